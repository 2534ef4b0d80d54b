"""Running the command line inside a test: ``run_cli("lora", "check", model, adapter)`` calls
``onnxparam.cli.main`` with the arguments as strings and returns ``(exit code, stdout, stderr)``."""

from __future__ import annotations

import contextlib
import io

from onnxparam.cli import main


def run_cli(*args) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()
