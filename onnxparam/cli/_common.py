"""Shared pieces of the command line: exit codes, the parser, argument types, output."""

import argparse
import contextlib
import math
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
"""``argparse``'s (and the Unix) convention for a command-line usage error."""

EXIT_SIGNAL_BASE = 128
"""A process ended by signal N exits ``128 + N`` (the shells' convention): 130 for SIGINT, 143
for SIGTERM."""

QUIET = False
"""Set by :func:`onnxparam.cli.main` from ``--quiet``: no progress bar anywhere."""

PROG = "onnxparam"
DEFAULT_OUT_DIR = "onnxparam-out"
DEFAULT_BATCH_SIZE = 256
MNIST_ONNX_FILE = "mnist.onnx"

COUNT_CHUNK_BYTES = 16 * 1024 * 1024
"""Bytes of one tensor scanned at a time when counting NaN / Inf: bounds the temporaries of a
scan (a few booleans per element) whatever the tensor's size."""

PROGRESS_MIN_BYTES = 64 * 1024 * 1024
"""Work smaller than this shows no progress bar (it would only flicker)."""


class Interrupted(BaseException):
    """Raised by the CLI's handler of SIGINT / SIGTERM in the main thread, through the running
    command (a ``BaseException``, so no ``except Exception`` swallows it; the writers' clean-up
    runs as it passes)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)
_SIGNAL_WORDS = {getattr(signal, "SIGINT", -1): "interrupted (SIGINT)", getattr(signal, "SIGTERM", -1): "terminated (SIGTERM)"}


def _interrupted(signum: int) -> int:
    """After a SIGINT / SIGTERM: remove this process's scratch entries, print one line, return
    the exit code (``128 + signum``). Further signals are ignored meanwhile."""
    from ..formats._scratch import remove_live_scratch

    for s in _SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(s, signal.SIG_IGN)
    remove_live_scratch()
    with contextlib.suppress(OSError, ValueError):
        print(f"{PROG}: {_SIGNAL_WORDS.get(signum, f'signal {signum}')}; unfinished files were removed, "
              "previous files are unchanged", file=sys.stderr, flush=True)
    return EXIT_SIGNAL_BASE + int(signum)


@contextlib.contextmanager
def _signals_raise():
    """While the CLI runs (main thread only): SIGINT and SIGTERM raise :class:`Interrupted`;
    the previous handlers are restored afterwards. Yields the list of signals received, so the
    caller can still exit ``128 + signal`` when library code swallowed the exception (a C
    extension that checks for signals and clears the error, say)."""
    fired: list = []
    if threading.current_thread() is not threading.main_thread():
        yield fired
        return

    def handler(signum, frame):
        if fired:  # a second signal while the first unwinds: let the clean-up finish
            return
        fired.append(signum)
        raise Interrupted(signum)

    previous = {}
    for s in _SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(s) is not signal.SIG_IGN:  # nohup / background jobs: keep ignoring
                previous[s] = signal.signal(s, handler)
    try:
        yield fired
    finally:
        for s, old in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(s, old if old is not None else signal.SIG_DFL)


class UsageError(Exception):
    """A bad command line; :func:`main` prints it as one line and returns :data:`EXIT_USAGE`."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage dump) and never exit."""

    def error(self, message: str):  # noqa: D401 - argparse's API
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


@dataclass(frozen=True)
class Command:
    """A subcommand: ``add_arguments(parser)`` declares its arguments; ``run(args) -> int``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"invalid regular expression {text!r}: {e}") from None
    return text


def _remap_rule(text: str) -> tuple:
    """``PATTERN=REPLACEMENT`` (split at the first ``=``) -> ``(pattern, replacement)``."""
    pattern, sep, replacement = text.partition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(f"expected PATTERN=REPLACEMENT, got {text!r}")
    _regex(pattern)
    return pattern, replacement


def _device(text: str):
    from ..core.device import Device

    try:
        return Device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


JSON_DOC: Optional[dict] = None
"""While a command added ``--json`` by :func:`add_common_flags` runs with it: the document
printed at the end (``command``, the command's structured ``results``, its ``output`` lines)."""


def _out(line: str = "") -> None:
    if JSON_DOC is not None:
        JSON_DOC["output"].append(line)
        return
    print(line, flush=True)


def json_result(key: str, value) -> None:
    """Add ``key: value`` to the ``--json`` document's ``results`` (nothing without ``--json``)."""
    if JSON_DOC is not None:
        JSON_DOC["results"][key] = value


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """Give a subcommand ``-q/--quiet`` and ``--json`` unless it declares its own."""
    options = parser._option_string_actions  # noqa: SLF001 - argparse has no public lookup
    if "--quiet" not in options:
        parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    if "--json" not in options:
        parser.add_argument("--json", action="store_true",
                            help="print one JSON document (the results and the output lines) instead of text")
        parser.set_defaults(_json_capture=True)


def _progress(total: Optional[int], desc: str, quiet: bool, unit: str = "B"):
    """A tqdm bar on stderr, or ``None`` (``--quiet``, not a terminal, small work, no tqdm)."""
    if quiet or QUIET or (total is not None and unit == "B" and total < PROGRESS_MIN_BYTES):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    # NOTE: disable=None is tqdm's "only on a terminal": pipes and logs get no bar.
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        disable=None,
        leave=False,
        file=sys.stderr,
    )


def _file_format(path: Path, role: str, allowed: Sequence[str] = ("burnpack", "onnx", "safetensors")) -> str:
    """The format of ``path``, or a one-line error naming ``role``: an input that exists is told
    by its content (:func:`~onnxparam.formats._extensions.detect_format`; a folder is an
    ``IsAFolderError``), an output (``role`` starting with "output") or a missing input by its
    extension."""
    from ..core.errors import IsAFolderError, RecordError
    from ..formats._extensions import FORMATS, detect_format

    if not role.startswith("output") and path.is_dir():
        raise IsAFolderError(f"{role} '{path}' is a folder, not a file")
    if not role.startswith("output") and (path.exists() or path.is_symlink()):
        fmt = detect_format(path)
        if fmt not in allowed:
            raise RecordError(f"{role} '{path}' is a {fmt} file; expected {' or '.join(allowed)}")
        return fmt
    fmt = FORMATS.get(path.suffix.lower())
    if fmt not in allowed:
        known = ", ".join(ext for ext, f in FORMATS.items() if f in allowed)
        raise RecordError(
            f"{role} '{path}': cannot tell the format from the extension '{path.suffix}'; use one of {known}"
        )
    return fmt


def _check_output(dst: Path, *sources: Path) -> None:
    """Refuse an output before any work: a folder (``IsAFolderError``), one of the ``sources``
    (``UsageError``), a read-only file, a folder that is missing or not writable
    (``FileAccessError``)."""
    from ..core.errors import IsAFolderError
    from ..formats._scratch import check_replaceable

    if dst.is_dir():
        raise IsAFolderError(f"output file '{dst}' is a folder, not a file")
    for src in sources:
        if src is not None and os.path.exists(src) and os.path.realpath(src) == os.path.realpath(dst):
            raise UsageError(f"{PROG}: error: the input and output are the same file '{src}'; write to another file")
    check_replaceable(dst)


def _existing(path: Path, role: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{role} '{path}' does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"{role} '{path}' is a folder, not a file")
    return path


def one_line(error: BaseException) -> str:
    # RecordError lists its problems as "  - ..." lines; keep them, on one line.
    from ..core.errors import FileAccessError

    text = str(error)
    if isinstance(error, FileAccessError) and isinstance(error.strerror, str) and error.strerror:
        # NOTE: the library's message names the file already: no "[Errno 2] ...: 'path'" around it
        text = error.strerror
    lines = [re.sub(r"^-\s+", "", line.strip()) for line in text.splitlines() if line.strip()]
    problems = getattr(error, "problems", None)
    text = "; ".join(lines) or type(error).__name__
    if problems and not any(str(p) in text for p in problems):
        text += ": " + "; ".join(str(p) for p in problems)
    return text
