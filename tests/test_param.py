"""Param and ParamId: lazy run-once init shared by clones, mappers, loading, display."""

import copy
import threading

import numpy as np
import pytest

from onnxparam import Device, DType, Param, ParamId, ShapeMismatchError, Tensor


def counting_init(shape=(2, 3), fill=1.0):
    calls = []

    def init(device, require_grad):
        calls.append((device, require_grad))
        return Tensor.from_numpy(np.full(shape, fill, dtype=np.float32), device)

    return init, calls


def lazy_param(shape=(2, 3), fill=1.0, **kw):
    init, calls = counting_init(shape, fill)
    return Param.uninitialized(ParamId(7), init, "cpu", True, shape, **kw), calls


def test_param_id_is_a_u64_and_hashable():
    assert int(ParamId(2**64 - 1)) == 2**64 - 1
    assert ParamId(5) == ParamId(5) and hash(ParamId(5)) == hash(ParamId(5))
    assert ParamId(5) != ParamId(6)
    with pytest.raises(ValueError, match="u64"):
        ParamId(2**64)
    with pytest.raises(ValueError, match="u64"):
        ParamId(-1)


def test_random_param_ids_differ():
    assert len({int(ParamId()) for _ in range(1000)}) == 1000


def test_lazy_param_initializes_once_across_64_threads_and_clones():
    init_calls = []
    barrier = threading.Barrier(64)

    def slow_init(device, require_grad):
        init_calls.append(1)
        return Tensor.from_numpy(np.random.default_rng().normal(size=(4, 4)).astype(np.float32))

    param = Param.uninitialized(ParamId(), slow_init, "cpu", True, (4, 4))
    clones = [param.clone() for _ in range(64)]
    results = [None] * 64

    def worker(i):
        barrier.wait()
        results[i] = clones[i].val().to_numpy()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(init_calls) == 1
    for r in results:
        np.testing.assert_array_equal(r, results[0])
    assert param.is_initialized()  # the original shares the cell


def test_cloning_never_initializes_and_copy_copy_is_clone():
    param, calls = lazy_param()
    clone = copy.copy(param)
    assert isinstance(clone, Param) and clone.id == param.id
    assert calls == [] and not clone.is_initialized()


def test_map_on_one_clone_does_not_change_another():
    param, _ = lazy_param(fill=2.0)
    other = param.clone()
    mapped = param.map(lambda t: Tensor.from_numpy(t.to_numpy() * 10))
    np.testing.assert_array_equal(mapped.val().to_numpy(), np.full((2, 3), 20.0, np.float32))
    np.testing.assert_array_equal(other.val().to_numpy(), np.full((2, 3), 2.0, np.float32))
    np.testing.assert_array_equal(param.val().to_numpy(), np.full((2, 3), 2.0, np.float32))


def test_set_require_grad_does_not_propagate_across_clones():
    param, calls = lazy_param()
    frozen = param.set_require_grad(False)
    assert param.require_grad is True and frozen.require_grad is False
    assert calls == []


def test_lazy_shape_device_and_dtype_never_initialize():
    param, calls = lazy_param(shape=(5, 7), dtype=DType.F32)
    assert param.lazy_shape() == (5, 7)
    assert param.lazy_device() == Device("cpu")
    assert param.lazy_dtype() is DType.F32
    assert "lazy" in repr(param) and "[5, 7]" in repr(param)
    assert calls == []


def test_init_receives_device_and_require_grad():
    init, calls = counting_init()
    param = Param.uninitialized(ParamId(), init, "cpu", False, (2, 3))
    param.val()
    assert calls == [(Device("cpu"), False)]


def test_init_returning_wrong_shape_raises_shape_mismatch():
    param = Param.uninitialized(ParamId(), lambda d, rg: np.zeros((3, 3), np.float32), "cpu", True, (2, 2))
    with pytest.raises(ShapeMismatchError, match=r"returned shape \(3, 3\).*declared with shape \(2, 2\)"):
        param.val()


def test_init_mapper_chains_lazily_then_applies_once_needed():
    param, calls = lazy_param(fill=3.0)
    doubled = param.init_mapper(lambda t: Tensor.from_numpy(t.to_numpy() * 2))
    assert calls == [] and not doubled.is_initialized()
    np.testing.assert_array_equal(doubled.val().to_numpy(), np.full((2, 3), 6.0, np.float32))
    assert len(calls) == 1
    # the original clone keeps the unmapped value and shares the one init run
    np.testing.assert_array_equal(param.val().to_numpy(), np.full((2, 3), 3.0, np.float32))
    assert len(calls) == 1


def test_init_mapper_on_initialized_param_applies_now():
    param = Param.initialized(ParamId(), Tensor.from_numpy(np.ones(3, np.float32)))
    seen = []
    mapped = param.init_mapper(lambda t: seen.append(1) or Tensor.from_numpy(t.to_numpy() + 1))
    assert seen == [1]
    np.testing.assert_array_equal(mapped.val().to_numpy(), [2, 2, 2])


def test_transform_for_load_checks_shape_first_and_never_runs_init():
    param, calls = lazy_param(shape=(2, 3))
    loaded = param.transform_for_load(Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3)), ParamId(99))
    assert loaded.id == ParamId(99) and loaded.require_grad is True
    np.testing.assert_array_equal(loaded.val().to_numpy(), np.arange(6).reshape(2, 3))
    with pytest.raises(ShapeMismatchError, match=r"expects \[2, 3\], the record has \[3, 2\]"):
        param.transform_for_load(Tensor.from_numpy(np.zeros((3, 2), np.float32)))
    assert calls == []


def test_transform_for_load_applies_load_mapper_and_keeps_require_grad():
    param, _ = lazy_param()
    param = param.set_require_grad(False).load_mapper(lambda t: Tensor.from_numpy(t.to_numpy() - 1))
    loaded = param.transform_for_load(Tensor.from_numpy(np.ones((2, 3), np.float32)))
    assert loaded.require_grad is False
    np.testing.assert_array_equal(loaded.val().to_numpy(), np.zeros((2, 3)))


def test_transform_for_save_applies_save_mapper():
    param = Param.initialized(ParamId(), Tensor.from_numpy(np.ones(2, np.float32))).save_mapper(
        lambda t: Tensor.from_numpy(t.to_numpy() * 5))
    np.testing.assert_array_equal(param.transform_for_save().val().to_numpy(), [5, 5])
    np.testing.assert_array_equal(param.val().to_numpy(), [1, 1])


def test_consume_and_from_mapped_value_round_trip():
    param = Param.initialized(ParamId(3), Tensor.from_numpy(np.ones(2, np.float32))).load_mapper(lambda t: t)
    pid, value, mapper = param.consume()
    again = Param.from_mapped_value(pid, value, mapper)
    assert again.id == ParamId(3) and again._mapper is mapper
    np.testing.assert_array_equal(again.val().to_numpy(), [1, 1])


def test_from_tensor_and_from_data_get_fresh_ids_and_grad_by_kind():
    f = Param.from_tensor(Tensor.from_numpy(np.zeros(2, np.float32)))
    i = Param.from_data(np.zeros(2, np.int64))
    assert f.require_grad is True and i.require_grad is False
    assert f.id != i.id
    assert i.lazy_dtype() is DType.I64


def test_host_tensors_are_shared_read_only():
    arr = np.arange(4, dtype=np.float32)
    t = Tensor.from_numpy(arr)
    view = t.to_numpy()
    assert np.shares_memory(view, arr)
    with pytest.raises(ValueError):
        view[0] = 5
