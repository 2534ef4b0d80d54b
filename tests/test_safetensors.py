"""Safetensors files as records: reading (lazy, bit-exact), writing (library bytes, streaming,
atomic), this library's metadata keys, and malformed files.

Oracles: files written by ``safetensors.numpy.save_file`` and values read back by
``safetensors.safe_open`` (the Hugging Face library), and numpy bit patterns built in the test.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import weakref

import ml_dtypes
import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

import onnxparam as op
from onnxparam.convert import read_safetensors, write_safetensors
from onnxparam.core.record import TensorSnapshot
from onnxparam.core.tensor import TensorData
from onnxparam.formats._safetensors import (
    DTYPES_KEY,
    MAX_HEADER_BYTES,
    ORDER_KEY,
    PARAM_IDS_KEY,
    SCALARS_KEY,
    SafetensorsTensor,
)

RNG = np.random.default_rng(20240601)

PLAIN_ARRAYS = {
    "f64": RNG.standard_normal((2, 3)),
    "f32.weight": RNG.standard_normal((4, 3)).astype(np.float32),
    "f16": RNG.standard_normal(5).astype(np.float16),
    "i64": np.arange(-3, 3, dtype=np.int64),
    "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
    "i16": np.array([-7, 7], np.int16),
    "i8": np.array([-128, 127], np.int8),
    "u64": np.array([2**64 - 1, 0], np.uint64),
    "u32": np.array([2**32 - 1], np.uint32),
    "u16": np.array([65535, 1], np.uint16),
    "u8": np.arange(10, dtype=np.uint8),
    "mask": np.array([[True, False], [False, True]]),
    "scalar": np.array(2.5, np.float32),
    "empty": np.zeros((0, 4), np.float32),
    "ünïcode/name:0": np.ones(2, np.float32),
}


def _raw(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def _snapshot(array, param_id=None, dtype=None) -> TensorSnapshot:
    array = np.asarray(array)
    dtype = dtype or op.DType.from_numpy(array.dtype)
    return TensorSnapshot(dtype, tuple(array.shape), param_id, lambda a=array, d=dtype: TensorData(a, d, a.shape))


def _header(path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


# -- reading ------------------------------------------------------------------------------------


def test_read_matches_safe_open_for_every_plain_dtype(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file(PLAIN_ARRAYS, str(path), metadata={"format": "pt"})
    st = read_safetensors(path)
    assert st.metadata == {"format": "pt"}
    assert set(st.tensors) == set(PLAIN_ARRAYS)
    with safe_open(str(path), framework="numpy") as oracle:
        for name, snap in st.tensors.items():
            expected = oracle.get_tensor(name)
            data = snap.to_data().to_numpy()
            assert data.dtype == expected.dtype, name
            assert data.shape == expected.shape == snap.shape, name
            assert _raw(data) == _raw(expected), name
            assert snap.param_id is None


def test_read_order_is_the_file_data_order(tmp_path):
    path = tmp_path / "order.safetensors"
    save_file(PLAIN_ARRAYS, str(path))
    header = _header(path)
    by_offset = sorted(header, key=lambda n: header[n]["data_offsets"])
    assert list(read_safetensors(path).tensors) == by_offset
    assert read_safetensors(path).offsets == {n: tuple(header[n]["data_offsets"]) for n in header}


def test_read_bf16_is_bit_exact(tmp_path):
    bits = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFBF, 0x0001, 0x807F, 0x3F80, 0x4049], np.uint16)
    values = bits.view(ml_dtypes.bfloat16).reshape(2, 5)
    path = tmp_path / "bf16.safetensors"
    save_file({"w": values}, str(path))
    assert _header(path)["w"]["dtype"] == "BF16"
    snap = read_safetensors(path).tensors["w"]
    assert snap.dtype is op.DType.BF16
    data = snap.to_data().to_numpy()
    assert data.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(data.view(np.uint16).reshape(-1), bits)
    # safe_open reads BF16 too once ml_dtypes has registered "bfloat16" with numpy (imported above).
    with safe_open(str(path), framework="numpy") as oracle:
        assert _raw(oracle.get_tensor("w")) == _raw(data)


def test_f16_special_values_round_trip_bit_exact(tmp_path):
    bits = np.array([0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFE7F, 0x0001, 0x83FF, 0x3C00], np.uint16)
    path = tmp_path / "a.safetensors"
    save_file({"h": bits.view(np.float16), "b": bits.view(ml_dtypes.bfloat16)}, str(path))
    again = tmp_path / "b.safetensors"
    write_safetensors(again, read_safetensors(path).to_record())
    assert again.read_bytes() == path.read_bytes()
    for name in ("h", "b"):
        got = read_safetensors(again).tensors[name].to_data().to_numpy()
        assert np.array_equal(got.view(np.uint16), bits)


def test_reading_is_lazy_and_zero_copy(tmp_path):
    path = tmp_path / "lazy.safetensors"
    save_file({"a": np.zeros(4, np.float32), "b": np.ones(2, np.int64)}, str(path))
    st = read_safetensors(path)
    # Change the bytes of 'a' in place after the header was read: a lazy, mapped read sees them.
    # The modification time is put back so the reader's in-place change check (which would
    # otherwise refuse the read; tests/test_changed_files.py) does not fire.
    stamp = os.stat(path)
    raw = bytearray(path.read_bytes())
    begin = st.data_start + st.offsets["a"][0]
    raw[begin : begin + 16] = np.arange(4, dtype=np.float32).tobytes()
    with open(path, "r+b") as f:
        f.write(raw)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    data = st.tensors["a"].to_data().to_numpy()
    assert data.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not data.flags.writeable
    assert not data.flags.owndata  # a view of the mapping, not a copy


def test_record_loads_into_a_module_with_file_ids(tmp_path):
    class Holder(op.Module):
        def __init__(self):
            self.w = op.Param.from_tensor(op.Tensor.from_numpy(np.zeros((2, 2), np.float32)))

    path = tmp_path / "ids.safetensors"
    write_safetensors(path, {"w": _snapshot(np.eye(2, dtype=np.float32), op.ParamId(2**64 - 5))})
    loaded = Holder().load_record(read_safetensors(path).to_record())
    assert loaded.w.id == op.ParamId(2**64 - 5)
    assert np.array_equal(loaded.w.val().to_numpy(), np.eye(2))


# -- writing ------------------------------------------------------------------------------------


def test_write_reproduces_the_library_bytes(tmp_path):
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_file(PLAIN_ARRAYS, str(theirs), metadata={"format": "pt"})
    # Given in another order: the file order is the library's (dtype, then name).
    items = {name: _snapshot(PLAIN_ARRAYS[name]) for name in reversed(list(PLAIN_ARRAYS))}
    write_safetensors(ours, items, metadata={"format": "pt"}, lossless=False)
    assert ours.read_bytes() == theirs.read_bytes()


def test_write_keeps_ids_order_and_dtypes_in_metadata(tmp_path):
    path = tmp_path / "lossless.safetensors"
    items = {  # the library's file order would be z.weight (4-byte), a.bias (2-byte), m.flag
        "a.bias": _snapshot(np.zeros(2, np.float16), op.ParamId(2**64 - 1)),
        "z.weight": _snapshot(np.ones((2, 2), np.float32), op.ParamId(7), op.DType.Flex32),
        "m.flag": _snapshot(np.array([True])),
    }
    write_safetensors(path, items, metadata={"epoch": "3"}, scalars={"step": 12, "lr": 0.5, "bad": float("nan")})
    meta = _header(path)["__metadata__"]
    assert list(meta) == sorted(meta)
    assert json.loads(meta[PARAM_IDS_KEY]) == {"z.weight": "7", "a.bias": str(2**64 - 1)}
    assert [n for n in _header(path) if n != "__metadata__"] == ["z.weight", "a.bias", "m.flag"]
    assert json.loads(meta[ORDER_KEY]) == ["a.bias", "z.weight", "m.flag"]
    assert json.loads(meta[DTYPES_KEY]) == {"z.weight": "Flex32"}
    assert json.loads(meta[SCALARS_KEY]) == {"step": {"Int": 12}, "lr": {"Float": 0.5}, "bad": {"Float": "nan"}}

    st = read_safetensors(path)
    assert list(st.tensors) == ["a.bias", "z.weight", "m.flag"]
    assert st.metadata == {"epoch": "3"}
    assert st.tensors["z.weight"].dtype is op.DType.Flex32
    assert st.tensors["a.bias"].param_id == op.ParamId(2**64 - 1)
    assert st.tensors["m.flag"].param_id is None
    assert {k: (s.kind, s.value) for k, s in st.scalars.items() if k != "bad"} == {"step": ("Int", 12), "lr": ("Float", 0.5)}
    assert np.isnan(st.scalars["bad"].value)
    # A plain reader still reads the file (the keys are ordinary metadata).
    with safe_open(str(path), framework="numpy") as oracle:
        assert np.array_equal(oracle.get_tensor("z.weight"), np.ones((2, 2), np.float32))


def test_lossless_false_writes_only_the_given_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    write_safetensors(path, {"w": _snapshot(np.ones(2, np.float32), op.ParamId(3))}, lossless=False)
    assert "__metadata__" not in _header(path)
    with pytest.raises(ValueError, match="scalars are kept in the 'onnxparam.scalars' metadata key"):
        write_safetensors(path, {}, scalars={"a": 1}, lossless=False)


def test_write_rejects_reserved_and_non_text_metadata(tmp_path):
    with pytest.raises(ValueError, match="metadata key 'onnxparam.order' is reserved"):
        write_safetensors(tmp_path / "x.safetensors", {}, metadata={"onnxparam.order": "[]"})
    with pytest.raises(ValueError, match="maps text to text"):
        write_safetensors(tmp_path / "x.safetensors", {}, metadata={"epoch": 3})


def test_write_names_the_tensor_whose_data_does_not_fit(tmp_path):
    wrong = TensorSnapshot(op.DType.F32, (2, 2), None, lambda: TensorData(np.zeros((2, 2), np.float16), op.DType.F16, (2, 2)))
    with pytest.raises(op.RecordError, match=r"tensor 'w' is described as F32 \[2, 2\], but its data is float16 \[2, 2\]"):
        write_safetensors(tmp_path / "x.safetensors", {"w": wrong})


def test_write_streams_one_tensor_at_a_time(tmp_path):
    alive: list = []

    def loader(i):
        def load():
            # Every tensor handed out before has been written and released. NOTE: a full collection
            # only when one is still referenced: late in the suite the heap is large and each
            # gc.collect() takes about a second; the assertion is the same either way.
            if any(ref() is not None for ref in alive):
                gc.collect()
            assert all(ref() is None for ref in alive), "an earlier tensor is still in memory"
            array = np.full((256, 256), i, np.float32)
            alive.append(weakref.ref(array))
            return TensorData(array, op.DType.F32, array.shape)

        return load

    items = {f"t{i}": TensorSnapshot(op.DType.F32, (256, 256), None, loader(i)) for i in range(5)}
    written = []
    write_safetensors(tmp_path / "s.safetensors", items, progress=lambda name, n: written.append((name, n)))
    assert written == [(f"t{i}", 256 * 256 * 4) for i in range(5)]


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "keep.safetensors"
    save_file({"old": np.ones(3, np.float32)}, str(path))
    before = path.read_bytes()

    def broken():
        raise RuntimeError("disk on fire")

    items = {"a": _snapshot(np.ones(2, np.float32)), "b": TensorSnapshot(op.DType.F32, (2,), None, broken)}
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_safetensors(path, items)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]


def test_quantized_tensor_survives_safetensors(tmp_path):
    from onnxparam.quant import QuantizedTensor, QuantScheme

    scheme = QuantScheme()
    q = QuantizedTensor.quantize(RNG.standard_normal((4, 8)).astype(np.float32), scheme)
    raw = np.frombuffer(q.to_bytes(), np.uint8)
    snap = TensorSnapshot(op.DType.QFloat, (4, 8), op.ParamId(9), lambda: TensorData(raw, op.DType.QFloat, (4, 8), scheme), scheme)
    path = tmp_path / "q.safetensors"
    write_safetensors(path, {"q": snap})
    assert _header(path)["q"] == {"dtype": "U8", "shape": [raw.size], "data_offsets": [0, raw.size]}
    back = read_safetensors(path).tensors["q"]
    assert (back.dtype, back.shape, back.scheme, back.param_id) == (op.DType.QFloat, (4, 8), scheme, op.ParamId(9))
    assert bytes(back.to_data().array) == raw.tobytes()
    with pytest.raises(op.RecordError, match="tensor 'q' is quantized \\(QFloat\\); safetensors has no quantized dtype"):
        write_safetensors(tmp_path / "plain.safetensors", {"q": snap}, lossless=False)


# -- malformed files ----------------------------------------------------------------------------


def _file_with_header(tmp_path, header, data: bytes = b"", name="bad.safetensors"):
    text = json.dumps(header).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4),
         r"tensor 'w' is F32 \[2\], which takes 8 bytes, but its data_offsets \[0, 4\] span 4"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
          "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}, bytes(6),
         r"tensor 'b' starts at data offset 4: it leaves a gap of 2 bytes"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, bytes(5),
         r"the tensors end at data offset 2, but the data section has 5 bytes"),
        ({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b"",
         r"tensor 'w' has shape \[-1\], not a list of non-negative integers"),
    ],
)
def test_malformed_files_are_rejected_like_the_library_does(tmp_path, header, data, message):
    path = _file_with_header(tmp_path, header, data)
    with pytest.raises(op.RecordError, match=message):
        read_safetensors(path)
    with pytest.raises(SafetensorError):  # the reference implementation refuses them too
        safe_open(str(path), framework="numpy")


def test_dtypes_burn_lacks_are_refused_by_name(tmp_path):
    # (F8_E4M3 / F8_E5M2 / F8_E8M0 read as ONNX-only dtypes: test_onnx_import_float8.py)
    path = _file_with_header(tmp_path, {"w": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(op.RecordError, match=r"tensor 'w' has dtype 'C64', which Burn has no dtype for \(known: BF16, BOOL"):
        read_safetensors(path)


def test_header_over_the_limit_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(op.RecordError, match=f"the header claims {MAX_HEADER_BYTES + 1} bytes, over the"):
        read_safetensors(path)


def test_truncated_and_non_json_headers(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(op.RecordError, match="fewer than the 8-byte header length"):
        read_safetensors(short)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(op.RecordError, match="the header claims 100 bytes, but the file has only 10"):
        read_safetensors(cut)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(op.RecordError, match="the header is not valid UTF-8 JSON"):
        read_safetensors(garbage)


def test_duplicate_names_are_refused(tmp_path):
    text = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(2))
    with pytest.raises(op.RecordError, match="the header names 'a' twice"):
        read_safetensors(path)


def test_bad_onnxparam_keys_are_refused(tmp_path):
    entry = {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    cases = [
        ({PARAM_IDS_KEY: '{"w": "-1"}'}, r"'onnxparam.param_ids' has '-1' for 'w', not a u64"),
        ({PARAM_IDS_KEY: '{"x": "1"}'}, r"__metadata__ names tensor 'x', which the file does not hold"),
        ({ORDER_KEY: '["w", "w"]'}, r"'onnxparam.order' does not list exactly the file's tensors"),
        ({DTYPES_KEY: '{"w": "Flex32"}'}, r"'onnxparam.dtypes' has 'Flex32' for 'w', which does not fit its stored dtype U8"),
        ({DTYPES_KEY: "[1"}, r"__metadata__ key 'onnxparam.dtypes' is not JSON"),
    ]
    for i, (meta, message) in enumerate(cases):
        path = _file_with_header(tmp_path, {"__metadata__": meta, **entry}, bytes(1), name=f"bad{i}.safetensors")
        with pytest.raises(op.RecordError, match=message):
            read_safetensors(path)


def test_snapshot_type_carries_offsets(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": np.ones(3, np.float32), "b": np.ones(1, np.float64)}, str(path))
    snap = read_safetensors(path).tensors["a"]
    assert isinstance(snap, SafetensorsTensor) and isinstance(snap, TensorSnapshot)
    assert (snap.name, snap.data_offsets) == ("a", (8, 20))


def test_closed_file_keeps_given_arrays_and_refuses_new_reads(tmp_path):
    path = tmp_path / "c.safetensors"
    save_file({"a": np.arange(3, dtype=np.float32), "b": np.ones(2, np.float32)}, str(path))
    with read_safetensors(path) as st:
        kept = st.tensors["a"].to_data().to_numpy()
    assert kept.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(op.RecordError, match=f"the safetensors file '{path}' is closed; read it again"):
        st.tensors["b"].to_data()
