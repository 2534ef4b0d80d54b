"""Only library errors leave the readers and writers (issue 28's structure-aware fuzz findings,
pinned one by one), and outputs are checked before any work.

Oracles: plain ONNX Runtime on the original file (a valid model still runs as before), the
ONNX spec for sparse tensors (indices inside the dims, one data field), the kernel's errno.
"""

import errno
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.core.errors import FileAccessError, IsAFolderError, OnnxFormatError, OnnxParamError
from onnxparam.onnx_io import export_onnx, import_onnx

TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 4] x) => (float[2, 4] y) <float[4] w = {1, 2, 3, 4}> {
    y = Mul(x, w)
}"""
X = np.arange(8, dtype=np.float32).reshape(2, 4)


def _model():
    return onnx.parser.parse_model(TEXT)


def _external(tmp_path, location):
    model = _model()
    init = model.graph.initializer[0]
    init.ClearField("float_data")
    init.data_location = TensorProto.EXTERNAL
    entry = init.external_data.add()
    entry.key, entry.value = "location", location
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _ort(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def test_external_data_through_a_symlink_leaving_the_folder_is_refused_at_import(tmp_path):
    (tmp_path / "outside.data").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (tmp_path / "m").mkdir()
    os.symlink(tmp_path / "outside.data", tmp_path / "m" / "w.data")
    path = _external(tmp_path / "m", "w.data")
    with pytest.raises(OnnxFormatError, match=r"m\.onnx: the external data file 'w\.data' of initializer 'w' is a "
                                              r"symbolic link to .*outside\.data, outside the model's folder"):
        import_onnx(path)


def test_external_data_through_a_symlink_inside_the_folder_imports_exports_and_runs_as_ort(tmp_path):
    (tmp_path / "real.data").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    os.symlink("real.data", tmp_path / "w.data")
    path = _external(tmp_path, "w.data")
    module = import_onnx(path)
    out = export_onnx(module, tmp_path / "out.onnx")
    np.testing.assert_array_equal(_ort(out), _ort(path))
    np.testing.assert_array_equal(module(X).to_numpy(), _ort(path))


def _sparse_model(tmp_path, indices, dims=(4,), values=(1.0, 2.0), typed_too=False):
    model = _model()
    del model.graph.initializer[:]
    vals = numpy_helper.from_array(np.array(values, np.float32), "w")
    if typed_too:
        vals.float_data.extend([5.0, 6.0])
    idx = numpy_helper.from_array(np.array(indices, np.int64), "")
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(vals, idx, list(dims)))
    path = tmp_path / "s.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("indices, dims, typed_too, message", [
    ([0, 9], (4,), False, r"index 9 lies outside the dims \[4\]"),
    ([-9, 1], (4,), False, r"index -9 lies outside the dims \[4\]"),
    ([0, 1, 2], (4,), False, r"indices \[3\] fit neither \[NNZ\] nor \[NNZ, rank\] for 2 values"),
    ([[0, 5], [1, 1]], (2, 2), False, r"index \[0, 5\] lies outside the dims \[2, 2\]"),
    ([[0, 1, 1], [1, 1, 0]], (2, 2), False, r"indices \[2, 3\] fit neither"),
    ([0, 1], (4,), True, r"its values hold both raw_data and a typed data field"),
    ([0, 1], (2**40,), False, r"dims \[1099511627776\] expand to 4398046511104 bytes, more than the"),
])
def test_an_inconsistent_sparse_initializer_is_a_format_error_naming_file_and_tensor(tmp_path, indices, dims,
                                                                                     typed_too, message):
    path = _sparse_model(tmp_path, indices, dims, typed_too=typed_too)
    with pytest.raises(OnnxFormatError, match=rf"s\.onnx: sparse initializer 'w': {message}"):
        import_onnx(path)


def test_a_valid_sparse_initializer_still_imports_as_ort_runs_it(tmp_path):
    path = _sparse_model(tmp_path, [[0, 1], [1, 0]], dims=(2, 2))
    model = onnx.load(str(path))
    model.graph.node[0].input[1] = "w"
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 2
    onnx.save(model, str(path))
    x = X[:, :2].copy()
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(import_onnx(path)(x).to_numpy(), expected)


def test_a_full_disk_the_adapter_writer_is_told_only_generically_is_named_as_a_full_disk(tmp_path, monkeypatch):
    onnxruntime = pytest.importorskip("onnxruntime")
    from onnxparam import write_onnx_adapter

    path = tmp_path / "a.onnx_adapter"
    write_onnx_adapter({"w.lora.a": np.ones((2, 1), np.float32)}, path)
    before = path.read_bytes()

    def export(self, target):  # what ORT says when its write fails, whatever the cause
        raise onnxruntime.capi.onnxruntime_pybind11_state.Fail("adapter.cc:45 Save failed to write the file")

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(onnxruntime.AdapterFormat, "export_adapter", export)
    monkeypatch.setattr(os, "statvfs", lambda folder: Full())
    with pytest.raises(FileAccessError) as info:
        write_onnx_adapter({"w.lora.a": np.zeros((2, 1), np.float32)}, path)
    assert info.value.errno == errno.ENOSPC
    assert f"writing '{path}'" in str(info.value) and "is full" in str(info.value)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["a.onnx_adapter"]


def _cli(capsys, *args):
    from onnxparam.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def small_onnx(tmp_path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "fc.weight")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "fc.weight"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [w])
    path = tmp_path / "in.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_quantize_into_a_folder_or_over_its_input_fails_before_quantizing(small_onnx, tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("quantized before the output was checked")

    monkeypatch.setattr(op.Module, "quantize_weights", never)
    (tmp_path / "out.onnx").mkdir()
    code, out, err = _cli(capsys, "quantize", small_onnx, tmp_path / "out.onnx")
    assert code != 0 and "is a folder" in err and "quantized:" not in out
    before = small_onnx.read_bytes()
    code, out, err = _cli(capsys, "quantize", small_onnx, small_onnx)
    assert code != 0 and "same file" in err and small_onnx.read_bytes() == before
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "q.onnx").write_bytes(b"old")
    (tmp_path / "ro" / "q.onnx").chmod(0o444)
    code, out, err = _cli(capsys, "quantize", small_onnx, tmp_path / "ro" / "q.onnx")
    assert code != 0 and "read-only" in err and (tmp_path / "ro" / "q.onnx").read_bytes() == b"old"


def test_convert_of_a_folder_named_like_a_weights_file_is_a_folder_error(tmp_path):
    from onnxparam.convert import convert

    (tmp_path / "d.bpk").mkdir()
    with pytest.raises(IsAFolderError):
        convert(tmp_path / "d.bpk", tmp_path / "x.safetensors")
    with pytest.raises(OnnxParamError, match=r"extension '\.txt'"):
        convert(tmp_path / "d.bpk", tmp_path / "x.txt")


def test_a_data_file_turned_into_an_outside_symlink_after_import_is_an_export_format_error(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.data").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    path = _external(tmp_path / "m", "w.data")
    module = import_onnx(path)
    (tmp_path / "outside.data").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (tmp_path / "m" / "w.data").unlink()
    os.symlink(tmp_path / "outside.data", tmp_path / "m" / "w.data")
    with pytest.raises(OnnxParamError):  # the data watch (file replaced) or the symlink refusal: a library error
        export_onnx(module, tmp_path / "out.onnx")
