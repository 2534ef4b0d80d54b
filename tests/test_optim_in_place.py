"""``Optimizer.step(..., in_place=True)``: the same bits as the value path and as the published
formulas, written into the arrays the optimizer made in earlier steps (never into imported,
file-mapped, user-given or device memory), and no cached session computing with the values
it overwrote. Oracles: numpy formulas of Adam / SGD, numpy forwards (MatMul, Conv) of the
weights read back, the file's bytes, ``np.shares_memory``, the runtime's session counters."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import onnxparam as op
from onnxparam import Tensor, nn, ops, runtime
from onnxparam.autodiff import Gradients, cross_entropy, grad
from onnxparam.optim import SGD, Adam


class Mlp(op.Module):
    def __init__(self):
        self.fc1 = nn.LinearConfig(6, 8).init()
        self.fc2 = nn.LinearConfig(8, 3).init()

    def forward(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


class _Wide(op.Module):
    """A param larger than Adam's update block (131072 elements: several blocks, a ragged last
    one) and a small one, from arrays the caller keeps."""

    def __init__(self, wide: np.ndarray, small: np.ndarray):
        self.wide = op.Param.from_tensor(Tensor.from_numpy(wide))
        self.small = op.Param.from_tensor(Tensor.from_numpy(small))


def _arrays(module) -> dict:
    return {path: np.asarray(p.base().to_numpy()) for path, p in module.named_params()}


def _grads(module, g: dict) -> Gradients:
    ids = {path: p.id for path, p in module.named_params()}
    return Gradients({ids[path]: Tensor.from_numpy(v) for path, v in g.items()})


def _adam_ref(p, g, a, b, t):
    """Adam of the class docstring in float32 whole-array numpy (lr 0.05, betas (0.8, 0.99), eps 1e-6, wd 0.1)."""
    d = g + np.float32(0.1) * p
    a = (1 - 0.8) * d if a is None else 0.8 * a + (1 - 0.8) * d
    b = (d * d) * (1 - 0.99) if b is None else 0.99 * b + (1 - 0.99) * (d * d)
    return p - 0.05 * ((a / (1 - 0.8 ** t)) / (np.sqrt(b / (1 - 0.99 ** t)) + 1e-6)), a, b


def _sgd_ref(p, g, a, b, t):
    """SGD of the class docstring (lr 0.1, momentum 0.9, wd 0.01, dampening 0.2, Nesterov)."""
    d = g + 0.01 * p
    a = d.copy() if a is None else 0.9 * a + (1 - 0.2) * d
    return p - 0.1 * (d + 0.9 * a), a, None


@pytest.mark.parametrize("make, formula", [
    (lambda: Adam(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), _adam_ref),
    (lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.2, nesterov=True), _sgd_ref),
], ids=["adam", "sgd"])
def test_in_place_steps_give_the_formula_and_the_value_path_bit_for_bit_in_the_optimizers_own_memory(make, formula):
    rng = np.random.default_rng(0)
    wide = rng.normal(size=(2 * 131072 + 37,)).astype(np.float32)
    small = rng.normal(size=(3, 5)).astype(np.float32)
    given = {"wide": wide.copy(), "small": small.copy()}
    steps = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in given.items()} for _ in range(3)]
    by_value, in_place = _Wide(wide, small), _Wide(wide, small)
    value_optim, place_optim = make(), make()
    ref = {k: [v.astype(np.float32), None, None] for k, v in given.items()}
    made = []  # the arrays of each in-place step's module
    for t, g in enumerate(steps, start=1):
        by_value = value_optim.step(by_value, _grads(by_value, g))
        in_place = place_optim.step(in_place, _grads(in_place, g), in_place=True)
        made.append(_arrays(in_place))
        for k in ref:
            ref[k] = list(formula(ref[k][0], g[k], ref[k][1], ref[k][2], t))
            assert ref[k][0].dtype == np.float32
            np.testing.assert_array_equal(made[-1][k], ref[k][0])
            np.testing.assert_array_equal(made[-1][k], _arrays(by_value)[k])
    for k in given:
        np.testing.assert_array_equal(wide if k == "wide" else small, given[k])  # the caller's arrays: never written
        assert not np.shares_memory(made[0][k], wide if k == "wide" else small)  # the first step allocates
        assert np.shares_memory(made[0][k], made[1][k]) and np.shares_memory(made[1][k], made[2][k])  # then in place
        assert not np.shares_memory(_arrays(by_value)[k], made[2][k])
    value_state, place_state = value_optim.to_record().tensors, place_optim.to_record().tensors
    for (_, p), (_, q) in zip(by_value.named_params(), in_place.named_params()):
        for field in value_optim.tensor_fields:
            np.testing.assert_array_equal(place_state[f"{int(q.id)}.{field}"], value_state[f"{int(p.id)}.{field}"])


def test_by_default_a_kept_module_never_changes_and_in_place_writes_only_what_it_made():
    m = Mlp()
    optim = Adam(lr=0.1)
    rng = np.random.default_rng(1)
    g = lambda: {path: rng.normal(size=p.shape).astype(np.float32) for path, p in m.named_params()}  # noqa: E731
    first = optim.step(m, _grads(m, g()))  # value semantics: arrays the optimizer made
    best = first
    kept = {k: v.copy() for k, v in _arrays(best).items()}
    second = optim.step(first, _grads(first, g()))
    for k, v in _arrays(best).items():
        np.testing.assert_array_equal(v, kept[k])  # the default never writes into a kept module
    third = optim.step(second, _grads(second, g()), in_place=True)
    for k, v in _arrays(third).items():
        assert np.shares_memory(v, _arrays(second)[k])  # second's arrays were the optimizer's: written
        np.testing.assert_array_equal(_arrays(second)[k], v)  # second (sharing them) sees the new values
    for k, v in _arrays(best).items():
        np.testing.assert_array_equal(v, kept[k])  # first's arrays are no longer any param's: untouched


def _conv_forward(x, w, b):
    """``Conv`` (stride 1, no padding) as a numpy sum over windows."""
    win = np.lib.stride_tricks.sliding_window_view(x, w.shape[2:], axis=(2, 3))  # n c h w kh kw
    return np.einsum("nchwij,ocij->nohw", win.astype(np.float64), w.astype(np.float64)) + b[None, :, None, None]


class ConvNet(op.Module):
    def __init__(self):
        self.conv = nn.Conv2dConfig((3, 4), (3, 3)).init()
        self.fc = nn.LinearConfig(4 * 4 * 4, 5).init()

    def forward(self, x):
        return self.fc(ops.reshape(self.conv(x), (x.shape[0], 4 * 4 * 4)))


def _convnet_numpy(module, x):
    v = _arrays(module)
    h = _conv_forward(x, v["conv.weight"], v["conv.bias"]).reshape(x.shape[0], -1)
    return h @ v["fc.weight"].astype(np.float64) + v["fc.bias"]


def _mlp_numpy(module, x):
    v = {k: a.astype(np.float64) for k, a in _arrays(module).items()}
    return np.maximum(x @ v["fc1.weight"] + v["fc1.bias"], 0) @ v["fc2.weight"] + v["fc2.bias"]


@pytest.mark.parametrize("make, numpy_forward, x_shape", [
    (Mlp, _mlp_numpy, (5, 6)), (ConvNet, _convnet_numpy, (2, 3, 6, 6))], ids=["matmul", "conv"])
def test_calls_after_an_in_place_step_compute_with_the_new_values(make, numpy_forward, x_shape):
    # NOTE: ONNX Runtime pre-packs constant MatMul / Conv weights when it builds a session: a
    # session built before an in-place write must not serve a module holding those arrays
    rng = np.random.default_rng(2)
    x = rng.normal(size=x_shape).astype(np.float32)
    m = make()
    optim = SGD(lr=0.5)
    g = lambda mod: _grads(mod, {p: rng.normal(size=q.shape).astype(np.float32)  # noqa: E731
                                 for p, q in mod.named_params()})
    m1 = optim.step(m, g(m), in_place=True)  # allocates
    m1_out = m1(x).to_numpy()
    np.testing.assert_allclose(m1_out, numpy_forward(m1, x), rtol=1e-4, atol=1e-4)
    m1(x)  # the fast path remembers m1's runner
    m2 = optim.step(m1, g(m1), in_place=True)  # writes into m1's arrays
    assert np.shares_memory(_arrays(m2)["fc1.weight" if make is Mlp else "fc.weight"],
                            _arrays(m1)["fc1.weight" if make is Mlp else "fc.weight"])
    expected = numpy_forward(m2, x)
    assert np.abs(expected - m1_out).max() > 1e-2  # the step changed the output
    np.testing.assert_allclose(m2(x).to_numpy(), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(m1(x).to_numpy(), expected, rtol=1e-4, atol=1e-4)  # m1 shares them: new values too
    m3 = optim.step(m2, g(m2), in_place=True)
    np.testing.assert_allclose(m1(x).to_numpy(), numpy_forward(m3, x), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(m3(x).to_numpy(), numpy_forward(m3, x), rtol=1e-4, atol=1e-4)


def _imported_file(tmp_path):
    """A Conv + MatMul classifier saved with its weights in an external data file."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = {"conv_w": rng.normal(size=(4, 3, 3, 3)).astype(np.float32) * 0.3,
             "conv_b": rng.normal(size=(4,)).astype(np.float32) * 0.1,
             "fc_w": rng.normal(size=(64, 5)).astype(np.float32) * 0.2,
             "fc_b": rng.normal(size=(5,)).astype(np.float32) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["h"]),
             helper.make_node("Flatten", ["h"], ["f"], axis=1),
             helper.make_node("MatMul", ["f", "fc_w"], ["mm"]),
             helper.make_node("Add", ["mm", "fc_b"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 5])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "net.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="net.data",
              size_threshold=0)
    return path, inits


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _imported_numpy(values, x):
    h = _conv_forward(x, values["conv_w"], values["conv_b"]).reshape(x.shape[0], -1)
    return h @ values["fc_w"].astype(np.float64) + values["fc_b"]


def _loss(m, x, y):
    return cross_entropy(m(x=x), y)


def test_training_an_imported_file_in_place_leaves_the_file_and_builds_one_training_session(tmp_path):
    path, inits = _imported_file(tmp_path)
    files = {p: _digest(p) for p in (path, tmp_path / "net.data")}
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4, 3, 6, 6)).astype(np.float32)
    y = rng.integers(0, 5, size=(4,)).astype(np.int64)
    module = op.import_onnx(path)
    np.testing.assert_allclose(module(x).to_numpy(), _imported_numpy(inits, x), rtol=1e-4, atol=1e-4)
    optim = Adam(lr=0.05)
    before = runtime.stats().training_sessions_built
    model, steps, first = module, [], None
    for _ in range(3):
        _, grads = grad(_loss, model, x, y)
        model = optim.step(model, grads, in_place=True)
        first = model if first is None else first
        steps.append({k: np.asarray(v) for k, v in _arrays(model).items()})
        np.testing.assert_allclose(model(x).to_numpy(), _imported_numpy(_arrays(model), x), rtol=1e-4, atol=1e-4)
        # the first step's module shares the memory written since: its session is rebuilt
        np.testing.assert_allclose(first(x).to_numpy(), _imported_numpy(_arrays(model), x), rtol=1e-4, atol=1e-4)
    assert runtime.stats().training_sessions_built - before == 1
    for k in inits:
        assert np.shares_memory(steps[0][k], steps[2][k])  # steps 2 and 3 wrote in place
        assert not np.array_equal(steps[2][k], inits[k])
    for k, v in _arrays(module).items():
        np.testing.assert_array_equal(v, inits[k])  # the imported module (the file's memory) is unchanged
    np.testing.assert_allclose(module(x).to_numpy(), _imported_numpy(inits, x), rtol=1e-4, atol=1e-4)
    assert {p: _digest(p) for p in files} == files


def test_a_shape_mismatch_refuses_before_any_param_is_written():
    m = Mlp()
    optim = SGD(lr=0.1)
    good = {p: np.ones(q.shape, np.float32) for p, q in m.named_params()}
    m1 = optim.step(m, _grads(m, good), in_place=True)
    kept = {k: v.copy() for k, v in _arrays(m1).items()}
    bad = dict(good, **{"fc2.bias": np.ones(4, np.float32)})
    with pytest.raises(op.ShapeMismatchError, match="fc2.bias"):
        optim.step(m1, _grads(m1, bad), in_place=True)
    for k, v in _arrays(m1).items():
        np.testing.assert_array_equal(v, kept[k])


def test_device_params_are_never_written_in_place():
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("no CUDA execution provider")
    m = Mlp()
    on_device = m.to_device("cuda")
    rng = np.random.default_rng(5)
    g = {p: rng.normal(size=q.shape).astype(np.float32) for p, q in m.named_params()}
    dev_optim, host_optim = Adam(lr=0.1), Adam(lr=0.1)
    for _ in range(3):
        on_device = dev_optim.step(on_device, _grads(on_device, g), in_place=True)
        m = host_optim.step(m, _grads(m, g))
    assert not dev_optim._owned  # no host array of its own: nothing to write in place
    for (path, p), (_, q) in zip(on_device.named_params(), m.named_params()):
        assert str(p.base().device).startswith("cuda")
        np.testing.assert_array_equal(np.asarray(p.base().to_numpy()), np.asarray(q.base().to_numpy()))


class _Two(op.Module):
    def __init__(self, a: op.Param, b: op.Param):
        self.a = a
        self.b = b


def test_memory_another_param_of_the_module_holds_is_not_written():
    rng = np.random.default_rng(6)
    start = rng.normal(size=(4, 5)).astype(np.float32)
    g1, g2 = (rng.normal(size=(4, 5)).astype(np.float32) for _ in range(2))
    optim = SGD(lr=0.1)
    solo = _Two(op.Param.from_tensor(Tensor.from_numpy(start)), op.Param.from_tensor(Tensor.from_numpy(start)))
    stepped = optim.step(solo, Gradients({solo.a.id: Tensor.from_numpy(g1)}), in_place=True)
    made = np.asarray(stepped.a.base().to_numpy())  # the optimizer's own array for a
    # b (another id, frozen) now holds the same tensor: writing a's memory would change b
    tied = _Two(stepped.a, op.Param(op.ParamId(), value=stepped.a.base(), require_grad=False))
    after = optim.step(tied, Gradients({tied.a.id: Tensor.from_numpy(g2)}), in_place=True)
    expected_b = start - np.float32(0.1) * g1
    np.testing.assert_array_equal(np.asarray(after.b.base().to_numpy()), expected_b)
    np.testing.assert_array_equal(made, expected_b)
    np.testing.assert_array_equal(np.asarray(after.a.base().to_numpy()), expected_b - np.float32(0.1) * g2)
    assert not np.shares_memory(np.asarray(after.a.base().to_numpy()), made)


class _Dense(op.Module):
    def __init__(self, w: np.ndarray):
        self.w = op.Param.from_tensor(Tensor.from_numpy(w))

    def forward(self, x):
        return ops.matmul(x, self.w.val())


def test_forget_values_after_a_write_into_an_array_given_to_a_param():
    rng = np.random.default_rng(7)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    x = rng.normal(size=(3, 6)).astype(np.float32)
    m = _Dense(w)
    np.testing.assert_allclose(m(x).to_numpy(), x @ w, rtol=1e-5, atol=1e-5)
    w *= 3.0  # the caller's own array, which the param shares
    assert runtime.forget_values([w]) >= 1
    np.testing.assert_allclose(m(x).to_numpy(), x @ w, rtol=1e-5, atol=1e-5)
