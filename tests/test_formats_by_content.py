"""Files are read by their content, not their name (issue 28): burnpack, safetensors, ONNX and the
three containers ``torch.save`` has written (zip, legacy stream, legacy tar); the extension only
picks the writer. A folder or a file of no known format is a library error naming what was found.

Oracles: ``torch.load`` (each legacy file is first checked to be one torch itself reads), the
``safetensors`` package's own reader of what we write, and the bytes torch holds.
"""

import os
import shutil

import numpy as np
import pytest

import onnxparam as op
from onnxparam.convert import convert, read_record
from onnxparam.core.errors import FileMissingError, IsAFolderError, OnnxParamError, RecordError

torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from torch_legacy_files import save_legacy_tar  # noqa: E402


def _state():
    torch.manual_seed(0)
    w = torch.randn(3, 4)
    return {"fc.weight": w, "fc.bias": torch.randn(3), "fc_t": w.t(), "tied": w, "half": torch.randn(5).half(),
            "idx": torch.arange(6).reshape(2, 3), "flags": torch.tensor([True, False, True]),
            "viewed": torch.randn(2, 2)}


def _as_numpy(t):
    return np.ascontiguousarray(t.numpy())


def _check_bit_exact(path, state, tmp_path):
    """``path`` converted to safetensors: the safetensors package reads back torch's bytes."""
    out = tmp_path / (path.name + ".safetensors")
    convert(path, out, lossless=False)
    got = safetensors_numpy.load_file(str(out))
    assert set(got) == set(state)
    for name, t in state.items():
        expected = _as_numpy(t)
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        assert got[name].tobytes() == expected.tobytes(), name


@pytest.mark.parametrize("kind", ["zip", "stream", "tar"])
def test_every_torch_container_reads_bit_exact_whatever_its_name(kind, tmp_path):
    state = _state()
    path = tmp_path / f"ckpt_{kind}.tar"
    if kind == "tar":
        save_legacy_tar(torch, state, path, views=("viewed",))
    else:
        torch.save(state, path, _use_new_zipfile_serialization=(kind == "zip"))
    loaded = torch.load(path, weights_only=False)  # the oracle: torch reads the file we built
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    _check_bit_exact(path, state, tmp_path)
    renamed = tmp_path / f"weights_{kind}.bin"
    shutil.copy(path, renamed)
    rec = read_record(renamed)
    np.testing.assert_array_equal(rec["fc_t"].to_data().to_numpy(), state["fc.weight"].numpy().T)


def test_a_legacy_tar_loads_into_a_module_as_torch_has_it(tmp_path):
    from onnxparam import nn
    from onnxparam.convert import load_pytorch

    lin = torch.nn.Linear(4, 3)
    save_legacy_tar(torch, lin.state_dict(), tmp_path / "old.tar")
    layer = load_pytorch(nn.Linear(4, 3), tmp_path / "old.tar")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(layer(op.Tensor.from_numpy(x)).to_numpy(), lin(torch.from_numpy(x)).numpy(),
                                   rtol=1e-6, atol=1e-6)


def test_burnpack_safetensors_and_onnx_are_read_by_their_bytes_under_any_name(tmp_path):
    state = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], dtype=np.int64)}
    safetensors_numpy.save_file(state, str(tmp_path / "s.safetensors"))
    convert(tmp_path / "s.safetensors", tmp_path / "b.bpk")
    convert(tmp_path / "s.safetensors", tmp_path / "o.onnx")
    for name in ("s.safetensors", "b.bpk", "o.onnx"):
        for disguise in ("x.onnx", "x.bpk", "x.safetensors", "x.pt", "noext"):
            if name.endswith(disguise.rpartition(".")[2]) and "." in disguise:
                continue
            wrong = tmp_path / f"{name}-{disguise}"
            shutil.copy(tmp_path / name, wrong)
            rec = read_record(wrong)
            for key, value in state.items():
                np.testing.assert_array_equal(rec[key].to_data().to_numpy(), value, err_msg=f"{name} as {disguise}")
            convert(wrong, tmp_path / "back.safetensors", lossless=False)
            back = safetensors_numpy.load_file(str(tmp_path / "back.safetensors"))
            assert all(np.array_equal(back[k], v) for k, v in state.items())


def test_a_file_of_no_known_format_is_a_library_error_naming_what_was_found(tmp_path):
    (tmp_path / "notes.bpk").write_text("hello, these are not weights\n")
    with pytest.raises(RecordError, match=r"not a weights file.*starting with 'hello, these are'"):
        read_record(tmp_path / "notes.bpk")
    (tmp_path / "zeros.pt").write_bytes(bytes(40))
    with pytest.raises(RecordError, match=r"40 bytes starting with 00 00"):
        convert(tmp_path / "zeros.pt", tmp_path / "z.bpk")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(RecordError, match="an empty file"):
        read_record(tmp_path / "empty.safetensors")
    with pytest.raises(FileMissingError):
        convert(tmp_path / "missing.bpk", tmp_path / "m.onnx")
    assert not (tmp_path / "z.bpk").exists()


def test_folders_and_unwritable_targets_are_library_errors_before_any_work(tmp_path):
    safetensors_numpy.save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "p.safetensors"))
    convert(tmp_path / "p.safetensors", tmp_path / "p.bpk")
    (tmp_path / "d.bpk").mkdir()
    with pytest.raises(IsAFolderError, match="folder"):
        convert(tmp_path / "d.bpk", tmp_path / "out.safetensors")
    with pytest.raises(IsAFolderError, match="folder"):
        convert(tmp_path / "p.bpk", tmp_path / "d.bpk")
    with pytest.raises(IsAFolderError):
        read_record(tmp_path / "d.bpk")
    with pytest.raises(RecordError, match=r"extension '\.txt'"):
        convert(tmp_path / "p.bpk", tmp_path / "x.txt")
    with pytest.raises(OnnxParamError):
        convert(tmp_path / "p.bpk", tmp_path / "p.bpk")
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "x.txt").exists()


def test_the_cli_says_a_folder_is_a_folder_and_reads_a_tar_checkpoint(tmp_path, capsys):
    from onnxparam.cli import main

    (tmp_path / "sp ace").mkdir()
    assert main(["inspect", str(tmp_path / "sp ace")]) != 0
    assert "is a folder" in capsys.readouterr().err
    save_legacy_tar(torch, {"w": torch.arange(4.0)}, tmp_path / "old.tar")
    assert main(["convert", str(tmp_path / "old.tar"), str(tmp_path / "old.safetensors"), "-q"]) == 0
    assert safetensors_numpy.load_file(str(tmp_path / "old.safetensors"))["w"].tolist() == [0, 1, 2, 3]
    assert main(["inspect", str(tmp_path / "old.tar")]) == 0
    assert "pytorch" in capsys.readouterr().out


# The cases of Burn's burn-store legacy-tar reader fixtures (tar_float32 ... tar_2d_tensor): the same
# names, dtypes and values, laid out by tests/torch_legacy_files.py and checked by torch.load.
BURN_TAR_CASES = {
    "float32": {"tensor": ("float32", [1.0, 2.5, -3.7, 0.0], [4])},
    "float64": {"tensor": ("float64", [1.1, 2.2, 3.3], [3])},
    "int64": {"tensor": ("int64", [100, -200, 300, 0], [4])},
    "weight_bias": {"weight": ("float32", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [2, 3]), "bias": ("float32", [0.01, 0.02], [2])},
    "multi_dtype": {"float_tensor": ("float32", [1.5, 2.5, 3.5], [3]), "double_tensor": ("float64", [1.111, 2.222], [2]),
                    "int_tensor": ("int64", [10, 20, 30, 40], [4])},
    "2d_tensor": {"matrix": ("float32", [float(v) for v in range(1, 13)], [3, 4])},
}


@pytest.mark.parametrize("case", sorted(BURN_TAR_CASES) + ["storage_view"])
def test_burns_legacy_tar_reader_cases_read_bit_exact(case, tmp_path):
    if case == "storage_view":
        root = torch.arange(8, dtype=torch.float32)
        state = {"window": root[2:6].view(2, 2)}
        save_legacy_tar(torch, state, tmp_path / f"tar_{case}.tar", views=("window",))
    else:
        state = {name: torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
                 for name, (dtype, values, shape) in BURN_TAR_CASES[case].items()}
        save_legacy_tar(torch, state, tmp_path / f"tar_{case}.tar")
    loaded = torch.load(tmp_path / f"tar_{case}.tar", weights_only=False)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    _check_bit_exact(tmp_path / f"tar_{case}.tar", state, tmp_path)
