"""convert: tensors that move unchanged are copied file to file by the kernel; the files hold
the values an independent reader (safetensors, onnx, torch) reads, and the copies are spied on."""

from __future__ import annotations

import errno
import os
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from safetensors.numpy import load_file

from onnxparam import burnpack
from onnxparam.convert import convert
from onnxparam.formats import _file_range

BIG = (256, 1024)  # 1 MiB of float32: above the kernel-copy threshold


def arrays() -> dict:
    rng = np.random.default_rng(7)
    return {
        "fc.weight": rng.standard_normal(BIG, dtype=np.float32),
        "fc.bias": np.arange(1024, dtype=np.float32) / 3,  # 4 KiB: written the ordinary way
        "emb.weight": (np.arange(512 * 512) % 251).astype(np.float16).reshape(512, 512),
        "steps": np.arange(70_000, dtype=np.int64),
        "mask": np.arange(300_000) % 3 == 0,  # Bool: never copied as bytes (stores differ)
    }


def write_bpk(path, tensors: dict) -> None:
    burnpack.write(path, [burnpack.TensorEntry.from_numpy(n, a, param_id=i + 1) for i, (n, a) in enumerate(tensors.items())])


@pytest.fixture
def spy(monkeypatch):
    """Bytes each kernel copy moved, in order."""
    moved = []
    real = _file_range._copy

    def counting(src, dst, offset, count):
        moved.append(count)
        return real(src, dst, offset, count)

    monkeypatch.setattr(_file_range, "_copy", counting)
    return moved


def onnx_arrays(path) -> dict:
    """The initializers as onnx itself reads them, in file order."""
    model = onnx.load(path)
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def test_bpk_to_safetensors_copies_the_big_tensors_and_safetensors_reads_the_same_values(tmp_path, spy):
    want = arrays()
    write_bpk(tmp_path / "m.bpk", want)
    convert(tmp_path / "m.bpk", tmp_path / "m.safetensors")
    got = load_file(tmp_path / "m.safetensors")
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    assert sorted(spy) == sorted([want["fc.weight"].nbytes, want["emb.weight"].nbytes, want["steps"].nbytes])


def test_every_pair_of_formats_keeps_the_values_and_moves_big_tensors_by_kernel_copy(tmp_path, spy):
    want = arrays()
    write_bpk(tmp_path / "m.bpk", want)
    convert(tmp_path / "m.bpk", tmp_path / "m.onnx")
    convert(tmp_path / "m.onnx", tmp_path / "from_onnx.safetensors")
    convert(tmp_path / "from_onnx.safetensors", tmp_path / "back.bpk")
    convert(tmp_path / "m.bpk", tmp_path / "m.safetensors")
    convert(tmp_path / "m.safetensors", tmp_path / "from_st.onnx")
    convert(tmp_path / "m.onnx", tmp_path / "from_onnx.bpk")
    for path in ("m.onnx", "from_st.onnx"):
        got = onnx_arrays(tmp_path / path)  # initializers in data order
        assert len(got) == len(want)
        for (name, array), value in zip(want.items(), got.values()):
            np.testing.assert_array_equal(value, array, err_msg=f"{path}: {name}")
    got = load_file(tmp_path / "from_onnx.safetensors")
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    # the Burn-written original comes back byte for byte through every format
    original = (tmp_path / "m.bpk").read_bytes()
    assert (tmp_path / "back.bpk").read_bytes() == original
    assert (tmp_path / "from_onnx.bpk").read_bytes() == original
    assert len(spy) == 6 * 3 and set(spy) == {want["fc.weight"].nbytes, want["emb.weight"].nbytes,
                                              want["steps"].nbytes}


def test_a_cast_or_transposed_tensor_is_computed_not_copied(tmp_path, spy):
    want = arrays()
    write_bpk(tmp_path / "m.bpk", want)
    convert(tmp_path / "m.bpk", tmp_path / "m.safetensors", cast={"f32": "f16"}, transpose=[r"^emb\.weight$"])
    got = load_file(tmp_path / "m.safetensors")
    np.testing.assert_array_equal(got["fc.weight"], want["fc.weight"].astype(np.float16))
    np.testing.assert_array_equal(got["emb.weight"], want["emb.weight"].T)
    assert spy == [want["steps"].nbytes]


@pytest.mark.parametrize("missing", ["copy_file_range", "both"])
def test_without_kernel_copies_the_bytes_are_copied_through_user_space(tmp_path, monkeypatch, missing):
    def refuse(*args, **kwargs):
        raise OSError(errno.EXDEV if missing == "copy_file_range" else errno.ENOSYS, "refused")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    if missing == "both":
        monkeypatch.setattr(os, "sendfile", refuse, raising=False)
    want = arrays()
    write_bpk(tmp_path / "m.bpk", want)
    convert(tmp_path / "m.bpk", tmp_path / "m.safetensors")
    got = load_file(tmp_path / "m.safetensors")
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_a_source_that_shrank_since_it_was_read_is_a_library_error_naming_it(tmp_path):
    from onnxparam.core.errors import RecordError

    path = tmp_path / "m.bin"
    path.write_bytes(bytes(1000))
    with open(tmp_path / "out", "wb") as out, pytest.raises(RecordError, match="m.bin.*past its end"):
        _file_range.copy_range(out, _file_range.FileRange(str(path), 500, 1000))


# -- .pt sources -----------------------------------------------------------------------------


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_pt_contiguous_tensors_are_copied_and_strided_ones_computed_with_torchs_values(tmp_path, spy, zip_format):
    torch = pytest.importorskip("torch")
    base = torch.arange(2 * 300 * 1024, dtype=torch.float32).reshape(600, 1024)
    state = {
        "contiguous": torch.randn(512, 1024),
        "offset_slice": base[300:],  # contiguous, storage offset 300 * 1024 elements
        "transposed": base[:300].t(),  # strided: copied out
    }
    torch.save(state, tmp_path / "m.pt", _use_new_zipfile_serialization=zip_format)
    convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    got = load_file(tmp_path / "m.safetensors")
    for name, tensor in state.items():
        np.testing.assert_array_equal(got[name], tensor.numpy(), err_msg=name)
    assert sorted(spy) == sorted([512 * 1024 * 4, 300 * 1024 * 4])


def test_pt_strided_tensors_are_copied_when_looked_up_not_when_read(tmp_path):
    torch = pytest.importorskip("torch")
    from onnxparam.formats import read_pytorch

    n = 1024
    big = torch.arange(n * n, dtype=torch.float32).reshape(n, n)  # 4 MiB
    state = {f"t{i}": (big + i).t() for i in range(4)}  # four strided views, 16 MiB of copies in all
    state["tied_a"] = state["t0"]
    torch.save(state, tmp_path / "m.pt")
    tracemalloc.start()
    try:
        checkpoint = read_pytorch(tmp_path / "m.pt")
        _, read_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        lazy = checkpoint.tensors
        assert [lazy.is_lazy_copy(name) for name in lazy] == [True] * 5
        assert lazy.shape("t1") == (n, n) and lazy.dtype("t1") == np.float32
        for name in ("t0", "t1", "t2", "t3"):
            value = lazy[name]
            assert np.array_equal(value, state[name].numpy()), name  # a 1 MiB bool array besides
            del value
        _, walk_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read_peak < 1 << 20  # nothing copied when the file is read
    assert walk_peak < 1.5 * 4 * n * n  # one 4 MiB copy held at a time, not 16 MiB
    held = lazy["t0"]
    assert lazy["tied_a"] is held  # tied names: one array while it lives
    assert not held.flags.writeable
