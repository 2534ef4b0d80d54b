"""The graph of an imported model is the model: running and exporting it as it came in.

An :class:`~onnxparam.onnx_io.OnnxModule` keeps its source graph verbatim (``_SourceGraph.pristine``:
the model as loaded, before any importer rewrite). Two things are made from it here, each from a
shallow ``onnx_ir`` clone (nodes and values copied, tensors shared):

* **the session model** (:func:`session_parts`): what ``module(x)`` runs outside a trace. The
  graph is not traced: every node, value type, subgraph and function goes to ONNX Runtime as in
  the file, so nothing needs an operator schema, a known rank or a Burn dtype (ONNX Runtime
  infers what the file leaves unknown). Main-graph weights are injected as ``OrtValue`` s of the
  params' current values (``SessionOptions.add_external_initializers``), weights inside
  subgraphs / ``Constant`` nodes are written into the clone when they changed.
* **the export model** (:func:`export_model`): the same graph with the params' current values;
  an unmodified import comes back with the same nodes in the same order, names, attributes,
  opset imports, metadata, value infos and functions. A weight quantized in the module becomes
  ``DequantizeLinear(int weight, scale[, zero point])`` in front of its uses (the ONNX operator
  spec: DequantizeLinear-13/21; the zero point is zeros for signed codes, absent only when
  blocked); a LoRA adapter is merged into its weight.

What this cannot express returns ``None`` (the caller then traces ``forward``, as for any module):
a param that is not a weight of the source graph and no longer holds the source's value (a
weight only the importer's rewrites made, e.g. a re-quantized imported QDQ weight), LoRA
adapters exported or run in the ``"keep"`` / ``"inputs"`` modes, a quantized weight whose
scales ``DequantizeLinear`` cannot express at the model's opset.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_ir as ir

from ..core.errors import LoraError
from ..core.dtype import DType
from ..core.module import named_params
from ._source import iter_graphs
from ._value_info import drop_undeclared_initializer_types
from ._weights import INITIALIZER, find_weights, reads_as_shape, tensor_data

__all__ = ["source_sites", "session_parts", "export_model", "is_source_valued"]

_INJECTED_LOCATION = "onnxparam-injected-initializer"
"""External-data location of weights a session gets as injected ``OrtValue`` s (never read)."""


def source_sites(source) -> dict:
    """Module path -> :class:`~onnxparam.onnx_io._weights.WeightSite` in the pristine graph
    (computed once per imported model)."""
    sites = source.cache.get("pristine_sites")
    if sites is None:
        sites = {site.path: site for site in find_weights(source.pristine, source.loaded.source)}
        source.cache["pristine_sites"] = sites
    return sites


def is_source_valued(source, path: str, param) -> bool:
    """True when ``param`` still holds exactly the value imported at ``path`` (its lazy cell is the
    import's, no adapter)."""
    cell = source.cells.get(path)
    return (cell is not None and getattr(param, "_value", None) is None and getattr(param, "_cell", None) is cell
            and param.adapter() is None)


def copy_model(model: ir.Model) -> ir.Model:
    """A copy of ``model`` whose nodes and values are new and whose tensors are shared
    (``Model.clone``); a graph whose nodes are not in topological order (which ONNX forbids but
    ONNX Runtime runs) is copied through its protobuf instead."""
    try:
        return model.clone()
    except RuntimeError:
        from ._source import base_dir_of

        base = base_dir_of(model)
        copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        if base:
            ir.external_data.set_base_dir(copy.graph, base)
        from ._data_watch import carry_stamps

        carry_stamps(model, copy)
        return copy


def _parallel(src: ir.Graph, dst: ir.Graph) -> dict:
    """``id(source object) -> clone object`` for the graphs, initializers and nodes of a clone."""
    found = {}
    for gs, gd in zip(iter_graphs(src), iter_graphs(dst)):
        found[id(gs)] = gd
        for name, value in gs.initializers.items():
            found[id(value)] = gd.initializers[name]
        for ns, nd in zip(gs, gd):
            found[id(ns)] = nd
    return found


def _plan(module, lora: str) -> Optional[list]:
    """``[(site, param, how)]`` for the weights to write (``how``: ``"value"``, ``"source"``,
    ``"quantized"``), or ``None`` when the graph alone cannot express the module (module
    docstring)."""
    source = module._source
    sites = source_sites(source)
    plan = []
    params = list(named_params(module))
    factors = {id(f) for _, p in params if p.adapter() is not None for f in (p.adapter().a, p.adapter().b)}
    for path, param in params:
        if id(param) in factors:
            continue  # a LoRA factor: merged into its weight below
        site = sites.get(path)
        same = is_source_valued(source, path, param)
        if site is None:
            if same:
                continue  # a weight of the importer's rewrites, unchanged: the graph holds it
            return None
        dtype = param.lazy_dtype()
        if param.adapter() is not None and lora != "merge":
            if dtype is DType.QFloat or lora != "keep":
                return None  # QLoRA and "inputs" mode (factors as graph inputs): traced
            plan.append((site, param, "lora"))
            continue
        if same and dtype is not site.dtype:
            plan.append((site, param, "source"))  # an imported QDQ weight (int data, QFloat param)
        elif dtype is DType.QFloat:
            if not site.dtype.is_float or site.is_graph_input:
                return None
            plan.append((site, param, "quantized"))
        else:
            plan.append((site, param, "source" if same else "value"))
    return plan


def _array(site, param, how: str) -> np.ndarray:
    from ..trace.tracer import param_array

    if how == "source":
        return tensor_data(site.tensor, site.dtype).array
    if how == "lora":
        return param_array(param.with_adapter(None), site.dtype)  # the raw base: nodes add the adapter
    try:
        return param_array(param, site.dtype)
    except LoraError as e:  # an adapter that cannot be merged (a grouped conv's): name the weight
        raise LoraError(f"weight {site.name!r}: {e}") from e


class _Symbol:
    def __init__(self, value: ir.Value):
        self.value = value


class _Emitted:
    """What :class:`onnxparam.lora._graph._Expander` reads of a traced tensor."""

    def __init__(self, value: ir.Value, dtype: DType):
        self._symbol = _Symbol(value)
        self.dtype = dtype


class _LoraEmitter:
    """The part of a tracer :class:`onnxparam.lora._graph._Expander` uses, over an export clone:
    nodes go into the weight's own graph, factors and scales become main-graph initializers
    named ``<weight>.lora.a`` / ``.lora.b`` (what :mod:`onnxparam.onnx_io._lora_import` recognizes)."""

    def __init__(self, main: ir.Graph, graph: ir.Graph, site, param, taken: set, lora: str, written: dict):
        self.graph = graph
        self.main = main
        self.mode = lora
        self.taken = taken
        self.site = site
        self.written = written
        self._param_paths = {id(param): site.name}
        self._names = taken
        self._constants: list = []
        self.factor_values = []

    def unique_name(self, name: str) -> str:
        return _unique(self.taken, name)

    def _initializer(self, name: str, tensor, dtype: ir.DataType, shape) -> ir.Value:
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(shape)), const_value=tensor)
        self.main.register_initializer(value)
        return value

    def param_value(self, factor) -> _Emitted:
        from ..trace.tracer import param_array

        which = "a" if self._adapter().a is factor else "b"
        name = self.unique_name(f"{self.site.name}.lora.{which}")
        dtype = factor.lazy_dtype()
        onnx_dtype = ir.DataType(dtype.to_onnx())
        tensor = ir.LazyTensor(lambda _f=factor, _d=dtype: ir.tensor(param_array(_f, _d)), onnx_dtype,
                               ir.Shape(list(factor.lazy_shape())), name=name)
        value = self._initializer(name, tensor, onnx_dtype, factor.lazy_shape())
        self.factor_values.append(value)
        self.written[name] = (f"{self.site.path}.lora.{which}", factor, tensor, float(self._adapter().scale))
        return _Emitted(value, dtype)

    def constant(self, array, name: str) -> _Emitted:
        array = np.asarray(array)
        name = self.unique_name(name)
        tensor = ir.Tensor(array, name=name)
        return _Emitted(self._initializer(name, tensor, tensor.dtype, array.shape), DType.from_numpy(array.dtype))

    def _adapter(self):
        return self._param.adapter()


def _expand_lora(clone: ir.Model, clone_map: dict, site, param, taken: set, lora: str, written: dict) -> None:
    """Emit ``param``'s adapter at every use of its weight (``"keep"`` / ``"inputs"``: the nodes
    :mod:`onnxparam.lora._graph` writes for a traced module)."""
    from ..lora._graph import _Expander

    graph = clone_map[id(site.graph)]
    base = clone_map[id(site.value)] if site.kind == INITIALIZER else clone_map[id(site.node)].outputs[0]
    if base.shape is None or base.type is None:  # a Constant's output the file left undeclared
        base.type = ir.TensorType(site.tensor.dtype)
        base.shape = ir.Shape(list(param.lazy_shape()))
    emitter = _LoraEmitter(clone.graph, graph, site, param, taken, lora, written)
    emitter._param = param
    _Expander(emitter, param, base, site.dtype).expand()



def _set_weight(clone_map: dict, site, tensor) -> None:
    """Put ``tensor`` where the clone holds ``site``'s data."""
    if site.kind == INITIALIZER:
        value = clone_map[id(site.value)]
        value.const_value = tensor
    else:
        node = clone_map[id(site.node)]
        node.attributes["value"] = ir.AttrTensor("value", tensor)
        value = node.outputs[0]
    _keep_shape(value, tensor.shape)


def _keep_shape(value: ir.Value, shape) -> None:
    """A value's declared shape follows a weight whose shape changed (else it is left alone:
    declaring shapes the file did not declare would change its value infos)."""
    dims = [int(d) for d in shape]
    if value.shape is not None and list(value.shape) != dims:
        value.shape = ir.Shape(dims)


# -- sessions ---------------------------------------------------------------------------------


def _used(value: ir.Value) -> bool:
    """ONNX Runtime drops initializers nothing uses before it takes injected values."""
    return bool(value.uses()) or value.is_graph_output()


def session_parts(module) -> Optional[tuple]:
    """``(model bytes, injected names, injected arrays)`` of the session that runs ``module`` (its
    source graph with its params' values), or ``None`` (module docstring)."""
    source = module._source
    plan = _plan(module, "merge")
    if plan is None:
        return None
    if any(how == "quantized" for _, _, how in plan):
        plan = [(s, p, "value" if how == "quantized" else how) for s, p, how in plan]  # dequantized values
    clone = copy_model(source.pristine)
    clone_map = _parallel(source.pristine.graph, clone.graph)
    main = clone.graph
    names, arrays = [], []
    for site, param, how in plan:
        array = np.ascontiguousarray(_array(site, param, how))
        value = clone_map.get(id(site.value)) if site.kind == INITIALIZER else None
        if value is not None and site.graph is source.pristine.graph and _used(value):
            names.append(value.name)
            arrays.append(array)
            value.const_value = ir.ExternalTensor(_INJECTED_LOCATION, 0, int(array.nbytes), site.tensor.dtype,
                                                  shape=ir.Shape(list(array.shape)), name=value.name)
            _keep_shape(value, array.shape)
        elif how != "source":
            _set_weight(clone_map, site, ir.tensor(array, dtype=site.tensor.dtype))
    injected = set(names)
    for graph in iter_graphs(main):
        for name, value in graph.initializers.items():
            const = value.const_value
            if not isinstance(const, ir.ExternalTensor) or name in injected and graph is main:
                continue
            array = np.ascontiguousarray(const.numpy())  # file data ORT would look for beside no file
            if (graph is main and array.dtype.kind in "biuf" and array.dtype.names is None and _used(value)
                    and not reads_as_shape(value)):  # shape data: ORT's shape inference reads it
                names.append(name)
                arrays.append(array)
                value.const_value = ir.ExternalTensor(_INJECTED_LOCATION, 0, int(array.nbytes), const.dtype,
                                                      shape=const.shape, name=name)
            else:
                value.const_value = ir.Tensor(array, dtype=const.dtype, name=name)
    return ir.to_proto(clone).SerializeToString(), names, arrays


# -- export -----------------------------------------------------------------------------------


def _all_names(model: ir.Model) -> set:
    names = set()
    for graph in iter_graphs(model.graph):
        for v in list(graph.inputs) + list(graph.initializers.values()) + [o for n in graph for o in n.outputs]:
            if v.name:
                names.add(v.name)
    return names


def _unique(taken: set, name: str) -> str:
    out, k = name, 1
    while out in taken:
        out, k = f"{name}__{k}", k + 1
    taken.add(out)
    return out


def _quantize_site(clone: ir.Model, clone_map: dict, site, param, taken: set, opset: int) -> Optional[ir.Tensor]:
    """Replace the float weight of ``site`` by ``DequantizeLinear(int weight, scale[, zero
    point])`` (zeros for signed codes unless blocked; the int initializer keeps the weight's
    name, so a re-import finds the same param).
    Returns the int tensor (for metadata), or ``None`` when ONNX cannot express the scales."""
    from ..quant import _qdq as qdq
    from ..quant._qdq_layout import weight_layout

    qt = qdq._quantized_of(param)
    axis_ok = opset >= 13
    layout = weight_layout(qt, opset)
    if layout is None or opset < 10 or (layout.axis is not None and not axis_ok):
        return None
    graph = clone_map[id(site.graph)]
    name = site.name
    if site.kind == INITIALIZER:
        old = clone_map[id(site.value)]
        anchor = None
    else:
        anchor = clone_map[id(site.node)]
        old = anchor.outputs[0]
    shape = ir.Shape(list(qt.shape))
    values = ir.LazyTensor(lambda _l=layout, _n=name: ir.Tensor(_l.values, dtype=_l.onnx_dtype, name=_n),
                           layout.onnx_dtype, shape, name=name)
    values.metadata_props.update(qdq._scheme_props(qt))
    inputs = []
    # NOTE: a zero point even for signed codes (zeros) unless blocked: qdq.explicit_zero_points says why
    zero_point = layout.zero_point if layout.block_size is not None else qdq.zero_point_array(layout)
    for suffix, data, dtype in (("", None, layout.onnx_dtype), ("_scale", layout.scale, ir.DataType.FLOAT),
                                ("_zero_point", zero_point, layout.onnx_dtype)):
        if suffix and data is None:
            continue
        vname = name if not suffix else _unique(taken, name + suffix)
        tensor = values if not suffix else ir.Tensor(np.asarray(data), dtype=dtype, name=vname)
        value = ir.Value(name=vname, type=ir.TensorType(dtype), shape=ir.Shape(list(tensor.shape)), const_value=tensor)
        inputs.append(value)
    attrs = []
    if layout.axis is not None:
        attrs.append(ir.AttrInt64("axis", int(layout.axis)))
    if layout.block_size is not None:
        attrs.append(ir.AttrInt64("block_size", int(layout.block_size)))
    dq = ir.Node("", "DequantizeLinear", inputs, attrs, name=_unique(taken, f"{name}/DequantizeLinear"))
    out = dq.outputs[0]
    out.name = _unique(taken, f"{name}_dequantized")
    out.type, out.shape = ir.TensorType(ir.DataType.FLOAT), shape
    nodes = [dq]
    if site.dtype is not DType.F32:
        cast = ir.Node("", "Cast", [out], [ir.AttrInt64("to", int(site.tensor.dtype))],
                       name=_unique(taken, f"{name}/Cast"))
        out = cast.outputs[0]
        out.name = _unique(taken, f"{name}_cast")
        out.type, out.shape = ir.TensorType(site.tensor.dtype), shape
        nodes.append(cast)
    if anchor is not None:
        graph.insert_after(anchor, nodes)
        old.name = None
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        graph.remove(anchor, safe=True)
    else:
        graph.initializers.pop(name)
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        if len(graph):
            graph.insert_before(graph[0], nodes)
        else:
            graph.extend(nodes)
    for value in inputs:
        graph.register_initializer(value)
    return values


def export_model(module, lora: str, input_names=None, output_names=None) -> Optional[tuple]:
    """``(model, {initializer name: (path, param, tensor, LoRA scale or None)})``: the source graph with the module's
    weights (module docstring), or ``None`` when the graph alone cannot express the module."""
    from ._data_watch import check_source

    source = module._source
    check_source(source)  # a data file changed since import: its bytes are not the imported weights
    plan = _plan(module, lora)
    if plan is None:
        return None
    clone = copy_model(source.pristine)
    clone_map = _parallel(source.pristine.graph, clone.graph)
    opset = int(source.opsets.get("", 1))
    taken = _all_names(clone)
    written = {}
    for site, param, how in plan:
        if how == "quantized":
            tensor = _quantize_site(clone, clone_map, site, param, taken, opset)
            if tensor is None:
                return None
        elif how == "lora":
            shape = ir.Shape(list(param.lazy_shape()))
            tensor = ir.LazyTensor(lambda _s=site, _p=param: ir.tensor(_array(_s, _p, "lora"), dtype=_s.tensor.dtype),
                                   site.tensor.dtype, shape, name=site.name)
            _set_weight(clone_map, site, tensor)
            _expand_lora(clone, clone_map, site, param, taken, lora, written)
        elif how == "source":
            tensor = ir.LazyTensor(lambda _t=site.tensor: _t, site.tensor.dtype, site.tensor.shape, name=site.name)
            _set_weight(clone_map, site, tensor)
        else:
            shape = ir.Shape(list(param.lazy_shape()))
            tensor = ir.LazyTensor(lambda _s=site, _p=param: ir.tensor(_array(_s, _p, "value"), dtype=_s.tensor.dtype),
                                   site.tensor.dtype, shape, name=site.name)
            _set_weight(clone_map, site, tensor)
        written[site.name] = (site.path, param, tensor, None)
    graph = clone.graph
    for values, names in ((graph.inputs, input_names), (graph.outputs, output_names)):
        if names is None:
            continue
        wanted = [v for v in values if not v.is_initializer()] if values is graph.inputs else list(values)
        if len(names) != len(wanted):
            raise TypeError(f"{len(names)} names given for {len(wanted)} graph "
                            f"{'inputs' if values is graph.inputs else 'outputs'}")
        for v, name in zip(wanted, names):
            v.name = str(name)
    drop_undeclared_initializer_types(zip(iter_graphs(source.pristine.graph), iter_graphs(clone.graph)))
    return clone, written


def apply_example_shapes(model: ir.Model, shapes: list) -> None:
    """Give the graph inputs the example inputs' shapes (an export for examples with
    ``dynamic_axes``: the examples fix every other dim)."""
    inputs = [v for v in model.graph.inputs if not v.is_initializer()]
    for value, shape in zip(inputs, shapes):
        if shape is not None and (value.shape is None or len(value.shape) == len(shape)):
            value.shape = ir.Shape([int(d) if isinstance(d, (int, np.integer)) else d for d in shape])


def apply_dynamic_axes(model: ir.Model, dynamic_axes) -> None:
    """Name the dims listed in ``dynamic_axes`` (``{name or input index: {axis: dim} | [axis]}``)."""
    from collections.abc import Mapping

    graph = model.graph
    inputs = [v for v in graph.inputs if not v.is_initializer()]
    by_name = {v.name: v for v in list(graph.inputs) + list(graph.outputs)}
    for key, axes in (dynamic_axes or {}).items():
        value = inputs[key] if isinstance(key, int) else by_name.get(key)
        if value is None or value.shape is None:
            continue
        dims = [d if isinstance(d, int) else d.value for d in value.shape]
        items = ([(int(a), None if d is None else str(d)) for a, d in axes.items()] if isinstance(axes, Mapping)
                 else [(int(a), f"{value.name}_dim_{int(a)}") for a in axes])
        for axis, dim in items:
            dims[axis] = dim
        value.shape = ir.Shape(dims)

