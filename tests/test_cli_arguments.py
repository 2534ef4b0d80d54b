"""Bad argument values of every validating argument type end the CLI with exit 2 and one line
naming the argument and the value, run in this process (so coverage sees the CLI).

Oracle: the argument's documented form (a positive integer, a finite number, a regular
expression Python's ``re`` compiles, ``PATTERN=REPLACEMENT``, a device ``cpu`` / ``cuda[:N]``).
"""

from __future__ import annotations

import contextlib
import io

import pytest

from onnxparam.cli import main


def run(*args) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("args, message", [
    (["export", "mnist", "--batch-size", "many"],
     "onnxparam export: error: argument --batch-size: expected a positive integer, got 'many'"),
    (["export", "mnist", "--batch-size", "-3"],
     "onnxparam export: error: argument --batch-size: expected a positive integer, got '-3'"),
    (["lora", "merge", "m.bpk", "o.onnx", "--alpha", "big"],
     "onnxparam lora: error: argument --alpha: expected a number, got 'big'"),
    (["lora", "merge", "m.bpk", "o.onnx", "--alpha", "nan"],
     "onnxparam lora: error: argument --alpha: expected a finite number, got 'nan'"),
    (["lora", "merge", "m.bpk", "o.onnx", "--alpha", "inf"],
     "onnxparam lora: error: argument --alpha: expected a finite number, got 'inf'"),
    (["convert", "m.bpk", "o.bpk", "--include", "fc("],
     "onnxparam convert: error: argument --include: invalid regular expression 'fc(': missing ), unterminated "
     "subpattern at position 2"),
    (["convert", "m.bpk", "o.bpk", "--remap", "=x"],
     "onnxparam convert: error: argument --remap: expected PATTERN=REPLACEMENT, got '=x'"),
    (["convert", "m.bpk", "o.bpk", "--remap", "[a=b"],
     "onnxparam convert: error: argument --remap: invalid regular expression '[a': unterminated character set at "
     "position 0"),
    (["export", "mnist", "--device", "tpu"], "onnxparam export: error: argument --device: unknown device 'tpu'"),
])
def test_a_bad_argument_value_exits_2_with_one_line_naming_it(args, message):
    code, out, err = run(*args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), err
    assert out == ""


@pytest.mark.parametrize("args, message", [
    (["lora", "merge", "missing.bpk", "o.onnx", "--zoo", "mnist", "--alpha", "4", "--rank", "2"],
     "onnxparam: error: model file 'missing.bpk' does not exist"),
    (["lora", "merge", "folder.bpk", "o.onnx", "--zoo", "mnist", "--alpha", "4", "--rank", "2"],
     "onnxparam: error: model file 'folder.bpk' is a folder, not a file"),
    (["convert", "folder.bpk", "o.safetensors"], "onnxparam: error: input file 'folder.bpk' is a folder, not a file"),
])
def test_a_missing_input_or_a_folder_in_its_place_exits_1_naming_the_role_and_the_path(tmp_path, monkeypatch, args,
                                                                                      message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.bpk").mkdir()
    code, out, err = run(*args)
    assert code == 1
    assert err.strip().splitlines() == [message]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.bpk"]  # nothing written


def test_an_out_folder_that_cannot_be_made_is_one_line_naming_it(tmp_path):
    # the errno (ENOTDIR: a parent is a file) is the spec's; no "[Errno 20]" or traceback, nothing else done
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "tour"
    code, stdout, stderr = run("export", "mnist", "--out", str(out))
    assert code != 0 and stdout == ""
    assert stderr.strip() == (f"onnxparam: error: cannot create the --out folder '{out}': Not a directory; "
                              "give a folder that can be created or written")


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_an_out_folder_under_proc_is_one_line_naming_it():
    code, stdout, stderr = run("export", "mnist", "--out", "/proc/nope")
    assert code != 0 and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith("onnxparam: error: cannot create the --out folder '/proc/nope': ") and "Errno" not in stderr
