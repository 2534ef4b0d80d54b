"""The runtime's caches are keyed by one call signature (module calls, their fast path, eager
ops): calls that differ in what the graph or session depends on (shapes, dtypes, plain values,
baked tensors, devices) get their own, calls that differ only in input values share one.

Oracles: numpy formulas for every result, and the runtime's public counters
(``runtime.stats()``: sessions and eager sessions built).
"""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest

import onnxparam as op
from onnxparam import Param, Tensor, ops, runtime
from onnxparam.core.errors import TraceError

RNG = np.random.default_rng(23)


def array(*shape, dtype=np.float32):
    return RNG.normal(size=shape).astype(dtype)


class Affine(op.Module):
    """``x * scale + 1``: no params, so any float dtype runs."""

    def forward(self, x, scale=2):
        return x * scale + 1.0


class WithExtras(op.Module):
    """``x + sum(extras)``: the list's tensors are baked into the graph as constants."""

    def forward(self, x, extras):
        for extra in extras:
            x = x + extra
        return x


class Dense(op.Module):
    def __init__(self, d_in, d_out):
        self.weight = Param.from_tensor(Tensor.from_numpy(array(d_in, d_out)))

    def forward(self, x):
        return ops.matmul(x, self.weight.val())


def static(module):
    runtime.set_session_config(module, runtime.SessionConfig(dynamic_shapes="static"))
    return module


def built():
    return runtime.stats().sessions_built


def eager_built():
    return runtime.stats().eager_sessions_built


def test_module_calls_share_a_session_per_shape_and_dtype_whatever_the_values():
    m = static(Affine())
    before = built()
    for _ in range(3):  # new values of one shape and dtype: tensors and arrays alike
        x = array(2, 4)
        np.testing.assert_allclose(m(Tensor.from_numpy(x)).to_numpy(), x * 2 + 1, rtol=1e-6)
        x = array(2, 4)
        np.testing.assert_allclose(m(x).to_numpy(), x * 2 + 1, rtol=1e-6)
    assert built() == before + 1
    x = array(3, 4)
    np.testing.assert_allclose(m(x).to_numpy(), x * 2 + 1, rtol=1e-6)
    assert built() == before + 2
    x = array(2, 4, dtype=np.float64)
    y = m(x)
    assert y.to_numpy().dtype == np.float64
    np.testing.assert_allclose(y.to_numpy(), x * 2 + 1, rtol=1e-12)
    assert built() == before + 3
    m(array(2, 4))
    assert built() == before + 3


def test_plain_values_are_part_of_the_module_call_signature_and_int_differs_from_float():
    m = static(Affine())
    x = array(2, 3)
    before = built()
    np.testing.assert_allclose(m(x, 2).to_numpy(), x * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(m(x, 3).to_numpy(), x * 3 + 1, rtol=1e-6)
    np.testing.assert_allclose(m(x, 3.0).to_numpy(), x * 3 + 1, rtol=1e-6)
    np.testing.assert_allclose(m(x, 3).to_numpy(), x * 3 + 1, rtol=1e-6)
    assert built() == before + 3  # 2, 3 and 3.0: three graphs; 3 again reuses its own
    np.testing.assert_allclose(m(x, scale=5).to_numpy(), x * 5 + 1, rtol=1e-6)


def test_tensors_inside_a_module_calls_list_are_baked_so_other_tensors_of_the_same_shapes_get_their_own_graph():
    m = static(WithExtras())
    x = array(2, 3)
    first = [Tensor.from_numpy(array(2, 3)), Tensor.from_numpy(array(3))]
    second = [Tensor.from_numpy(array(2, 3)), Tensor.from_numpy(array(3))]
    for extras in (first, second, first):
        expected = x + extras[0].to_numpy() + extras[1].to_numpy()
        np.testing.assert_allclose(m(x, extras).to_numpy(), expected, rtol=1e-6)


def test_eager_ops_share_a_session_per_shape_and_dtype_whatever_the_values():
    a, b = array(4, 5), array(4, 5)
    np.testing.assert_allclose(ops.add(Tensor.from_numpy(a), Tensor.from_numpy(b)).to_numpy(), a + b, rtol=1e-6)
    level = eager_built()
    for _ in range(3):
        a, b = array(4, 5), array(4, 5)
        np.testing.assert_allclose(ops.add(Tensor.from_numpy(a), Tensor.from_numpy(b)).to_numpy(), a + b, rtol=1e-6)
    assert eager_built() == level
    a, b = array(4, 6), array(4, 6)
    np.testing.assert_allclose(ops.add(Tensor.from_numpy(a), Tensor.from_numpy(b)).to_numpy(), a + b, rtol=1e-6)
    a, b = array(4, 6, dtype=np.float64), array(4, 6, dtype=np.float64)
    np.testing.assert_allclose(ops.add(Tensor.from_numpy(a), Tensor.from_numpy(b)).to_numpy(), a + b, rtol=1e-12)
    assert eager_built() == level + 2
    ops.add(Tensor.from_numpy(array(4, 6)), Tensor.from_numpy(array(4, 6)))
    assert eager_built() == level + 2


def test_tensors_inside_an_eager_ops_list_are_inputs_so_new_values_reuse_the_session():
    parts = [array(2, 7), array(3, 7)]
    np.testing.assert_allclose(ops.concat([Tensor.from_numpy(p) for p in parts], 0).to_numpy(),
                               np.concatenate(parts, 0))
    level = eager_built()
    for _ in range(3):
        parts = [array(2, 7), array(3, 7)]
        np.testing.assert_allclose(ops.concat([Tensor.from_numpy(p) for p in parts], 0).to_numpy(),
                                   np.concatenate(parts, 0))
    assert eager_built() == level
    parts = [array(2, 7), array(4, 7)]
    np.testing.assert_allclose(ops.concat([Tensor.from_numpy(p) for p in parts], 0).to_numpy(),
                               np.concatenate(parts, 0))
    assert eager_built() == level + 1


def test_a_symbolic_tensor_from_an_ended_trace_is_refused_by_module_calls_and_eager_ops():
    kept = []

    class Keep(op.Module):
        def forward(self, x):
            kept.append(x)
            return x + 1.0

    x = array(2, 3)
    np.testing.assert_allclose(Keep()(x).to_numpy(), x + 1)  # traced, then run: kept[0] is symbolic
    with pytest.raises(TraceError, match="is symbolic: it belongs to a trace that has ended"):
        Affine()(kept[0])
    with pytest.raises(TraceError, match="is symbolic: it belongs to a trace that has ended"):
        ops.relu(kept[0])


@pytest.mark.parametrize("as_tensor", [False, True], ids=["array", "tensor"])
def test_a_failed_dynamic_run_is_not_reused_by_the_next_call_of_that_signature(as_tensor):
    m = Dense(16, 8)  # automatic dynamic: the second shape makes the feature dim symbolic
    wrap = Tensor.from_numpy if as_tensor else (lambda a: a)
    x = array(2, 16)
    np.testing.assert_allclose(m(wrap(x)).to_numpy(), x @ m.weight.val().to_numpy(), rtol=1e-5, atol=1e-5)
    for _ in range(2):  # the symbolic trace fails in ONNX Runtime; the concrete one explains
        with pytest.raises(TraceError, match="MatMul"):
            m(wrap(array(2, 9)))
    x = array(5, 16)
    np.testing.assert_allclose(m(wrap(x)).to_numpy(), x @ m.weight.val().to_numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif("CUDAExecutionProvider" not in onnxruntime.get_available_providers(),
                    reason="ONNX Runtime's CUDAExecutionProvider is not available")
def test_the_same_call_on_another_device_gets_its_own_session_and_eager_session():
    m = static(Dense(16, 4))
    x = array(3, 16)
    expected = x @ m.weight.val().to_numpy()
    before = built()
    m(x)
    m(x)
    assert built() == before + 1
    on_gpu = static(m.to_device("cuda"))
    np.testing.assert_allclose(on_gpu(Tensor.from_numpy(x).to_device("cuda")).to_numpy(), expected, rtol=1e-4, atol=1e-4)
    assert built() == before + 2
    a = array(3, 11)
    np.testing.assert_allclose(ops.relu(Tensor.from_numpy(a)).to_numpy(), np.maximum(a, 0))
    level = eager_built()
    np.testing.assert_allclose(ops.relu(Tensor.from_numpy(a).to_device("cuda")).to_numpy(), np.maximum(a, 0))
    assert eager_built() == level + 1
    level = eager_built()
    ops.relu(Tensor.from_numpy(array(3, 11)))
    ops.relu(Tensor.from_numpy(array(3, 11)).to_device("cuda"))
    assert eager_built() == level
