"""Quantized params in ONNX graphs: ``DequantizeLinear`` (QDQ) export, layouts ONNX Runtime
fuses into integer kernels, static activation quantization, and QDQ import.

**Weights** (:func:`emit_param`, called by the tracer's param hook for a ``QFloat`` param): the
param's initializer (named by its path, as every param's) holds the **stored integer values**,
never re-quantized; ``<path>_scale`` (and ``<path>_zero_point`` for unsigned values) are
constants; a ``DequantizeLinear`` gives the float weight. Burn -> ONNX (``docs/burnpack.md`` §7):

==============================  ==============================================================
Burn                            ONNX ``DequantizeLinear``
==============================  ==============================================================
Q8S / Q8F                       ``INT8``, no zero point (``unsigned``: ``UINT8``, zero point 128)
Q4S / Q4F                       ``INT4`` (opset >= 21; ``UINT4``, zero point 8); ``INT8`` below 21
Q2S / Q2F                       ``INT8`` (ONNX ``INT2`` needs opset 25; ORT 1.32 has no kernel)
per-tensor                      scalar scale
blocks, scale grid varying      per-axis (``axis``), 1-D scale
along one axis only
a block with one extent > 1     blocked: ``axis`` = that axis, ``block_size`` = its extent,
(at axis ``i``)                 scale shaped as the grid (opset >= 21)
scale dtype F16 / BF16 / UE4M3  widened to float32 (exact)
two levels                      ``global * block_scale`` folded in float32 (Burn's own product)
2-D blocks                      not expressible: the float weight is exported (a warning says so)
==============================  ==============================================================

ONNX's ``DequantizeLinear`` computes ``(q - zero_point) * scale`` in float32, which is Burn's
``q * scale`` exactly, so the exported weight equals ``param.val()`` bit for bit. The Burn scheme
(and a two-level global scale) is written into the initializer's ``metadata_props``
(:data:`SCHEME_KEY`, :data:`GLOBAL_SCALE_KEY`) so import restores the exact ``QFloat`` tensor.

**Which layouts ONNX Runtime fuses** (checked on ORT 1.32, CPU; ``tests/test_qdq_export.py``
asserts it on the optimized graph):

* ``DequantizeLinear(W) -> MatMul`` with W ``[K, N]`` per-tensor, per-column (axis 1) or blocked
  along K (axis 0, block a power of 2 >= 16), 8 or 4 bits -> ``MatMulNBits``. Its activation
  precision is ORT's ``accuracy_level`` (session config ``session.qdq_matmulnbits_accuracy_level``,
  0/1 = float32 ... 4 = int8; see :func:`matmulnbits_accuracy_level`). NOTE: with 2-D
  activations ORT 1.32 may first fuse ``MatMul + Add (+ Relu)`` into ``FusedGemm`` and then
  dequantize that weight at every run (rank-3 activations are not affected). Blocks along N (axis 1,
  e.g. Burn's ``block_size=32`` on a Linear weight) are **not** fused: ORT dequantizes at every
  run. ``QdqOptions(reblock=True)`` re-quantizes such a weight with blocks along K (lossy: the
  largest error is reported in the warning), else a warning names the param.
* On x86 CPUs MatMulNBits at batch 1-256 measured *slower* than float32 (MLAS has no fast 8-bit
  path there), while ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` (what
  ``onnxruntime.quantization.quantize_dynamic`` writes) is fused to ``DynamicQuantizeMatMul``, an
  int8 GEMM 4-15x faster than float32. So by default (``matmul="auto"``) an exported 8-bit weight with
  per-tensor or per-column scales feeding ``MatMul`` is exported in that form (the activation is
  quantized to uint8 per tensor at run time); 4-bit and blocked weights keep
  ``DequantizeLinear -> MatMul`` (``MatMulNBits``). ``matmul="dequantize"`` keeps plain QDQ
  everywhere; it is what ``module(x)`` uses unless called inside :func:`qdq_options`, so the
  runtime computes with exactly ``param.val()``.
* ``Conv`` / ``Gemm`` with only a dequantized weight are not fused (ORT needs quantized
  activations too: see below); a weight-only conv dequantizes at every run. ``Gemm`` with
  ``transB=1`` (PyTorch's layout, imported models) is warned about as well.

**Activations** (:func:`quantize_activations`): with calibration data, ``QuantizeLinear ->
DequantizeLinear`` pairs (uint8, asymmetric, MinMax ranges) are put on the activation input and
the output of every ``MatMul`` / ``Conv`` with a quantized weight, so ORT fuses ``QLinearConv`` /
``QLinearMatMul`` (static quantization; ORT quantizes a float conv bias itself).

**Import** (:func:`fold_dequantize_weights`): ``DequantizeLinear(integer initializer, constant
scale[, constant zero point])`` and the ``DynamicQuantizeLinear -> MatMulInteger`` form above
become one float weight that :func:`imported_param` turns into a ``QFloat`` param.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import warnings
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ..dtype import DType
from ..errors import QuantizationError, QuantizationWarning
from .calibration import quantize
from .scheme import QuantScheme, QuantValue
from .tensor import QuantizedTensor

__all__ = [
    "ACCURACY_LEVEL_KEY",
    "GLOBAL_SCALE_KEY",
    "SCHEME_KEY",
    "QdqOptions",
    "QuantizationWarning",
    "WeightLayout",
    "current_options",
    "emit_param",
    "finish_graph",
    "fold_dequantize_weights",
    "imported_param",
    "matmulnbits_accuracy_level",
    "qdq_options",
    "quantize_activations",
    "weight_layout",
]

ACCURACY_LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"
"""ONNX Runtime session config entry: the ``accuracy_level`` of the ``MatMulNBits`` it fuses from
``DequantizeLinear -> MatMul`` (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations)."""

SCHEME_KEY = "onnxparam.quant.scheme"
"""Initializer ``metadata_props`` key: the Burn ``QuantScheme`` (JSON of its CBOR value)."""

GLOBAL_SCALE_KEY = "onnxparam.quant.global_scale"
"""Initializer ``metadata_props`` key: a two-level scheme's global scale (``float.hex``)."""

ACTIVATION_RANGES_ATTR = "_onnxparam_activation_ranges"
"""Private module attribute: ``((value_name, min, max), ...)`` from :func:`quantize_activations`."""

NBITS_MIN_BLOCK = 16
"""``MatMulNBits`` blocks: a power of 2, at least 16 (ORT's ``DQMatMulToMatMulNBits`` selector)."""

MATMUL_MODES = ("auto", "dynamic", "dequantize")
_QDQ_META = "onnxparam.qdq"


@dataclass(frozen=True)
class QdqOptions:
    """How quantized params are exported (module docstring).

    Args:
        matmul: ``"auto"`` (8-bit per-tensor / per-column weights of ``MatMul`` -> dynamic
            activation quantization, ORT ``DynamicQuantizeMatMul``; the rest ``DequantizeLinear``),
            ``"dynamic"`` (as auto), or ``"dequantize"`` (``DequantizeLinear`` everywhere).
        unsigned: write ``UINT8`` / ``UINT4`` values with zero point 128 / 8 instead of signed
            ones without zero point (lossless either way).
        reblock: re-quantize ``MatMul`` weights blocked along N with blocks along K so that ORT
            fuses ``MatMulNBits`` (lossy; the largest error is reported), instead of warning.

    Raises:
        ValueError: for an unknown ``matmul`` mode.
    """

    matmul: str = "auto"
    unsigned: bool = False
    reblock: bool = False

    def __post_init__(self):
        if self.matmul not in MATMUL_MODES:
            raise ValueError(f"QdqOptions.matmul must be one of {', '.join(MATMUL_MODES)}; got {self.matmul!r}")


_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("onnxparam_qdq_options", default=None)

RUNTIME_DEFAULT_OPTIONS = QdqOptions(matmul="dequantize")
"""What ``module(x)`` traces with outside :func:`qdq_options`: weight-only ``DequantizeLinear``,
so a quantized module computes with exactly ``param.val()`` (no activation quantization)."""


@contextlib.contextmanager
def qdq_options(options: QdqOptions | None = None, **kwargs):
    """Use ``options`` (or ``QdqOptions(**kwargs)``) for graphs traced inside the block (export
    and ``module(x)``)::

        with qdq_options(matmul="dequantize"):
            export_onnx(model, "model.onnx", x)
    """
    options = replace(options or QdqOptions(), **kwargs)
    token = _OPTIONS.set(options)
    try:
        yield options
    finally:
        _OPTIONS.reset(token)


def current_options() -> QdqOptions:
    """The :class:`QdqOptions` in effect for export (the defaults outside :func:`qdq_options`)."""
    return _OPTIONS.get() or QdqOptions()


def runtime_options() -> QdqOptions:
    """The :class:`QdqOptions` ``module(x)`` traces with: those of an enclosing
    :func:`qdq_options`, else :data:`RUNTIME_DEFAULT_OPTIONS` (part of the trace cache key)."""
    return _OPTIONS.get() or RUNTIME_DEFAULT_OPTIONS


def matmulnbits_accuracy_level(level: int) -> tuple:
    """The session config entry setting ORT's ``MatMulNBits`` ``accuracy_level`` (0-4), e.g.
    ``SessionConfig().with_config_entry(*matmulnbits_accuracy_level(4))``.

    Raises:
        ValueError: for a level outside 0..4.
    """
    if int(level) not in range(5):
        raise ValueError(f"MatMulNBits accuracy_level is 0..4 (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8); got {level}")
    return ACCURACY_LEVEL_KEY, str(int(level))


# -- weight layouts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightLayout:
    """The ONNX initializers of one quantized weight.

    Attributes:
        onnx_dtype: ``ir.DataType`` of ``values`` (INT8, UINT8, INT4, UINT4).
        values: the integer values, the weight's shape (``ml_dtypes`` int4/uint4 for 4 bits).
        scale: float32; ``()`` per-tensor, ``(d_axis,)`` per-axis, the block grid when blocked.
        zero_point: ``values``' dtype, the shape of ``scale``; ``None`` for signed values.
        axis: the ``DequantizeLinear`` axis (``None`` per-tensor).
        block_size: the ``block_size`` attribute (``None`` unless blocked).
        max_error: largest ``|exported - param.val()|``: 0 unless re-blocked.
    """

    onnx_dtype: ir.DataType
    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int | None
    block_size: int | None
    max_error: float = 0.0

    @property
    def bits(self) -> int:
        return 4 if self.onnx_dtype in (ir.DataType.INT4, ir.DataType.UINT4) else 8

    @property
    def per_column_2d(self) -> bool:
        """Per-tensor or per-axis-1 scales on a 2-D weight (what ``MatMulInteger`` takes)."""
        return self.values.ndim == 2 and self.block_size is None and self.axis in (None, 1)

    def dequantize(self) -> np.ndarray:
        """``(values - zero_point) * scale`` as ONNX ``DequantizeLinear`` computes it (float32)."""
        q = self.values.astype(np.float32)
        zp = 0 if self.zero_point is None else self.zero_point.astype(np.float32)
        if self.axis is None:
            return ((q - zp) * self.scale).astype(np.float32)
        shape = [1] * q.ndim
        if self.block_size is None:
            shape[self.axis] = -1
            return ((q - np.reshape(zp, shape) if np.ndim(zp) else q) * self.scale.reshape(shape)).astype(np.float32)
        rep = lambda a: np.repeat(a, self.block_size, axis=self.axis).take(
            range(q.shape[self.axis]), axis=self.axis)
        return ((q - (rep(zp) if np.ndim(zp) else 0)) * rep(self.scale)).astype(np.float32)


def _onnx_grid(qt: QuantizedTensor, opset: int):
    """``(scale array, axis, block_size)`` in ONNX's form, or ``None`` when ONNX cannot express
    the Burn scale grid (module docstring table)."""
    scheme = qt.scheme
    scales = np.asarray(qt.scales, dtype=np.float32)
    if qt.global_scale is not None:
        scales = (np.float32(qt.global_scale) * scales).astype(np.float32)  # Burn's (global * scale)
    rank = len(qt.shape)
    if scheme.block is None or scales.size == 1:
        return scales.reshape(()), None, None
    extents = scheme.block.size.to_dim_vec(rank)
    grid = scales.shape
    varying = [i for i, n in enumerate(grid) if n > 1]
    if len(varying) == 1 and extents[varying[0]] == 1:
        return scales.reshape(-1), varying[0], None
    blocked = [i for i, e in enumerate(extents) if e > 1]
    if len(blocked) == 1 and opset >= 21:
        return scales, blocked[0], int(extents[blocked[0]])
    return None


def weight_layout(qt: QuantizedTensor, opset: int = 21, options: QdqOptions | None = None) -> WeightLayout | None:
    """The exact ONNX layout of a Burn quantized tensor (module docstring), or ``None`` when ONNX
    ``DequantizeLinear`` cannot express its scales (2-D blocks, blocks below opset 21).

    Args:
        qt: the quantized tensor.
        opset: the graph's ``ai.onnx`` opset (INT4 and blocked scales need 21).
        options: :class:`QdqOptions` (``unsigned``).
    """
    options = options or QdqOptions()
    grid = _onnx_grid(qt, opset)
    if grid is None:
        return None
    scale, axis, block = grid
    four = qt.scheme.value in (QuantValue.Q4S, QuantValue.Q4F) and opset >= 21
    values = np.asarray(qt.values, dtype=np.int8)
    zero_point = None
    if options.unsigned:
        offset = 8 if four else 128
        np_dtype = ml_dtypes.uint4 if four else np.uint8
        values = (values.astype(np.int16) + offset).astype(np_dtype)
        zero_point = np.full(scale.shape, offset, dtype=np_dtype)
        onnx_dtype = ir.DataType.UINT4 if four else ir.DataType.UINT8
    elif four:
        values = values.astype(ml_dtypes.int4)
        onnx_dtype = ir.DataType.INT4
    else:
        onnx_dtype = ir.DataType.INT8
    return WeightLayout(onnx_dtype, values, scale, zero_point, axis, block)


def _nbits_block(k: int, preferred: int | None) -> int | None:
    """A ``MatMulNBits`` block size dividing ``k``: ``preferred`` if it qualifies, else the
    largest of 128, 64, 32, 16 (Burn's block extents stop at 255)."""
    candidates = ([preferred] if preferred else []) + [128, 64, 32, 16]
    for b in candidates:
        if b >= NBITS_MIN_BLOCK and b & (b - 1) == 0 and b <= 255 and k % b == 0:
            return b
    return None


def reblocked_layout(qt: QuantizedTensor, layout: WeightLayout, opset: int, options: QdqOptions):
    """``qt`` (a ``[K, N]`` weight) re-quantized with blocks along K (Burn's MinMax, same value
    type) so ORT fuses ``MatMulNBits``; ``(layout, block)`` with ``max_error`` set, or ``None``
    when no block size divides K."""
    k = qt.shape[0]
    block = _nbits_block(k, layout.block_size)
    if block is None:
        return None
    scheme = QuantScheme(qt.scheme.value, block_size=(block, 1))
    requant = quantize(qt.dequantize(), scheme)
    new = weight_layout(requant, opset, options)
    error = float(np.max(np.abs(requant.dequantize() - qt.dequantize()))) if qt.values.size else 0.0
    return replace(new, max_error=error)


# -- export: the tracer's param hook -------------------------------------------------------------


@dataclass
class _Emitted:
    """What :func:`emit_param` put in the graph for one param (kept in ``value.meta``)."""

    path: str
    param: object
    quantized: QuantizedTensor
    layout: WeightLayout
    value: ir.Value
    scale: ir.Value
    zero_point: ir.Value | None
    node: ir.Node
    output: object  # the symbolic Tensor of the dequantized weight


def _quantized_of(param) -> QuantizedTensor:
    from ..trace import untraced

    with untraced():
        base = param.base()
    if base._quant is None:  # pragma: no cover - lazy_dtype said QFloat
        raise QuantizationError(f"param {param!r} is not quantized")
    return base._quant


def _initializer_tensor(layout_ref: list, name: str):
    def make():
        layout = layout_ref[0]
        return ir.Tensor(layout.values, dtype=layout.onnx_dtype, name=name)

    return make


def emit_param(tracer, param, path: str, shape: tuple):
    """The tracer's hook for a ``QFloat`` param: integer initializer ``path`` + scale (+ zero
    point) constants -> ``DequantizeLinear``; returns the symbolic weight (float32, then cast to
    the tensor's ``float_dtype`` when it is not F32), or ``None``
    when ONNX cannot express the scheme (the tracer then exports the dequantized float weight,
    and a :class:`QuantizationWarning` says so)."""
    qt = _quantized_of(param)
    options = current_options()
    layout = weight_layout(qt, tracer.opset, options)
    if layout is None:
        warnings.warn(
            f"{path!r} ({qt.scheme.describe()}, shape {list(qt.shape)}) has a scale layout ONNX "
            f"DequantizeLinear cannot express at opset {tracer.opset} (2-D blocks need per-element scales; "
            "blocks need opset 21): it is exported as a float32 initializer (dequantized, exact)",
            QuantizationWarning, stacklevel=4)
        return None
    layout_ref = [layout]
    lazy = ir.LazyTensor(_initializer_tensor(layout_ref, path), layout.onnx_dtype, ir.Shape(list(shape)), name=path)
    lazy.metadata_props.update(_scheme_props(qt))
    value = ir.Value(name=path, const_value=lazy)
    value.type = ir.TensorType(layout.onnx_dtype)
    value.shape = ir.Shape(list(shape))
    tracer._names.add(path)
    tracer._params[path] = param
    tracer._param_values[path] = value
    scale = tracer.constant(layout.scale, name=f"{path}_scale")._symbol.value
    zero_point = None
    if layout.zero_point is not None:
        zero_point = ir.Value(name=tracer.unique_name(f"{path}_zero_point"),
                              const_value=ir.Tensor(layout.zero_point, dtype=layout.onnx_dtype))
        zero_point.type = ir.TensorType(layout.onnx_dtype)
        zero_point.shape = ir.Shape(list(layout.zero_point.shape))
        tracer._constants.append(zero_point)
    attrs = {}
    if layout.axis is not None:
        attrs["axis"] = layout.axis
    if layout.block_size is not None:
        attrs["block_size"] = layout.block_size
    # NOTE: no empty trailing zero-point input: ORT's DQ -> MatMulNBits selector rejects it
    inputs = [value, scale] + ([zero_point] if zero_point is not None else [])
    out = tracer.emit("DequantizeLinear", inputs, attrs,
                      output_types=[(DType.F32, tuple(shape))])[0]
    out._symbol.param = param
    node = out._symbol.value.producer()
    value.meta[_QDQ_META] = _Emitted(path, param, qt, layout, value, scale, zero_point, node, out)
    value.meta[_QDQ_META + ".ref"] = layout_ref
    if qt.float_dtype is not DType.F32:
        # NOTE: DequantizeLinear computes in float32 (its scale's type; a narrower scale would round
        # it); the weight comes back at the param's own dtype, as Param.val() casts it. The Cast
        # hides the MatMul from the fused forms (finish_graph), so such a weight is not fused.
        out = tracer.emit("Cast", [out], {"to": qt.float_dtype}, output_types=[(qt.float_dtype, tuple(shape))])[0]
        out._symbol.param = param
    return out


def _scheme_props(qt: QuantizedTensor) -> dict:
    props = {SCHEME_KEY: json.dumps(qt.scheme.to_cbor(), sort_keys=False, separators=(",", ":"))}
    if qt.global_scale is not None:
        props[GLOBAL_SCALE_KEY] = float(qt.global_scale).hex()
    return props


def is_qdq_initializer(value: ir.Value) -> bool:
    """True for the integer initializer :func:`emit_param` made (its data comes with the graph,
    not injected by the runtime)."""
    return _QDQ_META in value.meta


def _set_layout(tracer, emitted: _Emitted, layout: WeightLayout) -> None:
    """Swap an emitted weight's layout (re-blocking): initializer data, scale, attributes."""
    emitted.layout = layout
    emitted.value.meta[_QDQ_META + ".ref"][0] = layout
    emitted.value.type = ir.TensorType(layout.onnx_dtype)
    emitted.value.const_value = ir.LazyTensor(
        _initializer_tensor(emitted.value.meta[_QDQ_META + ".ref"], emitted.path), layout.onnx_dtype,
        emitted.value.shape, name=emitted.path)
    emitted.value.const_value.metadata_props.update(_scheme_props(emitted.quantized))
    scale = ir.Value(name=tracer.unique_name(f"{emitted.path}_scale"), const_value=ir.tensor(layout.scale))
    scale.type = ir.TensorType(ir.DataType.FLOAT)
    scale.shape = ir.Shape(list(layout.scale.shape))
    tracer._constants.append(scale)
    emitted.node.replace_input_with(1, scale)
    emitted.scale = scale
    attrs = {"axis": ir.AttrInt64("axis", layout.axis if layout.axis is not None else 1)}
    if layout.block_size is not None:
        attrs["block_size"] = ir.AttrInt64("block_size", layout.block_size)
    emitted.node.attributes.clear()
    emitted.node.attributes.update(attrs)


# -- export: finishing the graph ------------------------------------------------------------------


def _emitted(tracer) -> list:
    return [v.meta[_QDQ_META] for v in tracer._param_values.values() if _QDQ_META in v.meta]


def quantized_param_value(tracer, param, path: str, shape: tuple):
    """The QDQ pass's value of a ``QFloat`` param (:attr:`onnxparam.trace.GraphPasses.quantized_param`):
    :func:`emit_param`'s dequantized tensor, or the float dtype the tracer holds the dequantized
    values as when ONNX cannot express the scheme."""
    tensor = emit_param(tracer, param, path, shape)
    return tensor if tensor is not None else _quantized_of(param).float_dtype


def finish_graph(tracer) -> None:
    """Called by ``Tracer.finish`` (after LoRA's ``expand_adapters``, before the initializers are
    registered): QLoRA in merge mode, layout checks / re-blocking, the dynamic ``MatMul`` form,
    and static activation QDQ pairs. A no-op for graphs without quantized params or ranges."""
    emitted = _emitted(tracer)
    ranges = getattr(tracer._root, ACTIVATION_RANGES_ATTR, None) if getattr(tracer, "_root", None) is not None else None
    if not emitted and not ranges:
        return
    options = current_options()
    if tracer.mode == "merge":
        _expand_qlora(tracer, emitted)
    convs: list = []
    for e in emitted:
        _check_fusable(tracer, e, options, convs)
    if convs and not ranges:
        # NOTE: measured on MNIST with ORT 1.32: a weight-only DequantizeLinear -> Conv is not
        # fused and keeps ORT from pre-packing the conv weight: ~4x slower than float32.
        warnings.warn(f"{', '.join(repr(p) for p in convs)} feed Conv nodes with only a dequantized weight: ORT "
                      "fuses no weight-only DequantizeLinear -> Conv, so these convs dequantize at every run and "
                      "run slower than float32; quantize activations too (onnxparam.quant.quantize_activations) "
                      "or leave conv weights float (quantize_weights_group)", QuantizationWarning, stacklevel=4)
    if ranges:
        _insert_activation_qdq(tracer, {name: (lo, hi) for name, lo, hi in ranges})
    elif options.matmul in ("auto", "dynamic"):
        for e in emitted:
            _dynamic_matmuls(tracer, e)
    for e in emitted:
        if not e.output._symbol.value.uses() and not e.output._symbol.value.is_graph_output():
            e.node.graph.remove(e.node, safe=True)


def _expand_qlora(tracer, emitted: list) -> None:
    """Merge mode with a quantized base: the base stays quantized and the float adapter is added
    by graph nodes (``x @ DQ(W) + scale * ((x @ a) @ b)``), as ``"keep"`` mode does."""
    from .. import lora_graph

    for e in emitted:
        if e.param.adapter() is None:
            continue
        # NOTE: lora_graph's expander (the "keep" mode emitter) does exactly this for a base value;
        # the DQ output is the base here.
        lora_graph._Expander(tracer, e.param, e.output._symbol.value, DType.F32).expand()


def _uses(value: ir.Value) -> list:
    return list(value.uses())


def _check_fusable(tracer, e: _Emitted, options: QdqOptions, convs: list) -> None:
    out = e.output._symbol.value
    layout = e.layout
    for node, index in _uses(out):
        if node.op_type == "Conv" and index == 1:
            convs.append(e.path)
        if node.op_type == "Gemm" and index == 1:
            warnings.warn(f"{e.path!r} feeds Gemm {node.name!r}: ORT fuses no weight-only DequantizeLinear -> Gemm, "
                          "so it dequantizes at every run (export it through MatMul, or quantize activations)",
                          QuantizationWarning, stacklevel=5)
        if node.op_type != "MatMul" or index != 1 or layout.values.ndim != 2:
            continue
        if layout.block_size is not None and layout.axis == 1:
            if options.reblock:
                new = reblocked_layout(e.quantized, layout, tracer.opset, options)
                if new is not None:
                    _set_layout(tracer, e, new)
                    warnings.warn(f"{e.path!r} was re-quantized with blocks of {new.block_size} along K (axis 0) so "
                                  f"ORT fuses MatMulNBits; largest error {new.max_error:.6g} vs the stored values",
                                  QuantizationWarning, stacklevel=5)
                    return
            warnings.warn(
                f"{e.path!r} ({e.quantized.scheme.describe()}, shape {list(e.quantized.shape)}) is blocked along N "
                f"(axis 1) of MatMul {node.name!r}: ORT fuses MatMulNBits only for blocks along K, so this weight "
                "dequantizes at every run; quantize with block_size=(b, 1) or export with QdqOptions(reblock=True)",
                QuantizationWarning, stacklevel=5)
            return
        if layout.block_size is not None and (layout.block_size < NBITS_MIN_BLOCK
                                              or layout.block_size & (layout.block_size - 1)):
            warnings.warn(f"{e.path!r}: block size {layout.block_size} is not a power of 2 >= 16, so ORT fuses no "
                          "MatMulNBits and it dequantizes at every run", QuantizationWarning, stacklevel=5)


def _node(tracer, graph, op: str, inputs: list, outputs: list, label: str, attrs=None, domain: str = "") -> ir.Node:
    name = tracer.unique_name(label)
    node = ir.Node(domain, op, inputs, [_attr(k, v) for k, v in (attrs or {}).items()], num_outputs=len(outputs),
                   name=name)
    for out, (dtype, dims) in zip(node.outputs, outputs):
        out.name = tracer.unique_name(f"{name}_output_{out.index()}")
        out.type = ir.TensorType(dtype)
        out.shape = None if dims is None else ir.Shape(dims)
    return node


def _attr(name, value):
    return ir.AttrInt64(name, int(value))


def _dims(value: ir.Value):
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def _dynamic_matmuls(tracer, e: _Emitted) -> None:
    """``MatMul(x, DQ(W))`` -> ``DynamicQuantizeLinear(x) -> MatMulInteger -> Cast -> Mul`` for an
    8-bit per-tensor / per-column weight (ORT: ``DynamicQuantizeMatMul``)."""
    layout = e.layout
    if layout.bits != 8 or not layout.per_column_2d:
        return
    out = e.output._symbol.value
    for node, index in _uses(out):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or index != 1:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x.dtype != ir.DataType.FLOAT:
            continue
        graph = node.graph
        u8, i32, f32 = ir.DataType.UINT8, ir.DataType.INT32, ir.DataType.FLOAT
        label = f"{node.name}/dynamic"
        dql = _node(tracer, graph, "DynamicQuantizeLinear", [x], [(u8, _dims(x)), (f32, []), (u8, [])],
                    f"{label}/DynamicQuantizeLinear")
        xq, xs, xz = dql.outputs
        mm_inputs = [xq, e.value, xz] + ([e.zero_point] if e.zero_point is not None else [])
        mmi = _node(tracer, graph, "MatMulInteger", mm_inputs, [(i32, _dims(y))], f"{label}/MatMulInteger")
        cast = _node(tracer, graph, "Cast", [mmi.outputs[0]], [(f32, _dims(y))], f"{label}/Cast", {"to": int(f32)})
        scale = _node(tracer, graph, "Mul", [xs, e.scale], [(f32, list(layout.scale.shape))], f"{label}/Mul_scale")
        result = _node(tracer, graph, "Mul", [cast.outputs[0], scale.outputs[0]], [(f32, _dims(y))], f"{label}/Mul")
        graph.insert_after(node, [dql, mmi, cast, scale, result])
        new = result.outputs[0]
        y.replace_all_uses_with(new, replace_graph_outputs=True)
        old_name = y.name
        graph.remove(node, safe=True)
        new.name = old_name


# -- static activation quantization ------------------------------------------------------------------

_QUANTIZED_OPS = ("MatMul", "Conv")


def _activation_sites(graph: ir.Graph, emitted_outputs: set) -> list:
    """Value names to put a ``QuantizeLinear -> DequantizeLinear`` pair on: the activation input
    and the output of every float ``MatMul`` / ``Conv`` whose weight is a dequantized param."""
    names = []
    for node in graph:
        if node.op_type not in _QUANTIZED_OPS or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        if id(node.inputs[1]) not in emitted_outputs:
            continue
        for v in (node.inputs[0], node.outputs[0]):
            if v.dtype == ir.DataType.FLOAT and v.name not in names:
                names.append(v.name)
    return names


def _uint8_qparams(lo: float, hi: float) -> tuple:
    """Asymmetric uint8 ``(scale, zero_point)`` covering ``[min(lo, 0), max(hi, 0)]`` (ORT's
    calibrated activations: zero must be exact)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = np.float32((hi - lo) / 255.0) if hi > lo else np.float32(1.0)
    zero = int(np.clip(np.round(-lo / float(scale)), 0, 255))
    return scale, np.uint8(zero)


def _insert_activation_qdq(tracer, ranges: dict) -> None:
    graph = tracer.graph
    emitted = {id(e.output._symbol.value): e for e in _emitted(tracer)}
    by_name = {}
    for node in graph:
        for out in node.outputs:
            by_name[out.name] = out
    for v in graph.inputs:
        by_name[v.name] = v
    qparams = {}
    for name in _activation_sites(graph, set(emitted)):
        value = by_name.get(name)
        if value is None or name not in ranges:
            continue
        scale, zero = _uint8_qparams(*ranges[name])
        qparams[name] = scale
        s = tracer.constant(np.asarray(scale, np.float32), name=f"{name}_scale")._symbol.value
        z = tracer.constant(np.asarray(zero, np.uint8), name=f"{name}_zero_point")._symbol.value
        uses = _uses(value)
        dims = _dims(value)
        q = _node(tracer, graph, "QuantizeLinear", [value, s, z], [(ir.DataType.UINT8, dims)], f"{name}/QuantizeLinear")
        dq = _node(tracer, graph, "DequantizeLinear", [q.outputs[0], s, z], [(ir.DataType.FLOAT, dims)],
                   f"{name}/DequantizeLinear")
        producer = value.producer()
        if producer is None:
            first = next(iter(graph))
            graph.insert_before(first, [q, dq])
        else:
            graph.insert_after(producer, [q, dq])
        for node, index in uses:
            node.replace_input_with(index, dq.outputs[0])
        if value.is_graph_output():
            for i, out in enumerate(graph.outputs):
                if out is value:
                    graph.outputs[i] = dq.outputs[0]
                    value.name, dq.outputs[0].name = dq.outputs[0].name, value.name


def quantize_activations(module, calibration_inputs, *, batch_size: int | None = None):
    """A copy of ``module`` that carries activation ranges measured on ``calibration_inputs``, so
    its traced graphs (``module(x)`` and export) get static ``QuantizeLinear -> DequantizeLinear``
    pairs around every ``MatMul`` / ``Conv`` with a quantized weight (module docstring).

    Quantize the weights first (:meth:`~onnxparam.Module.quantize_weights`); activations of ops
    whose weight is float are left alone.

    Args:
        module: a module with quantized weights.
        calibration_inputs: an array (or a sequence of arrays, one per forward argument) holding
            representative inputs, batch first; run in batches of ``batch_size`` (all at once
            when ``None``).
        batch_size: calibration batch size.

    Returns:
        the module copy (ranges in the private attribute :data:`ACTIVATION_RANGES_ATTR`).

    Raises:
        QuantizationError: when the module has no quantized weight feeding a MatMul / Conv.
    """
    import onnx

    from .._ort import import_onnxruntime
    from ..module import rebuild
    from ..trace import InputSpec, trace_module

    ort = import_onnxruntime()
    args = list(calibration_inputs) if isinstance(calibration_inputs, (list, tuple)) else [calibration_inputs]
    args = [np.asarray(a) for a in args]
    plain = rebuild(module, lambda p, param: param,
                    lambda path, m: m.__dict__.pop(ACTIVATION_RANGES_ATTR, None) if path == "" else None)
    with qdq_options(matmul="dequantize"):
        traced = trace_module(plain, tuple(InputSpec(("batch",) + a.shape[1:], DType.from_numpy(a.dtype))
                                           for a in args))
    emitted = {id(v.meta[_QDQ_META].output._symbol.value) for v in traced.graph.initializers.values()
               if _QDQ_META in v.meta}
    sites = _activation_sites(traced.graph, emitted)
    if not sites:
        raise QuantizationError("no MatMul / Conv with a quantized weight to calibrate: quantize the weights first "
                                "(module.quantize_weights(Quantizer(...)))")
    proto = traced.to_proto()
    proto.graph.ClearField("value_info")
    known = {o.name for o in proto.graph.output}
    for name in sites:
        if name not in known:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in session.get_outputs()]
    lo = {n: math.inf for n in sites}
    hi = {n: -math.inf for n in sites}
    n = len(args[0])
    step = n if batch_size is None else int(batch_size)
    for start in range(0, n, step):
        feed = {name: a[start:start + step] for name, a in zip(traced.input_names, args)}
        for name, result in zip(out_names, session.run(out_names, feed)):
            if name in lo and result.size:
                lo[name] = min(lo[name], float(np.min(result)))
                hi[name] = max(hi[name], float(np.max(result)))
    ranges = tuple((name, lo[name], hi[name]) for name in sites if math.isfinite(lo[name]))

    def set_ranges(path, m):
        if path == "":
            object.__setattr__(m, ACTIVATION_RANGES_ATTR, ranges)

    return rebuild(module, lambda p, param: param, set_ranges)


# -- import --------------------------------------------------------------------------------------------

_INT_TYPES = (ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT4, ir.DataType.UINT4)


def _const(value: ir.Value | None):
    if value is None:
        return None
    if value.const_value is not None and value.is_initializer():
        return value.const_value
    return None


def _scheme_from_props(props, values: np.ndarray, scale_shape, axis, block, rank) -> QuantScheme:
    text = props.get(SCHEME_KEY) if props is not None else None
    if text:
        return QuantScheme.from_cbor(json.loads(text))
    four = False
    if values.dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
        four = True
    if four:
        value = QuantValue.Q4S if values.min(initial=0) >= -7 else QuantValue.Q4F
    else:
        value = QuantValue.Q8S if values.min(initial=0) >= -127 else QuantValue.Q8F
    if axis is None or int(np.prod(scale_shape)) == 1:
        return QuantScheme(value)
    if block is None:  # per-axis: a block covering every other axis
        return None  # decided by the caller (extents may exceed Burn's 255)
    extents = [1] * rank
    extents[axis] = block
    return QuantScheme(value, block_size=tuple(extents))


def _burn_tensor(values, scale, zero_point, axis, block, props) -> QuantizedTensor | None:
    """The Burn ``QFloat`` tensor of a ``DequantizeLinear`` weight, or ``None`` when Burn cannot
    hold it (values outside int8 after removing the zero point, a per-axis scale on an axis
    longer than Burn's 255-element blocks, non-positive scales)."""
    values = np.asarray(values)
    scale = np.asarray(scale, dtype=np.float32)
    rank = values.ndim
    if axis is not None and axis < 0:
        axis += rank
    q = values.astype(np.int32)
    if zero_point is not None:
        zp = np.asarray(zero_point).astype(np.int32)
        if zp.ndim and axis is not None:
            if block is None:
                shape = [1] * rank
                shape[axis] = -1
                zp = zp.reshape(shape)
            else:
                zp = np.repeat(zp, block, axis=axis).take(range(values.shape[axis]), axis=axis)
        q = q - zp
    if q.size and (q.min() < -128 or q.max() > 127):
        return None
    if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        return None
    scheme = _scheme_from_props(props, values, scale.shape, axis, block, rank)
    global_scale = None
    if scheme is None:  # per-axis
        extents = [d for d in values.shape]
        extents[axis] = 1
        if any(e > 255 for e in extents):
            return None
        value = QuantValue.Q8S if q.min(initial=0) >= -127 else QuantValue.Q8F
        if values.dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
            value = QuantValue.Q4S if q.min(initial=0) >= -7 else QuantValue.Q4F
        scheme = QuantScheme(value, block_size=tuple(extents))
    if props is not None and props.get(GLOBAL_SCALE_KEY):
        global_scale = np.float32(float.fromhex(props[GLOBAL_SCALE_KEY]))
        scale = (scale / global_scale).astype(np.float32)
    try:
        from .layout import params_shape

        grid = params_shape(values.shape, scheme)
        qt = QuantizedTensor(values.shape, scheme, q.astype(np.int8), scale.reshape(grid), global_scale)
        qt.to_bytes()  # scales representable in the scheme's dtype
    except QuantizationError:
        return None
    return qt


def fold_dequantize_weights(model: ir.Model) -> int:
    """Turn each ``DequantizeLinear(integer initializer, constant scale[, constant zero point])``
    of the main graph (and the ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` form the
    exporter writes) into one float initializer named as the integer initializer, whose value
    :func:`imported_param` makes a ``QFloat`` param. Called by the ONNX importer before it looks
    for weights. Returns the number of weights folded."""
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type == "MatMulInteger" and node.domain in ("", "ai.onnx"):
            folded += _fold_dynamic(graph, node)
    for node in list(graph):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
        data, scale, zp = (_const(v) for v in inputs[:3])
        source = inputs[0]
        if data is None or scale is None or (inputs[2] is not None and zp is None) or data.dtype not in _INT_TYPES:
            continue
        if source.is_graph_input() or len(source.uses()) != 1:
            continue
        axis = node.attributes.get("axis")
        block = node.attributes.get("block_size")
        axis = int(axis.value) if axis is not None else 1
        block = int(block.value) if block is not None and int(block.value) > 0 else None
        scale_arr = np.asarray(scale.numpy(), np.float32)
        if scale_arr.ndim == 0 or scale_arr.size == 1 and block is None:
            axis_used = None
        else:
            axis_used = axis
        qt = _burn_tensor(data.numpy(), scale_arr, None if zp is None else zp.numpy(), axis_used, block,
                          data.metadata_props)
        if qt is None:
            continue
        _replace_with_weight(graph, node.outputs[0], source, qt, data.metadata_props)
        graph.remove(node, safe=True)
        for value in inputs[1:3]:
            if value is not None:
                value.meta[_FOLDED_INPUT] = True
        folded += 1
    for value in list(graph.initializers.values()):
        if not value.uses() and not value.is_graph_output() and not value.is_graph_input() \
                and value.meta.get(_FOLDED_INPUT):
            graph.initializers.pop(value.name)
    return folded


_FOLDED_INPUT = "onnxparam.qdq.folded_input"
_IMPORTED = "onnxparam.qdq.imported"


def _replace_with_weight(graph, float_value: ir.Value, source: ir.Value, qt: QuantizedTensor, props) -> None:
    name = source.name
    lazy = ir.LazyTensor(lambda _qt=qt: ir.tensor(_qt.dequantize()), ir.DataType.FLOAT, ir.Shape(list(qt.shape)),
                         name=name)
    lazy.metadata_props.update({k: v for k, v in props.items() if k not in (SCHEME_KEY, GLOBAL_SCALE_KEY)})
    graph.initializers.pop(name)
    new = ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(list(qt.shape)),
                   const_value=lazy)
    new.meta[_IMPORTED] = qt
    float_value.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.register_initializer(new)


def _fold_dynamic(graph, mmi: ir.Node) -> int:
    """``DynamicQuantizeLinear(x) -> MatMulInteger(xq, W, xz[, wz]) -> Cast -> Mul(·, Mul(xs, s))``
    -> ``MatMul(x, W_float)``."""
    inputs = list(mmi.inputs)
    dql = inputs[0].producer() if inputs[0] is not None else None
    if dql is None or dql.op_type != "DynamicQuantizeLinear" or len(inputs) < 3 or inputs[2] is not dql.outputs[2]:
        return 0
    w = _const(inputs[1])
    wz = _const(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else None
    if w is None or w.dtype not in (ir.DataType.INT8, ir.DataType.UINT8) or len(inputs[1].uses()) != 1:
        return 0
    if len(inputs) > 3 and inputs[3] is not None and wz is None:
        return 0
    uses = list(mmi.outputs[0].uses())
    if len(uses) != 1 or uses[0][0].op_type != "Cast":
        return 0
    cast = uses[0][0]
    cuses = list(cast.outputs[0].uses())
    if len(cuses) != 1 or cuses[0][0].op_type != "Mul":
        return 0
    mul = cuses[0][0]
    other = mul.inputs[1 - cuses[0][1]]
    smul = other.producer() if other is not None else None
    if smul is None or smul.op_type != "Mul" or len(list(other.uses())) != 1:
        return 0
    s_in = [v for v in smul.inputs if v is not dql.outputs[1]]
    if len(s_in) != 1 or _const(s_in[0]) is None:
        return 0
    scale = np.asarray(_const(s_in[0]).numpy(), np.float32)
    axis = None if scale.size == 1 and scale.ndim <= 1 else 1
    qt = _burn_tensor(w.numpy(), scale.reshape(()) if axis is None else scale, None if wz is None else wz.numpy(),
                      axis, None, w.metadata_props)
    if qt is None:
        return 0
    x = dql.inputs[0]
    matmul = ir.Node("", "MatMul", [x, inputs[1]], name=mmi.name.replace("/dynamic/MatMulInteger", "") or None)
    y = mul.outputs[0]
    out = matmul.outputs[0]
    out.name = y.name
    out.type, out.shape = y.type, y.shape
    graph.insert_before(dql, [matmul])
    y.name = None
    y.replace_all_uses_with(out, replace_graph_outputs=True)
    w_source = inputs[1]
    for node in (mul, smul, cast, mmi):
        graph.remove(node, safe=True)
    if not any(o.uses() for o in dql.outputs):
        graph.remove(dql, safe=True)
    float_value = ir.Value(name=None)
    matmul.replace_input_with(1, float_value)
    _replace_with_weight(graph, float_value, w_source, qt, w.metadata_props)
    for value in (s_in[0],) + ((inputs[3],) if wz is not None else ()):
        if not value.uses() and value.is_initializer() and value.name in graph.initializers:
            value.meta[_FOLDED_INPUT] = True
    return 1


def imported_param(site, meta):
    """The ``QFloat`` param of a weight :func:`fold_dequantize_weights` made, else ``None``
    (called by the importer for every weight site)."""
    qt = site.value.meta.get(_IMPORTED) if site.value is not None else None
    if qt is None:
        return None
    from ..param import Param, ParamId

    pid = meta.param_id if meta.param_id is not None else ParamId()
    require_grad = bool(meta.require_grad) if meta.require_grad is not None else False

    def init(device, require_grad, _qt=qt):
        return _qt.to_tensor()

    return Param.uninitialized(pid, init, "cpu", require_grad, qt.shape, DType.QFloat)

