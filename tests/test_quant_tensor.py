"""QuantizedTensor and the MinMax quantizer against docs/burnpack.md §2-4 and independent numpy oracles."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxparam.core.dtype import DType
from onnxparam.core.errors import QuantizationError
from onnxparam.core.quant_scales import decode_scales, round_up
from onnxparam.core.tensor import Tensor
from onnxparam.quant import (
    QuantizedTensor,
    QuantScheme,
    QuantStore,
    QuantValue,
    ScaleDtype,
    quantize,
    quantized_nbytes,
    round_half_away_from_zero,
)

X = np.array([[-1.0, -0.5, 0.3, 0.5], [1.0, 1.5, -2.0, 2.54]], np.float32)  # docs/burnpack.md §2.4


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace("|", " "))


# -- oracles written here, independent of the package --------------------------------------------


def oracle_dequantize(values, scales, shape, block_dims, global_scale=None):
    """x[e] = q[e] * scale[block of e], looping over coordinates; f32 as Burn (§3)."""
    out = np.zeros(shape, np.float32)
    rank = len(shape)
    extents = (1,) * (rank - len(block_dims)) + tuple(block_dims) if block_dims is not None else None
    flat_scales = np.asarray(scales, np.float32).reshape(-1)
    grid = [-(-d // b) for d, b in zip(shape, extents)] if extents is not None else None
    for coord in itertools.product(*[range(d) for d in shape]):
        if extents is None:
            s = flat_scales[0]
        else:
            index = 0
            for c, b, g in zip(coord, extents, grid):
                index = index * g + c // b
            s = flat_scales[index]
        q = np.float32(values[coord])
        out[coord] = (np.float32(global_scale) * s) * q if global_scale is not None else s * q
    return out


def all_values(dtype) -> np.ndarray:
    """Every non-negative finite value of a 16/8-bit float dtype, ascending, as float32."""
    bits = np.arange(
        2 ** (8 * np.dtype(dtype).itemsize), dtype=np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint8
    )
    values = bits.view(dtype).astype(np.float32)
    return np.unique(values[np.isfinite(values) & (values >= 0)])


GRIDS = {
    ScaleDtype.F16: all_values(np.float16),
    ScaleDtype.BF16: all_values(ml_dtypes.bfloat16),
    ScaleDtype.UE4M3: all_values(ml_dtypes.float8_e4m3fn),
}


def oracle_round_up(s: float, dtype: ScaleDtype) -> np.float32:
    grid = GRIDS[dtype]
    i = np.searchsorted(grid, np.float32(s), side="left")
    return grid[min(i, len(grid) - 1)]


# -- §2.4 worked examples ------------------------------------------------------------------------


def test_q8s_per_tensor_quantizes_the_worked_example_exactly():
    qt = quantize(X, QuantScheme())
    assert qt.values.tolist() == [[-50, -25, 15, 25], [50, 75, -100, 127]]
    assert qt.scales.view(np.uint32).tolist() == [0x3CA3D70A]
    assert qt.to_bytes() == h("ce e7 0f 19 32 4b 9c 7f | 0a d7 a3 3c")


def test_q8s_block_two_quantizes_the_worked_example_exactly():
    qt = quantize(X, QuantScheme(block_size=2))
    assert qt.values.tolist() == [[-127, -64, 76, 127], [85, 127, -100, 127]]
    assert qt.to_bytes() == h("81 c0 4c 7f 55 7f 9c 7f | 04 02 01 3c | 04 02 81 3b | 06 83 41 3c | 0a d7 a3 3c")
    assert qt.scales.tolist() == np.float32([[2 / 254, 1 / 254], [3 / 254, np.float32(5.08) / 254]]).tolist()


def test_q8_values_are_identical_bytes_under_packed_u32_and_native():
    native = quantize(X, QuantScheme())
    packed = quantize(X, QuantScheme(store=QuantStore.PackedU32(0)))
    assert packed.to_bytes() == native.to_bytes()


def test_q4s_packed_u32_puts_the_first_value_in_the_low_nibble():
    values = np.array([-7, -3, 0, 1, 2, 3, 5, 7], np.int8)
    packed = QuantizedTensor((8,), QuantScheme(QuantValue.Q4S, store=QuantStore.PackedU32(0)), values, [1.0])
    native = QuantizedTensor((8,), QuantScheme(QuantValue.Q4S), values, [1.0])
    assert packed.to_bytes()[:4] == h("d9 10 32 75")
    assert native.to_bytes()[:8] == h("f9 fd 00 01 02 03 05 07")
    for qt in (packed, native):
        assert QuantizedTensor.from_bytes(qt.to_bytes(), (8,), qt.scheme).values.tolist() == values.tolist()


def test_q2s_packed_u32_packs_sixteen_values_per_word():
    values = np.array([-1, 0, 1, 1, -1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0], np.int8)
    qt = QuantizedTensor((16,), QuantScheme(QuantValue.Q2S, store=QuantStore.PackedU32(0)), values, [1.0])
    assert qt.to_bytes()[:4] == h("53 43 55 00")
    assert QuantizedTensor.from_bytes(qt.to_bytes(), (16,), qt.scheme).values.tolist() == values.tolist()


def test_two_level_q8s_is_values_then_ue4m3_blocks_then_f32_global():
    scheme = QuantScheme().per_block(4, ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32)
    x = np.array([0.5, -1.0, 0.25, 2.0, 10.0, -3.0, 0.0, 7.5], np.float32)
    qt = quantize(x, scheme)
    raw = qt.to_bytes()
    assert len(raw) == 14 == quantized_nbytes((8,), scheme)
    assert raw[:8] == qt.values.tobytes()
    blocks = np.frombuffer(raw[8:10], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    glob = np.frombuffer(raw[10:], "<f4")[0]
    # §4.3 recomputed here: raw block scales alpha/127, global = max / 448, blocks rounded up
    raw_scales = np.float32([2.0, 10.0]) * np.float32(2) / np.float32(254)
    assert glob == max(raw_scales.max() / np.float32(448), np.float32(2.0**-126))
    assert blocks.tolist() == [oracle_round_up(s / glob, ScaleDtype.UE4M3) for s in raw_scales]
    back = QuantizedTensor.from_bytes(raw, (8,), scheme)
    assert back.global_scale == glob
    np.testing.assert_array_equal(back.dequantize(), oracle_dequantize(qt.values, blocks, (8,), (4,), glob))


def test_packed_u32_pads_every_row_to_whole_words():
    scheme = QuantScheme(QuantValue.Q4S, store=QuantStore.PackedU32(0))
    assert quantized_nbytes((3, 3), scheme) == 3 * 4 + 4  # 3 rows x 1 word, one f32 scale
    values = np.array([[1, -2, 3], [-4, 5, -6], [7, 0, -7]], np.int8)
    qt = QuantizedTensor((3, 3), scheme, values, [0.5])
    words = np.frombuffer(qt.to_bytes()[:12], "<u4")
    assert [hex(w) for w in words] == ["0x3e1", "0xa5c", "0x907"]
    assert QuantizedTensor.from_bytes(qt.to_bytes(), (3, 3), scheme).values.tolist() == values.tolist()


# -- scale rounding and calibration rules (§4) -----------------------------------------------------


@pytest.mark.parametrize("dtype", [ScaleDtype.F16, ScaleDtype.BF16, ScaleDtype.UE4M3])
def test_round_up_picks_the_smallest_representable_value_not_below(dtype):
    rng = np.random.default_rng(7)
    samples = np.concatenate(
        [
            GRIDS[dtype][:: max(1, len(GRIDS[dtype]) // 200)],  # on-grid values stay put
            np.float32(10.0) ** rng.uniform(-12, 6, 2000).astype(np.float32),
            np.float32(
                [0.0, 2.0**-24, 2.0**-25, 3e-8, 2.0**-9, 2.0**-6, 1e-3, 447.0, 448.0, 449.0, 65504.0, 7e4, 3.4e38]
            ),
        ]
    ).astype(np.float32)
    got = round_up(samples, dtype)
    want = np.array([oracle_round_up(s, dtype) for s in samples], np.float32)
    np.testing.assert_array_equal(got, want)


def test_round_up_is_the_identity_for_f32_and_refuses_ue8m0():
    s = np.float32([0.1, 3.0, 1e-30])
    np.testing.assert_array_equal(round_up(s, ScaleDtype.F32), s)
    with pytest.raises(QuantizationError, match="UE8M0"):
        round_up(s, ScaleDtype.UE8M0)


def test_round_half_away_from_zero_breaks_ties_away_from_zero():
    y = np.float32([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, 127.5, 3.0, -0.0])
    assert round_half_away_from_zero(y).tolist() == [1, 2, 3, -1, -3, 0, 0, 127, 128, 3, 0]


def test_q8f_minmax_clips_the_positive_extreme_to_127():
    qt = quantize(np.float32([-127.5, 127.5, 0.5, -0.5]), QuantScheme(QuantValue.Q8F))
    assert qt.scales.tolist() == [1.0]  # 2 * 127.5 / 255, exact
    assert qt.values.tolist() == [-128, 127, 1, -1]  # +127.5 rounds to 128, then clamps (§4.5)


def test_a_zero_tensor_gets_the_dtype_rounded_min_positive_scale():
    for dtype, want in [(ScaleDtype.F32, 2.0**-126), (ScaleDtype.F16, 2.0**-24), (ScaleDtype.UE4M3, 2.0**-9)]:
        qt = quantize(np.zeros((2, 4), np.float32), QuantScheme(block_size=4).with_scale_dtype(dtype))
        assert qt.scales.reshape(-1).tolist() == [want, want]
        assert not qt.values.any()


def test_quantize_refuses_blocks_that_do_not_divide_the_shape():
    with pytest.raises(QuantizationError, match=r"shape \[2, 6\] is not a whole number of \[1, 4\] blocks"):
        quantize(np.zeros((2, 6), np.float32), QuantScheme(block_size=4))


@pytest.mark.parametrize(
    "scheme, message",
    [
        (QuantScheme(QuantValue.E4M3), "GPU only"),
        (QuantScheme(block_size=4).with_scale_dtype(ScaleDtype.UE8M0), "UE8M0"),
        (QuantScheme().per_block(4, ScaleDtype.F32).per_tensor(ScaleDtype.F32), "no wider than F16"),
        (QuantScheme().per_block(4, ScaleDtype.F16).per_tensor(ScaleDtype.F16), "global scale as F32"),
        (QuantScheme(store=QuantStore.PackedU32(1)), "PackedU32\\(1\\) is not supported"),
    ],
)
def test_quantize_refuses_schemes_burn_cannot_quantize_on_cpu(scheme, message):
    with pytest.raises(QuantizationError, match=message):
        quantize(np.ones((4, 4), np.float32), scheme)


def test_quantize_refuses_integer_input():
    with pytest.raises(QuantizationError, match="only float arrays"):
        quantize(np.ones(4, np.int32), QuantScheme())


# -- bytes, values and dequantization: randomized against the oracles -------------------------------

SCHEMES = st.builds(
    lambda value, packed, block, dtype, two_level: _scheme(value, packed, block, dtype, two_level),
    st.sampled_from([QuantValue.Q8S, QuantValue.Q8F, QuantValue.Q4S, QuantValue.Q4F, QuantValue.Q2S, QuantValue.Q2F]),
    st.booleans(),
    st.sampled_from([None, (1,), (2,), (3,), (2, 1), (2, 2)]),
    st.sampled_from([ScaleDtype.F32, ScaleDtype.F16, ScaleDtype.BF16, ScaleDtype.UE4M3]),
    st.booleans(),
)


def _scheme(value, packed, block, dtype, two_level):
    scheme = QuantScheme(value, store=QuantStore.PackedU32(0) if packed else QuantStore.Native)
    if block is None:
        return scheme.with_scale_dtype(dtype)
    scheme = scheme.per_block(block, dtype)
    if two_level and dtype in (ScaleDtype.F16, ScaleDtype.UE4M3):
        scheme = scheme.per_tensor(ScaleDtype.F32)
    return scheme


def _shape_for(scheme, draw_dims):
    extents = scheme.block_size.to_dim_vec(len(draw_dims)) if scheme.block else (1,) * len(draw_dims)
    return tuple(d * b for d, b in zip(draw_dims, extents))


@settings(max_examples=150, deadline=None)
@given(SCHEMES, st.lists(st.integers(0, 3), min_size=2, max_size=3), st.integers(0, 2**32 - 1))
def test_quantize_matches_an_elementwise_oracle_and_round_trips_its_bytes(scheme, dims, seed):
    shape = _shape_for(scheme, dims)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 300.0])).astype(np.float32)
    qt = quantize(x, scheme)
    a, b = scheme.value.range
    # oracle: recompute q from the tensor's own (rounded) scales, element by element
    extents = scheme.block_size.to_dim_vec(len(shape)) if scheme.block else None
    for coord in itertools.product(*[range(d) for d in shape]):
        s = qt.scales.reshape(-1)[0] if extents is None else qt.scales[tuple(c // e for c, e in zip(coord, extents))]
        divisor = np.float32(qt.global_scale) * s if qt.global_scale is not None else s
        y = np.float32(x[coord]) / divisor
        q = np.trunc(y) + (np.sign(y) if abs(y - np.trunc(y)) >= 0.5 else 0)
        assert qt.values[coord] == int(min(max(q, a), b)), coord
    # scales sit on their dtype's grid (rounded up from alpha)
    if scheme.scale_dtype() is not ScaleDtype.F32:
        flat = qt.scales.reshape(-1)
        np.testing.assert_array_equal(flat, [oracle_round_up(s, scheme.scale_dtype()) for s in flat])
    raw = qt.to_bytes()
    assert len(raw) == quantized_nbytes(shape, scheme)
    back = QuantizedTensor.from_bytes(raw, shape, scheme)
    assert back.values.tolist() == qt.values.tolist()
    np.testing.assert_array_equal(back.scales, qt.scales)
    assert back.to_bytes() == raw
    block_dims = scheme.block_size.dims if scheme.block else None
    np.testing.assert_array_equal(
        back.dequantize(), oracle_dequantize(back.values, back.scales, shape, block_dims, back.global_scale)
    )


@settings(max_examples=100, deadline=None)
@given(SCHEMES, st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers(0, 2**32 - 1))
def test_random_bytes_decode_and_reencode_exactly(scheme, shape, seed):
    if scheme.block and len(scheme.block_size.dims) > len(shape):
        shape = [1] * (len(scheme.block_size.dims) - len(shape)) + shape
    shape = tuple(shape)
    rng = np.random.default_rng(seed)
    n_values = quantized_nbytes(shape, scheme) - _scale_bytes(shape, scheme)
    q = rng.integers(scheme.value.range[0], scheme.value.range[1] + 1, size=shape).astype(np.int8)
    grid = QuantizedTensor(
        shape, scheme, q, np.ones(_n_scales(shape, scheme), np.float32), 1.0 if scheme.is_two_level else None
    )
    values_region = grid.to_bytes()[:n_values]
    scale_region = _random_scales(rng, shape, scheme)
    raw = values_region + scale_region
    qt = QuantizedTensor.from_bytes(raw, shape, scheme)
    assert qt.to_bytes() == raw
    assert qt.values.tolist() == q.tolist()
    block_dims = scheme.block_size.dims if scheme.block else None
    n = _n_scales(shape, scheme)
    scales = decode_scales(scale_region[: n * scheme.scale_dtype().nbytes], scheme.scale_dtype())
    glob = np.frombuffer(scale_region[-4:], "<f4")[0] if scheme.is_two_level else None
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(qt.dequantize(), oracle_dequantize(q, scales, shape, block_dims, glob))


def _n_scales(shape, scheme):
    return math.prod(scheme.block_size.num_blocks(shape)) if scheme.block else 1


def _scale_bytes(shape, scheme):
    return _n_scales(shape, scheme) * scheme.scale_dtype().nbytes + (4 if scheme.is_two_level else 0)


def _random_scales(rng, shape, scheme):
    n = _n_scales(shape, scheme)
    dtype = {
        ScaleDtype.F32: "<f4",
        ScaleDtype.F16: "<f2",
        ScaleDtype.BF16: ml_dtypes.bfloat16,
        ScaleDtype.UE4M3: ml_dtypes.float8_e4m3fn,
    }[scheme.scale_dtype()]
    raw = rng.uniform(1e-4, 4.0, n).astype(np.float32).astype(dtype).tobytes()
    if scheme.is_two_level:
        raw += np.float32(rng.uniform(1e-3, 1.0)).tobytes()
    return raw


def test_from_bytes_names_the_expected_length():
    with pytest.raises(QuantizationError, match=r"holds 11 bytes, but Q8S Native per-tensor F32 x \[2, 4\] needs 12"):
        QuantizedTensor.from_bytes(bytes(11), (2, 4), QuantScheme())


def test_to_bytes_refuses_scales_its_dtype_cannot_hold():
    qt = QuantizedTensor((2,), QuantScheme().with_scale_dtype(ScaleDtype.F16), [1, 2], [0.1])
    with pytest.raises(QuantizationError, match="not representable in F16"):
        qt.to_bytes()


def test_minifloat_values_are_refused_when_decoding():
    scheme = QuantScheme(QuantValue.E4M3)
    with pytest.raises(QuantizationError, match="E4M3 values are not supported"):
        QuantizedTensor.from_bytes(bytes(quantized_nbytes((4,), scheme)), (4,), scheme)


# -- exchange types ------------------------------------------------------------------------------------


def test_quantized_tensor_travels_through_tensor_data_and_tensor():
    qt = quantize(X, QuantScheme(QuantValue.Q4S, block_size=2))
    data = qt.to_data()
    assert data.dtype is DType.QFloat and data.shape == (2, 4) and data.scheme == qt.scheme
    assert data.array.dtype == np.uint8 and data.array.tobytes() == qt.to_bytes()
    back = QuantizedTensor.from_data(data)
    assert back.to_bytes() == qt.to_bytes()
    tensor = Tensor.from_data(data)
    assert tensor.dtype is DType.QFloat and tensor.shape == (2, 4) and tensor.is_quantized
    np.testing.assert_array_equal(tensor.to_numpy(), qt.dequantize())
    np.testing.assert_array_equal(qt.to_tensor().to_numpy(), qt.dequantize())


def test_values_and_scales_are_read_only():
    qt = quantize(X, QuantScheme())
    with pytest.raises(ValueError):
        qt.values[0, 0] = 1
    with pytest.raises(ValueError):
        qt.scales[0] = 1.0
