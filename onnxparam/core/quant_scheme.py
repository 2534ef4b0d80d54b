"""Quantization schemes, named and encoded exactly as Burn's (``docs/burnpack.md`` §1.3).

A :class:`QuantScheme` says how a float tensor became integers: the value type
(:class:`QuantValue`), how the values are stored (:class:`QuantStore`), the mode
(:class:`QuantMode`) and up to two scale levels, one per tensor (``tensor``, a
:class:`ScaleDtype`) and one per block (``block``, a :class:`BlockScale`). The Python objects
mirror Burn's ``cubecl_common::quant::scheme`` types field for field, so
:meth:`QuantScheme.to_cbor` gives the value that cbor2 encodes to Burn's bytes.

Nothing here knows of files or tensors: byte layouts live in :mod:`onnxparam.core.quant_layout`.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import QuantizationError

__all__ = [
    "QuantValue",
    "QuantStore",
    "QuantMode",
    "ScaleDtype",
    "BlockSize",
    "BlockScale",
    "QuantScheme",
]

U64_MAX = 2**64 - 1
"""Largest ``usize`` a 64-bit Burn writes (``PackedU32(n)``)."""


class QuantValue(enum.Enum):
    """The logical type of the quantized values (Burn ``QuantValue``, ``docs/burnpack.md`` §3).

    ``Q*F`` use the full two's-complement range, ``Q*S`` a range symmetric around zero (the most
    negative code is never produced). ``E4M3``, ``E5M2`` and ``E2M1`` are minifloat codes,
    which Burn produces on the GPU only.
    """

    Q8F = "Q8F"
    E5M2 = "E5M2"
    E4M3 = "E4M3"
    Q4F = "Q4F"
    E2M1 = "E2M1"
    Q2F = "Q2F"
    Q8S = "Q8S"
    Q4S = "Q4S"
    Q2S = "Q2S"

    @property
    def bits(self) -> int:
        """Width of one value in bits: 8, 4 or 2 (Burn ``size_bits``)."""
        return _VALUE_BITS[self]

    @property
    def range(self) -> tuple[float, float]:
        """The ``(a, b)`` range quantized values are clamped to (Burn ``range``, §3 table)."""
        return _VALUE_RANGES[self]

    @property
    def is_symmetric(self) -> bool:
        """True for ``Q8S``/``Q4S``/``Q2S``; Burn reports every other value as not symmetric."""
        return self in (QuantValue.Q8S, QuantValue.Q4S, QuantValue.Q2S)

    @property
    def is_float(self) -> bool:
        """True for the minifloat codes ``E4M3``, ``E5M2``, ``E2M1``."""
        return self in (QuantValue.E4M3, QuantValue.E5M2, QuantValue.E2M1)

    @property
    def native_packing(self) -> int:
        """Values per native element: 2 for ``E2M1`` (``e2m1x2``), else 1."""
        return 2 if self is QuantValue.E2M1 else 1


_VALUE_BITS = {
    QuantValue.Q8F: 8, QuantValue.Q8S: 8, QuantValue.E4M3: 8, QuantValue.E5M2: 8,
    QuantValue.Q4F: 4, QuantValue.Q4S: 4, QuantValue.E2M1: 4,
    QuantValue.Q2F: 2, QuantValue.Q2S: 2,
}  # fmt: skip
_VALUE_RANGES = {
    QuantValue.Q8F: (-128.0, 127.0),
    QuantValue.Q8S: (-127.0, 127.0),
    QuantValue.Q4F: (-8.0, 7.0),
    QuantValue.Q4S: (-7.0, 7.0),
    QuantValue.Q2F: (-2.0, 1.0),
    QuantValue.Q2S: (-1.0, 1.0),
    QuantValue.E4M3: (-448.0, 448.0),
    QuantValue.E5M2: (-57344.0, 57344.0),
    QuantValue.E2M1: (-6.0, 6.0),
}


class QuantMode(enum.Enum):
    """Burn ``QuantMode``. Only ``Symmetric`` (scale, no zero point) travels in files;
    a ``Lookup`` tensor's table is not part of its bytes (§1.3), so it is refused."""

    Symmetric = "Symmetric"
    Lookup = "Lookup"


class ScaleDtype(enum.Enum):
    """The dtype a scale level stores its scales in (Burn ``ScaleDtype``, §2.3)."""

    F32 = "F32"
    F16 = "F16"
    BF16 = "BF16"
    UE8M0 = "UE8M0"
    UE4M3 = "UE4M3"

    @property
    def nbytes(self) -> int:
        """Bytes per stored scale: 4, 2 or 1 (Burn ``scale_size``, §2.1)."""
        return _SCALE_BYTES[self]

    @property
    def max_representable(self) -> float:
        """The largest finite value of the dtype (Burn ``max_representable``, §4 step 3)."""
        return _SCALE_MAX[self]


_SCALE_BYTES = {ScaleDtype.F32: 4, ScaleDtype.F16: 2, ScaleDtype.BF16: 2, ScaleDtype.UE8M0: 1, ScaleDtype.UE4M3: 1}
_SCALE_MAX = {
    ScaleDtype.F32: 3.4028234663852886e38,
    ScaleDtype.F16: 65504.0,
    ScaleDtype.BF16: 3.3895313892515355e38,  # bits 0x7F7F
    ScaleDtype.UE8M0: 2.0**127,
    ScaleDtype.UE4M3: 448.0,
}


@dataclass(frozen=True, init=False, repr=False)
class QuantStore:
    """How quantized values are stored (Burn ``QuantStore``, §1.3 and §2.2).

    Spelled as in Burn: ``QuantStore.Native``, ``QuantStore.PackedU32(0)``,
    ``QuantStore.PackedNative(0)``. ``dim`` is the packing dimension counted from the innermost
    one (``None`` for ``Native``).

    Attributes:
        kind: ``"Native"``, ``"PackedU32"`` or ``"PackedNative"``.
        dim: the packing dimension for the packed kinds.
    """

    kind: str
    dim: int | None

    KINDS: ClassVar[tuple[str, ...]] = ("Native", "PackedU32", "PackedNative")
    Native: ClassVar["QuantStore"]

    def __init__(self, kind: str, dim: int | None = None):
        if kind not in self.KINDS:
            raise QuantizationError(f"unknown quantization store {kind!r}; Burn has {', '.join(self.KINDS)}")
        if kind == "Native":
            if dim is not None:
                raise QuantizationError("QuantStore.Native takes no packing dim")
        elif not _is_uint(dim):
            raise QuantizationError(f"QuantStore.{kind} needs a packing dim in 0..2^64-1, found {dim!r}")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "dim", None if dim is None else int(dim))

    @staticmethod
    def PackedU32(dim: int = 0) -> "QuantStore":  # noqa: N802 - Burn's variant name
        """Values packed LSB-first into little-endian ``u32`` words along ``dim`` (§2.2)."""
        return QuantStore("PackedU32", dim)

    @staticmethod
    def PackedNative(dim: int = 0) -> "QuantStore":  # noqa: N802 - Burn's variant name
        """Values packed in a native packed type (``e2m1x2``) along ``dim`` (§2.2)."""
        return QuantStore("PackedNative", dim)

    def size_bits(self, value: QuantValue) -> int:
        """Bits of one storage element for ``value`` (Burn ``QuantStore::size_bits``)."""
        if self.kind == "Native":
            return value.bits
        if self.kind == "PackedNative":
            return value.bits * value.native_packing
        return 32

    def to_cbor(self) -> Any:
        """``"Native"`` or ``{"PackedU32": dim}`` / ``{"PackedNative": dim}`` (§1.3)."""
        return self.kind if self.kind == "Native" else {self.kind: self.dim}

    @staticmethod
    def from_cbor(obj: Any) -> "QuantStore":
        """Inverse of :meth:`to_cbor`.

        Raises:
            QuantizationError: for any other value.
        """
        if obj == "Native":
            return QuantStore.Native
        if isinstance(obj, dict) and len(obj) == 1:
            ((kind, dim),) = obj.items()
            if kind in ("PackedU32", "PackedNative") and _is_uint(dim):
                return QuantStore(kind, dim)
        raise QuantizationError(
            f'unknown quantization store {obj!r}: expected "Native", {{"PackedU32": n}} or {{"PackedNative": n}}'
        )

    def __repr__(self) -> str:
        return "QuantStore.Native" if self.kind == "Native" else f"QuantStore.{self.kind}({self.dim})"


QuantStore.Native = QuantStore("Native")


@dataclass(frozen=True, init=False, repr=False)
class BlockSize:
    """The extent of one block, canonical as Burn's ``BlockSize::new`` makes it (§1.3).

    Leading 1s are dropped (``(1, 32)`` is ``(32,)``), at most :attr:`MAX_DIMS` dims remain, and
    the stored form pads unused slots with 1. It is rank-relative: on a tensor of rank ``r`` it
    is left-padded with 1s (:meth:`to_dim_vec`), so ``(32,)`` on a 2-D tensor means blocks of
    ``1 x 32`` along the last axis and ``(32, 1)`` means ``32 x 1`` along axis 0.

    Args:
        dims: an int (one extent, last axis) or a sequence of extents, each in 1..255 (Burn
            stores them as ``u8``).

    Raises:
        QuantizationError: for extents outside 1..255 or more than 5 dims after canonicalizing.
    """

    dims: tuple[int, ...]

    MAX_DIMS: ClassVar[int] = 5
    MAX_EXTENT: ClassVar[int] = 255

    def __init__(self, dims: "int | Iterable[int] | BlockSize"):
        if isinstance(dims, BlockSize):
            values = dims.dims
        else:
            values = (dims,) if isinstance(dims, numbers.Integral) else tuple(dims)
        for extent in values:
            if not (_is_uint(extent) and 1 <= extent <= self.MAX_EXTENT):
                raise QuantizationError(f"block extent {extent!r} is not an integer in 1..{self.MAX_EXTENT}")
        skip = next((i for i, v in enumerate(values) if v != 1), len(values))
        values = tuple(int(v) for v in values[skip:])
        if len(values) > self.MAX_DIMS:
            raise QuantizationError(f"block size {values} has more than {self.MAX_DIMS} dims")
        object.__setattr__(self, "dims", values)

    @property
    def storage(self) -> tuple[int, ...]:
        """The 5 stored slots: :attr:`dims` padded with 1s (Burn ``storage``)."""
        return self.dims + (1,) * (self.MAX_DIMS - len(self.dims))

    def __len__(self) -> int:
        return len(self.dims)

    def to_dim_vec(self, rank: int) -> tuple[int, ...]:
        """The block extent per axis of a rank-``rank`` tensor, left-padded with 1s.

        Mirrors Burn ``to_dim_vec`` exactly, including its truncation when the block has more
        dims than the tensor (then the first ``rank`` extents are used).
        """
        used = min(rank, len(self.dims))
        return (1,) * (rank - used) + self.dims[:used]

    def num_blocks(self, shape: Iterable[int]) -> tuple[int, ...]:
        """Blocks per axis, ``ceil(d / b)``: the shape of the scale grid (Burn ``num_blocks``)."""
        shape = tuple(shape)
        return tuple(-(-d // b) for d, b in zip(shape, self.to_dim_vec(len(shape))))

    def num_elements(self) -> int:
        """Elements in one block."""
        n = 1
        for extent in self.dims:
            n *= extent
        return n

    def to_cbor(self) -> dict:
        """``{"storage": [5 ints], "len": n}`` (§1.3; an array of ints, not a byte string)."""
        return {"storage": list(self.storage), "len": len(self.dims)}

    @staticmethod
    def from_cbor(obj: Any) -> "BlockSize":
        """Inverse of :meth:`to_cbor`; only the canonical form Burn writes is accepted.

        Raises:
            QuantizationError: for a malformed or non-canonical block size.
        """
        if not (isinstance(obj, dict) and set(obj) == {"storage", "len"}):
            raise QuantizationError(f"block size {obj!r} is not a map with keys 'storage' and 'len'")
        storage, length = obj["storage"], obj["len"]
        if not (
            isinstance(storage, list)
            and len(storage) == BlockSize.MAX_DIMS
            and all(_is_uint(v) and v <= 255 for v in storage)
            and _is_uint(length)
            and length <= BlockSize.MAX_DIMS
        ):
            raise QuantizationError(f"block size {obj!r} is not 5 u8 slots and a length of at most 5")
        block = BlockSize(storage[:length])
        if block.to_cbor() != {"storage": storage, "len": length}:
            raise QuantizationError(
                f"block size {obj!r} is not canonical: Burn drops leading 1s and pads unused slots with 1"
            )
        return block

    def __repr__(self) -> str:
        return f"BlockSize({self.dims})"


@dataclass(frozen=True)
class BlockScale:
    """The per-block scale level (Burn ``BlockScale``): one ``dtype`` scale per ``size`` block."""

    size: BlockSize
    dtype: ScaleDtype = ScaleDtype.F32

    def to_cbor(self) -> dict:
        """``{"size": BlockSize, "dtype": ScaleDtype}`` (§1.3)."""
        return {"size": self.size.to_cbor(), "dtype": self.dtype.value}

    @staticmethod
    def from_cbor(obj: Any) -> "BlockScale":
        """Inverse of :meth:`to_cbor`.

        Raises:
            QuantizationError: for a malformed block level.
        """
        if not (isinstance(obj, dict) and set(obj) == {"size", "dtype"}):
            raise QuantizationError(f"block level {obj!r} is not a map with keys 'size' and 'dtype'")
        return BlockScale(BlockSize.from_cbor(obj["size"]), _enum_from_cbor(ScaleDtype, obj["dtype"], "block dtype"))


_SCHEME_FIELDS = ("value", "store", "mode", "tensor", "block")
_OLD_SCHEME_FIELDS = ("param", "level")


@dataclass(frozen=True, init=False)
class QuantScheme:
    """How a float tensor is quantized: Burn's ``QuantScheme`` (§1.3), immutable.

    Per-tensor by default; ``block_size`` makes it per-block with f32 block scales::

        QuantScheme()                                   # Q8S, one f32 scale per tensor
        QuantScheme(QuantValue.Q4S, block_size=32)      # one scale per 32 values of the last axis
        QuantScheme(QuantValue.Q8S, block_size=(32, 1)) # blocks of 32 rows along axis 0
        QuantScheme().per_block(16, ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32)  # two levels

    Schemes made here default to ``store=QuantStore.Native``, as Burn's CPU backends write
    (Burn's own ``QuantScheme::default()`` is :meth:`burn_default`). A scheme with neither level
    set resolves to one f32 scale per tensor; that resolution is not stored, so it is written as
    ``"tensor": null, "block": null`` exactly as Burn writes it.

    Args:
        value: the quantized value type (default ``Q8S``).
        block_size: ``None`` (per-tensor), an int (blocks along the last axis) or a tuple of
            extents (:class:`BlockSize` semantics); gives a block level with f32 scales.
        store: how values are stored (default ``QuantStore.Native``).
        mode: ``QuantMode.Symmetric``.
        tensor: the per-tensor scale level dtype, or ``None``.
        block: the per-block scale level, or ``None``; not together with ``block_size``.

    Raises:
        QuantizationError: for wrong field types or both ``block_size`` and ``block``.
    """

    value: QuantValue
    store: QuantStore
    mode: QuantMode
    tensor: ScaleDtype | None
    block: BlockScale | None

    def __init__(
        self,
        value: QuantValue = QuantValue.Q8S,
        block_size: "int | Iterable[int] | BlockSize | None" = None,
        *,
        store: QuantStore = QuantStore.Native,
        mode: QuantMode = QuantMode.Symmetric,
        tensor: ScaleDtype | None = None,
        block: BlockScale | None = None,
    ):
        if block_size is not None:
            if block is not None:
                raise QuantizationError("give either block_size or block, not both")
            block = BlockScale(BlockSize(block_size), ScaleDtype.F32)
        for name, obj, kind in (
            ("value", value, QuantValue),
            ("store", store, QuantStore),
            ("mode", mode, QuantMode),
        ):
            if not isinstance(obj, kind):
                raise QuantizationError(f"QuantScheme.{name} must be a {kind.__name__}, found {obj!r}")
        if tensor is not None and not isinstance(tensor, ScaleDtype):
            raise QuantizationError(f"QuantScheme.tensor must be a ScaleDtype or None, found {tensor!r}")
        if block is not None and not isinstance(block, BlockScale):
            raise QuantizationError(f"QuantScheme.block must be a BlockScale or None, found {block!r}")
        for name, obj in zip(_SCHEME_FIELDS, (value, store, mode, tensor, block)):
            object.__setattr__(self, name, obj)

    @staticmethod
    def burn_default() -> "QuantScheme":
        """Burn's ``QuantScheme::default()``: Q8F, ``PackedU32(0)``, no level (§1.3)."""
        return QuantScheme(QuantValue.Q8F, store=QuantStore.PackedU32(0))

    # -- copies (one builder convention: with_* / per_* return a new scheme) -------------------

    def with_value(self, value: QuantValue) -> "QuantScheme":
        return dataclasses.replace(self, value=value)

    def with_store(self, store: QuantStore) -> "QuantScheme":
        return dataclasses.replace(self, store=store)

    def with_mode(self, mode: QuantMode) -> "QuantScheme":
        return dataclasses.replace(self, mode=mode)

    def with_block_size(
        self, block_size: "int | Iterable[int] | BlockSize | None", dtype: ScaleDtype | None = None
    ) -> "QuantScheme":
        """A copy with the block level set to ``block_size`` (``None`` removes the level).

        ``dtype`` defaults to the current block dtype, else F32.
        """
        if block_size is None:
            return dataclasses.replace(self, block=None)
        dtype = dtype or (self.block.dtype if self.block else ScaleDtype.F32)
        return dataclasses.replace(self, block=BlockScale(BlockSize(block_size), dtype))

    def with_scale_dtype(self, dtype: ScaleDtype) -> "QuantScheme":
        """A copy whose innermost scale level stores ``dtype`` (the block level if present,
        else the per-tensor level, which is then written explicitly)."""
        if self.block is not None:
            return dataclasses.replace(self, block=BlockScale(self.block.size, dtype))
        return dataclasses.replace(self, tensor=dtype)

    def per_tensor(self, dtype: ScaleDtype = ScaleDtype.F32) -> "QuantScheme":
        """A copy with the per-tensor level set (Burn ``per_tensor``); with a block level too,
        this is the global scale of a two-level scheme."""
        return dataclasses.replace(self, tensor=dtype)

    def per_block(
        self, block_size: "int | Iterable[int] | BlockSize", dtype: ScaleDtype = ScaleDtype.F32
    ) -> "QuantScheme":
        """A copy with the per-block level set (Burn ``per_block``)."""
        return dataclasses.replace(self, block=BlockScale(BlockSize(block_size), dtype))

    # -- resolution (Burn scheme.rs, §1.3) ---------------------------------------------------

    @property
    def block_size(self) -> BlockSize | None:
        """The block level's size, ``None`` for per-tensor quantization."""
        return self.block.size if self.block else None

    def tensor_scale(self) -> ScaleDtype | None:
        """The per-tensor level; a scheme storing no level resolves to F32 here."""
        if self.tensor is None and self.block is None:
            return ScaleDtype.F32
        return self.tensor

    def block_scale(self) -> BlockScale | None:
        return self.block

    def scale_dtype(self) -> ScaleDtype:
        """The innermost level's dtype, the one the scales region is stored in: the block
        dtype, else the tensor dtype, else F32 (§1.3)."""
        if self.block is not None:
            return self.block.dtype
        return self.tensor or ScaleDtype.F32

    def global_scale_dtype(self) -> ScaleDtype | None:
        """The dtype of the global (second-level) scale; set only when both levels are."""
        return self.tensor if self.block is not None else None

    @property
    def is_two_level(self) -> bool:
        return self.block is not None and self.tensor is not None

    def num_levels(self) -> int:
        return (self.block_scale() is not None) + (self.tensor_scale() is not None)

    def size_bits_stored(self) -> int:
        """Bits per storage element (Burn ``size_bits_stored``)."""
        return self.store.size_bits(self.value)

    def num_quants(self) -> int:
        """Values per storage element (Burn ``num_quants``)."""
        return self.size_bits_stored() // self.value.bits

    # -- CBOR ------------------------------------------------------------------------------

    def to_cbor(self) -> dict:
        """The Python value cbor2 encodes to Burn's bytes for this scheme (§1.3).

        All five fields, in Burn's declaration order; unset levels are ``None`` (CBOR null).
        The burnpack dtype wraps it as ``{"QFloat": scheme.to_cbor()}``.
        """
        return {
            "value": self.value.value,
            "store": self.store.to_cbor(),
            "mode": self.mode.value,
            "tensor": None if self.tensor is None else self.tensor.value,
            "block": None if self.block is None else self.block.to_cbor(),
        }

    @staticmethod
    def from_cbor(obj: Any) -> "QuantScheme":
        """Inverse of :meth:`to_cbor`, strict about what it accepts.

        Raises:
            QuantizationError: for the pre-2026-08 layout (keys ``param``/``level``, §6.4),
                ``Lookup`` mode (§1.3), unknown keys or variants, and malformed values.
        """
        if not isinstance(obj, dict):
            raise QuantizationError(f"a quantization scheme is a map, found {obj!r}")
        old = [k for k in _OLD_SCHEME_FIELDS if k in obj]
        if old:
            raise QuantizationError(
                f"quantization scheme has the keys {', '.join(map(repr, old))} of Burn's format before "
                "2026-08 (QuantLevel), whose scale layout differs; re-save the model with a current Burn"
            )
        unknown = [k for k in obj if k not in _SCHEME_FIELDS]
        if unknown:
            raise QuantizationError(
                f"quantization scheme has unknown keys {', '.join(map(repr, unknown))}; expected "
                f"{', '.join(_SCHEME_FIELDS)}"
            )
        missing = [k for k in ("value", "store", "mode") if k not in obj]
        if missing:
            raise QuantizationError(f"quantization scheme lacks {', '.join(map(repr, missing))}")
        mode = _enum_from_cbor(QuantMode, obj["mode"], "mode")
        if mode is QuantMode.Lookup:
            raise QuantizationError(
                "quantization mode Lookup is not supported: its lookup table is not stored with the tensor"
            )
        tensor = obj.get("tensor")
        block = obj.get("block")
        return QuantScheme(
            _enum_from_cbor(QuantValue, obj["value"], "value"),
            store=QuantStore.from_cbor(obj["store"]),
            mode=mode,
            tensor=None if tensor is None else _enum_from_cbor(ScaleDtype, tensor, "tensor dtype"),
            block=None if block is None else BlockScale.from_cbor(block),
        )

    def describe(self) -> str:
        """A short human form for messages, e.g. ``Q4S Native per-block (32,) F32``."""
        if self.block is None:
            level = f"per-tensor {self.scale_dtype().value}"
        else:
            level = f"per-block {self.block.size.dims} {self.block.dtype.value}"
            if self.tensor is not None:
                level += f" + global {self.tensor.value}"
        return f"{self.value.value} {self.store!r} {level}".replace("QuantStore.", "")


def _enum_from_cbor(kind: type[enum.Enum], obj: Any, what: str):
    if isinstance(obj, str):
        try:
            return kind(obj)
        except ValueError:
            pass
    names = ", ".join(member.value for member in kind)
    raise QuantizationError(f"unknown {what} {obj!r}; Burn's {kind.__name__} is one of {names}")


def _is_uint(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and 0 <= x <= U64_MAX
