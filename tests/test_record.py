"""ModuleRecord: lazy records, loading with every problem reported, nothing half-loaded."""

import numpy as np
import pytest

from onnxparam import DType, LoraConfig, Module, ModuleRecord, Param, ParamId, RecordError, Tensor, TensorSnapshot


class Lin(Module):
    def __init__(self, d_in, d_out, calls):
        def init(shape):
            def run(device, rg):
                calls.append(shape)
                return Tensor.from_numpy(np.full(shape, 0.5, np.float32))
            return run

        self.weight = Param.uninitialized(ParamId(), init((d_in, d_out)), "cpu", True, (d_in, d_out))
        self.bias = Param.uninitialized(ParamId(), init((d_out,)), "cpu", True, (d_out,))


class Two(Module):
    def __init__(self, calls):
        self.fc1 = Lin(3, 4, calls)
        self.fc2 = Lin(4, 2, calls)


def snapshot(array, pid=None):
    array = np.asarray(array)
    return TensorSnapshot(DType.from_numpy(array.dtype), array.shape, pid,
                          lambda: Tensor.from_numpy(array).into_data())


def full_record(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"fc1.weight": (3, 4), "fc1.bias": (4,), "fc2.weight": (4, 2), "fc2.bias": (2,)}
    arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    return ModuleRecord({k: snapshot(v, ParamId(100 + i)) for i, (k, v) in enumerate(arrays.items())}), arrays


def test_into_record_describes_every_param_without_initializing():
    calls = []
    record = Two(calls).into_record()
    assert list(record) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert record["fc1.weight"].shape == (3, 4) and record["fc1.weight"].dtype is DType.F32
    assert calls == []


def test_loading_a_record_into_a_lazy_module_never_runs_init_and_takes_ids():
    calls = []
    record, arrays = full_record()
    loaded = Two(calls).load_record(record)
    for path, param in loaded.named_params():
        np.testing.assert_array_equal(param.val().to_numpy(), arrays[path])
    assert calls == []
    assert [int(p.id) for _, p in loaded.named_params()] == [100, 101, 102, 103]


def test_loading_is_lazy_until_a_value_is_needed():
    reads = []
    record = ModuleRecord({
        "fc1.weight": TensorSnapshot(DType.F32, (3, 4), None,
                                     lambda: reads.append(1) or Tensor.from_numpy(np.ones((3, 4), np.float32)).into_data()),
    })
    loaded = Two([]).try_load_record(record, allow_partial=True)
    assert reads == []
    loaded.fc1.weight.val()
    assert reads == [1]


def test_every_problem_is_reported_by_path_with_expected_and_found():
    record, arrays = full_record()
    items = dict(record)
    items["fc1.weight"] = snapshot(np.zeros((4, 3), np.float32))
    items["fc2.bias"] = snapshot(np.zeros(2, np.int64))
    del items["fc1.bias"]
    items["fc3.weight"] = snapshot(np.zeros(1, np.float32))
    with pytest.raises(RecordError) as info:
        Two([]).load_record(ModuleRecord(items))
    message = str(info.value)
    assert "4 problem(s)" in message
    assert "shape mismatch for 'fc1.weight': the module expects [3, 4], the record has [4, 3]" in message
    assert "looks transposed" in message
    assert "dtype mismatch for 'fc2.bias': the module expects F32, the record has I64" in message
    assert "missing tensor 'fc1.bias'" in message
    assert "unexpected tensor 'fc3.weight'" in message
    assert len(info.value.problems) == 4


def test_a_failed_load_leaves_the_module_as_it_was():
    calls = []
    module = Two(calls)
    before = [(p, param) for p, param in module.named_params()]
    record, _ = full_record()
    items = dict(record)
    items["fc2.weight"] = snapshot(np.zeros((2, 4), np.float32))
    with pytest.raises(RecordError):
        module.load_record(ModuleRecord(items))
    assert [(p, param) for p, param in module.named_params()] == before
    assert calls == []


def test_allow_partial_loads_what_is_there_and_keeps_the_rest():
    record, arrays = full_record()
    partial = ModuleRecord({"fc2.weight": record["fc2.weight"], "zzz": snapshot(np.zeros(1, np.float32))})
    loaded = Two([]).try_load_record(partial, allow_partial=True)
    np.testing.assert_array_equal(loaded.fc2.weight.val().to_numpy(), arrays["fc2.weight"])
    np.testing.assert_array_equal(loaded.fc1.weight.val().to_numpy(), np.full((3, 4), 0.5, np.float32))


def test_lora_factors_without_an_adapter_explain_that_the_config_is_needed():
    adapted = Two([]).apply_lora(LoraConfig(rank=2, alpha=2.0, seed=1))
    record = adapted.into_record()
    assert "fc1.weight.lora.a" in record and record["fc1.weight.lora.a"].shape == (3, 2)
    with pytest.raises(RecordError, match=r"'fc1.weight.lora.a': it is a LoRA factor.*apply_lora"):
        Two([]).load_record(record)
    reloaded = Two([]).apply_lora(LoraConfig(rank=2, alpha=2.0)).load_record(record)
    np.testing.assert_array_equal(reloaded.fc1.weight.adapter().a.val().to_numpy(),
                                  adapted.fc1.weight.adapter().a.val().to_numpy())


def test_a_plain_dict_of_arrays_tensors_and_tensor_data_loads_and_keeps_the_modules_ids():
    module = Two([])
    ids = [int(p.id) for _, p in module.named_params()]
    w1 = np.arange(12, dtype=np.float32).reshape(3, 4)
    loaded = module.load_record({
        "fc1.weight": w1,
        "fc1.bias": Tensor.from_numpy(np.ones(4, np.float32)),
        "fc2.weight": Tensor.from_numpy(np.full((4, 2), 2.0, np.float32)).into_data(),
        "fc2.bias": np.zeros(2, np.float32),
    })
    np.testing.assert_array_equal(loaded.fc1.weight.val().to_numpy(), w1)
    np.testing.assert_array_equal(loaded.fc2.weight.val().to_numpy(), np.full((4, 2), 2.0))
    assert [int(p.id) for _, p in loaded.named_params()] == ids


def test_a_plain_dict_with_a_wrong_dtype_names_burns_dtype_and_a_non_tensor_is_refused():
    with pytest.raises(RecordError, match=r"dtype mismatch for 'fc1.bias': the module expects F32, the record has F64"):
        Two([]).try_load_record({"fc1.bias": np.zeros(4)}, allow_partial=True)
    with pytest.raises(RecordError, match=r"record entry 'fc1.bias' is a str, not a tensor"):
        Two([]).try_load_record({"fc1.bias": "zeros"}, allow_partial=True)
