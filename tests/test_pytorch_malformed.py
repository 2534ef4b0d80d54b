"""formats.pytorch on hostile and broken files: refused with a RecordError, nothing executed.

The pickles are assembled opcode by opcode (pickle protocol 2, as torch writes) so these tests
need no torch; the zip / legacy containers around them follow docs/pytorch_checkpoint.md.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from pathlib import Path

import pytest

from onnxparam.core.errors import OnnxParamError, RecordError
from onnxparam.formats import read_pytorch

DATA = Path(__file__).parent / "data" / "pytorch"


def op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def op_value(obj) -> bytes:
    """A plain value's opcodes (protocol 2, without the PROTO header and STOP)."""
    return pickle.dumps(obj, protocol=2)[2:-1]


def op_tensor(*, numel: int, size, stride, offset=0, key="0", storage="FloatStorage", legacy=False) -> bytes:
    """``torch._utils._rebuild_tensor_v2(<storage pid>, offset, size, stride, False, OrderedDict())``."""
    pid_fields = op_value("storage") + op_global("torch", storage) + op_value(key) + op_value("cpu") + op_value(numel)
    pid = b"(" + pid_fields + (op_value(None) if legacy else b"") + b"tQ"  # MARK ... TUPLE BINPERSID
    hooks = op_global("collections", "OrderedDict") + b")R"
    args = b"(" + pid + op_value(offset) + op_value(tuple(size)) + op_value(tuple(stride)) + op_value(False) + hooks + b"t"
    return op_global("torch._utils", "_rebuild_tensor_v2") + args + b"R"


def op_dict(**values: bytes) -> bytes:
    body = b"".join(op_value(k) + v for k, v in values.items())
    return b"\x80\x02}(" + body + b"u."  # PROTO 2, EMPTY_DICT, MARK ... SETITEMS, STOP


def write_zip(path: Path, pkl: bytes, storages: dict[str, bytes], folder="archive") -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{folder}/data.pkl", pkl)
        z.writestr(f"{folder}/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"{folder}/data/{key}", data)
    return path


def write_legacy(path: Path, pkl: bytes, storages: dict[str, tuple[int, bytes]]) -> Path:
    head = [0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True, "type_sizes": {}}]
    body = b"".join(pickle.dumps(v, protocol=2) for v in head) + pkl + pickle.dumps(sorted(storages), protocol=2)
    for key in sorted(storages):
        numel, data = storages[key]
        body += struct.pack("<q", numel) + data
    path.write_bytes(body)
    return path


FOUR_FLOATS = struct.pack("<4f", 0, 1, 2, 3)


def test_hand_made_file_reads_back_so_the_helpers_write_valid_checkpoints(tmp_path):
    # The positive control for every refusal below: the same builders, a well-formed tensor.
    pkl = op_dict(w=op_tensor(numel=4, size=(2, 2), stride=(1, 2)))
    assert read_pytorch(write_zip(tmp_path / "ok.pt", pkl, {"0": FOUR_FLOATS})).tensors["w"].tolist() == [[0, 2], [1, 3]]
    legacy = op_dict(w=op_tensor(numel=4, size=(2, 2), stride=(1, 2), legacy=True))
    assert read_pytorch(write_legacy(tmp_path / "l.pt", legacy, {"0": (4, FOUR_FLOATS)})).tensors["w"].tolist() == [
        [0, 2],
        [1, 3],
    ]


@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_os_system_reduce_is_refused_and_never_runs(tmp_path, container):
    marker = tmp_path / "pwned"
    payload = op_global("os", "system") + b"(" + op_value(f"touch {marker}") + b"tR"
    pkl = op_dict(w=payload)
    path = (
        write_zip(tmp_path / "evil.pt", pkl, {})
        if container == "zip"
        else write_legacy(tmp_path / "evil.pt", pkl, {})
    )
    with pytest.raises(RecordError, match=r"evil\.pt: refused .*global 'os\.system' is not allowed.*nothing in it was run"):
        read_pytorch(path)
    assert not marker.exists()


def test_builtins_eval_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').close()"
    pkl = op_dict(w=op_global("builtins", "eval") + b"(" + op_value(code) + b"tR")
    with pytest.raises(RecordError, match=r"global 'builtins\.eval' is not allowed"):
        read_pytorch(write_zip(tmp_path / "eval.pt", pkl, {}))
    assert not marker.exists()


def test_a_non_storage_persistent_id_is_refused(tmp_path):
    pkl = op_dict(w=b"(" + op_value("module") + op_value("x") + b"tQ")
    with pytest.raises(RecordError, match=r"persistent id 'module' is not a storage"):
        read_pytorch(write_zip(tmp_path / "pid.pt", pkl, {}))


def test_a_quantized_storage_class_is_refused(tmp_path):
    pkl = op_dict(w=op_tensor(numel=4, size=(4,), stride=(1,), storage="QInt8Storage"))
    with pytest.raises(RecordError, match=r"global 'torch\.QInt8Storage' is not allowed"):
        read_pytorch(write_zip(tmp_path / "q.pt", pkl, {"0": bytes(4)}))


def test_persistent_id_declaring_more_elements_than_the_record_holds_is_refused(tmp_path):
    pkl = op_dict(w=op_tensor(numel=100, size=(4,), stride=(1,)))
    with pytest.raises(RecordError, match=r"storage '0' holds 16 bytes, but the pickle declares 100 elements of float32 = 400 bytes"):
        read_pytorch(write_zip(tmp_path / "long.pt", pkl, {"0": FOUR_FLOATS}))


@pytest.mark.parametrize(
    "size, stride, offset, needed",
    [((5,), (1,), 0, 20), ((2, 2), (2, 1), 1, 20), ((3,), (2,), 0, 20), ((2,), (0,), 4, 20)],
)
def test_a_view_reaching_past_its_storage_names_tensor_and_sizes(tmp_path, size, stride, offset, needed):
    pkl = op_dict(w=op_tensor(numel=4, size=size, stride=stride, offset=offset))
    pattern = rf"(?s)short\.pt: tensors do not fit their storage.*'w': shape .* needs {needed} bytes of storage '0', which holds 16"
    with pytest.raises(RecordError, match=pattern):
        read_pytorch(write_zip(tmp_path / "short.pt", pkl, {"0": FOUR_FLOATS}))


def test_a_legacy_storage_shorter_than_declared_is_a_truncated_file(tmp_path):
    pkl = op_dict(w=op_tensor(numel=4, size=(4,), stride=(1,), legacy=True))
    path = write_legacy(tmp_path / "cut.pt", pkl, {"0": (4, FOUR_FLOATS[:12])})
    with pytest.raises(RecordError, match=r"cut\.pt: storage '0' ends at byte \d+, past the end of the file"):
        read_pytorch(path)


def test_a_truncated_zip_is_refused(tmp_path):
    data = (DATA / "state_dict_zip.pt").read_bytes()
    (tmp_path / "half.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordError, match=r"half\.pt: not a readable zip archive .*truncated"):
        read_pytorch(tmp_path / "half.pt")


def test_a_zip_without_data_pkl_is_not_a_torch_file(tmp_path):
    with zipfile.ZipFile(tmp_path / "nopkl.pt", "w") as z:
        z.writestr("archive/data/0", FOUR_FLOATS)
    with pytest.raises(RecordError, match=r"nopkl\.pt: expected exactly one '<archive>/data\.pkl' record .* found none"):
        read_pytorch(tmp_path / "nopkl.pt")


def test_a_missing_storage_record_is_named(tmp_path):
    pkl = op_dict(w=op_tensor(numel=4, size=(4,), stride=(1,), key="7"))
    with pytest.raises(RecordError, match=r"storage '7' has no record 'archive/data/7' in the zip"):
        read_pytorch(write_zip(tmp_path / "gone.pt", pkl, {}))


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", r"the file is empty"),
        (b"hello world", r"the magic number is not a valid pickle"),
        (pickle.dumps(12345, protocol=2), r"first pickle 12345, expected the magic number 0x1950a86a20f9469cfc6c"),
    ],
)
def test_files_that_are_not_checkpoints_are_refused(tmp_path, content, message):
    (tmp_path / "x.pt").write_bytes(content)
    with pytest.raises(RecordError, match=message):
        read_pytorch(tmp_path / "x.pt")


def test_a_bad_byteorder_record_is_refused(tmp_path):
    path = tmp_path / "bo.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", op_dict())
        z.writestr("archive/byteorder", "middle")
    with pytest.raises(RecordError, match=r"'archive/byteorder' says 'middle', expected 'little' or 'big'"):
        read_pytorch(path)


def test_a_big_endian_legacy_stream_is_refused_clearly(tmp_path):
    head = [0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": False}]
    (tmp_path / "be.pt").write_bytes(b"".join(pickle.dumps(v, protocol=2) for v in head) + op_dict())
    with pytest.raises(RecordError, match=r"be\.pt: the legacy stream was written big-endian"):
        read_pytorch(tmp_path / "be.pt")


def test_a_missing_file_is_a_file_missing_error(tmp_path):
    # README: a missing file is a FileMissingError (also a FileNotFoundError), naming it
    with pytest.raises(FileNotFoundError, match=r"no such file: '.*nothere\.pt'") as info:
        read_pytorch(tmp_path / "nothere.pt")
    assert isinstance(info.value, OnnxParamError)


@pytest.mark.parametrize(
    "slot_state, message",
    [({"__defaults__": (1,)}, r"tries to change <allowed _rebuild_tensor_v2> \(BUILD\)"), ({"function": "x"}, r"tries to change")],
)
def test_build_cannot_rewire_the_allowed_functions(tmp_path, slot_state, message):
    from onnxparam.formats import _torch_pickle

    defaults = _torch_pickle._rebuild_tensor_v2.__defaults__
    rewired = op_global("torch._utils", "_rebuild_tensor_v2") + op_value((None, slot_state)) + b"b"  # BUILD
    call = rewired + b"(" + op_value(1) + b"tR"
    with pytest.raises(RecordError, match=message):
        read_pytorch(write_zip(tmp_path / "build.pt", op_dict(w=call), {}))
    assert _torch_pickle._rebuild_tensor_v2.__defaults__ == defaults


def test_a_zero_stride_view_that_would_expand_past_the_limit_is_refused(tmp_path):
    pkl = op_dict(w=op_tensor(numel=4, size=(10**12,), stride=(0,)))
    pattern = r"'w': shape \(1000000000000,\) with stride \(0,\) would expand 16 bytes .* into 4000000000000 bytes"
    with pytest.raises(RecordError, match=pattern):
        read_pytorch(write_zip(tmp_path / "huge.pt", pkl, {"0": FOUR_FLOATS}))


@pytest.mark.parametrize("file", ["state_dict_zip.pt", "state_dict_legacy.pt"])
def test_randomly_corrupted_checkpoints_give_record_errors_only(tmp_path, file):
    """Seeded byte mutations of a committed file: each read succeeds or raises RecordError."""
    import random

    raw = (DATA / file).read_bytes()
    rng = random.Random(18)
    outcomes = {"ok": 0, "RecordError": 0}
    for case in range(300):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            kind, pos = rng.random(), rng.randrange(len(data))
            if kind < 0.6:
                data[pos] = rng.randrange(256)
            elif kind < 0.8:
                del data[max(pos, 1) :]
            else:
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        path = tmp_path / f"case{case}.pt"
        path.write_bytes(bytes(data))
        try:
            read_pytorch(path)
            outcomes["ok"] += 1
        except RecordError:
            outcomes["RecordError"] += 1
    assert outcomes["RecordError"] > 0 and sum(outcomes.values()) == 300


@pytest.mark.parametrize("state", [{"name": "int64"}, (None, {"name": "int64"})], ids=["dict", "slots"])
@pytest.mark.parametrize("module, name", [("torch", "float32"), ("torch.nn.parameter", "Parameter")])
def test_build_cannot_change_the_shared_stand_ins(tmp_path, state, module, name):
    from onnxparam.formats import _torch_pickle

    before = _torch_pickle._ALLOWED[(module, name)].name
    pkl = op_dict(d=op_global(module, name) + op_value(state) + b"b")  # BUILD
    with pytest.raises(RecordError, match=r"build\.pt: refused .*the pickle tries to (change|set 'name' on) torch\."):
        read_pytorch(write_zip(tmp_path / "build.pt", pkl, {}))
    assert _torch_pickle._ALLOWED[(module, name)].name == before
