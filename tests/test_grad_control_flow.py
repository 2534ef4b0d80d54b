"""Gradients through control flow: params inside ``If`` branches (a hand-written model with
params captured by both branches, and the public silero-vad model whose ``If`` branches hold
conv encoders and ``LSTM`` s, see data/onnx/README.md), and a clear error for ``Loop`` bodies.

Oracles: plain ONNX Runtime on the original files with weights perturbed (central differences,
a directional derivative for the big model), numpy formulas.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import grad, trainable_paths
from onnxparam.core.errors import ExecutionError, TraceError
from onnxparam.optim import SGD

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).parent / "data" / "onnx"


def _plain(model: onnx.ModelProto, feeds: dict) -> list:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _with_weights(model: onnx.ModelProto, weights: dict) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers / ``Constant`` nodes (at any depth) named in
    ``weights`` hold the given arrays."""
    model = onnx.ModelProto.FromString(model.SerializeToString())

    def walk(graph):
        for init in graph.initializer:
            if init.name in weights:
                init.CopyFrom(numpy_helper.from_array(weights[init.name].astype(np.float32), init.name))
        for node in graph.node:
            if node.op_type == "Constant" and node.output[0] in weights:
                for a in node.attribute:
                    if a.name == "value":
                        new = weights[node.output[0]].astype(np.float32)
                        a.t.CopyFrom(numpy_helper.from_array(new, node.output[0]))
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
    walk(model.graph)
    return model


# -- a small If whose branches capture params ---------------------------------------------------

def _if_model(inner_on_data: bool = False) -> onnx.ModelProto:
    """``y = If(sum(x) > 0, then: tanh(x @ w) * s, else: act(x @ v) + s)``; ``w``, ``v``, ``s``
    are main-graph initializers read only inside the branches; the else branch has an ``If`` of
    its own (nested) choosing ``act`` = ``relu`` or ``-``: on a shape test that is static (folded
    into the graph), or with ``inner_on_data`` on ``sum(x @ v) > 0`` (differentiated through)."""
    then = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["tw"]), helper.make_node("Tanh", ["tw"], ["tt"]),
                              helper.make_node("Mul", ["tt", "s"], ["then_y"])], "then", [],
                             [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, None)])
    inner_then = helper.make_graph([helper.make_node("Relu", ["xv"], ["inner_y"])], "inner_then", [],
                                   [helper.make_tensor_value_info("inner_y", TensorProto.FLOAT, None)])
    inner_else = helper.make_graph([helper.make_node("Neg", ["xv"], ["inner_n"])], "inner_else", [],
                                   [helper.make_tensor_value_info("inner_n", TensorProto.FLOAT, None)])
    els = helper.make_graph([
        helper.make_node("MatMul", ["x", "v"], ["xv"]),
        helper.make_node("Shape", ["xv"], ["shp"]),
        helper.make_node("Gather", ["shp", "zero"], ["rows"], axis=0),
        helper.make_node("ReduceSum", ["xv"], ["xv_sum"], keepdims=0) if inner_on_data else
        helper.make_node("Equal", ["rows", "rows"], ["always"]),
        *([helper.make_node("Greater", ["xv_sum", "zero_f"], ["always"])] if inner_on_data else []),
        helper.make_node("If", ["always"], ["act"], then_branch=inner_then, else_branch=inner_else),
        helper.make_node("Add", ["act", "s"], ["else_y"])], "else", [],
        [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero_f"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=els)]
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "v"),
             numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(0, np.float32), "zero_f")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _if_loss(m, x):
    y = m(x)
    return (y * y).sum()


@pytest.mark.parametrize("sign, inner_on_data, seed", [(1.0, False, 1), (-1.0, False, 1), (-1.0, True, 1),
                                                     (-1.0, True, 4)])
def test_params_captured_by_if_branches_get_the_gradient_of_the_taken_branch(sign, inner_on_data, seed):
    model = _if_model(inner_on_data)
    weights = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer if i.name in "wvs"}
    x = (np.abs(np.random.default_rng(1).normal(size=(2, 3))) * sign).astype(np.float32)
    if seed != 1:  # mixed signs, the outer condition still false: the other inner branch
        x = -np.random.default_rng(seed).normal(size=(2, 3)).astype(np.float32)
        x -= max(0.0, float(x.sum())) / x.size + 0.1
    module = op.import_onnx(model)
    assert set(trainable_paths(module)) == {"w", "v", "s"}
    loss, grads = grad(_if_loss, module, op.Tensor.from_numpy(x))
    got = grads.by_path()

    def np_loss(ws):
        y = _plain(_with_weights(model, ws), {"x": x})[0].astype(np.float64)
        return float((y * y).sum())

    np.testing.assert_allclose(float(loss.to_numpy()), np_loss(weights), rtol=1e-5)
    assert set(got) == {"w", "v", "s"}  # the untaken branch's param gets zeros, not nothing
    eps = 1e-3
    for name, value in weights.items():
        want = np.zeros_like(value)
        for idx in np.ndindex(*value.shape):
            plus, minus = dict(weights), dict(weights)
            plus[name], minus[name] = value.copy(), value.copy()
            plus[name][idx] += eps
            minus[name][idx] -= eps
            want[idx] = (np_loss(plus) - np_loss(minus)) / (2 * eps)
        np.testing.assert_allclose(got[name].to_numpy(), want, rtol=2e-3, atol=2e-3, err_msg=name)
    untaken = "v" if sign > 0 else "w"
    assert not got[untaken].to_numpy().any()


def test_a_param_read_inside_a_loop_body_by_an_op_without_rule_raises_naming_it_instead_of_no_gradient():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Mul", ["acc_in", "w"], ["scaled"]),
         helper.make_node("Twist", ["scaled"], ["acc_out"], domain="com.example", name="the_twist")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [3])],
        value_info=[helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [3])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "x"], ["y"], name="the_loop", body=body)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.array(2, np.int64), "trips"),
         numpy_helper.from_array(np.array([0.5, 1.5, -2.0], np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    module = op.import_onnx(model)
    assert "w" in trainable_paths(module)
    with pytest.raises(TraceError, match=r"'[^']*the_twist[^']*' \(com.example:Twist\): no gradient rule "
                                         r"\(in the body of '[^']*Loop[^']*' \(Loop\)\)"):
        grad(lambda m, x: m(x).sum(), module, op.Tensor.from_numpy(np.ones(3, np.float32)))


# -- silero-vad: If branches holding conv encoders and LSTMs ------------------------------------

SILERO = DATA / "silero_vad.onnx"
# NOTE: the 16 kHz branch takes 512 samples, the 8 kHz one 256 (each ends in a `squeeze` that
# needs one frame); 256 samples is an input both branches accept, at 512 the 8 kHz branch can
# only fail (the training graph keeps it as imported, with a NaN backward that never runs)


def _silero_feeds(batch: int, sr: int, seed: int, samples: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"input": (rng.normal(size=(batch, samples)) * 0.3).astype(np.float32),
            "state": (rng.normal(size=(2, batch, 128)) * 0.3).astype(np.float32),
            "sr": np.array(sr, np.int64)}


def _constants(model: onnx.ModelProto) -> dict:
    found = {}

    def walk(graph):
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                found[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
    walk(model.graph)
    return found


COEF = np.random.default_rng(11).normal(size=(2, 1, 128))


def _silero_loss(m, x, state, sr):
    out, new_state = m(x, state, sr)
    return (out * out).sum() * 10.0 + (new_state * op.Tensor.from_numpy(COEF.astype(np.float32))).sum()


def _np_silero_loss(model, feeds):
    out, new_state = (o.astype(np.float64) for o in _plain(model, feeds))
    return float((out * out).sum() * 10.0 + (new_state * COEF).sum())


def _directional_check(model, feeds, got: dict, groups: list, rng) -> None:
    """For each group of param names: ``sum_p <grad_p, d_p>`` against the central difference of
    plain ONNX Runtime's loss along the random direction ``d`` (each ``d_p`` scaled to its
    weight's magnitude)."""
    consts = _constants(model)
    for group in groups:
        base = {p: consts[p].astype(np.float64) for p in group}
        direction = {p: rng.normal(size=b.shape) * (np.abs(b).mean() + 1e-3) for p, b in base.items()}
        slope = sum(float((got[p].to_numpy().astype(np.float64) * direction[p]).sum()) for p in group)
        # steps that move the loss by about 3e-4 (float32 noise is ~1e-6 of a loss of ~10-60; the
        # ReLU kinks and the LSTM's curvature need small steps: its input weights give 46.6 at
        # h=1e-2, 72.9 at 1e-4); the median of three step sizes
        h0 = float(np.clip(3e-4 / max(abs(slope), 1e-9), 1e-5, 1e-2))
        estimates = []
        for h in (3 * h0, h0, h0 / 3):
            plus = _with_weights(model, {p: base[p] + h * direction[p] for p in group})
            minus = _with_weights(model, {p: base[p] - h * direction[p] for p in group})
            estimates.append((_np_silero_loss(plus, feeds) - _np_silero_loss(minus, feeds)) / (2 * h))
        want = float(np.median(estimates))
        np.testing.assert_allclose(slope, want, rtol=2e-2, atol=1e-3, err_msg=", ".join(group))


def _silero_grads(sr: int, samples: int):
    model = onnx.load(str(SILERO))
    module = op.import_onnx(SILERO)
    paths = trainable_paths(module)
    assert len(paths) == 30  # 15 float weights in each branch, LSTM weights among them
    feeds = _silero_feeds(1, sr, seed=sr, samples=samples)
    args = [op.Tensor.from_numpy(feeds[k]) for k in ("input", "state", "sr")]
    loss, grads = grad(_silero_loss, module, *args)
    got = grads.by_path()
    assert sorted(got) == sorted(paths)
    assert all(np.isfinite(t.to_numpy()).all() for t in got.values())
    np.testing.assert_allclose(float(loss.to_numpy()), _np_silero_loss(model, feeds), rtol=1e-5)
    taken = "then_branch" if sr == 16000 else "else_branch"
    for path in paths:
        if taken not in path:
            assert not got[path].to_numpy().any(), path  # the untaken branch: zero gradient
    checked = [p for p in paths if taken in p and "forward_basis_buffer" not in p]
    assert len(checked) == 14  # 4 convs + LSTM (4 tensors) + decoder conv, weights and biases
    return model, module, feeds, args, loss, grads, got, checked, taken


def test_silero_vad_params_inside_if_branches_match_directional_finite_differences_and_train():
    # its 16 kHz use: 512 samples
    model, module, feeds, args, loss, grads, got, checked, taken = _silero_grads(16000, 512)
    groups = [[p for p in checked if "encoder" in p], [p for p in checked if "rnn" in p],
              [p for p in checked if "decoder.decoder" in p]]
    assert [len(g) for g in groups] == [8, 4, 2]
    _directional_check(model, feeds, got, groups, np.random.default_rng(3))
    # a training step (SGD, the rate set so that the first-order decrease is 1% of the loss)
    # changes the taken branch's params and lowers the loss
    squared = sum(float((t.to_numpy().astype(np.float64) ** 2).sum()) for t in got.values())
    lr = 0.01 * abs(float(loss.to_numpy())) / squared
    stepped = SGD(lr=lr).step(module, grads)
    before_params, after_params = dict(module.named_params()), dict(stepped.named_params())
    changed = [p for p in got
               if not np.array_equal(before_params[p].val().to_numpy(), after_params[p].val().to_numpy())]
    assert changed and all(taken in p for p in changed)
    assert any("rnn.weight_ih" in p for p in changed)
    after, _ = grad(_silero_loss, stepped, *args)
    assert float(loss.to_numpy()) - float(after.to_numpy()) > 0.005 * abs(float(loss.to_numpy()))


@pytest.mark.slow
@pytest.mark.parametrize("sr, samples", [(16000, 256), (8000, 256), (16000, 512)])
def test_silero_vad_each_in_branch_param_matches_directional_finite_differences(sr, samples):
    model, module, feeds, args, loss, grads, got, checked, taken = _silero_grads(sr, samples)
    _directional_check(model, feeds, got, [[p] for p in checked], np.random.default_rng(sr))


def test_silero_vad_8khz_branch_fed_16khz_samples_raises_as_the_file_does():
    # plain ONNX Runtime on the file fails there too; the training graph must not return
    # gradients (its backward for that branch is NaN and never runs)
    feeds = _silero_feeds(1, 8000, seed=1, samples=512)
    with pytest.raises(Exception):
        _plain(onnx.load(str(SILERO)), feeds)
    module = op.import_onnx(SILERO)
    with pytest.raises(ExecutionError):
        grad(_silero_loss, module, *(op.Tensor.from_numpy(feeds[k]) for k in ("input", "state", "sr")))


# -- Scan ---------------------------------------------------------------------------------------

def _scan_model() -> onnx.ModelProto:
    """A float64 recurrence written as ``Scan``: state ``h`` ``[2, 3]``, two scan inputs (``x``
    forward, ``z`` read in reverse), body ``h' = tanh(h @ w + x * v) + z * h``, scan outputs
    ``y = h' * s`` (written in reverse) and ``h'``; ``w``, ``v``, ``s`` are read from the main
    graph; ``h0`` is computed from the param ``a``."""
    d = TensorProto.DOUBLE
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w"], ["hw"]), helper.make_node("Mul", ["x_t", "v"], ["xv"]),
         helper.make_node("Add", ["hw", "xv"], ["pre"]), helper.make_node("Tanh", ["pre"], ["th"]),
         helper.make_node("Mul", ["z_t", "h"], ["zh"]), helper.make_node("Add", ["th", "zh"], ["h_new"]),
         helper.make_node("Mul", ["h_new", "s"], ["y_t"]), helper.make_node("Identity", ["h_new"], ["h_copy"])],
        "body",
        [helper.make_tensor_value_info("h", d, [2, 3]), helper.make_tensor_value_info("x_t", d, [2, 3]),
         helper.make_tensor_value_info("z_t", d, [2, 3])],
        [helper.make_tensor_value_info("h_new", d, [2, 3]), helper.make_tensor_value_info("y_t", d, [2, 3]),
         helper.make_tensor_value_info("h_copy", d, [2, 3])])
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array(rng.normal(size=(3, 3)) * 0.6, "w"),
             numpy_helper.from_array(rng.normal(size=(3,)), "v"),
             numpy_helper.from_array(rng.normal(size=(3,)), "s"),
             numpy_helper.from_array(rng.normal(size=(2, 3)), "a")]
    graph = helper.make_graph(
        [helper.make_node("Tanh", ["a"], ["h0"]),
         helper.make_node("Scan", ["h0", "x", "z"], ["h_last", "y", "hs"], body=body, num_scan_inputs=2,
                          scan_input_directions=[0, 1], scan_output_directions=[1, 0])],
        "g", [helper.make_tensor_value_info("x", d, ["T", 2, 3]), helper.make_tensor_value_info("z", d, ["T", 2, 3])],
        [helper.make_tensor_value_info(n, d, None) for n in ("h_last", "y", "hs")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_scan_gradients_for_params_states_and_scan_inputs_match_float64_central_differences():
    model = _scan_model()
    rng = np.random.default_rng(2)
    x, z = rng.normal(size=(4, 2, 3)), rng.normal(size=(4, 2, 3)) * 0.5
    coefs = [rng.normal(size=(2, 3)), rng.normal(size=(4, 2, 3)), rng.normal(size=(4, 2, 3))]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}

    def np_loss(ws, x=x, z=z):
        return sum(float((o * c).sum()) for o, c in zip(_plain(_with_weights64(model, ws), {"x": x, "z": z}), coefs))

    class WithInputs(op.Module):
        onnx_opset_imports = {"": 17}  # the imported graph's opset

        def __init__(self, inner, x, z):
            self.inner = inner
            self.x = op.Param.from_tensor(op.Tensor.from_numpy(x))  # the scan inputs as params too
            self.z = op.Param.from_tensor(op.Tensor.from_numpy(z))

        def forward(self):
            return self.inner(self.x.val(), self.z.val())

    def loss_fn(m):
        total = None
        for o, c in zip(m(), coefs):
            term = (o * op.Tensor.from_numpy(c)).sum()
            total = term if total is None else total + term
        return total

    module = WithInputs(op.import_onnx(model), x, z)
    loss, grads = grad(loss_fn, module)
    got = grads.by_path()
    np.testing.assert_allclose(float(loss.to_numpy()), np_loss(weights), rtol=1e-12)
    eps = 1e-6
    for name in ("w", "v", "s", "a", "x", "z"):
        value = weights[name] if name in weights else {"x": x, "z": z}[name]
        want = np.zeros_like(value)
        for idx in np.ndindex(*value.shape):
            plus, minus = value.copy(), value.copy()
            plus[idx] += eps
            minus[idx] -= eps
            if name in weights:
                hi, lo = np_loss({**weights, name: plus}), np_loss({**weights, name: minus})
            else:
                hi, lo = np_loss(weights, **{name: plus}), np_loss(weights, **{name: minus})
            want[idx] = (hi - lo) / (2 * eps)
        key = next(k for k in got if k == name or k.endswith("." + name))
        np.testing.assert_allclose(got[key].to_numpy(), want, rtol=1e-6, atol=1e-8, err_msg=name)


def _with_weights64(model, weights):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for init in model.graph.initializer:
        if init.name in weights:
            init.CopyFrom(numpy_helper.from_array(np.asarray(weights[init.name], np.float64), init.name))
    return model


def _loop_model(trips: int, stop_after: int) -> onnx.ModelProto:
    """A float64 ``Loop``: at most ``trips`` iterations, the condition turns false after
    iteration ``stop_after``; state ``h`` ``[2, 3]`` and a counter; body
    ``h' = tanh(h @ w + v * (i + 1))``, scan output ``y = h' * s``."""
    d = TensorProto.DOUBLE
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i_f"], to=d), helper.make_node("Add", ["i_f", "one_f"], ["i1"]),
         helper.make_node("Mul", ["v", "i1"], ["vi"]), helper.make_node("MatMul", ["h", "w"], ["hw"]),
         helper.make_node("Add", ["hw", "vi"], ["pre"]), helper.make_node("Tanh", ["pre"], ["h_new"]),
         helper.make_node("Mul", ["h_new", "s"], ["y_t"]), helper.make_node("Add", ["count", "one_i"], ["count_new"]),
         helper.make_node("Less", ["i", "stop"], ["cond_new"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h", d, [2, 3]), helper.make_tensor_value_info("count", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("cond_new", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_new", d, [2, 3]),
         helper.make_tensor_value_info("count_new", TensorProto.INT64, []),
         helper.make_tensor_value_info("y_t", d, [2, 3])])
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(rng.normal(size=(3, 3)) * 0.6, "w"),
             numpy_helper.from_array(rng.normal(size=(3,)), "v"),
             numpy_helper.from_array(rng.normal(size=(3,)), "s"), numpy_helper.from_array(rng.normal(size=(2, 3)), "a"),
             numpy_helper.from_array(np.array(1.0), "one_f"), numpy_helper.from_array(np.array(1, np.int64), "one_i"),
             numpy_helper.from_array(np.array(stop_after, np.int64), "stop"),
             numpy_helper.from_array(np.array(trips, np.int64), "trips"),
             numpy_helper.from_array(np.array(0, np.int64), "zero_i"),
             numpy_helper.from_array(np.array(True), "go")]
    graph = helper.make_graph(
        [helper.make_node("Tanh", ["a"], ["h0"]),
         helper.make_node("Loop", ["trips", "go", "h0", "zero_i"], ["h_last", "n", "y"], body=body)],
        "g", [],
        [helper.make_tensor_value_info(n, t, None) for n, t in (("h_last", d), ("n", TensorProto.INT64), ("y", d))],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("trips, stop_after", [(4, 10), (10, 2)])
def test_loop_gradients_match_float64_central_differences(trips, stop_after):
    model = _loop_model(trips, stop_after)
    # every float initializer is a param (the scalar ``one_f`` the body reads from outside too)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == TensorProto.DOUBLE}
    n_iter = min(trips, stop_after + 1)
    rng = np.random.default_rng(4)
    c_last, c_y = rng.normal(size=(2, 3)), rng.normal(size=(n_iter, 2, 3))

    def np_loss(ws):
        h_last, _, y = _plain(_with_weights64(model, ws), {})
        assert y.shape[0] == n_iter
        return float((h_last * c_last).sum() + (y * c_y).sum())

    def loss_fn(m):
        h_last, _, y = m()
        return (h_last * op.Tensor.from_numpy(c_last)).sum() + (y * op.Tensor.from_numpy(c_y)).sum()

    loss, grads = grad(loss_fn, op.import_onnx(model))
    got = grads.by_path()
    assert sorted(got) == ["a", "one_f", "s", "v", "w"]
    np.testing.assert_allclose(float(loss.to_numpy()), np_loss(weights), rtol=1e-12)
    eps = 1e-6
    for name, value in weights.items():
        want = np.zeros_like(value)
        for idx in np.ndindex(*value.shape):
            plus, minus = value.copy(), value.copy()
            plus[idx] += eps
            minus[idx] -= eps
            want[idx] = (np_loss({**weights, name: plus}) - np_loss({**weights, name: minus})) / (2 * eps)
        np.testing.assert_allclose(got[name].to_numpy(), want, rtol=1e-6, atol=1e-8, err_msg=name)
