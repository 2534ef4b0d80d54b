"""LoRA core: apply_lora freezes, attaches factors with Burn's shapes/inits, val() composes."""

import numpy as np

from onnxparam import DType, LoraConfig, Module, Param, ParamGroup, ParamId, Tensor
from onnxparam.nn import Linear


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
    adapted = Two().apply_lora(
        LoraConfig(rank=1, alpha=1.0, dtype=DType.F16, param_group=ParamGroup.from_path("fc.weight")))
    assert adapted.fc.weight.adapter() is not None
    assert adapted.other.weight.adapter() is None and adapted.other.weight.require_grad is False
    adapted = Lin(np.zeros((3, 4), np.float32)).apply_lora(LoraConfig(rank=1, alpha=1.0, dtype=DType.F16))
    assert adapted.weight.adapter().a.lazy_dtype() is DType.F16


# -- re-applying LoRA and LoraConfig validation ---------------------------------------------------

import math  # noqa: E402

import pytest  # noqa: E402


class Two(Module):
    def __init__(self):
        self.fc = Lin(np.ones((3, 4), np.float32))
        self.other = Lin(np.ones((4, 2), np.float32))


def test_applying_lora_twice_raises_naming_the_adapted_param():
    once = Lin(np.ones((3, 4), np.float32)).apply_lora(LoraConfig(rank=2, alpha=3))
    with pytest.raises(ValueError) as info:
        once.apply_lora(LoraConfig(rank=5, alpha=1))
    assert str(info.value).startswith("'weight' already has a LoRA adapter (rank 2, scale 1.5); merge_lora() first or ")
    # the old adapter is untouched
    assert once.weight.adapter().rank == 2 and once.weight.adapter().scale == 1.5


def test_applying_lora_again_to_other_params_of_the_group_is_allowed():
    fc_only = LoraConfig(rank=2, alpha=3, param_group=ParamGroup.from_regex(r"^fc\."))
    first = Two().apply_lora(fc_only)
    second = first.apply_lora(LoraConfig(rank=1, alpha=1, param_group=ParamGroup.from_regex(r"^other\.")))
    assert second.fc.weight.adapter().rank == 2 and second.other.weight.adapter().rank == 1
    with pytest.raises(ValueError, match=r"^'fc\.weight' already has a LoRA adapter \(rank 2, scale 1\.5\)"):
        first.apply_lora(LoraConfig(rank=4, alpha=2))
    # merging first makes a second adapter fine
    again = first.merge_lora().apply_lora(LoraConfig(rank=4, alpha=2))
    assert again.fc.weight.adapter().rank == 4


@pytest.mark.parametrize("rank, error, message", [
    (0, ValueError, "LoraConfig.rank must be positive; got 0"),
    (-3, ValueError, "LoraConfig.rank must be positive; got -3"),
    (True, TypeError, "LoraConfig.rank must be an int; got bool True"),
    (2.0, TypeError, "LoraConfig.rank must be an int; got float 2.0"),
    ("2", TypeError, "LoraConfig.rank must be an int; got str '2'"),
])
def test_lora_config_rank_must_be_a_positive_int(rank, error, message):
    with pytest.raises(error) as info:
        LoraConfig(rank=rank, alpha=1.0)
    assert str(info.value) == message


@pytest.mark.parametrize("field, value, error, message", [
    ("alpha", math.nan, ValueError, "LoraConfig.alpha must be finite; got nan"),
    ("alpha", math.inf, ValueError, "LoraConfig.alpha must be finite; got inf"),
    ("alpha", "4", TypeError, "LoraConfig.alpha must be a real number; got str '4'"),
    ("alpha", None, TypeError, "LoraConfig.alpha must be a real number; got NoneType None"),
    ("init_std", 0.0, ValueError, "LoraConfig.init_std must be finite and > 0; got 0.0"),
    ("init_std", -0.1, ValueError, "LoraConfig.init_std must be finite and > 0; got -0.1"),
    ("init_std", math.inf, ValueError, "LoraConfig.init_std must be finite and > 0; got inf"),
    ("init_std", "0.1", TypeError, "LoraConfig.init_std must be a real number or None; got str '0.1'"),
    ("dtype", DType.I32, ValueError, "LoraConfig.dtype must be a float dtype (F64, F32, F16, BF16); got I32"),
    ("dtype", DType.QFloat, ValueError, "LoraConfig.dtype must be a float dtype (F64, F32, F16, BF16); got QFloat"),
    ("dtype", "F32", TypeError, "LoraConfig.dtype must be a DType or None; got str 'F32'"),
])
def test_lora_config_rejects_bad_alpha_init_std_and_dtype(field, value, error, message):
    kwargs = {"rank": 2, "alpha": 1.0, field: value}
    with pytest.raises(error) as info:
        LoraConfig(**kwargs)
    assert str(info.value) == message


def test_lora_config_accepts_ints_numpy_scalars_and_float_dtypes():
    config = LoraConfig(rank=np.int64(4), alpha=np.float32(2.0), init_std=0.5, dtype=DType.F16)
    assert config.scale == 0.5
    assert LoraConfig(rank=2, alpha=-1).scale == -0.5  # a negative alpha is a valid (finite) scale
    with pytest.raises(TypeError, match=r"^LoraConfig\.rank must be an int; got float 3\.0$"):
        config.with_rank(3.0)


def test_bad_lora_arguments_are_library_errors_that_are_also_the_builtin():
    # README "Errors": only the library's errors leave public functions; the builtin stays catchable
    from onnxparam import LoraError, LoraTypeError, OnnxParamError

    for bad, builtin, leaf in ((dict(rank=0), ValueError, LoraError), (dict(rank=2, alpha=float("inf")), ValueError, LoraError),
                               (dict(rank=2.5), TypeError, LoraTypeError), (dict(rank=2, dtype="f32"), TypeError, LoraTypeError)):
        with pytest.raises(builtin) as info:
            LoraConfig(**bad)
        assert isinstance(info.value, leaf) and isinstance(info.value, OnnxParamError), (bad, repr(info.value))
    with pytest.raises(LoraError, match=r"^LoraConfig\.rank must be positive; got 0$"):
        LoraConfig(rank=0)
    from onnxparam import BatchedLora

    with pytest.raises(LoraError, match="capacity must be an int >= 1"):
        BatchedLora(capacity=0)


def test_rslora_scale_is_alpha_over_sqrt_rank():
    # Kalajdzievski 2023 / PEFT use_rslora: alpha / sqrt(r)
    assert LoraConfig(rank=4, alpha=6.0, use_rslora=True).scale == 3.0
    assert LoraConfig(rank=4, alpha=6.0).scale == 1.5


def test_an_adapter_set_refuses_empty_modules_duplicate_names_and_misfit_params():
    from onnxparam import LoraAdapterSet

    class One(Module):
        def __init__(self, d_in, d_out):
            self.fc = Linear(d_in, d_out)

        def forward(self, x):
            return self.fc(x)

    from onnxparam import LoraError

    with pytest.raises(LoraError, match=r"One has no LoRA adapters to add as 'x'"):
        LoraAdapterSet().add("x", One(3, 2))
    adapters = LoraAdapterSet().add("x", One(3, 2).apply_lora(LoraConfig(rank=1, alpha=1.0, seed=0)))
    with pytest.raises(LoraError, match=r"an adapter named 'x' is already in the set"):
        adapters.add("x", One(3, 2).apply_lora(LoraConfig(rank=1, alpha=1.0, seed=0)))
    with pytest.raises(LoraError, match=r"'fc.weight': the adapter makes a \(3, 2\) delta, the param is \[4, 2\]"):
        adapters.activate(One(4, 2), "x")
