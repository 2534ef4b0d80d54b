"""Tensor bytes that move from one weight file to another unchanged, copied by the kernel.

A conversion that neither casts nor transposes a tensor writes exactly the bytes the source file
holds (burnpack, safetensors, inline ONNX ``raw_data`` and ``torch.save`` storages are all
row-major little-endian). Reading them through a map and writing them back costs a page fault
per 4 KiB page and a copy through user space; :func:`copy_range` instead asks the kernel to copy
the file range into the target (``copy_file_range(2)``, else ``sendfile(2)``, else ``pread`` /
``write`` in bounded chunks), which is what ``shutil.copyfile`` does for a whole file.

A writer receives a :class:`FileRange` where it would receive the tensor's data
(:func:`file_range_of` finds one on a tensor object) and still checks its byte count against
the dtype and shape it declares.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import RecordError

__all__ = ["FileRange", "copy_range", "file_range_of", "COPY_MIN_BYTES"]

COPY_MIN_BYTES = 256 * 1024
"""Tensors smaller than this go through the ordinary buffered write: a kernel copy is one
flush and a few system calls, which pays off only once a tensor spans many pages."""

_CHUNK_BYTES = 1 << 30
"""Largest count asked of one kernel call (they may copy less; the loop continues)."""
_FALLBACK_CHUNK_BYTES = 16 << 20
"""``pread`` / ``write`` chunk when the kernel calls are unavailable: bounded memory."""
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF,
                   errno.EPERM, errno.ENOTSOCK}
"""Errors meaning "this kernel call cannot copy between these files" (another file system, an
old kernel, macOS's socket-only sendfile): the next way is tried."""


@dataclass(frozen=True)
class FileRange:
    """``nbytes`` bytes of the file ``path`` starting at byte ``offset``: a tensor's data exactly
    as the target stores it (row-major, little-endian)."""

    path: str
    offset: int
    nbytes: int


def file_range_of(item: Any) -> Optional[FileRange]:
    """The :class:`FileRange` an item offers (an attribute or zero-argument method
    ``file_range``), or ``None``: then its data is written the ordinary way."""
    found = getattr(item, "file_range", None)
    if callable(found):
        found = found()
    if isinstance(found, FileRange) and found.nbytes >= COPY_MIN_BYTES:
        return found
    return None


def copy_range(out, source: FileRange) -> None:
    """Append ``source``'s bytes to the binary file object ``out`` (flushed first; its position
    is the end of the file afterwards).

    Raises:
        RecordError: the source file is missing or shorter than the range (it changed since it
            was read), naming it.
        OSError: writing failed (a full disk: ``ENOSPC``).
    """
    out.flush()
    dst = out.fileno()
    try:
        src = os.open(source.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise RecordError(f"'{source.path}': cannot read the source's tensor bytes ({e.strerror or e})") from e
    try:
        size = os.fstat(src).st_size
        if source.offset + source.nbytes > size:
            raise RecordError(f"'{source.path}': {source.nbytes} bytes at byte {source.offset} lie past its end "
                              f"({size} bytes); the file changed while it was converted")
        _copy(src, dst, source.offset, source.nbytes)
    finally:
        os.close(src)
    out.seek(0, os.SEEK_END)


def _copy(src: int, dst: int, offset: int, count: int) -> None:
    for kernel_copy in (_copy_file_range, _sendfile):
        try:
            copied = kernel_copy(src, dst, offset, count)
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
            continue
        offset, count = offset + copied, count - copied
        if count == 0:
            return
    while count:  # NOTE: the kernel calls copied part or nothing: finish through user space
        chunk = _pread(src, min(count, _FALLBACK_CHUNK_BYTES), offset)
        if not chunk:
            raise RecordError(f"the source ended {count} bytes early at byte {offset}")
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
        offset, count = offset + len(chunk), count - len(chunk)


def _pread(fd: int, count: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, count, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # NOTE: Windows has no pread
    return os.read(fd, count)


def _copy_file_range(src: int, dst: int, offset: int, count: int) -> int:
    """Bytes copied (all of ``count`` unless the source ends early: then fewer)."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        raise OSError(errno.ENOSYS, "copy_file_range is not available")
    return _in_chunks(lambda done, n: copy(src, dst, n, offset_src=offset + done), count)


def _sendfile(src: int, dst: int, offset: int, count: int) -> int:
    send = getattr(os, "sendfile", None)
    if send is None:
        raise OSError(errno.ENOSYS, "sendfile is not available")
    return _in_chunks(lambda done, n: send(dst, src, offset + done, n), count)


def _in_chunks(step, count: int) -> int:
    """Bytes moved by calling the kernel copy ``step(done, n)`` (``n`` at most
    :data:`_CHUNK_BYTES`) until ``count`` are copied, the source ends (a call copies 0) or a later
    call fails; a failing first call raises its ``OSError`` (the caller then tries the next way)."""
    done = 0
    while done < count:
        try:
            n = step(done, min(count - done, _CHUNK_BYTES))
        except OSError:
            if done == 0:
                raise
            break  # NOTE: what was copied stays; the caller finishes the rest another way
        if n == 0:
            break
        done += n
    return done
