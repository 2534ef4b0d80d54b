"""Running the command line inside a test: ``run_cli("lora", "check", model, adapter)`` calls
``onnxparam.cli.main`` with the arguments as strings and returns ``(exit code, stdout, stderr)``;
``run_main(..., cwd=folder)`` does the same in a folder and returns a :class:`CliResult`."""

from __future__ import annotations

import contextlib
import io

from onnxparam.cli import main


def run_cli(*args) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


class CliResult:
    """What a run of the command line gave: exit code, stdout, stderr (as ``CompletedProcess``)."""

    def __init__(self, args, returncode, stdout, stderr):
        self.args, self.returncode, self.stdout, self.stderr = args, returncode, stdout, stderr


def run_main(*args, cwd=None) -> CliResult:
    """Run ``onnxparam <args>`` in this process (so coverage sees the CLI), in folder ``cwd``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or "."), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliResult(args, code, out.getvalue(), err.getvalue())
