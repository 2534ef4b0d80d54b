"""QuantScheme and friends: Burn's names, defaults, resolution and exact CBOR (docs/burnpack.md §1.3, §3)."""

from __future__ import annotations

import re

import cbor2
import pytest

from onnxparam.burnpack import _cbor as cbor
from onnxparam.core.errors import QuantizationError
from onnxparam.quant import BlockScale, BlockSize, QuantMode, QuantScheme, QuantStore, QuantValue, ScaleDtype


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace("|", " "))


# -- enums -----------------------------------------------------------------------------------

RANGES = {  # docs/burnpack.md §3 table: value -> (bits, (a, b), is_symmetric)
    "Q8F": (8, (-128, 127), False),
    "Q8S": (8, (-127, 127), True),
    "Q4F": (4, (-8, 7), False),
    "Q4S": (4, (-7, 7), True),
    "Q2F": (2, (-2, 1), False),
    "Q2S": (2, (-1, 1), True),
    "E4M3": (8, (-448, 448), False),
    "E5M2": (8, (-57344, 57344), False),
    "E2M1": (4, (-6, 6), False),
}


@pytest.mark.parametrize("name", RANGES)
def test_quant_value_has_burns_bits_range_and_symmetry(name):
    value = QuantValue[name]
    bits, (a, b), symmetric = RANGES[name]
    assert value.value == name
    assert value.bits == bits
    assert value.range == (a, b)
    assert value.is_symmetric is symmetric


def test_enums_are_spelled_as_burns_variants():
    assert [v.value for v in QuantValue] == ["Q8F", "E5M2", "E4M3", "Q4F", "E2M1", "Q2F", "Q8S", "Q4S", "Q2S"]
    assert [d.value for d in ScaleDtype] == ["F32", "F16", "BF16", "UE8M0", "UE4M3"]
    assert [m.value for m in QuantMode] == ["Symmetric", "Lookup"]
    assert [d.nbytes for d in ScaleDtype] == [4, 2, 2, 1, 1]


def test_quant_store_spells_burns_variants_and_round_trips_cbor():
    assert QuantStore.Native.to_cbor() == "Native"
    assert QuantStore.PackedU32(0).to_cbor() == {"PackedU32": 0}
    assert QuantStore.PackedNative(1).to_cbor() == {"PackedNative": 1}
    for store in (QuantStore.Native, QuantStore.PackedU32(0), QuantStore.PackedU32(3), QuantStore.PackedNative(0)):
        assert QuantStore.from_cbor(store.to_cbor()) == store
    assert repr(QuantStore.PackedU32(0)) == "QuantStore.PackedU32(0)"


@pytest.mark.parametrize("bad", ["U8", {"PackedU8": 0}, {"PackedU32": -1}, {"PackedU32": 0, "x": 1}, 3])
def test_quant_store_rejects_unknown_variants(bad):
    with pytest.raises(QuantizationError, match="unknown quantization store"):
        QuantStore.from_cbor(bad)


# -- BlockSize -------------------------------------------------------------------------------


def test_block_size_drops_leading_ones_and_pads_storage_with_ones():
    assert BlockSize((1, 32)) == BlockSize(32) == BlockSize((32,))
    assert BlockSize((1, 1, 8, 4, 2, 3)).dims == (8, 4, 2, 3)
    assert BlockSize((32,)).storage == (32, 1, 1, 1, 1)
    assert BlockSize((32, 1)).dims == (32, 1)
    assert BlockSize((1, 1)).dims == ()


def test_block_size_is_rank_relative_like_burns():
    assert BlockSize(32) != BlockSize((32, 32))
    assert BlockSize(32).to_dim_vec(2) == (1, 32)
    assert BlockSize((32, 32)).to_dim_vec(2) == (32, 32)
    assert BlockSize(32).num_blocks((8, 64)) == (8, 2)
    assert BlockSize((4, 32)).num_blocks((8, 64)) == (2, 2)
    assert BlockSize(32).num_blocks((4, 8, 64)) == (4, 8, 2)
    assert BlockSize(32).num_blocks((8, 70)) == (8, 3)


@pytest.mark.parametrize("bad, says", [(0, "block extent 0 is not an integer in 1..255"),
                                       (256, "block extent 256 is not an integer in 1..255"),
                                       ((2, 2, 2, 2, 2, 2), "has more than 5 dims"),
                                       ((3, -1), "block extent -1 is not an integer in 1..255")])
def test_block_size_rejects_extents_burn_cannot_store(bad, says):
    # docs/burnpack.md: Burn's BlockSize holds up to 5 extents of u8, each at least 1
    with pytest.raises(QuantizationError, match=re.escape(says)):
        BlockSize(bad)


def test_block_size_cbor_is_five_u8_slots_and_a_length():
    assert BlockSize(2).to_cbor() == {"storage": [2, 1, 1, 1, 1], "len": 1}
    assert BlockSize.from_cbor({"storage": [16, 4, 1, 1, 1], "len": 2}) == BlockSize((16, 4))


@pytest.mark.parametrize(
    "bad",
    [
        {"storage": [1, 32, 1, 1, 1], "len": 2},  # leading 1 kept (pre-2026-08 BlockSize::new)
        {"storage": [32, 0, 1, 1, 1], "len": 1},  # unused slot not padded with 1
        {"storage": [32, 1, 1, 1], "len": 1},
        {"storage": [32, 1, 1, 1, 1], "len": 6},
        {"storage": b"\x20\x01\x01\x01\x01", "len": 1},
    ],
)
def test_block_size_from_cbor_accepts_only_burns_canonical_form(bad):
    with pytest.raises(QuantizationError, match="block size"):
        BlockSize.from_cbor(bad)


# -- QuantScheme -----------------------------------------------------------------------------


def test_quant_scheme_defaults_to_q8s_native_per_tensor():
    scheme = QuantScheme()
    assert scheme == QuantScheme(value=QuantValue.Q8S, block_size=None)
    assert (scheme.value, scheme.store, scheme.mode, scheme.tensor, scheme.block) == (
        QuantValue.Q8S,
        QuantStore.Native,
        QuantMode.Symmetric,
        None,
        None,
    )
    assert scheme.tensor_scale() is ScaleDtype.F32  # resolved, not stored
    assert scheme.scale_dtype() is ScaleDtype.F32
    assert scheme.num_levels() == 1
    assert scheme.block_size is None


def test_quant_scheme_block_size_int_means_the_last_axis():
    scheme = QuantScheme(QuantValue.Q4S, block_size=32)
    assert scheme.block == BlockScale(BlockSize((32,)), ScaleDtype.F32)
    assert scheme.block_size.to_dim_vec(2) == (1, 32)
    assert QuantScheme(block_size=(32, 1)).block_size.to_dim_vec(2) == (32, 1)
    assert QuantScheme(block_size=(1, 32)) == QuantScheme(block_size=32)


def test_burn_default_is_q8f_packed_u32_without_levels():
    scheme = QuantScheme.burn_default()
    assert scheme.to_cbor() == {
        "value": "Q8F",
        "store": {"PackedU32": 0},
        "mode": "Symmetric",
        "tensor": None,
        "block": None,
    }


def test_scale_dtype_resolves_block_then_tensor_then_f32():
    assert QuantScheme().scale_dtype() is ScaleDtype.F32
    assert QuantScheme().per_tensor(ScaleDtype.F16).scale_dtype() is ScaleDtype.F16
    two = QuantScheme().per_block(16, ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32)
    assert two.scale_dtype() is ScaleDtype.UE4M3
    assert two.global_scale_dtype() is ScaleDtype.F32 and two.is_two_level and two.num_levels() == 2
    block_only = QuantScheme().per_block(32, ScaleDtype.F16)
    assert block_only.tensor_scale() is None and block_only.global_scale_dtype() is None


def test_levels_set_in_any_order_are_the_same_scheme():
    a = QuantScheme().per_block(16, ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32)
    b = QuantScheme().per_tensor(ScaleDtype.F32).per_block(16, ScaleDtype.UE4M3)
    assert a == b and hash(a) == hash(b)


def test_explicit_per_tensor_f32_differs_from_no_level_as_in_burn():
    assert QuantScheme().per_tensor(ScaleDtype.F32) != QuantScheme()
    assert QuantScheme().per_tensor(ScaleDtype.F32).to_cbor()["tensor"] == "F32"


def test_with_methods_return_copies_and_leave_the_receiver_alone():
    base = QuantScheme()
    assert base.with_value(QuantValue.Q4F).value is QuantValue.Q4F
    assert base.with_store(QuantStore.PackedU32(0)).store == QuantStore.PackedU32(0)
    assert base.with_block_size(8).block == BlockScale(BlockSize(8), ScaleDtype.F32)
    assert base.with_block_size(8).with_scale_dtype(ScaleDtype.F16).block.dtype is ScaleDtype.F16
    assert base.with_block_size(8, ScaleDtype.BF16).with_block_size(4).block.dtype is ScaleDtype.BF16
    assert base.with_block_size(8).with_block_size(None) == base
    assert base.with_scale_dtype(ScaleDtype.F16).tensor is ScaleDtype.F16
    assert base.with_mode(QuantMode.Lookup).mode is QuantMode.Lookup
    assert base == QuantScheme()
    with pytest.raises(AttributeError):
        base.value = QuantValue.Q8F  # frozen


def test_quant_scheme_rejects_block_size_and_block_together_and_wrong_types():
    with pytest.raises(QuantizationError, match="not both"):
        QuantScheme(block_size=4, block=BlockScale(BlockSize(4)))
    with pytest.raises(QuantizationError, match="QuantScheme.value"):
        QuantScheme("Q8S")


# -- exact CBOR bytes (docs/burnpack.md §1.3 examples) ----------------------------------------------

FLEX_Q8S_PER_TENSOR = h(
    "a1 66 51 46 6c 6f 61 74 a5 65 76 61 6c 75 65 63 51 38 53 65 73 74 6f 72 65 66 4e 61 74 69"
    "76 65 64 6d 6f 64 65 69 53 79 6d 6d 65 74 72 69 63 66 74 65 6e 73 6f 72 f6 65 62 6c 6f 63 6b f6"
)
BLOCK_2_F32_TAIL = h(
    "65 62 6c 6f 63 6b a2 64 73 69 7a 65 a2 67 73 74 6f 72 61 67 65 85 02 01 01 01 01"
    "63 6c 65 6e 01 65 64 74 79 70 65 63 46 33 32"
)
GPU_Q4S_STORE = h("65 73 74 6f 72 65 a1 69 50 61 63 6b 65 64 55 33 32 00")


def qfloat_bytes(scheme: QuantScheme) -> bytes:
    return cbor.dumps({"QFloat": scheme.to_cbor()})


def test_flex_q8s_per_tensor_scheme_encodes_to_burns_bytes():
    assert qfloat_bytes(QuantScheme()) == FLEX_Q8S_PER_TENSOR
    assert cbor2.dumps({"QFloat": QuantScheme().to_cbor()}) == FLEX_Q8S_PER_TENSOR
    assert QuantScheme.from_cbor(cbor2.loads(FLEX_Q8S_PER_TENSOR)["QFloat"]) == QuantScheme()


def test_block_size_two_scheme_encodes_its_block_level_as_burn():
    encoded = qfloat_bytes(QuantScheme(block_size=2))
    assert encoded == FLEX_Q8S_PER_TENSOR[: -len("65 62 6c 6f 63 6b f6".split())] + BLOCK_2_F32_TAIL
    assert QuantScheme.from_cbor(cbor2.loads(encoded)["QFloat"]) == QuantScheme(block_size=2)


def test_gpu_q4s_scheme_encodes_its_packed_store_as_burn():
    encoded = qfloat_bytes(QuantScheme(QuantValue.Q4S, store=QuantStore.PackedU32(0)))
    assert GPU_Q4S_STORE in encoded
    assert cbor2.loads(encoded) == {
        "QFloat": {"value": "Q4S", "store": {"PackedU32": 0}, "mode": "Symmetric", "tensor": None, "block": None}
    }


def test_two_level_scheme_encodes_tensor_f32_and_ue4m3_block():
    scheme = QuantScheme().per_block(16, ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32)
    decoded = cbor2.loads(qfloat_bytes(scheme))["QFloat"]
    assert decoded["tensor"] == "F32"
    assert decoded["block"] == {"size": {"storage": [16, 1, 1, 1, 1], "len": 1}, "dtype": "UE4M3"}
    assert list(decoded) == ["value", "store", "mode", "tensor", "block"]


@pytest.mark.parametrize("value", list(QuantValue))
@pytest.mark.parametrize("store", [QuantStore.Native, QuantStore.PackedU32(0), QuantStore.PackedNative(0)])
@pytest.mark.parametrize(
    "levels",
    [
        {},
        {"tensor": ScaleDtype.F16},
        {"block": BlockScale(BlockSize((4, 8)), ScaleDtype.BF16)},
        {"tensor": ScaleDtype.F32, "block": BlockScale(BlockSize(16), ScaleDtype.UE4M3)},
        {"block": BlockScale(BlockSize(32), ScaleDtype.UE8M0)},
    ],
)
def test_every_scheme_round_trips_through_cbor_bytes(value, store, levels):
    scheme = QuantScheme(value, store=store, **levels)
    assert QuantScheme.from_cbor(cbor2.loads(cbor.dumps(scheme.to_cbor()))) == scheme


def test_from_cbor_rejects_the_pre_2026_08_scheme_layout():
    old = {
        "value": "Q8S",
        "param": "F32",
        "store": "Native",
        "level": {"Block": {"storage": [32, 1, 1, 1, 1], "len": 1}},
        "mode": "Symmetric",
    }
    with pytest.raises(QuantizationError, match=r"keys 'param', 'level' of Burn's format before 2026-08"):
        QuantScheme.from_cbor(old)


def test_from_cbor_rejects_lookup_mode():
    obj = dict(QuantScheme().to_cbor(), mode="Lookup")
    with pytest.raises(QuantizationError, match="Lookup is not supported"):
        QuantScheme.from_cbor(obj)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"value": "Q3S"}, "unknown value 'Q3S'"),
        ({"mode": "Asymmetric"}, "unknown mode 'Asymmetric'"),
        ({"tensor": "F8"}, "unknown tensor dtype 'F8'"),
        ({"zero_point": 0}, "unknown keys 'zero_point'"),
        ({"block": {"size": {"storage": [2, 1, 1, 1, 1], "len": 1}}}, "block level"),
    ],
)
def test_from_cbor_rejects_unknown_variants_and_keys(change, message):
    with pytest.raises(QuantizationError, match=message):
        QuantScheme.from_cbor(dict(QuantScheme().to_cbor(), **change))


def test_from_cbor_rejects_a_missing_value():
    obj = QuantScheme().to_cbor()
    del obj["value"]
    with pytest.raises(QuantizationError, match="lacks 'value'"):
        QuantScheme.from_cbor(obj)
