"""The command line's first moments: signal handlers installed before any heavy import.

``onnxparam ...`` (the console script) and ``python -m onnxparam ...`` import the package before
:func:`onnxparam.cli.main` runs, and importing numpy / onnx / ONNX Runtime takes a while; a
Ctrl-C or SIGTERM meanwhile would print a ``KeyboardInterrupt`` traceback (or die silently). When
the process *is* the command line (and only then: a library user's handlers are never touched),
:func:`install_if_command_line` installs handlers that print one line and exit ``128 + signal``
(130, 143); nothing has been written yet, so there is nothing to clean. ``main()`` replaces them
with handlers that unwind the running command (:mod:`onnxparam.cli._common`).

A leaf module: imports only the standard library (it runs before everything else).
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["install_if_command_line", "is_command_line"]

_WORDS = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}


def is_command_line() -> bool:
    """This process runs the ``onnxparam`` console script or ``python -m onnxparam``."""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    if argv0 in ("onnxparam", "onnxparam.exe"):
        return True
    orig = list(getattr(sys, "orig_argv", []))
    return "-m" in orig and orig.index("-m") + 1 < len(orig) and orig[orig.index("-m") + 1] == "onnxparam"


def _exit_now(signum, frame) -> None:  # pragma: no cover - runs in a subprocess
    try:
        os.write(2, f"onnxparam: {_WORDS.get(signum, f'signal {signum}')}\n".encode())
    finally:
        os._exit(128 + int(signum))


def install_if_command_line() -> None:
    """Install the start-up handlers when :func:`is_command_line` (main thread only)."""
    if not is_command_line():
        return
    for signum in _WORDS:
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup / background jobs keep theirs
                signal.signal(signum, _exit_now)
        except (ValueError, OSError):  # not the main thread
            return
