"""The inputs of an imported graph inlined into a trace, typed as the file declares them.

ONNX Runtime infers the types of *every* branch of an ``If`` (and every ``Loop`` / ``Scan``
body) when it builds a session, also of branches a run never takes. Some exporters write
control flow that is only valid while a dim stays unknown: silero-vad's encoder branches on the
batch size and squeezes that dim in the branch for batch 1, so the file with ``input``
declared ``[1, 512]`` instead of ``[?, ?]`` fails in ONNX Runtime itself ("LSTM: first input
tensor must have rank 3", "Squeeze: dimension of input 2 must be 1 instead of 2"). A trace
knows concrete shapes, and ONNX Runtime folds shapes it knows (``Shape`` of a static tensor
becomes a constant), so the imported graph must see its inputs as the file types them.

The boundary is a one-iteration ``Loop`` carrying the value: ONNX's ``Loop`` inference clears
the shape of loop-carried values ("the shape may change across iterations"; ONNX operator
spec: Loop-16, and ``LoopInferenceFunction`` in onnx/defs/controlflow), so nothing downstream
sees the trace's dims, and ONNX Runtime cannot fold it. Its output is declared with the file's
element type and rank (its dims unknown). The Python tensor keeps the trace's shape.

It is put only where it is needed: for graphs that hold control flow (a graph attribute at
any depth), on inputs whose traced dims are more specific than the declared ones.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_ir as ir

from ..core.dtype import DType
from ..core.tensor import Tensor
from ._source import iter_graphs

__all__ = ["declared_inputs", "declared_view", "has_control_flow"]


def has_control_flow(graph: ir.Graph) -> bool:
    """True when a node of ``graph`` (at any depth) has a graph attribute."""
    graphs = iter_graphs(graph)
    next(graphs)  # the graph itself
    return next(graphs, None) is not None


def _declared(value: ir.Value) -> Optional[tuple]:
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) and d >= 0 else None for d in value.shape)


def _more_specific(traced: tuple, declared: Optional[tuple]) -> bool:
    if declared is None:
        return True
    if len(declared) != len(traced):
        return False  # a wrong rank: the call's own checks report it
    return any(isinstance(t, int) and d is None for t, d in zip(traced, declared))


def declared_view(tracer, x, value: ir.Value):
    """``x`` (the traced value bound to the graph input ``value``) behind the boundary (module
    docstring), or ``x`` itself when the trace's dims say nothing the file does not.

    Args:
        tracer: the active tracer.
        x: a symbolic :class:`~onnxparam.Tensor` of any shape and dtype.
        value: the imported graph's input it is bound to.

    Returns:
        a symbolic tensor with ``x``'s values and Python shape whose ONNX type has the file's
        element type and rank and unknown dims.
    """
    if not isinstance(x, Tensor) or not x.is_symbolic or not x.rank_known \
            or not _more_specific(tuple(x.shape), _declared(value)):
        return x  # (a value of unknown rank says nothing the file does not)
    from ..trace.tracer import InputSpec

    body = tracer.subgraph(lambda i, cond, v: (cond, v),
                           [InputSpec((), DType.I64), InputSpec((), DType.Bool), InputSpec(tuple(x.shape), x.dtype)],
                           name="declared_type")
    # NOTE: a body input declaring the trace's shape would be merged back in by the inferencer
    carried = body.inputs[2]
    carried.shape = None
    body.outputs[1].shape = None
    out = tracer.emit("Loop", [np.array(1, np.int64), np.array(True), x], {"body": body},
                      output_types=[(x.dtype, tuple(x.shape))], name="declared_type")[0]
    declared = _declared(value)
    out._symbol.value.shape = None if declared is None else ir.Shape(list(declared))
    return out


def declared_inputs(source, bound: dict) -> dict:
    """``bound`` (graph input name -> value) with each input of a graph that holds control flow
    behind :func:`declared_view`; unchanged for other graphs or outside a trace."""
    from ..trace import tracer as tr

    tracer = tr.current_tracer()
    graph = source.loaded.model.graph
    if tracer is None or not has_control_flow(graph):
        return bound
    declared = {v.name: v for v in source.inputs}
    return {name: declared_view(tracer, x, declared[name]) if name in declared else x for name, x in bound.items()}
