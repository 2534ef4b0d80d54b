"""Saving into a folder that exists but takes no new files (``/proc``), or under a path whose
parent is a file, is refused with a library error that says so (fresh-user report 5, 7a):
never "the folder does not exist" for a folder that is there, never a bare OSError."""

import errno
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxparam as op
from onnxparam import nn

PROC = "/proc"
needs_proc = pytest.mark.skipif(not os.path.isdir(PROC) or os.name != "posix", reason="needs Linux /proc")


def _imported(tmp_path):
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 2], np.arange(6, dtype=np.float32).tolist())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return op.import_onnx(path), op.Tensor.from_numpy(np.ones((1, 3), np.float32))


def _refuses_new_files(folder):
    try:
        fd = os.open(os.path.join(folder, ".onnxparam-probe"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError:
        return True
    os.close(fd)  # pragma: no cover - a /proc that takes files
    os.unlink(os.path.join(folder, ".onnxparam-probe"))
    return False


@needs_proc
@pytest.mark.parametrize("name", ["x.onnx", "sub/x.onnx"])
def test_export_into_proc_says_the_folder_is_not_writable(tmp_path, name):
    if not _refuses_new_files(PROC):  # pragma: no cover
        pytest.skip("/proc takes new files here")
    module, x = _imported(tmp_path)
    target = os.path.join(PROC, name)
    with pytest.raises(op.FileAccessError) as info:
        op.export_onnx(module, target, x)
    message = str(info.value)
    assert isinstance(info.value, PermissionError) and info.value.errno == errno.EACCES
    assert f"'{target}'" in message and "'/proc' is not writable" in message
    assert "does not exist" not in message


@needs_proc
def test_burnpack_save_into_proc_says_the_folder_is_not_writable():
    if not _refuses_new_files(PROC):  # pragma: no cover
        pytest.skip("/proc takes new files here")
    with pytest.raises(op.FileAccessError, match="'/proc' is not writable") as info:
        nn.Linear(2, 2).save_file(os.path.join(PROC, "model"))
    assert "does not exist" not in str(info.value) and isinstance(info.value, PermissionError)


@pytest.mark.parametrize("below", ["x.onnx", "sub/x.onnx"])
def test_export_below_a_file_names_that_file(tmp_path, below):
    module, x = _imported(tmp_path)
    blocker = tmp_path / "afile"
    blocker.write_bytes(b"")
    target = blocker / below
    with pytest.raises(op.FileAccessError) as info:
        op.export_onnx(module, target, x)
    assert isinstance(info.value, NotADirectoryError) and info.value.errno == errno.ENOTDIR
    assert f"'{blocker}' is a file, not a folder" in str(info.value) and str(target) in str(info.value)
    assert blocker.read_bytes() == b"" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "m.onnx"]


def test_export_still_creates_missing_folders(tmp_path):
    module, x = _imported(tmp_path)
    target = tmp_path / "a" / "b" / "x.onnx"
    op.export_onnx(module, target, x)
    ort = pytest.importorskip("onnxruntime")
    got = ort.InferenceSession(str(target)).run(None, {"x": np.ones((1, 3), np.float32)})[0]
    np.testing.assert_allclose(got, np.ones((1, 3), np.float32) @ np.arange(6, dtype=np.float32).reshape(3, 2))
