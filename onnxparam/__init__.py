"""onnxparam: Burn's Param/Module model for ONNX models, executed through ONNX Runtime.

Layers, bottom to top. A folder is one layer: its files import only their own folder and the
folders of lower layers (``tests/test_layers.py`` reads this list, and checks every import, inside
functions too, the ``importlib`` calls and the two extension points; and that no two files
import each other in a cycle):

1. ``core/``: values and the module tree, verb-free: dtypes, devices, errors, tensors and quantized tensors, params, groups, ``Module``, records, the two extension points
2. ``trace/``: tracing a forward into an ONNX graph: the tracer, symbolic dims, the traced model, the graph-pass interface
3. ``ops/``: the functional ops (eager or traced); the tensor operator table of the core
4. ``nn/``: Burn's layers, built from ops; initializers and ``nn.seed``
5. ``formats/``: weight files other than ONNX and burnpack: safetensors, PyTorch checkpoints, ONNX protobuf streaming, memory maps, atomic writes
6. ``burnpack/``: Burn's ``.bpk`` bytes, and modules <-> burnpack files
7. ``runtime/``: ONNX Runtime sessions, devices, module calls, eager ops; the core's executor
8. ``lora/``: LoRA: config, adapters, the graph pass, ``.onnx_adapter`` files, PEFT
9. ``quant/``: quantization verbs and graphs: module quantization, QDQ passes and import, calibration, the standard graph passes
10. ``autodiff/``: gradients: backward graphs, training steps
11. ``optim/``: optimizers
12. ``onnx_io/``: ONNX models as modules and back: validation, naming, import (``OnnxModule``), export, records
13. ``convert/``: converters and loaders (safetensors, PyTorch, ONNX weights), layout adapters, reports
14. ``zoo/``: small ready models (MNIST)
14. ``cli/``: the ``onnxparam`` command line
15. ``onnxparam/``: this package facade (lazy), ``__main__``, and ``_assembly`` (the features' verbs on ``Module``, the extension points' loaders)

The core needs code of two higher layers at run time: ``Tensor``'s operators and a param's value
inside a trace (:mod:`onnxparam.ops`), and ``Module.__call__``, eager ops, device values and
cache clearing (:mod:`onnxparam.runtime`). Each goes through one typed extension point,
:mod:`onnxparam.core.extension`, whose loaders :mod:`onnxparam._assembly` installs.
"""

from ._assembly import install_if_command_line as _install_if_command_line

# NOTE: the command line's first signal handlers, before any heavy import (a Ctrl-C while the
# CLI starts is one line and exit 130, not a traceback); nothing happens for library users.
_install_if_command_line()

from . import _assembly  # noqa: E402, F811
from .core.device import Device  # noqa: E402
from .core.errors import (  # noqa: E402
    BurnpackFormatError,
    CallArgumentError,
    CaptureWarning,
    DeviceError,
    DTypeError,
    ExecutionError,
    FileAccessError,
    LoraError,
    LoraTypeError,
    LoraWarning,
    OnnxFormatError,
    OnnxParamError,
    OptimizerError,
    ParamGroupError,
    PrecisionWarning,
    QuantizationError,
    RecordError,
    ShapeMismatchError,
    TraceError,
    TraceTypeError,
    TraceValueError,
)
from .core.version import __version__  # noqa: E402

# The features' verbs on Module, and the core's extension points (imported on first use).
_assembly.install()

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
    "write_batched_peft",
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
    "LoraTypeError",
    "OptimizerError",
    "ParamGroupError",
    "FileAccessError",
    "PrecisionWarning",
    "LoraWarning",
    "CaptureWarning",
]

_LAZY = {
    "burnpack": None, "nn": None, "autodiff": None, "optim": None, "runtime": None, "ops": None,
    "DType": "core.dtype",
    "ParamGroup": "core.group",
    "LoraAdapter": "lora", "LoraConfig": "lora", "LoraAdapterSet": "lora",
    "write_onnx_adapter": "lora._adapter_file",
    "check_onnx_adapter": "lora._adapter_file",
    "BatchedLora": "lora._batched",
    "write_batched_adapter": "lora._batched_run", "check_batched_adapters": "lora._batched_run",
    "write_batched_peft": "lora._batched_peft",
    "Module": "core.module", "ModuleMapper": "core.module", "ModuleVisitor": "core.module",
    "OnnxModule": "onnx_io", "export_onnx": "onnx_io", "import_onnx": "onnx_io",
    "Param": "core.param", "ParamId": "core.param",
    "BlockSize": "quant", "Calibration": "quant", "QuantizedTensor": "quant", "Quantizer": "quant",
    "QuantMode": "quant", "QuantScheme": "quant", "QuantStore": "quant", "QuantValue": "quant",
    "ScaleDtype": "quant",
    "ModuleRecord": "core.record", "TensorSnapshot": "core.record",
    "Tensor": "core.tensor", "TensorData": "core.tensor",
    "load_peft_adapter": "lora._peft", "PeftLoadReport": "lora._peft",
    "save_peft_adapter": "lora._peft_save", "save_peft_adapters": "lora._peft_save",
    "load_peft_adapters": "lora._peft",
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
