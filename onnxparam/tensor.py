"""Tensors: host (numpy), device (ONNX Runtime ``OrtValue``) or symbolic (inside a trace).

A :class:`Tensor` has one of three storages:

* **host**: a numpy array, shared read-only (``Tensor.from_numpy`` wraps without copying where
  the array is already C-contiguous; ``to_numpy`` returns a read-only view). A host tensor may be
  a zero-copy view of a memory-mapped weight file.
* **device**: an ``onnxruntime.OrtValue`` resident on a CUDA device, so values that stay on the
  GPU are not copied back on every call. ``to_numpy`` copies to the host.
* **symbolic**: a value inside a graph being traced (see :mod:`onnxparam._trace`). It has a shape
  (ints, or ``None``/``str`` for dynamic dims) and a dtype, but no data; ``to_numpy`` raises.

The tensor ops (``+``, ``@``, ``relu`` ...) are methods here that delegate to
:mod:`onnxparam.ops`, where each is documented with the ONNX operator it emits. ``==`` is not
overloaded (tensors hash by identity); use ``.equal``.

:class:`TensorData` is the exchange type for records and files: host bytes + dtype + shape
(+ the quantization scheme for ``QFloat``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._services import service
from .device import CPU, Device
from .dtype import DType, dtype_from_numpy

__all__ = ["Tensor", "TensorData"]

Shape = tuple  # tuple[int | str | None, ...]


class Tensor:
    """An n-dimensional value of kind float, int or bool; see the module docstring. Inside a
    trace (and as an imported model's weight) it may also hold an ONNX-only element type
    (``DType.String``, float8 ...; see :mod:`onnxparam.dtype`).

    Attributes:
        shape: tuple of dims; ints for concrete tensors. A symbolic tensor may have an unknown
            rank (an operator whose output rank neither ONNX shape inference nor the caller
            gives, e.g. a ``Loop`` state): it flows into further nodes, and reading ``shape``
            (or ``ndim``, ``len`` ...) raises ``TraceError`` naming the value.
        dtype: a :class:`~onnxparam.DType`.
        device: a :class:`~onnxparam.Device`.
    """

    __slots__ = ("_host", "_ort", "_symbol", "_quant", "_shape", "dtype", "device")

    def __init__(self, *, host=None, ort=None, symbol=None, quant=None, shape, dtype: DType, device: Device = CPU):
        self._host = host
        self._ort = ort
        self._symbol = symbol
        self._quant = quant
        if shape is None and symbol is None:
            raise ValueError("only a symbolic tensor (inside a trace) may have an unknown rank")
        self._shape = None if shape is None else tuple(shape)
        self.dtype = dtype
        self.device = device

    @property
    def shape(self) -> tuple:
        if self._shape is None:
            from .errors import TraceError

            value = self._symbol.value
            producer = value.producer()
            made = f" (output of {producer.op_type} node {producer.name!r})" if producer is not None else ""
            raise TraceError(
                f"the rank of traced value {value.name!r}{made} is unknown: ONNX shape inference does not give it, so "
                "Python code cannot read its shape; give the producing op its output shape (ops.custom(..., "
                "output_shapes=...)) or reshape it to a known rank")
        return self._shape

    @shape.setter
    def shape(self, value) -> None:
        self._shape = tuple(value)

    @property
    def rank_known(self) -> bool:
        """False for a symbolic tensor whose rank the trace does not know (see ``shape``)."""
        return self._shape is not None

    # -- construction -------------------------------------------------------------------------

    @staticmethod
    def from_numpy(array, device: "Device | str | None" = None) -> "Tensor":
        """Wrap a numpy array (or anything ``np.asarray`` accepts) as a tensor.

        The array is shared, not copied, when it is already C-contiguous and little-endian; the
        tensor keeps a read-only view, so later writes through the tensor are impossible.

        Args:
            array: values of a dtype Burn knows (float64/32/16, bfloat16, ints, bool).
            device: target device; ``None`` or ``"cpu"`` keeps it on the host.

        Raises:
            ValueError: for dtypes Burn has no dtype for.
            DeviceError: when ``device`` is not available.
        """
        arr = np.asarray(array)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        dtype = dtype_from_numpy(arr.dtype)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # NOTE: only here: it turns 0-d arrays into 1-d ones
        if arr.flags.writeable:
            arr = arr.view()
            arr.flags.writeable = False
        tensor = Tensor(host=arr, shape=arr.shape, dtype=dtype, device=CPU)
        if device is not None and Device(device) != CPU:
            return tensor.to_device(device)
        return tensor

    @staticmethod
    def from_data(data: "TensorData", device: "Device | str | None" = None) -> "Tensor":
        """A tensor holding ``data``'s values (zero-copy for plain dtypes on the host)."""
        if data.dtype is DType.QFloat:
            # the quantization values own QFloat bytes (quant.tensor builds on this file)
            return service("quant.tensor").QuantizedTensor.from_data(data).to_tensor(device)
        if data.dtype.is_onnx_only:  # an imported float8 weight: held, not computed with here
            array = np.ascontiguousarray(data.to_numpy())
            array.flags.writeable = False
            tensor = Tensor(host=array, shape=array.shape, dtype=data.dtype)
            return tensor if device is None else tensor.to_device(device)
        tensor = Tensor.from_numpy(data.to_numpy())
        if tensor.dtype is not data.dtype:  # Flex32 shares float32 storage
            tensor = Tensor(host=tensor._host, shape=tensor.shape, dtype=data.dtype)
        return tensor if device is None else tensor.to_device(device)

    @staticmethod
    def zeros(shape, dtype: DType = DType.F32, device: "Device | str | None" = None) -> "Tensor":
        return Tensor.from_numpy(np.zeros(tuple(shape), dtype=dtype.to_numpy()), device)

    # -- properties ---------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        """Number of elements. Raises ``TypeError`` for a symbolic tensor with dynamic dims."""
        if not all(isinstance(d, int) for d in self.shape):
            raise TypeError(f"tensor of shape {self.shape} has dynamic dims")
        return math.prod(self.shape)

    @property
    def is_symbolic(self) -> bool:
        return self._symbol is not None

    @property
    def is_quantized(self) -> bool:
        return self._quant is not None

    @property
    def kind(self) -> str:
        """``"float"``, ``"int"`` or ``"bool"`` (``"string"`` / ``"complex"`` for those ONNX-only dtypes)."""
        if self.dtype is DType.String:
            return "string"
        if self.dtype in (DType.C64, DType.C128):
            return "complex"
        return "float" if self.dtype.is_float else "bool" if self.dtype.is_bool else "int"

    # -- data access --------------------------------------------------------------------------

    def to_numpy(self) -> np.ndarray:
        """The values as a numpy array: a read-only view for host tensors, a copy from a device.

        A quantized tensor returns its dequantized float values (see :mod:`onnxparam.quant`).

        Raises:
            TraceError: for a symbolic tensor (it has no values yet).
        """
        if self._host is not None:
            return self._host
        if self._quant is not None:
            return self._quant.dequantize()
        if self._ort is not None:
            arr = self._ort.numpy()
            arr.flags.writeable = False
            return arr
        from .errors import TraceError

        raise TraceError(
            "a symbolic tensor has no values: it exists only while a forward is being traced; "
            "call the module to run it through ONNX Runtime"
        )

    def numpy(self) -> np.ndarray:
        return self.to_numpy()

    def __array__(self, dtype=None, copy=None):
        arr = self.to_numpy()
        return arr if dtype is None else arr.astype(dtype)

    def into_data(self) -> "TensorData":
        """The values as :class:`TensorData` (host bytes)."""
        if self._quant is not None:
            return self._quant.to_data()
        arr = self.to_numpy()
        return TensorData(arr, self.dtype, self.shape)

    def to_data(self) -> "TensorData":
        return self.into_data()

    def to_device(self, device: "Device | str") -> "Tensor":
        """This tensor on ``device`` (the same object when it is already there).

        Raises:
            DeviceError: when ``device`` is not available to ONNX Runtime.
        """
        device = Device(device)
        if device == self.device or self._symbol is not None:
            return self
        if self._quant is not None:
            if device != CPU:
                from .errors import DeviceError

                raise DeviceError("quantized tensors live on the host; they are moved as ONNX initializers")
            return self
        if device == CPU:
            return Tensor.from_numpy(self.to_numpy())
        # the runtime owns ONNX Runtime (a service it registers)
        ort_value = service("runtime.ortvalue_from_numpy")(self.to_numpy(), device)
        return Tensor(ort=ort_value, shape=self.shape, dtype=self.dtype, device=device)

    def __repr__(self) -> str:
        shape = "?" if self._shape is None else "[" + ", ".join(str(d) for d in self._shape) + "]"
        if self._symbol is not None:
            return f"Tensor(symbolic, shape={shape}, dtype={self.dtype.name})"
        return f"Tensor(shape={shape}, dtype={self.dtype.name}, device={self.device})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        first = self.shape[0]
        if not isinstance(first, int):
            from .errors import TraceError

            raise TraceError(
                f"len() must return a Python int, but dim 0 of {self!r} is dynamic in this trace; "
                "use x.shape[0] (a symbolic size) instead of len(x)")
        return first

    def __iter__(self):
        """The slices along dim 0 (``q, k, v = qkv``); a dynamic dim 0 in a trace raises
        ``TraceError`` as ``len()`` does (the number of slices is not known)."""
        for i in range(len(self)):
            yield self[i]

    def size(self, dim=None):
        """The shape, or dim ``dim`` of it (PyTorch's ``size``); a dynamic dim inside a trace is a
        symbolic size (see :mod:`onnxparam._symint`)."""
        if dim is None:
            return self.shape
        return self.shape[dim]

    def __getitem__(self, key) -> "Tensor":
        """Basic indexing: ints, slices (symbolic bounds inside a trace), ``None``, ``...``.

        Outside a trace this indexes the values with numpy (a host tensor); inside one it emits
        ``Slice`` / ``Gather`` / ``Unsqueeze`` (see :func:`onnxparam.ops.getitem`).
        """
        if self._symbol is None:
            if isinstance(key, Tensor):
                key = key.to_numpy()
            elif isinstance(key, tuple):
                key = tuple(k.to_numpy() if isinstance(k, Tensor) else k for k in key)
            return Tensor.from_numpy(np.asarray(self.to_numpy()[key]))
        return _ops().getitem(self, key)

    # -- ops (defined in onnxparam.ops; each emits the ONNX operator its docstring names) ------
    # NOTE: ``==`` is not overloaded (tensors stay hashable by identity); use ``.equal``.

    def __add__(self, other):
        return _ops().add(self, other)

    def __radd__(self, other):
        return _ops().add(other, self)

    def __sub__(self, other):
        return _ops().sub(self, other)

    def __rsub__(self, other):
        return _ops().sub(other, self)

    def __mul__(self, other):
        return _ops().mul(self, other)

    def __rmul__(self, other):
        return _ops().mul(other, self)

    def __truediv__(self, other):
        return _ops().div(self, other)

    def __rtruediv__(self, other):
        return _ops().div(other, self)

    def __pow__(self, other):
        return _ops().pow(self, other)

    def __rpow__(self, other):
        return _ops().pow(other, self)

    def __matmul__(self, other):
        return _ops().matmul(self, other)

    def __rmatmul__(self, other):
        return _ops().matmul(other, self)

    def __neg__(self):
        return _ops().neg(self)

    def __abs__(self):
        return _ops().abs(self)

    def __lt__(self, other):
        return _ops().less(self, other)

    def __le__(self, other):
        return _ops().less_equal(self, other)

    def __gt__(self, other):
        return _ops().greater(self, other)

    def __ge__(self, other):
        return _ops().greater_equal(self, other)

    def equal(self, other) -> "Tensor":
        """Elementwise ``==`` (bool); see :func:`onnxparam.ops.equal`."""
        return _ops().equal(self, other)

    def add(self, other) -> "Tensor":
        return _ops().add(self, other)

    def sub(self, other) -> "Tensor":
        return _ops().sub(self, other)

    def mul(self, other) -> "Tensor":
        return _ops().mul(self, other)

    def div(self, other) -> "Tensor":
        return _ops().div(self, other)

    def pow(self, other) -> "Tensor":
        return _ops().pow(self, other)

    def neg(self) -> "Tensor":
        return _ops().neg(self)

    def abs(self) -> "Tensor":
        return _ops().abs(self)

    def matmul(self, other) -> "Tensor":
        """``self @ other``; see :func:`onnxparam.ops.matmul`."""
        return _ops().matmul(self, other)

    def reshape(self, *shape) -> "Tensor":
        """``reshape((2, -1))`` or ``reshape(2, -1)``; see :func:`onnxparam.ops.reshape`."""
        if len(shape) == 1 and isinstance(shape[0], _SEQUENCES):
            shape = shape[0]
        return _ops().reshape(self, shape)

    def view(self, *shape) -> "Tensor":
        """:meth:`reshape` (every onnxparam tensor is contiguous; PyTorch's ``view``)."""
        return self.reshape(*shape)

    def expand(self, *shape) -> "Tensor":
        """``expand(b, -1, 4)`` or ``expand((b, -1, 4))``; see :func:`onnxparam.ops.expand`."""
        if len(shape) == 1 and isinstance(shape[0], _SEQUENCES):
            shape = shape[0]
        return _ops().expand(self, shape)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> "Tensor":
        return _ops().flatten(self, start_dim, end_dim)

    def transpose(self, dim0: int = -2, dim1: int = -1) -> "Tensor":
        return _ops().transpose(self, dim0, dim1)

    def permute(self, *dims) -> "Tensor":
        if len(dims) == 1 and isinstance(dims[0], _SEQUENCES):
            dims = dims[0]
        return _ops().permute(self, dims)

    def squeeze(self, dims=None) -> "Tensor":
        return _ops().squeeze(self, dims)

    def unsqueeze(self, dims) -> "Tensor":
        return _ops().unsqueeze(self, dims)

    def relu(self) -> "Tensor":
        return _ops().relu(self)

    def sigmoid(self) -> "Tensor":
        return _ops().sigmoid(self)

    def tanh(self) -> "Tensor":
        return _ops().tanh(self)

    def exp(self) -> "Tensor":
        return _ops().exp(self)

    def log(self) -> "Tensor":
        return _ops().log(self)

    def sqrt(self) -> "Tensor":
        return _ops().sqrt(self)

    def erf(self) -> "Tensor":
        return _ops().erf(self)

    def sum(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().sum(self, dim, keepdim)

    def mean(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().mean(self, dim, keepdim)

    def max(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().max(self, dim, keepdim)

    def min(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().min(self, dim, keepdim)

    def argmax(self, dim: int, keepdim: bool = False) -> "Tensor":
        return _ops().argmax(self, dim, keepdim)

    def softmax(self, dim: int = -1) -> "Tensor":
        return _ops().softmax(self, dim)

    def log_softmax(self, dim: int = -1) -> "Tensor":
        return _ops().log_softmax(self, dim)

    def cast(self, dtype: DType) -> "Tensor":
        return _ops().cast(self, dtype)

    def clamp(self, min=None, max=None) -> "Tensor":
        return _ops().clamp(self, min, max)

    def gelu(self, approximate: str = "none") -> "Tensor":
        return _ops().gelu(self, approximate)

    def logical_not(self) -> "Tensor":
        return _ops().logical_not(self)

    def __bool__(self):
        if self._symbol is not None:
            from .errors import TraceError

            raise TraceError(
                "a traced tensor has no truth value: data-dependent Python control flow cannot "
                "be recorded into an ONNX graph"
            )
        return bool(self.to_numpy())


_SEQUENCES = (list, tuple, np.ndarray, Tensor)


def _ops():
    """The ops module: a service of the graph layer (registered by ``onnxparam/__init__.py``)."""
    return service("ops")


@dataclass(frozen=True)
class TensorData:
    """Host bytes + dtype + shape: the exchange type for records and files.

    Attributes:
        array: a numpy array of the plain dtype (``QFloat``: a 1-D ``uint8`` array of the raw
            bytes, laid out as values, scales, global scale; ``docs/burnpack.md`` section 2).
        dtype: the :class:`DType`.
        shape: the logical shape (for ``QFloat``, the unpacked shape).
        scheme: the quantization scheme for ``QFloat`` data, else ``None``.
    """

    array: Any
    dtype: DType
    shape: tuple
    scheme: Any = field(default=None)

    @staticmethod
    def from_numpy(array) -> "TensorData":
        arr = np.asarray(array)
        return TensorData(arr, dtype_from_numpy(arr.dtype), tuple(arr.shape))

    def to_numpy(self) -> np.ndarray:
        """The values (read-only view where possible). Raises ``ValueError`` for ``QFloat``."""
        if self.dtype is DType.QFloat:
            raise ValueError("QFloat data holds quantized bytes; dequantize it with onnxparam.quant")
        arr = np.asarray(self.array)
        want = self.dtype.to_numpy()
        if arr.dtype != want:
            arr = arr.view(want) if arr.dtype.itemsize == 1 and arr.ndim <= 1 else arr.astype(want)
        return arr.reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.asarray(self.array).nbytes)
