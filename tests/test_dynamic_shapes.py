"""Dynamic shapes: symbolic sizes in traces, automatic dynamic module calls, dynamic exports.

Oracles: numpy formulas of the same computation at every size, plain ONNX Runtime on the written
files, the runtime's own counters for traces and sessions.
"""

import math
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxparam as op
from onnxparam import nn, ops, runtime
from onnxparam.core.errors import TraceError
from onnxparam.quant._passes import trace_module
from onnxparam.trace.tracer import InputSpec

RNG = np.random.default_rng(7)


def rand(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def plain_ort(path_or_bytes):
    source = path_or_bytes if isinstance(path_or_bytes, bytes) else str(path_or_bytes)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def proto_session(traced):
    return plain_ort(traced.to_proto().SerializeToString())


def values(*params):
    return [p.val().to_numpy() for p in params]


class Mlp(op.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=4):
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def mlp_numpy(m, x):
    w1, b1, w2, b2 = values(m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias)
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


# -- automatic dynamic module calls -----------------------------------------------------------


def test_eight_batch_sizes_take_two_traces_and_two_sessions_and_match_numpy():
    m = Mlp()
    before = runtime.stats()
    for batch in (2, 3, 5, 1, 8, 13, 32, 64):  # batch 1 too runs on the dynamic trace
        x = rand(batch, 16)
        np.testing.assert_allclose(m(op.Tensor.from_numpy(x)).to_numpy(), mlp_numpy(m, x), rtol=1e-5, atol=1e-5)
    after = runtime.stats()
    assert after.traces - before.traces == 2
    assert after.sessions_built - before.sessions_built == 2
    assert after.dynamic_traces - before.dynamic_traces == 1


def test_the_static_policy_builds_a_trace_and_a_session_per_shape():
    m = Mlp(16, 8, 3)
    runtime.set_session_config(m, runtime.SessionConfig(dynamic_shapes="static"))
    before = runtime.stats()
    for batch in (2, 3, 4, 5):
        x = rand(batch, 16)
        np.testing.assert_allclose(m(x).to_numpy(), mlp_numpy(m, x), rtol=1e-5, atol=1e-5)
    after = runtime.stats()
    assert (after.traces - before.traces, after.sessions_built - before.sessions_built) == (4, 4)
    assert after.dynamic_traces == before.dynamic_traces
    with pytest.raises(ValueError, match="dynamic_shapes must be one of auto, static"):
        runtime.SessionConfig(dynamic_shapes="always")


class SizeOneBranch(op.Module):
    """Python control flow on ``x.shape[0] == 1``: decidable on the dynamic trace (sizes >= 2)."""

    def forward(self, x):
        return x * 2.0 if x.shape[0] == 1 else x * 3.0


def test_sizes_one_are_specialized_so_a_branch_on_size_one_stays_right():
    m = SizeOneBranch()
    before = runtime.stats()
    for batch in (3, 4, 7, 1, 9):
        x = rand(batch, 2)
        want = x * (2.0 if batch == 1 else 3.0)
        np.testing.assert_allclose(m(x).to_numpy(), want, rtol=1e-6)
    after = runtime.stats()
    assert after.traces - before.traces == 3  # 3 (first), 4.. (dynamic), 1 (specialized)
    assert after.dynamic_traces - before.dynamic_traces == 1


class BranchOnSize(op.Module):
    """Python control flow that a symbolic size cannot decide."""

    def forward(self, x):
        return x * 2.0 if x.shape[0] > 4 else x - 1.0


def test_a_forward_needing_concrete_sizes_falls_back_to_a_trace_per_shape():
    m = BranchOnSize()
    before = runtime.stats()
    for batch in (2, 3, 6, 8):
        x = rand(batch, 3)
        want = x * 2.0 if batch > 4 else x - 1.0
        np.testing.assert_allclose(m(x).to_numpy(), want, rtol=1e-6)
    after = runtime.stats()
    assert after.traces - before.traces == 4 and after.dynamic_traces == before.dynamic_traces


class Stacked(op.Module):
    def forward(self, x, y):
        return ops.concat([x, y], 0) * 2.0


def test_dims_that_were_equal_and_then_differ_get_their_own_symbols():
    m = Stacked()
    before = runtime.stats()
    for a, b in ((2, 2), (3, 3), (4, 4), (4, 5), (6, 2)):
        x, y = rand(a, 4), rand(b, 4)
        np.testing.assert_allclose(m(x, y).to_numpy(), np.concatenate([x, y]) * 2.0, rtol=1e-6)
    after = runtime.stats()
    # (2, 2) concrete; (3, 3) one symbol for both dims; (4, 5) a symbol each, reused by (6, 2)
    assert (after.traces - before.traces, after.dynamic_traces - before.dynamic_traces) == (3, 2)


# -- symbolic sizes in a trace ----------------------------------------------------------------


class ShapeArithmetic(op.Module):
    def forward(self, x):
        b, s, d = x.shape
        pairs = x[:, : s - s % 2].reshape(b, (s - s % 2) // 2, 2 * d)       # reshape with computed dims
        grid = ops.zeros((b, s), op.DType.F32) + ops.arange(s).cast(op.DType.F32)  # zeros + arange
        tiled = x[:, :1].expand(b, s, d)                                      # expand to symbolic dims
        tail = x[:, -1]                                                       # an int index
        return pairs, grid, tiled.view(b, s * d), tail, x[..., None][:, 1:]


def shape_arithmetic_numpy(x):
    b, s, d = x.shape
    even = s - s % 2
    return (x[:, :even].reshape(b, even // 2, 2 * d), np.zeros((b, s), np.float32) + np.arange(s, dtype=np.float32),
            np.broadcast_to(x[:, :1], (b, s, d)).reshape(b, s * d), x[:, -1], x[..., None][:, 1:])


def test_shape_arithmetic_lowers_to_a_graph_that_is_right_at_every_size():
    traced = trace_module(ShapeArithmetic(), InputSpec(("batch", "seq", 3)))
    names = [t[0] for t in traced.input_types()]
    assert traced.input_types()[0][2] == ("batch", "seq", 3)
    assert traced.output_types()[1][2] == ("batch", "seq")
    assert traced.output_types()[2][2] == ("batch", "seq*3")
    session = proto_session(traced)
    for b, s in ((1, 1), (2, 5), (3, 6), (4, 9)):
        x = rand(b, s, 3)
        for got, want in zip(session.run(None, {names[0]: x}), shape_arithmetic_numpy(x)):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_comparisons_are_answered_when_decidable_and_raise_otherwise():
    seen = {}

    class Probe(op.Module):
        def forward(self, x):
            n = x.shape[0]
            seen["decided"] = (n >= 0, n + 1 > 0, n - n == 0, n % 4 < 4, n == "n")
            return x

    trace_module(Probe(), InputSpec(("n", 2)))
    assert seen["decided"] == (True, True, True, True, True)

    class Undecided(op.Module):
        def forward(self, x):
            if x.shape[0] == 3:
                return x
            return -x

    with pytest.raises(TraceError, match=r"comparison n == 3 needs a concrete value, but dim 0 of input 'x' \('n'\)"):
        trace_module(Undecided(), InputSpec(("n", 2)))


class NeedsInt(op.Module):
    def forward(self, x):
        return x.reshape(int(x.shape[0]), -1)  # the line the error names


def test_a_concrete_value_of_a_dynamic_dim_raises_naming_the_dim_and_the_line():
    with pytest.raises(TraceError) as info:
        trace_module(NeedsInt(), InputSpec(("batch", 2, 2)))
    message = str(info.value)
    assert "dim 0 of input 'x' ('batch')" in message
    assert "test_dynamic_shapes.py" in message and "x.reshape(int(x.shape[0]), -1)" in message

    class UsesLen(op.Module):
        def forward(self, x):
            return x * float(len(x))

    with pytest.raises(TraceError, match=r"len\(\) must return a Python int.*use x.shape\[0\]"):
        trace_module(UsesLen(), InputSpec(("batch", 2)))


# -- exports ----------------------------------------------------------------------------------


def test_export_with_the_batch_shorthand_runs_in_plain_ort_at_every_batch(tmp_path):
    m = Mlp()
    path = op.export_onnx(m, tmp_path / "m.onnx", rand(2, 16), dynamic_batch=True)
    model = onnx.load(path)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    session = plain_ort(path)
    for batch in (1, 2, 7, 300):
        x = rand(batch, 16)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], mlp_numpy(m, x), rtol=1e-4, atol=1e-5)


def test_export_without_dynamic_axes_makes_the_batch_dynamic_by_default(tmp_path):
    m = Mlp()
    path = op.export_onnx(m, tmp_path / "m.onnx", rand(2, 16))
    session = plain_ort(path)
    x = rand(300, 16)  # the "Got: 300 Expected: 2"
    np.testing.assert_allclose(session.run(None, {"x": x})[0], mlp_numpy(m, x), rtol=1e-4, atol=1e-5)
    pinned = op.export_onnx(m, tmp_path / "p.onnx", rand(2, 16), dynamic_batch=False)
    assert onnx.load(pinned).graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2


class PinsTheBatch(op.Module):
    """Reshapes with a batch size kept as a Python int: the graph only works at that batch."""

    def __init__(self, batch):
        self.batch = batch
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x).reshape(self.batch, 2, 3)


def test_a_declared_dynamic_dim_baked_into_a_constant_fails_naming_the_node(tmp_path):
    m = PinsTheBatch(4)
    with pytest.raises(TraceError, match=r"dim 0 of output 'output' dynamic \('batch'\).*constant 4 at node "
                                         r"'/Reshape' \(Reshape\)"):
        op.export_onnx(m, tmp_path / "a.onnx", rand(4, 6), dynamic_axes={"x": {0: "batch"}, "output": {0: "batch"}})
    with pytest.raises(TraceError, match=r"node '/Reshape' \(Reshape\)"):
        op.export_onnx(m, tmp_path / "b.onnx", rand(4, 6), dynamic_batch=True)
    assert not (tmp_path / "a.onnx").exists() and not (tmp_path / "b.onnx").exists()


def test_the_default_export_of_a_forward_that_pins_the_batch_warns_and_keeps_the_example_shapes(tmp_path):
    m = PinsTheBatch(4)
    with pytest.warns(UserWarning, match=r"batch size 4 pinned.*'/Reshape' \(Reshape\)"):
        path = op.export_onnx(m, tmp_path / "m.onnx", rand(4, 6))
    x = rand(4, 6)
    w, b = values(m.fc.weight, m.fc.bias)
    np.testing.assert_allclose(plain_ort(path).run(None, {"x": x})[0], (x @ w + b).reshape(4, 2, 3), rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op.export_onnx(m, tmp_path / "q.onnx", rand(4, 6), dynamic_batch=False)


# -- a transformer-style block over a dynamic sequence length -----------------------------------


class SelfAttention(op.Module):
    """Causal multi-head self-attention: heads split by reshape/transpose of computed dims."""

    def __init__(self, d_model=16, heads=4):
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, s, d = x.shape
        head_dim = d // self.heads
        qkv = self.qkv(x).reshape(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # (3, b, h, s, hd)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / float(np.sqrt(head_dim)))
        pos = ops.arange(s)
        future = pos[None, :] > pos[:, None]                                   # (s, s) causal mask
        scores = ops.where(future, ops.full((1,), -1e9), scores)
        att = scores.softmax(-1) @ v                                           # (b, h, s, hd)
        return self.out(att.transpose(1, 2).reshape(b, s, self.heads * head_dim))


def attention_numpy(m, x):
    wqkv, bqkv, wo, bo = values(m.qkv.weight, m.qkv.bias, m.out.weight, m.out.bias)
    b, s, d = x.shape
    h = m.heads
    qkv = (x @ wqkv + bqkv).reshape(b, s, 3, h, d // h).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // h)
    scores = np.where(np.triu(np.ones((s, s), bool), 1), -1e9, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return ((p @ v).transpose(0, 2, 1, 3).reshape(b, s, d)) @ wo + bo


def test_an_attention_block_exported_with_dynamic_batch_and_sequence_matches_the_module_at_every_size(tmp_path):
    m = SelfAttention()
    path = op.export_onnx(m, tmp_path / "att.onnx", rand(2, 5, 16),
                          dynamic_axes={"x": {0: "batch", 1: "seq"}, "output": {0: "batch", 1: "seq"}})
    dims = [d.dim_param or d.dim_value for d in onnx.load(path).graph.output[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq", 16]
    session = plain_ort(path)
    before = runtime.stats()
    for b, s in ((2, 5), (1, 1), (3, 7), (4, 16), (2, 33)):
        x = rand(b, s, 16)
        exported = session.run(None, {"x": x})[0]
        called = m(x).to_numpy()
        np.testing.assert_allclose(exported, attention_numpy(m, x), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(called, exported, rtol=1e-5, atol=1e-6)
    after = runtime.stats()
    assert after.traces - before.traces <= 3  # (2, 5) first, one dynamic trace, (1, 1) specialized
    assert after.dynamic_traces - before.dynamic_traces == 1


def test_the_readme_deployment_exports_run_at_any_batch(tmp_path, monkeypatch):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    script = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "export_onnx" in block)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    exec(compile(script, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    model = namespace["model"]
    files = sorted(tmp_path.glob("*.onnx"))
    assert len(files) >= 5
    for path in files:
        session = plain_ort(path)
        assert session.get_inputs()[0].shape[0] == "batch", path.name
        for batch in (3, 300):
            x = rand(batch, 16)
            out = session.run(None, {"x": x})[0]
            assert out.shape == (batch, 4), path.name
            if path.name == "mlp.onnx":  # Linear -> exact Gelu -> Linear, in numpy
                w1, b1, w2, b2 = values(model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias)
                h = x @ w1 + b1
                gelu = 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))
                np.testing.assert_allclose(out, gelu @ w2 + b2, rtol=1e-4, atol=1e-5)


class Encoder(op.Module):
    """onnxparam.nn.MultiHeadAttention (Burn's) as a self-attention block."""

    def __init__(self):
        self.mha = nn.MultiHeadAttention(16, 4, dropout=0.0)

    def forward(self, x):
        return self.mha(x)[0]


def mha_numpy(mha, x):
    def linear(layer, t):
        w, b = values(layer.weight, layer.bias)
        return t @ w + b

    b, s, d = x.shape
    h = mha.n_heads

    def heads(t):
        return t.reshape(b, s, h, d // h).transpose(0, 2, 1, 3)

    q, k, v = heads(linear(mha.query, x)), heads(linear(mha.key, x)), heads(linear(mha.value, x))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // h)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return linear(mha.output, (p @ v).transpose(0, 2, 1, 3).reshape(b, s, d))


def test_nn_multi_head_attention_exported_with_dynamic_batch_and_sequence_matches_numpy(tmp_path):
    m = Encoder()
    path = op.export_onnx(m, tmp_path / "mha.onnx", rand(2, 3, 16),
                          dynamic_axes={"x": {0: "batch", 1: "seq"}, "output": {0: "batch", 1: "seq"}})
    session = plain_ort(path)
    for b, s in ((2, 3), (1, 9), (5, 4)):
        x = rand(b, s, 16)
        want = mha_numpy(m.mha, x)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(m(x).to_numpy(), want, rtol=1e-4, atol=1e-5)


def test_a_dim_the_weights_pin_gets_the_forwards_own_error_not_the_runtimes():
    m = Mlp(16, 8, 2)
    x = rand(2, 16)
    np.testing.assert_allclose(m(x).to_numpy(), mlp_numpy(m, x), rtol=1e-5, atol=1e-5)
    for _ in range(2):  # the feature dim made symbolic fails in ORT: the concrete trace explains
        with pytest.raises(TraceError, match="MatMul"):
            m(rand(2, 9))
    x = rand(3, 16)
    np.testing.assert_allclose(m(x).to_numpy(), mlp_numpy(m, x), rtol=1e-5, atol=1e-5)


def test_iterating_a_traced_tensor_unpacks_a_static_dim_and_refuses_a_dynamic_one():
    class Unpack(op.Module):
        def forward(self, x):
            a, b, c = x  # static dim 0 (3)
            return a + b * c

    traced = trace_module(Unpack(), InputSpec((3, "n")))
    x = rand(3, 5)
    np.testing.assert_allclose(proto_session(traced).run(None, {"x": x})[0], x[0] + x[1] * x[2], rtol=1e-6)
    assert [row.to_numpy().tolist() for row in op.Tensor.from_numpy(x[:2])] == x[:2].tolist()
    with pytest.raises(TraceError, match=r"len\(\) must return a Python int"):
        trace_module(Unpack(), InputSpec(("n", 5)))
