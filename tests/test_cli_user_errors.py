"""The command line's answers to mistakes users make that no other test made: malformed
``quantize`` option values, a ``--calibrate`` file that is no ``.npz`` or holds nothing,
``--per-channel`` with ``--block-size``, a model with nothing to quantize, and an unexpected
exception inside a command (one line, never a traceback; a JSON error document with ``--json``).

Oracles: the messages and exit codes the CLI's module docstring promises (2 for usage errors, 1
for failures, one line on stderr), ``numpy`` writing the ``--calibrate`` files, and the
file system (no output written).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_run import run_cli as run
from onnx import TensorProto, helper, numpy_helper

from onnxparam import Module, export_onnx
from onnxparam.nn import Linear


class Net(Module):
    def __init__(self):
        self.fc = Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


@pytest.fixture
def model(tmp_path):
    return export_onnx(Net(), tmp_path / "m.onnx", np.zeros((2, 8), np.float32))


@pytest.mark.parametrize("flag, value, words", [
    ("--block-size", "x", "expected N or N,M (positive integers), got 'x'"),
    ("--block-size", "4,0", "expected N or N,M (positive integers), got '4,0'"),
    ("--min-cosine", "abc", "expected a number in (0, 1], got 'abc'"),
    ("--min-cosine", "1.5", "expected a number in (0, 1], got '1.5'"),
])
def test_a_malformed_quantize_value_is_a_usage_error_naming_it(model, tmp_path, flag, value, words):
    code, _, err = run("quantize", model, tmp_path / "q.onnx", flag, value)
    assert code == 2 and words in err and flag in err
    assert not (tmp_path / "q.onnx").exists()


def test_per_channel_with_a_block_size_is_refused_before_any_work(model, tmp_path):
    code, _, err = run("quantize", model, tmp_path / "q.onnx", "--per-channel", "--block-size", "4")
    assert code == 2 and "--per-channel sets the scale grid itself; leave out --block-size" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "q.onnx").exists()


def test_a_calibrate_file_that_is_no_npz_is_named(model, tmp_path):
    bad = tmp_path / "inputs.npz"
    bad.write_bytes(b"not a zip archive at all")
    code, _, err = run("quantize", model, tmp_path / "q.onnx", "--calibrate", bad)
    assert code == 1 and f"the --calibrate file '{bad}' is not a readable .npz of arrays" in err
    assert not (tmp_path / "q.onnx").exists()


def test_a_calibrate_file_without_arrays_is_named(model, tmp_path):
    empty = tmp_path / "empty.npz"
    np.savez(empty)
    code, _, err = run("quantize", model, tmp_path / "q.onnx", "--calibrate", empty, "--json")
    assert code == 1 and f"the --calibrate file '{empty}' holds no arrays" in err
    doc = json.loads(run("quantize", model, tmp_path / "q.onnx", "--calibrate", empty, "--json")[1])
    assert doc["exit_code"] == 1 and "holds no arrays" in doc["error"] and doc["command"] == "quantize"


def test_a_model_without_a_float_matrix_has_nothing_to_quantize_and_writes_nothing(tmp_path):
    bias = numpy_helper.from_array(np.ones(4, np.float32), "bias")
    graph = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [bias])
    src = tmp_path / "add.onnx"
    import onnx

    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    code, _, err = run("quantize", src, tmp_path / "q.onnx")
    assert code != 0 and "no float weight (rank >= 2) to quantize; nothing was written" in err
    assert not (tmp_path / "q.onnx").exists()


def test_an_unexpected_exception_is_one_line_and_a_json_error(model, monkeypatch):
    import onnxparam.cli.inspect as inspect_cli

    def broken(*args, **kwargs):
        raise LookupError("a bug\nover two lines")

    monkeypatch.setattr(inspect_cli, "inspect_file", broken)
    code, out, err = run("inspect", model)
    assert code == 1 and "Traceback" not in err
    (line,) = err.strip().splitlines()  # one line, the exception's two folded into it
    assert line.startswith("onnxparam: error: unexpected LookupError: a bug") and "over two lines" in line
    assert line.endswith("(please report this)")
    code, out, err = run("inspect", model, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["type"] == "LookupError" and doc["exit_code"] == 1
    assert doc["error"].startswith("unexpected LookupError") and doc["command"] == "inspect"
