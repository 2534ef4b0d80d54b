"""Output ranks of imported nodes that neither the file nor ONNX shape inference gives (an ``If``
whose branches hold an ``LSTM``, a ``Split`` of computed sizes ...), for the trace path of an
imported module (:meth:`~onnxparam.onnx_io.OnnxModule.forward` inside another module's trace).

The graph is run once in ONNX Runtime on zeros of the trace's concrete input shapes, with every
main-graph value as an output: each value's element type and rank are what ONNX Runtime
computed (its dims stay unknown in the trace). Cached per imported model and input shapes; not
used when an input dim is symbolic.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_ir as ir

from ..core.dtype import DType

__all__ = ["probed_types"]


def _input_signature(source, env: dict) -> Optional[tuple]:
    sig = []
    for value in source.inputs:
        hit = env.get(id(value))
        if hit is None:
            return None
        tensor = hit[1]
        shape = getattr(tensor, "shape", None)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        sig.append((value.name, tuple(shape), tensor.dtype))
    return tuple(sig)


def _probe(source, sig: tuple) -> dict:
    """Value name -> ``(DType, rank)`` of every main-graph value ONNX Runtime computes."""
    from ..runtime._sessions import ort
    from ._graph_model import copy_model
    from ._source import proto_for_inference

    model = copy_model(source.loaded.model)
    graph = model.graph
    known = {v.name for v in graph.outputs}
    for node in graph:
        for value in node.outputs:
            if value.name and value.name not in known:
                graph.outputs.append(value)
                known.add(value.name)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto_for_inference(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feeds = {name: np.zeros(shape, dtype.to_numpy()) for name, shape, dtype in sig}
    names = [o.name for o in session.get_outputs()]
    found = {}
    for name, array in zip(names, session.run(names, feeds)):
        if isinstance(array, np.ndarray):
            try:
                found[name] = (DType.from_numpy(array.dtype), array.ndim)
            except ValueError:
                continue
    return found


def probed_types(source, node: ir.Node, count: int, env: dict) -> Optional[list]:
    """``[(DType, (None,) * rank)]`` of ``node``'s first ``count`` outputs from a probe run, or
    ``None`` (symbolic input dims, a failed probe, an output that is not a tensor)."""
    sig = _input_signature(source, env)
    if sig is None:
        return None
    key = ("probe", sig)
    table = source.cache.get(key)
    if table is None:
        try:
            table = _probe(source, sig)
        except Exception:  # noqa: BLE001 - the probe is a fallback; the caller reports the node
            table = {}
        source.cache[key] = table
    types = []
    for value in node.outputs[:count]:
        hit = table.get(value.name)
        if hit is None:
            return None
        types.append((hit[0], (None,) * hit[1]))
    return types
