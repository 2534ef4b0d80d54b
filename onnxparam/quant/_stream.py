"""Quantizing weights larger than memory allows: one weight at a time, in chunks, codes on disk.

A quantized module keeps each quantized param's codes (its ``QuantizedTensor``) once computed,
and the export keeps each weight's ONNX layout until the file is written: a model's worth of
int8 codes, twice, in anonymous memory. For a large model (:func:`streaming`, set by
:func:`onnxparam.export_onnx` for modules whose quantized params hold at least
:data:`AUTO_STREAM_BYTES` of float data, and by ``onnxparam quantize`` in the output's folder):

* :func:`quantize_chunked`: a per-tensor scheme (Burn's MinMax) reads the float weight (a
  memory map of the source file) in chunks of :data:`CHUNK_ELEMENTS` twice: ``max |x|``, then the
  codes; bit for bit :func:`onnxparam.core.tensor.quantize` (same scale, same rounding), without
  its full-size float temporaries. A blocked scheme (4-bit blocks along K) is quantized by
  ``quantize`` itself, slab by slab of whole blocks along axis 0. Per-channel weights (one
  scale per output channel: every row is read for each scale) are quantized whole, their codes
  spilled after (:func:`spill_codes`);
* :func:`spilled`: codes of at least :data:`SPILL_BYTES` go to a scratch file in the folder
  (removed at once; the open map keeps its bytes until the array is freed) and are read back
  through a read-only memory map: file-backed pages, which the kernel writes out and drops under
  memory pressure, not anonymous memory. The writer then copies them into the output one tensor at
  a time (:mod:`onnxparam.onnx_io._ir_stream`, or external data).

Outside :func:`streaming` nothing is spilled; :func:`quantize_chunked` still bounds the float
temporaries of large weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["AUTO_STREAM_BYTES", "CHUNK_ELEMENTS", "SPILL_BYTES", "quantize_chunked", "spilled", "spill_codes",
           "streaming", "offset_codes"]

CHUNK_ELEMENTS = 1 << 21
"""Elements per step of :func:`quantize_chunked` (8 MiB of float32 at a time)."""

SPILL_BYTES = 1 << 20
"""Arrays of at least this many bytes are spilled to a scratch file under :func:`streaming`."""

AUTO_STREAM_BYTES = 256 << 20
"""``export_onnx`` streams a module whose quantized params hold at least this many float bytes."""

_FOLDER: contextvars.ContextVar = contextvars.ContextVar("onnxparam_quant_spill_folder", default=None)


@contextlib.contextmanager
def streaming(folder):
    """Spill large codes into scratch files in ``folder`` (module docstring) inside the block."""
    token = _FOLDER.set(Path(folder))
    try:
        yield
    finally:
        _FOLDER.reset(token)


def streaming_folder():
    """The folder of the enclosing :func:`streaming` block, or ``None``."""
    return _FOLDER.get()


def _scratch(shape, dtype) -> np.ndarray:
    """A writable array of ``shape`` / ``dtype``: a map of a removed scratch file under
    :func:`streaming` when large, else ``np.empty``."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    folder = _FOLDER.get()
    if folder is None or nbytes < SPILL_BYTES:
        return np.empty(shape, dtype)
    try:
        folder.mkdir(parents=True, exist_ok=True)  # NOTE: the output's folder; the save makes it anyway
        fd, name = tempfile.mkstemp(prefix=".onnxparam-codes-", suffix=".tmp", dir=os.fspath(folder))
    except OSError:  # a folder that cannot take a scratch file: the system's temporary folder
        fd, name = tempfile.mkstemp(prefix=".onnxparam-codes-", suffix=".tmp")
    try:
        # NOTE: blocks reserved now: writing into a map of a sparse file on a full disk is a SIGBUS
        os.posix_fallocate(fd, 0, nbytes)
        with open(fd, "r+b", closefd=False) as f:
            array = np.memmap(f, dtype=dtype, mode="r+", shape=tuple(shape))
    except OSError:  # a full disk: in memory after all
        array = np.empty(shape, dtype)
    finally:
        os.close(fd)
        os.unlink(name)  # NOTE: the map keeps the bytes; nothing is left behind, even on a crash
    return array


def spilled(array: np.ndarray) -> np.ndarray:
    """``array``, or under :func:`streaming` when large, a read-only memory-mapped copy of it in a
    scratch file (copied in chunks)."""
    array = np.asarray(array)
    if _FOLDER.get() is None or array.nbytes < SPILL_BYTES or isinstance(array, np.memmap):
        return array
    out = _scratch(array.shape, array.dtype)
    flat_in, flat_out = array.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, CHUNK_ELEMENTS):
        flat_out[start:start + CHUNK_ELEMENTS] = flat_in[start:start + CHUNK_ELEMENTS]
    return _read_only(out)


def _read_only(array: np.ndarray) -> np.ndarray:
    if isinstance(array, np.memmap):
        array.flush()
    array.flags.writeable = False
    return array


def offset_codes(values: np.ndarray, offset: int, np_dtype) -> np.ndarray:
    """``(values + offset)`` as ``np_dtype`` (int8 codes to the unsigned layout), in chunks into
    a :func:`spilled`-style array when large; the same bytes as ``(values.astype(int16) + offset)
    .astype(np_dtype)``."""
    values = np.asarray(values)
    if values.size < CHUNK_ELEMENTS and _FOLDER.get() is None:
        return (values.astype(np.int16) + offset).astype(np_dtype)
    out = _scratch(values.shape, np_dtype)
    flat_in, flat_out = values.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, CHUNK_ELEMENTS):
        flat_out[start:start + CHUNK_ELEMENTS] = (flat_in[start:start + CHUNK_ELEMENTS].astype(np.int16)
                                                  + offset).astype(np_dtype)
    return _read_only(out)


def spill_codes(qt):
    """``qt`` (a ``QuantizedTensor`` quantized whole: a blocked or per-channel scheme) with its
    codes :func:`spilled` under :func:`streaming` (the same values), else ``qt`` itself."""
    if _FOLDER.get() is None or np.asarray(qt.values).nbytes < SPILL_BYTES:
        return qt
    from ..core.tensor import QuantizedTensor

    return QuantizedTensor(qt.shape, qt.scheme, spilled(qt.values), qt.scales, qt.global_scale,
                           axis=getattr(qt, "axis", None))


def quantize_chunked(array, quantizer, axis):
    """``quantizer.quantize(array, axis)`` read in chunks (module docstring), or ``None`` when
    this does not apply (a small array, a two-level or per-channel scheme, blocks that do not
    divide the shape, a value that is not finite: the caller then quantizes the whole array,
    which raises the usual error)."""
    from ..core.tensor import QuantizedTensor, quantize, round_half_away_from_zero

    x = np.asarray(array)
    scheme = quantizer.scheme
    if (x.size < CHUNK_ELEMENTS or x.dtype.kind != "f" or scheme.is_two_level
            or (quantizer.per_channel and x.ndim >= 2)):
        return None
    if scheme.block is not None:
        return _blocked_chunked(x, scheme)
    flat = x.reshape(-1)
    zero = x.dtype.type(0)
    alpha = zero
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[start:start + CHUNK_ELEMENTS]
        if not np.isfinite(chunk).all():
            return None
        alpha = np.fmax(alpha, np.fmax.reduce(np.abs(chunk), initial=zero))
    # NOTE: the scale of the whole array is the scale of its max |x| alone (Burn's MinMax reads
    # only that): quantize() computes it, so the float arithmetic is the same
    scales = quantize(np.array([alpha], dtype=x.dtype), scheme).scales
    divisor = np.float32(np.asarray(scales, np.float32).reshape(-1)[0])
    a, b = scheme.value.range
    codes = _scratch(x.shape, np.int8)
    out = codes.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for start in range(0, flat.size, CHUNK_ELEMENTS):
            q = round_half_away_from_zero(flat[start:start + CHUNK_ELEMENTS].astype(np.float32) / divisor)
            q = np.where(np.isnan(q), np.float32(0), np.clip(q, a, b))
            out[start:start + CHUNK_ELEMENTS] = q.astype(np.int8)
    return QuantizedTensor(x.shape, scheme, _read_only(codes), scales, None)


def _blocked_chunked(x: np.ndarray, scheme):
    """A one-level blocked scheme, quantized by :func:`onnxparam.core.tensor.quantize` itself on
    slabs of whole blocks along axis 0 (no block crosses a slab, so each slab's scales and codes
    are the whole tensor's), or ``None`` (blocks that do not divide the shape, a value that is not
    finite: the caller quantizes the whole array and raises the usual error)."""
    from ..core.tensor import QuantizedTensor, quantize

    if x.ndim == 0 or len(scheme.block.size.dims) > x.ndim:
        return None
    extents = scheme.block.size.to_dim_vec(x.ndim)
    if any(d % b for d, b in zip(x.shape, extents)):
        return None
    row = max(1, x.size // max(1, x.shape[0]))
    step = max(1, CHUNK_ELEMENTS // (row * extents[0])) * extents[0]
    codes = _scratch(x.shape, np.int8)
    scales = []
    for start in range(0, x.shape[0], step):
        slab = x[start:start + step]
        if not np.isfinite(slab).all():
            return None
        part = quantize(slab, scheme)
        codes[start:start + step] = part.values
        scales.append(np.asarray(part.scales, np.float32))
    return QuantizedTensor(x.shape, scheme, _read_only(codes), spilled(np.concatenate(scales, axis=0)), None)
