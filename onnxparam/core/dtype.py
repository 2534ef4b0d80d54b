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

ONNX-only element types. ONNX holds element types Burn has none for: ``String``, the complex
types ``C64`` / ``C128``, the float8 types ``F8E4M3FN``, ``F8E4M3FNUZ``, ``F8E5M2``,
``F8E5M2FNUZ``, ``F8E8M0FNU``, the float6 / float4 types ``F6E2M3FN``, ``F6E3M2FN``,
``F4E2M1FN`` and the packed integers ``I4``, ``U4``, ``I2``, ``U2`` (ONNX spec: onnx.proto,
``TensorProto.DataType``; numpy types from ``ml_dtypes``, one element per numpy item, so
``I4`` values are unpacked). They are members of :class:`DType` so that an imported model's
weights of those types are params like any other; ``DType.is_onnx_only`` is true for them and
``DType.burnpack_storable`` false (Burn's ``DType`` has no such variant, so a burnpack writer
refuses them). They are in :data:`ONNX_ONLY_ELEMENT_TYPES`, not in :data:`ONNX_ELEMENT_TYPES` /
:data:`DTYPE_FROM_ONNX`, and :meth:`DType.from_onnx` / :func:`dtype_from_numpy` keep answering
for Burn's dtypes only (an onnxparam ``Tensor`` computes with Burn's dtypes); use
:func:`dtype_from_onnx_element` for any ONNX element type.
"""

from __future__ import annotations

import enum

import numpy as np

from .errors import DTypeError

__all__ = [
    "DType",
    "NUMPY_DTYPES",  # noqa: F822  (answered by the module __getattr__)
    "ONNX_ELEMENT_TYPES",
    "DTYPE_FROM_ONNX",
    "dtype_from_numpy",
    "ONNX_ONLY_ELEMENT_TYPES",
    "dtype_from_onnx_element",
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
    # ONNX-only element types (module docstring): no Burn dtype, not storable in burnpack
    String = "String"
    C64 = "C64"
    C128 = "C128"
    F8E4M3FN = "F8E4M3FN"
    F8E4M3FNUZ = "F8E4M3FNUZ"
    F8E5M2 = "F8E5M2"
    F8E5M2FNUZ = "F8E5M2FNUZ"
    F8E8M0FNU = "F8E8M0FNU"
    F6E2M3FN = "F6E2M3FN"
    F6E3M2FN = "F6E3M2FN"
    F4E2M1FN = "F4E2M1FN"
    I4 = "I4"
    U4 = "U4"
    I2 = "I2"
    U2 = "U2"

    @property
    def is_onnx_only(self) -> bool:
        """True for element types ONNX has and Burn does not (module docstring)."""
        return self in ONNX_ONLY_ELEMENT_TYPES

    @property
    def burnpack_storable(self) -> bool:
        """True when Burn's ``DType`` has this variant, so a burnpack file can hold it."""
        return self not in ONNX_ONLY_ELEMENT_TYPES

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
            ValueError: for ``QFloat``, whose byte length follows the quantization scheme, and
                ``String``, whose elements have no fixed size.
        """
        if self is DType.QFloat:
            raise ValueError("QFloat has no fixed element size; its length follows its scheme")
        if self is DType.String:
            raise ValueError("String has no fixed element size")
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
            return ONNX_ELEMENT_TYPES.get(self) or ONNX_ONLY_ELEMENT_TYPES[self]
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
            raise DTypeError(f"ONNX element type {name} has no Burn dtype") from None

    @staticmethod
    def from_numpy(dtype) -> "DType":
        return dtype_from_numpy(dtype)


_FLOATS = frozenset({DType.F64, DType.F32, DType.Flex32, DType.F16, DType.BF16, DType.QFloat,
                     DType.F8E4M3FN, DType.F8E4M3FNUZ, DType.F8E5M2, DType.F8E5M2FNUZ, DType.F8E8M0FNU,
                     DType.F6E2M3FN, DType.F6E3M2FN, DType.F4E2M1FN})
_INTS = frozenset({DType.I64, DType.I32, DType.I16, DType.I8, DType.U64, DType.U32, DType.U16, DType.U8,
                   DType.I4, DType.U4, DType.I2, DType.U2})

_ML_DTYPES_NAMES: dict = {
    DType.F8E4M3FN: "float8_e4m3fn", DType.F8E4M3FNUZ: "float8_e4m3fnuz", DType.F8E5M2: "float8_e5m2",
    DType.F8E5M2FNUZ: "float8_e5m2fnuz", DType.F8E8M0FNU: "float8_e8m0fnu", DType.F6E2M3FN: "float6_e2m3fn",
    DType.F6E3M2FN: "float6_e3m2fn", DType.F4E2M1FN: "float4_e2m1fn", DType.I4: "int4", DType.U4: "uint4",
    DType.I2: "int2", DType.U2: "uint2",
}
"""ONNX-only dtype -> the ``ml_dtypes`` type holding one element per numpy item."""

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
    if dtype in _ML_DTYPES_NAMES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, _ML_DTYPES_NAMES[dtype]))
    other = {DType.C64: np.complex64, DType.C128: np.complex128, DType.String: np.object_}.get(dtype)
    if other is not None:
        return np.dtype(other)
    raise ValueError(f"{dtype.name} has no plain numpy dtype")


def __getattr__(name):
    # NUMPY_DTYPES: ``DType`` -> numpy dtype (every dtype but ``QFloat``; little-endian byte order
    # implied, as in burnpack and ONNX raw data), built on first use: it imports ml_dtypes
    if name == "NUMPY_DTYPES":
        return {dtype: _numpy_dtype(dtype) for dtype in DType if dtype is not DType.QFloat and not dtype.is_onnx_only}
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

ONNX_ONLY_ELEMENT_TYPES: dict[DType, int] = {  # ONNX spec: onnx.proto, TensorProto.DataType
    DType.String: 8,  # STRING
    DType.C64: 14,  # COMPLEX64
    DType.C128: 15,  # COMPLEX128
    DType.F8E4M3FN: 17,  # FLOAT8E4M3FN
    DType.F8E4M3FNUZ: 18,  # FLOAT8E4M3FNUZ
    DType.F8E5M2: 19,  # FLOAT8E5M2
    DType.F8E5M2FNUZ: 20,  # FLOAT8E5M2FNUZ
    DType.U4: 21,  # UINT4
    DType.I4: 22,  # INT4
    DType.F4E2M1FN: 23,  # FLOAT4E2M1
    DType.F8E8M0FNU: 24,  # FLOAT8E8M0
    DType.U2: 25,  # UINT2
    DType.I2: 26,  # INT2
    DType.F6E2M3FN: 27,  # FLOAT6E2M3
    DType.F6E3M2FN: 28,  # FLOAT6E3M2
}
"""ONNX-only ``DType`` -> ``onnx.TensorProto`` element type (module docstring)."""

_FROM_ONNX_ONLY: dict[int, DType] = {onnx_type: dtype for dtype, onnx_type in ONNX_ONLY_ELEMENT_TYPES.items()}


def dtype_from_onnx_element(elem_type: int) -> DType:
    """The ``DType`` of any ONNX element type: Burn's (as :meth:`DType.from_onnx`) or ONNX-only.

    Raises:
        ValueError: for ``UNDEFINED`` and numbers ONNX does not define.
    """
    hit = DTYPE_FROM_ONNX.get(int(elem_type)) or _FROM_ONNX_ONLY.get(int(elem_type))
    if hit is None:
        raise ValueError(f"{elem_type} is not an ONNX element type onnxparam knows")
    return hit

_FROM_NUMPY: dict[np.dtype, DType] = {
    np_dtype: dtype for dtype, np_dtype in _PLAIN_NUMPY.items() if dtype is not DType.Flex32
}


def dtype_from_numpy(dtype) -> DType:
    """The ``DType`` of a numpy dtype (``ml_dtypes.bfloat16`` -> ``BF16``).

    Raises:
        DTypeError: (a ``ValueError``) for numpy dtypes Burn has no dtype for (complex, strings, objects ...).
    """
    np_dtype = np.dtype(dtype)
    try:
        return _FROM_NUMPY[np_dtype.newbyteorder("=") if np_dtype.byteorder not in "=|" else np_dtype]
    except KeyError:
        # a bfloat16 value exists only once ml_dtypes is imported (its dtype is named so)
        if np_dtype.name == "bfloat16" and np_dtype == _numpy_dtype(DType.BF16):
            return DType.BF16
        hint = ("; strings go to an imported ONNX module as numpy arrays (module(x) accepts them)"
                if np_dtype.kind in "USO" else "")
        raise DTypeError(f"numpy dtype {np_dtype} has no Burn dtype{hint}") from None
