"""Deliberate file errors are library errors that are also the builtin OSError subclass of
their errno (the README: everything raised on purpose is an OnnxParamError)."""

import errno
import os
import stat

import pytest

import onnxparam as op
from onnxparam import nn
from onnxparam.convert import convert


def test_saving_into_a_missing_folder_is_a_library_error_and_a_file_not_found_error(tmp_path):
    with pytest.raises(op.FileAccessError) as info:
        nn.Linear(2, 2).save_file(tmp_path / "nodir" / "model")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, op.OnnxParamError)
    assert info.value.errno == errno.ENOENT and "does not exist (create it first)" in str(info.value)


def test_overwriting_a_read_only_file_is_a_library_error_and_a_permission_error(tmp_path):
    target = tmp_path / "model.bpk"
    nn.Linear(2, 2).save_file(tmp_path / "model")
    before = target.read_bytes()
    os.chmod(target, stat.S_IRUSR)
    with pytest.raises(op.FileAccessError) as info:
        nn.Linear(2, 2).save_file(tmp_path / "model")
    assert isinstance(info.value, PermissionError) and "is read-only" in str(info.value)
    assert target.read_bytes() == before


def test_converting_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "absent.bpk"
    with pytest.raises(op.FileAccessError, match="no such file") as info:
        convert(missing, tmp_path / "out.safetensors")
    assert isinstance(info.value, FileNotFoundError) and info.value.filename == os.fspath(missing)


def test_file_error_builds_the_leaf_of_each_errno():
    from onnxparam.core.errors import file_error

    cases = {errno.ENOENT: FileNotFoundError, errno.EACCES: PermissionError, errno.EISDIR: IsADirectoryError,
             errno.ENOTDIR: NotADirectoryError, errno.ENOSPC: OSError}
    for code, builtin in cases.items():
        error = file_error(code, "message", "f")
        assert isinstance(error, builtin) and isinstance(error, op.OnnxParamError) and error.errno == code
