"""Module.save_file / load_file and the file's format: burnpack only, other formats pointed elsewhere.

``save_file`` writes burnpack; a ``.onnx`` or ``.safetensors`` name would give a burnpack under
the wrong name, so it is refused with the function that writes that format. ``load_file`` reads
burnpack; a real safetensors or ONNX file given to it is answered with the function that reads
it (checked here by calling that function on the same file). Permissions and folders on save:
``tests/test_write_faults.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxparam
import onnxparam.burnpack as bp
from onnxparam import Module, RecordError, Tensor
from onnxparam.convert import load_safetensors, save_safetensors
from onnxparam.nn import Linear
from onnxparam.onnx_io import read_onnx_record


class Net(Module):
    def __init__(self):
        self.fc = Linear(3, 2)

    def forward(self, x):
        return self.fc(x)


def _arrays() -> dict:
    rng = np.random.default_rng(7)
    return {"fc.weight": rng.standard_normal((3, 2)).astype(np.float32),
            "fc.bias": rng.standard_normal(2).astype(np.float32)}


def _net() -> Net:
    arrays = _arrays()
    return Net().map(lambda p, param: param.map(lambda t: Tensor.from_numpy(arrays[p])))


def _values(module: Module) -> dict:
    return {p: np.asarray(param.val().to_numpy()) for p, param in module.named_params()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name, hint", [
    ("weird.onnx", "export ONNX with onnxparam.export_onnx(module, path, *example_inputs)"),
    ("w.safetensors", "write safetensors with onnxparam.convert.save_safetensors(module, path)"),
    ("W.SAFETENSORS", "write safetensors with onnxparam.convert.save_safetensors(module, path)"),
])
def test_save_file_refuses_an_onnx_or_safetensors_name_and_names_the_right_writer(tmp_path, monkeypatch, name, hint):
    monkeypatch.chdir(tmp_path)
    suffix = Path(name).suffix
    with pytest.raises(RecordError) as info:
        _net().save_file(name)
    assert str(info.value) == (
        f"cannot save '{name}': save_file writes burnpack (.bpk) files, and a '{suffix}' name would hold "
        f"burnpack bytes; {hint}, or use a '.bpk' name")
    assert list(tmp_path.iterdir()) == []


def test_load_file_on_a_safetensors_file_names_load_safetensors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_safetensors(_net(), "w.safetensors")
    before = Path("w.safetensors").read_bytes()
    with pytest.raises(RecordError) as info:
        Net().load_file("w.safetensors")
    assert str(info.value) == (
        "cannot load 'w.safetensors': it is not a burnpack (.bpk) file, which is all load_file reads; for a "
        "safetensors file, use onnxparam.convert.load_safetensors(module, 'w.safetensors')")
    assert isinstance(info.value.__cause__, onnxparam.BurnpackFormatError)
    assert Path("w.safetensors").read_bytes() == before
    # the suggested call reads the file: the values written, not the module's fresh init
    assert _same(_values(load_safetensors(Net(), "w.safetensors")), _arrays())


def test_load_file_on_an_onnx_file_names_import_onnx_and_read_onnx_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    onnxparam.export_onnx(_net(), "m.onnx", Tensor.from_numpy(np.ones((1, 3), np.float32)))
    with pytest.raises(RecordError) as info:
        Net().load_file("m.onnx")
    assert str(info.value) == (
        "cannot load 'm.onnx': it is not a burnpack (.bpk) file, which is all load_file reads; for an ONNX "
        "file, use onnxparam.import_onnx('m.onnx'), or "
        "module.load_record(onnxparam.onnx_io.read_onnx_record('m.onnx'))")
    # the suggested calls read the file
    assert _same(_values(Net().load_record(read_onnx_record("m.onnx"))), _arrays())
    assert onnxparam.import_onnx("m.onnx") is not None


def test_load_file_still_reads_a_burnpack_saved_under_an_onnx_name(tmp_path):
    # NOTE: earlier versions let save_file write such files; the bytes decide, not the name.
    path = tmp_path / "legacy.onnx"
    bp.write(path, [bp.TensorEntry.from_numpy(k, v) for k, v in _arrays().items()])
    assert _same(_values(Net().load_file(path)), _arrays())


def test_load_file_on_a_malformed_bpk_keeps_the_burnpack_error(tmp_path):
    path = tmp_path / "w.bpk"
    path.write_bytes(b"\x80\x05" + bytes(30))
    with pytest.raises(onnxparam.BurnpackFormatError, match="not a burnpack file"):
        Net().load_file(path)


def test_save_file_then_load_file_round_trips_and_appends_bpk(tmp_path):
    written = _net().save_file(tmp_path / "w")
    assert written == tmp_path / "w.bpk"
    assert _same(_values(Net().load_file(tmp_path / "w")), _arrays())
