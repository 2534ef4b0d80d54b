"""The external data file of an imported ONNX model changed on disk after import: named, never NaN.

``onnx_ir`` reads external tensors from a memory map of the data file, so an edit of the file
after import would otherwise change the weights silently. The oracle is plain ONNX Runtime on
the original file, and numpy's ``x @ W + b`` with the weights ``onnx`` reads from it.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx.helper as h
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

import onnxparam as op

RNG = np.random.default_rng(0)
W = RNG.standard_normal((64, 32)).astype(np.float32)
B = RNG.standard_normal(32).astype(np.float32)
X = RNG.standard_normal((2, 64)).astype(np.float32)


def _model(folder):
    """``y = x @ W + b`` with both weights in ``weights.data``; the data file's modification time is
    set 10 s back, so that any later write changes it whatever the clock's granularity."""
    graph = h.make_graph([h.make_node("MatMul", ["x", "W"], ["t"]), h.make_node("Add", ["t", "B"], ["y"])], "lin",
                         [h.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT, [None, 32])],
                         [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    path = folder / "lin.onnx"
    onnx.save(model, path, save_as_external_data=True, location="weights.data", size_threshold=0)
    data = folder / "weights.data"
    past = os.stat(data).st_mtime_ns - 10_000_000_000
    os.utime(data, ns=(past, past))
    return path, data


def _ort(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def _offset(path, name):
    tensor = next(t for t in onnx.load(path, load_external_data=False).graph.initializer if t.name == name)
    return int({e.key: e.value for e in tensor.external_data}["offset"])


def test_an_unchanged_data_file_runs_like_onnxruntime_call_after_call(tmp_path):
    path, _ = _model(tmp_path)
    module = op.import_onnx(path)
    for _ in range(2):
        np.testing.assert_allclose(module(X).to_numpy(), _ort(path), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(module.W.val().to_numpy(), W)  # the weight onnx wrote, read back


def test_a_data_file_edited_in_place_after_import_raises_naming_the_file_and_tensors(tmp_path):
    path, data = _model(tmp_path)
    module = op.import_onnx(path)
    with open(data, "r+b") as f:  # same size, other bytes (NaN) in W
        f.seek(_offset(path, "W"))
        f.write(b"\xff" * 64)
    assert os.path.getsize(data) == W.nbytes + B.nbytes
    with pytest.raises(op.OnnxFormatError, match=rf"external data file '{data}' .*of tensors 'W', 'B' changed on disk "
                                                 r"after the model was imported: it was modified in place \(same size\)"):
        module(X)
    with pytest.raises(op.OnnxFormatError, match=r"of tensor 'W' changed on disk .*import the model again"):
        module.W.val()  # a lazy weight read names its own tensor


def test_a_data_file_edited_after_a_first_call_raises_at_the_next_call(tmp_path):
    path, data = _model(tmp_path)
    module = op.import_onnx(path)
    np.testing.assert_allclose(module(X).to_numpy(), _ort(path), rtol=1e-6, atol=1e-6)
    with open(data, "r+b") as f:
        f.seek(_offset(path, "B"))
        f.write(np.full(32, 7.0, np.float32).tobytes())
    with pytest.raises(op.OnnxFormatError, match=r"modified in place"):
        module(X)  # the cached session holds the old weights: refused, not silently stale


def test_a_data_file_truncated_after_import_raises_naming_the_file_and_sizes(tmp_path):
    path, data = _model(tmp_path)
    module = op.import_onnx(path)
    size = os.path.getsize(data)
    os.truncate(data, size // 2)
    with pytest.raises(op.OnnxFormatError, match=rf"'{data}' .*its size changed from {size} to {size // 2} bytes"):
        module(X)


def test_a_data_file_replaced_after_import_raises(tmp_path):
    path, data = _model(tmp_path)
    module = op.import_onnx(path)
    other = tmp_path / "other.data"
    other.write_bytes((W * 2).tobytes() + B.tobytes())
    os.replace(other, data)  # what `cp` via a temporary file, or a re-export, does
    with pytest.raises(op.OnnxFormatError, match=r"it was replaced by another file"):
        module(X)


def test_a_fresh_import_after_the_change_reads_the_new_weights(tmp_path):
    path, data = _model(tmp_path)
    op.import_onnx(path)
    with open(data, "r+b") as f:
        f.seek(_offset(path, "B"))
        f.write(np.zeros(32, np.float32).tobytes())
    np.testing.assert_allclose(op.import_onnx(path)(X).to_numpy(), X @ W, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_ort(path), X @ W, rtol=1e-5, atol=1e-5)


def test_an_export_after_the_data_file_changed_raises_instead_of_writing_other_weights(tmp_path):
    path, data = _model(tmp_path)
    module = op.import_onnx(path)
    with open(data, "r+b") as f:
        f.seek(_offset(path, "W"))
        f.write(b"\xff" * 64)
    out = tmp_path / "out" / "exported.onnx"
    out.parent.mkdir()
    with pytest.raises(op.OnnxFormatError, match=rf"external data file '{data}' .*modified in place"):
        op.export_onnx(module, out)
    assert not out.exists()
