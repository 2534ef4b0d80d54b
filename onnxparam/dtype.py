"""Element types: Burn's ``DType`` and its numpy and ONNX equivalents.

The names are Burn's (``burn_std::tensor::DType``): ``F64``, ``F32``, ``Flex32``, ``F16``,
``BF16``, ``I64`` ... ``U8``, ``Bool`` and ``QFloat`` (a quantized float tensor whose scheme is
carried beside the dtype, see :mod:`onnxparam.quant`).

Three mapping tables, one per direction that is needed, each a constant:

* :data:`NUMPY_DTYPES`       ``DType`` -> numpy dtype (bf16 through ``ml_dtypes``)
* :data:`ONNX_ELEMENT_TYPES` ``DType`` -> ``onnx.TensorProto`` element type
* :data:`DTYPE_FROM_ONNX`    ``onnx.TensorProto`` element type -> ``DType``

``Flex32`` is Burn's "f32 storage, any float precision in compute" type; its bytes are f32, so
it maps to ``float32`` and ONNX ``FLOAT``, but ``FLOAT`` maps back to ``F32`` only.
``QFloat`` has no single numpy or ONNX element type: its bytes are values + scales (see
``docs/burnpack.md`` section 2), so it is absent from those tables.
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = [
    "DType",
    "NUMPY_DTYPES",  # noqa: F822  (answered by the module __getattr__)
    "ONNX_ELEMENT_TYPES",
    "DTYPE_FROM_ONNX",
    "dtype_from_numpy",
]


class DType(enum.Enum):
    """A tensor element type, named as in Burn's ``DType``.

    ``value`` is Burn's variant name, which is also the burnpack CBOR text for plain dtypes.
    """

    F64 = "F64"
    F32 = "F32"
    Flex32 = "Flex32"
    F16 = "F16"
    BF16 = "BF16"
    I64 = "I64"
    I32 = "I32"
    I16 = "I16"
    I8 = "I8"
    U64 = "U64"
    U32 = "U32"
    U16 = "U16"
    U8 = "U8"
    Bool = "Bool"
    QFloat = "QFloat"

    @property
    def is_float(self) -> bool:
        """True for float kinds (including ``QFloat``, which dequantizes to float)."""
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def is_bool(self) -> bool:
        return self is DType.Bool

    @property
    def itemsize(self) -> int:
        """Bytes per element of the plain storage.

        Raises:
            ValueError: for ``QFloat``, whose byte length follows the quantization scheme.
        """
        if self is DType.QFloat:
            raise ValueError("QFloat has no fixed element size; its length follows its scheme")
        return _numpy_dtype(self).itemsize

    def to_numpy(self) -> np.dtype:
        """The numpy dtype holding this type's elements.

        Raises:
            ValueError: for ``QFloat``.
        """
        return _numpy_dtype(self)

    def to_onnx(self) -> int:
        """The ``onnx.TensorProto`` element type of this dtype.

        Raises:
            ValueError: for ``QFloat``.
        """
        try:
            return ONNX_ELEMENT_TYPES[self]
        except KeyError:
            raise ValueError(f"{self.name} has no single ONNX element type") from None

    @staticmethod
    def from_onnx(elem_type: int) -> "DType":
        """The ``DType`` of an ONNX element type.

        Raises:
            ValueError: for ONNX types Burn has no dtype for (strings, complex, float8, int4).
        """
        try:
            return DTYPE_FROM_ONNX[elem_type]
        except KeyError:
            from onnx import TensorProto  # NOTE: only for the message; `import onnx` is slow

            name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
            raise ValueError(f"ONNX element type {name} has no Burn dtype") from None

    @staticmethod
    def from_numpy(dtype) -> "DType":
        return dtype_from_numpy(dtype)


_FLOATS = frozenset({DType.F64, DType.F32, DType.Flex32, DType.F16, DType.BF16, DType.QFloat})
_INTS = frozenset({DType.I64, DType.I32, DType.I16, DType.I8, DType.U64, DType.U32, DType.U16, DType.U8})

_PLAIN_NUMPY: dict = {
    DType.F64: np.dtype(np.float64),
    DType.F32: np.dtype(np.float32),
    DType.Flex32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.I64: np.dtype(np.int64),
    DType.I32: np.dtype(np.int32),
    DType.I16: np.dtype(np.int16),
    DType.I8: np.dtype(np.int8),
    DType.U64: np.dtype(np.uint64),
    DType.U32: np.dtype(np.uint32),
    DType.U16: np.dtype(np.uint16),
    DType.U8: np.dtype(np.uint8),
    DType.Bool: np.dtype(np.bool_),
}
"""The numpy dtypes of every plain dtype but ``BF16``, whose numpy type ``ml_dtypes`` defines:
that package (slow to import) is imported only when a ``BF16`` dtype is asked for."""


def _numpy_dtype(dtype: DType) -> np.dtype:
    plain = _PLAIN_NUMPY.get(dtype)
    if plain is not None:
        return plain
    if dtype is DType.BF16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"{dtype.name} has no plain numpy dtype")


def __getattr__(name):
    # NUMPY_DTYPES: ``DType`` -> numpy dtype (every dtype but ``QFloat``; little-endian byte order
    # implied, as in burnpack and ONNX raw data), built on first use: it imports ml_dtypes
    if name == "NUMPY_DTYPES":
        return {dtype: _numpy_dtype(dtype) for dtype in DType if dtype is not DType.QFloat}
    raise AttributeError(f"module 'onnxparam.dtype' has no attribute {name!r}")

ONNX_ELEMENT_TYPES: dict[DType, int] = {  # ONNX spec: onnx.proto, TensorProto.DataType
    DType.F64: 11,  # DOUBLE
    DType.F32: 1,  # FLOAT
    DType.Flex32: 1,  # FLOAT
    DType.F16: 10,  # FLOAT16
    DType.BF16: 16,  # BFLOAT16
    DType.I64: 7,  # INT64
    DType.I32: 6,  # INT32
    DType.I16: 5,  # INT16
    DType.I8: 3,  # INT8
    DType.U64: 13,  # UINT64
    DType.U32: 12,  # UINT32
    DType.U16: 4,  # UINT16
    DType.U8: 2,  # UINT8
    DType.Bool: 9,  # BOOL
}
"""``DType`` -> ``onnx.TensorProto`` element type (the numbers of the ONNX spec, so that this
module does not import ``onnx``)."""

DTYPE_FROM_ONNX: dict[int, DType] = {
    onnx_type: dtype for dtype, onnx_type in ONNX_ELEMENT_TYPES.items() if dtype is not DType.Flex32
}
"""``onnx.TensorProto`` element type -> ``DType`` (``FLOAT`` -> ``F32``, never ``Flex32``)."""

_FROM_NUMPY: dict[np.dtype, DType] = {
    np_dtype: dtype for dtype, np_dtype in _PLAIN_NUMPY.items() if dtype is not DType.Flex32
}


def dtype_from_numpy(dtype) -> DType:
    """The ``DType`` of a numpy dtype (``ml_dtypes.bfloat16`` -> ``BF16``).

    Raises:
        ValueError: for numpy dtypes Burn has no dtype for (complex, strings, objects ...).
    """
    np_dtype = np.dtype(dtype)
    try:
        return _FROM_NUMPY[np_dtype.newbyteorder("=") if np_dtype.byteorder not in "=|" else np_dtype]
    except KeyError:
        # a bfloat16 value exists only once ml_dtypes is imported (its dtype is named so)
        if np_dtype.name == "bfloat16" and np_dtype == _numpy_dtype(DType.BF16):
            return DType.BF16
        raise ValueError(f"numpy dtype {np_dtype} has no Burn dtype") from None
