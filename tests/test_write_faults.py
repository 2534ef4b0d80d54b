"""Fault injection on every writer: a failed or killed save never loses the previous file.

For each writer (burnpack ``Module.save_file`` / ``burnpack.write``, ``write_safetensors``,
ONNX ``save_model``) the test counts the file writes, fsyncs and renames of one save, then
repeats the save making the N-th of each raise, for every N. After each attempt the target is
either the previous file, byte for byte (the save raised), or the new one (the failure hit a
step after the rename, e.g. the directory fsync, which is best effort) — never a mix — and
the folder holds no scratch file. A process SIGKILLed mid-save leaves the previous file intact;
its scratch file (which no handler could remove) is removed by the next save to that path.
"""

from __future__ import annotations

import builtins
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

import onnxparam.burnpack as bp
from onnxparam import Module, Tensor
from onnxparam.core.record import ModuleRecord
from onnxparam.formats import read_safetensors, write_safetensors
from onnxparam.nn import Linear
from onnxparam.onnx_io import save_model

ROOT = Path(__file__).resolve().parent.parent


class Injected(OSError):
    """The error the fault injector raises (an OSError, as a real I/O failure is)."""


class _Faulty:
    """A file object whose writes go through the injector."""

    def __init__(self, inner, injector):
        self._inner = inner
        self._injector = injector

    def write(self, data):
        self._injector.hit("write")
        return self._inner.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._inner.close()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Injector:
    """Counts write / fsync / replace calls under ``folder`` and raises at the chosen one."""

    def __init__(self, monkeypatch, folder: Path, op: str | None = None, at: int = 0, error: OSError | None = None):
        self.counts = {"write": 0, "fsync": 0, "replace": 0}
        self.op, self.at = op, at
        self.error = error or Injected(errno.EIO, "injected I/O error")
        folder = os.path.realpath(folder)
        real_open, real_fdopen, real_fsync, real_replace = builtins.open, os.fdopen, os.fsync, os.replace

        def ours(path) -> bool:
            return isinstance(path, (str, os.PathLike)) and os.path.realpath(path).startswith(folder)

        def fake_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            writing = any(c in mode for c in "wax+")
            return _Faulty(handle, self) if writing and ours(file) else handle

        def fake_fdopen(fd, mode="r", *args, **kwargs):
            handle = real_fdopen(fd, mode, *args, **kwargs)
            return _Faulty(handle, self) if any(c in mode for c in "wax+") else handle

        def fake_fsync(fd):
            self.hit("fsync")
            return real_fsync(fd)

        def fake_replace(src, dst, *args, **kwargs):
            if ours(dst):
                self.hit("replace")
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(os, "fdopen", fake_fdopen)
        monkeypatch.setattr(os, "fsync", fake_fsync)
        monkeypatch.setattr(os, "replace", fake_replace)

    def hit(self, op: str) -> None:
        self.counts[op] += 1
        if op == self.op and self.counts[op] == self.at:
            raise self.error


# -- the three writers, each as (save(path, version), read(path) -> comparable) --------------------


def _arrays(version: int) -> dict:
    rng = np.random.default_rng(version)
    return {"fc.weight": rng.standard_normal((64, 300)).astype(np.float32),
            "fc.bias": rng.standard_normal(300).astype(np.float32)}


def save_burnpack(path: Path, version: int) -> None:
    bp.write(path, [bp.TensorEntry.from_numpy(k, v) for k, v in _arrays(version).items()], metadata={"v": str(version)})


def read_burnpack(path: Path) -> dict:
    with bp.read(path) as f:
        return {k: e.to_numpy().copy() for k, e in f.tensors.items()}


class Net(Module):
    def __init__(self):
        self.fc = Linear(64, 300)

    def forward(self, x):
        return self.fc(x)


def save_module(path: Path, version: int) -> None:
    arrays = _arrays(version)
    module = Net().map(lambda p, param: param.map(lambda t: Tensor.from_numpy(arrays[p])))
    module.save_file(path)


def save_st(path: Path, version: int) -> None:
    record = ModuleRecord.from_module(
        Net().map(lambda p, param: param.map(lambda t, _p=p: Tensor.from_numpy(_arrays(version)[_p]))))
    write_safetensors(path, record)


def read_st(path: Path) -> dict:
    with read_safetensors(path) as f:
        return {k: np.array(s.to_data().to_numpy()) for k, s in f.tensors.items()}


def save_onnx(path: Path, version: int) -> None:
    arrays = _arrays(version)
    x = ir.Value(name="x", shape=ir.Shape([1, 64]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="fc.weight", shape=ir.Shape([64, 300]), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.tensor(arrays["fc.weight"], name="fc.weight"))
    b = ir.Value(name="fc.bias", shape=ir.Shape([300]), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.tensor(arrays["fc.bias"], name="fc.bias"))
    mm = ir.node("MatMul", [x, w])
    add = ir.node("Add", [mm.outputs[0], b])
    graph = ir.Graph([x], [add.outputs[0]], nodes=[mm, add], initializers=[w, b], opset_imports={"": 17}, name="g")
    save_model(ir.Model(graph, ir_version=8), path, external_data=True)


def read_onnx(path: Path) -> dict:
    model = ir.load(path)
    out = {k: np.array(v.const_value.numpy()) for k, v in model.graph.initializers.items()}
    return out


WRITERS = {
    "burnpack.write": (save_burnpack, read_burnpack, "m.bpk"),
    "Module.save_file": (save_module, read_burnpack, "m.bpk"),
    "write_safetensors": (save_st, read_st, "m.safetensors"),
    "save_model": (save_onnx, read_onnx, "m.onnx"),
}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def snapshot_folder(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_save_failing_at_any_write_fsync_or_rename_keeps_the_old_file(tmp_path, monkeypatch, writer):
    save, read, name = WRITERS[writer]
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / name
    save(target, 1)
    old_files = snapshot_folder(folder)
    old = read(target)
    with monkeypatch.context() as m:
        counter = Injector(m, folder)
        save(target, 2)
    counts = dict(counter.counts)
    # NOTE: onnx_ir writes external data with numpy's tofile (straight to the descriptor), which
    # the injector cannot see; the model file's write, the fsyncs and the renames it can.
    assert counts["write"] >= (1 if writer == "save_model" else 3) and counts["fsync"] >= 1, counts
    assert counts["replace"] >= 1, counts
    new = read(target)
    assert not same(old, new)
    attempts = raised = 0
    for op, total in counts.items():
        for at in range(1, total + 1):
            for p in folder.iterdir():
                p.unlink()
            for n, data in old_files.items():
                (folder / n).write_bytes(data)
            attempts += 1
            with monkeypatch.context() as m:
                Injector(m, folder, op, at)
                try:
                    save(target, 2)
                except Injected:
                    raised += 1
                    assert snapshot_folder(folder) == old_files, f"{op} #{at}: the folder changed"
                    continue
            # the failure hit a best-effort step after the rename: the new file, whole
            assert same(read(target), new), f"{op} #{at}: neither the old nor the new file"
            assert sorted(p.name for p in folder.iterdir()) == sorted(old_files), f"{op} #{at}: stray files"
    assert raised >= attempts - 2 and attempts == sum(counts.values())


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_is_reported_as_enospc_naming_the_file(tmp_path, monkeypatch, writer):
    save, read, name = WRITERS[writer]
    target = tmp_path / name
    save(target, 1)
    before = snapshot_folder(tmp_path)
    with monkeypatch.context() as m:
        Injector(m, tmp_path, "write", 1, error=OSError(errno.ENOSPC, "No space left on device"))
        with pytest.raises(OSError) as info:
            save(target, 2)
    assert info.value.errno == errno.ENOSPC and not isinstance(info.value, Injected)
    assert info.value.filename == str(target)
    assert str(info.value) == (
        f"[Errno {errno.ENOSPC}] No space left on device writing '{target}': the disk (or its inodes, or the "
        f"quota) is full; nothing was replaced (any previous file is unchanged); free space or save elsewhere: "
        f"'{target}'")
    assert snapshot_folder(tmp_path) == before


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_at_every_write_and_fsync_names_the_target_and_keeps_the_old_file(tmp_path, monkeypatch, writer):
    save, read, name = WRITERS[writer]
    target = tmp_path / name
    save(target, 1)
    before = snapshot_folder(tmp_path)
    with monkeypatch.context() as m:
        counter = Injector(m, tmp_path)
        save(target, 2)
    for p in tmp_path.iterdir():
        p.unlink()
    for n, data in before.items():
        (tmp_path / n).write_bytes(data)
    tried = 0
    for op in ("write", "fsync"):
        for at in range(1, counter.counts[op] + 1):
            with monkeypatch.context() as m:
                Injector(m, tmp_path, op, at, error=OSError(errno.ENOSPC, "No space left on device"))
                try:
                    save(target, 2)
                except OSError as e:
                    tried += 1
                    assert e.errno == errno.ENOSPC and e.filename == str(target), (op, at, e)
                    assert str(e).startswith("[Errno 28] No space left on device writing '"), (op, at, e)
                    assert ".tmp" not in str(e)  # never the scratch name
                    assert snapshot_folder(tmp_path) == before, (op, at)
                    continue
            # a best-effort step after the rename (the directory fsync): the new file, whole
            assert not same(read(target), _arrays(1)), (op, at)
            for p in tmp_path.iterdir():
                p.unlink()
            for n, data in before.items():
                (tmp_path / n).write_bytes(data)
    assert tried >= counter.counts["write"]


def test_a_short_external_data_write_is_reported_as_a_full_disk_naming_the_data_file(tmp_path, monkeypatch):
    import onnx_ir.external_data as ext

    target = tmp_path / "out.onnx"
    save_onnx(target, 1)
    before = snapshot_folder(tmp_path)

    def short_write(tensor, file, offset):  # numpy's tofile on a full disk: no errno
        raise OSError("262144 requested and 2048 written")

    monkeypatch.setattr(ext, "_write_tensor_at", short_write)
    with pytest.raises(OSError) as info:
        save_onnx(target, 2)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    assert str(info.value).startswith(
        f"[Errno {errno.ENOSPC}] No space left on device writing '{tmp_path / 'out.onnx.data'}' (saving '{target}'): "
        "the disk (or its inodes, or the quota) is full")
    assert snapshot_folder(tmp_path) == before


def test_an_onnx_runtime_failure_writing_an_adapter_is_an_execution_error_naming_the_file(tmp_path, monkeypatch):
    import onnxruntime

    from onnxparam import ExecutionError

    def export(self, target):
        raise onnxruntime.capi.onnxruntime_pybind11_state.Fail(
            "/onnxruntime_src/onnxruntime/core/framework/adapter.cc:45 void onnxruntime::Save(int) cannot open file")

    monkeypatch.setattr(onnxruntime.AdapterFormat, "export_adapter", export)
    path = tmp_path / "a.onnx_adapter"
    with pytest.raises(ExecutionError) as info:
        save_adapter(path, 1)
    assert str(info.value) == f"ONNX Runtime could not write the adapter file '{path}': cannot open file"
    assert list(tmp_path.iterdir()) == []


# -- a process killed mid-save ----------------------------------------------------------------------

_KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from pathlib import Path
    target, kind = Path(sys.argv[1]), sys.argv[2]
    big = np.ones(16 * 1024 * 1024, np.float32)   # 64 MiB

    def stall(value):
        print("mid-save", flush=True)   # the big tensor is written; now wait for SIGKILL
        time.sleep(60)
        return value

    if kind == "burnpack":
        import onnxparam.burnpack as bp
        bp.write(target, [bp.TensorEntry.from_numpy("big", big),
                          bp.TensorEntry("last", __import__("onnxparam").DType.F32, (1,), lambda: stall(np.ones(1, np.float32)))])
    elif kind == "safetensors":
        from onnxparam.formats._safetensors import write_safetensors
        from onnxparam.core.record import TensorSnapshot
        from onnxparam.core.tensor import TensorData
        from onnxparam.core.dtype import DType
        write_safetensors(target, {
            "a_big": TensorSnapshot(DType.F32, big.shape, None, lambda: TensorData.from_numpy(big)),
            "b_last": TensorSnapshot(DType.F32, (1,), None, lambda: stall(TensorData.from_numpy(np.ones(1, np.float32)))),
        })
    else:
        import onnx_ir as ir
        from onnxparam.onnx_io import save_model
        lazy = ir.LazyTensor(lambda: stall(ir.tensor(np.ones(1024, np.float32))), dtype=ir.DataType.FLOAT,
                             shape=ir.Shape([1024]), name="last")
        x = ir.Value(name="x", shape=ir.Shape([1024]), type=ir.TensorType(ir.DataType.FLOAT))
        vals = [ir.Value(name=n, shape=ir.Shape(list(t.shape)), type=ir.TensorType(ir.DataType.FLOAT), const_value=t)
                for n, t in (("big", ir.tensor(big, name="big")), ("last", lazy))]
        node = ir.node("Add", [x, vals[1]])
        g = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=vals, opset_imports={"": 17})
        save_model(ir.Model(g, ir_version=8), target, external_data=True)
""")


@pytest.mark.parametrize("kind, name, save, read", [
    ("burnpack", "m.bpk", save_burnpack, read_burnpack),
    ("safetensors", "m.safetensors", save_st, read_st),
    ("onnx", "m.onnx", save_onnx, read_onnx),
])
def test_a_save_killed_mid_way_keeps_the_old_file_and_the_next_save_removes_its_scratch(tmp_path, kind, name, save, read):
    target = tmp_path / name
    save(target, 1)
    old_files = snapshot_folder(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(target), kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line == b"mid-save\n", proc.stderr.read().decode()
        scratch = [p.name for p in tmp_path.iterdir() if p.name not in old_files]
        assert len(scratch) == 1 and scratch[0].startswith(f".{name}.{proc.pid}-"), scratch
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert {n: (tmp_path / n).read_bytes() for n in old_files} == old_files  # the old file, intact
    save(target, 2)  # the next save to the same path removes the dead process's scratch
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(old_files)
    assert same(read(target), {k: v for k, v in _arrays(2).items()})


def test_a_failed_onnx_adapter_save_keeps_the_previous_file(tmp_path, monkeypatch):
    import numpy as np
    import onnxruntime

    from onnxparam import write_onnx_adapter

    path = tmp_path / "a.onnx_adapter"
    write_onnx_adapter({"w.lora.a": np.ones((2, 1), np.float32)}, path)
    before = path.read_bytes()

    def boom(self, target):
        with open(target, "wb") as handle:
            handle.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnxruntime.AdapterFormat, "export_adapter", boom)
    with pytest.raises(OSError, match="No space left"):
        write_onnx_adapter({"w.lora.a": np.zeros((2, 1), np.float32)}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.onnx_adapter"]


# -- permissions: a save refuses what open(path, "w") refuses, and keeps the old file's mode -----------
#
# NOTE: the suite may run as root, for whom os.access always says "writable"; a file chmod'ed
# 0o444 must still be refused (the writers check the mode bits too), so these tests hold for root
# and for other users alike.


def save_adapter(path: Path, version: int) -> None:
    from onnxparam import write_onnx_adapter

    write_onnx_adapter({"fc.weight.lora.a": _arrays(version)["fc.weight"][:, :2].copy()}, path)


def _net(version: int) -> Net:
    arrays = _arrays(version)
    return Net().map(lambda p, param: param.map(lambda t: Tensor.from_numpy(arrays[p])))


def export_onnx_file(path: Path, version: int) -> None:
    import onnxparam

    onnxparam.export_onnx(_net(version), path, Tensor.from_numpy(np.ones((1, 64), np.float32)))


def save_safetensors_file(path: Path, version: int) -> None:
    from onnxparam.convert import save_safetensors

    save_safetensors(_net(version), path)


PERMISSION_WRITERS = {
    **{name: (save, name_) for name, (save, _read, name_) in WRITERS.items()},
    "write_onnx_adapter": (save_adapter, "m.onnx_adapter"),
    "export_onnx": (export_onnx_file, "m.onnx"),
    "convert.save_safetensors": (save_safetensors_file, "m.safetensors"),
}
CREATES_FOLDERS = {"save_model", "export_onnx"}
"""Writers that create a missing output folder (ONNX saves); the others refuse one."""


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(folder: Path) -> dict:
    return {p.name: stat_mode(p) for p in folder.iterdir()}


def stat_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o7777


@pytest.mark.parametrize("writer", sorted(PERMISSION_WRITERS))
def test_saving_over_a_read_only_file_is_refused_and_leaves_it_unchanged(tmp_path, monkeypatch, writer):
    save, name = PERMISSION_WRITERS[writer]
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()
    target = Path("d") / name
    save(target, 1)
    target.chmod(0o444)
    before, before_modes = snapshot_folder(Path("d")), modes(Path("d"))
    with pytest.raises(PermissionError) as info:
        save(target, 2)
    assert info.value.errno == errno.EACCES and info.value.filename == f"d/{name}"
    assert str(info.value) == (
        f"[Errno {errno.EACCES}] 'd/{name}' is read-only; the file was not changed (make it writable, e.g. "
        f"chmod u+w, or save elsewhere): 'd/{name}'")
    assert snapshot_folder(Path("d")) == before  # same files, same bytes, no scratch left
    assert modes(Path("d")) == before_modes and stat_mode(target) == 0o444


def test_an_onnx_save_refuses_a_read_only_data_file_before_writing_anything(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()
    save_onnx(Path("d/m.onnx"), 1)
    assert sorted(p.name for p in Path("d").iterdir()) == ["m.onnx", "m.onnx.data"]
    Path("d/m.onnx.data").chmod(0o444)
    before = snapshot_folder(Path("d"))
    with pytest.raises(PermissionError) as info:
        save_onnx(Path("d/m.onnx"), 2)
    assert info.value.errno == errno.EACCES and info.value.filename == "d/m.onnx.data"
    assert str(info.value).startswith(f"[Errno {errno.EACCES}] 'd/m.onnx.data' is read-only; the file was not changed")
    assert snapshot_folder(Path("d")) == before
    assert modes(Path("d")) == {"m.onnx": 0o644, "m.onnx.data": 0o444}


@pytest.mark.parametrize("writer", sorted(PERMISSION_WRITERS))
def test_replacing_a_file_keeps_its_permission_bits_and_a_new_file_gets_the_umasks(tmp_path, umask_022, writer):
    save, name = PERMISSION_WRITERS[writer]
    target = tmp_path / name
    save(target, 1)
    assert set(modes(tmp_path).values()) == {0o644}  # 0o666 less the umask
    for path in tmp_path.iterdir():
        path.chmod(0o640)
    old = snapshot_folder(tmp_path)
    save(target, 2)
    assert snapshot_folder(tmp_path) != old  # replaced ...
    assert modes(tmp_path) == {n: 0o640 for n in old}  # ... keeping the old modes (data files too)


@pytest.mark.parametrize("writer", sorted(set(PERMISSION_WRITERS) - CREATES_FOLDERS))
def test_saving_into_a_missing_folder_names_the_target_not_a_scratch_file(tmp_path, monkeypatch, writer):
    save, name = PERMISSION_WRITERS[writer]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        save(Path("nodir") / name, 1)
    assert info.value.errno == errno.ENOENT and info.value.filename == f"nodir/{name}"
    assert str(info.value) == (
        f"[Errno {errno.ENOENT}] cannot write 'nodir/{name}': the folder 'nodir' does not exist (create it "
        f"first); nothing was written: 'nodir/{name}'")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("writer", sorted(CREATES_FOLDERS))
def test_onnx_saves_create_a_missing_folder(tmp_path, writer):
    save, name = PERMISSION_WRITERS[writer]
    save(tmp_path / "a" / "b" / name, 1)
    assert (tmp_path / "a" / "b" / name).is_file()


def _deny_writes_to(monkeypatch, folder: Path) -> None:
    """Make ``folder`` unwritable: chmod 0o555, and for root (whom the kernel lets write anyway)
    an ``os.access`` that answers for ``folder`` as the kernel would for any other user."""
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real_access = os.access
        denied = os.path.realpath(folder)

        def access(path, mode, *args, **kwargs):
            if mode & os.W_OK and os.path.realpath(path) == denied:
                return False
            return real_access(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)


@pytest.mark.parametrize("writer", sorted(PERMISSION_WRITERS))
def test_saving_into_a_read_only_folder_names_the_target(tmp_path, monkeypatch, writer):
    save, name = PERMISSION_WRITERS[writer]
    monkeypatch.chdir(tmp_path)
    Path("ro").mkdir()
    try:
        _deny_writes_to(monkeypatch, Path("ro"))
        with pytest.raises(PermissionError) as info:
            save(Path("ro") / name, 1)
    finally:
        Path("ro").chmod(0o755)
    assert info.value.errno == errno.EACCES and info.value.filename == f"ro/{name}"
    assert str(info.value) == (
        f"[Errno {errno.EACCES}] cannot write 'ro/{name}': the folder 'ro' is not writable; nothing was "
        f"written: 'ro/{name}'")
    assert list(Path("ro").iterdir()) == []


def _refuse_scratch(monkeypatch, name: str, code: int, text: str) -> None:
    """Make the kernel's answer to creating a save's scratch file or folder (``.<name>.*.tmp``)
    the error ``code`` (``OSError(code, text, path)``), as a full or read-only file system would."""
    real_open, real_mkdir = os.open, os.mkdir

    def is_scratch(path) -> bool:
        base = os.path.basename(os.fspath(path))
        return base.startswith(f".{name}.") and base.endswith(".tmp")

    def fake_open(path, *args, **kwargs):
        if is_scratch(path):
            raise OSError(code, text, os.fspath(path))
        return real_open(path, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if is_scratch(path):
            raise OSError(code, text, os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_scratch_the_system_refuses_is_reported_naming_the_target(tmp_path, monkeypatch, writer):
    """A refusal only the kernel knows (here a read-only file system) names the target too."""
    save, _read, name = WRITERS[writer]
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()
    _refuse_scratch(monkeypatch, name, errno.EROFS, "Read-only file system")
    with pytest.raises(OSError) as info:
        save(Path("d") / name, 1)
    assert info.value.errno == errno.EROFS and info.value.filename == f"d/{name}"
    assert str(info.value) == (
        f"[Errno {errno.EROFS}] cannot write 'd/{name}': the folder 'd' is on a read-only file system; "
        f"nothing was written: 'd/{name}'")
    assert list(Path("d").iterdir()) == []


@pytest.mark.parametrize("writer", sorted(PERMISSION_WRITERS))
def test_out_of_inodes_creating_the_scratch_names_the_target(tmp_path, monkeypatch, writer):
    save, name = PERMISSION_WRITERS[writer]
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()
    _refuse_scratch(monkeypatch, name, errno.ENOSPC, "No space left on device")
    if writer == "write_onnx_adapter":  # ONNX Runtime creates the file itself, from C++
        import onnxruntime

        def export(self, target):
            raise onnxruntime.capi.onnxruntime_pybind11_state.Fail(
                "/onnxruntime_src/onnxruntime/core/platform/posix/env.cc:12 void onnxruntime::Save(int) "
                "No space left on device")

        monkeypatch.setattr(onnxruntime.AdapterFormat, "export_adapter", export)
    with pytest.raises(OSError) as info:
        save(Path("d") / name, 1)
    assert info.value.errno == errno.ENOSPC and info.value.filename == f"d/{name}"
    assert str(info.value).startswith(f"[Errno {errno.ENOSPC}] No space left on device writing 'd/{name}': the disk "
                                      "(or its inodes, or the quota) is full; nothing was replaced")
    assert list(Path("d").iterdir()) == []


def test_an_os_error_naming_a_file_object_instead_of_a_path_still_leaves_as_that_os_error(tmp_path, monkeypatch):
    # some writers (an interrupted write, a signal mid-save) raise OSError whose filename is the
    # open file object: the save must re-raise it, not fail building its message (a TypeError)
    save_onnx(tmp_path / "m.onnx", 1)
    real_fsync = os.fsync

    def failing_fsync(fd):
        with open(os.devnull, "wb") as handle:
            raise OSError(errno.EIO, "Input/output error", handle)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError) as info:
        save_onnx(tmp_path / "m.onnx", 2)
    monkeypatch.setattr(os, "fsync", real_fsync)

    assert info.value.errno == errno.EIO and not isinstance(info.value, TypeError)
    assert same(read_onnx(tmp_path / "m.onnx"), _arrays(1))
