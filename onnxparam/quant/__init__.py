"""Quantization: Burn's schemes and quantized tensors, quantizing modules, and quantized ONNX graphs.

The quantized *values* are part of the core (a ``Tensor`` may hold a ``QuantizedTensor``; the
burnpack format stores their bytes); this facade re-exports them. Every rule cites
``docs/burnpack.md`` (the repository's note on Burn's format):

* :mod:`onnxparam.core.quant_scheme`  the enums and :class:`QuantScheme`, with their CBOR form (§1.3)
* :mod:`onnxparam.core.quant_layout`  the byte layout of values and scales (§2)
* :mod:`onnxparam.core.quant_scales`  scale dtypes: round-up, encode, decode (§2.3, §4.4)
* :mod:`onnxparam.core.tensor`        :class:`QuantizedTensor`: bytes <-> values, dequantization (§2, §3);
  :func:`quantize`: Burn's ``Quantizer`` with MinMax calibration (§4)

The verbs and graphs of this package (layer ``quant/``):

* :mod:`._module`       :class:`Quantizer`, :class:`Calibration`: quantizing a module's params
* :mod:`._qdq`          quantized params in ONNX graphs (QDQ export / import, static activations);
  the tracer and the ONNX importer call into it; ``_qdq_forms`` picks each op's form (float /
  dynamic / static int8, ``prefer="speed"|"size"``) and writes the per-op report
  (:func:`quantized_ops`), ``_nbits`` writes 4-bit MatMul weights as ``com.microsoft.MatMulNBits``
  below opset 21 (4-bit Gemm weights too; other 4-bit weights are written float with a reason),
  ``_nbits_import`` reads ``MatMulNBits`` weights back as ``QFloat`` params
* :mod:`._passes`       the standard graph passes of a trace (LoRA, then QDQ)
"""

from ..core.errors import QuantizationWarning
from ..core.quant_layout import params_shape, quantized_nbytes
from ..core.quant_scheme import BlockScale, BlockSize, QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype

_UPPER_LAYERS = {
    "quantize": "..core.tensor", "round_half_away_from_zero": "..core.tensor", "QuantizedTensor": "..core.tensor",
    "quantize_per_axis": "..core.tensor",
    "Calibration": "._module", "Quantizer": "._module", "channel_axes": "._module",
    "QdqOptions": "._qdq", "qdq_options": "._qdq", "matmulnbits_accuracy_level": "._qdq",
    "quantize_activations": "._activations", "quantized_ops": "._qdq_forms",
}
"""Names imported on first use (plain imports in ``__getattr__``): their modules import numpy,
``ml_dtypes`` or ONNX, which ``import onnxparam.quant`` for a scheme does not need."""


def __getattr__(name):
    owner = _UPPER_LAYERS.get(name)
    if owner == "..core.tensor":
        from ..core import tensor as module
    elif owner == "._module":
        from . import _module as module
    elif owner == "._qdq":
        from . import _qdq as module
    elif owner == "._activations":
        from . import _activations as module
    elif owner == "._qdq_forms":
        from . import _qdq_forms as module
    else:
        raise AttributeError(f"module 'onnxparam.quant' has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)
    return value


def __dir__():
    return sorted(set(globals()) | set(_UPPER_LAYERS))

__all__ = [
    "QuantValue",
    "QuantStore",
    "QuantMode",
    "ScaleDtype",
    "BlockSize",
    "BlockScale",
    "QuantScheme",
    "QuantizedTensor",
    "Quantizer",
    "Calibration",
    "QdqOptions",
    "qdq_options",
    "quantize_activations",
    "matmulnbits_accuracy_level",
    "quantized_ops",
    "quantize_per_axis",
    "channel_axes",
    "QuantizationWarning",
    "quantize",
    "quantized_nbytes",
    "params_shape",
    "round_half_away_from_zero",
]
