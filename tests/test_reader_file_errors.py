"""Every public reader, given a missing path or a folder, raises the library's file error (README
"Errors": ``FileMissingError``, also a ``FileNotFoundError``; ``IsAFolderError``, also an
``IsADirectoryError``) naming the path; and a file of another known format given to the ONNX
importer (or an ONNX Runtime adapter file given anywhere) says what it is.

Oracles: the builtin ``OSError`` leaf and the POSIX ``errno`` of each case (the spec), the
bytes of files written by the numpy ``safetensors`` package, ``torch.save`` and ONNX Runtime's
own ``AdapterFormat``, not by this library."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import onnxparam as op
from onnxparam import burnpack, nn, onnx_io
from onnxparam.convert import convert, load_onnx, load_pytorch, load_safetensors, read_record
from onnxparam.formats import read_pytorch, read_safetensors

_READERS = {
    "import_onnx": op.import_onnx,
    "read_onnx_record": onnx_io.read_onnx_record,
    "Module.load_file": lambda p: nn.Linear(2, 3).load_file(p),
    "Module.try_load_file": lambda p: nn.Linear(2, 3).try_load_file(p, allow_partial=True),
    "Module.load_record(path)": lambda p: nn.Linear(2, 3).load_record(p),
    "load_safetensors": lambda p: load_safetensors(nn.Linear(2, 3), p),
    "load_pytorch": lambda p: load_pytorch(nn.Linear(2, 3), p),
    "load_onnx": lambda p: load_onnx(nn.Linear(2, 3), p),
    "read_safetensors": read_safetensors,
    "read_pytorch": read_pytorch,
    "burnpack.read": burnpack.read,
    "read_record": read_record,
    "convert": lambda p: convert(p, os.path.join(os.path.dirname(os.fspath(p)), "out.safetensors")),
    "check_onnx_adapter(adapter)": lambda p: op.check_onnx_adapter(p, p),
    # (config, weights) given as two paths: the first one is the missing file / the folder
    "load_peft_adapter(files)": lambda p: op.load_peft_adapter(nn.Linear(2, 3), (p, os.fspath(p) + ".safetensors")),
}
# NOTE: the PEFT loaders take a folder, so only a missing path applies to them as a folder path;
# given as a pair of files, a folder in place of a file is refused as every reader does.
_MISSING_ONLY = {
    "load_peft_adapter(folder)": lambda p: op.load_peft_adapter(nn.Linear(2, 3), p),
    "load_peft_adapters": lambda p: op.load_peft_adapters(nn.Linear(2, 3), p),
}


@pytest.mark.parametrize("name", sorted(_READERS) + sorted(_MISSING_ONLY))
def test_a_missing_path_is_a_file_missing_error_naming_it(name, tmp_path):
    reader = {**_READERS, **_MISSING_ONLY}[name]
    missing = tmp_path / "nope.bin"
    with pytest.raises(op.OnnxParamError) as info:
        reader(missing)
    error = info.value
    assert isinstance(error, FileNotFoundError) and type(error).__name__ == "FileMissingError", (name, repr(error))
    assert error.errno == errno.ENOENT
    assert os.fspath(missing) in str(error) and error.filename == os.fspath(missing)


@pytest.mark.parametrize("name", sorted(_READERS))
def test_a_folder_is_an_is_a_folder_error_naming_it(name, tmp_path):
    folder = tmp_path / "weights.onnx"  # a folder whatever its name says
    folder.mkdir()
    with pytest.raises(op.OnnxParamError) as info:
        _READERS[name](folder)
    error = info.value
    assert isinstance(error, IsADirectoryError) and type(error).__name__ == "IsAFolderError", (name, repr(error))
    assert error.errno == errno.EISDIR
    assert os.fspath(folder) in str(error) and error.filename == os.fspath(folder)


def _safetensors_file(path):
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 3), np.float32)}, os.fspath(path))
    return path


def _pytorch_file(path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.zeros(2, 3)}, os.fspath(path))
    return path


def _burnpack_file(path):
    # a real burnpack (save_file), renamed; its first bytes are the spec's magic "NRUB"
    saved = nn.Linear(2, 3).save_file(path.with_suffix(".bpk"))
    os.replace(saved, path)
    assert path.read_bytes()[:4] == b"NRUB"
    return path


@pytest.mark.parametrize("fmt, make, reader", [
    ("burnpack", _burnpack_file, "Module.load_file"),
    ("safetensors", _safetensors_file, "load_safetensors"),
    ("PyTorch", _pytorch_file, "load_pytorch"),
])
def test_import_onnx_of_another_format_names_it_and_its_reader(fmt, make, reader, tmp_path):
    path = make(tmp_path / "model.onnx")  # named .onnx: the content decides
    for read in (op.import_onnx, onnx_io.read_onnx_record):
        with pytest.raises(op.OnnxFormatError) as info:
            read(path)
        message = str(info.value)
        assert f"'{path}' is a {fmt}" in message and "not ONNX" in message and reader in message, message
        assert "truncated" not in message


def _ort_adapter(path):
    ort = pytest.importorskip("onnxruntime")
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({"w.lora.a": ort.OrtValue.ortvalue_from_numpy(np.zeros((3, 2), np.float32))})
    fmt.export_adapter(os.fspath(path))
    return path


def test_an_onnx_runtime_adapter_file_is_named_by_every_reader_and_listed_by_inspect(tmp_path, capsys):
    from onnxparam.cli import main

    path = _ort_adapter(tmp_path / "lora.onnx_adapter")
    for read in (op.import_onnx, lambda p: nn.Linear(2, 3).load_file(p), read_record):
        with pytest.raises(op.OnnxParamError, match="is an ONNX Runtime LoRA adapter file .*check_onnx_adapter"):
            read(path)
    assert main(["inspect", os.fspath(path)]) == 0  # inspect lists its factors (tests/test_inspect_onnx_adapter.py)
    out = capsys.readouterr().out
    assert "ONNX Runtime LoRA adapter" in out and "w.lora.a" in out and "[3, 2]" in out


def test_the_safetensors_and_pytorch_readers_name_a_file_of_another_format(tmp_path):
    bpk = _burnpack_file(tmp_path / "w.safetensors")
    with pytest.raises(op.RecordError, match=r"is a burnpack file, not safetensors; use Module\.load_file"):
        load_safetensors(nn.Linear(2, 3), bpk)
    st = _safetensors_file(tmp_path / "w.pt")
    with pytest.raises(op.RecordError, match=r"is a safetensors file, not PyTorch \(torch\.save\); use onnxparam\.convert\.load_safetensors"):
        load_pytorch(nn.Linear(2, 3), st)
