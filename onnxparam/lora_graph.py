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
  :func:`onnxparam.write_onnx_adapter` writes ``.onnx_adapter`` files whose names are those paths by
  construction.

NOTE (ONNX Runtime, checked on 1.32): ``run_with_iobinding`` ignores the active adapters of the
``RunOptions``. To switch adapters with device-resident data, bind the factor values as inputs
(``IOBinding.bind_ortvalue_input("fc.weight.lora.a", value)``) — :mod:`onnxparam.runtime` does
exactly that in ``"inputs"`` mode, for every call.

Parts: this module is the export pass; ``.onnx_adapter`` files are written by
:func:`onnxparam.write_onnx_adapter` (``onnxparam/_lora_adapter_file.py``), and the import-time
recognition lives in ``onnxparam/_lora_import.py``.

Import (``strip_lora_subexpressions``) recognizes both shapes the export writes — the kept
branch after a ``MatMul`` / ``Gemm`` and the merged-weight expression — by their factor
initializers (``<W>.lora.a`` / ``<W>.lora.b``), removes them from the graph and returns the
adapters to attach, with their scale taken from ONNX metadata (``onnxparam.lora.scale``; Burn
does not store it) or, failing that, from the graph's constant.
"""

from __future__ import annotations

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
