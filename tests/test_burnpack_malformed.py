"""Malformed burnpack files: every limit and inconsistency is a BurnpackFormatError naming the problem.

Files are built by hand (struct + cbor2), so a header can declare sizes far beyond what the
file holds; the reader must refuse them before allocating anything of that size.
"""

from __future__ import annotations

import random
import struct
import tracemalloc
from pathlib import Path

import cbor2
import numpy as np
import pytest

import onnxparam.burnpack as bp
from onnxparam.core.dtype import DType
from onnxparam.core.errors import BurnpackFormatError, RecordError
from onnxparam.quant import QuantScheme, QuantStore, QuantValue, ScaleDtype, quantize

MNIST = Path(__file__).resolve().parent.parent / "models" / "mnist" / "model.bpk"
GiB = 1024**3


def burnpack(
    meta=None,
    *,
    raw_meta: bytes | None = None,
    data: bytes = b"",
    version: int = 1,
    magic: bytes = b"NRUB",
    metadata_size: int | None = None,
) -> bytes:
    """header + metadata + zero padding to 256 + data, any field overridable."""
    raw_meta = cbor2.dumps(meta) if raw_meta is None else raw_meta
    size = len(raw_meta) if metadata_size is None else metadata_size
    head = magic + struct.pack("<HI", version, size) + raw_meta
    return head + bytes(-len(head) % 256) + data


def tensor(dtype="F32", shape=(2, 4), offsets=(0, 32), **extra) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


def one(desc: dict, name: str = "fc1.weight") -> dict:
    return {"tensors": {name: desc}}


@pytest.fixture
def write(tmp_path):
    def write(raw: bytes, name: str = "mnist.bpk") -> Path:
        path = tmp_path / name
        path.write_bytes(raw)
        return path

    return write


def refuse(path: Path, message: str) -> BurnpackFormatError:
    with pytest.raises(BurnpackFormatError, match=message) as info:
        bp.read(path)
    assert str(info.value).startswith(str(path))
    return info.value


# -- header ---------------------------------------------------------------------------------


def test_burnpack_rejects_a_file_shorter_than_the_header(write):
    refuse(write(b"NRUB\x01"), "file has 5 bytes, fewer than the 10-byte burnpack header")
    refuse(write(b""), "file has 0 bytes")


def test_burnpack_rejects_a_wrong_magic(write):
    refuse(
        write(b"PK\x03\x04" + bytes(40)),
        r'not a burnpack file: starts with 50 4b 03 04, expected magic 4e 52 55 42 \("NRUB"\)',
    )


def test_burnpack_rejects_future_version(write):
    refuse(
        write(burnpack({"tensors": {}}, version=2)), "burnpack format version 2 is newer than the supported version 1"
    )


def test_burnpack_rejects_metadata_over_100_mib_before_allocating_it(write):
    path = write(burnpack(raw_meta=b"\xa0", metadata_size=200 * 1024**2))
    tracemalloc.start()
    refuse(path, "metadata size 209715200 bytes exceeds the limit of 104857600 bytes")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1024**2


def test_burnpack_rejects_metadata_truncated_by_the_end_of_file(write):
    refuse(
        write(b"NRUB" + struct.pack("<HI", 1, 1000) + bytes(40)),
        "truncated: the header declares 1000 bytes of metadata, but only 40 bytes follow it",
    )


# -- CBOR --------------------------------------------------------------------------------------


def test_burnpack_rejects_cbor_nested_deeper_than_128(write):
    deep = b"\xa2" + cbor2.dumps("tensors") + b"\xa0" + cbor2.dumps("metadata") + b"\x81" * 128 + b"\x00"
    refuse(write(burnpack(raw_meta=deep)), "deeper than 128 levels")


def test_burnpack_accepts_cbor_nested_exactly_128_deep_then_checks_its_meaning(write):
    deep = b"\xa2" + cbor2.dumps("tensors") + b"\xa0" + cbor2.dumps("metadata") + b"\x81" * 126 + b"\x00"
    refuse(write(burnpack(raw_meta=deep)), "'metadata' must map text to text")


def test_burnpack_rejects_more_than_100000_tensors_before_decoding_them(write):
    raw = b"\xa1" + cbor2.dumps("tensors") + b"\xba" + struct.pack(">I", 100_001)
    refuse(write(burnpack(raw_meta=raw)), "the tensors map declares 100001 tensors, more than the limit of 100000")


def test_burnpack_rejects_containers_longer_than_the_metadata(write):
    raw = b"\xa1" + cbor2.dumps("tensors") + b"\xba" + struct.pack(">I", 90_000)
    refuse(write(burnpack(raw_meta=raw)), "declares 180000 items, only 0 bytes remain")
    refuse(write(burnpack(raw_meta=b"\xa1\x7b" + struct.pack(">Q", 2**40))), "declares 1099511627776 bytes")


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\xbf\xff", "indefinite-length CBOR item at byte 0"),
        (b"\xa1\x67tensors\xc1\x00", "CBOR tag 1 at byte 9"),
        (b"\xa1\x67tensors\xf7", "CBOR simple value 23 at byte 9 is not false, true, null or a float"),
        (b"\xa1\x67tensors", "CBOR ends early"),
        (b"\x80", "the metadata is not a CBOR map"),
        (b"\x07", "the metadata is not a CBOR map"),
        (b"\xa1\x67tensors\xa0\x00", "1 bytes follow the metadata map"),
        (b"\xa1\x67tensors\x7c", "malformed CBOR head 0x7c at byte 9"),
        (b"\xa2\x67tensors\xa0\x67tensors\xa0", "duplicate map key 'tensors' at byte 10"),
        (b"\xa1\x67tensors\xa1\x01\xa0", "map key at byte 10 is not text"),
        (b"\xa1\x62\xff\xfe\xa0", "invalid CBOR"),
    ],
)
def test_burnpack_rejects_cbor_burn_never_writes(write, raw, message):
    refuse(write(burnpack(raw_meta=raw)), f"metadata: {message}")


# -- metadata structure -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"tensors": {}, "extra": 1}, "metadata has unknown keys 'extra'"),
        ({"metadata": {}}, "metadata has no 'tensors' map"),
        ({"tensors": []}, "metadata has no 'tensors' map"),
        ({"tensors": {}, "metadata": {"a": 1}}, "'metadata' must map text to text"),
        ({"tensors": {}, "scalars": []}, "'scalars' must be a map"),
        ({"tensors": {}, "scalars": {"lr": {"Float": 1}}}, "scalar 'lr': Float scalar needs a CBOR float"),
        ({"tensors": {}, "scalars": {"n": {"Int": 2**63}}}, r"scalar 'n': Int scalar needs an integer in"),
        ({"tensors": {}, "scalars": {"s": {"Str": "x"}}}, "unknown scalar kind 'Str'"),
        ({"tensors": {}, "scalars": {"b": {"Bool": True, "Int": 1}}}, "a scalar is a 1-entry map"),
        ({"tensors": {b"w": tensor()}}, "metadata: map key at byte 10 is not text"),
        (one([1, 2]), r"tensor 'fc1.weight': descriptor is not a map"),
        (one({"dtype": "F32", "shape": [1]}), r"tensor 'fc1.weight': descriptor has missing data_offsets"),
        (one(tensor(strides=[1])), r"tensor 'fc1.weight': descriptor has unknown keys \['strides'\]"),
        (one(tensor(shape=[2, -4])), r"shape \[2, -4\] is not a list of u64"),
        (one(tensor(shape=[2.0])), r"shape \[2.0\] is not a list of u64"),
        (one(tensor(offsets=[0])), r"data_offsets \[0\] is not \[start, end\] of u64"),
        (one(tensor(param_id=-1)), "param_id -1 is not a u64"),
        (one(tensor(param_id="7")), "param_id '7' is not a u64"),
    ],
)
def test_burnpack_rejects_malformed_metadata(write, meta, message):
    refuse(write(burnpack(meta, data=bytes(32))), message)


@pytest.mark.parametrize(
    "dtype, message",
    [
        ("F8", "unknown dtype 'F8'; Burn's DType is one of F64, F32"),
        ("Bool", "unknown dtype 'Bool'"),
        ({"Bool": "U16"}, "unknown bool store 'U16'"),
        (
            {"QFloat": {"value": "Q8S", "param": "F32", "store": "Native", "level": "Tensor", "mode": "Symmetric"}},
            "quantization scheme has the keys 'param', 'level' of Burn's format before 2026-08",
        ),
        ({"QFloat": dict(QuantScheme().to_cbor(), mode="Lookup")}, "quantization mode Lookup is not supported"),
        ({"QFloat": dict(QuantScheme().to_cbor(), value="Q3S")}, "unknown value 'Q3S'"),
        ({"Complex": "F32"}, "unknown dtype"),
    ],
)
def test_burnpack_rejects_unknown_dtypes_and_old_quantization_keys(write, dtype, message):
    refuse(write(burnpack(one(tensor(dtype=dtype)), data=bytes(32))), f"tensor 'fc1.weight': {message}")


# -- offsets -----------------------------------------------------------------------------------


def test_burnpack_rejects_a_length_that_does_not_fit_dtype_and_shape(write):
    refuse(
        write(burnpack(one(tensor(offsets=(0, 12))), data=bytes(32))),
        r"mnist.bpk: tensor 'fc1.weight': data_offsets \[0, 12\] hold 12 bytes, but F32 x \[2, 4\] needs 32",
    )


def test_burnpack_rejects_a_quantized_length_that_does_not_fit_its_scheme(write):
    meta = one(tensor(dtype={"QFloat": QuantScheme().to_cbor()}, offsets=(0, 8)), "w")
    refuse(
        write(burnpack(meta, data=bytes(12))),
        r"tensor 'w': data_offsets \[0, 8\] hold 8 bytes, but QFloat\(Q8S Native per-tensor F32\) x \[2, 4\] needs 12",
    )


def test_burnpack_rejects_a_tensor_over_10_gib_before_allocating(write):
    path = write(burnpack(one(tensor("U8", (11 * GiB,), (0, 11 * GiB))), data=bytes(16)))
    tracemalloc.start()
    refuse(
        path,
        r"data_offsets \[0, 11811160064\] hold 11811160064 bytes, more than the limit of 10737418240 bytes \(10 GiB\)",
    )
    assert tracemalloc.get_traced_memory()[1] < 1024**2
    tracemalloc.stop()


def test_burnpack_rejects_offsets_past_the_end_of_the_file(write):
    refuse(
        write(burnpack(one(tensor(shape=(64,), offsets=(0, 256))), data=bytes(100))),
        r"data_offsets \[0, 256\] end at byte 512 of the file, but it has 356 bytes \(truncated\?\)",
    )


def test_burnpack_rejects_offsets_that_end_before_they_start(write):
    refuse(
        write(burnpack(one(tensor(offsets=(256, 0))), data=bytes(300))),
        r"data_offsets \[256, 0\] end before they start",
    )


def test_burnpack_rejects_offsets_not_aligned_to_256(write):
    refuse(write(burnpack(one(tensor(offsets=(4, 36))), data=bytes(64))), "data offset 4 is not a multiple of 256")


def test_burnpack_rejects_overlapping_tensors(write):
    meta = {"tensors": {"a": tensor(shape=(128,), offsets=(0, 512)), "b": tensor(shape=(128,), offsets=(256, 768))}}
    refuse(write(burnpack(meta, data=bytes(768))), r"tensors 'a' \[0, 512\] and 'b' \[256, 768\] overlap")


def test_burnpack_accepts_zero_size_tensors_sharing_an_offset(write):
    meta = {"tensors": {"a": tensor(shape=(0,), offsets=(0, 0)), "b": tensor(shape=(1,), offsets=(0, 4))}}
    with bp.read(write(burnpack(meta, data=bytes(4)))) as f:
        assert list(f.tensors) == ["a", "b"]


def test_burnpack_rejects_empty_shapes_no_array_can_have(write):
    refuse(
        write(burnpack(one(tensor(shape=(0, 2**63), offsets=(0, 0))))),
        r"shape \[0, 9223372036854775808\] is empty, but",
    )


def test_burnpack_reports_unreadable_paths_as_file_errors(tmp_path):
    # README: a missing file is a FileMissingError, a folder an IsAFolderError (builtin leaves too)
    with pytest.raises(FileNotFoundError, match="no such file: '.*missing.bpk'"):
        bp.read(tmp_path / "missing.bpk")
    with pytest.raises(IsADirectoryError, match="it is a folder, not a file"):
        bp.read(tmp_path)


def test_quantized_tensors_that_cannot_be_decoded_fail_on_access_with_a_record_error(write):
    scheme = QuantScheme(QuantValue.E4M3)
    meta = one(tensor(dtype={"QFloat": scheme.to_cbor()}, offsets=(0, 12)), "w")
    with bp.read(write(burnpack(meta, data=bytes(12)))) as f:
        assert bytes(f.tensors["w"].raw_bytes()) == bytes(12)  # still readable, and writable back
        with pytest.raises(RecordError, match="tensor 'w': E4M3 values are not supported"):
            f.tensors["w"].to_numpy()


# -- fuzzing --------------------------------------------------------------------------------------


def quantized_file(path: Path) -> bytes:
    x = np.linspace(-2, 3, 64, dtype=np.float32).reshape(4, 16)
    entries = [
        bp.TensorEntry.from_quantized("q8", quantize(x, QuantScheme())),
        bp.TensorEntry.from_quantized(
            "q4", quantize(x, QuantScheme(QuantValue.Q4S, 8, store=QuantStore.PackedU32(0))), 7
        ),
        bp.TensorEntry.from_quantized("two", quantize(x, QuantScheme().per_block(16, ScaleDtype.UE4M3).per_tensor())),
        bp.TensorEntry("mask", DType.Bool, (3,), np.array([True, False, True]), bool_store="U32"),
        bp.TensorEntry.from_numpy("bias", np.arange(5, dtype=np.float16)),
    ]
    bp.write(path, entries, metadata={"producer": "test"}, scalars={"lr": 0.001, "step": 3})
    return path.read_bytes()


def mutate(rng: random.Random, raw: bytes, hot: int) -> bytes:
    """One of: truncation, byte flips / random bytes in the first `hot` bytes, a new
    metadata size, an inserted or deleted byte in the metadata."""
    kind = rng.randrange(6) if len(raw) > 11 else 0
    b = bytearray(raw)
    if kind == 0:
        return bytes(b[: rng.randrange(len(b) + 1)])
    if kind in (1, 2):
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(min(hot, len(b)))
            b[i] = b[i] ^ (1 << rng.randrange(8)) if kind == 1 else rng.randrange(256)
        return bytes(b)
    if kind == 3:
        b[6:10] = struct.pack("<I", rng.choice([0, 1, rng.randrange(2**32), len(b) - 10, len(b), hot - 1]))
        return bytes(b)
    i = rng.randrange(10, min(hot, len(b)))
    if kind == 4:
        return bytes(b[:i] + bytes([rng.randrange(256)]) + b[i:])
    return bytes(b[:i] + b[i + 1 :])


def exercise(path: Path) -> None:
    try:
        f = bp.read(path)
    except RecordError:
        return
    with f:
        for entry in f.tensors.values():
            try:
                entry.to_numpy()
                entry.to_data()
                bytes(entry.raw_bytes())
            except RecordError:
                pass
        dict(f.metadata), dict(f.scalars)


@pytest.mark.parametrize("source, cases", [("mnist", 1500), ("quantized", 2500)])
def test_fuzzed_files_raise_only_record_errors(tmp_path, source, cases):
    if source == "mnist":
        raw = MNIST.read_bytes()
        hot = 1536  # header + metadata + padding; the data section is never validated
    else:
        raw = quantized_file(tmp_path / "q.bpk")
        hot = struct.unpack_from("<I", raw, 6)[0] + 10
    rng = random.Random(20260821)
    path = tmp_path / "fuzz.bpk"
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(cases):
        path.write_bytes(mutate(rng, raw, hot))
        try:
            bp.read(path).close()
            outcomes["ok"] += 1
        except RecordError:
            outcomes["refused"] += 1
        exercise(path)
    assert outcomes["refused"] > cases // 4 and outcomes["ok"] > 0
