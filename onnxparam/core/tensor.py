"""Tensors: host (numpy), device (ONNX Runtime ``OrtValue``) or symbolic (inside a trace).

A :class:`Tensor` has one of three storages:

* **host**: a numpy array, shared read-only (``Tensor.from_numpy`` wraps without copying where
  the array is already C-contiguous; ``to_numpy`` returns a read-only view). A host tensor may be
  a zero-copy view of a memory-mapped weight file.
* **device**: an ``onnxruntime.OrtValue`` resident on a CUDA device, so values that stay on the
  GPU are not copied back on every call. ``to_numpy`` copies to the host.
* **symbolic**: a value inside a graph being traced (see :mod:`onnxparam.trace.tracer`). It has a shape
  (ints, or ``None``/``str`` for dynamic dims) and a dtype, but no data; ``to_numpy`` raises.

The tensor ops (``+``, ``@``, ``relu`` ...) are methods here that delegate to
:mod:`onnxparam.ops`, where each is documented with the ONNX operator it emits. ``==`` is not
overloaded (tensors hash by identity); use ``.equal``.

:class:`TensorData` is the exchange type for records and files: host bytes + dtype + shape
(+ the quantization scheme for ``QFloat``).

:class:`QuantizedTensor` holds a Burn ``QFloat`` tensor's values and scales in their exact Burn
byte form (``docs/burnpack.md`` §2-3); :func:`quantize` is Burn's ``Quantizer`` with MinMax
calibration (§4). They live beside :class:`Tensor` because each builds the other
(``Tensor.from_data`` of ``QFloat`` bytes, ``QuantizedTensor.to_tensor``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import extension
from .device import CPU, Device
from .dtype import DType, dtype_from_numpy
from .errors import QuantizationError
from .quant_layout import (
    _check_decodable,
    expand_scales,
    pack_values,
    params_shape,
    quantized_nbytes,
    unpack_values,
    values_nbytes,
)
from .quant_scheme import BlockSize, QuantMode, QuantScheme, ScaleDtype

__all__ = ["Tensor", "TensorData", "QuantizedTensor", "quantize", "quantize_per_axis", "round_half_away_from_zero"]

Shape = tuple  # tuple[int | str | None, ...]


class Tensor:
    """An n-dimensional value of kind float, int or bool; see the module docstring. Inside a
    trace (and as an imported model's weight) it may also hold an ONNX-only element type
    (``DType.String``, float8 ...; see :mod:`onnxparam.core.dtype`).

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
            return QuantizedTensor.from_data(data).to_tensor(device)
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

    def __deepcopy__(self, memo) -> "Tensor":
        """``copy.deepcopy``: a host tensor whose memory is writable (the array owning it, e.g.
        an optimizer's own array that ``in_place=True`` steps overwrite, or the caller's array
        behind a ``from_numpy`` view) gets a read-only copy; a tensor on read-only memory (a
        file mapping), on a device, quantized or symbolic is never written and is returned as
        is (a snapshot shares it safely)."""
        host = self._host
        if host is None or self._quant is not None:
            return self
        owner = host
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        if not owner.flags.writeable:
            return self
        copy = np.array(host, copy=True, order="C")
        copy.flags.writeable = False
        return Tensor(host=copy, shape=self._shape, dtype=self.dtype, device=self.device)

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
        # the runtime owns ONNX Runtime: the executor extension point
        ort_value = extension.executor().ortvalue_from_numpy(self.to_numpy(), device)
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
        symbolic size (see :mod:`onnxparam.trace.symint`)."""
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


_ops = extension.tensor_ops
"""The tensor operator table (:mod:`onnxparam.ops`, through :mod:`onnxparam.core.extension`)."""


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


# -- quantized tensors (docs/burnpack.md §2-3) ----------------------------------------------------


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class QuantizedTensor:
    """A Burn ``QFloat`` tensor: int values, scales and an optional global scale.

    The value of element ``e`` is ``values[e] * scales[block_of(e)]`` (one level) or
    ``global_scale * scales[block_of(e)] * values[e]`` in float32 (two levels, §3). There is
    no zero point.

    Attributes:
        shape: the logical (unpacked) shape, a tuple of ints.
        scheme: the :class:`QuantScheme`.
        values: int8 array of ``shape``, row-major, one sign-extended value per element
            (whatever the store packs them into on disk). Read-only.
        scales: float32 array of the scale grid ``params_shape(shape, scheme)`` (``(1,)`` for a
            per-tensor scheme), row-major, holding the values decoded from the stored scale
            dtype. Read-only.
        global_scale: the float32 global scale of a two-level scheme, else ``None``.
        float_dtype: the float :class:`~onnxparam.DType` the tensor was quantized from (F32
            unless set, e.g. by ``quantize_weights`` on an F16 param): ``Param.val()`` and the
            traced ``DequantizeLinear`` give the weight back at this dtype. Not stored in bytes
            (Burn's ``QFloat`` does not record it).
        axis: ``None`` for Burn's schemes; else the axis of an **ONNX per-axis** scale (one
            scale per index of ``shape[axis]``, ONNX operator spec: DequantizeLinear-21 ``axis``)
            that Burn's block sizes cannot express (an extent over 255). ``scheme`` then is
            per-tensor (it gives the value type), ``scales`` has shape ``(shape[axis],)``, and
            :meth:`to_bytes` raises: Burn cannot store it.

    Args:
        shape: logical shape.
        scheme: the scheme; its store must be ``Native`` or ``PackedU32(0)`` with Q8/Q4/Q2 values
            for :meth:`to_bytes`.
        values: int8-convertible array of ``shape``.
        scales: float32-convertible array with ``prod(params_shape)`` elements.
        global_scale: required exactly when the scheme has two levels.
        axis: the per-axis scale's axis (see Attributes), or ``None``.

    Raises:
        QuantizationError: when the arrays do not fit the shape and scheme.
    """

    __slots__ = ("shape", "scheme", "values", "scales", "global_scale", "float_dtype", "axis")

    def __init__(self, shape, scheme: QuantScheme, values, scales, global_scale: float | None = None,
                 axis: int | None = None):
        shape = tuple(int(d) for d in shape)
        values = np.asarray(values)
        if values.dtype != np.int8:
            if (
                not np.issubdtype(values.dtype, np.integer)
                or values.size
                and (values.min() < -128 or values.max() > 127)
            ):
                raise QuantizationError(f"quantized values must be int8, found {values.dtype}")
            values = values.astype(np.int8)
        if values.shape != shape:
            raise QuantizationError(f"values of shape {list(values.shape)} do not fill a tensor of shape {list(shape)}")
        if axis is not None:
            if scheme.block is not None or scheme.is_two_level or not 0 <= int(axis) < len(shape):
                raise QuantizationError(f"a per-axis scale needs a per-tensor, one-level scheme and an axis in "
                                        f"0..{len(shape) - 1}; got {scheme.describe()}, axis {axis}")
            axis = int(axis)
            grid = (shape[axis],)
        else:
            grid = params_shape(shape, scheme)
        scales = np.asarray(scales, dtype=np.float32)
        if scales.size != math.prod(grid):
            raise QuantizationError(
                f"{scales.size} scales given, {scheme.describe()} x {list(shape)} has a scale grid of {list(grid)}"
            )
        if scheme.is_two_level != (global_scale is not None):
            need = "needs" if scheme.is_two_level else "takes no"
            raise QuantizationError(f"{scheme.describe()} {need} a global scale")
        self.shape = shape
        self.scheme = scheme
        self.values = _read_only(np.asarray(values, order="C"))  # keeps 0-d (ascontiguousarray does not)
        self.scales = _read_only(np.ascontiguousarray(scales.reshape(grid)))
        self.global_scale = None if global_scale is None else np.float32(global_scale)
        self.float_dtype = DType.F32
        self.axis = axis

    # -- bytes (§2) ---------------------------------------------------------------------------

    @classmethod
    def from_bytes(cls, raw, shape, scheme: QuantScheme) -> "QuantizedTensor":
        """Decode Burn's ``QFloat`` bytes: values, scales, optional global scale (§2.1).

        Args:
            raw: bytes-like, exactly :func:`~onnxparam.core.quant_layout.quantized_nbytes` long.
            shape: the logical shape (the burnpack descriptor's ``shape``).
            scheme: the tensor's scheme.

        Raises:
            QuantizationError: for a wrong length or an unsupported store, value or scale dtype.
        """
        from .quant_scales import decode_scales  # ml_dtypes: imported with the first quantized tensor

        shape = tuple(int(d) for d in shape)
        buf = memoryview(raw).cast("B")
        expected = quantized_nbytes(shape, scheme)
        if buf.nbytes != expected:
            raise QuantizationError(
                f"quantized data holds {buf.nbytes} bytes, but {scheme.describe()} x {list(shape)} needs {expected}"
            )
        n_values = values_nbytes(shape, scheme)
        n_scales = math.prod(params_shape(shape, scheme)) * scheme.scale_dtype().nbytes
        values = unpack_values(buf[:n_values], shape, scheme)
        scales = decode_scales(buf[n_values : n_values + n_scales], scheme.scale_dtype())
        global_dtype = scheme.global_scale_dtype()
        global_scale = None
        if global_dtype is not None:
            global_scale = decode_scales(buf[n_values + n_scales :], global_dtype)[0]
        return cls(shape, scheme, values, scales, global_scale)

    def to_bytes(self) -> bytes:
        """Burn's bytes for this tensor, the inverse of :meth:`from_bytes` (§2).

        Raises:
            QuantizationError: for an unsupported store or value, a scale that its dtype
                cannot hold exactly, or an ONNX per-axis tensor (:attr:`axis`; Burn has no
                such scheme).
        """
        from .quant_scales import encode_scales  # ml_dtypes: imported with the first quantized tensor

        if self.axis is not None:
            raise QuantizationError(
                f"a per-axis scale along axis {self.axis} of {list(self.shape)} is ONNX-only: Burn's block extents "
                f"are at most 255, so a burnpack file cannot store it (export it to ONNX, or quantize with a "
                "block size)")
        parts = [pack_values(self.values, self.scheme), encode_scales(self.scales, self.scheme.scale_dtype())]
        global_dtype = self.scheme.global_scale_dtype()
        if global_dtype is not None:
            parts.append(encode_scales(np.array([self.global_scale], np.float32), global_dtype))
        return b"".join(parts)

    @property
    def nbytes(self) -> int:
        """Length of :meth:`to_bytes` (§2.1)."""
        return quantized_nbytes(self.shape, self.scheme)

    # -- values (§3) --------------------------------------------------------------------------

    def dequantize(self) -> np.ndarray:
        """The float values: ``q * scale`` (one level) or ``(global * scale) * q`` (two levels),
        computed in float32 as Burn's Flex backend does (§3).

        Returns:
            float32 array of :attr:`shape`.
        """
        if self.values.size == 0:
            return np.zeros(self.shape, np.float32)
        if self.axis is not None:
            shape = [1] * len(self.shape)
            shape[self.axis] = -1
            return (self.scales.reshape(shape) * self.values.astype(np.float32)).astype(np.float32, copy=False)
        scale = expand_scales(self.scales, self.shape, self.scheme)
        if self.global_scale is not None:
            scale = np.float32(self.global_scale) * scale
        return (scale * self.values.astype(np.float32)).astype(np.float32, copy=False).reshape(self.shape)

    @classmethod
    def quantize(cls, array, scheme: QuantScheme) -> "QuantizedTensor":
        """Quantize a float array as Burn's ``Quantizer`` with MinMax calibration does (§4).

        See :func:`onnxparam.quant.quantize`.
        """

        return quantize(array, scheme)

    # -- exchange types -----------------------------------------------------------------------

    @classmethod
    def from_data(cls, data) -> "QuantizedTensor":
        """From a ``TensorData`` of dtype ``QFloat`` (raw bytes in ``array``, ``scheme`` set).

        Raises:
            QuantizationError: for other dtypes, a missing scheme, or bytes that do not fit.
        """
        if data.dtype is not DType.QFloat or not isinstance(data.scheme, QuantScheme):
            raise QuantizationError(
                f"TensorData of dtype {data.dtype.name} with scheme {data.scheme!r} is not quantized data"
            )
        raw = np.ascontiguousarray(np.asarray(data.array)).view(np.uint8).reshape(-1)
        return cls.from_bytes(raw, data.shape, data.scheme)

    def to_data(self):
        """A ``TensorData(array=uint8 bytes, dtype=QFloat, shape=logical, scheme=scheme)``."""
        raw = _read_only(np.frombuffer(self.to_bytes(), dtype=np.uint8))
        return TensorData(raw, DType.QFloat, self.shape, self.scheme)

    def to_tensor(self, device=None):
        """A :class:`~onnxparam.core.tensor.Tensor` of dtype ``QFloat`` holding this tensor.

        Raises:
            DeviceError: for a device other than the host (quantized tensors live on the host).
        """
        tensor = Tensor(quant=self, shape=self.shape, dtype=DType.QFloat)
        return tensor if device is None else tensor.to_device(device)

    def describe(self) -> str:
        """The scheme in words (``scheme.describe()``, plus ``per-axis N`` for an ONNX per-axis tensor)."""
        text = self.scheme.describe()
        return text if self.axis is None else f"{text}, per-axis {self.axis} (ONNX)"

    def __repr__(self) -> str:
        return f"QuantizedTensor(shape={list(self.shape)}, scheme={self.describe()})"


# -- MinMax quantization --------------------------------------------------------------------------

# Burn's ``Quantizer`` with ``Calibration::MinMax`` (``docs/burnpack.md`` §4), in numpy.
#
# Steps, each exactly as Burn's CPU path computes it:
#
# 1. range: ``alpha = max(|min|, |max|)`` per tensor, or per block (every axis must divide evenly);
# 2. scale: ``(2 * alpha) / (b - a)`` in the tensor's float dtype, then float32;
# 3. two levels only: ``global = max(scales) / block_dtype.max_representable()`` in f32, at least
#    ``f32::MIN_POSITIVE``; block scales become ``scale / global``;
# 4. each scale is rounded **up** onto its storage dtype; a scale that is not positive and finite
#    becomes ``round_up(f32::MIN_POSITIVE)`` (as Burn's Flex backend does);
# 5. ``q = clamp(round_half_away_from_zero(x / scale), a, b)`` in f32, with ``scale = global * block``
#    for two levels.
#
# NOTE: step 5 divides (NdArray's ``x / s``); Flex multiplies by ``1 / s``. The two can differ by
# one ulp near a tie, so a value exactly between two codes may round differently (§4.5).

_FLOAT_INPUTS: tuple = ()
"""The float dtypes MinMax quantizes (bfloat16 from ``ml_dtypes``, imported on first use)."""


def _float_inputs() -> tuple:
    global _FLOAT_INPUTS
    if not _FLOAT_INPUTS:
        import ml_dtypes

        _FLOAT_INPUTS = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16),
                         np.dtype(ml_dtypes.bfloat16))
    return _FLOAT_INPUTS
_F16_MAX = 65504.0


def round_half_away_from_zero(y: np.ndarray) -> np.ndarray:
    """Rust's ``f32::round``: ties go away from zero (numpy's ``round`` goes to even).

    Exact: ``y - trunc(y)`` is representable, so no addition of 0.5 can round wrongly.
    """
    whole = np.trunc(y)
    frac = y - whole
    return whole + np.where(np.abs(frac) >= 0.5, np.sign(y), 0).astype(y.dtype)


def _check_quantizable(scheme: QuantScheme) -> None:
    if scheme.mode is not QuantMode.Symmetric:
        raise QuantizationError(f"quantization mode {scheme.mode.value} is not supported; use Symmetric")
    _check_decodable(scheme)
    dtypes = [scheme.scale_dtype()] + ([scheme.tensor] if scheme.tensor else [])
    if ScaleDtype.UE8M0 in dtypes:
        raise QuantizationError("UE8M0 scales cannot be produced: Burn has no round-up rule for them (§4.4)")
    if scheme.is_two_level:
        if scheme.tensor is not ScaleDtype.F32:
            raise QuantizationError(f"a two-level scheme stores its global scale as F32, not {scheme.tensor.value}")
        if scheme.block.dtype.max_representable > _F16_MAX:
            raise QuantizationError(
                f"two-level block scales must be no wider than F16; {scheme.block.dtype.value} would drive the "
                "global scale subnormal (§4.3)"
            )


def _block_alpha(x: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """``max |x|`` per block of the scale grid, in ``x``'s dtype (NaNs ignored, empty -> 0)."""
    zero = x.dtype.type(0)
    if scheme.block is None:
        return np.fmax.reduce(np.abs(x).reshape(-1), initial=zero, keepdims=False).reshape(1)
    block = scheme.block.size
    if len(block.dims) > x.ndim:
        raise QuantizationError(f"block size {block.dims} has more dims than the tensor's shape {list(x.shape)}")
    extents = block.to_dim_vec(x.ndim)
    if any(d % b for d, b in zip(x.shape, extents)):
        raise QuantizationError(
            f"shape {list(x.shape)} is not a whole number of {list(extents)} blocks; Burn's MinMax "
            "calibration needs every axis to divide evenly (§4.1)"
        )
    split = [n for d, b in zip(x.shape, extents) for n in (d // b, b)]
    reduce_axes = tuple(range(1, 2 * x.ndim, 2))
    return np.fmax.reduce(np.abs(x).reshape(split), axis=reduce_axes, initial=zero)


def quantize(array, scheme: QuantScheme) -> QuantizedTensor:
    """Quantize ``array`` with MinMax calibration, exactly as Burn's CPU backends (§4).

    Args:
        array: float64/float32/float16/bfloat16 values, any shape (row-major).
        scheme: Q8/Q4/Q2 values, ``Native`` or ``PackedU32(0)`` store, F32/F16/BF16/UE4M3 scales;
            per-tensor, per-block, or two levels (F32 global, block dtype at most F16 wide).

    Returns:
        a :class:`QuantizedTensor` with int8 values of ``array``'s shape and float32 scales.

    Raises:
        QuantizationError: for non-float input, NaN or infinite values, a scheme Burn cannot
            quantize with, or a block size that does not divide the shape.
    """
    from .quant_scales import F32_MIN_POSITIVE, validated_scales  # ml_dtypes: imported with the first quantized tensor

    x = np.asarray(array)
    if x.dtype not in _float_inputs():
        raise QuantizationError(f"only float arrays can be quantized, found {x.dtype}")
    _check_quantizable(scheme)
    finite = np.isfinite(x)
    if not finite.all():
        nan = int(np.isnan(x).sum())
        raise QuantizationError(
            f"the values hold {nan} NaN and {int(x.size - finite.sum()) - nan} infinite element(s); MinMax "
            "calibration needs finite values (a NaN would vanish and an infinity would zero every other value)")
    a, b = scheme.value.range
    compute = x.dtype.type
    alpha = _block_alpha(x, scheme)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        raw = ((alpha * compute(2)) / compute(b - a)).astype(np.float32)
        global_scale = None
        if scheme.is_two_level:
            peak = np.fmax.reduce(raw.reshape(-1), initial=np.float32(0))
            global_scale = max(np.float32(peak / np.float32(scheme.block.dtype.max_representable)), F32_MIN_POSITIVE)
            raw = raw / global_scale
            global_scale = validated_scales(np.float32(global_scale), ScaleDtype.F32)[()]
        scales = validated_scales(raw, scheme.scale_dtype())
        divisor = expand_scales(scales, x.shape, scheme)
        if global_scale is not None:
            divisor = np.float32(global_scale) * divisor
        q = round_half_away_from_zero(x.astype(np.float32) / divisor)
        q = np.where(np.isnan(q), np.float32(0), np.clip(q, a, b))
    return QuantizedTensor(x.shape, scheme, q.astype(np.int8), scales, global_scale)


def per_axis_block(shape: tuple, axis: int) -> tuple:
    """The block extents of one scale per index of ``axis``: the whole tensor but 1 along ``axis``."""
    return tuple(1 if i == axis else int(d) for i, d in enumerate(shape))


def quantize_per_axis(array, scheme: QuantScheme, axis: int) -> QuantizedTensor:
    """Quantize ``array`` with one scale per index of ``axis`` (per output channel): MinMax over
    every other axis, ``scale = max|x| / 127`` for Q8S (``2 * alpha / (b - a)``, as :func:`quantize`).

    When Burn's block sizes can hold it (every extent of :func:`per_axis_block` at most 255) the
    result is Burn's own block scheme (f32 block scales), which burnpack stores; else it is an
    ONNX per-axis tensor (:attr:`QuantizedTensor.axis`), exported to ONNX as ``DequantizeLinear``
    with ``axis`` but refused by a burnpack save (Burn cannot read it).

    Args:
        array: float values, rank >= 1.
        scheme: a per-tensor, one-level scheme: its value type and store are used.
        axis: the channel axis (0 for Conv ``[O, I, kh, kw]``, 1 for ConvTranspose ``[I, O/g, kh, kw]``
            and a ``[K, N]`` MatMul weight).

    Raises:
        QuantizationError: for an axis out of range, a blocked or two-level ``scheme``, or values
            :func:`quantize` refuses.
    """
    x = np.asarray(array)
    if not 0 <= axis < x.ndim:
        raise QuantizationError(f"axis {axis} is out of range for a tensor of shape {list(x.shape)}")
    if scheme.block is not None or scheme.is_two_level:
        raise QuantizationError(f"per-axis quantization takes a per-tensor scheme, got {scheme.describe()}")
    extents = per_axis_block(x.shape, axis)
    try:
        block = BlockSize(extents)  # extents over 255 (or over 5 dims) are not Burn's
    except QuantizationError:
        block = None
    if block is not None:
        return quantize(x, QuantScheme(scheme.value, block_size=block, store=scheme.store))
    moved = np.moveaxis(x, axis, 0)
    flat = moved.reshape(moved.shape[0], -1)
    # one row per channel: the per-tensor MinMax of each row (Burn's formula, row by row)
    parts = [quantize(row, QuantScheme(scheme.value, store=scheme.store)) for row in flat]
    values = np.stack([p.values for p in parts]).reshape(moved.shape)
    scales = np.array([p.scales.reshape(()) for p in parts], np.float32)
    return QuantizedTensor(x.shape, QuantScheme(scheme.value, store=scheme.store),
                           np.moveaxis(values, 0, axis), scales, axis=axis)
