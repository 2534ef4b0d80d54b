"""Quantizing modules: Quantizer, quantize_weights(_group), apply_qlora (docs/burnpack.md §3-4).

The oracle for values is a numpy transcription of Burn's MinMax formulas written here (not the
library's ``quantize``): alpha = max|x| per tensor / block, scale = 2*alpha/(b-a) (f32, rounded
up to the scale dtype), q = clamp(round_half_away(x/scale), a, b), value = q * scale.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam import nn
from onnxparam.quant import (
    Calibration,
    QuantizationWarning,
    Quantizer,
    QuantScheme,
    QuantValue,
    ScaleDtype,
)

RANGES = {"Q8S": (-127, 127), "Q8F": (-128, 127), "Q4S": (-7, 7), "Q4F": (-8, 7), "Q2S": (-1, 1), "Q2F": (-2, 1)}


class Mlp(op.Module):
    def __init__(self):
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(op.ops.relu(self.fc1(x)))


def burn_minmax(x: np.ndarray, value: str, block=None) -> np.ndarray:
    """Dequantized values of Burn's MinMax quantization (F32 scales), from the formulas alone."""
    a, b = RANGES[value]
    x = x.astype(np.float32)
    if block is None:
        blocks = np.full(x.shape, np.abs(x).max(), np.float32)
    else:
        br, bc = block
        g = np.abs(x).reshape(x.shape[0] // br, br, x.shape[1] // bc, bc).max(axis=(1, 3))
        blocks = np.repeat(np.repeat(g, br, 0), bc, 1).astype(np.float32)
    scale = (np.float32(2) * blocks / np.float32(b - a)).astype(np.float32)
    y = x / scale
    q = np.clip(np.sign(y) * np.floor(np.abs(y) + np.float32(0.5)), a, b)  # half away from zero
    return (q * scale).astype(np.float32)


def weight_of(module, path):
    return dict(module.named_params())[path]


@pytest.mark.parametrize("value", list(RANGES))
@pytest.mark.parametrize("block", [None, (1, 4), (4, 1), (2, 2)])
def test_dequantized_values_follow_burns_minmax_formula(value, block):
    rng = np.random.default_rng(7)
    w = rng.normal(size=(8, 16)).astype(np.float32)
    w[0, 0] = 0.5  # ties: x / scale lands on .5 for some values with these scales
    m = Mlp()
    m.fc1.weight = op.Param.from_data(w)
    scheme = QuantScheme(QuantValue[value], block_size=block)
    q = m.quantize_weights(Quantizer(scheme))
    got = q.fc1.weight.val().to_numpy()
    np.testing.assert_array_equal(got, burn_minmax(w, value, block))


def test_round_half_away_from_zero_on_exact_ties():
    # alpha = 127 -> scale 1.0 (Q8S): x = +-2.5 must become +-3 (numpy's round would give +-2)
    w = np.array([[127.0, 2.5, -2.5, 0.5, -0.5, 1.5]], np.float32)
    m = Mlp()
    m.fc1.weight = op.Param.from_data(np.zeros((8, 16), np.float32))
    m.fc1.weight = op.Param.from_data(np.resize(w, (8, 16)).astype(np.float32))
    q = m.quantize_weights(Quantizer(QuantScheme()))
    assert q.fc1.weight.base()._quant.values[0, :6].tolist() == [127, 3, -3, 1, -1, 2]


def test_two_level_scheme_dequantizes_as_global_times_block_scale():
    w = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
    m = Mlp()
    m.fc1.weight = op.Param.from_data(w)
    scheme = QuantScheme(QuantValue.Q8S).per_block(4, ScaleDtype.F16).per_tensor(ScaleDtype.F32)
    qt = m.quantize_weights(Quantizer(scheme)).fc1.weight.base()._quant
    expected = (np.float32(qt.global_scale) * np.repeat(qt.scales, 4, axis=1)) * qt.values.astype(np.float32)
    np.testing.assert_array_equal(qt.dequantize(), expected.astype(np.float32))
    assert np.abs(qt.dequantize() - w).max() <= np.abs(w).max() / 127 * 0.6


def test_quantize_weights_takes_rank_2_float_params_frozen_and_keeps_biases():
    m = Mlp()
    q = m.quantize_weights(Quantizer())
    dtypes = {path: (p.lazy_dtype(), p.require_grad) for path, p in q.named_params()}
    assert dtypes["fc1.weight"] == (op.DType.QFloat, False)
    assert dtypes["fc2.weight"] == (op.DType.QFloat, False)
    assert dtypes["fc1.bias"] == (op.DType.F32, True)
    assert m.fc1.weight.lazy_dtype() is op.DType.F32  # the receiver is unchanged


def test_quantizing_a_lazy_module_stays_lazy_and_keeps_ids():
    m = Mlp()
    q = m.quantize_weights(Quantizer())
    assert not q.fc1.weight.is_initialized()
    assert q.fc1.weight.id == m.fc1.weight.id
    values = q.fc1.weight.base()._quant.values
    assert values.dtype == np.int8 and values.shape == (8, 16)


def test_min_rank_one_quantizes_biases_as_burn_does():
    q = Mlp().quantize_weights(Quantizer(min_rank=1))
    assert all(p.lazy_dtype() is op.DType.QFloat for _, p in q.named_params())


def test_quantize_weights_group_only_touches_the_group():
    m = Mlp()
    q = m.quantize_weights_group(Quantizer(), op.ParamGroup.from_regex(r"^fc2\."))
    assert q.fc1.weight.lazy_dtype() is op.DType.F32
    assert q.fc2.weight.lazy_dtype() is op.DType.QFloat


def test_blocks_that_do_not_divide_a_weight_leave_it_float_with_a_warning():
    with pytest.warns(QuantizationWarning, match=r"left float: fc2\.weight \[16, 4\]: not a whole number of \[8\]"):
        q = Mlp().quantize_weights(Quantizer(QuantScheme(block_size=8)))
    assert q.fc1.weight.lazy_dtype() is op.DType.QFloat
    assert q.fc2.weight.lazy_dtype() is op.DType.F32


def test_quantizer_rejects_a_scheme_burn_cannot_quantize_with_the_path():
    m = Mlp()
    m.fc1.weight = op.Param.from_data(np.ones((8, 16), np.float32))
    with pytest.raises(op.QuantizationError, match=r"cannot quantize 'fc1.weight' \[8, 16\]: UE8M0"):
        m.quantize_weights(Quantizer(QuantScheme().with_scale_dtype(ScaleDtype.UE8M0)))


def test_quantizer_rejects_other_calibrations_and_non_quantizers():
    with pytest.raises(op.QuantizationError, match="unknown calibration 'AbsMean'"):
        Quantizer(calibration="AbsMean")
    with pytest.raises(op.QuantizationError, match="quantize_weights takes a Quantizer, found QuantScheme"):
        Mlp().quantize_weights(QuantScheme())
    assert Quantizer().calibration is Calibration.MinMax


def test_apply_qlora_quantizes_the_frozen_base_and_adds_float_trainable_factors():
    q = Mlp().apply_qlora(op.LoraConfig(2, 4.0), Quantizer())
    params = dict(q.named_params())
    assert params["fc1.weight"].lazy_dtype() is op.DType.QFloat and not params["fc1.weight"].require_grad
    assert params["fc1.weight.lora.a"].lazy_dtype() is op.DType.F32 and params["fc1.weight.lora.a"].require_grad
    assert params["fc1.weight.lora.b"].lazy_shape() == (2, 16)
    base = params["fc1.weight"].base()._quant.dequantize()
    np.testing.assert_array_equal(params["fc1.weight"].val().to_numpy(), base)  # b = 0: delta 0


def test_quantized_module_saves_qfloat_burnpack_tensors(tmp_path):
    q = Mlp().quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S, block_size=(4, 1))))
    path = q.save_file(tmp_path / "q.bpk")
    with op.burnpack.read(path) as f:
        assert f.tensors["fc1.weight"].dtype is op.DType.QFloat
        assert f.tensors["fc1.weight"].scheme == QuantScheme(QuantValue.Q4S, block_size=(4, 1))
    back = Mlp().quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S, block_size=(4, 1)))).load_file(path)
    np.testing.assert_array_equal(back.fc1.weight.val().to_numpy(), q.fc1.weight.val().to_numpy())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_quantizing_a_weight_with_nan_or_inf_is_refused_with_its_path(bad):
    weight = np.ones((4, 8), np.float32)
    weight[1, 2] = bad

    class One(op.Module):
        def __init__(self):
            self.fc = op.Param.initialized(op.ParamId(1), op.Tensor.from_numpy(weight))

    with pytest.raises(op.QuantizationError, match=r"cannot quantize 'fc' \[4, 8\]: the values hold (1 NaN and 0|0 NaN and 1) infinite"):
        One().quantize_weights(op.Quantizer(op.QuantScheme(value=op.QuantValue.Q8S)))


# -- re-quantizing, apply_qlora arguments, F16 weights ------------------------------------------


def test_quantizing_already_quantized_weights_again_raises_naming_paths_and_scheme():
    q8 = Mlp().quantize_weights(Quantizer())  # lazy params: the scheme is known before any init
    with pytest.raises(op.QuantizationError) as info:
        q8.quantize_weights(Quantizer(QuantScheme(value=QuantValue.Q4S)))
    assert str(info.value).startswith(
        "already quantized: fc1.weight (Q8S Native per-tensor F32), fc2.weight (Q8S Native per-tensor F32); "
        "quantizing them again with Q4S Native per-tensor F32 would be ignored")
    m = Mlp()
    m.fc1.weight = op.Param.from_data(np.ones((8, 16), np.float32))  # initialized: read from the value
    with pytest.raises(op.QuantizationError, match=r"^already quantized: fc1\.weight \(Q8S Native per-tensor F32\), "):
        m.quantize_weights(Quantizer()).quantize_weights(Quantizer())


def test_requantizing_only_checks_the_params_the_group_touches():
    fc1 = op.ParamGroup.from_regex(r"^fc1\.")
    fc2 = op.ParamGroup.from_regex(r"^fc2\.")
    first = Mlp().quantize_weights_group(Quantizer(), fc1)
    both = first.quantize_weights_group(Quantizer(QuantScheme(value=QuantValue.Q4S)), fc2)
    assert both.fc1.weight.base()._quant.scheme.value is QuantValue.Q8S
    assert both.fc2.weight.base()._quant.scheme.value is QuantValue.Q4S
    with pytest.raises(op.QuantizationError, match=r"^already quantized: fc1\.weight \(Q8S Native per-tensor F32\); "):
        first.quantize_weights_group(Quantizer(), fc1)
    # QLoRA on a module quantized elsewhere: the group decides too
    with pytest.raises(op.QuantizationError, match=r"^already quantized: fc1\.weight "):
        first.apply_qlora(op.LoraConfig(2, 4.0), Quantizer())


@pytest.mark.parametrize("args, message", [
    ((Quantizer(), op.LoraConfig(2, 4.0)),
     "apply_qlora(config, quantizer) takes a LoraConfig then a Quantizer; got Quantizer and LoraConfig (swapped?)"),
    ((op.LoraConfig(2, 4.0), QuantScheme()),
     "apply_qlora(config, quantizer) takes a LoraConfig then a Quantizer; got LoraConfig and QuantScheme"),
    ((None, Quantizer()), "apply_qlora(config, quantizer) takes a LoraConfig then a Quantizer; got NoneType and Quantizer"),
])
def test_apply_qlora_rejects_swapped_or_wrong_arguments_with_a_type_error(args, message):
    with pytest.raises(TypeError) as info:
        Mlp().apply_qlora(*args)
    assert str(info.value) == message


class Mlp16(op.Module):
    def __init__(self):
        rng = np.random.default_rng(3)
        self.w1 = rng.normal(size=(8, 16)).astype(np.float16)
        self.w2 = rng.normal(size=(16, 4)).astype(np.float16)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.fc1.weight = op.Param.from_data(self.w1)
        self.fc1.bias = op.Param.from_data(np.full(16, 0.25, np.float16))
        self.fc2.weight = op.Param.from_data(self.w2)
        self.fc2.bias = op.Param.from_data(np.full(4, -0.5, np.float16))

    def forward(self, x):
        return self.fc2(op.ops.relu(self.fc1(x)))


@pytest.mark.parametrize("value", ["Q8S", "Q4S"])
def test_quantized_f16_weights_dequantize_to_f16_and_the_module_stays_callable(value):
    m = Mlp16()
    q = m.quantize_weights(Quantizer(QuantScheme(value=QuantValue[value])))
    assert q.fc1.weight.lazy_dtype() is op.DType.QFloat
    w1 = burn_minmax(m.w1.astype(np.float32), value).astype(np.float16)
    w2 = burn_minmax(m.w2.astype(np.float32), value).astype(np.float16)
    assert q.fc1.weight.val().dtype is op.DType.F16
    # NOTE: the library quantizes from the F16 values; a value near a rounding tie may land one
    # quantization step from the F32 oracle, so the check is "within one step" here
    a, b = RANGES[value]
    step = 2 * np.abs(m.w1.astype(np.float32)).max() / (b - a)
    diff = np.abs(q.fc1.weight.val().to_numpy().astype(np.float32) - w1.astype(np.float32))
    assert diff.max() <= step * 1.01 and np.mean(diff <= 2e-3 * np.abs(w1.astype(np.float32))) > 0.95
    np.testing.assert_array_equal(q.fc1.weight.val().to_numpy(),
                                  q.fc1.weight.base()._quant.dequantize().astype(np.float16))
    x = np.random.default_rng(4).normal(size=(3, 8)).astype(np.float16)
    out = q(op.Tensor.from_numpy(x))
    assert out.dtype is op.DType.F16
    h = np.maximum(x.astype(np.float32) @ w1.astype(np.float32) + 0.25, 0).astype(np.float16)
    want = h.astype(np.float32) @ w2.astype(np.float32) - 0.5
    np.testing.assert_allclose(out.to_numpy().astype(np.float32), want, rtol=2e-2, atol=2e-2)
    # QLoRA on F16 weights runs as well (factors F32, the base dequantized to F16)
    ql = m.apply_qlora(op.LoraConfig(2, 4.0), Quantizer(QuantScheme(value=QuantValue[value])))
    np.testing.assert_allclose(ql(op.Tensor.from_numpy(x)).to_numpy().astype(np.float32), want, rtol=2e-2, atol=2e-2)
