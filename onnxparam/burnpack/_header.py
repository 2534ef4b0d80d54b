"""The fixed numbers of the burnpack container (``docs/burnpack.md`` §0; Burn ``burn-pack/src/base.rs``)."""

from __future__ import annotations

import struct

__all__ = [
    "MAGIC",
    "MAGIC_BYTES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "ALIGNMENT",
    "MAX_METADATA_BYTES",
    "MAX_TENSORS",
    "MAX_TENSOR_BYTES",
    "MAX_CBOR_DEPTH",
    "pack_header",
    "unpack_header",
    "align",
    "data_section_start",
]

MAGIC = 0x4255524E
"""``u32`` magic, little-endian on disk: bytes ``4E 52 55 42`` ("NRUB")."""
MAGIC_BYTES = MAGIC.to_bytes(4, "little")
FORMAT_VERSION = 1
"""The only version Burn has written; readers refuse versions above it (§6.1)."""
HEADER_SIZE = 10
"""``u32`` magic + ``u16`` version + ``u32`` metadata size."""
ALIGNMENT = 256
"""Every tensor starts on a multiple of 256 bytes from the data section start, so a mapped file
gives aligned zero-copy arrays for any dtype (and GPU-friendly staging); since Burn 272ca0b4a."""
MAX_METADATA_BYTES = 100 * 1024 * 1024
"""Burn's reader refuses larger metadata (a DoS guard); so do we, before allocating it."""
MAX_TENSORS = 100_000
"""Burn's reader refuses more tensors than this."""
MAX_TENSOR_BYTES = 10 * 1024**3
"""Burn's reader refuses a tensor larger than 10 GiB."""
MAX_CBOR_DEPTH = 128
"""Burn decodes the metadata with ciborium's recursion limit set to 128 nested containers."""

_HEADER = struct.Struct("<IHI")


def pack_header(metadata_size: int, version: int = FORMAT_VERSION) -> bytes:
    """The 10 header bytes."""
    return _HEADER.pack(MAGIC, version, metadata_size)


def unpack_header(raw: bytes) -> tuple[int, int, int]:
    """``(magic, version, metadata_size)`` of exactly :data:`HEADER_SIZE` bytes."""
    return _HEADER.unpack(raw)


def align(offset: int) -> int:
    """The smallest multiple of :data:`ALIGNMENT` that is at least ``offset``."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def data_section_start(metadata_size: int) -> int:
    """Where the data section begins: header + metadata, rounded up to :data:`ALIGNMENT`."""
    return align(HEADER_SIZE + metadata_size)
