"""The standard graph passes of a trace (graph layer): LoRA adapters, then QDQ.

The tracer (:mod:`onnxparam._trace`) imports no pass; its callers give it these (the package
``__init__`` registers them as the default, service ``"trace.passes"``).
"""

from . import _lora_batched as lora_batched
from . import _lora_graph as lora_graph
from ._trace import GraphPasses
from .quant import _qdq as qdq

__all__ = ["STANDARD_PASSES"]

STANDARD_PASSES = GraphPasses(
    held_param=lora_graph.initializer_param,
    quantized_param=qdq.quantized_param_value,
    # NOTE: LoRA's adapters are emitted first: the QDQ fusion rewrites the uses of weights
    finish=(lora_graph.expand_adapters, lora_batched.expand_batched, qdq.finish_graph),
)
