"""Per-call overhead of ``module(x)`` against a plain ``onnxruntime.InferenceSession.run``.

Benchmarks are not tests: run ``python tools/bench_runtime.py``. It builds a small MLP
(784 -> 128 -> GELU -> 10, batch 1), gets the very session ``module(x)`` uses
(``runtime.session_for``), and times, in the same run and interleaved:

* baseline: ``session.run(None, {"x": array})`` — what a user of ONNX Runtime writes;
* onnxparam: ``module(tensor)`` (the cached fast path, output wrapped as a Tensor), and
  ``runtime.call_module`` directly (what ``Module.__call__`` calls; the difference is the cost of
  ``Module.__call__`` itself).

It prints the best-of-rounds microseconds per call and the ratio (target: <= 1.05), with
one intra-op thread (stable timings on small machines) and ONNX Runtime's default threads, then
the session build time
with weights injected as OrtValues versus serialized into the protobuf, for a larger model.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import onnxparam as op
from onnxparam import ops, runtime
from onnxparam.core.tensor import Tensor


class MLP(op.Module):
    def __init__(self, sizes, seed=0):
        rng = np.random.default_rng(seed)
        self.layers = [
            {"weight": op.Param.from_tensor(Tensor.from_numpy((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32))),
             "bias": op.Param.from_tensor(Tensor.from_numpy(np.zeros(b, np.float32)))}
            for a, b in zip(sizes[:-1], sizes[1:])
        ]

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = ops.linear(x, layer["weight"].val(), layer["bias"].val())
            if i < len(self.layers) - 1:
                x = ops.gelu(x)
        return x


class AttrMLP(op.Module):
    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.w1 = op.Param.from_tensor(Tensor.from_numpy((rng.normal(size=(784, 128)) / 28).astype(np.float32)))
        self.b1 = op.Param.from_tensor(Tensor.from_numpy(np.zeros(128, np.float32)))
        self.w2 = op.Param.from_tensor(Tensor.from_numpy((rng.normal(size=(128, 10)) / 11).astype(np.float32)))
        self.b2 = op.Param.from_tensor(Tensor.from_numpy(np.zeros(10, np.float32)))

    def forward(self, x):
        return ops.linear(ops.gelu(ops.linear(x, self.w1.val(), self.b1.val())), self.w2.val(), self.b2.val())


def time_per_call(fn, n):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def overhead(module, label, n=5000, rounds=21):
    x = np.random.default_rng(1).normal(size=(1, 784)).astype(np.float32)
    t = Tensor.from_numpy(x)
    module(t)
    session = runtime.session_for(module, t)
    name = session.get_inputs()[0].name
    np.testing.assert_allclose(module(t).to_numpy(), session.run(None, {name: x})[0], rtol=1e-6)
    base, ours, direct = [], [], []
    for _ in range(rounds):
        base.append(time_per_call(lambda: session.run(None, {name: x}), n))
        ours.append(time_per_call(lambda: module(t), n))
        direct.append(time_per_call(lambda: runtime.call_module(module, (t,), {}), n))
    b, o, d = min(base) * 1e6, min(ours) * 1e6, min(direct) * 1e6
    print(f"{label}: plain InferenceSession.run {b:.2f} us/call, module(x) {o:.2f} us/call (ratio {o / b:.3f}), "
          f"runtime.call_module {d:.2f} us/call (ratio {d / b:.3f})")
    return o / b


def build_time(sizes):
    module = MLP(sizes)
    x = Tensor.from_numpy(np.zeros((1, sizes[0]), np.float32))
    traced = runtime.traced_for(module, x)
    nbytes = sum(p.numel() * 4 for _, p in module.named_params())
    start = time.perf_counter()
    for _ in range(3):
        runtime.clear_caches()
        runtime.session_for(module, x)
    injected = (time.perf_counter() - start) / 3
    import onnxruntime as ort

    start = time.perf_counter()
    for _ in range(3):
        data = traced.to_proto().SerializeToString()
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    embedded = (time.perf_counter() - start) / 3
    print(f"session build, {nbytes / 2**20:.0f} MiB of weights: injected OrtValues {injected * 1e3:.1f} ms, "
          f"serialized into protobuf {embedded * 1e3:.1f} ms")


def main(argv):
    for threads in (1, 0):
        runtime.set_session_config(None, runtime.SessionConfig(intra_op_num_threads=threads))
        label = f"{threads} intra-op thread" if threads else "default threads"
        overhead(AttrMLP(), f"MLP 784-128-10, attribute params, {label}")
        overhead(MLP([784, 128, 10]), f"MLP 784-128-10, params in a list of dicts, {label}")
    runtime.set_session_config(None, None)
    build_time([2048, 4096, 4096, 2048])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
