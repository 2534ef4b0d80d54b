"""Where the batch is in each value of a graph: the row layout check of batched LoRA.

A batched export (:mod:`onnxparam.lora._batched`) adds row ``n``'s adapter to the rows of each
adapted ``MatMul`` / ``Gemm`` / ``Conv`` / embedding ``Gather`` that come from batch element
``n``. It views the node's input as ``[batch, -1, d_in]``: right only when the input's storage
is batch-major. This module follows the batch from the graph inputs through the graph so the
pass can tell, per target, whether that view is right, whether a cheap mapping exists (the
batch on another axis of a ``MatMul`` input: transposed to the front and back), or whether the
rows are mixed (refused, naming the node where the batch axis was lost).

Each value gets a :class:`Layout`:

* ``"none"``: no batch in it (initializers, params, constants, shapes, anything computed from
  those only);
* ``"axis"`` (``axis=k``): axis ``k`` indexes the batch element exactly;
* ``"rows"``: batch-major storage with the batch folded into axis 0 (``[batch * m, ...]``, slice
  ``i`` of axis 0 belongs to batch element ``i // m``): a ``[batch, seq, d]`` value flattened
  to ``[batch * seq, d]``, a conv input ``[batch * T, C, L]``;
* ``"merged"`` (``axis=k``, ``outer``, ``inner``): axis ``k`` holds ``outer * batch * inner``
  (monomials: an int times named dims): element ``j`` of it belongs to batch element
  ``(j // inner) % batch``: torch's ``nn.MultiheadAttention`` views ``[seq, batch, d]`` as
  ``[seq, batch * heads, head_dim]`` (``inner`` = heads) and feeds ``out_proj``
  ``[seq * batch, d]`` (axis 0, ``outer`` = seq); a ``"rows"`` value may carry its ``inner``;
* ``"flat"``: batch-major storage only (a ``Reshape`` whose leading dim could not be shown to be
  a multiple of the batch): still right for the pass's ``[batch, -1, d]`` views (a view that does
  not divide fails in ONNX Runtime's ``Reshape``, never silently), not propagated through ops
  that move data across axes;
* ``"unknown"``: none of these (``where``: the node that lost the batch axis).

The batch comes from the first graph input with a dim (its dim 0, as the index check of
:class:`onnxparam.lora._batched._Graph`) and from every other graph input whose dim 0 is the
same symbol (or, for a static batch, the same size); an input holding the batch's symbol at
another axis has it there; params and initializers have none.

Rules (``k``: a batched input's axis; ops not listed: below):

* elementwise ops (broadcast, right-aligned ranks): the batched inputs must agree on the
  output's axis; ``"rows"`` / ``"flat"`` inputs must have the output's rank;
* ``MatMul`` (and ``Gemm``, ``MatMulInteger``, ``FusedMatMul`` without transposes): a batch on a
  broadcast axis or on ``A``'s rows / ``B``'s columns stays; on the contracted axis it is lost;
* ``Transpose``: the axis moves with ``perm``; ``"rows"`` stays when ``perm[0] == 0``;
* ``Reshape`` / ``Flatten`` / ``Squeeze`` / ``Unsqueeze`` keep the storage order: a batch-major
  input stays batch-major (``"axis" 0`` when the output's dim 0 is the input's, ``"rows"`` when
  it is shown to be a multiple of the batch, else ``"flat"``); a batch on axis ``k > 0`` stays
  only when the leading ``k + 1`` dims are kept;
* ``Slice`` / ``Gather`` / ``GatherElements`` / ``Concat`` / ``Split`` / ``Pad`` / ``Tile`` and
  reductions on other axes keep it, on the batch axis lose it; ``Softmax``-like ops and
  ``LayerNormalization`` keep a batch on an axis before theirs;
* N-first ops (``Conv``, pools, ``BatchNormalization``, ``InstanceNormalization``, ``Resize``
  ...): a batch on axis 0 (``"axis"`` or ``"rows"``) stays;
* ``LSTM`` / ``GRU`` / ``RNN``: ``layout=0`` takes the batch on axis 1 of ``X`` and gives it on
  axis 2 of ``Y`` and 1 of ``Y_h`` / ``Y_c``; ``layout=1`` batch-first throughout (so a
  ``batch_first`` LSTM's transposes round-trip);
* ``Shape`` / ``Size``: none;
* ``Expand`` / ``Tile`` of a value without the batch to a shape whose entry ``k`` is the batch's
  size read by ``Shape`` (``queries.expand(x.shape[0], -1, -1)``: learned queries, DETR /
  Perceiver) from a dim of 1: the batch on axis ``k``, every row the same
  (:mod:`onnxparam.lora._batch_index`);
* ``ScatterND``, ``Compress``, ``NonZero``, ``Unique`` of a batched value lose it; ``Scatter`` /
  ``ScatterElements`` on an axis after a batch on axis 0 keep it;
* an index built from the batch's size (``Range(0, batch)``: Hugging Face's padding-mask
  ``mask[arange(batch)[:, None, None, None], kv_idx]``, a ``Gather`` of the flattened mask or a
  ``GatherND``) keeps the batch: :mod:`onnxparam.lora._batch_index`; any other ``GatherND`` of a
  batched axis loses it;
* ops with subgraphs (``If``, ``Loop``, ``Scan``): unknown when any input or value they capture
  holds the batch;
* any other op: its outputs are ``"axis" 0`` when every batched input is ``"axis" 0`` and the
  output's dim 0 is the batch (by its shape), else unknown.

Batch-major values carry ``count`` (elements per batch element) where static dims tell
(:meth:`_Analysis.static_dims` fills dims the tracer left unknown from constant ``Reshape``
shapes, ``MatMul``, ``Transpose``, ``Split`` and elementwise ops), so a ``Reshape`` to
``[-1, *tail]`` is known to give the batch (``count == prod(tail)``) or whole rows of it.

The batch as a factor of an axis (:meth:`_Analysis.factored`): each value's dims are followed
as monomials of the batch (:meth:`_Analysis.mdims`: static dims, the batch's symbol ``B`` (its
size for a static batch), named dims, and the dims ``Reshape`` shapes computed from ``Shape``
give, ``-1`` solved; a dim the analysis cannot name is a symbol of its own, equal only to
itself). Where the rules above lose the batch at a ``Reshape`` / ``Flatten`` / ``Squeeze`` /
``Unsqueeze`` (storage order kept) or a ``Transpose``, the batch's place in the storage
(``pre`` elements before each batch block, ``post`` after it) gives the output axis ``j`` with
``prod(out[:j]) * outer == pre`` and ``inner * prod(out[j + 1:]) == post``, both exact monomial
divisions, else unknown. A ``"merged"`` axis moves like an ``"axis"`` one through elementwise
ops, ``MatMul`` / ``Gemm`` rows, ``Softmax`` / normalizations on a later axis, ``Slice`` /
``Gather`` / ``Concat`` / reductions on other axes; any other op loses it. A target reads it
through :meth:`onnxparam.lora._batched._Target.branch_factored` (an int ``inner``).

Not followed (unknown, so refused at a target): subgraph bodies; a factor whose dims the
analysis cannot name (a shape computed by ops other than ``Shape`` / ``Gather`` / ``Slice`` /
``Concat`` / ``Unsqueeze`` / ``Cast`` / ``Mul`` / exact ``Div``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import onnx_ir as ir

from ._ir import attr as _attr, dims as _dims, rank as _rank

__all__ = ["Layout", "NONE", "batch_layouts", "describe"]


@dataclass(frozen=True)
class Layout:
    """Where the batch is in one value (module docstring). ``where``: the node (``"name (Op)"``)
    that last moved or lost the batch axis, ``""`` for a graph input."""

    kind: str  # "none" | "axis" | "rows" | "flat" | "merged" | "unknown"
    axis: Optional[int] = None
    where: str = ""
    count: Optional[int] = None  # "rows" / "flat": elements per batch element, when known (static dims)
    outer: Optional[tuple] = None  # "merged": axis ``axis`` is [outer * batch * inner] (monomials, _mono)
    inner: Optional[tuple] = None  # "merged", and "rows" where known: the co-factor after the batch

    @property
    def batched(self) -> bool:
        return self.kind != "none"

    @property
    def batch_major(self) -> bool:
        """Batch-major storage: a ``[batch, -1, ...]`` view of the value is its rows per batch element."""
        return self.kind in ("rows", "flat") or (self.kind == "axis" and self.axis == 0)


NONE = Layout("none")


def describe(layout: Layout) -> str:
    """The layout in words, for an error message."""
    where = f" (since node {layout.where})" if layout.where else ""
    if layout.kind == "axis":
        return f"the batch is on axis {layout.axis}{where}"
    if layout.kind == "unknown":
        return f"the batch axis was lost at node {layout.where}" if layout.where else "the batch axis is unknown"
    if layout.kind == "none":
        return "it does not depend on the batch input"
    if layout.kind == "merged":
        return (f"the batch is a factor of its axis {layout.axis} ({_mono_text(layout.outer)} * batch * "
                f"{_mono_text(layout.inner)}){where}")
    return f"its rows are batch-major{where}"


# -- monomials: a dim as an int times symbols ("B" the batch, ("s", name) a named dim, ("v", id, i)
# / ("?", id, j) a dim or shape entry the analysis cannot name: the same runtime value each time) --

ONE = (1, ())


def _mono(coef: int = 1, syms=()) -> tuple:
    return (int(coef), tuple(sorted(syms, key=repr)))


def _mul(a: tuple, b: tuple) -> tuple:
    return _mono(a[0] * b[0], a[1] + b[1])


def _div(a: tuple, b: tuple) -> Optional[tuple]:
    """``a / b`` when it is a monomial (``b``'s symbols among ``a``'s, the coefficient divides), else ``None``."""
    if b[0] == 0 or a[0] % b[0]:
        return None
    rest = list(a[1])
    for sym in b[1]:
        if sym not in rest:
            return None
        rest.remove(sym)
    return (a[0] // b[0], tuple(rest))


def _prod(monos) -> Optional[tuple]:
    out = ONE
    for m in monos:
        if m is None:
            return None
        out = _mul(out, m)
    return out


def _mono_text(m: Optional[tuple]) -> str:
    if m is None:
        return "?"
    names = [s if s == "B" else (s[1] if s[0] == "s" else "?") for s in m[1]]
    return "*".join(([str(m[0])] if m[0] != 1 or not names else []) + names)


def _label(node: ir.Node) -> str:
    return f"{node.name!r} ({node.op_type})"


def _const(value) -> Optional[np.ndarray]:
    """``value``'s constant contents (an initializer or a ``Constant`` node's output), or ``None``."""
    if value is None:
        return None
    c = value.const_value
    if c is not None:
        try:
            return np.asarray(c.numpy())
        except Exception:  # noqa: BLE001 - an external / lazy tensor: not a constant we can read
            return None
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
        attr = producer.attributes.get("value")
        if attr is not None and attr.value is not None:
            try:
                return np.asarray(attr.value.numpy())
            except Exception:  # noqa: BLE001
                return None
        for name in ("value_int", "value_ints"):
            attr = producer.attributes.get(name)
            if attr is not None:
                return np.asarray(attr.value)
    return None


_ELEMENTWISE = {
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not", "BitShift", "BitwiseAnd", "BitwiseOr",
    "BitwiseXor", "BitwiseNot", "Mod", "PRelu", "Relu", "Sigmoid", "Tanh", "Erf", "Gelu", "Exp", "Log", "Sqrt",
    "Neg", "Abs", "Cast", "CastLike", "Identity", "Dropout", "Clip", "Sign", "Reciprocal", "Floor", "Ceil",
    "Round", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
    "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Softplus", "Softsign",
    "Mish", "IsNaN", "IsInf", "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Shrink",
    "FastGelu", "BiasGelu", "QuickGelu", "BiasAdd", "Swish",
}
_N_FIRST = {
    "Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool",
    "GlobalMaxPool", "GlobalLpPool", "BatchNormalization", "InstanceNormalization", "LRN", "Resize", "Upsample",
    "DepthToSpace", "SpaceToDepth", "GroupNormalization", "MaxUnpool", "Col2Im", "DeformConv",
}
_REDUCE = {
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare",
}
_LAST_AXIS = {"Softmax", "LogSoftmax", "Hardmax", "LayerNormalization", "SimplifiedLayerNormalization",
              "RMSNormalization", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "CumSum", "TopK",
              "ArgMax", "ArgMin", "LpNormalization", "ReverseSequence"}
_NO_BATCH = {"Shape", "Size"}
_STORAGE_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")  # the storage order kept


class _Analysis:
    def __init__(self, graph: ir.Graph, none_values: set):
        self.graph = graph
        self.none_values = none_values
        self.layouts: dict = {}
        self.batch = None
        self.shapes: dict = {}  # id(int64 1-d / scalar value) -> [token], computed from Shape ops
        self.consts: dict = {}  # id(value) -> small int array folded from constants (pads, axes, shapes)
        self._mdims: dict = {}  # id(value) -> [monomial dim]: the dims in terms of the batch (mdims)
        self._smonos: dict = {}  # id(int shape-like value) -> [monomial or None]: its entries (shape_mono)
        from ._batch_index import IndexFacts

        self.index = IndexFacts(self)  # arange(batch) indices (padding-mask gathers)

    def const(self, value) -> Optional[np.ndarray]:
        if value is None:
            return None
        hit = self.consts.get(id(value))
        return hit if hit is not None else _const(value)

    def axes(self, node: ir.Node, input_index: int = 1) -> Optional[list]:
        attr = node.attributes.get("axes")
        if attr is not None:
            return [int(a) for a in attr.value]
        if len(node.inputs) > input_index and node.inputs[input_index] is not None:
            c = self.const(node.inputs[input_index])
            return None if c is None else [int(a) for a in np.ravel(c)]
        return []

    def fold(self, node: ir.Node) -> None:
        """Fold a small integer op of constants (torch's TorchScript exporter builds ``Pad``'s pads
        and some shapes from constants this way)."""
        if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1 or node.op_type not in _FOLDED:
            return
        args = [self.const(v) if v is not None else None for v in node.inputs]
        if any(a is None for a, v in zip(args, node.inputs) if v is not None) or not args and \
                node.op_type != "ConstantOfShape":
            return
        if any(a is not None and (a.dtype.kind not in "iub" or a.size > 4096) for a in args):
            return
        try:
            out = _fold(node, args)
        except (ValueError, IndexError, TypeError):
            return
        if out is not None and out.size <= 4096:
            self.consts[id(node.outputs[0])] = out

    def per_batch(self, layout: Layout, value) -> Optional[int]:
        """Elements per batch element of a batch-major ``value`` (storage order kept by a
        ``Reshape``), when its dims tell."""
        if layout.count is not None:
            return layout.count
        dims = self.static_dims(value)
        if dims is None or not all(isinstance(d, int) for d in dims[1:]):
            return None
        if layout.kind == "axis" and layout.axis == 0:
            return int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if isinstance(self.batch, int) and self.batch > 0 and dims and isinstance(dims[0], int):
            total = int(np.prod(dims))
            return total // self.batch if total % self.batch == 0 else None
        return None

    def per_batch_factor(self, layout: Layout, value) -> Optional[int]:
        """A number that divides the elements per batch element of a batch-major ``value``: the
        count when known, else for a batch on axis 0 the product of the static dims after it (a
        symbolic dim multiplies it by an unknown integer)."""
        count = self.per_batch(layout, value)
        if count is not None:
            return count
        if layout.kind != "axis" or layout.axis != 0:
            return None
        dims = self.static_dims(value) or _dims(value)
        if dims is None:
            return None
        return int(np.prod([d for d in dims[1:] if isinstance(d, int) and d > 0])) if len(dims) > 1 else 1

    # -- shape values: what a computed Reshape shape holds -------------------------------------

    def dim_token(self, value, i: int):
        """Dim ``i`` of ``value`` as a comparable token: ``"B"`` where the batch is (``"axis"``
        ``i``), an int, a named symbol, else one unique to the value and axis."""
        layout = self.of(value)
        if layout.kind == "axis" and layout.axis == i:
            return "B"
        dims = _dims(value)
        if dims is not None and i < len(dims) and dims[i] is not None:
            return ("n", dims[i]) if isinstance(dims[i], int) else ("s", dims[i])
        return ("v", id(value), i)

    def tokens(self, value) -> Optional[list]:
        """A shape-like int value's entries as tokens (:meth:`dim_token`), or ``None``."""
        if value is None:
            return None
        hit = self.shapes.get(id(value))
        if hit is not None:
            return hit
        c = self.const(value)
        if c is not None and c.dtype.kind in "iu" and c.ndim <= 1:
            return [("n", int(v)) for v in np.ravel(c)]
        dims = _dims(value)
        if dims is not None and len(dims) <= 1 and all(isinstance(d, int) for d in dims):
            return [("?", id(value), j) for j in range(dims[0] if dims else 1)]  # entries not followed
        return None

    def shape_value(self, node: ir.Node) -> None:
        """Follow ``Shape`` through the int ops torch's exporters build a ``Reshape`` shape with."""
        op, out = node.op_type, node.outputs[0] if node.outputs else None
        if out is None or node.domain not in ("", "ai.onnx"):
            return
        found = None
        if op == "Shape":
            rank = _rank(node.inputs[0])
            if rank is None:
                return
            start, end = int(_attr(node, "start", 0)), _attr(node, "end", None)
            axes = list(range(rank))[slice(start, None if end is None else int(end))]
            found = [self.dim_token(node.inputs[0], i) for i in axes]
        elif op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape") and len(node.inputs) >= 1:
            hit = self.tokens(node.inputs[0])
            if hit is not None and (len(hit) <= 1 or op in ("Cast", "Identity", "Reshape")):
                found = list(hit)  # a scalar made 1-d (or back), a 1-d shape kept 1-d
        elif op == "Concat":
            parts = [self.tokens(v) for v in node.inputs]
            if all(p is not None for p in parts):
                found = [t for p in parts for t in p]
        elif op == "Gather":
            data, idx = self.tokens(node.inputs[0]), self.const(node.inputs[1])
            if data is not None and idx is not None and idx.ndim <= 1:
                found = [data[int(i)] for i in np.ravel(idx)]
        elif op == "Slice":
            data = self.tokens(node.inputs[0])
            starts, ends = (self.const(v) if v is not None else None for v in node.inputs[1:3])
            if data is not None and starts is not None and ends is not None and len(node.inputs) <= 4:
                found = data[int(np.ravel(starts)[0]):int(np.ravel(ends)[0])]
        if found is not None:
            self.shapes[id(out)] = found

    # -- inputs --------------------------------------------------------------------------------

    def seed(self) -> None:
        inputs = [v for v in self.graph.inputs
                  if not (v.is_initializer() or v.const_value is not None or id(v) in self.none_values)]
        source = next((v for v in inputs if _dims(v)), None)
        for value in self.graph.inputs:
            self.layouts[id(value)] = NONE
        if source is None:
            return
        self.batch = _dims(source)[0]
        for value in inputs:
            dims = _dims(value)
            if dims is None:
                self.layouts[id(value)] = Layout("unknown", where=f"graph input {value.name!r} (no shape)")
            elif dims and dims[0] == self.batch:
                self.layouts[id(value)] = Layout("axis", 0)
            elif isinstance(self.batch, str) and self.batch in dims:
                self.layouts[id(value)] = Layout("axis", dims.index(self.batch), f"graph input {value.name!r}")

    def of(self, value) -> Layout:
        if value is None:
            return NONE
        return self.layouts.get(id(value), NONE)

    # -- the walk ------------------------------------------------------------------------------

    def run(self) -> dict:
        self.seed()
        for node in self.graph:
            self.fold(node)
            self.shape_value(node)
            for value in node.outputs:  # in graph order: each producer's inputs are known first (no deep recursion)
                self.mdims(value)
            self.shape_mono(node)
            self.index.track(node)
            outs = self.node(node)
            for value, layout in zip(node.outputs, outs):
                if value is not None:
                    self.layouts[id(value)] = layout
        return self.layouts

    def node(self, node: ir.Node) -> list:
        n_out = len(node.outputs)
        ins = [self.of(v) for v in node.inputs]
        if any(isinstance(a.value, (ir.Graph, list)) and a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
               for a in node.attributes.values()):
            captured = any(self.of(v).batched for v in _captured(node))  # outer values are in the map
            if any(l.batched for l in ins) or captured:
                return [Layout("unknown", where=_label(node))] * n_out
            return [NONE] * n_out
        batched = [l for l in ins if l.batched]
        if not batched and node.op_type in ("Expand", "Tile") and len(node.inputs) == 2:
            axis = self.index.broadcast_to_batch(node)  # learned queries expanded to the batch
            if axis is not None:
                return [Layout("axis", axis, _label(node))] * n_out
        batched = [l for l in ins if l.batched]
        if not batched or node.op_type in _NO_BATCH:
            return [NONE] * n_out
        lost = next((l for l in batched if l.kind == "unknown"), None)
        if lost is not None:
            return [lost] * n_out
        op = node.op_type
        try:
            out = self.rule(node, op, ins)
        except (TypeError, ValueError, IndexError):  # an attribute / constant of an unexpected form
            out = None
        if out is None:
            out = self.fallback(node, ins)
        if isinstance(out, Layout) and out.kind in ("unknown", "flat") and op in _STORAGE_OPS + ("Transpose",) \
                and ins[0].kind in ("axis", "rows", "merged") and not any(l.batched for l in ins[1:]):
            out = self.factored(node, op, ins[0]) or out  # the batch as a factor of an axis
        if isinstance(out, Layout):
            out = [out] * n_out
        if op not in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Split"):  # a count only where computed
            out = [l if l.count is None or (op in ("Gemm", "MatMul") and l.kind == "rows") else
                   replace(l, count=None) for l in out]
        out = [self.keep_count(node, op, ins, l) for l in out]
        return [l if l.kind != "unknown" or l.where else Layout("unknown", where=_label(node)) for l in out]

    def keep_count(self, node: ir.Node, op: str, ins: list, layout: Layout) -> Layout:
        """``layout`` with the elements per batch element of the batched input when ``op`` keeps
        the shape (elementwise without broadcasting it up, ``Transpose``, normalizations)."""
        if layout.count is not None or not layout.batch_major or not (
                op in _ELEMENTWISE or op in ("Transpose", "Softmax", "LogSoftmax", "LayerNormalization",
                                             "SimplifiedLayerNormalization", "RMSNormalization",
                                             "SkipLayerNormalization", "SkipSimplifiedLayerNormalization")):
            return layout
        out = node.outputs[0]
        count = self.per_batch(Layout(layout.kind, layout.axis), out)  # from the output's own dims
        if count is not None:
            return replace(layout, count=count)
        out_rank = _rank(out)
        for l, v in zip(ins, node.inputs):
            if l.batch_major and (l.kind, l.axis) == (layout.kind, layout.axis) and _rank(v) == out_rank \
                    and self.not_broadcast_up(node, v):
                count = self.per_batch(l, v)
                if count is not None:
                    return replace(layout, count=count)
        return layout

    def not_broadcast_up(self, node: ir.Node, value) -> bool:
        """Whether no other input of ``node`` can make its output larger than ``value`` (each of
        their dims 1, or an int equal to ``value``'s; ranks not above ``value``'s)."""
        dims = self.static_dims(value)
        if dims is None:
            return False
        if node.op_type not in _ELEMENTWISE:
            return True  # Transpose, normalizations: the output is input 0's size
        for other in node.inputs:
            if other is None or other is value:
                continue
            od = self.static_dims(other)
            if od is None or len(od) > len(dims):
                return False
            for i, d in enumerate(od):
                mine = dims[i + len(dims) - len(od)]
                if not (d == 1 or (isinstance(d, int) and d == mine)):
                    return False
        return True

    def rule(self, node: ir.Node, op: str, ins: list):
        gone = Layout("unknown", where=_label(node))
        out_rank = _rank(node.outputs[0]) if node.outputs else None
        if op in _ELEMENTWISE:
            if op == "CastLike":
                ins = ins[:1]
            if op in ("QuantizeLinear", "DequantizeLinear", "Clip", "PRelu", "DynamicQuantizeLinear"):
                if any(l.batched for l in ins[1:]):
                    return gone
                ins = ins[:1]
            return self.broadcast(node, [(l, v) for l, v in zip(ins, node.inputs)], out_rank)
        if op in ("MatMul", "MatMulInteger", "Gemm", "FusedMatMul", "MatMulNBits", "QLinearMatMul"):
            return self.matmul(node, op, ins)
        if op == "Transpose":
            l = ins[0]
            rank = _rank(node.inputs[0])
            perm = _attr(node, "perm")
            if perm is None:
                if rank is None:
                    return gone
                perm = list(reversed(range(rank)))
            perm = [int(p) for p in perm]
            if l.kind == "merged":
                return self.factored(node, op, l)
            if l.kind == "axis":
                return replace(l, axis=perm.index(l.axis), where=_label(node)) if perm.index(l.axis) != l.axis else l
            if l.kind == "rows" and perm[0] == 0:
                return l
            return gone
        if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
            if any(l.batched for l in ins[1:]):
                return gone
            return self.reshape(node, op, ins[0])
        if op == "Expand":
            if ins[1].batched:
                return gone
            return self.broadcast(node, [(ins[0], node.inputs[0])], out_rank)
        if op in ("Slice", "Pad", "Tile"):
            if any(l.batched for l in ins[1:]):
                return gone
            return self.keep_unless(node, ins[0], self.touched(node, op))
        if op in ("Gather", "GatherElements"):
            return self.gather(node, op, ins)
        if op in ("ScatterND", "Scatter", "ScatterElements", "Compress", "NonZero", "Unique"):
            # NOTE: rows written / picked by data-dependent indices: the output's dim 0 being the
            # batch (the fallback's test) says nothing of which row went where
            if op in ("Scatter", "ScatterElements") and int(_attr(node, "axis", 0)) not in (0, -(out_rank or 0)) \
                    and out_rank is not None and all(l.kind == "axis" and l.axis == 0 for l in ins if l.batched) \
                    and all(_rank(v) == out_rank for v, l in zip(node.inputs, ins) if l.batched):
                return Layout("axis", 0)  # each row scattered within itself
            return gone
        if op == "GatherND":
            found = self.index.gather_nd(node, ins)
            return gone if found is None else (Layout("axis", found, _label(node)) if isinstance(found, int) else found)
        if op == "Concat":
            axis = int(_attr(node, "axis", 0))
            rank = out_rank if out_rank is not None else _rank(node.inputs[0])
            return self.same_layout(node, ins, axis, rank)
        if op == "Split":
            if any(l.batched for l in ins[1:]):
                return gone
            axis = int(_attr(node, "axis", 0))
            out = self.same_layout(node, ins[:1], axis, _rank(node.inputs[0]))
            return self.split_counts(node, out, axis)
        if op in _REDUCE:
            return self.reduce(node, op, ins)
        if op in _LAST_AXIS:
            if any(l.batched for l in ins[1:]) and op not in ("SkipLayerNormalization",
                                                            "SkipSimplifiedLayerNormalization"):
                return gone
            rank = _rank(node.inputs[0])
            default = 1 if op in ("ArgMax", "ArgMin") else -1
            if op in ("ArgMax", "ArgMin", "CumSum", "TopK"):
                axis = int(_attr(node, "axis", 0 if op in ("ArgMax", "ArgMin") else -1))
                if op == "CumSum":
                    c = self.const(node.inputs[1])
                    if c is None:
                        return gone
                    axis = int(np.ravel(c)[0])
            else:
                axis = int(_attr(node, "axis", default))
            if op == "ReverseSequence":
                return gone
            if rank is None:
                return gone if axis >= 0 else None
            axis = axis + rank if axis < 0 else axis
            main = ins[0]
            if op.startswith("Skip"):
                main = self.broadcast(node, [(l, v) for l, v in zip(ins[:2], node.inputs[:2])], rank)
            if op in ("ArgMax", "ArgMin") and not int(_attr(node, "keepdims", 1)):
                return self.keep_unless(node, main, {axis}, removed={axis})
            # NOTE: before opset 13 Softmax flattens to 2-d at its axis: a batch before the axis
            # is safe in both readings, one after it only in the newer one (not claimed)
            if main.kind in ("axis", "merged") and main.axis < axis:
                return main
            if main.kind == "rows" and axis > 0:
                return main
            return gone
        if op in _N_FIRST:
            if any(l.batched for l in ins[1:]):
                return gone
            if ins[0].kind == "axis" and ins[0].axis == 0 or ins[0].kind == "rows":
                return ins[0]
            return gone
        if op in ("LSTM", "GRU", "RNN"):
            return self.recurrent(node, ins)
        return None

    # -- rules ---------------------------------------------------------------------------------

    def broadcast(self, node: ir.Node, pairs: list, out_rank: Optional[int]):
        gone = Layout("unknown", where=_label(node))
        ranks = [_rank(v) for _, v in pairs if v is not None]
        if out_rank is None:
            out_rank = max(ranks) if ranks and None not in ranks else None
        found = []
        for layout, value in pairs:
            if not layout.batched:
                continue
            rank = _rank(value)
            if rank is None or out_rank is None:
                found.append(layout if all(r is None or r == (rank or r) for r in ranks) else gone)
                continue
            if layout.kind in ("axis", "merged"):
                axis = layout.axis + out_rank - rank
                found.append(layout if axis == layout.axis else replace(layout, axis=axis, where=_label(node)))
            elif rank == out_rank:
                found.append(layout)
            else:
                return gone
        return self.merge(node, found)

    def split_counts(self, node: ir.Node, layout: Layout, axis: int):
        """``Split``'s outputs, each with its share of the elements per batch element."""
        plain = Layout(layout.kind, layout.axis, layout.where)
        count = self.per_batch(layout, node.inputs[0]) if layout.batch_major else None
        dims = self.static_dims(node.inputs[0])
        if count is None or dims is None:
            return plain
        axis = axis + len(dims) if axis < 0 else axis
        sizes = self.const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        sizes = [int(v) for v in np.ravel(sizes)] if sizes is not None else _attr(node, "split")
        whole = dims[axis] if isinstance(dims[axis], int) else (sum(sizes) if sizes else None)
        if not sizes and whole is not None and whole % len(node.outputs) == 0:
            sizes = [whole // len(node.outputs)] * len(node.outputs)
        if not sizes or not whole or len(sizes) != len(node.outputs) or any((count * v) % whole for v in sizes):
            return plain
        return [Layout(layout.kind, layout.axis, layout.where, count=count * v // whole) for v in sizes]

    def static_dims(self, value, depth: int = 0) -> Optional[list]:
        """``value``'s dims, unknown ones filled where the ops that made it tell: a constant
        ``Reshape`` shape's positive entries, ``MatMul``, ``Transpose``, ``Split`` and shape-keeping
        ops of inputs whose dims are known (the tracer leaves some unknown)."""
        if value is None:
            return None
        memo = self.__dict__.setdefault("_static", {})
        if id(value) in memo:
            return memo[id(value)]
        dims = _dims(value)
        producer = value.producer()
        if depth < 64 and producer is not None and (dims is None or not all(isinstance(d, int) for d in dims)) \
                and producer.domain in ("", "ai.onnx"):
            found = self._infer_dims(producer, value, dims, depth + 1)
            if found is not None:
                dims = found
        memo[id(value)] = dims
        return dims

    def _infer_dims(self, node: ir.Node, value, dims, depth: int) -> Optional[list]:
        op = node.op_type

        def merge(found):
            if found is None or (dims is not None and len(dims) != len(found)):
                return None
            return [f if isinstance(f, int) else (dims[i] if dims is not None else None) for i, f in enumerate(found)]

        if op == "Reshape" and len(node.inputs) > 1:
            shape = self.const(node.inputs[1])
            if shape is None:
                return None
            entries = [int(v) for v in np.ravel(shape)]
            src = self.static_dims(node.inputs[0], depth)
            found = [e if e > 0 else (src[i] if e == 0 and src is not None and i < len(src) else None)
                     for i, e in enumerate(entries)]
            if src is not None and all(isinstance(d, int) for d in src) and entries.count(-1) == 1:
                known = [d for d in found if isinstance(d, int)]
                if known and int(np.prod(src)) % int(np.prod(known)) == 0:
                    found[entries.index(-1)] = int(np.prod(src)) // int(np.prod(known))
            return merge(found)
        if op == "Transpose":
            src = self.static_dims(node.inputs[0], depth)
            perm = _attr(node, "perm")
            if src is None:
                return None
            perm = [int(p) for p in perm] if perm is not None else list(reversed(range(len(src))))
            return merge([src[p] for p in perm])
        if op == "MatMul" and len(node.inputs) == 2:
            a, b = self.static_dims(node.inputs[0], depth), self.static_dims(node.inputs[1], depth)
            if a is None or b is None or len(a) < 2 or len(b) < 2:
                return None
            lead_a, lead_b = a[:-2], b[:-2]
            rank = max(len(lead_a), len(lead_b))
            lead_a, lead_b = [1] * (rank - len(lead_a)) + lead_a, [1] * (rank - len(lead_b)) + lead_b
            lead = [x if x == y or y == 1 else (y if x == 1 else (x if isinstance(x, int) else y))
                    for x, y in zip(lead_a, lead_b)]
            return merge(lead + [a[-2], b[-1]])
        if op == "Split":
            src = self.static_dims(node.inputs[0], depth)
            if src is None:
                return None
            axis = int(_attr(node, "axis", 0))
            axis = axis + len(src) if axis < 0 else axis
            sizes = self.const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
            sizes = [int(v) for v in np.ravel(sizes)] if sizes is not None else _attr(node, "split")
            whole = src[axis]
            if not sizes and isinstance(whole, int) and whole % len(node.outputs) == 0:
                sizes = [whole // len(node.outputs)] * len(node.outputs)
            if not sizes or len(sizes) != len(node.outputs):
                return None
            index = next(i for i, o in enumerate(node.outputs) if o is value)
            return merge(src[:axis] + [sizes[index]] + src[axis + 1:])
        if op in _ELEMENTWISE or op in _LAST_AXIS and op not in ("TopK", "ArgMax", "ArgMin"):
            ranks = [_rank(v) for v in node.inputs if v is not None]
            out_rank = dims and len(dims) or (max(ranks) if ranks and None not in ranks else None)
            if out_rank is None or op in ("CastLike",) and False:
                return None
            found = [None] * out_rank
            for v in node.inputs[:1] if op in _LAST_AXIS else node.inputs:
                src = self.static_dims(v, depth) if v is not None else None
                if src is None:
                    continue
                for i, d in enumerate(src):
                    j = i + out_rank - len(src)
                    if 0 <= j < out_rank and isinstance(d, int) and d != 1:
                        found[j] = d
                    elif 0 <= j < out_rank and d == 1 and found[j] is None:
                        found[j] = None
            return merge(found)
        return None

    def scaled_rows(self, layout: Layout, x, y) -> Layout:
        """A ``"rows"`` layout through an op changing the last dim only (``MatMul``'s ``K -> N``):
        the elements per batch element scale by ``N / K``."""
        count = self.per_batch(layout, x)
        xd, yd = _dims(x), _dims(y)
        node = y.producer()
        if node is not None and node.op_type in ("MatMul", "Gemm") and len(node.inputs) > 1 \
                and node.inputs[1] is not None:
            wd = _dims(node.inputs[1])  # K and N from the weight when the activations' dims are not known
            if wd is not None and len(wd) == 2:
                k, n = (wd[1], wd[0]) if node.op_type == "Gemm" and int(_attr(node, "transB", 0)) else (wd[0], wd[1])
                xd = (xd or [None])[:-1] + [k] if not xd or not isinstance(xd[-1], int) else xd
                yd = (yd or [None])[:-1] + [n] if not yd or not isinstance(yd[-1], int) else yd
        if count is None or not xd or not yd or not isinstance(xd[-1], int) or not isinstance(yd[-1], int) \
                or xd[-1] <= 0 or (count * yd[-1]) % xd[-1]:
            return Layout("rows", where=layout.where)
        return Layout("rows", where=layout.where, count=count * yd[-1] // xd[-1])

    def merge(self, node: ir.Node, found: list):
        if not found:
            return NONE
        kinds = {(l.kind, l.axis) for l in found}
        if any(l.kind == "merged" for l in found):
            same = {(l.kind, l.axis, l.outer, l.inner) for l in found}
            return found[0] if len(same) == 1 else Layout("unknown", where=_label(node))
        if len(kinds) == 1:
            return found[0]
        if kinds <= {("axis", 0), ("rows", None)}:
            return next(l for l in found if l.kind == "rows")
        if kinds <= {("axis", 0), ("rows", None), ("flat", None)}:
            return next(l for l in found if l.kind == "flat")
        return Layout("unknown", where=_label(node))

    def matmul(self, node: ir.Node, op: str, ins: list):
        gone = Layout("unknown", where=_label(node))
        if op == "Gemm":
            if any(l.batched for l in ins[1:]) or int(_attr(node, "transA", 0)):
                return gone
            a = ins[0]
            if a.kind == "flat" and a.count is None:
                # NOTE: batch-major storage whose elements per batch element are not known (a symbolic
                # dim): Gemm keeps it when each batch element holds whole rows of A, which every use
                # of a "flat" value checks at run time (the [batch, -1, d] Reshape of a branch fails
                # in ONNX Runtime otherwise): dynamo's GPT-2 attention output, [b*s, d] from [b, s, h, hd]
                return Layout("flat", where=a.where)
            if a.kind == "rows" or a.kind == "flat" and a.count is not None:
                # a flat input whose batch elements hold whole rows (count a multiple of K) is rows
                scaled = self.scaled_rows(a, node.inputs[0], node.outputs[0])
                return scaled if a.kind == "rows" or scaled.count is not None else gone
            return a if a.kind in ("axis", "merged") and a.axis == 0 else gone  # A's rows: the output's
        if op == "FusedMatMul" and any(int(_attr(node, k, 0)) for k in ("transA", "transB", "transBatchA",
                                                                            "transBatchB")):
            return gone
        pairs = [(ins[0], node.inputs[0])]
        if op in ("MatMul", "MatMulInteger", "FusedMatMul"):
            pairs.append((ins[1], node.inputs[1]))
        elif any(l.batched for l in ins[1:]):
            return gone
        out_rank = _rank(node.outputs[0])
        found = []
        for side, (layout, value) in enumerate(pairs):
            if not layout.batched:
                continue
            rank = _rank(value)
            if rank is None or out_rank is None or rank < 2:
                return gone
            if layout.kind in ("axis", "merged"):
                k = layout.axis
                if (side == 0 and k == rank - 1) or (side == 1 and k == rank - 2):
                    return gone  # the contracted axis
                if side == 0 and k == rank - 2:
                    axis = out_rank - 2
                elif side == 1 and k == rank - 1:
                    axis = out_rank - 1
                else:
                    axis = k + out_rank - rank
                found.append(layout if axis == k else replace(layout, axis=axis, where=_label(node)))
            elif layout.kind == "rows" and rank == out_rank and (side == 0 or rank > 2):
                found.append(self.scaled_rows(layout, value, node.outputs[0]))
            else:
                return gone
        return self.merge(node, found)

    def reshape(self, node: ir.Node, op: str, layout: Layout):
        gone = Layout("unknown", where=_label(node))
        x, y = node.inputs[0], node.outputs[0]
        in_dims, out_dims = _dims(x), _dims(y)
        if op in ("Squeeze", "Unsqueeze"):
            axes = self.axes(node)
            rank = _rank(x)
            if axes is not None and rank is not None and (axes or op == "Unsqueeze"):
                out_rank = rank + len(axes) if op == "Unsqueeze" else rank - len(axes)
                axes = sorted(a + (out_rank if op == "Unsqueeze" else rank) if a < 0 else a for a in axes)
                if op == "Unsqueeze":
                    kept = [i for i in range(out_rank) if i not in axes]  # kept[j]: input axis j's position
                else:
                    kept = [i for i in range(rank) if i not in axes]
                    kept = [kept.index(i) if i in kept else None for i in range(rank)]
                if layout.kind == "axis":
                    moved = kept[layout.axis]
                    if moved is None:
                        return gone
                    return layout if moved == layout.axis else Layout("axis", moved, _label(node))
                if layout.kind == "rows":
                    return layout if kept[0] == 0 else Layout("flat", where=_label(node))
                return layout if layout.kind == "flat" else gone
        shape = self.const(node.inputs[1]) if op == "Reshape" and len(node.inputs) > 1 else None
        entries = self.tokens(node.inputs[1]) if op == "Reshape" and len(node.inputs) > 1 else None
        if op == "Flatten":
            axis = int(_attr(node, "axis", 1))
            rank = _rank(x)
            if rank is not None and axis < 0:
                axis += rank
            if layout.kind == "axis" and layout.axis == 0 and axis == 1:
                return layout
            if layout.kind == "axis" and 0 < layout.axis < axis:
                return Layout("unknown", where=_label(node))
            if (layout.kind == "axis" and layout.axis == 0 or layout.kind == "rows") and axis >= 1:
                return Layout("rows", where=_label(node))
            return Layout("flat", where=_label(node)) if layout.batch_major else gone
        # Reshape (or a Squeeze / Unsqueeze whose axes are not known): storage order kept
        if layout.kind == "axis" and layout.axis > 0:
            k = layout.axis
            if in_dims is None:
                return gone
            lead = self.kept_lead(x, in_dims, out_dims, entries)
            return layout if lead > k else gone
        if not layout.batch_major:
            return gone
        lead = self.kept_lead(x, in_dims, out_dims, entries) if in_dims is not None else 0
        if lead >= 1 and layout.kind in ("axis", "rows"):
            return layout  # dim 0 kept: the same slices of axis 0
        if (out_dims and self.batch is not None and out_dims[0] == self.batch) or (entries and entries[0] == "B"):
            return Layout("axis", 0, _label(node))  # batch-major storage, dim 0 the batch: exactly it
        count = self.per_batch(layout, x)
        tail = None
        if out_dims is not None and len(out_dims) >= 1 and all(isinstance(d, int) for d in out_dims[1:]):
            tail = int(np.prod(out_dims[1:])) if len(out_dims) > 1 else 1
        elif entries and all(t[0] == "n" and t[1] > 0 for t in entries[1:] if isinstance(t, tuple)) \
                and all(isinstance(t, tuple) for t in entries[1:]):
            tail = int(np.prod([t[1] for t in entries[1:]])) if len(entries) > 1 else 1
        if count is not None and tail:
            if count == tail:
                return Layout("axis", 0, _label(node), count=count)  # one batch element per slice of axis 0
            if count % tail == 0:
                return Layout("rows", where=_label(node), count=count)
            return Layout("flat", where=_label(node), count=count)
        if self.multiple_of_batch(in_dims, out_dims, shape, layout) or self.leading_merge(x, entries, layout):
            return Layout("rows", where=_label(node), count=count)
        factor = self.per_batch_factor(layout, x) if count is None else None
        if factor and tail and factor % tail == 0:
            # NOTE: each batch element's count is a multiple of the output's slice of axis 0 (its static
            # dims divide it, whatever the symbolic ones are): it fills whole slices, in batch order
            return Layout("rows", where=_label(node))
        return Layout("flat", where=_label(node), count=count)

    def kept_lead(self, x, in_dims, out_dims, entries) -> int:
        """How many leading dims a ``Reshape`` provably keeps: ``0`` entries of its shape, entries
        equal to the input's dim (:meth:`tokens`: the batch, an int, a named symbol, a dim read
        by ``Shape``), or equal output dims, after kept ones (the same sizes in front: the same
        storage blocks)."""
        n = 0
        for i, d in enumerate(in_dims):
            entry = entries[i] if entries is not None and i < len(entries) else None
            if entry == ("n", 0) or (entry is not None and entry == self.dim_token(x, i)):
                n += 1
                continue
            if out_dims is not None and i < len(out_dims) and d is not None and out_dims[i] == d:
                n += 1
                continue
            break
        if entries is not None and n < len(entries) and n < len(in_dims) and entries[n] == ("n", -1):
            # [*kept, -1, *tail] with tail the input's dims after axis n merged: the -1 is axis n
            tail, rest = entries[n + 1:], list(range(n + 1, len(in_dims)))
            if tail == [self.dim_token(x, j) for j in rest]:
                return n + 1
            ints = [t[1] for t in tail if t[0] == "n"]
            if len(ints) == len(tail) and all(isinstance(in_dims[j], int) for j in rest) and \
                    all(v > 0 for v in ints) and int(np.prod(ints)) == int(np.prod([in_dims[j] for j in rest])):
                return n + 1
        return n

    def leading_merge(self, x, entries, layout: Layout) -> bool:
        """A ``Reshape`` to ``[-1, *tail]`` whose ``tail`` is the input's trailing dims (by
        :meth:`tokens`): the leading dims merged, a multiple of the batch."""
        if layout.kind == "flat" or not entries or entries[0] != ("n", -1):
            return False
        rank = _rank(x)
        tail = entries[1:]
        if rank is None or len(tail) >= rank:
            return False
        return all(t == self.dim_token(x, rank - len(tail) + i) and t != "B" for i, t in enumerate(tail))

    def multiple_of_batch(self, in_dims, out_dims, shape, layout: Layout) -> bool:
        """Whether a batch-major ``Reshape``'s output dim 0 is a multiple of the batch: static
        dims divide, or the shape is ``[-1, *tail]`` with ``tail`` the input's trailing dims."""
        if out_dims and isinstance(out_dims[0], int) and isinstance(self.batch, int) and self.batch > 0 \
                and out_dims[0] % self.batch == 0:
            return True  # batch-major storage: each slice of axis 0 within one batch element
        if layout.kind == "flat":
            return False
        if shape is not None and in_dims is not None and np.size(shape) >= 1 and int(np.ravel(shape)[0]) == -1:
            tail = [int(v) for v in np.ravel(shape)[1:]]
            if all(v > 0 for v in tail):
                product = int(np.prod(tail)) if tail else 1
                acc = 1
                for d in reversed(in_dims[1:]):
                    if not isinstance(d, int):
                        break
                    acc *= d
                    if acc == product:
                        return True
                if product == 1 and not tail:
                    return False
        return False

    def touched(self, node: ir.Node, op: str) -> Optional[set]:
        """The axes a ``Slice`` / ``Pad`` / ``Tile`` changes (``None``: not known)."""
        rank = _rank(node.inputs[0])
        if op == "Slice":
            if len(node.inputs) < 3:
                return None
            starts, ends = self.const(node.inputs[1]), self.const(node.inputs[2])
            axes = self.const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
            steps = self.const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
            if starts is None or ends is None:
                axes_only = axes
                if axes_only is None or rank is None:
                    return None
                return {int(a) + rank if int(a) < 0 else int(a) for a in np.ravel(axes_only)}
            starts, ends = np.ravel(starts), np.ravel(ends)
            axes = np.ravel(axes) if axes is not None else np.arange(len(starts))
            steps = np.ravel(steps) if steps is not None else np.ones(len(starts), dtype=np.int64)
            dims = _dims(node.inputs[0])
            out = set()
            for s, e, a, st in zip(starts, ends, axes, steps):
                a = int(a)
                if a < 0:
                    if rank is None:
                        return None
                    a += rank
                full = int(s) == 0 and int(st) == 1 and (int(e) >= 2 ** 31 - 1 or (
                    dims is not None and isinstance(dims[a], int) and int(e) >= dims[a]))
                if not full:
                    out.add(a)
            return out
        if op == "Pad":
            pads = self.const(node.inputs[1]) if len(node.inputs) > 1 else None
            if pads is None:
                pads = _attr(node, "pads")
            if pads is None or rank is None:
                return None
            pads = [int(p) for p in np.ravel(pads)]
            axes = self.const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
            axes = [int(a) + rank if int(a) < 0 else int(a) for a in np.ravel(axes)] if axes is not None \
                else list(range(rank))
            half = len(pads) // 2
            return {axes[i] for i in range(half) if pads[i] or pads[i + half]}
        repeats = self.const(node.inputs[1]) if len(node.inputs) > 1 else None  # Tile
        if repeats is None:
            return None
        return {i for i, r in enumerate(np.ravel(repeats)) if int(r) != 1}

    def keep_unless(self, node: ir.Node, layout: Layout, touched: Optional[set], removed: set = frozenset()):
        gone = Layout("unknown", where=_label(node))
        if touched is None:
            return gone
        if layout.kind in ("axis", "merged"):
            if layout.axis in touched:
                return gone
            shift = sum(1 for a in removed if a < layout.axis)
            return layout if not shift else replace(layout, axis=layout.axis - shift, where=_label(node))
        if layout.kind == "rows":
            return layout if 0 not in touched and 0 not in removed else gone
        return layout if not touched else gone

    def same_layout(self, node: ir.Node, ins: list, axis: int, rank: Optional[int]):
        gone = Layout("unknown", where=_label(node))
        if rank is None:
            return gone
        axis = axis + rank if axis < 0 else axis
        found = [l for l in ins if l.batched]
        for l in found:
            if l.kind in ("axis", "merged") and l.axis == axis or l.kind == "rows" and axis == 0 or l.kind == "flat":
                return gone
        return self.merge(node, found)

    def gather(self, node: ir.Node, op: str, ins: list):
        gone = Layout("unknown", where=_label(node))
        data, idx = ins[0], ins[1]
        rank = _rank(node.inputs[0])
        if rank is None:
            return gone
        axis = int(_attr(node, "axis", 0))
        axis = axis + rank if axis < 0 else axis
        if op == "GatherElements":
            if data.batched and (data.kind in ("axis", "merged") and data.axis == axis or
                                 data.kind not in ("axis", "merged") and axis == 0):
                return gone
            return self.broadcast(node, [(data, node.inputs[0]), (idx, node.inputs[1])], rank)
        if data.batched and not idx.batched and op == "Gather":
            hit = self.index.gather(node, data, node.inputs[1], axis)  # an arange(batch) index
            if hit is not None:
                return Layout("axis", hit, _label(node))
        if data.batched and idx.batched:
            return gone
        idx_rank = _rank(node.inputs[1])
        if idx_rank is None:
            return gone
        if data.batched:
            if data.kind in ("axis", "merged"):
                if data.axis == axis:
                    return gone
                moved = data.axis if data.axis < axis else data.axis - 1 + idx_rank
                return data if moved == data.axis else replace(data, axis=moved, where=_label(node))
            return data if data.kind == "rows" and axis > 0 else gone
        if idx.kind in ("axis", "merged"):
            moved = axis + idx.axis
            return idx if moved == idx.axis else replace(idx, axis=moved, where=_label(node))
        if axis == 0 and idx.kind in ("rows", "flat"):
            return idx
        return gone

    def reduce(self, node: ir.Node, op: str, ins: list):
        gone = Layout("unknown", where=_label(node))
        if any(l.batched for l in ins[1:]):
            return gone
        rank = _rank(node.inputs[0])
        axes = self.axes(node)
        if axes is None or rank is None:
            return gone
        if not axes:
            if int(_attr(node, "noop_with_empty_axes", 0)):
                return ins[0]
            return gone  # every axis
        axes = {a + rank if a < 0 else a for a in axes}
        keep = int(_attr(node, "keepdims", 1))
        return self.keep_unless(node, ins[0], axes, removed=set() if keep else axes)

    def recurrent(self, node: ir.Node, ins: list):
        gone = Layout("unknown", where=_label(node))
        layout = int(_attr(node, "layout", 0))
        want = Layout("axis", 0) if layout else Layout("axis", 1)
        x = ins[0]
        if not (x.kind == "axis" and x.axis == want.axis):
            return gone
        for i, l in enumerate(ins[1:], start=1):
            if not l.batched:
                continue
            if i == 4:  # sequence_lens [batch]
                if not (l.kind == "axis" and l.axis == 0):
                    return gone
            elif i in (5, 6) and not (l.kind == "axis" and l.axis == want.axis):  # initial_h / initial_c
                return gone
            elif i not in (4, 5, 6):
                return gone
        where = _label(node)
        if layout:
            return [Layout("axis", 0, where)] * len(node.outputs)
        return [Layout("axis", 2, where)] + [Layout("axis", 1, where)] * (len(node.outputs) - 1)

    # -- the batch as a factor of an axis ---------------------------------------------------------

    @property
    def bmono(self) -> tuple:
        """The batch as a monomial: the symbol ``"B"``, or its size when static."""
        return _mono(self.batch) if isinstance(self.batch, int) else _mono(1, ("B",))

    def mdims(self, value) -> Optional[list]:
        """``value``'s dims as monomials (module docstring: "merged"): a static dim its int, the
        batch's symbol ``B``, another named dim its name; an unknown dim from the op that made it
        (a ``Reshape``'s shape entries, ``-1`` solved; ``Transpose``, ``MatMul``, ``Gemm``,
        ``Gather``, ``Squeeze`` / ``Unsqueeze``, ``Flatten``, elementwise ops), else a symbol of its
        own (the same as a ``Shape`` of it reads). ``None``: the rank is unknown. Filled in graph
        order by :meth:`run` (each producer's inputs first)."""
        if value is None:
            return None
        hit = self._mdims.get(id(value), False)
        if hit is not False:
            return hit
        self._mdims[id(value)] = None  # a cycle (there is none in a graph) reads unknown
        declared = _dims(value)
        inferred = None
        producer = value.producer()
        if producer is not None and producer.domain in ("", "ai.onnx") and (
                declared is None or not all(isinstance(d, int) for d in declared)):
            try:
                inferred = self._infer_mdims(producer, value)
            except (TypeError, ValueError, IndexError, KeyError):
                inferred = None
        rank = len(declared) if declared is not None else (len(inferred) if inferred is not None else None)
        if inferred is not None and len(inferred) != rank:
            inferred = None
        out = None
        if rank is not None:
            out = []
            for i in range(rank):
                d = declared[i] if declared is not None else None
                if isinstance(d, int):
                    out.append(_mono(d))
                elif inferred is not None and inferred[i] is not None:
                    out.append(inferred[i])
                elif isinstance(d, str):
                    out.append(self.bmono if d == self.batch else _mono(1, (("s", d),)))
                else:
                    out.append(_mono(1, (("v", id(value), i),)))
        self._mdims[id(value)] = out
        return out

    def _infer_mdims(self, node: ir.Node, value) -> Optional[list]:
        op, ins = node.op_type, node.inputs
        src = self.mdims(ins[0]) if ins and ins[0] is not None else None
        if op == "Reshape" and len(ins) > 1:
            entries = self.smonos_of(ins[1])
            if src is None or entries is None:
                return None
            out, neg = [], None
            for i, e in enumerate(entries):
                if e == _mono(-1):
                    neg = i
                    out.append(None)
                elif e == _mono(0) and not int(_attr(node, "allowzero", 0)):
                    out.append(src[i] if i < len(src) else None)
                else:
                    out.append(e)
            if neg is not None and all(d is not None for j, d in enumerate(out) if j != neg):
                out[neg] = _div(_prod(src), _prod([d for j, d in enumerate(out) if j != neg]))
            return out
        if op == "Range":
            return self.index.range_mdims(node)
        if src is None:
            return None
        if op == "Transpose":
            perm = _attr(node, "perm")
            perm = [int(p) for p in perm] if perm is not None else list(reversed(range(len(src))))
            return [src[p] for p in perm]
        if op == "Flatten":
            axis = int(_attr(node, "axis", 1))
            axis = axis + len(src) if axis < 0 else axis
            return [_prod(src[:axis]), _prod(src[axis:])]
        if op in ("Squeeze", "Unsqueeze"):
            axes = self.axes(node)
            if not axes:
                return None
            if op == "Squeeze":
                axes = {a + len(src) if a < 0 else a for a in axes}
                return [d for i, d in enumerate(src) if i not in axes]
            rank = len(src) + len(axes)
            axes = {a + rank if a < 0 else a for a in axes}
            rest = iter(src)
            return [ONE if i in axes else next(rest) for i in range(rank)]
        if op in ("MatMul", "FusedMatMul") and len(ins) == 2 and not any(
                int(_attr(node, k, 0)) for k in ("transA", "transB", "transBatchA", "transBatchB")):
            b = self.mdims(ins[1])
            if b is None or len(src) < 2 or len(b) < 2:
                return None
            lead = self._broadcast_monos([src[:-2], b[:-2]])
            return None if lead is None else lead + [src[-2], b[-1]]
        if op == "Gemm" and len(ins) >= 2:
            b = self.mdims(ins[1])
            if b is None or len(src) != 2 or len(b) != 2:
                return None
            return [src[1] if int(_attr(node, "transA", 0)) else src[0], b[0] if int(_attr(node, "transB", 0)) else b[1]]
        if op == "Gather" and len(ins) == 2:
            idx = self.mdims(ins[1])
            axis = int(_attr(node, "axis", 0))
            axis = axis + len(src) if axis < 0 else axis
            return None if idx is None else src[:axis] + idx + src[axis + 1:]
        if op in _ELEMENTWISE or op in _LAST_AXIS and op not in ("TopK", "ArgMax", "ArgMin"):
            parts = [self.mdims(v) for v in (ins[:1] if op in _LAST_AXIS else ins) if v is not None]
            return None if any(p is None for p in parts) else self._broadcast_monos(parts)
        if op == "Slice" and len(ins) >= 3:
            starts, ends = self.int_entries(ins[1]), self.int_entries(ins[2])  # torch: ends from Shape too
            axes = self.const(ins[3]) if len(ins) > 3 and ins[3] is not None else None
            steps = self.const(ins[4]) if len(ins) > 4 and ins[4] is not None else None
            if starts is None or ends is None:
                return None
            starts, ends = np.ravel(starts), np.ravel(ends)
            axes = np.ravel(axes) if axes is not None else np.arange(len(starts))
            steps = np.ravel(steps) if steps is not None else np.ones(len(starts), dtype=np.int64)
            out = list(src)
            for start, end, axis, step in zip(starts, ends, axes, steps):
                axis = int(axis) + len(src) if int(axis) < 0 else int(axis)
                start, end, step = int(start), int(end), int(step)
                if start == 0 and step == 1 and end >= 2 ** 31 - 1:
                    continue  # the whole axis
                size = src[axis]
                out[axis] = _mono(len(range(*slice(start, end, step).indices(size[0])))) if not size[1] else None
            return out
        if op == "Split":
            axis = int(_attr(node, "axis", 0))
            axis = axis + len(src) if axis < 0 else axis
            sizes = self.const(ins[1]) if len(ins) > 1 and ins[1] is not None else None
            sizes = [int(v) for v in np.ravel(sizes)] if sizes is not None else _attr(node, "split")
            index = next((i for i, o in enumerate(node.outputs) if o is value), None)
            if index is None:
                return None
            if sizes:
                part = _mono(int(sizes[index]))
            else:
                part = _div(src[axis], _mono(len(node.outputs)))
            return src[:axis] + [part] + src[axis + 1:]
        return None

    def int_entries(self, value) -> Optional[np.ndarray]:
        """A 1-d / scalar int value's entries when every one is a known int (a constant, or
        computed from static dims through :meth:`shape_mono`), else ``None``."""
        entries = self.smonos_of(value)
        if entries is None or any(e is None or e[1] for e in entries):
            return None
        return np.asarray([e[0] for e in entries], dtype=np.int64)

    @staticmethod
    def _broadcast_monos(parts: list) -> Optional[list]:
        rank = max(len(p) for p in parts)
        out = []
        for i in range(rank):
            found = [p[i - rank + len(p)] for p in parts if i - rank + len(p) >= 0]
            big = [d for d in found if d != ONE]
            out.append(big[0] if big else ONE)
        return out

    def smonos_of(self, value) -> Optional[list]:
        """A 1-d / scalar int value's entries as monomials (``None`` for an entry not followed)."""
        if value is None:
            return None
        hit = self._smonos.get(id(value))
        if hit is not None:
            return hit
        c = self.const(value)
        if c is not None and c.dtype.kind in "iu" and c.ndim <= 1:
            return [_mono(int(v)) for v in np.ravel(c)]
        return None

    def shape_mono(self, node: ir.Node) -> None:
        """Follow ``Shape`` as monomials (:meth:`mdims`) through the int ops torch's exporters
        build a ``Reshape`` shape with (``Gather``, ``Slice``, ``Concat``, ``Unsqueeze``, ``Cast``,
        ``Mul``, ``Div`` ...): ``[seq, batch * heads, head_dim]`` from ``Shape`` of ``[seq, batch, d]``."""
        op, out = node.op_type, node.outputs[0] if node.outputs else None
        if out is None or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            return
        found = None
        ins = node.inputs
        if op == "Shape":
            dims = self.mdims(ins[0])
            if dims is None:
                return
            start, end = int(_attr(node, "start", 0)), _attr(node, "end", None)
            found = dims[slice(start, None if end is None else int(end))]
        elif op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape") and ins:
            found = self.smonos_of(ins[0])
        elif op == "Concat":
            parts = [self.smonos_of(v) for v in ins]
            if all(p is not None for p in parts):
                found = [m for p in parts for m in p]
        elif op == "Gather" and len(ins) == 2:
            data, idx = self.smonos_of(ins[0]), self.const(ins[1])
            if data is not None and idx is not None and idx.ndim <= 1:
                found = [data[int(i)] for i in np.ravel(idx)]
        elif op == "Slice" and len(ins) >= 3:
            data = self.smonos_of(ins[0])
            consts = [self.const(v) if v is not None else None for v in ins[1:]]
            if data is not None and all(c is not None for c in consts[:2]) and \
                    (len(consts) < 3 or consts[2] is None or list(np.ravel(consts[2])) in ([0], [-1])) and \
                    (len(consts) < 4 or consts[3] is None or list(np.ravel(consts[3])) == [1]):
                start, end = int(np.ravel(consts[0])[0]), int(np.ravel(consts[1])[0])
                found = data[max(start, -len(data)) if start < 0 else start:end if end < 2 ** 62 else None]
        elif op in ("Mul", "Div", "Add", "Sub") and len(ins) == 2:
            a, b = self.smonos_of(ins[0]), self.smonos_of(ins[1])
            if a is not None and b is not None and (len(a) == len(b) or len(a) == 1 or len(b) == 1):
                n = max(len(a), len(b))
                a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
                found = [self._arith(op, x, y) for x, y in zip(a, b)]
        if found is not None:
            self._smonos[id(out)] = list(found)

    @staticmethod
    def _arith(op: str, a, b):
        if a is None or b is None:
            return None
        if op == "Mul":
            return _mul(a, b)
        if op == "Div":
            return _div(a, b) if b[0] > 0 and a[0] >= 0 else None
        if a[1] or b[1]:
            return None  # a sum of symbols is no monomial
        return _mono(a[0] + b[0] if op == "Add" else a[0] - b[0])

    def descriptor(self, layout: Layout, value) -> Optional[tuple]:
        """``(axis, outer, inner)``: the batch is a factor of ``axis`` of ``value``, which holds
        ``outer * batch * inner`` (a plain axis: ``outer == inner == 1``); ``None``: not known."""
        if layout.kind == "axis":
            return (layout.axis, ONE, ONE)
        if layout.kind == "merged":
            return (layout.axis, layout.outer, layout.inner)
        if layout.kind == "rows":
            if layout.inner is not None:
                return (0, ONE, layout.inner)
            dims = self.mdims(value)
            inner = _div(dims[0], self.bmono) if dims else None
            return None if inner is None else (0, ONE, inner)
        return None

    def factored(self, node: ir.Node, op: str, layout: Layout) -> Optional[Layout]:
        """The batch through a ``Transpose`` or a storage-keeping op (``Reshape`` ...) as a factor
        of an axis (module docstring, "merged"); ``None``: not shown."""
        x, y = node.inputs[0], node.outputs[0]
        found = self.descriptor(layout, x)
        if found is None:
            return None
        k, outer, inner = found
        if op == "Transpose":
            rank = _rank(x)
            perm = _attr(node, "perm")
            if rank is None and perm is None:
                return None
            perm = [int(p) for p in perm] if perm is not None else list(reversed(range(rank)))
            return self.as_layout(perm.index(k), outer, inner, _label(node), y)
        din, dout = self.mdims(x), self.mdims(y)
        if din is None or dout is None or k >= len(din):
            return None
        batch = self.bmono
        pre, post = _prod(din[:k] + [outer]), _prod([inner] + din[k + 1:])
        for j in range(len(dout)):
            tail = _prod(dout[j + 1:])
            inner_j = _div(post, tail)
            if inner_j is None:
                continue
            outer_j = _div(_mul(dout[j], tail), _mul(batch, post))
            if outer_j is None or _mul(_prod(dout[:j]), outer_j) != pre:
                continue
            return self.as_layout(j, outer_j, inner_j, _label(node), y)
        return None

    def as_layout(self, axis: int, outer: tuple, inner: tuple, where: str, value) -> Layout:
        """The layout of a batch on ``axis`` of ``value`` as ``outer * batch * inner``."""
        if outer == ONE and inner == ONE:
            return Layout("axis", axis, where)
        if axis == 0 and outer == ONE:
            dims = self.mdims(value)
            count = _prod([inner] + dims[1:]) if dims else None
            return Layout("rows", where=where, count=count[0] if count is not None and not count[1] else None,
                          inner=inner)
        return Layout("merged", axis, where, outer=outer, inner=inner)

    def fallback(self, node: ir.Node, ins: list) -> list:
        """An op without a rule: ``"axis" 0`` where every batched input has it and the output's
        dim 0 is the batch; else unknown."""
        gone = Layout("unknown", where=_label(node))
        if not all(l.kind == "axis" and l.axis == 0 for l in ins if l.batched):
            return [gone] * len(node.outputs)
        dims0 = {(_dims(v) or [None])[0] for v, l in zip(node.inputs, ins) if l.batched}
        out = []
        for value in node.outputs:
            dims = _dims(value)
            out.append(Layout("axis", 0) if dims and (dims[0] in dims0 or dims[0] == self.batch) and
                       dims[0] is not None else gone)
        return out


_FOLDED = {"ConstantOfShape", "Concat", "Reshape", "Slice", "Transpose", "Cast", "Unsqueeze", "Squeeze", "Gather",
           "Add", "Sub", "Mul", "Neg", "Identity", "Mod"}


def _fold(node: ir.Node, args: list) -> Optional[np.ndarray]:
    """``node`` (an op of :data:`_FOLDED`) on the integer arrays ``args``, in numpy."""
    op = node.op_type
    if op == "ConstantOfShape":
        attr = node.attributes.get("value")
        fill = np.asarray(attr.value.numpy()).ravel()[0] if attr is not None else np.float32(0)
        if np.asarray(fill).dtype.kind not in "iub":
            return None
        return np.full([int(d) for d in np.ravel(args[0])], fill)
    if op == "Concat":
        return np.concatenate([np.atleast_1d(a) for a in args], axis=int(_attr(node, "axis", 0)))
    if op == "Reshape":
        shape = [int(d) for d in np.ravel(args[1])]
        shape = [args[0].shape[i] if d == 0 and not _attr(node, "allowzero", 0) else d for i, d in enumerate(shape)]
        return args[0].reshape(shape)
    if op == "Slice":
        data, starts, ends = args[0], np.ravel(args[1]), np.ravel(args[2])
        axes = np.ravel(args[3]) if len(args) > 3 and args[3] is not None else np.arange(len(starts))
        steps = np.ravel(args[4]) if len(args) > 4 and args[4] is not None else np.ones(len(starts), dtype=np.int64)
        index = [slice(None)] * data.ndim
        for st, en, ax, sp in zip(starts, ends, axes, steps):
            en = int(en)
            en = None if (sp > 0 and en >= data.shape[int(ax)]) or en < -(2 ** 62) else en
            index[int(ax)] = slice(int(st), en, int(sp))
        return data[tuple(index)]
    if op == "Transpose":
        perm = _attr(node, "perm")
        return np.transpose(args[0], None if perm is None else [int(p) for p in perm])
    if op == "Cast":
        to = ir.DataType(int(_attr(node, "to")))
        return args[0].astype(to.numpy()) if to.is_integer() else None
    if op in ("Unsqueeze", "Squeeze"):
        axes = node.attributes.get("axes")
        axes = [int(a) for a in axes.value] if axes is not None else (
            [int(a) for a in np.ravel(args[1])] if len(args) > 1 and args[1] is not None else None)
        if op == "Squeeze":
            return np.squeeze(args[0], axis=None if axes is None else tuple(axes))
        out = args[0]
        rank = out.ndim + len(axes)
        for a in sorted(a + rank if a < 0 else a for a in axes):
            out = np.expand_dims(out, a)
        return out
    if op == "Gather":
        return np.take(args[0], args[1], axis=int(_attr(node, "axis", 0)))
    if op in ("Add", "Sub", "Mul"):
        return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[op](args[0], args[1])
    if op == "Mod":  # torch's TorchScript unflatten: Mod(-1, rank) (fmod=0: the divisor's sign)
        return (np.fmod if int(_attr(node, "fmod", 0)) else np.mod)(args[0], args[1])
    if op == "Neg":
        return -args[0]
    return args[0]  # Identity


def _captured(node: ir.Node) -> list:
    """Every value read inside ``node``'s subgraphs (the outer graph's among them)."""
    out = []
    for attr in node.attributes.values():
        graphs = attr.value if isinstance(attr.value, list) else [attr.value]
        for g in graphs:
            if isinstance(g, ir.Graph):
                for inner in ir.traversal.RecursiveGraphIterator(g):
                    out += [v for v in inner.inputs if v is not None]
    return out


def batch_layouts(graph: ir.Graph, none_values=()) -> dict:
    """``{id(value): Layout}`` for every value of ``graph``'s main body (module docstring);
    ``none_values``: graph inputs holding no batch (params fed as inputs)."""
    return _Analysis(graph, {id(v) for v in none_values}).run()
