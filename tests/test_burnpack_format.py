"""The burnpack reader and writer against Burn's bytes (docs/burnpack.md §0-2, §5) and a real Burn file."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import cbor2
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxparam.burnpack as bp
from onnxparam.core.dtype import NUMPY_DTYPES, DType
from onnxparam.core.errors import RecordError
from onnxparam.core.tensor import Tensor
from onnxparam.quant import QuantScheme, QuantStore, QuantValue, ScaleDtype, quantize

MNIST = Path(__file__).resolve().parent.parent / "models" / "mnist" / "model.bpk"
X = np.array([[-1.0, -0.5, 0.3, 0.5], [1.0, 1.5, -2.0, 2.54]], np.float32)  # docs/burnpack.md §2.4


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace("|", " "))


def t(text: str) -> bytes:
    """CBOR text string (short) written out by hand: head byte 0x60 + length, then UTF-8."""
    raw = text.encode()
    return bytes([0x60 + len(raw)]) + raw


# -- the Burn-written MNIST file --------------------------------------------------------------


def independent_mnist():
    """Parse mnist.bpk with struct + cbor2 only: {name: (descriptor, float32 array)}."""
    raw = MNIST.read_bytes()
    magic, version, size = struct.unpack_from("<IHI", raw)
    assert (magic, version) == (0x4255524E, 1)
    meta = cbor2.loads(raw[10 : 10 + size])
    data_start = -(-(10 + size) // 256) * 256
    out = {}
    for name, d in meta["tensors"].items():
        start, end = d["data_offsets"]
        count = (end - start) // 4
        values = struct.unpack_from(f"<{count}f", raw, data_start + start)
        out[name] = (d, np.array(values, np.float32).reshape(d["shape"]))
    return meta, out


def test_mnist_reads_and_writes_back_byte_for_byte(tmp_path):
    out = tmp_path / "copy.bpk"
    with bp.read(MNIST) as f:
        bp.write(out, f.tensors.values(), metadata=f.metadata, scalars=f.scalars)
    assert out.read_bytes() == MNIST.read_bytes()


def test_mnist_tensors_equal_the_floats_at_their_offsets():
    meta, expected = independent_mnist()
    with bp.read(MNIST) as f:
        assert set(f.tensors) == set(expected) and len(f.tensors) == 18
        assert dict(f.metadata) == {} and dict(f.scalars) == {}
        for name, entry in f.tensors.items():
            d, values = expected[name]
            assert entry.dtype is DType.F32
            assert entry.shape == tuple(d["shape"])
            assert entry.param_id == d["param_id"]
            assert entry.data_offsets == tuple(d["data_offsets"])
            np.testing.assert_array_equal(entry.to_numpy(), values)


def test_mnist_tensors_iterate_in_data_order_not_name_order():
    with bp.read(MNIST) as f:
        names = list(f.tensors)
        offsets = [e.data_offsets[0] for e in f.tensors.values()]
    assert offsets == sorted(offsets)
    assert names[:2] == ["conv1.conv.weight", "conv1.conv.bias"]  # weight at 0, bias at 2304 (§0)


def test_mnist_arrays_are_read_only_zero_copy_views_that_outlive_close():
    f = bp.read(MNIST)
    weight = f.tensors["fc1.weight"].to_numpy()
    assert weight.shape == (1600, 128) and weight.dtype == np.float32
    assert not weight.flags.writeable and not weight.flags.owndata
    assert weight.ctypes.data % 256 == 0  # 256-aligned in a page-aligned mapping
    total = float(weight.sum())
    f.close()
    assert f.closed and float(weight.sum()) == total
    with pytest.raises(RecordError, match="closed"):
        f.tensors["fc1.bias"].to_numpy()


def test_entry_to_data_feeds_tensor_from_data():
    with bp.read(MNIST) as f:
        data = f.tensors["fc3.bias"].to_data()
        tensor = Tensor.from_data(data)
        assert tensor.dtype is DType.F32 and tensor.shape == (10,)
        np.testing.assert_array_equal(tensor.to_numpy(), f.tensors["fc3.bias"].to_numpy())


# -- docs/burnpack.md §2.4 worked files --------------------------------------------------------------


QFLOAT_Q8S = h(
    "a1 66 51 46 6c 6f 61 74 a5 65 76 61 6c 75 65 63 51 38 53 65 73 74 6f 72 65 66 4e 61 74 69"
    "76 65 64 6d 6f 64 65 69 53 79 6d 6d 65 74 72 69 63 66 74 65 6e 73 6f 72 f6 65 62 6c 6f 63 6b f6"
)
EXAMPLE_A_DATA = h("ce e7 0f 19 32 4b 9c 7f | 0a d7 a3 3c")


def example_a_file() -> bytes:
    """The 268-byte file of §2.4 (a), assembled from the note's pieces."""
    metadata = (
        h("a1") + t("tensors") + h("a1") + t("w") + h("a3") + t("dtype") + QFLOAT_Q8S
        + t("shape") + h("82 02 04") + t("data_offsets") + h("82 00 0c")
    )  # fmt: skip
    assert len(metadata) == 106
    header = h("4e 52 55 42 01 00 6a 00 00 00")
    return header + metadata + bytes(0x100 - 0x74) + EXAMPLE_A_DATA


def test_writer_produces_the_q8s_per_tensor_example_file(tmp_path):
    path = tmp_path / "a.bpk"
    bp.write(path, [bp.TensorEntry.from_quantized("w", quantize(X, QuantScheme()))])
    assert len(path.read_bytes()) == 268
    assert path.read_bytes() == example_a_file()


def test_reader_decodes_the_q8s_per_tensor_example_file(tmp_path):
    path = tmp_path / "a.bpk"
    path.write_bytes(example_a_file())
    with bp.read(path) as f:
        w = f.tensors["w"]
        assert (w.dtype, w.shape, w.param_id, w.data_offsets) == (DType.QFloat, (2, 4), None, (0, 12))
        assert w.scheme == QuantScheme()
        assert bytes(w.raw_bytes()) == EXAMPLE_A_DATA
        q = w.quantized()
        assert q.values.tolist() == [[-50, -25, 15, 25], [50, 75, -100, 127]]
        np.testing.assert_array_equal(w.to_numpy(), q.values.astype(np.float32) * np.float32(0.02))


def test_writer_produces_the_q8s_block_two_example(tmp_path):
    path = tmp_path / "b.bpk"
    bp.write(path, [bp.TensorEntry.from_quantized("w", quantize(X, QuantScheme(block_size=2)))])
    raw = path.read_bytes()
    assert raw[6:10] == h("8e 00 00 00")  # 142 bytes of metadata
    assert raw[256:] == h("81 c0 4c 7f 55 7f 9c 7f | 04 02 01 3c | 04 02 81 3b | 06 83 41 3c | 0a d7 a3 3c")
    meta = cbor2.loads(raw[10 : 10 + 142])
    assert meta["tensors"]["w"]["data_offsets"] == [0, 24]
    with bp.read(path) as f:
        assert f.tensors["w"].scheme == QuantScheme(block_size=2)


def test_gpu_packed_store_changes_only_the_dtype_map(tmp_path):
    native, gpu = tmp_path / "n.bpk", tmp_path / "g.bpk"
    bp.write(native, [bp.TensorEntry.from_quantized("w", quantize(X, QuantScheme()))])
    bp.write(gpu, [bp.TensorEntry.from_quantized("w", quantize(X, QuantScheme(store=QuantStore.PackedU32(0))))])
    assert gpu.read_bytes()[-12:] == native.read_bytes()[-12:] == EXAMPLE_A_DATA
    assert h("65 73 74 6f 72 65 a1 69 50 61 63 6b 65 64 55 33 32 00") in gpu.read_bytes()


def test_two_level_tensor_round_trips_with_its_fourteen_bytes(tmp_path):
    scheme = QuantScheme().per_block(4, ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32)
    qt = quantize(np.linspace(-3, 5, 8, dtype=np.float32), scheme)
    path = tmp_path / "d.bpk"
    bp.write(path, [bp.TensorEntry.from_quantized("w", qt)])
    with bp.read(path) as f:
        w = f.tensors["w"]
        assert w.nbytes == 14 and w.scheme == scheme
        np.testing.assert_array_equal(w.to_numpy(), qt.dequantize())


# -- §5 scalars and metadata -------------------------------------------------------------------

SCALARS_HEX = (
    "a5 64 666c6167 a1 64 426f6f6c f5 | 64 68616c66 a1 65 466c6f6174 f9 3800"
    "| 62 6c72 a1 65 466c6f6174 fb 3f50624dd2f1a9fc | 66 6f6666736574 a1 63 496e74 22"
    "| 64 73746570 a1 64 55496e74 18 2a"
)


def test_writer_encodes_scalars_exactly_as_burn(tmp_path):
    path = tmp_path / "s.bpk"
    scalars = {"step": bp.Scalar("UInt", 42), "lr": 0.001, "offset": -3, "half": 0.5, "flag": True}
    bp.write(path, [], scalars=scalars)
    raw = path.read_bytes()
    assert raw[10 : 10 + struct.unpack_from("<I", raw, 6)[0]] == h("a2") + t("tensors") + h("a0") + t("scalars") + h(
        SCALARS_HEX
    )
    with bp.read(path) as f:
        assert dict(f.scalars) == {
            "flag": bp.Scalar("Bool", True),
            "half": bp.Scalar("Float", 0.5),
            "lr": bp.Scalar("Float", 0.001),
            "offset": bp.Scalar("Int", -3),
            "step": bp.Scalar("UInt", 42),
        }


def test_writer_adds_no_default_metadata_and_omits_empty_sections(tmp_path):
    path = tmp_path / "e.bpk"
    bp.write(path, [])
    raw = path.read_bytes()
    assert raw == h("4e 52 55 42 01 00 0a 00 00 00 | a1") + t("tensors") + h("a0") + bytes(256 - 20)
    with bp.read(path) as f:
        assert len(f.tensors) == 0 and dict(f.metadata) == {}


def test_metadata_is_written_sorted_and_read_back(tmp_path):
    path = tmp_path / "m.bpk"
    bp.write(path, [], metadata={"producer": "burn", "format": "burnpack", "version": "0.22.0"})
    raw = path.read_bytes()
    meta = cbor2.loads(raw[10 : 10 + struct.unpack_from("<I", raw, 6)[0]])
    assert list(meta) == ["tensors", "metadata"] and list(meta["metadata"]) == ["format", "producer", "version"]
    with bp.read(path) as f:
        assert dict(f.metadata) == {"format": "burnpack", "producer": "burn", "version": "0.22.0"}


# -- every dtype, randomized ----------------------------------------------------------------------

PLAIN = [d for d in DType if d not in (DType.Bool, DType.QFloat) and d.burnpack_storable]
NAMES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)  # a name is never empty
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
SCALAR_VALUES = st.one_of(
    st.builds(bp.Scalar, st.just("Int"), st.integers(-(2**63), 2**63 - 1)),
    st.builds(bp.Scalar, st.just("UInt"), st.integers(0, 2**64 - 1)),
    st.builds(bp.Scalar, st.just("Float"), st.floats(allow_nan=False)),
    st.builds(bp.Scalar, st.just("Bool"), st.booleans()),
)


@st.composite
def entries(draw):
    names = draw(st.lists(NAMES, min_size=0, max_size=6, unique=True))
    out = []
    for name in names:
        shape = draw(SHAPES)
        kind = draw(st.sampled_from(["plain", "bool", "qfloat"]))
        param_id = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if kind == "plain":
            dtype = draw(st.sampled_from(PLAIN))
            n = int(np.prod(shape)) * NUMPY_DTYPES[dtype].itemsize
            out.append(bp.TensorEntry(name, dtype, shape, rng.integers(0, 256, n, dtype=np.uint8).tobytes(), param_id))
        elif kind == "bool":
            store = draw(st.sampled_from(["Native", "U8", "U32"]))
            values = rng.integers(0, 2, shape).astype(bool)
            out.append(bp.TensorEntry(name, DType.Bool, shape, values, param_id, bool_store=store))
        else:
            value = draw(st.sampled_from([QuantValue.Q8S, QuantValue.Q4F, QuantValue.Q2S]))
            store = draw(st.sampled_from([QuantStore.Native, QuantStore.PackedU32(0)]))
            x = rng.standard_normal(shape).astype(np.float32)
            qt = quantize(x, QuantScheme(value, store=store))
            out.append(bp.TensorEntry.from_quantized(name, qt, param_id))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries(),
    st.dictionaries(NAMES, NAMES, max_size=4),
    st.dictionaries(NAMES, SCALAR_VALUES, max_size=4),
)
def test_any_tensors_metadata_and_scalars_round_trip(tmp_path, tensors, metadata, scalars):
    first, second = tmp_path / "first.bpk", tmp_path / "second.bpk"
    bp.write(first, iter(tensors), metadata=metadata, scalars=scalars)
    with bp.read(first) as f:
        offsets = [e.data_offsets for e in f.tensors.values()]
        assert offsets == sorted(offsets) and set(f.tensors) == {e.name for e in tensors}
        nonempty = [e.name for e in f.tensors.values() if e.nbytes]  # zero-size ones share offsets
        assert nonempty == [e.name for e in tensors if e.name in nonempty]  # data order = write order
        assert dict(f.metadata) == metadata and dict(f.scalars) == scalars
        for want in tensors:
            got = f.tensors[want.name]
            assert (got.dtype, got.shape, got.param_id) == (want.dtype, want.shape, want.param_id)
            assert got.data_offsets[0] % 256 == 0
            if want.dtype is DType.Bool:
                assert got.bool_store == want.bool_store
                np.testing.assert_array_equal(got.to_numpy(), want.data)
            elif want.dtype is DType.QFloat:
                assert got.scheme == want.scheme
                assert bytes(got.raw_bytes()) == want.data.to_bytes()
                np.testing.assert_array_equal(got.to_numpy(), want.data.dequantize())
            else:
                assert bytes(got.raw_bytes()) == want.data
                assert got.to_numpy().tobytes() == want.data and got.to_numpy().shape == want.shape
        bp.write(second, f.tensors.values(), metadata=f.metadata, scalars=f.scalars)
    assert second.read_bytes() == first.read_bytes()


@pytest.mark.parametrize("dtype, np_dtype", [(DType.F16, np.float16), (DType.BF16, ml_dtypes.bfloat16)])
def test_half_precision_bits_survive_exactly_including_nans(tmp_path, dtype, np_dtype):
    bits = np.arange(2**16, dtype=np.uint16).reshape(256, 256)  # every pattern: subnormals, inf, NaNs
    path = tmp_path / "half.bpk"
    bp.write(path, [bp.TensorEntry("h", dtype, (256, 256), bits.view(np_dtype))])
    with bp.read(path) as f:
        got = f.tensors["h"].to_numpy()
        assert got.dtype == np.dtype(np_dtype)
        np.testing.assert_array_equal(got.view(np.uint16), bits)


def test_bool_stores_hold_one_or_four_bytes_per_value(tmp_path):
    values = np.array([[True, False, True], [False, False, True]])
    path = tmp_path / "b.bpk"
    bp.write(
        path, [bp.TensorEntry(f"b_{s}", DType.Bool, (2, 3), values, bool_store=s) for s in ("Native", "U8", "U32")]
    )
    with bp.read(path) as f:
        assert [f.tensors[f"b_{s}"].nbytes for s in ("Native", "U8", "U32")] == [6, 6, 24]
        assert bytes(f.tensors["b_U32"].raw_bytes()) == np.array(values, "<u4").tobytes()
        for entry in f.tensors.values():
            np.testing.assert_array_equal(entry.to_numpy(), values)


def test_scalar_and_zero_size_tensors_round_trip(tmp_path):
    path = tmp_path / "z.bpk"
    tensors = [
        bp.TensorEntry.from_numpy("scalar", np.float64(2.5)),
        bp.TensorEntry.from_numpy("empty", np.zeros((0, 3), np.int64)),
        bp.TensorEntry.from_numpy("after", np.arange(3, dtype=np.int16)),
    ]
    bp.write(path, tensors)
    with bp.read(path) as f:
        assert f.tensors["scalar"].to_numpy().shape == () and f.tensors["scalar"].to_numpy() == 2.5
        assert f.tensors["empty"].to_numpy().shape == (0, 3) and f.tensors["empty"].data_offsets == (256, 256)
        assert f.tensors["after"].data_offsets == (256, 262)
        assert list(f.tensors) == ["scalar", "empty", "after"]


def test_param_ids_keep_all_64_bits(tmp_path):
    path = tmp_path / "p.bpk"
    bp.write(
        path,
        [
            bp.TensorEntry("a", DType.U8, (1,), b"\x01", param_id=2**64 - 1),
            bp.TensorEntry("b", DType.U8, (1,), b"\x02", 0),
        ],
    )
    with bp.read(path) as f:
        assert f.tensors["a"].param_id == 2**64 - 1 and f.tensors["b"].param_id == 0


# -- writer behaviour ----------------------------------------------------------------------------


def test_writer_streams_one_tensor_at_a_time(tmp_path):
    events = []

    def provider(i):
        def produce():
            events.append(("produce", i))
            return np.full((4,), i, np.float32)

        return produce

    def generator():
        for i in range(3):
            events.append(("plan", i))
            yield bp.TensorEntry(f"t{i}", DType.F32, (4,), provider(i))

    bp.write(tmp_path / "s.bpk", generator())
    assert events == [("plan", 0), ("plan", 1), ("plan", 2), ("produce", 0), ("produce", 1), ("produce", 2)]
    with bp.read(tmp_path / "s.bpk") as f:
        assert [float(e.to_numpy()[0]) for e in f.tensors.values()] == [0.0, 1.0, 2.0]


def test_writer_rejects_data_of_another_length_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "keep.bpk"
    bp.write(path, [bp.TensorEntry("ok", DType.U8, (1,), b"\x07")])
    before = path.read_bytes()
    bad = [
        bp.TensorEntry("ok", DType.U8, (1,), b"\x07"),
        bp.TensorEntry("fc1.weight", DType.F32, (2, 4), lambda: bytes(12)),
    ]
    with pytest.raises(
        RecordError, match=r"keep.bpk: tensor 'fc1.weight': data has 12 bytes, but F32 x \[2, 4\] needs 32"
    ):
        bp.write(path, bad)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.bpk"]  # the scratch file is gone


def test_writer_names_the_tensor_whose_provider_failed(tmp_path):
    def boom():
        raise OSError("device lost")

    with pytest.raises(RecordError, match=r"tensor 'w': its data could not be produced: OSError: device lost"):
        bp.write(tmp_path / "x.bpk", [bp.TensorEntry("w", DType.F32, (1,), boom)])
    assert os.listdir(tmp_path) == []


def test_writer_rejects_duplicate_names(tmp_path):
    twice = [bp.TensorEntry("w", DType.U8, (1,), b"\x00")] * 2
    with pytest.raises(RecordError, match="duplicate tensor name 'w'"):
        bp.write(tmp_path / "d.bpk", twice)


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            bp.TensorEntry("w", DType.F32, (2,), np.zeros(2, np.float64)),
            "array of dtype float64, the entry declares F32",
        ),
        (
            bp.TensorEntry("w", DType.F32, (2,), np.zeros(3, np.float32)),
            r"array of shape \[3\], the entry declares \[2\]",
        ),
        (bp.TensorEntry("w", DType.QFloat, (2,), b""), "needs a QuantScheme"),
        (bp.TensorEntry("w", DType.F32, (-1,), b""), "not a list of non-negative integers"),
        (bp.TensorEntry("w", DType.F32, (1,), b"\0" * 4, param_id=2**64), "is not a u64"),
        (bp.TensorEntry("w", DType.Bool, (1,), b"\0", bool_store="U16"), "bool store 'U16'"),
        (bp.TensorEntry("w", DType.F32, (1,), 3.0), "data of type float"),
        (bp.TensorEntry("\udc80", DType.F32, (1,), b"\0" * 4), "not valid Unicode"),
    ],
)
def test_writer_refuses_entries_that_contradict_their_declaration(tmp_path, entry, message):
    with pytest.raises(RecordError, match=message):
        bp.write(tmp_path / "bad.bpk", [entry])
    assert os.listdir(tmp_path) == []


def test_writer_accepts_big_endian_arrays_and_writes_little_endian(tmp_path):
    path = tmp_path / "be.bpk"
    bp.write(path, [bp.TensorEntry("w", DType.I32, (2,), np.array([1, -2], ">i4"))])
    with bp.read(path) as f:
        assert bytes(f.tensors["w"].raw_bytes()) == np.array([1, -2], "<i4").tobytes()


def test_a_file_can_be_rewritten_in_place_while_it_is_open(tmp_path):
    path = tmp_path / "model.bpk"
    path.write_bytes(MNIST.read_bytes())
    with bp.read(path) as f:
        kept = f.tensors["fc3.bias"].to_numpy()
        bp.write(path, f.tensors.values(), metadata={"producer": "onnxparam"})
        np.testing.assert_array_equal(kept, independent_mnist()[1]["fc3.bias"][1])  # old mapping intact
    with bp.read(path) as f:
        assert dict(f.metadata) == {"producer": "onnxparam"} and len(f.tensors) == 18


def test_flex32_is_stored_as_f32_bytes_under_its_own_name(tmp_path):
    path = tmp_path / "flex.bpk"
    bp.write(path, [bp.TensorEntry("w", DType.Flex32, (2,), np.float32([1.5, -2.0]))])
    raw = path.read_bytes()
    assert t("Flex32") in raw[10:256]
    with bp.read(path) as f:
        assert f.tensors["w"].dtype is DType.Flex32 and f.tensors["w"].to_numpy().tolist() == [1.5, -2.0]


def test_float_scalars_take_ciboriums_shortest_lossless_form_and_keep_their_sign(tmp_path):
    nan, inf = float("nan"), float("inf")
    values = {"a": 0.5, "b": -0.0, "c": inf, "d": nan, "e": -nan, "f": 65505.0, "g": 0.1, "h": 2.0**-24}
    expected = {
        "a": "f9 3800",
        "b": "f9 8000",
        "c": "f9 7c00",
        "d": "f9 7e00",
        "e": "f9 fe00",
        "f": "fa 477fe100",
        "g": "fb 3fb999999999999a",
        "h": "f9 0001",
    }
    path, again = tmp_path / "f.bpk", tmp_path / "g.bpk"
    bp.write(path, [], scalars=values)
    raw = path.read_bytes()
    for name, encoding in expected.items():
        assert t(name) + h("a1") + t("Float") + h(encoding) in raw, name
    with bp.read(path) as f:
        got = {k: s.value for k, s in f.scalars.items()}
        assert np.copysign(1.0, got["b"]) == -1.0 and np.isnan(got["d"]) and np.copysign(1.0, got["e"]) == -1.0
        bp.write(again, [], scalars=f.scalars)
    assert again.read_bytes() == raw
