"""The library's exceptions: one small, closed hierarchy.

Every error the library raises on purpose is an :class:`OnnxParamError`. Leaves also inherit
the natural builtin (``ValueError``, ``RuntimeError``, ...) so code that already catches those
keeps working::

    OnnxParamError
    ├── RecordError (ValueError)            a record or file does not fit a module / is malformed
    │   ├── BurnpackFormatError             the bytes are not a valid burnpack file
    │   └── ShapeMismatchError              a tensor has another shape than the module expects
    ├── DeviceError (RuntimeError)          a device or execution provider is unavailable
    ├── TraceError (RuntimeError)           a forward could not be traced into an ONNX graph
    │   ├── TraceTypeError (TypeError)      ... because of a value of the wrong kind
    │   └── TraceValueError (ValueError)    ... because of a value of the wrong shape / a bad argument
    ├── ExecutionError (RuntimeError)       ONNX Runtime failed to build or run a session
    ├── CallArgumentError (TypeError)       an imported model was called with inputs its graph does not take
    ├── DTypeError (ValueError)             a value's element type has no Burn dtype (strings, objects ...)
    ├── OnnxFormatError (ValueError)        an ONNX file could not be read or is inconsistent
    ├── QuantizationError (ValueError)      a quantization scheme is unsupported or inconsistent
    ├── LoraError (ValueError)              LoRA adapters cannot be attached or written as asked
    │   └── LoraTypeError (TypeError)       ... because an argument is of the wrong kind
    ├── OptimizerError (ValueError)         an optimizer's hyperparameter is out of its range
    ├── ParamGroupError (ValueError)        a ParamGroup given to a verb matches no param of the module
    └── FileAccessError (OSError)           a file or folder cannot be read or written as asked
        ├── FileMissingError (FileNotFoundError)
        ├── FilePermissionError (PermissionError)
        ├── IsAFolderError (IsADirectoryError)
        └── NotAFolderError (NotADirectoryError)

``file_error(errno, message, filename)`` builds the leaf of an ``errno`` (as ``OSError(errno,
...)`` builds the builtin subclass), so ``except FileNotFoundError`` keeps working.

Warnings (not errors: the operation completes)::

    PrecisionWarning (UserWarning)          a dtype cast lost values (f32 -> f16 overflow to inf)
    QuantizationWarning (UserWarning)       a quantized graph ONNX Runtime runs without integer kernels
    LoraWarning (UserWarning)               apply_lora left params its param_group matches without adapters
    CaptureWarning (UserWarning)            a trace froze an outside tensor no guard can watch
"""

from __future__ import annotations

__all__ = [
    "OnnxParamError",
    "RecordError",
    "DTypeError",
    "BurnpackFormatError",
    "ShapeMismatchError",
    "DeviceError",
    "TraceError",
    "TraceTypeError",
    "TraceValueError",
    "ExecutionError",
    "CallArgumentError",
    "OnnxFormatError",
    "QuantizationError",
    "LoraError",
    "LoraTypeError",
    "OptimizerError",
    "ParamGroupError",
    "FileAccessError",
    "FileMissingError",
    "FilePermissionError",
    "IsAFolderError",
    "NotAFolderError",
    "file_error",
    "PrecisionWarning",
    "QuantizationWarning",
    "LoraWarning",
    "CaptureWarning",
]


class OnnxParamError(Exception):
    """Base class of every error this library raises on purpose."""


class RecordError(OnnxParamError, ValueError):
    """A record, or a weight file, does not fit the module it is loaded into, or is malformed.

    Attributes:
        problems: one human-readable line per problem (missing, unexpected, mis-shaped,
            mis-typed tensor ...), each naming the tensor path. Loading collects every problem
            before raising, so a user sees them all at once.
    """

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class BurnpackFormatError(RecordError):
    """The bytes are not a valid burnpack (``.bpk``) file: bad header, bad CBOR, bad offsets."""


class ShapeMismatchError(RecordError):
    """A tensor has another shape than the param it is loaded into."""


class DeviceError(OnnxParamError, RuntimeError):
    """A requested device (execution provider) is not available."""


class TraceError(OnnxParamError, RuntimeError):
    """A module's ``forward`` could not be traced into an ONNX graph."""


class TraceTypeError(TraceError, TypeError):
    """A forward was called with values of the wrong kind (dtype, number of inputs ...).

    Also a ``TypeError``, so code catching the builtin keeps working."""


class TraceValueError(TraceError, ValueError):
    """A forward was called with values of the wrong shape or an op got a bad argument.

    Also a ``ValueError``, so code catching the builtin keeps working."""


class ExecutionError(OnnxParamError, RuntimeError):
    """ONNX Runtime failed to create or run a session; the message names nodes and params."""


class CallArgumentError(OnnxParamError, TypeError):
    """An imported ONNX model was called with inputs its graph does not take: an unknown, missing
    or duplicate input name, too many inputs, or a value of another element type or shape than
    the graph declares for that input (the message names the input).

    Also a ``TypeError``, as Python's own error for a call with wrong arguments."""


class DTypeError(OnnxParamError, ValueError):
    """A numpy array or ONNX element type has no Burn dtype where one is needed
    (``Tensor.from_numpy`` of strings or objects, ``DType.from_onnx`` of a string type)."""


class OnnxFormatError(OnnxParamError, ValueError):
    """An ONNX file or model could not be read, or is inconsistent (dangling names, ...)."""


class FileAccessError(OnnxParamError, OSError):
    """A file or folder cannot be read or written as asked (missing, read-only, a folder where a
    file is expected, disk full ...); ``errno`` and ``filename`` as :class:`OSError`'s, the
    message names the file and what to do. Nothing was changed."""


class FileMissingError(FileAccessError, FileNotFoundError):
    """``ENOENT``: the file, or the folder to write into, does not exist."""


class FilePermissionError(FileAccessError, PermissionError):
    """``EACCES`` / ``EPERM``: the file is read-only or the folder is not writable."""


class IsAFolderError(FileAccessError, IsADirectoryError):
    """``EISDIR``: a folder where a file is expected."""


class NotAFolderError(FileAccessError, NotADirectoryError):
    """``ENOTDIR``: a file where a folder is expected."""


def file_error(code: int, message: str, filename=None) -> FileAccessError:
    """The :class:`FileAccessError` leaf for ``code`` (an ``errno`` number)."""
    import errno as _errno

    leaf = {_errno.ENOENT: FileMissingError, _errno.EACCES: FilePermissionError, _errno.EPERM: FilePermissionError,
            _errno.EISDIR: IsAFolderError, _errno.ENOTDIR: NotAFolderError}.get(code, FileAccessError)
    return leaf(code, message) if filename is None else leaf(code, message, filename)


class QuantizationError(OnnxParamError, ValueError):
    """A quantization scheme is unsupported, or quantized data is inconsistent with it."""


class LoraError(OnnxParamError, ValueError):
    """LoRA adapters cannot be attached or written as asked: no param of a module can take one
    (none matched, or none is the matrix of a linear map), a param already has one, or there
    is no adapter to write; or an argument has a bad value (``LoraConfig(rank=0)``, a duplicate
    adapter name ...)."""


class LoraTypeError(LoraError, TypeError):
    """A LoRA argument of the wrong kind (``LoraConfig(rank=2.5)``, a dtype that is not a
    ``DType`` ...). Also a ``TypeError``, so code catching the builtin keeps working."""


class ParamGroupError(OnnxParamError, ValueError):
    """A :class:`~onnxparam.ParamGroup` matches no param of the module a verb applies it to
    (``freeze_group`` / ``unfreeze_group``), or a path of ``ParamGroup.from_paths`` names none:
    the verb would silently do nothing. The message names the group and the closest paths."""


class OptimizerError(OnnxParamError, ValueError):
    """An optimizer's hyperparameter is out of its range (``Adam(betas=(1.0, 0.9))``, a negative
    ``lr`` / ``eps`` / ``momentum`` / ``weight_decay``)."""


class PrecisionWarning(UserWarning):
    """A cast to a narrower float dtype changed finite values into infinities (f32 -> f16 of a
    value beyond 65504, ...). The message names the tensor path, how many values overflowed and
    the largest magnitude; filter it with ``warnings.filterwarnings("error", category=...)`` to
    make such a cast fail."""


class QuantizationWarning(UserWarning):
    """An exported quantized graph that ONNX Runtime will not run with integer kernels, or a
    lossy change of layout (re-exported as ``onnxparam.quant.QuantizationWarning``)."""


class LoraWarning(UserWarning):
    """:func:`onnxparam.lora.apply_lora` left params that its ``param_group`` matches without an
    adapter (a convolution kernel: it creates adapters for matrices only), or adapted nothing
    with ``allow_empty=True``. The message names the params and their shapes."""


class CaptureWarning(UserWarning):
    """A traced ``forward`` or ``loss_fn`` read a concrete tensor from outside (not an argument,
    not a param, not a module attribute) that no guard can watch: it is not held by a global or
    closure variable the traced code names (e.g. reached through another object's attribute).
    Its values are frozen into the cached graph, so a later change is not seen. The message
    names the tensor's shape and dtype; pass such a tensor as an input instead."""
