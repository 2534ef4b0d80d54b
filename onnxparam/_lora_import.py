"""Recognizing LoRA adapters in an imported ONNX graph (the shapes :mod:`onnxparam.lora_graph`
exports), removing them from the graph and attaching them to the imported module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx_ir as ir

from .lora_graph import FACTOR_SUFFIXES, _attr_float, _attr_int
from .param import Param

__all__ = ["ImportedAdapter", "strip_lora_subexpressions", "strip_imported", "attach_imported",
           "has_lora_factors", "transposed_weight_names"]


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


def _lora_chain(out: ir.Value, factors: dict) -> Optional[tuple]:
    """``(x, a, b, coefficient, [nodes])`` when ``out = Mul(MatMul(MatMul(x, a), b), s)`` with
    ``a`` / ``b`` factor initializers of one base (``factors``: value name -> (base, "a"|"b"))."""
    mul = _producer(out, "Mul")
    if mul is None:
        return None
    for first, second in ((0, 1), (1, 0)):
        mm_b = _producer(mul.inputs[first], "MatMul")
        coefficient = _scalar(mul.inputs[second]) if mul.inputs[second] is not None else None
        if mm_b is None or coefficient is None:
            continue
        b = mm_b.inputs[1]
        mm_a = _producer(mm_b.inputs[0], "MatMul")
        if mm_a is None or factors.get(b.name, (None, None))[1] != "b":
            continue
        a = mm_a.inputs[1]
        if factors.get(a.name, (None, None))[1] != "a" or factors[a.name][0] != factors[b.name][0]:
            continue
        return mm_a.inputs[0], a, b, coefficient, [mm_a, mm_b, mul]
    return None


def _merged_chain(out: ir.Value, factors: dict) -> Optional[tuple]:
    """``(a, b, coefficient, transposed, [nodes])`` when ``out`` is ``Mul(MatMul(a, b), s)``,
    optionally ``Transpose``-d."""
    transpose = _producer(out, "Transpose")
    inner = transpose.inputs[0] if transpose is not None else out
    mul = _producer(inner, "Mul")
    if mul is None:
        return None
    for first, second in ((0, 1), (1, 0)):
        mm = _producer(mul.inputs[first], "MatMul")
        coefficient = _scalar(mul.inputs[second]) if mul.inputs[second] is not None else None
        if mm is None or coefficient is None:
            continue
        a, b = mm.inputs
        if factors.get(a.name, (None, None))[1] == "a" and factors.get(b.name, (None, None))[1] == "b" \
                and factors[a.name][0] == factors[b.name][0]:
            nodes = [mm, mul] + ([transpose] if transpose is not None else [])
            return a, b, coefficient, transpose is not None, nodes
    return None


def _remove_if_unused(nodes: list) -> None:
    for node in reversed(nodes):
        if node.graph is not None and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            node.graph.remove(node, safe=True)


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
                if base is None or base.inputs[0] is not x or base.inputs[1] is None \
                        or base.inputs[1].name != factors[a.name][0]:
                    continue
                transposed = base.op_type == "Gemm" and _attr_int(base, "transB", 0) == 1
                if base.op_type == "Gemm":
                    coefficient /= _attr_float(base, "alpha", 1.0)
                _strip(node, y, nodes)
                found.setdefault(factors[a.name][0], (a, b, coefficient, transposed))
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
        adapters.append(ImportedAdapter(base_name, a, b, float(scale), transposed))
    return adapters


def _factor_names(graph: ir.Graph) -> dict:
    """Factor initializer name -> (base initializer name, "a" | "b"). The base is the
    initializer named by the factor's prefix, or (an imported model re-exported) whose module
    path is that prefix."""
    from .onnx_io.naming import onnx_name_to_path

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
    from .onnx_io import metadata as md
    from .onnx_io.source import LoadedModel, base_dir_of

    base = base_dir_of(loaded.model)
    model = ir.serde.deserialize_model(ir.serde.serialize_model(loaded.model))
    if base:
        ir.external_data.set_base_dir(model.graph, base)
    props = {name: dict(v.const_value.metadata_props) for name, v in model.graph.initializers.items()
             if name.endswith(FACTOR_SUFFIXES) and v.const_value is not None and v.const_value.metadata_props}
    metas = md.read_params(model.metadata_props, props, loaded.source)
    scales = {name: meta.lora_scale for name, meta in metas.items() if meta.lora_scale is not None}
    adapters = strip_lora_subexpressions(model, scales)
    if not adapters:
        return loaded, []
    return LoadedModel(model, loaded.source, loaded.path), [(adapter, metas) for adapter in adapters]


def attach_imported(module, found: list):
    """``module`` (an imported ``OnnxModule``) with the adapters :func:`strip_imported` found
    attached to their bases: lazy factor params with the ids and flags ONNX metadata records."""
    if not found:
        return module
    from .lora import LoraAdapter
    from .module import rebuild
    from .onnx_io import metadata as md
    from .onnx_io.naming import onnx_name_to_path
    from .onnx_io.weights import burn_dtype, tensor_data
    from .param import ParamId
    from .tensor import Tensor

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


def transposed_weight_names(model: ir.Model) -> set:
    """Names of the weights ``model`` uses as ``Gemm`` B with ``transB=1`` — stored
    ``(d_out, d_in)``, so their adapters are transposed — and nowhere as ``MatMul`` B."""
    gemm, matmul = set(), set()
    for node in model.graph.all_nodes():
        if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        name = node.inputs[1].name
        if node.op_type == "Gemm" and _attr_int(node, "transB", 0) == 1:
            gemm.add(name)
        elif node.op_type in ("MatMul", "Gemm"):
            matmul.add(name)
    return gemm - matmul
