"""Atomic file replacement: write beside the target, then ``os.replace``.

A reader never sees a half-written file and a failed write leaves the old file as it was.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Iterator

from .._scratch import (
    cannot_write_error,
    check_replaceable,
    disk_full_error,
    preserve_mode,
    remove_stale_scratch,
    scratch_name,
)

__all__ = ["atomic_output"]


@contextlib.contextmanager
def atomic_output(path: "str | os.PathLike") -> Iterator[BinaryIO]:
    """A binary file object whose contents replace ``path`` when the block exits cleanly.

    The temporary file lives in the target's folder (``os.replace`` is atomic only within one
    file system), is flushed and fsynced before the rename, and is removed when the block
    raises; the old ``path`` is then untouched. A replaced file keeps its permission bits.

    Raises:
        PermissionError: (``EACCES``) ``path`` is read-only (whatever the process's privileges),
            or its folder is not writable; raised before the block runs.
        FileNotFoundError: (``ENOENT``) ``path``'s folder does not exist.
        OSError: ``ENOSPC`` / ``EDQUOT`` when the disk is full, naming ``path``.
    """
    target = Path(path)
    # NOTE: the rename would replace a read-only file that open(path, "w") refuses: check first.
    mode = check_replaceable(path)
    # NOTE: the scratch name carries the pid, so a save killed mid-way (whose scratch file no
    # handler could remove) is cleaned up by the next save to the same target.
    remove_stale_scratch(os.fspath(target.parent), target.name)
    # NOTE: os.open with O_EXCL and mode 0o666 (not tempfile.mkstemp, which forces 0o600) so
    # the finished file gets the permissions the process umask gives any new file.
    while True:
        tmp = target.with_name(scratch_name(target.name))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:  # pragma: no cover - 48 random bits collided
            continue
        except OSError as e:
            clear = cannot_write_error(e, path)
            if clear is not None:
                raise clear from e
            raise
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        preserve_mode(mode, tmp)
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        full = disk_full_error(e, target)
        if full is not None:
            raise full from e
        raise
