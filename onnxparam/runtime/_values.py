"""Every ONNX element type across the ONNX Runtime boundary, as raw bits where numpy's binding
cannot carry it.

ONNX Runtime's Python binding converts numpy arrays of its own numpy types only: ``bfloat16``,
the float8 types, ``float4e2m1``, ``float8e8m0`` and the packed integers ``int4`` / ``uint4`` /
``int2`` / ``uint2`` fail ("Numpy_type 256 can't be converted to MLDataType", "No corresponding
Numpy type for Tensor Type") or come back as ``uint8``. Here they travel as ``OrtValue`` s built
from the values' bits, and come back as ``ml_dtypes`` arrays (one element per numpy item):

* one- and two-byte types: ``OrtValue.ortvalue_from_numpy_with_onnx_type`` over a ``uint8`` /
  ``uint16`` view (no copy);
* sub-byte types (``int4`` ... ``int2``): an ``OrtValue`` of the ONNX type allocated by ONNX
  Runtime (``ortvalue_from_shape_and_type``) and filled with the packed bytes, ONNX's layout
  (ONNX IR spec, "4 bit / 2 bit types": element ``i`` in the low bits first);
* outputs: the bytes at ``OrtValue.data_ptr()`` (``tensor_size_in_bytes`` of them), unpacked.

Checked on onnxruntime 1.32 and ml_dtypes 0.5 to 0.7 (``ml_dtypes.int4(-1)`` is the byte
``0x0F``: values keep their bits in the low bits of a byte).
"""

from __future__ import annotations

import ctypes
import math
from typing import Optional

import numpy as np

__all__ = ["RAW_ONNX_TYPES", "numpy_of_onnx", "onnx_of_numpy", "needs_raw", "host_ortvalue", "ortvalue_array",
           "onnx_type_of_ort_string"]

# ONNX TensorProto element types (onnx.proto)
_BF16, _E4M3FN, _E4M3FNUZ, _E5M2, _E5M2FNUZ, _U4, _I4, _F4E2M1, _E8M0, _U2, _I2 = 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26

_ML_NAMES = {_BF16: "bfloat16", _E4M3FN: "float8_e4m3fn", _E4M3FNUZ: "float8_e4m3fnuz", _E5M2: "float8_e5m2",
             _E5M2FNUZ: "float8_e5m2fnuz", _U4: "uint4", _I4: "int4", _F4E2M1: "float4_e2m1fn",
             _E8M0: "float8_e8m0fnu", _U2: "uint2", _I2: "int2"}
"""ONNX element type -> ``ml_dtypes`` type name, for the types numpy's ORT binding cannot carry."""

_BITS = {_U4: 4, _I4: 4, _F4E2M1: 4, _U2: 2, _I2: 2}
"""Packed (sub-byte) element types -> bits per element."""

_ORT_TYPE_STRINGS = {"bfloat16": _BF16, "float8e4m3fn": _E4M3FN, "float8e4m3fnuz": _E4M3FNUZ,
                     "float8e5m2": _E5M2, "float8e5m2fnuz": _E5M2FNUZ, "uint4": _U4, "int4": _I4,
                     "float4e2m1": _F4E2M1, "float8e8m0": _E8M0, "uint2": _U2, "int2": _I2}
"""ONNX Runtime's type string (``tensor(float8e4m3fn)``) -> ONNX element type."""

RAW_ONNX_TYPES = frozenset(_ML_NAMES)
"""ONNX element types that cross the boundary as raw bits."""


def _ml(name: str):
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def numpy_of_onnx(onnx_type: int) -> Optional[np.dtype]:
    """The ``ml_dtypes`` numpy dtype of a raw ONNX element type (``None`` for other types or an
    ``ml_dtypes`` without it)."""
    name = _ML_NAMES.get(int(onnx_type))
    if name is None:
        return None
    try:
        return _ml(name)
    except AttributeError:  # an older ml_dtypes (int2 / uint2 arrived in 0.5)
        return None


def onnx_of_numpy(dtype) -> Optional[int]:
    """The raw ONNX element type of an ``ml_dtypes`` numpy dtype, ``None`` for any other dtype."""
    dtype = np.dtype(dtype)
    if dtype.itemsize > 2 or dtype.kind not in "Vfiu" or dtype.names is not None:
        return None
    for onnx_type, name in _ML_NAMES.items():
        if dtype.name == name:
            return onnx_type
    return None


def needs_raw(array) -> bool:
    """True when ``array`` (a numpy array) holds a type numpy's ORT binding cannot carry."""
    return isinstance(array, np.ndarray) and onnx_of_numpy(array.dtype) is not None


def onnx_type_of_ort_string(type_string: str) -> Optional[int]:
    """The raw ONNX element type of a session input/output type string (``tensor(bfloat16)``)."""
    if not type_string.startswith("tensor(") or not type_string.endswith(")"):
        return None
    return _ORT_TYPE_STRINGS.get(type_string[7:-1])


def _pack(bits: np.ndarray, width: int) -> np.ndarray:
    """Elements' low ``width`` bits (``uint8``, flat) packed ONNX's way: element 0 lowest."""
    per = 8 // width
    n = bits.size
    padded = np.zeros(-(-n // per) * per, dtype=np.uint8)
    padded[:n] = bits & ((1 << width) - 1)
    lanes = padded.reshape(-1, per)
    out = np.zeros(lanes.shape[0], dtype=np.uint8)
    for k in range(per):
        out |= lanes[:, k] << (k * width)
    return out


def _unpack(packed: np.ndarray, width: int, n: int) -> np.ndarray:
    per = 8 // width
    mask = (1 << width) - 1
    lanes = np.stack([(packed >> (k * width)) & mask for k in range(per)], axis=1).reshape(-1)
    return lanes[:n].astype(np.uint8)


def host_ortvalue(array: np.ndarray, ort):
    """A CPU ``OrtValue`` of ``array``; raw ONNX types through their bits (module docstring).

    The one- and two-byte raw types and every numpy type share ``array``'s memory (keep it alive
    while the value is used); packed types are copied into memory ONNX Runtime owns.
    """
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).reshape(array.shape)
    onnx_type = onnx_of_numpy(array.dtype)
    if onnx_type is None:
        return ort.OrtValue.ortvalue_from_numpy(array)
    width = _BITS.get(onnx_type)
    if width is None:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16 if array.dtype.itemsize == 2
                                                                          else np.uint8), onnx_type)
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), onnx_type)
    packed = _pack(array.reshape(-1).view(np.uint8), width)
    if packed.size:
        ctypes.memmove(value.data_ptr(), packed.ctypes.data, packed.size)
    return value


def ortvalue_array(value) -> np.ndarray:
    """The host array of a CPU tensor ``OrtValue``, of its real dtype (``ml_dtypes`` for the raw
    types; ``value.numpy()`` for the others)."""
    onnx_type = int(value.element_type())
    dtype = numpy_of_onnx(onnx_type)
    if dtype is None:
        return value.numpy()
    shape = tuple(value.shape())
    n = math.prod(shape)
    if n == 0:
        return np.zeros(shape, dtype=dtype)
    nbytes = int(value.tensor_size_in_bytes())
    raw = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(value.data_ptr()), dtype=np.uint8).copy()
    width = _BITS.get(onnx_type)
    if width is None:
        return raw.view(np.uint16 if dtype.itemsize == 2 else np.uint8).view(dtype).reshape(shape)
    return _unpack(raw, width, n).view(dtype).reshape(shape)
