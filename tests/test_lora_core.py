"""LoRA core: apply_lora freezes, attaches factors with Burn's shapes/inits, val() composes."""

import numpy as np

from onnxparam import DType, LoraConfig, Module, Param, ParamGroup, ParamId, Tensor


class Lin(Module):
    def __init__(self, w):
        self.weight = Param.initialized(ParamId(), Tensor.from_numpy(w))
        self.bias = Param.initialized(ParamId(), Tensor.from_numpy(np.zeros(w.shape[1], np.float32)))


def test_apply_lora_freezes_every_float_param_and_adapts_rank2_ones():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    adapted = Lin(w).apply_lora(LoraConfig(rank=2, alpha=6.0, seed=0))
    paths = {p: param for p, param in adapted.named_params()}
    assert list(paths) == ["weight", "weight.lora.a", "weight.lora.b", "bias"]
    assert paths["weight"].require_grad is False and paths["bias"].require_grad is False
    assert paths["weight.lora.a"].require_grad and paths["weight.lora.b"].require_grad
    assert paths["weight.lora.a"].lazy_shape() == (3, 2) and paths["weight.lora.b"].lazy_shape() == (2, 4)
    assert adapted.weight.adapter().scale == 3.0
    # b starts at zero, so the effective weight is the base
    np.testing.assert_array_equal(adapted.weight.val().to_numpy(), w)
    np.testing.assert_array_equal(adapted.weight.base().to_numpy(), w)


def test_val_is_base_plus_scale_times_a_at_b():
    w = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    a = np.random.default_rng(1).normal(size=(5, 2)).astype(np.float32)
    b = np.random.default_rng(2).normal(size=(2, 3)).astype(np.float32)
    adapted = Lin(w).apply_lora(LoraConfig(rank=2, alpha=3.0))
    adapter = adapted.weight.adapter()
    adapter = adapter.with_factors(Param.initialized(adapter.a.id, Tensor.from_numpy(a)),
                                   Param.initialized(adapter.b.id, Tensor.from_numpy(b)))
    param = adapted.weight.with_adapter(adapter)
    np.testing.assert_allclose(param.val().to_numpy(), w + 1.5 * (a @ b), rtol=1e-6)
    pid, base, _ = param.consume()
    np.testing.assert_array_equal(base.to_numpy(), w)


def test_factor_a_is_normal_with_std_one_over_rank_by_default():
    w = np.zeros((400, 8), np.float32)
    adapted = Lin(w).apply_lora(LoraConfig(rank=4, alpha=4.0, seed=3))
    a = adapted.weight.adapter().a.val().to_numpy()
    assert abs(a.std() - 0.25) < 0.02 and abs(a.mean()) < 0.02


def test_param_group_limits_which_params_get_adapters_and_dtype_is_respected():
    adapted = Lin(np.zeros((3, 4), np.float32)).apply_lora(
        LoraConfig(rank=1, alpha=1.0, dtype=DType.F16, param_group=ParamGroup.from_path("nothing")))
    assert adapted.weight.adapter() is None and adapted.weight.require_grad is False
    adapted = Lin(np.zeros((3, 4), np.float32)).apply_lora(LoraConfig(rank=1, alpha=1.0, dtype=DType.F16))
    assert adapted.weight.adapter().a.lazy_dtype() is DType.F16
