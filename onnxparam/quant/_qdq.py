"""Quantized params in ONNX graphs: ``DequantizeLinear`` (QDQ) export, layouts ONNX Runtime
fuses into integer kernels, static activation quantization, and QDQ import.

**Weights** (:func:`emit_param`, called by the tracer's param hook for a ``QFloat`` param): the
param's initializer (named by its path, as every param's) holds the **stored integer values**,
never re-quantized; ``<path>_scale`` and ``<path>_zero_point`` are constants; a
``DequantizeLinear`` gives the float weight. Every unblocked ``DequantizeLinear`` of the finished
graph has a zero point, zeros of the codes' dtype for signed codes (:func:`explicit_zero_points`
says why: without one, ORT's QDQ propagation inserts a ``uint8`` ``QuantizeLinear`` that clips
negative codes). Burn -> ONNX (``docs/burnpack.md`` §7):

==============================  ==============================================================
Burn                            ONNX ``DequantizeLinear``
==============================  ==============================================================
Q8S / Q8F                       ``INT8``, zero point 0 (``unsigned``: ``UINT8``, zero point 128);
                                a weight an integer kernel reads (``MatMulInteger``, the QDQ
                                ``QLinearMatMul`` / ``QLinearConv`` fuse) is always ``UINT8`` with
                                zero point 128: ORT's u8 x s8 kernels saturate on x86 without VNNI
                                (``_qdq_forms.unsigned_for_integer_kernels``)
Q4S / Q4F                       ``INT4``, zero point 0 unless blocked (opset >= 21; ``UINT4``, zero point 8);
                                a MatMul / Gemm weight becomes ``com.microsoft.MatMulNBits`` (``_nbits``; from
                                opset 21 not with ``matmul="dequantize"``); below 21 any other
                                4-bit weight is written float, with a warning and the reason in
                                the per-op report (never as ``INT8``)
Q2S / Q2F                       ``INT8`` (ONNX ``INT2`` needs opset 25; ORT 1.32 has no kernel)
per-tensor                      scalar scale
blocks, scale grid varying      per-axis (``axis``), 1-D scale
along one axis only
a block with one extent > 1     blocked: ``axis`` = that axis, ``block_size`` = its extent,
(at axis ``i``)                 scale shaped as the grid (opset >= 21)
ONNX per-axis (``qt.axis``)      per-axis (``axis``), 1-D scale (``Quantizer(per_channel=True)``)
scale dtype F16 / BF16 / UE4M3  widened to float32 (exact); an F16 weight (opset >= 19) whose
                                scales are F16 values gets an F16 scale and F16 output, no Cast
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
  quantized to uint8 per tensor at run time); blocked 8-bit weights keep
  ``DequantizeLinear -> MatMul`` (``MatMulNBits``); 4-bit MatMul / Gemm weights are written as
  ``com.microsoft.MatMulNBits`` at every opset with ``accuracy_level`` 0 (float32 compute; the
  session default 4 that ORT gives a fused ``DequantizeLinear -> MatMul`` quantizes activations
  to int8 and ran 1.27-1.35x slower on a transformer block on AVX2, ``tools/bench.py quant``).
  ``matmul="dequantize"`` keeps plain QDQ
  everywhere; it is what ``module(x)`` uses unless called inside :func:`qdq_options`, so the
  runtime computes with exactly ``param.val()``.
* ``Conv`` / ``Gemm`` with only a dequantized weight are not fused (ORT needs quantized
  activations too: see below); a weight-only conv dequantizes at every run, so the default
  (``prefer="speed"``) writes those weights float (below).

**Activations** (:func:`onnxparam.quant.quantize_activations`): with calibration data, ``QuantizeLinear ->
DequantizeLinear`` pairs (uint8, asymmetric, MinMax ranges) are put on the activation input and
the output of every ``MatMul`` / ``Conv`` with a quantized weight, so ORT fuses ``QLinearConv`` /
``QLinearMatMul`` (static quantization; ORT quantizes a float conv bias itself).

**Which form each op gets** (``QdqOptions.prefer``; ``_qdq_forms``): ``"speed"`` (default) writes
a weight that feeds only ops ORT runs slower with a weight-only ``DequantizeLinear`` than in float
(Conv, ConvTranspose, Gemm without calibrated activations; LSTM, GRU, RNN, which have no integer
kernel) as its float values, so the default
export is never slower than float32; ``"size"`` keeps every weight integer. The choice per op is
written to the model's ``onnxparam.quant.ops`` metadata (``quantized_ops``) and logged.

**Burnpack and ONNX-only schemes**: a per-channel weight whose block extents exceed Burn's 255
is an ONNX per-axis tensor (``QuantizedTensor.axis``); saving it to burnpack raises, naming the
param (Burn could not read it). Per-channel weights within Burn's limits are Burn block schemes.

Parts: options and metadata keys (``_qdq_options``), weight layouts (``_qdq_layout``), this
module (the export pass: :func:`emit_param`, :func:`finish_graph`), activation QDQ pairs
(``_qdq_static``: where they go, tied through MaxPool / Flatten, after a Relu),
calibration (``_activations``: :func:`onnxparam.quant.quantize_activations`) and import
(``_qdq_import``: ``fold_dequantize_weights``, ``imported_param``).

**Import** (``fold_dequantize_weights``): ``DequantizeLinear(integer initializer, constant
scale[, constant zero point])`` and the ``DynamicQuantizeLinear -> MatMulInteger`` form above
(a ``Gemm(transB=1)`` weight's ``Transpose`` of the codes too: back to that ``Gemm``)
become one float weight that ``imported_param`` turns into a ``QFloat`` param; so does a
``com.microsoft.MatMulNBits`` weight (``_nbits_import``: Burn's 4-bit block scheme along K, Q8S
for zero points other than 8), which becomes ``MatMul`` (or the ``Gemm`` it was exported from).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import QuantizationError, QuantizationWarning
from ..core.quant_scheme import QuantValue
from ..core.tensor import QuantizedTensor
from . import _nbits
from . import _qdq_forms as _forms
from . import _qdq_static as _static
from ._qdq_layout import WeightLayout, reblocked_layout, weight_layout
from ._qdq_options import (  # noqa: F401  (_OPTIONS: read by runtime.calls' fast path)
    _OPTIONS,
    _QDQ_META,
    ACCURACY_LEVEL_KEY,
    ACTIVATION_RANGES_ATTR,
    GLOBAL_SCALE_KEY,
    MATMUL_MODES,
    NBITS_MIN_BLOCK,
    RUNTIME_DEFAULT_OPTIONS,
    SCHEME_KEY,
    QdqOptions,
    current_options,
    matmulnbits_accuracy_level,
    qdq_options,
    runtime_options,
)
from ._qdq_static import dims as _dims
from ._qdq_static import node as _node

__all__ = [
    "ACCURACY_LEVEL_KEY",
    "GLOBAL_SCALE_KEY",
    "SCHEME_KEY",
    "ACTIVATION_RANGES_ATTR",
    "NBITS_MIN_BLOCK",
    "MATMUL_MODES",
    "RUNTIME_DEFAULT_OPTIONS",
    "QdqOptions",
    "QuantizationWarning",
    "WeightLayout",
    "current_options",
    "runtime_options",
    "emit_param",
    "finish_graph",
    "is_qdq_initializer",
    "matmulnbits_accuracy_level",
    "qdq_options",
    "quantized_param_value",
    "reblocked_layout",
    "weight_layout",
]


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
    from ..trace.tracer import untraced

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
    opset21 = False
    if tracer.opset < 21 and qt.scheme.value in (QuantValue.Q4S, QuantValue.Q4F):
        # NOTE: a 4-bit weight is never written as INT8 below opset 21 (it would claim 4 bits and
        # store 8): it takes opset 21's INT4 layout for a moment, and finish_graph turns its MatMul /
        # Gemm uses into com.microsoft MatMulNBits, or the weight into a float one with a reported
        # reason (quant/_nbits.py)
        layout, opset21 = weight_layout(qt, 21, options), True
    if layout is not None and layout.axis is not None and tracer.opset < 13 and not opset21:
        # NOTE: DequantizeLinear's axis attribute (per-axis scales) is opset 13's; ORT refuses to load
        # it at opset 10-12 ("Unrecognized attribute: axis"). The codes were rounded against one scale
        # per channel, so no per-tensor form is exact: the weight stays float, and the warning says why.
        warnings.warn(
            f"{path!r} ({qt.describe()}, shape {list(qt.shape)}) has one scale per index of axis {layout.axis}: "
            f"DequantizeLinear takes per-axis scales from opset 13, the model's opset is {tracer.opset}; it is "
            f"exported as a float32 initializer ("
            f"{'its original values' if _forms.original_param(tracer, param) is not None else 'dequantized, exact'}"
            "); quantize per tensor (leave out --per-channel) or convert the model to opset 13 or later",
            QuantizationWarning, stacklevel=4)
        return None
    if layout is None:
        warnings.warn(
            f"{path!r} ({qt.describe()}, shape {list(qt.shape)}) has a scale layout ONNX "
            f"DequantizeLinear cannot express at opset {tracer.opset} (2-D blocks need per-element scales; "
            "blocks need opset 21): it is exported as a float32 initializer ("
            f"{'its original values' if _forms.original_param(tracer, param) is not None else 'dequantized, exact'})",
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
    half = _half_scale(qt, layout, tracer.opset)
    scale_array = layout.scale.astype(np.float16) if half else layout.scale
    scale = tracer.constant(scale_array, name=f"{path}_scale")._symbol.value
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
    out_dtype = DType.F16 if half else DType.F32
    out = tracer.emit("DequantizeLinear", inputs, attrs, output_types=[(out_dtype, tuple(shape))])[0]
    out._symbol.param = param
    node = out._symbol.value.producer()
    value.meta[_QDQ_META] = _Emitted(path, param, qt, layout, value, scale, zero_point, node, out)
    value.meta[_QDQ_META + ".ref"] = layout_ref
    if opset21:
        value.meta[_QDQ_META + ".opset21"] = True
    if qt.float_dtype is not out_dtype:
        # NOTE: DequantizeLinear computes in float32 (its scale's type; a narrower scale would round
        # it); the weight comes back at the param's own dtype, as Param.val() casts it. The Cast
        # hides the MatMul from the fused forms (finish_graph), so such a weight is not fused.
        out = tracer.emit("Cast", [out], {"to": qt.float_dtype}, output_types=[(qt.float_dtype, tuple(shape))])[0]
        out._symbol.param = param
    return out


def _half_scale(qt: QuantizedTensor, layout: WeightLayout, opset: int) -> bool:
    """Whether an F16 weight's ``DequantizeLinear`` takes an F16 scale and gives F16 directly:
    opset >= 19 (ONNX operator spec: DequantizeLinear-19 adds float16 scales) and every scale
    exactly an F16 value (as ``quantize_weights`` of an F16 param makes them; ``q * scale`` is
    then rounded once, as ``Param.val()`` rounds Burn's float32 product to F16)."""
    if qt.float_dtype is not DType.F16 or opset < 19:
        return False
    scale = np.asarray(layout.scale, np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(scale.astype(np.float16).astype(np.float32), scale))


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
    """The QDQ pass's value of a ``QFloat`` param (:attr:`onnxparam.trace.tracer.GraphPasses.quantized_param`):
    :func:`emit_param`'s dequantized tensor; when ONNX cannot express the scheme, the original
    float param's tensor (:attr:`QdqOptions.float_module`), else the float dtype the tracer holds
    the dequantized values as."""
    tensor = emit_param(tracer, param, path, shape)
    if tensor is not None:
        return tensor
    original = _forms.original_param(tracer, param)
    if original is not None:  # QdqOptions.float_module: the original float values, not val()
        tracer._param_paths[id(original)] = path
        return tracer.param_value(original)
    return _quantized_of(param).float_dtype


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
    for e in emitted:
        _check_fusable(tracer, e, options)
    if tracer.opset < 21:
        for e in emitted:
            _nbits.matmul_nbits(tracer, e, options.prefer)
    elif options.matmul in ("auto", "dynamic") and not ranges:
        # NOTE: ORT fuses DQ(INT4) -> MatMul into MatMulNBits with the session's accuracy_level, 4 (int8
        # activations) unless set: 1.27-1.35x the time of accuracy_level 0 (float32 compute, what
        # MatMulNBitsQuantizer writes) on a transformer block at M = 512 on AVX2. Written directly, the
        # op carries level 0 in the file and computes with exactly the dequantized weights
        for e in emitted:
            _nbits.matmul_nbits(tracer, e, options.prefer, direct=True)
    if ranges:
        _static.fold_batch_norms(tracer, emitted)
        _static.insert_activation_qdq(tracer, {name: (lo, hi) for name, lo, hi in ranges},
                                       {id(e.output._symbol.value) for e in emitted})
    elif options.matmul in ("auto", "dynamic"):
        for e in emitted:
            _dynamic_matmuls(tracer, e)
            _forms.dynamic_gemms(tracer, e)
            _forms.gather_then_dequantize(tracer, e)
    _forms.keep_float(tracer, emitted, options.prefer)
    _forms.unsigned_for_integer_kernels(tracer, emitted, options.kernel_weights)  # u8 x s8 saturates w/o VNNI
    _forms.record_report(tracer, emitted)
    for e in emitted:
        if not e.output._symbol.value.uses() and not e.output._symbol.value.is_graph_output():
            e.node.graph.remove(e.node, safe=True)
    explicit_zero_points(tracer)


def zero_point_array(layout: WeightLayout) -> np.ndarray:
    """``layout``'s zero point as written: its own (unsigned codes), else zeros of the codes'
    dtype (``int8`` / ``ml_dtypes.int4``) shaped as the scale (:func:`explicit_zero_points`)."""
    if layout.zero_point is not None:
        return layout.zero_point
    return np.zeros(np.shape(layout.scale), dtype=layout.values.dtype)


def explicit_zero_points(tracer) -> None:
    """Give every ``DequantizeLinear`` of the finished graph whose codes are not ``uint8`` and
    which has no zero point an explicit one: zeros of the codes' dtype shaped as its scale
    (``<codes>_zero_point``). The values do not change (ONNX spec: an absent zero point is 0).
    Blocked ones (``block_size``) are left without: their scale is never a scalar, which ORT's
    propagation requires, and ORT fuses them into ``MatMulNBits`` with no ``zero_points`` input
    (one with zeros would add that input to the fused op).

    Why: ONNX Runtime's ``QDQPropagationTransformer`` (on by default) moves a per-tensor
    ``DequantizeLinear`` past a ``Transpose`` / ``Reshape`` / ``Squeeze`` ... and inserts a
    ``QuantizeLinear`` with the same scale and zero point inputs; without a zero point that
    ``QuantizeLinear`` outputs ``uint8`` (the spec's default), which clips every negative code to 0:
    a wrong number with no error (an int8 embedding table's gathered rows feeding an LSTM's
    ``Transpose``: cosine 0.95 to the module)."""
    from onnx_ir.traversal import RecursiveGraphIterator

    made: dict = {}
    for node in list(RecursiveGraphIterator(tracer.graph)):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        if (len(node.inputs) > 2 and node.inputs[2] is not None) or node.attributes.get("block_size") is not None:
            continue
        codes, scale = node.inputs[0], node.inputs[1]
        if codes is None or scale is None or codes.dtype in (None, ir.DataType.UINT8) or not codes.dtype.is_integer():
            continue
        dims = scale.shape if scale.shape is not None else (
            scale.const_value.shape if scale.const_value is not None else None)
        if dims is None or not all(isinstance(d, int) for d in dims):
            continue
        dims = tuple(int(d) for d in dims)
        source = codes.producer()
        base = source.inputs[0] if source is not None and source.op_type in ("Gather", "Transpose") else codes
        key = (id(base), codes.dtype, dims)
        if key not in made:
            zero = ir.Value(name=tracer.unique_name(f"{base.name or 'codes'}_zero_point"),
                            const_value=ir.Tensor(np.zeros(dims, dtype=codes.dtype.numpy()), dtype=codes.dtype))
            zero.type, zero.shape = ir.TensorType(codes.dtype), ir.Shape(list(dims))
            tracer._constants.append(zero)
            made[key] = zero
        node.resize_inputs(3)
        node.replace_input_with(2, made[key])


def _expand_qlora(tracer, emitted: list) -> None:
    """Merge mode with a quantized base: the base stays quantized and the float adapter is added
    by graph nodes (``x @ DQ(W) + scale * ((x @ a) @ b)``), as ``"keep"`` mode does."""
    from ..lora import _graph as lora_graph

    for e in emitted:
        if e.param.adapter() is None:
            continue
        # NOTE: lora_graph's expander (the "keep" mode emitter) does exactly this for a base value;
        # the DQ output is the base here.
        lora_graph._Expander(tracer, e.param, e.output._symbol.value, DType.F32).expand()


def _uses(value: ir.Value) -> list:
    return list(value.uses())


def _check_fusable(tracer, e: _Emitted, options: QdqOptions) -> None:
    out = e.output._symbol.value
    layout = e.layout
    for node, index in _uses(out):
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
