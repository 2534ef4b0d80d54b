"""The safetensors header as this library writes and reads it: sizes, dtype names, the
``onnxparam.*`` metadata keys and the scalars' JSON form (see :mod:`onnxparam.formats._safetensors`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..core.dtype import DType
from ..core.errors import RecordError

SAFETENSORS_EXTENSION = ".safetensors"

HEADER_LENGTH_BYTES = 8
"""The leading ``u64`` that gives the JSON header's length."""
HEADER_ALIGNMENT = 8
"""The library pads the header with spaces to a multiple of 8, so the data start (and every
tensor of 8-byte elements) is 8-byte aligned for zero-copy views."""
MAX_HEADER_BYTES = 100_000_000
"""The ``safetensors`` library refuses longer headers (``MAX_HEADER_SIZE``, a DoS guard); so do
we, before allocating it."""
METADATA_KEY = "__metadata__"

RESERVED_PREFIX = "onnxparam."
"""Metadata keys with this prefix belong to this library (see the module docstring)."""
PARAM_IDS_KEY = "onnxparam.param_ids"
ORDER_KEY = "onnxparam.order"
DTYPES_KEY = "onnxparam.dtypes"
SCALARS_KEY = "onnxparam.scalars"
_KNOWN_KEYS = frozenset({PARAM_IDS_KEY, ORDER_KEY, DTYPES_KEY, SCALARS_KEY})

SAFETENSORS_DTYPES: dict[DType, str] = {
    DType.F64: "F64",
    DType.F32: "F32",
    DType.Flex32: "F32",
    DType.F16: "F16",
    DType.BF16: "BF16",
    DType.I64: "I64",
    DType.I32: "I32",
    DType.I16: "I16",
    DType.I8: "I8",
    DType.U64: "U64",
    DType.U32: "U32",
    DType.U16: "U16",
    DType.U8: "U8",
    DType.Bool: "BOOL",
    # ONNX-only float8 types the safetensors format names (its README's dtype list)
    DType.F8E4M3FN: "F8_E4M3",
    DType.F8E5M2: "F8_E5M2",
    DType.F8E8M0FNU: "F8_E8M0",
}
"""``DType`` -> safetensors dtype name (``Flex32`` has f32 storage; ``QFloat`` is stored as ``U8``
bytes, see the module docstring). safetensors' ``F8_E4M3`` is the finite-only e4m3 (ONNX
``FLOAT8E4M3FN``, ``torch.float8_e4m3fn``) and ``F8_E8M0`` the exponent-only e8m0 with NaN
(``FLOAT8E8M0``, ``torch.float8_e8m0fnu``); the ``fnuz`` variants have no safetensors name."""

DTYPE_FROM_SAFETENSORS: dict[str, DType] = {
    name: dtype for dtype, name in SAFETENSORS_DTYPES.items() if dtype is not DType.Flex32
}
"""safetensors dtype name -> ``DType``. The float8 names read as ONNX-only dtypes (see
:mod:`onnxparam.core.dtype`); names onnxparam has no dtype for (``C64``, ``F4`` ...) are absent and
refused when read."""

_WRITE_RANK: dict[str, int] = {
    name: rank
    for rank, name in enumerate(
        ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
         "F64", "I64", "U64"]
    )
}
"""The order of the ``Dtype`` enum of the Rust ``safetensors`` crate (restricted to the names
above). Its writer sorts tensors by dtype in *descending* enum order, then by name, so wide
types come first and stay aligned; :func:`write_safetensors` does the same to match its bytes."""


def _canonical_key(name: str, st_dtype: str) -> tuple:
    # NOTE: Python compares str by code point, which is the byte order of UTF-8: the order of
    # Rust's String comparison that the library uses.
    return (-_WRITE_RANK[st_dtype], name)


def _format_error(path, message: str) -> RecordError:
    from ._extensions import other_format_message

    other = other_format_message(path, "safetensors")  # a burnpack / ONNX / .pt file says so
    return RecordError(f"not a valid safetensors file '{path}': {message}" + (f"; {other}" if other else ""))


def _decode_scalars(path, raw: dict) -> dict:
    from ._scalars import scalar_from_cbor

    out = {}
    for name, obj in raw.items():
        if isinstance(obj, dict) and len(obj) == 1 and obj.get("Float") in _NON_FINITE:
            obj = {"Float": float(obj["Float"])}
        try:
            out[name] = scalar_from_cbor(obj)
        except ValueError as exc:
            raise _format_error(path, f"'{SCALARS_KEY}' has a bad scalar '{name}': {exc}") from None
    return out


_NON_FINITE = ("nan", "inf", "-inf")
"""JSON has no NaN or infinity; a non-finite Float scalar is written as one of these texts."""


def _encode_scalars(scalars: Mapping) -> dict:
    from ._scalars import Scalar

    out = {}
    for name, value in scalars.items():
        obj = Scalar.from_python(value).to_cbor()
        if "Float" in obj and not np.isfinite(obj["Float"]):
            obj = {"Float": repr(obj["Float"])}
        out[str(name)] = obj
    return out
