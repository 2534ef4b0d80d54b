"""LoRA in ONNX graphs: the ``"keep"`` and ``"inputs"`` export modes, and recognizing them on import.

The tracer (:mod:`onnxparam.trace.tracer`) calls into this module at two points only:

* :func:`initializer_param` — in every mode but ``"merge"``, an adapted param's initializer
  holds its **raw base** (the adapter is applied by graph nodes instead);
* :func:`expand_adapters` — when a trace finishes, every use of an adapted base in the graph
  (main graph and ``If`` / ``Loop`` bodies) gets its adapter:

  ================================  ============================================================
  use of the base ``W``             what is emitted (``sb``: ``scale * b``, see below)
  ================================  ============================================================
  ``MatMul(x, W)``, ``W`` (in, out) ``y + MatMul(MatMul(x, a), sb)`` — ``a @ b`` is never
                                    formed (Hu et al. 2021; cost ``O(n * r * (in + out))``)
  ``Gemm(x, W, transB=t)``, with    ``y + MatMul(MatMul(x, a), alpha_gemm * sb)``; ``t=1`` is
  ``transA=0`` and ``t`` equal to   PyTorch's ``(out, in)`` layout, whose adapter is
  the adapter's ``transposed``      ``transposed`` (delta ``(a @ b).T``)
  ``MatMul(x, Transpose(W))``,      ``y + MatMul(MatMul(x, a), sb)`` after the ``MatMul`` (torch's
  ``transposed`` adapter            exporters' ``nn.Linear`` on 3-d inputs)
  ``Conv(x, W, group=g)``, ``g > 1``, ``h = Conv(x, a as (r, in, *kernel))`` (no ``group``), then
  with PEFT's grouped-conv adapter  ``y + Reshape(MatMul(sb.T, h viewed [n, r, -1]), Shape(y))``
  (``a`` reads all ``in`` channels) (:meth:`_Expander.grouped_conv`; no merged form exists)
  anything else                     the merged weight ``W + a @ sb`` (``Transpose``-d for a
                                    transposed adapter, ``Reshape``-d for a 1-d bias or a conv
                                    weight), computed once in the graph
  ================================  ============================================================

  A grouped convolution's PEFT adapter (:func:`onnxparam.lora._adapters.conv_adapter_groups`)
  is refused by ``"merge"`` (a :class:`~onnxparam.LoraError` naming the weight; ``module(x)`` in
  ``lora_mode="merge"`` runs such a module in ``"keep"`` instead) and by any use but such a
  ``Conv``'s weight.

  In ``"merge"`` mode only a base that is not an initializer (a quantized weight emitted as
  ``DequantizeLinear``: QLoRA) gets nodes: the merged weight, as it cannot be one initializer.

  ``"keep"``: the factors are initializers named by their record paths (``fc.weight.lora.a``,
  ``fc.weight.lora.b``) and ``sb = Mul(b, scale)`` sits at the top of the graph (initializers
  only: ONNX Runtime folds it into one constant, so no full-width ``Mul`` runs per call).
  ``"inputs"``: the factors are **graph inputs** ``<W>.lora.a`` ``(d_in, r)`` and
  ``<W>.lora.b`` ``(r, d_out)`` with a symbolic rank ``r`` (:data:`FACTOR_RANK_DIM`), at the
  base's dtype, whose defaults are **zero-rank** initializers (``(d_in, 0)`` / ``(0, d_out)``):
  with no adapter active the branch adds exactly zero and the session is the base model. The
  scale is not in the graph: what is fed for ``b`` is ``scale * b`` (:func:`fed_factor`; as
  Olive writes adapters), so one exported model serves adapters of any rank, alpha or rsLoRA.
  ONNX Runtime's multi-LoRA API (``onnxruntime.LoraAdapter`` + ``RunOptions.add_active_adapter``)
  feeds them by name, and :func:`onnxparam.write_onnx_adapter` writes ``.onnx_adapter`` files
  holding ``a`` and ``scale * b`` under those names.

NOTE (ONNX Runtime, checked on 1.32): ``run_with_iobinding`` ignores the active adapters of the
``RunOptions``. To switch adapters with device-resident data, bind the factor values as inputs
(``IOBinding.bind_ortvalue_input("fc.weight.lora.a", value)``) — :mod:`onnxparam.runtime` does
exactly that in ``"inputs"`` mode, for every call.

Parts: this module is the export pass; ``.onnx_adapter`` files are written by
:func:`onnxparam.write_onnx_adapter` (``onnxparam/lora/_adapter_file.py``), and the import-time
recognition lives in ``onnxparam/onnx_io/_lora_import.py``.

Import (``strip_lora_subexpressions``) recognizes the shapes the export writes — the kept
branch after a ``MatMul`` / ``Gemm`` and the merged-weight expression — by their factor
initializers (``<W>.lora.a`` / ``<W>.lora.b``), removes them from the graph and returns the
adapters to attach, with their scale taken from ONNX metadata (``onnxparam.lora.scale``; Burn
does not store it) or, failing that, from the graph's constant. An ``"inputs"`` export's
zero-rank defaults import as no adapter (the base model).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Optional

import numpy as np
import onnx_ir as ir

from ..core.dtype import DType
from ..core.param import Param
from ._ir import dims

__all__ = [
    "LORA_MODES",
    "LORA_NODE_KEY",
    "FACTOR_SUFFIXES",
    "initializer_param",
    "expand_adapters",
    "factor_input_names",
    "fed_factor",
    "fed_factors",
    "FACTOR_RANK_DIM",
]

from ._adapters import LORA_MODES  # noqa: E402  (re-exported: the modes this pass implements)

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
    return dims(value) or []


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
        self._grouped = None
        self._scaled_b: dict = {}

    def _node(self, graph: ir.Graph, op: str, inputs: list, dims: list, label: str, attrs=None,
              attributes=()) -> ir.Node:
        name = self.tracer.unique_name(f"{label}")
        node = ir.Node("", op, inputs, [ir.AttrInt64s(k, v) if isinstance(v, list) else ir.AttrInt64(k, v)
                                       for k, v in (attrs or {}).items()] + list(attributes), name=name)
        out = node.outputs[0]
        out.name = self.tracer.unique_name(f"{name}_output_0")
        out.type = ir.TensorType(ir.DataType(self.dtype.to_onnx()))
        out.shape = ir.Shape(dims) if dims is not None else None  # None: a shape the graph left unknown
        node.metadata_props[LORA_NODE_KEY] = self.path
        return node

    def factors(self) -> tuple:
        """``(a, b, scale)`` values: the factors' initializers (cast to the base dtype when they
        differ, e.g. F32 factors on an F16 base) and the 0-d scale constant. In ``"inputs"``
        mode: the factor graph inputs (:func:`_factor_inputs`) and ``None`` (the scale is folded
        into the fed ``b``)."""
        if self._factors is None:
            tracer = self.tracer
            if tracer.mode == "inputs":
                self._factors = _factor_inputs(tracer, self.param, self.path, self.dtype) + (None,)
                return self._factors
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

    def scaled_b(self, coefficient: float) -> ir.Value:
        """``coefficient * b`` (the scale, times a ``Gemm``'s ``alpha``), once per coefficient,
        at the top of the main graph: it depends on initializers only, so ONNX Runtime folds it
        into one constant and the branch costs two small ``MatMul`` s and an ``Add``. In
        ``"inputs"`` mode ``b`` is fed pre-scaled and only a ``Gemm``'s ``alpha`` remains."""
        a, b, scale = self.factors()
        if scale is None:
            coefficient = coefficient / float(self.adapter.scale)
            if coefficient == 1.0:
                return b
        hit = self._scaled_b.get(coefficient)
        if hit is None:
            if scale is None or coefficient != float(self.adapter.scale):
                scale = self.tracer.constant(np.asarray(coefficient, dtype=self.dtype.to_numpy()),
                                             name=f"{self.path}.lora.scale")._symbol.value
            node = self._node(self.tracer.graph, "Mul", [b, scale], _dims(b), f"/{self.path}.lora/Mul")
            _prepend(self.tracer.graph, [node])
            hit = self._scaled_b[coefficient] = node.outputs[0]
        return hit

    def branch(self, node: ir.Node, x: ir.Value, coefficient: float) -> None:
        """``y + (x @ a) @ (coefficient * b)`` after ``node`` (its output ``y``), replacing
        every use of ``y``. ``coefficient`` is the adapter's scale, times a ``Gemm``'s
        ``alpha``."""
        a, _, _ = self.factors()
        b = self.scaled_b(coefficient)
        graph = node.graph
        y = node.outputs[0]
        out_dims = _dims(y) if y.shape is not None else None  # imported graphs may not declare it
        rank = _dims(a)[-1] if _dims(a) else self.adapter.rank
        label = f"{node.name}/lora"
        xa = self._node(graph, "MatMul", [x, a], out_dims[:-1] + [rank] if out_dims else None, f"{label}/MatMul_a")
        xab = self._node(graph, "MatMul", [xa.outputs[0], b], out_dims, f"{label}/MatMul_b")
        uses = list(y.uses())
        total = self._node(graph, "Add", [y, xab.outputs[0]], out_dims, f"{label}/Add")
        graph.insert_after(node, [xa, xab, total])
        _redirect(y, total.outputs[0], uses)

    def merged(self) -> ir.Value:
        """``W + scale * (a @ b)`` (transposed for a transposed adapter), once, at the top of
        the main graph (it depends on initializers and factor inputs only)."""
        if self._merged is None:
            a, b, _ = self.factors()
            a_dims, b_dims = _dims(a), _dims(b)
            b = self.scaled_b(float(self.adapter.scale))
            graph = self.tracer.graph
            label = f"/{self.path}.lora"
            dims = [a_dims[0], b_dims[1]]
            nodes = [self._node(graph, "MatMul", [a, b], dims, f"{label}/MatMul")]
            if self.adapter.transposed:
                nodes.append(self._node(graph, "Transpose", [nodes[-1].outputs[0]], dims[::-1],
                                        f"{label}/Transpose", {"perm": [1, 0]}))
            base_dims = _dims(self.base)
            if len(base_dims) != 2:  # a bias's (PEFT lora_bias) or a convolution's adapter
                shape = self.tracer.constant(np.asarray(base_dims, dtype=np.int64),
                                             name=f"{self.path}.lora.shape")._symbol.value
                nodes.append(self._node(graph, "Reshape", [nodes[-1].outputs[0], shape], base_dims,
                                        f"{label}/Reshape"))
            total = self._node(graph, "Add", [self.base, nodes[-1].outputs[0]], base_dims, f"{label}/Add")
            _prepend(graph, nodes)
            producer = self.base.producer()  # a DequantizeLinear (QLoRA): the Add must follow it
            if producer is not None and producer.graph is graph:
                graph.insert_after(producer, [total])
            else:
                graph.insert_after(nodes[-1], [total])
            self._merged = total.outputs[0]
        return self._merged

    def grouped_conv(self, node: ir.Node, groups: int) -> None:
        """A grouped ``Conv``'s adapter (PEFT's LoRA on a ``groups > 1`` conv,
        :func:`~onnxparam.lora._adapters.conv_adapter_groups`): ``a`` ``(in * prod(kernel), r)``
        is a conv of every input channel (``lora_A``), ``b`` ``(r, out)`` a 1x1 conv
        (``lora_B``, zero outside each group's rows) after it::

            h = Conv(x, Reshape(Transpose(a), [-1, in, *kernel]))    [n, r, *spatial]
            y + Reshape(MatMul(Transpose(scale * b) * mask, Reshape(h, [0, 0, prod(spatial)])), Shape(y))

        (with dynamic spatial dims the MatMul runs channels-last between two Transposes instead:
        no Reshape, so a zero rank, ``"inputs"`` mode with no adapter fed, still runs the base)

        ``Conv`` with the node's attributes but ``group`` (strides, pads, ``auto_pad``; PEFT's
        ``lora_A`` takes the base's stride and padding; a dilated base, whose PEFT ``lora_A`` is
        not dilated, or an input a ``reflect`` / ``edge`` / ``wrap`` ``Pad`` fills, is refused:
        :func:`onnxparam.lora._conv_checks.conv_node_problem`). ``mask`` (``<W>.lora.group_mask``, ``(out, r)``,
        a constant; not in ``"inputs"`` mode, whose rank is symbolic): ``1`` in each group's
        block, else ``0``: the forward is unchanged (``b`` is zero there) and ``b``'s gradient
        is zero outside the blocks, so training keeps PEFT's parameters (its grouped ``lora_B``).
        A ``b`` with an entry outside the blocks (not PEFT's layout: the mask would drop what an
        ``"inputs"`` graph adds) is refused when traced, as :func:`fed_factor` refuses it when fed
        (:func:`onnxparam.lora._conv_checks.check_grouped_b`)."""
        from ._conv_checks import check_conv_node

        dims = _dims(self.base)
        check_conv_node(node, self.path, tuple(dims), groups, self.tracer.mode)  # PEFT's forward is the only one
        graph = self.tracer.graph
        label = f"/{self.path}.lora"
        if self._grouped is None:  # the branch's conv weights, once per base
            from ..trace.tracer import untraced
            from ._conv_checks import check_grouped_b

            with untraced():  # b must be PEFT's block-diagonal lora_B (checked when traced)
                b_value = np.asarray(self.adapter.b.val().to_numpy())
            check_grouped_b(b_value, tuple(dims), int(self.adapter.a.lazy_shape()[0]),
                            f"lora={self.tracer.mode!r}: the adapter of {self.path!r}")
            a, _, _ = self.factors()
            b = self.scaled_b(float(self.adapter.scale))
            shape = self.tracer.constant(np.asarray([-1, dims[1] * groups, *dims[2:]], dtype=np.int64),
                                         name=f"{self.path}.lora.conv_shape")._symbol.value
            rank = _dims(a)[1]
            nodes = [self._node(graph, "Transpose", [a], _dims(a)[::-1], f"{label}/Transpose_a", {"perm": [1, 0]})]
            nodes.append(self._node(graph, "Reshape", [nodes[-1].outputs[0], shape],
                                    [rank, dims[1] * groups, *dims[2:]], f"{label}/Reshape_a"))
            nodes.append(self._node(graph, "Transpose", [b], _dims(b)[::-1], f"{label}/Transpose_b", {"perm": [1, 0]}))
            if isinstance(rank, int) and rank % groups == 0 and dims[0] % groups == 0:
                mask = np.kron(np.eye(groups), np.ones((dims[0] // groups, rank // groups)))
                mask = self.tracer.constant(mask.astype(self.dtype.to_numpy()),
                                            name=f"{self.path}.lora.group_mask")._symbol.value
                nodes.append(self._node(graph, "Mul", [nodes[-1].outputs[0], mask], [dims[0], rank],
                                        f"{label}/Mul_mask"))
            _prepend(graph, nodes)
            self._grouped = (nodes[1].outputs[0], nodes[-1].outputs[0], rank)
        a_conv, b_t, rank = self._grouped
        y = node.outputs[0]
        y_dims = _dims(y) if y.shape is not None else None
        uses = list(y.uses())
        name = f"{node.name}/lora"
        kept = [attr for key, attr in node.attributes.items() if key != "group"]
        n, spatial = (y_dims[0], y_dims[2:]) if y_dims else (None, None)
        flat_len = int(np.prod(spatial)) if spatial is not None and all(isinstance(d, int) for d in spatial) else None
        nodes = [self._node(node.graph, "Conv", [node.inputs[0], a_conv], [n, rank, *spatial] if y_dims else None,
                            f"{name}/Conv_a", attributes=kept)]
        # a zero rank ("inputs" mode with no adapter fed) makes h empty ([n, 0, *spatial]): no
        # Reshape with -1 (ambiguous next to a zero dim; ORT refuses it, and its ReshapeFusion
        # turns a computed [n, r, prod(spatial)] back into [0, 0, -1]), so the base model runs
        h = nodes[-1].outputs[0]
        k = len(dims) - 2  # spatial rank
        if flat_len is not None:  # [n, r, L] by explicit dims, then (b^T * mask) @ h, viewed as y
            flat = self.tracer.constant(np.asarray([0, 0, flat_len], dtype=np.int64),
                                        name=f"lora.conv.flat3_{flat_len}")._symbol.value
            nodes.append(self._node(node.graph, "Reshape", [h, flat], [n, rank, flat_len], f"{name}/Reshape_h"))
            nodes.append(self._node(node.graph, "MatMul", [b_t, nodes[-1].outputs[0]], [n, dims[0], flat_len],
                                    f"{name}/MatMul_b"))
            nodes.append(self._node(node.graph, "Shape", [y], [len(y_dims)], f"{name}/Shape_y"))
            nodes[-1].outputs[0].type = ir.TensorType(ir.DataType.INT64)
            nodes.append(self._node(node.graph, "Reshape", [nodes[-2].outputs[0], nodes[-1].outputs[0]], y_dims,
                                    f"{name}/Reshape_y"))
        else:  # dynamic spatial dims: channels last, h^T @ (b^T * mask)^T, channels back (no Reshape)
            last = [n, *spatial] if y_dims else None
            nodes.append(self._node(node.graph, "Transpose", [h], last and [*last, rank], f"{name}/Transpose_h",
                                    {"perm": [0, *range(2, k + 2), 1]}))
            nodes.append(self._node(node.graph, "Transpose", [b_t], [rank, dims[0]], f"{name}/Transpose_bt",
                                    {"perm": [1, 0]}))
            nodes.append(self._node(node.graph, "MatMul", [nodes[-2].outputs[0], nodes[-1].outputs[0]],
                                    last and [*last, dims[0]], f"{name}/MatMul_b"))
            nodes.append(self._node(node.graph, "Transpose", [nodes[-1].outputs[0]], y_dims, f"{name}/Transpose_y",
                                    {"perm": [0, k + 1, *range(1, k + 1)]}))
        nodes.append(self._node(node.graph, "Add", [y, nodes[-1].outputs[0]], y_dims, f"{name}/Add"))
        node.graph.insert_after(node, nodes)
        _redirect(y, nodes[-1].outputs[0], uses)

    def expand(self) -> None:
        from ..core.errors import LoraError
        from ._adapters import conv_adapter_groups

        transposed = bool(self.adapter.transposed)
        dims = _dims(self.base)
        groups = 1
        if len(dims) >= 3 and all(isinstance(d, int) for d in dims):
            groups = conv_adapter_groups(tuple(dims), int(self.adapter.a.lazy_shape()[0]))
        for node, index in list(self.base.uses()):
            if groups > 1:  # (lora='merge' refused it already: _check_mergeable)
                if node.op_type == "Conv" and node.domain in ("", "ai.onnx") and index == 1 \
                        and _attr_int(node, "group", 1) == groups:
                    self.grouped_conv(node, groups)
                    continue
                raise LoraError(f"{self.path!r} is used by node {node.name!r} ({node.op_type}, input {index}"
                                f"{', group=%d' % _attr_int(node, 'group', 1) if node.op_type == 'Conv' else ''}), but "
                                f"its adapter is PEFT's LoRA of a Conv with group={groups}: it applies to such a "
                                "Conv's weight only")
            if node.metadata_props.get(LORA_NODE_KEY) == self.path and node.op_type == "Add":
                continue  # the merged weight's own Add
            if node.domain in ("", "ai.onnx") and node.outputs:
                if index == 1 and node.op_type == "MatMul" and not transposed and (
                        node.inputs[0].shape is None or len(node.inputs[0].shape) >= 1):
                    self.branch(node, node.inputs[0], float(self.adapter.scale))
                    continue
                if index == 1 and node.op_type == "Gemm" and _attr_int(node, "transA", 0) == 0 \
                        and _attr_int(node, "transB", 0) == int(transposed):
                    self.branch(node, node.inputs[0], _attr_float(node, "alpha", 1.0) * float(self.adapter.scale))
                    continue
                matmul = _transpose_to_matmul(node) if transposed else None
                if matmul is not None:  # torch's exporters: Linear on 3-d inputs
                    self.branch(matmul, matmul.inputs[0], float(self.adapter.scale))
                    continue
            node.replace_input_with(index, self.merged())


def _transpose_to_matmul(node: ir.Node) -> "ir.Node | None":
    """The ``MatMul`` that uses ``node``'s output as its B and is its only use, when ``node``
    is a 2-d ``Transpose`` (``perm`` ``[1, 0]``): a weight stored ``(d_out, d_in)`` read as
    ``(d_in, d_out)``."""
    if node.op_type != "Transpose" or not node.outputs or node.outputs[0].is_graph_output():
        return None
    perm = node.attributes.get("perm")
    if perm is None or list(perm.value) != [1, 0]:
        return None
    uses = list(node.outputs[0].uses())
    if len(uses) != 1:
        return None
    user, index = uses[0]
    if user.op_type != "MatMul" or user.domain not in ("", "ai.onnx") or index != 1 or not user.inputs[0]:
        return None
    return user


FACTOR_RANK_DIM = "{path}.lora.rank"
"""The symbolic rank dim of an ``"inputs"``-mode adapter's factor inputs (one per adapted weight:
any rank can be fed)."""


def _factor_inputs(tracer, param: Param, path: str, dtype: DType) -> tuple:
    """The ``"inputs"``-mode factors of ``param``'s adapter: graph inputs ``<path>.lora.a``
    ``(d_in, r)`` and ``<path>.lora.b`` ``(r, d_out)``, ``r`` symbolic, at the base's dtype,
    with **zero-rank** defaults ``(d_in, 0)`` / ``(0, d_out)``: with nothing fed the branch adds
    exactly zero (the base model). The fed ``b`` carries the scale (``scale * b``, as Olive
    writes adapters): any alpha, rank or rsLoRA adapter runs on one graph."""
    adapter = param.adapter()
    d_in, rank = (int(d) for d in adapter.a.lazy_shape())
    d_out = int(adapter.b.lazy_shape()[1])
    names = [tracer._param_paths.get(id(f), f"{path}{suffix}") for f, suffix in
             ((adapter.a, FACTOR_SUFFIXES[0]), (adapter.b, FACTOR_SUFFIXES[1]))]
    rank_dim = ir.SymbolicDim(FACTOR_RANK_DIM.format(path=path))
    np_dtype = dtype.to_numpy()
    values = []
    for name, shape, zero in ((names[0], [d_in, rank_dim], (d_in, 0)), (names[1], [rank_dim, d_out], (0, d_out))):
        tracer._names.add(name)
        value = ir.Value(name=name, type=ir.TensorType(ir.DataType(dtype.to_onnx())), shape=ir.Shape(shape),
                         const_value=ir.tensor(np.zeros(zero, dtype=np_dtype), name=name))
        tracer._constants.append(value)
        tracer.graph.inputs.append(value)
        values.append(value)
    return values[0], values[1]


_HEADERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""graph -> the last node of its LoRA header: the nodes that depend on initializers only
(factor ``Cast`` s, ``scale * b``, merged weights), kept at the top of the graph in creation
order (each is created after its inputs, so the order is topological)."""


def _prepend(graph: ir.Graph, nodes: list) -> None:
    """Append ``nodes`` to ``graph``'s LoRA header (the top of the graph, :data:`_HEADERS`)."""
    last = _HEADERS.get(graph)
    if last is not None and last.graph is graph:
        graph.insert_after(last, nodes)
    else:
        first = next(iter(graph), None)
        if first is None:
            graph.extend(nodes)
        else:
            graph.insert_before(first, nodes)
    _HEADERS[graph] = nodes[-1]


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


def _check_mergeable(tracer, param: Param) -> None:
    """Refuse to merge a grouped convolution's adapter (no weight delta) with the param's path."""
    from ..core.errors import LoraError
    from ._adapters import conv_adapter_groups, grouped_conv_message

    shape = tuple(int(d) for d in param.lazy_shape())
    if len(shape) >= 3:
        groups = conv_adapter_groups(shape, int(param.adapter().a.lazy_shape()[0]))
        if groups > 1:
            path = tracer._param_paths.get(id(param), "a param")
            raise LoraError(f"{path!r} (lora='merge'): " + grouped_conv_message(shape, groups, "merged"))


def expand_adapters(tracer) -> None:
    """Emit every adapted param's adapter into ``tracer``'s graph (module docstring); in
    ``"inputs"`` mode the factors become graph inputs too. Called by ``Tracer.finish`` after the
    outputs are set, before the initializers are registered; a no-op in ``"merge"`` mode.
    ``"batched"`` mode is its own pass (:func:`onnxparam.lora._batched.expand_batched`)."""
    if tracer.mode == "batched":
        return
    if tracer.mode == "merge":
        # NOTE: a base emitted as nodes (a quantized weight's DequantizeLinear, QLoRA) cannot
        # hold base + delta in one initializer: its adapter is merged in the graph instead.
        for tensor in list(tracer._param_tensors.values()):
            param = tensor._symbol.param
            if param is not None and param.adapter() is not None:
                _check_mergeable(tracer, param)
            if param is not None and param.adapter() is not None and tensor._symbol.value.producer() is not None:
                expander = _Expander(tracer, param, tensor._symbol.value, tensor.dtype)
                for node, index in list(expander.base.uses()):
                    if node.metadata_props.get(LORA_NODE_KEY) != expander.path:
                        node.replace_input_with(index, expander.merged())
        return
    for tensor in list(tracer._param_tensors.values()):
        symbol = tensor._symbol
        param = symbol.param
        if param is None or param.adapter() is None:
            continue
        _Expander(tracer, param, symbol.value, tensor.dtype).expand()


def factor_input_names(model: ir.Model) -> list:
    """The graph inputs of ``model`` that are LoRA factors with defaults (``"inputs"`` mode)."""
    return [v.name for v in model.graph.inputs if v.is_initializer() and v.name.endswith(FACTOR_SUFFIXES)]


_FED: "OrderedDict" = OrderedDict()  # (id(factor tensor), which, scale, dtype) -> (tensor, array)
_FED_SIZE = 256
_FED_LOCK = threading.Lock()


def fed_factor(param: Param, which: str, dtype: DType, name: Optional[str] = None) -> np.ndarray:
    """The value an ``"inputs"``-mode graph is fed for factor ``which`` (``"a"`` / ``"b"``) of
    ``param``'s adapter: ``a``, or ``scale * b`` (the scale folded in, as in ``.onnx_adapter``
    files), computed in float32 (float64 for F64) and cast to ``dtype`` (the base's).

    The arrays of the last :data:`_FED_SIZE` factor tensors are kept (read-only; keyed by the
    tensor's identity, which the key holds alive): switching between adapters feeds them again
    without recomputing ``scale * b``.

    Raises:
        LoraError: a grouped convolution's ``b`` that is not block-diagonal
            (:func:`onnxparam.lora._conv_checks.check_grouped_b`), naming the weight ``name``."""
    adapter = param.adapter()
    factor = adapter.a if which == "a" else adapter.b
    tensor = factor.val()
    key = (id(tensor), which, float(adapter.scale) if which == "b" else None, dtype)
    with _FED_LOCK:
        hit = _FED.get(key)
        if hit is not None and hit[0] is tensor:
            _FED.move_to_end(key)
            return hit[1]
    value = np.asarray(tensor.to_numpy())
    shape = tuple(param.lazy_shape())
    if which == "b" and len(shape) >= 3:  # a convolution's adapter: a grouped one's b must be PEFT's
        from ._conv_checks import check_grouped_b

        check_grouped_b(value, shape, int(adapter.a.lazy_shape()[0]), f"the adapter of {name or 'a weight'!r}")
    compute = np.float64 if value.dtype == np.float64 or dtype is DType.F64 else np.float32
    value = value.astype(compute)
    if which == "b":
        value = value * compute(adapter.scale)
    np_dtype = np.float32 if dtype is DType.QFloat else dtype.to_numpy()
    value = np.ascontiguousarray(value.astype(np_dtype))
    value.flags.writeable = False
    with _FED_LOCK:
        _FED[key] = (tensor, value)
        while len(_FED) > _FED_SIZE:
            _FED.popitem(last=False)
    return value


def fed_factors(model: ir.Model, params: dict) -> list:
    """``[(graph input, array), ...]``: what a module call feeds ``model`` (an ``"inputs"``-mode
    trace) for its factor inputs, from ``params`` (the module's ``path -> Param``): the adapters'
    ``a`` and ``scale * b`` (:func:`fed_factor`), or the zero-rank defaults for a base that has
    no adapter now."""
    from ..trace.tracer import untraced

    fed = []
    with untraced():
        for value in model.graph.inputs:
            name = value.name
            if not (value.is_initializer() and name.endswith(FACTOR_SUFFIXES)):
                continue
            base = params.get(name[: -len(FACTOR_SUFFIXES[0])])
            dtype = DType.from_onnx(int(value.dtype))
            if base is None or base.adapter() is None:
                fed.append((name, value.const_value.numpy()))
            else:
                fed.append((name, fed_factor(base, name[-1], dtype, name[: -len(FACTOR_SUFFIXES[0])])))
    return fed
