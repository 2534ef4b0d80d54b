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
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..dtype import DType
from ..quant._layout import quantized_nbytes
from ..quant._scheme import QuantScheme

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

U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

BOOL_STORES: dict[str, int] = {"Native": 1, "U8": 1, "U32": 4}
"""Burn ``BoolStore`` variant -> bytes per element (``dtype.rs``, §1.2)."""

PLAIN_DTYPES: dict[str, DType] = {d.value: d for d in DType
                                   if d not in (DType.Bool, DType.QFloat) and d.burnpack_storable}
"""CBOR text -> plain ``DType`` (§1.2)."""

SCALAR_KINDS = ("Int", "UInt", "Float", "Bool")
"""Burn ``Scalar`` variants (``pack/base.rs:178-188``, §5)."""


@dataclass(frozen=True)
class Scalar:
    """A typed scalar of the ``scalars`` section, keeping Burn's variant so it round trips.

    Attributes:
        kind: ``"Int"`` (i64), ``"UInt"`` (u64), ``"Float"`` (f64) or ``"Bool"``.
        value: the Python value.

    Raises:
        ValueError: when ``value`` does not fit ``kind``.
    """

    kind: str
    value: Any

    def __post_init__(self):
        problem = _scalar_problem(self.kind, self.value)
        if problem:
            raise ValueError(problem)

    @staticmethod
    def from_python(value) -> "Scalar":
        """``bool`` -> Bool, ``int`` -> Int (UInt above i64), ``float`` -> Float; a Scalar as is."""
        if isinstance(value, Scalar):
            return value
        if isinstance(value, bool):
            return Scalar("Bool", value)
        if isinstance(value, numbers.Integral):
            value = int(value)
            return Scalar("Int" if value <= I64_MAX else "UInt", value)
        if isinstance(value, numbers.Real):
            return Scalar("Float", float(value))
        raise ValueError(f"scalar {value!r} is not a bool, int or float")

    def to_cbor(self) -> dict:
        """``{kind: value}`` (§5)."""
        value = float(self.value) if self.kind == "Float" else self.value
        return {self.kind: value}


def _scalar_problem(kind, value) -> str | None:
    if kind == "Bool":
        return None if isinstance(value, bool) else f"Bool scalar needs a bool, found {value!r}"
    if kind == "Float":
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return None if ok else f"Float scalar needs a float, found {value!r}"
    if kind in ("Int", "UInt"):
        low, high = (I64_MIN, I64_MAX) if kind == "Int" else (0, U64_MAX)
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= high
        return None if ok else f"{kind} scalar needs an integer in {low}..{high}, found {value!r}"
    return f"unknown scalar kind {kind!r}; Burn's Scalar is one of {', '.join(SCALAR_KINDS)}"


def scalar_from_cbor(obj) -> Scalar:
    """Decode ``{kind: value}``. Raises ``ValueError`` for anything else."""
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise ValueError(f'a scalar is a 1-entry map like {{"Float": 0.5}}, found {obj!r}')
    ((kind, value),) = obj.items()
    if kind == "Float" and not isinstance(value, float):  # ciborium writes a CBOR float
        raise ValueError(f"Float scalar needs a CBOR float, found {value!r}")
    return Scalar(kind, value)


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
