"""The ``onnxparam`` command line (also ``python -m onnxparam``).

Each subcommand is a :class:`Command`: a name, a one-line help, a function that adds its
arguments to its own parser and a function that runs it and returns the exit code. Add a
command by writing those and listing it in :data:`COMMANDS`; :func:`main` does the rest.

Exit codes: 0 success, 1 a failure (one line on stderr: ``onnxparam: error: ...``), 2 a usage
error (one line on stderr naming the bad argument, as ``argparse`` words it), 130 interrupted
(SIGINT, Ctrl-C) and 143 terminated (SIGTERM), each with one line on stderr and the scratch
files of unfinished saves removed (the previous files intact). No tracebacks, at any moment:
``python -m onnxparam`` installs its handlers before importing anything heavy.
Warnings are one line each on stderr, ``onnxparam: warning: <message>`` (no source path; Python
keyword spellings replaced by the options that do the same, :data:`CLI_SPELLINGS`).
Progress bars (``tqdm``) go to stderr, only on a terminal, never with ``--quiet``.

Commands:

* ``onnxparam inspect FILE [--json] [--no-count]``: the tensors of a ``.bpk``, ``.onnx``,
  ``.safetensors``, ``.pt`` / ``.pth`` or ``.onnx_adapter`` file (name, dtype, shape, bytes, param id, quantization scheme, NaN / Inf
  counts of float tensors), the file's metadata and totals. Tensor data is read lazily
  (memory-mapped) in :data:`COUNT_CHUNK_BYTES` chunks, so a file larger than memory is fine (an
  ``.onnx`` whose weights sit inside the protobuf is parsed whole: protobuf has no lazy reads).
  ``--json`` prints one JSON document (:func:`inspect_file` builds it).

Every subcommand takes ``--json``: one JSON object on stdout, ``{"command", "results",
"output"}`` (``results``: convert's report; quantize's params, scheme, per-op table and written
file; lora's action, adapted weights, rank, alpha and written file; export's model accuracy and
one entry per written variant with its path, bytes and per-op report); for inspect, its
document with ``"command": "inspect"``; a failure prints ``{"command", "error", "type", "exit_code"}`` instead (and its
line on stderr) and exits with that code.
* ``onnxparam convert IN OUT [--graph G.onnx] [--zero-copy] [--remap PATTERN=REPL ...]
  [--include RE ...] [--exclude RE ...] [--transpose RE ...] [--cast f16|bf16|f32]
  [--pytorch] [--allow-partial] [--external-data] [--plain] [--quiet]``: wraps
  :func:`onnxparam.convert.convert` (formats from the extensions) and prints its report.
* ``onnxparam quantize IN OUT --scheme q8s|q8f|q4s|q4f [--block-size N[,M]] [--reblock]``:
  quantize the weights of a model (an ``.onnx`` file, or a ``.bpk`` / ``.safetensors`` with
  ``--graph`` or ``--zoo``) with :class:`onnxparam.quant.Quantizer`; ``OUT.onnx`` is a QDQ model
  (``--reblock``: ``QdqOptions(reblock=True)``), ``OUT.bpk`` holds ``QFloat`` tensors. A block
  size that leaves every weight float is an error (nothing written).
* ``onnxparam lora merge|keep|adapter MODEL OUT --alpha A [--rank R] [--adapter FILE]
  [--targets RE ...]``: LoRA adapters on a model's rank-2 weights (factors from ``MODEL`` or
  ``--adapter``, else fresh ones of ``--rank``): ``merge`` folds them into the weights,
  ``keep`` keeps them as separate factors (ONNX ``lora="keep"``; a ``.bpk`` with
  ``<param>.lora.a`` / ``.lora.b``), ``adapter`` writes the factors alone. The base weights
  (and param ids) are always ``MODEL``'s. A fresh ``--rank`` above ``min(d_in, d_out)`` of every
  adapted weight is refused (a warning when above that of some).
* ``onnxparam export mnist [--out DIR] [--batch-size N] [--device D] [--only PART ...]``: the
  tour of the packaged MNIST model: classify the 1,797 packaged digits through ONNX Runtime,
  export float32, int8-QDQ and LoRA (merged and kept) ONNX files, round-trip the weights
  through a burnpack file, and print accuracy, file size and latency for each.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings
from typing import Optional, Sequence

from . import _common
from ._common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    Command,
    Interrupted,
    UsageError,
    _interrupted,
    _Parser,
    _signals_raise,
    add_common_flags,
    one_line,
)
from ._models import export_mnist_onnx
from .convert import _add_convert_arguments, _run_convert
from .export import _add_export_arguments, _run_export
from .inspect import _add_inspect_arguments, _run_inspect, inspect_file
from .lora import _add_lora_arguments, _run_lora
from .quantize import _add_quantize_arguments, _run_quantize

__all__ = [
    "main",
    "build_parser",
    "inspect_file",
    "export_mnist_onnx",
    "Command",
    "COMMANDS",
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_USAGE",
]

COMMANDS: tuple = (
    Command(
        "inspect",
        "list the tensors and metadata of a .bpk, .onnx, .safetensors, .pt or .onnx_adapter file",
        _add_inspect_arguments,
        _run_inspect,
    ),
    Command("convert", "convert weights between .bpk, .safetensors and .onnx", _add_convert_arguments, _run_convert),
    Command(
        "quantize", "quantize a model's weights (QDQ .onnx or QFloat .bpk)", _add_quantize_arguments, _run_quantize
    ),
    Command(
        "lora", "LoRA adapters: merge them, keep them as factors, or write them alone", _add_lora_arguments, _run_lora
    ),
    Command(
        "export",
        "the tour of a packaged model: ONNX files (float32, int8, LoRA), burnpack, a table",
        _add_export_arguments,
        _run_export,
    ),
)
"""The subcommands, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    """The ``onnxparam`` argument parser, one subparser per :data:`COMMANDS` entry."""
    from ..core.version import __version__

    parser = _Parser(prog=PROG, description="Burn's Param/Module model for ONNX models.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        add_common_flags(p)
        p.set_defaults(_run=command.run)
    return parser


CLI_SPELLINGS = {
    "block_size=(b, 1)": "--block-size N,1",
    "QdqOptions(reblock=True)": "--reblock",
}
"""Python spellings in library warnings -> the command-line options that do the same.

NOTE: warnings are written for Python callers; on the command line they would name keyword
arguments the user cannot type, so :func:`_show_warning` shows the option instead."""


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for the CLI: ``onnxparam: warning: <message>``, one line on
    stderr (no file path, no source line: those are the library's, not the user's)."""
    text = " ".join(str(message).split())
    for python, option in CLI_SPELLINGS.items():
        text = text.replace(python, option)
    try:
        print(f"{PROG}: warning: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # pragma: no cover - stderr closed
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    # NOTE: catch_warnings restores warnings.showwarning on return, so calling main() from
    # Python (tests) leaves the caller's warning machinery as it was; the signal handlers are
    # restored likewise.
    with warnings.catch_warnings(), _signals_raise() as fired:
        # NOTE: the filters of a fresh interpreter (a warning is a line on stderr, never an
        # error), also when main() is called from Python with other filters in force
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = _show_warning
        try:
            code = _main(argv)
        except Interrupted as e:  # while the parser is built or the arguments parsed
            return _interrupted(e.signum)
        # NOTE: a signal whose exception some library code swallowed still ends the command
        # as interrupted (its writes are atomic: a completed one is whole).
        return _interrupted(fired[0]) if fired and code != 128 + int(fired[0]) else code


def _json_error(command: Optional[str], error: BaseException, message: str, code: int) -> None:
    """With ``--json``: the error as one JSON object on stdout (``command``, ``error``, ``type``,
    ``exit_code``), besides the usual line on stderr."""
    import json

    doc = {"command": command, "error": message, "type": type(error).__name__, "exit_code": code}
    with contextlib.suppress(OSError, ValueError):
        print(json.dumps(doc, ensure_ascii=False), flush=True)


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        if "--json" in argv:
            _json_error(next((a for a in argv if a in {c.name for c in COMMANDS}), None), e, str(e), EXIT_USAGE)
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version
        return int(e.code or 0)
    from ..core.errors import OnnxParamError

    wants_json = bool(getattr(args, "json", False))
    capture = wants_json and bool(getattr(args, "_json_capture", False))
    try:
        _common.QUIET = bool(getattr(args, "quiet", False))
        _common.JSON_DOC = {"command": args.command, "results": {}, "output": []} if capture else None
        code = int(args._run(args))
        if capture and code == EXIT_OK:
            import json

            doc, _common.JSON_DOC = _common.JSON_DOC, None
            print(json.dumps(doc, indent=2, ensure_ascii=False, default=str), flush=True)
        return code
    except UsageError as e:
        print(e, file=sys.stderr)
        if wants_json:
            _json_error(args.command, e, str(e), EXIT_USAGE)
        return EXIT_USAGE
    except (Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        return _interrupted(signum)
    except BrokenPipeError:  # `onnxparam inspect big.bpk | head`: the reader left; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except (OnnxParamError, OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        if wants_json:
            _json_error(args.command, e, one_line(e), EXIT_FAILURE)
        return EXIT_FAILURE
    except Exception as e:  # noqa: BLE001 - the CLI promises one line, never a traceback
        print(f"{PROG}: error: unexpected {type(e).__name__}: {one_line(e)} (please report this)", file=sys.stderr)
        if wants_json:
            _json_error(args.command, e, f"unexpected {type(e).__name__}: {one_line(e)}", EXIT_FAILURE)
        return EXIT_FAILURE
    finally:
        _common.QUIET, _common.JSON_DOC = False, None
