"""The traced model (:class:`TracedModel`) and closing a trace into it: outputs, declared
dynamic dims, the graph passes, initializers.

:func:`finish_trace` is :meth:`onnxparam.trace.tracer.Tracer.finish`'s body; :func:`baking_node` and
:func:`baked_message` explain a dim declared dynamic that the traced forward made a constant,
and :func:`check_batch_outputs` checks ``trace_module``'s ``dynamic_batch`` shorthand. The
tracer's own state (names, params, constants) stays in :class:`onnxparam.trace.tracer.Tracer`; this
module only reads and closes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import onnx
import onnx_ir as ir

from ..core.dtype import dtype_from_onnx_element
from ..core.errors import TraceError
from ..core.param import Param
from ..core.version import __version__
from .values import _axes_items, _dims_of_value

__all__ = ["TracedModel", "finish_trace", "baking_node", "baked_message", "check_batch_outputs"]


@dataclass(frozen=True, eq=False)
class TracedModel:
    """A traced forward: an ``onnx_ir.Model`` and what a runtime or exporter needs to know.

    Attributes:
        model: the ``onnx_ir.Model``. Param initializers are named by their module path and
            hold ``onnx_ir.LazyTensor`` s (materialized only when serialized); constants hold
            their data.
        input_names: the graph inputs, in ``forward``'s argument order.
        output_names: the graph outputs.
        param_paths: the initializer names that are params, in traversal order; params the
            forward does not use are absent.
        params: path -> the :class:`~onnxparam.Param` traced.
        mode: the LoRA mode (``"merge"``).
        single_output: ``forward`` returned one tensor (else a tuple / list).
    """

    model: ir.Model
    input_names: tuple
    output_names: tuple
    param_paths: tuple
    params: Mapping[str, Param] = field(repr=False)
    mode: str = "merge"
    single_output: bool = True
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def graph(self) -> ir.Graph:
        return self.model.graph

    @property
    def opset_imports(self) -> dict:
        return dict(self.model.graph.opset_imports)

    def input_types(self) -> list[tuple]:
        """``[(name, DType, shape), ...]`` of the graph inputs (dynamic dims as str / None)."""
        return [(v.name, dtype_from_onnx_element(int(v.dtype)), tuple(_dims_of_value(v))) for v in self.graph.inputs]

    def output_types(self) -> list[tuple]:
        """``[(name, DType, shape), ...]`` of the graph outputs (shape ``None``: an unknown rank)."""
        return [(v.name, dtype_from_onnx_element(int(v.dtype)), None if v.shape is None else tuple(_dims_of_value(v)))
                for v in self.graph.outputs]

    def to_proto(self) -> onnx.ModelProto:
        """The ``onnx.ModelProto`` with every initializer's data (runs lazy inits once each)."""
        return ir.to_proto(self.model)


def finish_trace(tracer, outputs, output_names: Optional[Sequence[str]] = None,
                 dynamic_axes: Optional[Mapping] = None, input_names: Sequence[str] = ()) -> TracedModel:
    """Close ``tracer``'s graph; see :meth:`onnxparam.trace.tracer.Tracer.finish`.

    Raises:
        TraceError: for a finished trace, outputs that are not tensors, clashing output names,
            or an output dim ``dynamic_axes`` declares dynamic that the forward made a constant.
    """
    if tracer._finished:
        raise TraceError("this trace is already finished")
    single = not isinstance(outputs, (tuple, list))
    outs = [outputs] if single else list(outputs)
    fresh: set = set()  # default names made unique here (unique_name registers them)
    if output_names is None:
        bases = ["output"] if single else [f"output_{i}" for i in range(len(outs))]
        output_names = [b if b not in tracer._names else tracer.unique_name(b) for b in bases]
        fresh = {n for n, b in zip(output_names, bases) if n != b}
    output_names = [str(n) for n in output_names]
    if len(output_names) != len(outs):
        raise TraceError(f"{len(output_names)} output names given for {len(outs)} outputs")
    for out, name in zip(outs, output_names):
        value = tracer._local_output(out, tracer.graph)
        if name != value.name:
            if name in tracer._names and name not in fresh:
                raise TraceError(f"output name {name!r} is already used (by a param path, input or node)")
            tracer._names.add(name)
            value.name = name
        tracer.graph.outputs.append(value)
    for name, axes in (dynamic_axes or {}).items():
        if isinstance(name, str) and name in output_names:
            index = output_names.index(name)
            value = tracer.graph.outputs[index]
            tracked = tracer.tensor_of(outs[index]).shape
            dims = list(_dims_of_value(value))
            for axis, dim in _axes_items(axes, name):
                if axis < len(tracked) and isinstance(tracked[axis], int):
                    raise TraceError(baked_message(value, axis, tracked[axis], dim, "dynamic_axes declares"))
                dims[axis] = dim
            value.shape = ir.Shape(dims)
    for rewrite in tracer.passes.finish:  # LoRA adapters as nodes (may add params), then QDQ
        rewrite(tracer)
    params = sorted(tracer._params, key=lambda p: (tracer._param_order.get(p, len(tracer._param_order)), p))
    for path in params:
        tracer.graph.register_initializer(tracer._param_values[path])
    for value in tracer._constants:
        tracer.graph.register_initializer(value)
    for domain, version in tracer.opset_imports.items():
        tracer.graph.opset_imports[domain] = version
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in tracer.opset_imports.items()]
    ir_version = max(onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True), 8)
    model = ir.Model(tracer.graph, ir_version=ir_version, producer_name="onnxparam", producer_version=__version__)
    tracer._finished = True
    return TracedModel(
        model=model,
        input_names=tuple(input_names) if input_names else tuple(v.name for v in tracer.graph.inputs),
        output_names=tuple(output_names),
        param_paths=tuple(params),
        params={p: tracer._params[p] for p in params},
        mode=tracer.mode,
        single_output=single,
    )




def baking_node(value: ir.Value) -> Optional[ir.Node]:
    """The node where a dynamic dim became a constant on the way to ``value``: walking back from
    ``value``'s producer, the nearest node whose output on the path has only static dims while
    one of its inputs has a dynamic dim (``Reshape`` to a constant shape, a broadcast with a
    constant ...), or ``None``."""
    seen, todo = set(), [value]
    while todo:
        current = todo.pop(0)
        node = current.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        static_out = all(isinstance(d, int) for d in _dims_of_value(current))
        inputs = [v for v in node.inputs if v is not None]
        if static_out and any(not all(isinstance(d, int) for d in _dims_of_value(v)) for v in inputs):
            return node
        todo.extend(inputs)
    return None


def baked_message(value: ir.Value, axis: int, size: int, dim, what: str) -> str:
    """The error text for a declared-dynamic dim of ``value`` that the forward made ``size``."""
    node = baking_node(value)
    where = (f" at node {node.name!r} ({node.op_type})" if node is not None else "")
    return (f"{what} dim {axis} of output {value.name!r} dynamic ({dim!r}), but the traced forward makes it the "
            f"constant {size}{where}: the graph would only work at that size. Compute the size from the input "
            "(x.shape[0], -1 in reshape) instead of a Python int, or leave the dim static")


def check_batch_outputs(traced: TracedModel, batch: str) -> None:
    """Every output's dim 0 is the batch (the ``dynamic_batch`` shorthand)."""
    for value in traced.graph.outputs:
        dims = _dims_of_value(value)
        if dims and dims[0] == batch:
            continue
        if dims and isinstance(dims[0], int):
            raise TraceError(baked_message(value, 0, dims[0], batch, "dynamic_batch declares"))
        got = "an unknown rank" if value.shape is None else "a scalar" if not dims else f"dim 0 {dims[0] or '?'!r}"
        raise TraceError(f"dynamic_batch declares dim 0 of every output the batch ({batch!r}), but output "
                         f"{value.name!r} has {got}; pass dynamic_axes for the dims that are dynamic instead")
