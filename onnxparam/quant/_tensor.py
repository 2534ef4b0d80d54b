"""A quantized tensor's values and scales, and its exact Burn byte form (``docs/burnpack.md`` §2-3)."""

from __future__ import annotations

import math

import numpy as np

from .._services import service
from ..dtype import DType
from ..errors import QuantizationError
from ._layout import (
    expand_scales,
    pack_values,
    params_shape,
    quantized_nbytes,
    unpack_values,
    values_nbytes,
)
from ._scales import decode_scales, encode_scales
from ._scheme import QuantScheme

__all__ = ["QuantizedTensor"]


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
            raw: bytes-like, exactly :func:`~onnxparam.quant._layout.quantized_nbytes` long.
            shape: the logical shape (the burnpack descriptor's ``shape``).
            scheme: the tensor's scheme.

        Raises:
            QuantizationError: for a wrong length or an unsupported store, value or scale dtype.
        """
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
        # calibration builds on this file (a service it is registered as, not an import)
        return service("quant.quantize")(array, scheme)

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
        from ..tensor import TensorData

        raw = _read_only(np.frombuffer(self.to_bytes(), dtype=np.uint8))
        return TensorData(raw, DType.QFloat, self.shape, self.scheme)

    def to_tensor(self, device=None):
        """A :class:`~onnxparam.tensor.Tensor` of dtype ``QFloat`` holding this tensor.

        Raises:
            DeviceError: for a device other than the host (quantized tensors live on the host).
        """
        from ..tensor import Tensor

        tensor = Tensor(quant=self, shape=self.shape, dtype=DType.QFloat)
        return tensor if device is None else tensor.to_device(device)

    def describe(self) -> str:
        """The scheme in words (``scheme.describe()``, plus ``per-axis N`` for an ONNX per-axis tensor)."""
        text = self.scheme.describe()
        return text if self.axis is None else f"{text}, per-axis {self.axis} (ONNX)"

    def __repr__(self) -> str:
        return f"QuantizedTensor(shape={list(self.shape)}, scheme={self.describe()})"
