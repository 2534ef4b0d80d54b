"""A lazily loaded file changed on disk: in place raises, atomic replacement goes on silently.

Lazily loaded tensors are views of a memory map, which shows the file's *current* bytes. A file
overwritten in place after loading (``cp other.bpk ckA.bpk``) would give the other file's
weights without a word, and a truncated one would kill Python with SIGBUS on the first read.
The readers record the mapped file's size and modification time when it is opened and check
them (one ``fstat``) before every tensor read: a change raises, naming the file. An atomic
replacement (``save_file`` writes beside and renames) leaves the mapped file intact: the old
module keeps returning the weights it was loaded with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from onnxparam import BurnpackFormatError, Module, Param, ParamId, RecordError, Tensor
from onnxparam.convert import load_safetensors, save_safetensors

SHAPE = (256, 256)  # 256 KiB per tensor: pages wholly past a truncated end (SIGBUS without the check)
CHANGED = "changed on disk after it was opened"
AGAIN = "its tensors can no longer be read safely: load the file again"


class Pair(Module):
    def __init__(self, w: np.ndarray, b: np.ndarray):
        # fixed ids: two checkpoints of the same shapes are then exactly the same size
        self.w = Param.initialized(ParamId(1), Tensor.from_numpy(w))
        self.b = Param.initialized(ParamId(2), Tensor.from_numpy(b))

    def forward(self, x):
        return x


def _arrays(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(SHAPE).astype(np.float32),
            "b": rng.standard_normal(SHAPE).astype(np.float32)}


def _module(arrays: dict) -> Pair:
    return Pair(arrays["w"], arrays["b"])


def _template() -> Pair:
    return Pair(np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32))


def _value(param) -> np.ndarray:
    return np.array(param.val().to_numpy(), copy=True)


def _save(kind: str, module: Module, path):
    if kind == "burnpack":
        module.save_file(path)
    else:
        save_safetensors(module, path)


def _load(kind: str, path) -> Module:
    if kind == "burnpack":
        return _template().load_file(path)
    module = load_safetensors(_template(), path)
    return module


def _overwrite_in_place(source, target) -> None:
    """``cp source target``: same inode, new bytes; a later modification time than the load's."""
    before = os.stat(target)
    time.sleep(0.05)  # beyond the file system's timestamp granularity
    shutil.copyfile(source, target)
    after = os.stat(target)
    assert after.st_ino == before.st_ino and after.st_size == before.st_size
    assert after.st_mtime_ns != before.st_mtime_ns, "precondition: the copy has a new modification time"


KINDS = [("burnpack", "ckA.bpk", "ckB.bpk", BurnpackFormatError),
         ("safetensors", "ckA.safetensors", "ckB.safetensors", RecordError)]


@pytest.mark.parametrize("kind, name_a, name_b, error", KINDS, ids=[k[0] for k in KINDS])
def test_overwritten_in_place_with_a_same_size_checkpoint_raises_instead_of_returning_its_weights(
        tmp_path, kind, name_a, name_b, error):
    a, b = tmp_path / name_a, tmp_path / name_b
    _save(kind, _module(_arrays(1)), a)
    _save(kind, _module(_arrays(2)), b)
    assert os.path.getsize(a) == os.path.getsize(b)
    loaded = _load(kind, a)  # lazy: nothing read yet
    _overwrite_in_place(b, a)
    with pytest.raises(error) as info:
        _value(loaded.w)
    message = str(info.value)
    assert type(info.value) is error
    assert f"'{a}' {CHANGED} (modified in place, same size); {AGAIN}" == message


@pytest.mark.parametrize("kind, name_a, name_b, error", KINDS, ids=[k[0] for k in KINDS])
def test_every_read_is_checked_not_only_the_first(tmp_path, kind, name_a, name_b, error):
    a, b = tmp_path / name_a, tmp_path / name_b
    arrays = _arrays(1)
    _save(kind, _module(arrays), a)
    _save(kind, _module(_arrays(2)), b)
    loaded = _load(kind, a)
    np.testing.assert_array_equal(_value(loaded.w), arrays["w"])  # read before the change: fine
    _overwrite_in_place(b, a)
    with pytest.raises(error) as info:
        _value(loaded.b)  # a later read: checked again
    assert type(info.value) is error
    assert str(info.value) == f"'{a}' {CHANGED} (modified in place, same size); {AGAIN}"


@pytest.mark.parametrize("kind, name_a, name_b, error", KINDS, ids=[k[0] for k in KINDS])
def test_truncated_in_place_raises_without_sigbus(tmp_path, kind, name_a, name_b, error):
    # in a child process: without the check, the read dies of SIGBUS and would take pytest with it
    a = tmp_path / name_a
    _save(kind, _module(_arrays(1)), a)
    size = os.path.getsize(a)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import numpy as np
        import onnxparam
        from test_changed_files import _load, _value
        loaded = _load({kind!r}, {str(a)!r})
        with open({str(a)!r}, "r+b") as f:
            f.truncate(100)
        try:
            _value(loaded.w)
        except onnxparam.{error.__name__} as e:
            assert type(e) is onnxparam.{error.__name__}, type(e)
            print("RAISED:" + str(e))
            sys.exit(0)
        print("NO ERROR")
        sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.strip() == f"RAISED:'{a}' {CHANGED} (size {size} -> 100 bytes); {AGAIN}"


@pytest.mark.parametrize("kind, name_a, name_b, error", KINDS, ids=[k[0] for k in KINDS])
def test_atomic_replacement_keeps_the_loaded_weights(tmp_path, kind, name_a, name_b, error):
    a = tmp_path / name_a
    arrays, other = _arrays(1), _arrays(2)
    _save(kind, _module(arrays), a)
    loaded = _load(kind, a)
    inode = os.stat(a).st_ino
    _save(kind, _module(other), a)  # write beside + rename: a new file at the same path
    assert os.stat(a).st_ino != inode
    np.testing.assert_array_equal(_value(loaded.w), arrays["w"])
    np.testing.assert_array_equal(_value(loaded.b), arrays["b"])
    fresh = _load(kind, a)  # and the path now gives the new weights
    np.testing.assert_array_equal(_value(fresh.w), other["w"])


@pytest.mark.parametrize("kind, name_a, name_b, error", KINDS, ids=[k[0] for k in KINDS])
def test_deleted_file_keeps_the_loaded_weights(tmp_path, kind, name_a, name_b, error):
    a = tmp_path / name_a
    arrays = _arrays(3)
    _save(kind, _module(arrays), a)
    loaded = _load(kind, a)
    os.remove(a)
    np.testing.assert_array_equal(_value(loaded.w), arrays["w"])
    np.testing.assert_array_equal(_value(loaded.b), arrays["b"])


def test_reader_closes_its_descriptor(tmp_path):
    import onnxparam.burnpack as bp
    from onnxparam.convert import read_safetensors

    a, s = tmp_path / "a.bpk", tmp_path / "a.safetensors"
    _module(_arrays(1)).save_file(a)
    save_safetensors(_module(_arrays(1)), s)
    for open_file, watch_of in [(bp.read, lambda f: f._mapped.watch), (read_safetensors, lambda f: f.mapping.watch)]:
        with open_file(a if open_file is bp.read else s) as f:
            watch = watch_of(f)
            assert watch._release.alive
        assert not watch._release.alive  # the duplicate descriptor went with the mapping


class Net(Module):
    def __init__(self):
        from onnxparam.nn import Linear

        self.fc = Linear(512, 512)

    def forward(self, x):
        return self.fc(x)


def test_forward_of_a_module_whose_file_was_overwritten_in_place_raises(tmp_path):
    # the user's repro: m = Net().load_file("ckA.bpk"); cp ckB.bpk ckA.bpk; m(x)
    a, b = tmp_path / "ckA.bpk", tmp_path / "ckB.bpk"
    first, second = Net(), Net()
    first.save_file(a)
    second.map(lambda path, p: Param.initialized(first.fc.weight.id if path == "fc.weight" else first.fc.bias.id,
                                                   p.val(), p.require_grad)).save_file(b)
    assert os.path.getsize(a) == os.path.getsize(b)
    m = Net().load_file(a)
    _overwrite_in_place(b, a)
    x = Tensor.from_numpy(np.ones((1, 512), np.float32))
    with pytest.raises(BurnpackFormatError) as info:
        m(x)
    assert type(info.value) is BurnpackFormatError
    assert str(info.value) == f"'{a}' {CHANGED} (modified in place, same size); {AGAIN}"
