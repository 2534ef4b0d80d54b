"""onnxparam: Burn's Param/Module model for ONNX models, executed through ONNX Runtime.

Layers, bottom to top; a file imports only its own layer and those below it
(``tests/test_layers.py`` checks every import, inside functions too, and that no two files
import each other in a cycle):

1. **values**: :mod:`~onnxparam.dtype`, :mod:`~onnxparam.device`, :mod:`~onnxparam.errors`,
   :mod:`~onnxparam.tensor` (``Tensor``, ``TensorData``), the quantized values of
   :mod:`~onnxparam.quant` (schemes, layout, scales, ``QuantizedTensor``, MinMax calibration).
2. **model**: :mod:`~onnxparam.param` (``ParamId``, ``Param``), :mod:`~onnxparam.group`,
   :mod:`~onnxparam.module` (the one traversal), :mod:`~onnxparam.lora`,
   ``onnxparam.quant._module`` (quantizing a module's weights). No files, no ONNX.
3. **formats**: bytes of files, no modules: :mod:`~onnxparam.burnpack`,
   :mod:`~onnxparam.formats` (safetensors, the shared memory map), the ONNX protobuf parts of
   :mod:`~onnxparam.onnx_io` (``source``, ``save``, ``weights``, ``metadata``, ``naming``).
4. **graph**: :mod:`~onnxparam._trace`, :mod:`~onnxparam.ops`, :mod:`~onnxparam.nn` (layers
   built from ops), the graph passes (``lora_graph``, ``quant.qdq``) and the backward graphs of
   :mod:`~onnxparam.autodiff`.
5. **runtime**: :mod:`~onnxparam.runtime` (ONNX Runtime sessions, calls), training steps
   (``autodiff.training``, :mod:`~onnxparam.optim`).
6. **bridges**: :mod:`~onnxparam.record` (module <-> records <-> files), ONNX import / export,
   :mod:`~onnxparam.convert` (converters, PEFT).
7. **cli / zoo**: :mod:`~onnxparam.cli`, :mod:`~onnxparam.zoo`, and this package facade.

Where a lower layer needs an upper one at run time (``Tensor.__add__`` -> ops, ``Module.__call__``
-> runtime, the tracer's LoRA / QDQ passes), the upper layer is registered below as a service
(:mod:`onnxparam._services`), imported on first use.
"""

from ._cli_start import install_if_command_line as _install_if_command_line

# NOTE: the command line's first signal handlers, before any heavy import (a Ctrl-C while the
# CLI starts is one line and exit 130, not a traceback); nothing happens for library users.
_install_if_command_line()

from ._services import provide as _provide  # noqa: E402
from ._version import __version__  # noqa: E402
from .device import Device
from .errors import (
    BurnpackFormatError,
    CallArgumentError,
    DeviceError,
    DTypeError,
    ExecutionError,
    FileAccessError,
    LoraError,
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

# Services the upper layers give the lower ones (onnxparam/_services.py), imported on first use.
_provide("ops", "onnxparam.ops")  # Tensor's operators (values -> graph)
_provide("trace.passes", "onnxparam._passes:STANDARD_PASSES")  # the tracer's default passes
_provide("quant.tensor", "onnxparam.quant._tensor")  # Tensor.from_data of QFloat bytes
_provide("quant.quantize", "onnxparam.quant._calibration:quantize")  # QuantizedTensor.quantize
_provide("lora", "onnxparam.lora")  # Module.apply_lora / merge_lora / valid
_provide("quant.module", "onnxparam.quant._module")  # Module.quantize_weights / apply_qlora
_provide("record", "onnxparam.record")  # Module.into_record / load_record / save_file (model -> bridges)
_provide("record.apply", "onnxparam.convert._store:apply_record")  # Module.load_record / load_file: the one loading path
_provide("lora.call_batched", "onnxparam._lora_batched_run:call_batched")  # module(x, adapter_index=...)
_provide("runtime.call_module", "onnxparam.runtime._calls:call_module")  # Module.__call__
_provide("runtime.run_eager", "onnxparam.runtime._eager:run_eager")  # an op outside a trace
_provide("runtime.ortvalue_from_numpy", "onnxparam.runtime._devices:ortvalue_from_numpy")  # Tensor.to_device
_provide("runtime.clear_caches", "onnxparam.runtime._calls:clear_caches")  # nn.seed: seeded dropout restarts
_provide("autodiff.clear_cache", "onnxparam.autodiff._training:clear_cache")  # nn.seed: the training graphs too

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
    "LoraAdapterSet",
    "write_onnx_adapter",
    "check_onnx_adapter",
    "BatchedLora",
    "write_batched_adapter",
    "check_batched_adapters",
    "load_peft_adapter",
    "save_peft_adapter",
    "load_peft_adapters",
    "save_peft_adapters",
    "PeftLoadReport",
    "OnnxParamError",
    "RecordError",
    "BurnpackFormatError",
    "ShapeMismatchError",
    "DeviceError",
    "TraceError",
    "TraceTypeError",
    "TraceValueError",
    "ExecutionError",
    "CallArgumentError",
    "DTypeError",
    "OnnxFormatError",
    "QuantizationError",
    "LoraError",
    "FileAccessError",
    "PrecisionWarning",
]

_LAZY = {
    "burnpack": None, "nn": None, "autodiff": None, "optim": None, "runtime": None, "ops": None,
    "DType": "dtype",
    "ParamGroup": "group",
    "LoraAdapter": "lora", "LoraConfig": "lora", "LoraAdapterSet": "lora",
    "write_onnx_adapter": "_lora_adapter_file",
    "check_onnx_adapter": "_lora_adapter_file",
    "BatchedLora": "_lora_batched",
    "write_batched_adapter": "_lora_batched_run", "check_batched_adapters": "_lora_batched_run",
    "Module": "module", "ModuleMapper": "module", "ModuleVisitor": "module",
    "OnnxModule": "onnx_io", "export_onnx": "onnx_io", "import_onnx": "onnx_io",
    "Param": "param", "ParamId": "param",
    "BlockSize": "quant", "Calibration": "quant", "QuantizedTensor": "quant", "Quantizer": "quant",
    "QuantMode": "quant", "QuantScheme": "quant", "QuantStore": "quant", "QuantValue": "quant",
    "ScaleDtype": "quant",
    "ModuleRecord": "record", "TensorSnapshot": "record",
    "Tensor": "tensor", "TensorData": "tensor",
    "load_peft_adapter": "convert._peft", "PeftLoadReport": "convert._peft",
    "save_peft_adapter": "convert._peft_save", "save_peft_adapters": "convert._peft_save",
    "load_peft_adapters": "convert._peft",
    "grad": "autodiff", "Gradients": "autodiff",
}
"""Every public name and the module that defines it (``None``: the name is a subpackage),
imported on first use: ``import onnxparam`` (and so ``onnxparam --help``) loads neither numpy's
extension dtypes (``ml_dtypes``), ``onnx``, ``onnx_ir`` nor ONNX Runtime."""


def __getattr__(name):
    if name in _LAZY:
        import importlib

        owner = _LAZY[name]
        module = importlib.import_module(f".{owner or name}", __name__)
        value = getattr(module, name) if owner else module
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onnxparam' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
