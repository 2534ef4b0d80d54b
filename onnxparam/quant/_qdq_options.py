"""QDQ export options and the metadata keys of quantized initializers (see :mod:`onnxparam.quant._qdq`)."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace

import onnx_ir as ir

ACCURACY_LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"
"""ONNX Runtime session config entry: the ``accuracy_level`` of the ``MatMulNBits`` it fuses from
``DequantizeLinear -> MatMul`` (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations)."""

SCHEME_KEY = "onnxparam.quant._scheme"
"""Initializer ``metadata_props`` key: the Burn ``QuantScheme`` (JSON of its CBOR value)."""

NBITS_TRANS_KEY = "onnxparam.quant.nbits_trans"
"""Initializer ``metadata_props`` key on an exported ``MatMulNBits`` ``B``: ``"1"`` when the param
is a ``Gemm`` ``transB=1`` weight ``[N, K]`` (import restores that shape and the ``Gemm``)."""

GLOBAL_SCALE_KEY = "onnxparam.quant.global_scale"
"""Initializer ``metadata_props`` key: a two-level scheme's global scale (``float.hex``)."""

ACTIVATION_RANGES_ATTR = "_onnxparam_activation_ranges"
"""Private module attribute: ``((value_name, min, max), ...)`` from :func:`quantize_activations`."""

NBITS_MIN_BLOCK = 16
"""``MatMulNBits`` blocks: a power of 2, at least 16 (ORT's ``DQMatMulToMatMulNBits`` selector)."""

MATMUL_MODES = ("auto", "dynamic", "dequantize")
PREFER_MODES = ("speed", "size")
KERNEL_WEIGHTS = ("uint8", "int8")
_QDQ_META = "onnxparam.qdq"


@dataclass(frozen=True)
class QdqOptions:
    """How quantized params are exported (module docstring).

    Args:
        matmul: ``"auto"`` (8-bit per-tensor / per-column weights of ``MatMul`` -> dynamic
            activation quantization, ORT ``DynamicQuantizeMatMul``; the rest ``DequantizeLinear``),
            ``"dynamic"`` (as auto), or ``"dequantize"`` (``DequantizeLinear`` everywhere).
        unsigned: write ``UINT8`` / ``UINT4`` values with zero point 128 / 8 instead of signed
            ones without zero point (lossless either way). An 8-bit weight an integer kernel reads
            (``MatMulInteger``, static ``QLinearMatMul`` / ``QLinearConv``) is ``UINT8`` with zero
            point 128 either way: ORT's uint8 x int8 kernels saturate on x86 CPUs without VNNI
            (:func:`onnxparam.quant._qdq_forms.unsigned_for_integer_kernels`), unless
            ``kernel_weights="int8"``.
        kernel_weights: how an 8-bit weight an integer kernel reads is stored: ``"uint8"``
            (default: codes + 128 with zero point 128, exact on every CPU) or ``"int8"`` (the
            codes as they are, no zero point: the layout ``quantize_dynamic`` /
            ``quantize_static`` write, whose uint8 x int8 kernels ran the bench transformer
            1.1-1.25x faster on AVX2). **Opt-in for CPUs whose uint8 x int8 kernels do not
            saturate** (x86 with AVX-VNNI / AVX512-VNNI: ``VPDPBUSD`` adds into int32; check others
            with ``tests/test_quant_integer_kernels.py``): on x86 with AVX2 but no VNNI, ONNX
            Runtime adds pairs of products into a saturating int16 and the file computes wrong
            values with no error (MNIST int8 accuracy 0.76-0.84 instead of 0.92). The export
            warns (:class:`~onnxparam.core.errors.QuantizationWarning`) when the CPU it runs on
            is not known to be safe; the file runs wrong on any such CPU it is deployed to.        reblock: re-quantize ``MatMul`` weights blocked along N with blocks along K so that ORT
            fuses ``MatMulNBits`` (lossy; the largest error is reported), instead of warning.
        prefer: ``"speed"`` (default): a weight feeding only ops that ORT runs slower with a
            weight-only ``DequantizeLinear`` than in float (Conv, ConvTranspose, Gemm without
            calibrated activations) is written as a float initializer (exactly ``param.val()``),
            so the export is never slower than float32; ``"size"``: every quantized weight stays
            integer (smallest file; those ops dequantize at every run).
        float_module: the float module the exported (quantized) one was quantized from, e.g.
            ``float_model`` of ``float_model.quantize_weights(q)`` (params matched by
            :class:`~onnxparam.ParamId`). A quantized weight the export writes float (``prefer``,
            a 4-bit weight below opset 21 without a ``MatMulNBits`` form, a scale grid ONNX
            cannot express) then gets that module's **original** float values, not the
            dequantized ones, so only what is written quantized carries quantization error
            (``onnxparam quantize`` passes its input model). ``None`` (default): such weights are
            written as ``param.val()``, so the file computes what the quantized module does.

    Raises:
        ValueError: for an unknown ``matmul`` or ``prefer`` mode, or a ``float_module`` that is
            no module, or an unknown ``kernel_weights``.
    """

    matmul: str = "auto"
    unsigned: bool = False
    reblock: bool = False
    prefer: str = "speed"
    float_module: object = None
    kernel_weights: str = "uint8"

    def __post_init__(self):
        if self.matmul not in MATMUL_MODES:
            raise ValueError(f"QdqOptions.matmul must be one of {', '.join(MATMUL_MODES)}; got {self.matmul!r}")
        if self.kernel_weights not in KERNEL_WEIGHTS:
            raise ValueError(f"QdqOptions.kernel_weights must be one of {', '.join(KERNEL_WEIGHTS)}; "
                             f"got {self.kernel_weights!r}")
        if self.prefer not in PREFER_MODES:
            raise ValueError(f"QdqOptions.prefer must be one of {', '.join(PREFER_MODES)}; got {self.prefer!r}")
        if self.float_module is not None and not callable(getattr(self.float_module, "named_params", None)):
            raise ValueError(f"QdqOptions.float_module must be a Module (the float one); got "
                             f"{type(self.float_module).__name__}")


_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("onnxparam_qdq_options", default=None)

RUNTIME_DEFAULT_OPTIONS = QdqOptions(matmul="dequantize", prefer="size")
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


_INT_TYPES = (ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT4, ir.DataType.UINT4)


def _const(value: ir.Value | None):
    if value is None:
        return None
    if value.const_value is not None and value.is_initializer():
        return value.const_value
    return None
