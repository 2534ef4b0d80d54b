"""LoRA in ONNX graphs: the ``"keep"`` and ``"inputs"`` export modes, and recognizing them on import.

The tracer (:mod:`onnxparam.trace`) calls into this module at two points only:

* :func:`initializer_param` — in every mode but ``"merge"``, an adapted param's initializer
  holds its **raw base** (the adapter is applied by graph nodes instead);
* :func:`expand_adapters` — when a trace finishes, every use of an adapted base in the graph
  (main graph and ``If`` / ``Loop`` bodies) gets its adapter:

  ================================  ============================================================
  use of the base ``W``             what is emitted
  ================================  ============================================================
  ``MatMul(x, W)``, ``W`` (in, out) ``y + scale * MatMul(MatMul(x, a), b)`` — ``a @ b`` is never
                                    formed (Hu et al. 2021; cost ``O(n * r * (in + out))``)
  ``Gemm(x, W, transB=t)``, with    ``y + (alpha_gemm * scale) * MatMul(MatMul(x, a), b)``;
  ``transA=0`` and ``t`` equal to   ``t=1`` is PyTorch's ``(out, in)`` layout, whose adapter is
  the adapter's ``transposed``      ``transposed`` (delta ``(a @ b).T``)
  anything else                     the merged weight ``W + scale * (a @ b)`` (``Transpose``-d
                                    for a transposed adapter), computed once in the graph
  ================================  ============================================================

  In ``"merge"`` mode only a base that is not an initializer (a quantized weight emitted as
  ``DequantizeLinear``: QLoRA) gets nodes: the merged weight, as it cannot be one initializer.

  The factors are initializers named by their record paths (``fc.weight.lora.a``,
  ``fc.weight.lora.b``), the scale a 0-d constant. In ``"inputs"`` mode the factors are also
  **graph inputs** with those initializers as defaults: ONNX Runtime's multi-LoRA API
  (``onnxruntime.LoraAdapter`` + ``RunOptions.add_active_adapter``) feeds them by name, and
  :func:`write_onnx_adapter` writes ``.onnx_adapter`` files whose names are those paths by
  construction.

NOTE (ONNX Runtime, checked on 1.32): ``run_with_iobinding`` ignores the active adapters of the
``RunOptions``. To switch adapters with device-resident data, bind the factor values as inputs
(``IOBinding.bind_ortvalue_input("fc.weight.lora.a", value)``) — :mod:`onnxparam.runtime` does
exactly that in ``"inputs"`` mode, for every call.

Import (:func:`strip_lora_subexpressions`) recognizes both shapes the export writes — the kept
branch after a ``MatMul`` / ``Gemm`` and the merged-weight expression — by their factor
initializers (``<W>.lora.a`` / ``<W>.lora.b``), removes them from the graph and returns the
adapters to attach, with their scale taken from ONNX metadata (``onnxparam.lora.scale``; Burn
does not store it) or, failing that, from the graph's constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx_ir as ir

from .dtype import DType
from .param import Param

__all__ = [
    "LORA_MODES",
    "LORA_NODE_KEY",
    "FACTOR_SUFFIXES",
    "initializer_param",
    "expand_adapters",
    "factor_input_names",
    "write_onnx_adapter",
    "adapter_params",
    "ImportedAdapter",
    "strip_lora_subexpressions",
    "strip_imported",
    "attach_imported",
    "has_lora_factors",
    "transposed_weight_names",
]

from .lora import LORA_MODES  # noqa: E402  (re-exported: the modes this pass implements)

LORA_NODE_KEY = "onnxparam.lora"
"""Node ``metadata_props`` key set on every node this module emits; the value is the adapted
weight's path. Import uses the factor names, not this key (other tools may drop metadata)."""

FACTOR_SUFFIXES = (".lora.a", ".lora.b")
"""Record-path suffixes of the two factors (Burn's reparameterization naming)."""


def initializer_param(param: Param, mode: str) -> Param:
    """The param whose value a traced initializer holds: ``param`` itself in ``"merge"`` mode
    (``val()`` folds the adapter in), else ``param`` without its adapter (the raw base)."""
    if mode == "merge" or param.adapter() is None:
        return param
    return param.with_adapter(None)


# -- export -----------------------------------------------------------------------------------


def _dims(value: ir.Value) -> list:
    if value.shape is None:
        return []
    return [d if isinstance(d, int) else d.value for d in value.shape]


def _attr_int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _attr_float(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else float(attr.value)


class _Expander:
    """Emits the adapter of one adapted base for each of its uses (module docstring)."""

    def __init__(self, tracer, param: Param, base: ir.Value, dtype: DType):
        self.tracer = tracer
        self.param = param
        self.adapter = param.adapter()
        self.base = base
        self.dtype = dtype
        self.path = tracer._param_paths.get(id(param), base.name)
        self._factors = None
        self._merged = None

    def _node(self, graph: ir.Graph, op: str, inputs: list, dims: list, label: str, attrs=None) -> ir.Node:
        name = self.tracer.unique_name(f"{label}")
        node = ir.Node("", op, inputs, [ir.AttrInt64s(k, v) if isinstance(v, list) else ir.AttrInt64(k, v)
                                       for k, v in (attrs or {}).items()], name=name)
        out = node.outputs[0]
        out.name = self.tracer.unique_name(f"{name}_output_0")
        out.type = ir.TensorType(ir.DataType(self.dtype.to_onnx()))
        out.shape = ir.Shape(dims)
        node.metadata_props[LORA_NODE_KEY] = self.path
        return node

    def factors(self) -> tuple:
        """``(a, b, scale)`` values: the factors' initializers (cast to the base dtype when they
        differ, e.g. F32 factors on an F16 base) and the 0-d scale constant."""
        if self._factors is None:
            tracer = self.tracer
            a = tracer.param_value(self.adapter.a)
            b = tracer.param_value(self.adapter.b)
            values, casts = [], []
            for factor in (a, b):
                value = factor._symbol.value
                if factor.dtype is not self.dtype:
                    node = self._node(tracer.graph, "Cast", [value], _dims(value), f"{self.path}.lora/Cast",
                                      {"to": self.dtype.to_onnx()})
                    casts.append(node)
                    value = node.outputs[0]
                values.append(value)
            if casts:
                _prepend(tracer.graph, casts)
            scale = tracer.constant(np.asarray(self.adapter.scale, dtype=self.dtype.to_numpy()),
                                    name=f"{self.path}.lora.scale")._symbol.value
            self._factors = (values[0], values[1], scale)
        return self._factors

    def branch(self, node: ir.Node, x: ir.Value, coefficient: float) -> None:
        """``y + coefficient * ((x @ a) @ b)`` after ``node`` (its output ``y``), replacing
        every use of ``y``."""
        a, b, scale = self.factors()
        if coefficient != float(self.adapter.scale):
            scale = self.tracer.constant(np.asarray(coefficient, dtype=self.dtype.to_numpy()),
                                         name=f"{self.path}.lora.scale")._symbol.value
        graph = node.graph
        y = node.outputs[0]
        out_dims = _dims(y)
        label = f"{node.name}/lora"
        xa = self._node(graph, "MatMul", [x, a], out_dims[:-1] + [self.adapter.rank], f"{label}/MatMul_a")
        xab = self._node(graph, "MatMul", [xa.outputs[0], b], out_dims, f"{label}/MatMul_b")
        scaled = self._node(graph, "Mul", [xab.outputs[0], scale], out_dims, f"{label}/Mul")
        uses = list(y.uses())
        total = self._node(graph, "Add", [y, scaled.outputs[0]], out_dims, f"{label}/Add")
        graph.insert_after(node, [xa, xab, scaled, total])
        _redirect(y, total.outputs[0], uses)

    def merged(self) -> ir.Value:
        """``W + scale * (a @ b)`` (transposed for a transposed adapter), once, at the top of
        the main graph (it depends on initializers only)."""
        if self._merged is None:
            a, b, scale = self.factors()
            a_dims, b_dims = _dims(a), _dims(b)
            graph = self.tracer.graph
            label = f"/{self.path}.lora"
            ab = self._node(graph, "MatMul", [a, b], [a_dims[0], b_dims[1]], f"{label}/MatMul")
            delta = self._node(graph, "Mul", [ab.outputs[0], scale], [a_dims[0], b_dims[1]], f"{label}/Mul")
            nodes = [ab, delta]
            if self.adapter.transposed:
                nodes.append(self._node(graph, "Transpose", [delta.outputs[0]], [b_dims[1], a_dims[0]],
                                        f"{label}/Transpose", {"perm": [1, 0]}))
            total = self._node(graph, "Add", [self.base, nodes[-1].outputs[0]], _dims(self.base), f"{label}/Add")
            _prepend(graph, nodes)
            producer = self.base.producer()  # a DequantizeLinear (QLoRA): the Add must follow it
            if producer is not None and producer.graph is graph:
                graph.insert_after(producer, [total])
            else:
                graph.insert_after(nodes[-1], [total])
            self._merged = total.outputs[0]
        return self._merged

    def expand(self) -> None:
        transposed = bool(self.adapter.transposed)
        for node, index in list(self.base.uses()):
            if node.metadata_props.get(LORA_NODE_KEY) == self.path and node.op_type == "Add":
                continue  # the merged weight's own Add
            if node.domain in ("", "ai.onnx") and index == 1 and node.outputs:
                if node.op_type == "MatMul" and not transposed and len(_dims(node.inputs[0])) >= 1:
                    self.branch(node, node.inputs[0], float(self.adapter.scale))
                    continue
                if node.op_type == "Gemm" and _attr_int(node, "transA", 0) == 0 \
                        and _attr_int(node, "transB", 0) == int(transposed):
                    self.branch(node, node.inputs[0], _attr_float(node, "alpha", 1.0) * float(self.adapter.scale))
                    continue
            node.replace_input_with(index, self.merged())


def _prepend(graph: ir.Graph, nodes: list) -> None:
    first = next(iter(graph), None)
    if first is None:
        graph.extend(nodes)
    else:
        graph.insert_before(first, nodes)


def _redirect(old: ir.Value, new: ir.Value, uses: list) -> None:
    """Point ``uses`` (``(node, index)`` pairs) and graph outputs from ``old`` to ``new``; a
    graph output keeps its name (``new`` takes it, ``old`` gets ``new``'s)."""
    for node, index in uses:
        node.replace_input_with(index, new)
    producer = old.producer()
    graph = producer.graph if producer is not None else None
    if graph is not None:
        for i, value in enumerate(graph.outputs):
            if value is old:
                graph.outputs[i] = new
                old.name, new.name = new.name, old.name


def expand_adapters(tracer) -> None:
    """Emit every adapted param's adapter into ``tracer``'s graph (module docstring); in
    ``"inputs"`` mode the factors become graph inputs too. Called by ``Tracer.finish`` after the
    outputs are set, before the initializers are registered; a no-op in ``"merge"`` mode."""
    if tracer.mode == "merge":
        # NOTE: a base emitted as nodes (a quantized weight's DequantizeLinear, QLoRA) cannot
        # hold base + delta in one initializer: its adapter is merged in the graph instead.
        for tensor in list(tracer._param_tensors.values()):
            param = tensor._symbol.param
            if param is not None and param.adapter() is not None and tensor._symbol.value.producer() is not None:
                expander = _Expander(tracer, param, tensor._symbol.value, tensor.dtype)
                for node, index in list(expander.base.uses()):
                    if node.metadata_props.get(LORA_NODE_KEY) != expander.path:
                        node.replace_input_with(index, expander.merged())
        return
    factor_values = []
    for tensor in list(tracer._param_tensors.values()):
        symbol = tensor._symbol
        param = symbol.param
        if param is None or param.adapter() is None:
            continue
        expander = _Expander(tracer, param, symbol.value, tensor.dtype)
        expander.expand()
        if expander._factors is not None:
            for factor in (param.adapter().a, param.adapter().b):
                factor_values.append(tracer._param_tensors[id(factor)]._symbol.value)
    if tracer.mode == "inputs":
        for value in factor_values:
            if value not in tracer.graph.inputs:
                tracer.graph.inputs.append(value)


def factor_input_names(model: ir.Model) -> list:
    """The graph inputs of ``model`` that are LoRA factors with defaults (``"inputs"`` mode)."""
    return [v.name for v in model.graph.inputs if v.is_initializer() and v.name.endswith(FACTOR_SUFFIXES)]


# -- .onnx_adapter files ----------------------------------------------------------------------


def adapter_params(module) -> dict:
    """``{"<path>.lora.a": array, "<path>.lora.b": array, ...}`` for every adapter of
    ``module``: the graph-input names of its ``"inputs"`` export and their values."""
    from .module import named_params
    from .trace import untraced

    params = {}
    with untraced():
        for path, param in named_params(module):
            adapter = param.adapter()
            if adapter is None:
                continue
            params[f"{path}.lora.a"] = np.asarray(adapter.a.val().to_numpy())
            params[f"{path}.lora.b"] = np.asarray(adapter.b.val().to_numpy())
    return params


def write_onnx_adapter(module_or_params, path, *, adapter_version: int = 1, model_version: int = 1):
    """Write an ONNX Runtime adapter file (``.onnx_adapter``, ``onnxruntime.AdapterFormat``).

    Args:
        module_or_params: a module with LoRA adapters (its factors are written under their
            record paths, ``fc.weight.lora.a`` ..., the names of the ``lora="inputs"`` export's
            graph inputs), or a mapping ``name -> array``.
        path: the file to write.
        adapter_version, model_version: the versions stored in the file's header.

    Returns:
        the ``pathlib.Path`` written.

    Load it with ``onnxruntime.LoraAdapter().Load(path)`` and activate it per run with
    ``RunOptions.add_active_adapter``. NOTE: ONNX Runtime ignores active adapters under IO
    binding; bind the factors as inputs there instead (module docstring). NOTE: ``RunOptions``
    does not keep its ``LoraAdapter`` alive (ONNX Runtime 1.32 crashes if the adapter object is
    collected first): hold a reference for as long as the options are used.

    Raises:
        ValueError: when there is nothing to write (a module without adapters).
        PermissionError: (``EACCES``) ``path`` is read-only (whatever the process's privileges),
            or its folder is not writable; nothing is written.
        FileNotFoundError: (``ENOENT``) ``path``'s folder does not exist.
    """
    import os
    from pathlib import Path

    from ._ort import import_onnxruntime
    from ._scratch import check_replaceable, preserve_mode, scratch_name

    ort = import_onnxruntime()
    params = module_or_params if isinstance(module_or_params, dict) else adapter_params(module_or_params)
    if not params:
        raise ValueError("no LoRA adapter to write: the module has no adapters (apply_lora first)")
    values = {str(k): ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(int(adapter_version))
    fmt.set_model_version(int(model_version))
    fmt.set_parameters(values)
    path = Path(path)
    # NOTE: ONNX Runtime writes straight to the path it is given; write beside it and rename,
    # so a failed save never destroys the previous adapter file. The rename would also replace
    # a read-only file that open(path, "w") refuses: check first, keep the old mode.
    mode = check_replaceable(path)
    scratch = path.with_name(scratch_name(path.name))
    try:
        fmt.export_adapter(str(scratch))
        preserve_mode(mode, scratch)
        os.replace(scratch, path)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    return path


# -- import -----------------------------------------------------------------------------------


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
