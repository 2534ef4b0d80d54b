"""Execution on CUDA (``CUDAExecutionProvider``); skipped where ONNX Runtime has no CUDA.

Run with ``python -m pytest -m cuda``; needs ``onnxruntime-gpu`` and a GPU.
"""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest

import onnxparam as op
from onnxparam import Device, DType, Param, ParamId, Tensor, ops, runtime

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif("CUDAExecutionProvider" not in onnxruntime.get_available_providers(),
                       reason="ONNX Runtime's CUDAExecutionProvider is not available"),
]

RNG = np.random.default_rng(11)
CUDA = Device("cuda:0")


def array(*shape):
    return RNG.normal(size=shape).astype(np.float32)


class Dense(op.Module):
    def __init__(self, d_in, d_out):
        self.weight = Param.from_tensor(Tensor.from_numpy(array(d_in, d_out)))
        self.bias = Param.from_tensor(Tensor.from_numpy(array(d_out)))

    def forward(self, x):
        return ops.linear(x, self.weight.val(), self.bias.val())


class TwoLayer(op.Module):
    def __init__(self):
        self.fc1 = Dense(16, 32)
        self.fc2 = Dense(32, 4)

    def forward(self, x):
        return self.fc2(ops.gelu(self.fc1(x)))


def test_module_on_cuda_equals_cpu_and_outputs_stay_on_device():
    m = TwoLayer()
    x = array(8, 16)
    expected = m(x).to_numpy()
    on_gpu = m.to_device("cuda")
    assert on_gpu.devices() == [CUDA]
    y = on_gpu(Tensor.from_numpy(x))  # a host input is copied in
    assert y.device == CUDA and y._ort is not None and y._ort.device_name().lower() == "cuda"
    np.testing.assert_allclose(y.to_numpy(), expected, rtol=1e-4, atol=1e-4)
    x_gpu = Tensor.from_numpy(x).to_device("cuda")
    y2 = on_gpu(x_gpu)  # a device input is bound as is
    assert y2.device == CUDA
    np.testing.assert_allclose(y2.to_numpy(), expected, rtol=1e-4, atol=1e-4)
    session = runtime.session_for(on_gpu, x_gpu)
    assert session.get_providers()[0] == "CUDAExecutionProvider"


def test_device_outputs_feed_the_next_call_without_leaving_the_device():
    first, second = Dense(16, 16).to_device("cuda"), Dense(16, 4).to_device("cuda")
    x = array(2, 16)
    h = first(Tensor.from_numpy(x).to_device("cuda"))
    y = second(h)
    assert h.device == CUDA and y.device == CUDA
    w1, b1 = first.weight.val().to_numpy(), first.bias.val().to_numpy()
    w2, b2 = second.weight.val().to_numpy(), second.bias.val().to_numpy()
    np.testing.assert_allclose(y.to_numpy(), (x @ w1 + b1) @ w2 + b2, rtol=1e-4, atol=1e-4)


def test_lazy_params_on_cuda_initialize_once():
    calls = []

    def init(device, require_grad):
        calls.append(device)
        return Tensor.from_numpy(np.ones((16, 4), np.float32), device)

    m = Dense(16, 4).to_device("cuda")
    m.weight = Param.uninitialized(ParamId(), init, "cuda", True, (16, 4), DType.F32)
    x = Tensor.from_numpy(array(3, 16)).to_device("cuda")
    m(x)
    m(x)
    assert calls == [CUDA]


def test_eager_ops_on_device_tensors_stay_on_device():
    x = array(3, 5)
    t = Tensor.from_numpy(x).to_device("cuda")
    y = ops.relu(t) * 2.0
    assert y.device == CUDA
    np.testing.assert_allclose(y.to_numpy(), np.maximum(x, 0) * 2.0, rtol=1e-6)


def test_lora_inputs_mode_switches_device_resident_adapters_under_io_binding():
    """ONNX Runtime ignores active adapters under IO binding; the runtime binds the factors as
    inputs instead, so switching device-resident adapters on CUDA needs no new session."""
    on_gpu = TwoLayer().apply_lora(op.LoraConfig(rank=2, alpha=3.0, seed=0)).to_device("cuda")

    def filled(seed):
        rng = np.random.default_rng(seed)
        return on_gpu.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(
            rng.normal(size=p.lazy_shape()).astype(np.float32)).to_device("cuda"), require_grad=p.require_grad)
            if path.endswith((".lora.a", ".lora.b")) else p)

    x_gpu = Tensor.from_numpy(array(8, 16)).to_device("cuda")
    before = None
    for seed in (1, 2, 3):
        module = filled(seed)
        expected = module.to_device("cpu").merge_lora()(x_gpu.to_numpy()).to_numpy()
        runtime.set_session_config(module, runtime.SessionConfig(lora_mode="inputs"))
        y = module(x_gpu)
        assert y.device == CUDA
        np.testing.assert_allclose(y.to_numpy(), expected, rtol=1e-4, atol=1e-4)
        if before is None:
            before = runtime.sessions_built()
    assert runtime.sessions_built() == before
