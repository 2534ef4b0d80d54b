"""Burn's burnpack (``.bpk``) format, version 1: bytes in, bytes out, byte-compatible with Burn.

This is the *format* layer. It reads and writes tensors, metadata and scalars, and knows
nothing of modules or params (bridges such as records do that). Section numbers (§) refer to
``docs/burnpack.md``, the repository's note on Burn's ``burn-pack`` format.

Byte layout (all integers little-endian)::

    offset 0          4        6              10
           +----------+--------+---------------+
           | magic    | version| metadata_size |   header, HEADER_SIZE = 10 bytes
           | 4E525542 | 01 00  | u32           |   magic 0x4255524E reads "NRUB" on disk
           +----------+--------+---------------+
    10     | metadata: metadata_size bytes of CBOR (ciborium's encoding, §1)          |
           |   {"tensors": {name: {"dtype", "shape", "data_offsets", "param_id"}},   |
           |    "metadata": {text: text}, "scalars": {name: {"Int"|...: value}}}      |
           +---------------------------------------------------------------------------+
           | zeros up to data_start = ceil((10 + metadata_size) / 256) * 256          |
    data_start
           +---------------------------------------------------------------------------+
           | tensor bytes, each starting at a multiple of ALIGNMENT = 256 relative to  |
           | data_start (zeros between), laid out in the writer's order (module        |
           | traversal order), while the CBOR map is sorted by name. The file ends at  |
           | the last tensor's end. data_offsets = [start, end) relative to data_start.|
           +---------------------------------------------------------------------------+

Why: the header is fixed-size so a reader learns the metadata size in one read; the metadata
precedes the data so a writer must plan offsets before streaming; 256-byte alignment lets a
memory-mapped file hand out aligned zero-copy arrays. A quantized (``QFloat``) tensor's bytes
are values, then scales, then an optional global scale (§2; :mod:`onnxparam.quant`).

Public API::

    import onnxparam.burnpack as bp
    with bp.read("model.bpk") as f:             # validated, lazy, memory-mapped
        for entry in f.tensors.values():        # data order
            entry.name, entry.dtype, entry.shape, entry.param_id, entry.to_numpy()
    bp.write("copy.bpk", f.tensors.values(), metadata=f.metadata, scalars=f.scalars)

Reading then writing a Burn-written file reproduces it byte for byte.
"""

from ._header import (
    ALIGNMENT,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_CBOR_DEPTH,
    MAX_METADATA_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
)
from ._metadata import BOOL_STORES, SCALAR_KINDS, Scalar
from ._reader import BurnpackEntry, BurnpackFile, read
from ._writer import TensorEntry, write

__all__ = [
    "read",
    "write",
    "BurnpackFile",
    "BurnpackEntry",
    "TensorEntry",
    "Scalar",
    "SCALAR_KINDS",
    "BOOL_STORES",
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "ALIGNMENT",
    "MAX_METADATA_BYTES",
    "MAX_TENSORS",
    "MAX_TENSOR_BYTES",
    "MAX_CBOR_DEPTH",
]
