"""Recognizing LoRA adapters in an imported ONNX graph (the shapes :mod:`onnxparam.lora._graph`
exports), removing them from the graph and attaching them to the imported module. The layouts of
an imported graph's weights and its tables (embeddings, position tables, tied projections) are
read in :mod:`onnxparam.lora._layouts` and :mod:`onnxparam.lora._tables`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx_ir as ir

from ..core.param import Param
from ..lora._graph import FACTOR_SUFFIXES, _attr_float, _attr_int

__all__ = ["ImportedAdapter", "strip_lora_subexpressions", "strip_imported", "attach_imported",
           "has_lora_factors"]


@dataclass(frozen=True)
class ImportedAdapter:
    """An adapter found in an imported graph: the base weight's ONNX name, the factors'
    initializer values (their tensors and metadata stay on the values), scale, layout."""

    base_name: str
    a: ir.Value
    b: ir.Value
    scale: float
    transposed: bool


def _producer(value: Optional[ir.Value], op: str) -> Optional[ir.Node]:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None


def _scalar(value: ir.Value) -> Optional[float]:
    const = value.const_value
    if const is None:
        producer = _producer(value, "Constant")
        if producer is None or "value" not in producer.attributes:
            return None
        const = producer.attributes["value"].value
    array = np.asarray(const.numpy())
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _factor(value: Optional[ir.Value], factors: dict, which: str) -> Optional[tuple]:
    """``(factor, coefficient, [nodes])`` when ``value`` is factor ``which`` (``"a"`` / ``"b"``)
    itself or ``Mul(factor, s)`` / ``Mul(s, factor)`` with a scalar ``s`` (the kept export's
    ``scale * b``)."""
    if value is None:
        return None
    if factors.get(value.name, (None, None))[1] == which:
        return value, 1.0, []
    mul = _producer(value, "Mul")
    if mul is not None and len(mul.inputs) == 2:
        for first, second in ((0, 1), (1, 0)):
            factor, other = mul.inputs[first], mul.inputs[second]
            if factor is not None and other is not None and factors.get(factor.name, (None, None))[1] == which:
                coefficient = _scalar(other)
                if coefficient is not None:
                    return factor, coefficient, [mul]
    return None


def _scaled_outputs(out: ir.Value) -> list:
    """``[(value, coefficient, [nodes])]``: ``out`` itself, and when ``out = Mul(v, s)`` with a
    scalar ``s`` (older kept exports scale the branch's output), ``v`` with ``s``."""
    found = [(out, 1.0, [])]
    mul = _producer(out, "Mul")
    if mul is not None and len(mul.inputs) == 2:
        for first, second in ((0, 1), (1, 0)):
            if mul.inputs[first] is not None and mul.inputs[second] is not None:
                coefficient = _scalar(mul.inputs[second])
                if coefficient is not None:
                    found.append((mul.inputs[first], coefficient, [mul]))
    return found


def _lora_chain(out: ir.Value, factors: dict) -> Optional[tuple]:
    """``(x, a, b, coefficient, [nodes])`` when ``out = MatMul(MatMul(x, a), s * b)`` (the kept
    export), ``MatMul(MatMul(x, a), b)`` (``"inputs"``: the scale is in the fed ``b``) or
    ``Mul(MatMul(MatMul(x, a), b), s)`` (older kept exports), with ``a`` / ``b`` factor
    initializers of one base (``factors``: value name -> (base, "a"|"b"))."""
    for value, outer, outer_nodes in _scaled_outputs(out):
        mm_b = _producer(value, "MatMul")
        if mm_b is None:
            continue
        b_found = _factor(mm_b.inputs[1], factors, "b")
        mm_a = _producer(mm_b.inputs[0], "MatMul")
        if b_found is None or mm_a is None:
            continue
        b, coefficient, b_nodes = b_found
        a = mm_a.inputs[1]
        if a is None or factors.get(a.name, (None, None))[1] != "a" or factors[a.name][0] != factors[b.name][0]:
            continue
        return mm_a.inputs[0], a, b, outer * coefficient, b_nodes + [mm_a, mm_b] + outer_nodes
    return None


def _merged_chain(out: ir.Value, factors: dict) -> Optional[tuple]:
    """``(a, b, coefficient, transposed, [nodes])`` when ``out`` is ``MatMul(a, s * b)`` (or one
    of the other scalings of :func:`_lora_chain`), optionally ``Transpose``-d (a transposed
    adapter) or ``Reshape``-d (a bias's adapter)."""
    transpose = _producer(out, "Transpose")
    wrapper = transpose or _producer(out, "Reshape")
    inner = wrapper.inputs[0] if wrapper is not None else out
    for value, outer, outer_nodes in _scaled_outputs(inner):
        mm = _producer(value, "MatMul")
        if mm is None:
            continue
        b_found = _factor(mm.inputs[1], factors, "b")
        a = mm.inputs[0]
        if b_found is None or a is None or factors.get(a.name, (None, None))[1] != "a":
            continue
        b, coefficient, b_nodes = b_found
        if factors[a.name][0] == factors[b.name][0]:
            nodes = b_nodes + [mm] + outer_nodes + ([wrapper] if wrapper is not None else [])
            return a, b, outer * coefficient, transpose is not None, nodes
    return None


def _grouped_chain(out: ir.Value, factors: dict) -> Optional[tuple]:
    """``(x, conv, a, b, coefficient, [nodes])`` when ``out`` is a grouped convolution's kept
    branch (:meth:`onnxparam.lora._graph._Expander.grouped_conv`)::

        Reshape(MatMul(Transpose(s * b) [* mask], Reshape(Conv(x, Reshape(Transpose(a), shape)), flat)), Shape(y))

    or, with dynamic spatial dims, channels-last between Transposes::

        Transpose(MatMul(Transpose(Conv(x, ...)), Transpose(Transpose(s * b) [* mask])))
    """
    back = _producer(out, "Reshape")
    if back is not None:
        mm = _producer(back.inputs[0], "MatMul")
        if mm is None or len(mm.inputs) != 2:
            return None
        b_side, flat = mm.inputs[0], _producer(mm.inputs[1], "Reshape")
        shape_y = _producer(back.inputs[1], "Shape")
        tail = [mm] + ([shape_y] if shape_y is not None else []) + [back]
    else:
        flip_y = _producer(out, "Transpose")
        mm = _producer(flip_y.inputs[0], "MatMul") if flip_y is not None else None
        if mm is None or len(mm.inputs) != 2:
            return None
        flip_bt = _producer(mm.inputs[1], "Transpose")
        flat = _producer(mm.inputs[0], "Transpose")  # channels last
        if flip_bt is None:
            return None
        b_side = flip_bt.inputs[0]
        tail = [flip_bt, mm, flip_y]
    masked, mask_nodes = b_side, []
    mul = _producer(masked, "Mul")
    if mul is not None and len(mul.inputs) == 2 and mul.inputs[1] is not None \
            and mul.inputs[1].name.endswith(".lora.group_mask"):
        masked, mask_nodes = mul.inputs[0], [mul]
    flip_b = _producer(masked, "Transpose")
    b_found = _factor(flip_b.inputs[0], factors, "b") if flip_b is not None else None
    conv = _producer(flat.inputs[0], "Conv") if flat is not None else None
    shaped = _producer(conv.inputs[1], "Reshape") if conv is not None and len(conv.inputs) == 2 else None
    flip_a = _producer(shaped.inputs[0], "Transpose") if shaped is not None else None
    if b_found is None or flip_a is None:
        return None
    a, (b, coefficient, b_nodes) = flip_a.inputs[0], b_found
    if a is None or factors.get(a.name, (None, None))[1] != "a" or factors[a.name][0] != factors[b.name][0]:
        return None
    nodes = b_nodes + [flip_b] + mask_nodes + [flip_a, shaped, conv, flat] + tail
    return conv.inputs[0], conv, a, b, coefficient, nodes


def _remove_if_unused(nodes: list) -> None:
    """Remove ``nodes`` (producers before consumers) that nothing uses any more, and the scalar
    initializers they alone read (the kept export's ``<W>.lora.scale``; the int64 shapes of a
    grouped convolution's branch, ``lora.``-named)."""
    for node in reversed(nodes):
        if node.graph is not None and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph = node.graph
            inputs = [v for v in node.inputs if v is not None]
            graph.remove(node, safe=True)
            for value in inputs:
                lora_constant = value.name.endswith((".lora.scale", ".lora.group_mask")) or (
                    "lora." in value.name and value.dtype == ir.DataType.INT64)
                if (value.is_initializer() and not value.uses() and value not in graph.inputs
                        and not value.is_graph_output() and lora_constant
                        and graph.initializers.get(value.name) is value):
                    graph.initializers.pop(value.name)


def strip_lora_subexpressions(model: ir.Model, scales: dict) -> list:
    """Remove the LoRA nodes an onnxparam ``"keep"`` / ``"inputs"`` export wrote (module
    docstring) from ``model`` (changed in place) and return the adapters found.

    Args:
        model: the model being imported (its main graph; factors are main-graph initializers).
        scales: factor initializer name -> the ``onnxparam.lora.scale`` recorded in metadata.

    A factor pair whose nodes do not match the patterns is left in the graph (the model keeps
    computing what it computed; the factors import as plain params).
    """
    graph = model.graph
    factors = _factor_names(graph)
    if not factors:
        return []
    found: dict = {}
    for node in list(graph.all_nodes()):
        if node.graph is None or node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        for keep, other in ((0, 1), (1, 0)):
            y, branch = node.inputs[keep], node.inputs[other]
            if y is None or branch is None:
                continue
            chain = _lora_chain(branch, factors)
            if chain is not None:
                x, a, b, coefficient, nodes = chain
                base = _producer(y, "MatMul") or _producer(y, "Gemm")
                if base is None or base.inputs[0] is not x or base.inputs[1] is None:
                    continue
                weight = base.inputs[1]
                flip = _producer(weight, "Transpose") if base.op_type == "MatMul" else None
                if flip is not None:  # Transpose(W) -> MatMul: W stored (d_out, d_in)
                    weight = flip.inputs[0]
                if weight is None or weight.name != factors[a.name][0]:
                    continue
                transposed = flip is not None or (base.op_type == "Gemm" and _attr_int(base, "transB", 0) == 1)
                if base.op_type == "Gemm":
                    coefficient /= _attr_float(base, "alpha", 1.0)
                _strip(node, y, nodes)
                found.setdefault(factors[a.name][0], (a, b, coefficient, transposed))
                break
            grouped = _grouped_chain(branch, factors)
            if grouped is not None:
                x, conv, a, b, coefficient, nodes = grouped
                base = _producer(y, "Conv")
                if base is None or base.inputs[0] is not x or base.inputs[1] is None \
                        or base.inputs[1].name != factors[a.name][0]:
                    continue
                _strip(node, y, nodes)
                found.setdefault(factors[a.name][0], (a, b, coefficient, True))
                break
            merged = _merged_chain(branch, factors)
            if merged is not None and y.is_initializer() and y.name == factors[merged[0].name][0]:
                a, b, coefficient, transposed, nodes = merged
                _strip(node, y, nodes)
                found.setdefault(y.name, (a, b, coefficient, transposed))
                break
    adapters = []
    for base_name, (a, b, coefficient, transposed) in found.items():
        if a.uses() or b.uses():
            continue  # used elsewhere too: keep them as plain params
        scale = scales.get(a.name, scales.get(b.name, coefficient))
        for value in (a, b):
            graph.initializers.pop(value.name, None)
            if value in graph.inputs:
                graph.inputs.remove(value)
        if 0 in _shape(a) or 0 in _shape(b):
            continue  # an "inputs" export's zero-rank defaults: no adapter, the base model
        adapters.append(ImportedAdapter(base_name, a, b, float(scale), transposed))
    return adapters


def _shape(value: ir.Value) -> tuple:
    const = value.const_value
    return tuple(const.shape.numpy()) if const is not None else ()


def _factor_names(graph: ir.Graph) -> dict:
    """Factor initializer name -> (base initializer name, "a" | "b"). The base is the
    initializer named by the factor's prefix, or (an imported model re-exported) whose module
    path is that prefix."""
    from ._naming import onnx_name_to_path

    names = list(graph.initializers)
    by_path = None
    factors = {}
    for name in names:
        for suffix, which in ((".lora.a", "a"), (".lora.b", "b")):
            if not name.endswith(suffix):
                continue
            prefix = name[: -len(suffix)]
            if prefix in graph.initializers:
                factors[name] = (prefix, which)
                continue
            if by_path is None:
                by_path = {}
                for other in names:
                    try:
                        by_path.setdefault(onnx_name_to_path(other), other)
                    except Exception:  # a name the path escaping rejects: not a base
                        pass
            if prefix in by_path:
                factors[name] = (by_path[prefix], which)
    return factors


def has_lora_factors(model: ir.Model) -> bool:
    """True when ``model``'s main graph holds LoRA factor initializers (cheap: names only)."""
    return any(name.endswith(FACTOR_SUFFIXES) for name in model.graph.initializers)


def strip_imported(loaded):
    """``(loaded, adapters)``: for a model with LoRA factors, a copy of the loaded model
    (``onnx_io.source.LoadedModel``; the caller's model is never changed) without its LoRA
    nodes and factor initializers, and the :class:`ImportedAdapter` s removed; else
    ``(loaded, [])``. Used by :func:`onnxparam.import_onnx`."""
    if not has_lora_factors(loaded.model):
        return loaded, []
    from . import _metadata as md
    from ._source import LoadedModel, base_dir_of

    base = base_dir_of(loaded.model)
    model = ir.serde.deserialize_model(ir.serde.serialize_model(loaded.model))
    if base:
        ir.external_data.set_base_dir(model.graph, base)
    props = {name: dict(v.const_value.metadata_props) for name, v in model.graph.initializers.items()
             if name.endswith(FACTOR_SUFFIXES) and v.const_value is not None and v.const_value.metadata_props}
    metas = md.read_params(model.metadata_props, props, loaded.source)
    scales = {name: meta.lora_scale for name, meta in metas.items() if meta.lora_scale is not None}
    before = len(model.graph.initializers)
    adapters = strip_lora_subexpressions(model, scales)
    if not adapters and len(model.graph.initializers) == before:
        return loaded, []
    return LoadedModel(model, loaded.source, loaded.path), [(adapter, metas) for adapter in adapters]


def attach_imported(module, found: list):
    """``module`` (an imported ``OnnxModule``) with the adapters :func:`strip_imported` found
    attached to their bases: lazy factor params with the ids and flags ONNX metadata records."""
    if not found:
        return module
    from ..core.module import rebuild
    from ..core.param import ParamId
    from ..core.tensor import Tensor
    from ..lora._adapters import LoraAdapter
    from . import _metadata as md
    from ._naming import onnx_name_to_path
    from ._weights import burn_dtype, tensor_data

    def factor(value: ir.Value, metas: dict) -> Param:
        meta = metas.get(value.name, md.ParamMetadata())
        dtype = burn_dtype(value.dtype)
        tensor = value.const_value

        def init(device, require_grad, _tensor=tensor, _dtype=dtype):
            return Tensor.from_data(tensor_data(_tensor, _dtype), device)

        pid = meta.param_id if meta.param_id is not None else ParamId()
        grad = meta.require_grad if meta.require_grad is not None else True
        return Param.uninitialized(pid, init, "cpu", grad, tuple(value.shape.numpy()), dtype)

    by_path = {}
    for adapter, metas in found:
        by_path[onnx_name_to_path(adapter.base_name)] = LoraAdapter(
            factor(adapter.a, metas), factor(adapter.b, metas), adapter.scale, adapter.transposed)

    def attach(path: str, param: Param) -> Param:
        adapter = by_path.get(path)
        return param if adapter is None else param.with_adapter(adapter)

    return rebuild(module, attach)


def _strip(add: ir.Node, y: ir.Value, nodes: list) -> None:
    out = add.outputs[0]
    graph = add.graph
    if out.is_graph_output():
        # the Add's output is named as the graph output: give that name (and place) to y
        for i, value in enumerate(graph.outputs):
            if value is out:
                graph.outputs[i] = y
        name = out.name
        out.name = None
        y.name = name
    out.replace_all_uses_with(y)
    graph.remove(add, safe=True)
    _remove_if_unused(nodes)
