"""``python -m onnxparam``: the ``onnxparam`` command line (:mod:`onnxparam.cli`)."""

import os
import signal
import sys


def _early_exit(signum, frame):  # pragma: no cover - runs in a subprocess
    """Until :func:`onnxparam.cli.main` installs its handlers: nothing is written yet, so one
    line and the exit code (128 + signal) suffice. Imports nothing (it may run mid-import)."""
    words = "interrupted (SIGINT)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    try:
        os.write(2, f"onnxparam: {words}\n".encode())
    finally:
        os._exit(128 + int(signum))


if __name__ == "__main__":
    # NOTE: before any heavy import: a Ctrl-C (or SIGTERM) while the CLI starts prints one line
    # and exits 130 (143), never a traceback from a half-done import.
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _early_exit)

from .cli import main  # noqa: E402 - after the handlers

if __name__ == "__main__":
    sys.exit(main())
