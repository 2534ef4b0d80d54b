"""A memory-mapped file that notices when it is changed in place: shared by the burnpack and
safetensors readers (formats layer).

A file's tensors are zero-copy ``np.frombuffer`` views of one read-only ``mmap``; a
:class:`MappedFile` owns the mapping and a :class:`FileWatch`, and checks the watch every time
it hands out the buffer.
"""

from __future__ import annotations

import mmap
import os
import weakref

__all__ = ["FileWatch", "MappedFile"]


class FileWatch:
    """The identity of a memory-mapped file when it was opened, checked before each tensor read.

    NOTE: a mapping shows the file's *current* bytes. A file overwritten in place after it was
    mapped (``cp other.bpk ckA.bpk``, an editor saving over it) makes later reads return the
    other file's bytes, silently; a file truncated in place makes a read past its new end kill
    the process with SIGBUS. So the reader keeps a (non-inheritable) duplicate of the file
    descriptor it mapped and, before handing out any tensor bytes, ``fstat``s it (one system
    call, no hashing): a size or modification time that differs from the one seen when the
    file was opened raises. The descriptor follows the mapped file itself, not its path: an
    atomic replacement (write beside, then rename over it, as this library's writers do) or a
    deletion leaves the mapped file, and the mapping, untouched, so reads go on silently and
    return what was loaded. The descriptor is closed with the mapping (or when garbage collected).

    Arrays handed out earlier are zero-copy views of the mapping: nothing can check *their*
    reads. A value already read before the file was changed in place shows the new bytes (or
    SIGBUS); copy it (``np.array(a)``) to keep it independent of the file.
    """

    __slots__ = ("label", "fd", "size", "mtime_ns", "ino", "dev", "_release", "__weakref__")

    def __init__(self, label: str, fd: int, st: os.stat_result):
        self.label = label
        self.size, self.mtime_ns, self.ino, self.dev = st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev
        self.fd = os.dup(fd)
        self._release = weakref.finalize(self, os.close, self.fd)

    def check(self, error: type) -> None:
        """Raise ``error`` when the mapped file changed since it was opened."""
        try:
            st = os.fstat(self.fd)
        except OSError as e:
            raise error(f"cannot check '{self.label}' before reading it: {e.strerror or e}") from e
        if st.st_size != self.size:
            change = f"size {self.size} -> {st.st_size} bytes"
        elif st.st_mtime_ns != self.mtime_ns:
            change = "modified in place, same size"
        else:
            return
        raise error(
            f"'{self.label}' changed on disk after it was opened ({change}); its tensors can no longer be "
            "read safely: load the file again"
        )

    def close(self) -> None:
        self._release()


class MappedFile:
    """The read-only memory map of one file, shared by its tensors until closed.

    Args:
        label: the file's name in messages.
        buffer: the ``mmap`` (``None`` for an empty data section).
        watch: the file's :class:`FileWatch` (``None``: not checked).
        error: the error raised when the file changed on disk (the format's own error type).
        closed_message: the message of the ``RecordError`` raised by a read after :meth:`close`.
    """

    __slots__ = ("label", "buffer", "watch", "error", "closed_message")

    def __init__(self, label: str, buffer, watch: "FileWatch | None", error: type, closed_message: str):
        self.label = label
        self.buffer = buffer
        self.watch = watch
        self.error = error
        self.closed_message = closed_message

    @staticmethod
    def map(handle, label: str, st: os.stat_result) -> tuple:
        """``(mmap, FileWatch)`` of the open file ``handle`` (``st``: its ``fstat`` when opened).

        Raises:
            OSError: the file cannot be mapped (the watch is closed again).
        """
        watch = FileWatch(label, handle.fileno(), st)
        try:
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ), watch
        except BaseException:
            watch.close()
            raise

    @property
    def closed(self) -> bool:
        return self.buffer is None

    def view(self):
        """The buffer, after checking (one ``fstat``) that the file was not changed in place.

        Raises:
            RecordError: after :meth:`close`.
            error: the file changed on disk since it was opened.
        """
        if self.buffer is None:
            from ..core.errors import RecordError

            raise RecordError(self.closed_message)
        # NOTE: checked on every read, not once: mmap + an in-place write = stale bytes or SIGBUS
        if self.watch is not None:
            self.watch.check(self.error)
        return self.buffer

    def close(self) -> None:
        """Release the mapping. Arrays already handed out stay valid: the mapping lives on until
        the last of them is gone."""
        buffer, self.buffer = self.buffer, None
        if self.watch is not None:
            self.watch.close()
        if buffer is not None:
            try:
                buffer.close()
            except BufferError:  # views are still alive; the mmap closes when they go
                pass
