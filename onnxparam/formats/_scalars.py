"""Burn's typed metadata scalars (``Scalar``: Int / UInt / Float / Bool) and bool stores
(``docs/burnpack.md`` §1.2, §5), shared by the burnpack and safetensors formats.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

__all__ = ["Scalar", "SCALAR_KINDS", "BOOL_STORES", "scalar_from_cbor", "U64_MAX", "I64_MIN", "I64_MAX"]

U64_MAX = 2**64 - 1


I64_MIN, I64_MAX = -(2**63), 2**63 - 1


BOOL_STORES: dict[str, int] = {"Native": 1, "U8": 1, "U32": 4}
"""Burn ``BoolStore`` variant -> bytes per element (``dtype.rs``, §1.2)."""


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
