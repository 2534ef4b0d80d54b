"""onnxparam: Burn's Param/Module model for ONNX models, executed through ONNX Runtime.

Layers (each knows only the ones above it in this list):

* **values**: :mod:`~onnxparam.dtype`, :mod:`~onnxparam.device`, :mod:`~onnxparam.tensor`,
  :mod:`~onnxparam.errors`, :mod:`~onnxparam.quant` (quantized values, no files).
* **model**: :mod:`~onnxparam.param` (``ParamId``, ``Param``), :mod:`~onnxparam.group`,
  :mod:`~onnxparam.module` (the one traversal), :mod:`~onnxparam.lora`. Knows nothing of
  files or ONNX protobuf.
* **formats**: :mod:`~onnxparam.burnpack` (bytes of Burn's ``.bpk``; knows nothing of modules).
* **bridges**: :mod:`~onnxparam.record` (module <-> records <-> files), ONNX export/import,
  converters.
* **runtime**: :mod:`~onnxparam.trace` and :mod:`~onnxparam.runtime` own ONNX graphs and
  ONNX Runtime sessions.
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("onnxparam")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+source"

from . import burnpack
from .device import Device
from .dtype import DType
from .errors import (
    BurnpackFormatError,
    DeviceError,
    ExecutionError,
    OnnxFormatError,
    OnnxParamError,
    PrecisionWarning,
    QuantizationError,
    RecordError,
    ShapeMismatchError,
    TraceError,
    TraceTypeError,
    TraceValueError,
)
from .group import ParamGroup
from .lora import LoraAdapter, LoraConfig
from .lora_graph import write_onnx_adapter
from .module import Module, ModuleMapper, ModuleVisitor
from .onnx_io import OnnxModule, export_onnx, import_onnx
from .param import Param, ParamId
from .quant import (
    BlockSize,
    Calibration,
    QuantizedTensor,
    Quantizer,
    QuantMode,
    QuantScheme,
    QuantStore,
    QuantValue,
    ScaleDtype,
)
from .record import ModuleRecord, TensorSnapshot
from .tensor import Tensor, TensorData

from . import nn  # noqa: E402  (layers build on everything above)
from .convert.peft import load_peft_adapter  # noqa: E402  (a bridge: PEFT files -> adapters)

__all__ = [
    "__version__",
    "burnpack",
    "nn",
    "export_onnx",
    "import_onnx",
    "OnnxModule",
    "QuantScheme",
    "Quantizer",
    "Calibration",
    "QuantValue",
    "QuantStore",
    "QuantMode",
    "ScaleDtype",
    "BlockSize",
    "QuantizedTensor",
    "Device",
    "DType",
    "Tensor",
    "TensorData",
    "Param",
    "ParamId",
    "ParamGroup",
    "Module",
    "ModuleVisitor",
    "ModuleMapper",
    "ModuleRecord",
    "TensorSnapshot",
    "LoraConfig",
    "LoraAdapter",
    "write_onnx_adapter",
    "load_peft_adapter",
    "OnnxParamError",
    "RecordError",
    "BurnpackFormatError",
    "ShapeMismatchError",
    "DeviceError",
    "TraceError",
    "TraceTypeError",
    "TraceValueError",
    "ExecutionError",
    "OnnxFormatError",
    "QuantizationError",
    "PrecisionWarning",
]

_LAZY_TRAINING = {"autodiff": None, "optim": None, "grad": "autodiff", "Gradients": "autodiff"}
"""Training names imported on first use: ``onnxparam.autodiff`` loads ONNX Runtime, which a
plain ``import onnxparam`` does not."""


def __getattr__(name):
    if name in _LAZY_TRAINING:
        import importlib

        owner = _LAZY_TRAINING[name]
        module = importlib.import_module(f".{owner or name}", __name__)
        return getattr(module, name) if owner else module
    raise AttributeError(f"module 'onnxparam' has no attribute {name!r}")
