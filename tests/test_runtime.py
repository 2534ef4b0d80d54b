"""``module(x)`` through ONNX Runtime: results, session caching, weights, devices, errors."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest

import onnxparam as op
from onnxparam import DType, LoraAdapter, Param, ParamId, Tensor, ops, runtime
from onnxparam.core.errors import DeviceError, ExecutionError, TraceError

RNG = np.random.default_rng(7)
HAS_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def array(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def param(values):
    return Param.from_tensor(Tensor.from_numpy(values))


class Dense(op.Module):
    """A Linear-like layer written here: weight (d_in, d_out), bias (d_out,)."""

    def __init__(self, weight, bias):
        self.weight = param(weight)
        self.bias = param(bias)

    def forward(self, x):
        return x @ self.weight.val() + self.bias.val()


class TwoLayer(op.Module):
    def __init__(self, d_in=4, d_hidden=8, d_out=3):
        self.fc1 = Dense(array(d_in, d_hidden), array(d_hidden))
        self.fc2 = Dense(array(d_hidden, d_out), array(d_out))
        self.unused = param(array(2))

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def expected_two_layer(m, x):
    w1, b1 = m.fc1.weight.val().to_numpy(), m.fc1.bias.val().to_numpy()
    w2, b2 = m.fc2.weight.val().to_numpy(), m.fc2.bias.val().to_numpy()
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def test_two_layer_module_equals_numpy():
    m = TwoLayer()
    x = array(5, 4)
    y = m(Tensor.from_numpy(x))
    assert isinstance(y, Tensor) and y.shape == (5, 3) and y.dtype is DType.F32
    np.testing.assert_allclose(y.to_numpy(), expected_two_layer(m, x), rtol=1e-5, atol=1e-5)
    assert not y.to_numpy().flags.writeable


def test_module_accepts_numpy_arrays():
    m = TwoLayer()
    x = array(2, 4)
    np.testing.assert_allclose(m(x).to_numpy(), expected_two_layer(m, x), rtol=1e-5, atol=1e-5)


def test_repeated_calls_build_one_session_and_a_new_shape_one_more():
    m = TwoLayer()
    runtime.set_session_config(m, runtime.SessionConfig(dynamic_shapes="static"))  # a session per shape
    x = Tensor.from_numpy(array(2, 4))
    before = runtime.sessions_built()
    for _ in range(5):
        m(x)
    m(Tensor.from_numpy(array(2, 4)))
    assert runtime.sessions_built() == before + 1
    m(Tensor.from_numpy(array(3, 4)))
    assert runtime.sessions_built() == before + 2
    m(x)  # back to the first signature: cached
    assert runtime.sessions_built() == before + 2


def test_loading_a_new_record_makes_the_next_call_use_the_new_weights():
    m, other = TwoLayer(), TwoLayer()
    x = array(2, 4)
    first = m(x).to_numpy()
    loaded = m.load_record(other.into_record())
    np.testing.assert_allclose(loaded(x).to_numpy(), expected_two_layer(other, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m(x).to_numpy(), first)  # the receiver is unchanged


def test_a_param_replaced_in_place_is_used_by_the_next_call():
    m = TwoLayer()
    x = Tensor.from_numpy(array(2, 4))
    m(x)
    m.fc2.bias = param(np.full(3, 100.0, np.float32))
    np.testing.assert_allclose(m(x).to_numpy(), expected_two_layer(m, x.to_numpy()), rtol=1e-5, atol=1e-5)


def test_copies_sharing_weights_reuse_the_session():
    m = TwoLayer()
    x = Tensor.from_numpy(array(2, 4))
    m(x)
    before = runtime.sessions_built()
    m.no_grad()(x)
    m.to_device("cpu")(x)
    assert runtime.sessions_built() == before
    m.train()(x)  # training mode may change the forward: traced again
    assert runtime.sessions_built() == before + 1


def test_different_configuration_attributes_get_different_graphs():
    class Scale(op.Module):
        def __init__(self, factor):
            self.factor = factor
            self.w = param(np.ones(3, np.float32))

        def forward(self, x):
            return x * self.w.val() * self.factor

    x = Tensor.from_numpy(np.ones(3, np.float32))
    assert Scale(2.0)(x).to_numpy().tolist() == [2.0, 2.0, 2.0]
    assert Scale(3.0)(x).to_numpy().tolist() == [3.0, 3.0, 3.0]


def counting_lazy_param(values, calls):
    def init(device, require_grad):
        calls.append(1)
        return Tensor.from_numpy(values, device)

    return Param.uninitialized(ParamId(), init, "cpu", True, values.shape, DType.F32)


def test_lazy_params_are_initialized_once_by_the_first_call():
    calls = []
    w, b = array(4, 2), array(2)
    m = Dense(w, b)
    m.weight = counting_lazy_param(w, calls)
    x = array(3, 4)
    runtime.traced_for(m, x)
    assert calls == []  # tracing never runs an init
    np.testing.assert_allclose(m(x).to_numpy(), x @ w + b, rtol=1e-5, atol=1e-5)
    assert calls == [1]
    m(array(5, 4))  # a new session for a new shape: the value is reused
    m(x)
    assert calls == [1]


def test_adapted_params_run_with_their_merged_value():
    m = Dense(array(4, 3), array(3))
    a, b = param(array(4, 2)), param(array(2, 3))
    m.weight = m.weight.with_adapter(LoraAdapter(a, b, 0.5))
    x = array(2, 4)
    merged = m.weight.base().to_numpy() + 0.5 * (a.val().to_numpy() @ b.val().to_numpy())
    np.testing.assert_allclose(m(x).to_numpy(), x @ merged + m.bias.val().to_numpy(), rtol=1e-5, atol=1e-5)


def test_quantized_params_run_with_their_dequantized_value():
    from onnxparam.quant import QuantScheme, quantize

    w = array(8, 4)
    quantized = quantize(w, QuantScheme()).to_tensor()
    m = Dense(w, np.zeros(4, np.float32))
    m.weight = Param.initialized(ParamId(), quantized)
    assert m.weight.lazy_dtype() is DType.QFloat
    x = array(2, 8)
    dequantized = quantized.to_numpy()
    assert not np.array_equal(dequantized, w)
    np.testing.assert_allclose(m(x).to_numpy(), x @ dequantized, rtol=1e-5, atol=1e-5)


def test_several_outputs_are_a_tuple_and_kwargs_and_static_args_work():
    class Multi(op.Module):
        def __init__(self):
            self.w = param(array(3))

        def forward(self, x, y=None, negate=False):
            s = x * self.w.val()
            if negate:
                s = -s
            return s, s + y

    m = Multi()
    x, y = array(2, 3), array(3)
    w = m.w.val().to_numpy()
    out = m(Tensor.from_numpy(x), y=Tensor.from_numpy(y))
    assert isinstance(out, tuple) and len(out) == 2
    np.testing.assert_allclose(out[0].to_numpy(), x * w, rtol=1e-6)
    np.testing.assert_allclose(out[1].to_numpy(), x * w + y, rtol=1e-6)
    neg = m(Tensor.from_numpy(x), Tensor.from_numpy(y), True)
    np.testing.assert_allclose(neg[0].to_numpy(), -x * w, rtol=1e-6)


def test_session_for_exposes_the_ort_session_and_its_options():
    m = TwoLayer()
    x = Tensor.from_numpy(array(1, 4))
    runtime.set_session_config(m, runtime.SessionConfig(intra_op_num_threads=1, graph_optimization_level="basic"))
    session = runtime.session_for(m, x)
    assert isinstance(session, onnxruntime.InferenceSession)
    options = session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert runtime.session_for(m, x) is session
    assert runtime.session_config(m.load_record(m.into_record())).intra_op_num_threads == 1
    runtime.set_session_config(m, None)
    assert runtime.session_for(m, x) is not session
    assert [i.name for i in session.get_inputs()] == ["x"]
    # the weights were injected as OrtValues, not serialized into the session's model
    assert runtime.traced_for(m, x).param_paths == ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def test_session_config_validates_its_values():
    with pytest.raises(ValueError, match="graph_optimization_level must be one of disable, basic, extended, all; "
                                         "got 'max'"):
        runtime.SessionConfig(graph_optimization_level="max")
    config = runtime.SessionConfig().with_threads(2).with_config_entry("session.intra_op.allow_spinning", "0")
    assert config.intra_op_num_threads == 2 and config.config_entries == (("session.intra_op.allow_spinning", "0"),)


def test_unavailable_provider_in_config_raises_device_error():
    m = TwoLayer()
    runtime.set_session_config(m, runtime.SessionConfig(providers=("NoSuchExecutionProvider",)))
    with pytest.raises(DeviceError, match=r"execution provider NoSuchExecutionProvider is not available; "
                                          r"available providers: .*CPUExecutionProvider"):
        m(array(1, 4))


def test_ort_failure_names_the_node_and_the_params_feeding_it():
    class Embed(op.Module):
        def __init__(self):
            self.emb = Dense(array(5, 2), array(2))

        def forward(self, idx):
            return ops.embedding(self.emb.weight.val(), idx)

    m = Embed()
    ok = m(Tensor.from_numpy(np.array([0, 4])))
    np.testing.assert_array_equal(ok.to_numpy(), m.emb.weight.val().to_numpy()[[0, 4]])
    with pytest.raises(ExecutionError, match=r"ONNX Runtime failed to run Embed at node '/Gather' \(Gather\), fed by "
                                             r"params 'emb.weight': .*indices element out of data bounds") as info:
        m(Tensor.from_numpy(np.array([1, 9])))
    assert info.value.__cause__ is not None


def test_session_build_failure_names_the_node():
    class Unknown(op.Module):
        def forward(self, x):
            return ops.custom("MyOp", x, domain="my.domain", output_dtypes=[DType.F32], output_shapes=[x.shape])

    with pytest.raises(ExecutionError, match=r"ONNX Runtime failed to build a session for Unknown at node '/MyOp' "
                                             r"\(MyOp\) \(no param feeds it\): .*my.domain:MyOp"):
        Unknown()(array(3))


def test_data_dependent_control_flow_is_a_trace_error():
    class Branchy(op.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return -x

    with pytest.raises(TraceError, match="a traced tensor has no truth value: data-dependent Python control flow"):
        Branchy()(array(3))


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where CUDA is missing")
def test_cuda_without_cuda_provider_raises_device_error_naming_providers():
    with pytest.raises(DeviceError, match=r"device cuda:0 needs ONNX Runtime's CUDAExecutionProvider, which is not "
                                          r"available; available providers: .*CPUExecutionProvider"):
        Tensor.from_numpy(array(3)).to_device("cuda")
    calls = []
    m = Dense(array(4, 2), array(2))
    m.weight = counting_lazy_param(array(4, 2), calls).to_device("cuda:1")
    m.bias = counting_lazy_param(array(2), calls).to_device("cuda:1")
    with pytest.raises(DeviceError, match=r"device cuda:1 needs ONNX Runtime's CUDAExecutionProvider, which is not "
                                          r"available; available providers: .*CPUExecutionProvider"):
        m(array(1, 4))
    assert calls == []


def test_params_on_several_devices_are_rejected():
    m = Dense(array(4, 2), array(2))
    m.bias = counting_lazy_param(array(2), []).to_device("cuda:1")
    with pytest.raises(DeviceError, match=r"Dense has params on several devices \(cpu: 'weight'; cuda:1: 'bias'\)"):
        m(array(1, 4))


def test_cache_bounds_evict_sessions():
    runtime.set_cache_size(sessions=2)
    try:
        m = TwoLayer()
        runtime.set_session_config(m, runtime.SessionConfig(dynamic_shapes="static"))  # a session per shape
        before = runtime.sessions_built()
        for n in (1, 2, 3):
            m(array(n, 4))
        m(array(1, 4))  # evicted: built again
        assert runtime.sessions_built() == before + 4
    finally:
        runtime.set_cache_size(sessions=runtime.MAX_CACHED_SESSIONS)


def test_concurrent_first_calls_build_one_session_and_initialize_once():
    from concurrent.futures import ThreadPoolExecutor

    calls = []
    w, b = array(4, 2), array(2)
    m = Dense(w, b)
    m.weight = counting_lazy_param(w, calls)
    x = array(3, 4)
    before = runtime.sessions_built()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: m(Tensor.from_numpy(x)).to_numpy(), range(16)))
    assert runtime.sessions_built() == before + 1 and calls == [1]
    for r in results:
        np.testing.assert_allclose(r, x @ w + b, rtol=1e-5, atol=1e-5)


def test_the_call_caches_keep_no_module_alive():
    import gc
    import weakref

    from onnxparam import runtime as rt
    from onnxparam.nn import LinearConfig

    module = LinearConfig(3, 2).init()
    x = Tensor.from_numpy(np.ones((1, 3), np.float32))
    expected = np.ones((1, 3), np.float32) @ module.weight.val().to_numpy() + module.bias.val().to_numpy()
    np.testing.assert_allclose(module(x).to_numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(module(x).to_numpy(), expected, rtol=1e-6)  # the fast path
    alive = weakref.ref(module)
    del module
    if alive() is not None:  # a full collection only when needed: it takes about a second late in the suite
        gc.collect()
    assert alive() is None
    assert rt._calls._fast == {} or all(entry.module() is not None for entry in rt._calls._fast.values())


def test_two_copies_of_a_lazy_module_frozen_apart_share_one_session():
    """Freezing a lazy param clones its once-cell; both copies read the first cell's value, so
    they are one set of weights and one session (adding a first adapter freezes a base this way:
    two adapter sets over one lazy base served by one session)."""
    from onnxparam.nn import Linear

    base = Linear(4, 3)  # lazy: no value until the first call
    assert not base.weight.is_initialized()
    a = base.map(lambda path, p: p.set_require_grad(False))
    b = base.map(lambda path, p: p.set_require_grad(False))
    runtime.set_session_config(a, runtime.SessionConfig(dynamic_shapes="static"))
    runtime.set_session_config(b, runtime.SessionConfig(dynamic_shapes="static"))
    x = array(2, 4)
    before = runtime.sessions_built()
    ya, yb = a(x).to_numpy(), b(x).to_numpy()
    assert runtime.sessions_built() == before + 1
    w, bias = base.weight.val().to_numpy(), base.bias.val().to_numpy()  # the one initialized value
    np.testing.assert_allclose(ya, x @ w + bias, rtol=1e-5, atol=1e-6)  # Burn's layout: weight [d_in, d_out]
    np.testing.assert_array_equal(ya, yb)
