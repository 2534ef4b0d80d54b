"""Quantization values: Burn's schemes, quantized tensors and the MinMax quantizer.

This is the value layer. It knows Burn's ``QuantScheme`` and the bytes of one ``QFloat``
tensor (values, scales, optional global scale), but nothing of files: the burnpack format
(:mod:`onnxparam.burnpack`) stores these bytes, and the model layer attaches them to params.
Every rule here cites ``docs/burnpack.md`` (the repository's note on Burn's format):

* :mod:`._scheme`       the enums and :class:`QuantScheme`, with their CBOR form (§1.3)
* :mod:`._layout`       the byte layout of values and scales (§2)
* :mod:`._scales`       scale dtypes: round-up, encode, decode (§2.3, §4.4)
* :mod:`._tensor`       :class:`QuantizedTensor`: bytes <-> values, dequantization (§2, §3)
* :mod:`._calibration`  :func:`quantize`: Burn's ``Quantizer`` with MinMax calibration (§4)
* :mod:`._module`       :class:`Quantizer`, :class:`Calibration`: quantizing a module's params
* :mod:`._qdq`          quantized params in ONNX graphs (QDQ export / import, static activations);
  the tracer and the ONNX importer call into it; ``_qdq_forms`` picks each op's form (float /
  dynamic / static int8, ``prefer="speed"|"size"``) and writes the per-op report
  (:func:`quantized_ops`), ``_nbits`` writes 4-bit MatMul weights as ``com.microsoft.MatMulNBits``
  below opset 21 (4-bit Gemm weights too; other 4-bit weights are written float with a reason),
  ``_nbits_import`` reads ``MatMulNBits`` weights back as ``QFloat`` params
"""

import importlib

from ..errors import QuantizationWarning
from ._layout import params_shape, quantized_nbytes
from ._scheme import BlockScale, BlockSize, QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype

_UPPER_LAYERS = {
    "quantize": "._calibration", "round_half_away_from_zero": "._calibration", "QuantizedTensor": "._tensor",
    "Calibration": "._module", "Quantizer": "._module",
    "QdqOptions": "._qdq", "qdq_options": "._qdq", "quantize_activations": "._activations",
    "matmulnbits_accuracy_level": "._qdq", "quantized_ops": "._qdq_forms", "quantize_per_axis": "._calibration",
    "channel_axes": "._module",
}
"""Names imported on first use: those of the model layer (:mod:`._module`) and the graph layer
(:mod:`._qdq`), since this facade sits in the value layer, which ``burnpack`` and ``tensor``
import; and those whose modules import ``ml_dtypes`` (slow), which reading a burnpack file's
header does not need."""


def __getattr__(name):
    if name in _UPPER_LAYERS:
        value = getattr(importlib.import_module(_UPPER_LAYERS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onnxparam.quant' has no attribute {name!r}")


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
