"""Scratch names for atomic saves, and the clean-up of those a killed process left behind.

Every writer (burnpack, safetensors, ONNX) writes beside its target under a scratch name and
renames it over the target when complete. A process killed mid-save (SIGKILL, power loss)
cannot remove its scratch file; its target is intact, but the scratch would stay forever. The
scratch name therefore carries the writer's process id::

    .<target name>.<pid>-<12 hex digits>.tmp        (a file, or a folder for ONNX saves)

and the next save to the same target removes the scratch entries of processes that no longer
run. Entries of live processes (another save in progress) are left alone. A leaf module: no
imports from the rest of the package, so the burnpack format layer can use it.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil

__all__ = ["scratch_name", "remove_stale_scratch", "disk_full_error"]

_HEX_DIGITS = 12


def scratch_name(target_name: str) -> str:
    """A fresh scratch name for a save to ``target_name`` by this process."""
    return f".{target_name}.{os.getpid()}-{secrets.token_hex(_HEX_DIGITS // 2)}.tmp"


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


def remove_stale_scratch(directory: str, target_name: str) -> list:
    """Remove the scratch entries for ``target_name`` in ``directory`` whose writer process is
    gone; returns their names. Best effort: errors are ignored. POSIX only (elsewhere a process
    id cannot be probed without side effects, and nothing is removed)."""
    if os.name != "posix":
        return []
    pattern = re.compile(re.escape(f".{target_name}.") + rf"(\d+)-[0-9a-f]{{{_HEX_DIGITS}}}\.tmp")
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    for name in entries:
        match = pattern.fullmatch(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


_DISK_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
"""errno values meaning "no space left": the device is full, or the user's quota is."""


def disk_full_error(error: BaseException, target) -> "OSError | None":
    """For an ``OSError`` meaning "no space left" (``ENOSPC``, ``EDQUOT``): an ``OSError`` of the
    same errno whose message names the target and says the old file is untouched; else ``None``."""
    if not isinstance(error, OSError) or error.errno not in _DISK_FULL:
        return None
    return OSError(
        error.errno,
        f"{os.strerror(error.errno)} while saving '{os.fspath(target)}': the disk is full, nothing was "
        "replaced (any previous file is unchanged); free space or save elsewhere",
        os.fspath(target),
    )
