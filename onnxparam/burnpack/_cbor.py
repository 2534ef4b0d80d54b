"""CBOR as Burn writes it (ciborium 0.2.2) and a bounded, validating decode.

Encoding goes through cbor2, except for floats. cbor2 already writes what ciborium writes
for the types burnpack uses: definite lengths, shortest integer heads, text keys in the order
the dict holds them. Floats differ: cbor2 writes every float as f64 unless ``canonical=True``,
and canonical mode also re-sorts map keys (which would break Burn's struct field order) and
writes every NaN as ``f9 7e00``. ciborium writes the shortest of f16/f32/f64 that keeps the f64
*bits* (``ciborium-ll/src/hdr.rs``), so ``-0.0`` stays ``f9 8000`` and a NaN keeps its sign;
:func:`ciborium_float` does that (``docs/burnpack.md`` §1.1, §5).

Decoding first walks the raw bytes (:func:`_scan`): item heads only, no allocation, so a hostile
file is refused before cbor2 builds anything. The walk enforces nesting depth, definite lengths,
no tags, no simple values other than false/true/null, unique text map keys, declared lengths
that fit in the bytes present, and the tensor count. cbor2 then decodes the checked bytes.
"""

from __future__ import annotations

import struct

import cbor2

from ._header import MAX_CBOR_DEPTH, MAX_TENSORS

__all__ = ["dumps", "loads", "CborError"]

_F64_QUIET_BIT = 1 << 51
_F64_MANTISSA_MASK = (1 << 52) - 1
_F16_DROPPED_BITS = 42  # f64 mantissa bits an f16 lacks
_F32_DROPPED_BITS = 29  # f64 mantissa bits an f32 lacks


class CborError(ValueError):
    """The metadata bytes are not the CBOR Burn writes; the message says where and why."""


def ciborium_float(value: float) -> bytes:
    """The CBOR bytes ciborium writes for an ``f64``: the shortest of f16/f32/f64 keeping its bits."""
    value = float(value)
    if value != value:  # NaN: keep sign and payload the way half/f32 conversions would
        bits = struct.unpack(">Q", struct.pack(">d", value))[0]
        mantissa = bits & _F64_MANTISSA_MASK
        if mantissa & _F64_QUIET_BIT and not mantissa & ((1 << _F16_DROPPED_BITS) - 1):
            head = (bits >> 63) << 15 | 0x7C00 | mantissa >> _F16_DROPPED_BITS
            return b"\xf9" + head.to_bytes(2, "big")
        if mantissa & _F64_QUIET_BIT and not mantissa & ((1 << _F32_DROPPED_BITS) - 1):
            head = (bits >> 63) << 31 | 0x7F800000 | mantissa >> _F32_DROPPED_BITS
            return b"\xfa" + head.to_bytes(4, "big")
        return b"\xfb" + bits.to_bytes(8, "big")
    for head, fmt in ((b"\xf9", ">e"), (b"\xfa", ">f")):
        try:
            packed = struct.pack(fmt, value)
        except OverflowError:
            continue
        if struct.unpack(fmt, packed)[0] == value:  # lossless; struct keeps the sign of zero
            return head + packed
    return b"\xfb" + struct.pack(">d", value)


class _Float:
    """A float cbor2 must not encode itself: it goes through :func:`_encode_default`."""

    __slots__ = ("value",)

    def __init__(self, value: float):
        self.value = value


def _encode_default(encoder, value) -> None:
    if isinstance(value, _Float):
        encoder.write(ciborium_float(value.value))
        return
    raise TypeError(f"cannot encode {type(value).__name__} in burnpack metadata")


def _wrap_floats(obj):
    if isinstance(obj, float):
        return _Float(obj)
    if isinstance(obj, dict):
        return {k: _wrap_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_wrap_floats(v) for v in obj]
    return obj


def dumps(obj) -> bytes:
    """Encode ``obj`` (dicts, lists, str, int, float, bool, None) as ciborium would.

    Dict keys are written in the dict's order: callers order them as Burn does (struct
    declaration order, or sorted for Rust ``BTreeMap``\\ s).
    """
    # NOTE: floats are wrapped and written through `default` rather than cbor2's `encoders`
    # override, which cbor2 5.x (allowed by the package's requirements) does not have.
    return cbor2.dumps(_wrap_floats(obj), default=_encode_default)


# -- decoding ----------------------------------------------------------------------------------

_MAJOR_UINT, _MAJOR_NINT, _MAJOR_BYTES, _MAJOR_TEXT, _MAJOR_ARRAY, _MAJOR_MAP, _MAJOR_TAG, _MAJOR_SIMPLE = range(8)
_ARG_BYTES = {24: 1, 25: 2, 26: 4, 27: 8}
_SIMPLE_OK = {20, 21, 22}  # false, true, null
_FLOAT_BYTES = {25: 2, 26: 4, 27: 8}


def _scan(buf: bytes) -> int:
    """Walk one CBOR item from the start of ``buf``; return where it ends.

    Only item heads are read and nothing is allocated per declared length, so this is safe on
    hostile input. Map keys must be text (as every Burn map's are) and unique within their map.

    Raises:
        CborError: for anything outside the subset Burn writes, or lengths past the end.
    """
    n = len(buf)
    pos = 0
    # per open container: [items still to read, keys seen so far (a set) or None for an array]
    stack: list[list] = []
    top_key: str | None = None
    while True:
        if pos >= n:
            raise CborError(f"CBOR ends early at byte {pos} of {n}")
        start = pos
        initial = buf[pos]
        major, info = initial >> 5, initial & 0x1F
        pos += 1
        if major == _MAJOR_SIMPLE:
            if info in _FLOAT_BYTES:
                pos += _FLOAT_BYTES[info]
            elif info == 31:
                raise CborError(f"indefinite-length CBOR (break byte) at byte {start}: Burn writes definite lengths")
            elif info not in _SIMPLE_OK:
                raise CborError(f"CBOR simple value {info} at byte {start} is not false, true, null or a float")
            arg = 0
        elif info < 24:
            arg = info
        elif info in _ARG_BYTES:
            size = _ARG_BYTES[info]
            if pos + size > n:
                raise CborError(f"CBOR ends early at byte {n} inside the item at byte {start}")
            arg = int.from_bytes(buf[pos : pos + size], "big")
            pos += size
        elif info == 31:
            raise CborError(f"indefinite-length CBOR item at byte {start}: Burn writes definite lengths")
        else:
            raise CborError(f"malformed CBOR head 0x{initial:02x} at byte {start}")
        if pos > n:
            raise CborError(f"CBOR ends early at byte {n} inside the item at byte {start}")

        at_key = bool(stack) and stack[-1][1] is not None and stack[-1][0] % 2 == 0
        if at_key and major != _MAJOR_TEXT:
            raise CborError(f"map key at byte {start} is not text: Burn's maps have text keys")
        if major == _MAJOR_TAG:
            raise CborError(f"CBOR tag {arg} at byte {start}: burnpack metadata uses no tags")
        if major in (_MAJOR_BYTES, _MAJOR_TEXT):
            if arg > n - pos:
                raise CborError(f"string at byte {start} declares {arg} bytes, only {n - pos} remain")
            if at_key:
                key = bytes(buf[pos : pos + arg])
                if key in stack[-1][1]:
                    raise CborError(f"duplicate map key {key.decode('utf-8', 'replace')!r} at byte {start}")
                stack[-1][1].add(key)
                if len(stack) == 1:
                    top_key = key.decode("utf-8", "replace")
            pos += arg
        if major in (_MAJOR_ARRAY, _MAJOR_MAP):
            if len(stack) >= MAX_CBOR_DEPTH:
                raise CborError(f"CBOR nesting at byte {start} is deeper than {MAX_CBOR_DEPTH} levels")
            if not stack and major != _MAJOR_MAP:
                raise CborError("the metadata is not a CBOR map")
            if len(stack) == 1 and top_key == "tensors" and major == _MAJOR_MAP and arg > MAX_TENSORS:
                raise CborError(f"the tensors map declares {arg} tensors, more than the limit of {MAX_TENSORS}")
            items = arg * 2 if major == _MAJOR_MAP else arg
            if items > n - pos:  # every item takes at least one byte
                raise CborError(f"container at byte {start} declares {items} items, only {n - pos} bytes remain")
            if items:
                stack.append([items, set() if major == _MAJOR_MAP else None])
                continue
        elif not stack:
            raise CborError("the metadata is not a CBOR map")
        # one complete item: count it off its containers
        while stack:
            stack[-1][0] -= 1
            if stack[-1][0]:
                break
            stack.pop()
        if not stack:
            return pos


def loads(buf: bytes):
    """Decode burnpack metadata bytes into Python objects, bounded and strict.

    :func:`_scan` is the gate: once it passes, the bytes hold only definite-length maps with
    unique text keys, arrays, strings, integers, floats, booleans and null, nested at most
    :data:`MAX_CBOR_DEPTH` deep, so cbor2 decodes them without options (any cbor2 >= 5).

    Raises:
        CborError: for malformed or disallowed CBOR, trailing bytes, or too many tensors.
    """
    end = _scan(buf)
    if end != len(buf):
        raise CborError(f"{len(buf) - end} bytes follow the metadata map inside the declared metadata size")
    try:
        return cbor2.loads(bytes(buf))
    except (cbor2.CBORError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise CborError(f"invalid CBOR: {e}") from e
