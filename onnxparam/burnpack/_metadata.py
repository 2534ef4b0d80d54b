"""The burnpack metadata map: descriptors, dtypes, user metadata and typed scalars (§0, §1, §5).

Section numbers below refer to ``docs/burnpack.md``::

    Metadata   = { "tensors": { name: Descriptor, ... },   sorted by name (Rust BTreeMap)
                   "metadata": { text: text, ... },         omitted when empty
                   "scalars":  { name: Scalar, ... } }      omitted when empty
    Descriptor = { "dtype": DType, "shape": [u64, ...], "data_offsets": [start, end],
                   "param_id": u64 }                        param_id omitted when None
    DType      = "F32" | ... | {"Bool": "Native"|"U8"|"U32"} | {"QFloat": QuantScheme}
    Scalar     = {"Int": i64} | {"UInt": u64} | {"Float": f64} | {"Bool": bool}

Keys appear in exactly this order (Rust struct declaration order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..core.dtype import DType
from ..core.quant_layout import quantized_nbytes
from ..core.quant_scheme import QuantScheme
from ..formats._scalars import BOOL_STORES, I64_MAX, I64_MIN, SCALAR_KINDS, U64_MAX, Scalar, scalar_from_cbor  # noqa: F401  (re-exported)

__all__ = [
    "Scalar",
    "SCALAR_KINDS",
    "BOOL_STORES",
    "Descriptor",
    "dtype_to_cbor",
    "dtype_from_cbor",
    "expected_nbytes",
    "describe_dtype",
    "scalar_from_cbor",
    "U64_MAX",
]


PLAIN_DTYPES: dict[str, DType] = {d.value: d for d in DType
                                   if d not in (DType.Bool, DType.QFloat) and d.burnpack_storable}
"""CBOR text -> plain ``DType`` (§1.2)."""


@dataclass(frozen=True)
class Descriptor:
    """One tensor's metadata entry (§0)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    param_id: int | None = None
    bool_store: str | None = None
    scheme: QuantScheme | None = None

    def to_cbor(self) -> dict:
        """The descriptor map, keys in Burn's order; ``param_id`` omitted when None."""
        out = {
            "dtype": dtype_to_cbor(self.dtype, self.bool_store, self.scheme),
            "shape": list(self.shape),
            "data_offsets": list(self.data_offsets),
        }
        if self.param_id is not None:
            out["param_id"] = self.param_id
        return out


def dtype_to_cbor(dtype: DType, bool_store: str | None = None, scheme: QuantScheme | None = None):
    """``"F32"``, ``{"Bool": store}`` or ``{"QFloat": scheme}`` (§1.2-1.3)."""
    if dtype is DType.Bool:
        return {"Bool": bool_store or "Native"}
    if dtype is DType.QFloat:
        return {"QFloat": scheme.to_cbor()}
    return dtype.value


def dtype_from_cbor(obj) -> tuple[DType, str | None, QuantScheme | None]:
    """Inverse of :func:`dtype_to_cbor`: ``(dtype, bool_store, scheme)``.

    Raises:
        ValueError: for an unknown dtype or bool store.
        QuantizationError: for a quantization scheme that is unsupported or malformed.
    """
    if isinstance(obj, str) and obj in PLAIN_DTYPES:
        return PLAIN_DTYPES[obj], None, None
    if isinstance(obj, dict) and len(obj) == 1:
        ((variant, inner),) = obj.items()
        if variant == "Bool":
            if isinstance(inner, str) and inner in BOOL_STORES:
                return DType.Bool, inner, None
            raise ValueError(f"unknown bool store {inner!r}; Burn's BoolStore is one of {', '.join(BOOL_STORES)}")
        if variant == "QFloat":
            return DType.QFloat, None, QuantScheme.from_cbor(inner)
    known = ", ".join(list(PLAIN_DTYPES) + ['{"Bool": ...}', '{"QFloat": ...}'])
    raise ValueError(f"unknown dtype {obj!r}; Burn's DType is one of {known}")


def expected_nbytes(dtype: DType, shape, bool_store: str | None = None, scheme: QuantScheme | None = None) -> int:
    """Byte length of a tensor: ``numel * itemsize``, or the QFloat formula (§2.1).

    Raises:
        QuantizationError: when a QFloat scheme does not fit the shape.
    """
    if dtype is DType.QFloat:
        return quantized_nbytes(shape, scheme)
    itemsize = BOOL_STORES[bool_store or "Native"] if dtype is DType.Bool else dtype.itemsize
    return math.prod(shape) * itemsize


def describe_dtype(dtype: DType, bool_store: str | None = None, scheme: QuantScheme | None = None) -> str:
    """``F32``, ``Bool(U32)`` or ``QFloat(Q8S Native per-tensor F32)`` for messages."""
    if dtype is DType.Bool:
        return f"Bool({bool_store or 'Native'})"
    if dtype is DType.QFloat:
        return f"QFloat({scheme.describe()})"
    return dtype.name


def build_metadata(descriptors: list[Descriptor], metadata: Mapping[str, str], scalars: Mapping[str, Scalar]) -> dict:
    """The top-level metadata object, ordered and sorted as Burn serializes it."""
    out: dict = {"tensors": {d.name: d.to_cbor() for d in sorted(descriptors, key=lambda d: d.name.encode())}}
    if metadata:
        out["metadata"] = {k: metadata[k] for k in sorted(metadata, key=str.encode)}
    if scalars:
        out["scalars"] = {k: scalars[k].to_cbor() for k in sorted(scalars, key=str.encode)}
    return out
