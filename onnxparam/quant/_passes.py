"""The standard graph passes of a trace: LoRA adapters, then QDQ.

The tracer (:mod:`onnxparam.trace.tracer`) imports no pass; its callers give it these: the
exporter, the training graphs, and the runtime (through the executor the top layer builds,
:mod:`onnxparam._assembly`). :func:`trace_module` is the tracer's ``trace_module`` with them.
"""

from __future__ import annotations

from ..lora import _batched as lora_batched
from ..lora import _batched_run as lora_batched_run
from ..lora import _graph as lora_graph
from ..lora import _trace_keys as lora_keys
from ..trace import tracer as _tracer
from ..trace.passes import GraphPasses
from . import _qdq as qdq
from . import _qdq_options as options

__all__ = ["STANDARD_PASSES", "trace_module"]

STANDARD_PASSES = GraphPasses(
    held_param=lora_graph.initializer_param,
    quantized_param=qdq.quantized_param_value,
    # NOTE: LoRA's adapters are emitted first: the QDQ fusion rewrites the uses of weights
    finish=(lora_graph.expand_adapters, lora_batched.expand_batched, qdq.finish_graph),
    fed_input_names=lora_graph.factor_input_names,
    fed_inputs=lora_graph.fed_factors,
    options=options._OPTIONS.get,
    call_options=options.runtime_options,
    with_options=options.qdq_options,
    is_pass_initializer=qdq.is_qdq_initializer,
    keyword_calls=((lora_batched.INDEX_INPUT, lora_batched_run.call_batched),),
    untraced_attrs=lora_keys.UNTRACED_ATTRS,
    structure_key=lora_keys.structure_key,
)


def trace_module(module, inputs=(), *, passes: GraphPasses = STANDARD_PASSES, **kwargs):
    """:func:`onnxparam.trace.tracer.trace_module` with the standard passes (LoRA, then QDQ)."""
    return _tracer.trace_module(module, inputs, passes=passes, **kwargs)
