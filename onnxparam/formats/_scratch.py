"""Scratch names for atomic saves, and the clean-up of those a killed process left behind.

Every writer (burnpack, safetensors, ONNX) writes beside its target under a scratch name and
renames it over the target when complete. A process killed mid-save (SIGKILL, power loss)
cannot remove its scratch file; its target is intact, but the scratch would stay forever. The
scratch name therefore carries the writer's process id::

    .<target name>.<pid>-<12 hex digits>.tmp        (a file, or a folder for ONNX saves)

and the next save of *any* target in that folder removes the scratch entries of processes that
no longer run. Entries of live processes (another save in progress) are left alone.

A process that is *told* to stop (SIGINT, SIGTERM) removes its own scratch entries: every entry
this module creates is registered in :data:`_LIVE` until it is renamed or removed, and the CLI's
signal handler calls :func:`remove_live_scratch` (the writers' own clean-up also runs, as the
handler raises through them).

Renaming over a file needs write permission on its *folder* only, so the rename would replace a
read-only file that ``open(path, "w")`` refuses, and the new file would get the umask's mode,
not the old one's. Every writer therefore calls :func:`check_replaceable` before writing
anything (a read-only target, a missing or unwritable folder: refused with an ``OSError`` naming
the target) and :func:`preserve_mode` on its scratch file before the rename.

A leaf module: no imports from the rest of the package, so the burnpack format layer can use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import threading
from pathlib import Path
from typing import BinaryIO, Iterator

from ..core.errors import file_error

__all__ = [
    "scratch_name",
    "remove_stale_scratch",
    "disk_full_error",
    "check_replaceable",
    "preserve_mode",
    "cannot_write_error",
    "make_parent_folder",
    "remove_live_scratch",
    "register",
    "release",
    "is_scratch_name",
]

_HEX_DIGITS = 12


def scratch_name(target_name: str) -> str:
    """A fresh scratch name for a save to ``target_name`` by this process."""
    return f".{target_name}.{os.getpid()}-{secrets.token_hex(_HEX_DIGITS // 2)}.tmp"


_SCRATCH = re.compile(rf"\..+\.(\d+)-[0-9a-f]{{{_HEX_DIGITS}}}\.tmp")
"""Any scratch entry's name (:func:`scratch_name`); group 1 is the writer's process id."""

_LIVE: set = set()
"""Scratch entries this process created and has not yet renamed or removed (absolute paths)."""
_LIVE_LOCK = threading.RLock()  # re-entered when a signal handler interrupts register()


def is_scratch_name(name: str) -> bool:
    """Whether ``name`` is a writer's scratch entry (``inspect`` and folder listings skip them)."""
    return _SCRATCH.fullmatch(name) is not None


def register(path) -> None:
    """Remember ``path`` (a scratch entry this process is writing) for :func:`remove_live_scratch`."""
    with _LIVE_LOCK:
        _LIVE.add(os.path.abspath(os.fspath(path)))


def release(path) -> None:
    """Forget ``path`` (renamed into place or removed): :func:`remove_live_scratch` skips it."""
    with _LIVE_LOCK:
        _LIVE.discard(os.path.abspath(os.fspath(path)))


def remove_live_scratch() -> list:
    """Remove every scratch entry this process still has (files or folders); returns their
    paths. Called on SIGINT / SIGTERM by the CLI; safe to call at any moment (best effort)."""
    with _LIVE_LOCK:
        paths = sorted(_LIVE)
        _LIVE.clear()
    return [path for path in paths if _remove_entry(path)]


def _remove_entry(path: str) -> bool:
    """Remove the scratch file or folder ``path`` (a link is unlinked, never followed); False
    when it could not be removed (gone already, no permission): removal is best effort."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or cannot tell: keep its files
    return True


def remove_stale_scratch(directory: str, target_name: str = "") -> list:
    """Remove the scratch entries in ``directory`` whose writer process is gone, whatever
    target they were for (``target_name`` is kept for callers; every target's count); returns
    their names. Best effort: errors are ignored. POSIX only (elsewhere a process id cannot be
    probed without side effects, and nothing is removed)."""
    if os.name != "posix":
        return []
    pattern = _SCRATCH
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    for name in entries:
        match = pattern.fullmatch(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        if _remove_entry(os.path.join(directory, name)):
            removed.append(name)
    return removed


_DISK_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
"""errno values meaning "no space left": the device is full, or the user's quota is."""


_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")
"""numpy's ``tofile`` message for a short write (no errno): what a full disk gives there."""


def disk_full_error(error: BaseException, target, writing=None) -> "OSError | None":
    """For an ``OSError`` meaning "no space left" (``ENOSPC``, ``EDQUOT``, or numpy's errno-less
    short write "N requested and M written"): an ``OSError`` of errno ``ENOSPC`` / ``EDQUOT``
    whose message names the file being written (``writing``, default ``target``; never a scratch
    name) and says the old file is untouched; else ``None``."""
    if not isinstance(error, OSError):
        return None
    code = error.errno
    if code is None and _SHORT_WRITE.search(str(error)):
        code = errno.ENOSPC
    if code not in _DISK_FULL:
        return None
    label = os.fspath(target)
    file = label if writing is None else os.fspath(writing)
    saving = "" if file == label else f" (saving '{label}')"
    # NOTE: out of inodes is ENOSPC too (creating the scratch entry); "or inodes" covers it
    return file_error(
        code,
        f"{os.strerror(code)} writing '{file}'{saving}: the disk (or its inodes, or the quota) is full; nothing "
        "was replaced (any previous file is unchanged); free space or save elsewhere",
        label,
    )


_ANY_WRITE_BIT = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


def _folder_label(target: str) -> str:
    return os.path.dirname(target) or "."


def check_replaceable(target) -> int | None:
    """Refuse, before anything is written, a save that ``open(target, "w")`` would refuse.

    Returns:
        the permission bits of the existing ``target`` (to give the new file, see
        :func:`preserve_mode`), or ``None`` when there is no file there yet.

    Raises:
        PermissionError: (``EACCES``) ``target`` is read-only, or its folder is not writable.
        FileNotFoundError: (``ENOENT``) ``target``'s folder does not exist.
        NotADirectoryError: (``ENOTDIR``) ``target``'s folder is a file.
        IsADirectoryError: (``EISDIR``) ``target`` is a folder.
    """
    label = os.fspath(target)
    folder = os.path.dirname(os.path.abspath(label))
    if not os.path.exists(folder):
        raise _error(errno.ENOENT, label, f"the folder '{_folder_label(label)}' does not exist (create it first)")
    if not os.path.isdir(folder):
        raise _error(errno.ENOTDIR, label, f"'{_folder_label(label)}' is a file, not a folder")
    try:
        st = os.stat(label)  # follows a symbolic link, as open() would
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _error(errno.EISDIR, label, "it is a folder")
    # NOTE: the mode bits as well as os.access: for root os.access always says writable, but a
    # file chmod'ed read-only is a statement of intent that a save must not overrule.
    if st is not None and (not st.st_mode & _ANY_WRITE_BIT or not os.access(label, os.W_OK)):
        raise file_error(
            errno.EACCES,
            f"'{label}' is read-only; the file was not changed (make it writable, e.g. chmod u+w, "
            "or save elsewhere)",
            label,
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _error(errno.EACCES, label, f"the folder '{_folder_label(label)}' is not writable")
    return None if st is None else stat.S_IMODE(st.st_mode)


def preserve_mode(mode: int | None, scratch) -> None:
    """Give ``scratch`` the permission bits ``mode`` (from :func:`check_replaceable`) before it is
    renamed over the old file; nothing when ``mode`` is ``None`` (a new file keeps the umask's)."""
    if mode is not None:
        os.chmod(scratch, mode)


def cannot_write_error(error: BaseException, target) -> OSError | None:
    """For an ``OSError`` raised creating a scratch entry beside ``target`` (it names the scratch,
    which the user never asked for): an ``OSError`` of the same errno naming ``target`` and the
    reason; ``None`` for other errors. Covers what :func:`check_replaceable` could not foresee
    (a folder removed since, a read-only file system, a denial only the kernel knows). An
    ``ENOENT`` in a folder that exists (``/proc`` refuses new files so) becomes ``EACCES``,
    "not writable"."""
    if not isinstance(error, OSError) or error.errno is None:
        return None
    label = os.fspath(target)
    folder = _folder_label(label)
    if error.errno == errno.ENOENT and os.path.isdir(os.path.dirname(os.path.abspath(label))):
        # NOTE: the folder is there but refuses new entries with ENOENT (/proc, /sys, a folder
        # removed and recreated ...): "does not exist" would contradict what the user sees.
        return _error(errno.EACCES, label, f"the folder '{folder}' is not writable (the system refused to "
                                           f"create a file there: {os.strerror(errno.ENOENT)})")
    reasons = {
        errno.ENOENT: f"the folder '{folder}' does not exist (create it first)",
        errno.ENOTDIR: f"'{folder}' is not a folder",
        errno.EACCES: f"the folder '{folder}' is not writable",
        errno.EPERM: f"the folder '{folder}' is not writable",
        errno.EROFS: f"the folder '{folder}' is on a read-only file system",
    }
    reason = reasons.get(error.errno)
    return None if reason is None else _error(error.errno, label, reason)


def make_parent_folder(target) -> None:
    """Create ``target``'s folder and any missing folders above it (as ``mkdir -p``).

    Raises:
        NotADirectoryError: (``ENOTDIR``) a path above ``target`` is a file; names it.
        PermissionError: (``EACCES``) a folder on the way cannot take the new folder (not
            writable, or a system folder such as ``/proc`` that refuses new entries).
        OSError: any other failure, of the same errno, naming ``target``.
    """
    label = os.fspath(target)
    folder = Path(os.path.dirname(os.path.abspath(label)))
    if folder.is_dir():
        return
    for above in [folder, *folder.parents]:
        if os.path.lexists(above) and not above.is_dir():
            raise _error(errno.ENOTDIR, label, f"'{above}' is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno is None:
            raise
        failed = Path(e.filename) if e.filename else folder
        where = failed.parent
        if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS) and where.is_dir():
            raise _error(errno.EACCES, label, f"cannot create the folder '{failed}': '{where}' is not writable "
                                              f"({os.strerror(e.errno)})") from None
        raise _error(e.errno, label, f"cannot create the folder '{failed}': {os.strerror(e.errno)}") from None


def _error(code: int, label: str, reason: str) -> OSError:
    # NOTE: file_error builds the library leaf of that errno (also a FileNotFoundError, ...).
    return file_error(code, f"cannot write '{label}': {reason}; nothing was written", label)


def create_scratch(target: Path, make, path_for_errors=None):
    """``(scratch_path, make(scratch_path))`` for a fresh scratch entry beside ``target``.

    Scratch entries of dead writers are removed first (their names carry the pid, so a save
    killed mid-way is cleaned up by the next save to the same target). ``make`` creates the
    entry (a file or a folder) and must fail with ``FileExistsError`` if it exists. Errors name
    ``path_for_errors`` (default ``target``), never the scratch name.
    """
    remove_stale_scratch(os.fspath(target.parent) or ".")
    label = target if path_for_errors is None else path_for_errors
    while True:
        tmp = target.with_name(scratch_name(target.name))
        # registered before it exists: a SIGINT / SIGTERM landing right after ``make`` must find it
        register(tmp)
        try:
            made = make(tmp)
        except FileExistsError:  # pragma: no cover - 48 random bits collided
            release(tmp)
            continue
        except OSError as e:
            release(tmp)
            clear = cannot_write_error(e, label) or disk_full_error(e, label)
            if clear is not None:
                raise clear from e
            raise
        return tmp, made


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
    # NOTE: os.open with O_EXCL and mode 0o666 (not tempfile.mkstemp, which forces 0o600) so
    # the finished file gets the permissions the process umask gives any new file.
    tmp, fd = create_scratch(
        target, lambda p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), path)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        preserve_mode(mode, tmp)
        os.replace(tmp, target)
        release(tmp)
        sync_directory(os.fspath(target.parent) or ".")
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        release(tmp)
        full = disk_full_error(e, target)
        if full is not None:
            raise full from e
        raise


def sync_directory(directory: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
