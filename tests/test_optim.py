"""Optimizers: updates against the published formulas, updates by ParamId (frozen params never
move), and state records that round-trip through burnpack so training resumes identically."""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam import DType, Tensor, nn, ops
from onnxparam import burnpack as bp
from onnxparam.autodiff import Gradients, cross_entropy, grad
from onnxparam.optim import SGD, Adam


class Mlp(op.Module):
    def __init__(self, dtype=DType.F32):
        self.fc1 = nn.LinearConfig(6, 8).init(dtype=dtype)
        self.fc2 = nn.LinearConfig(8, 3).init(dtype=dtype)

    def forward(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


def _loss(m, x, t):
    return cross_entropy(m(x), t)


def _data(seed=0, n=16, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(dtype)
    t = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    return x, t


def _values(module) -> dict:
    return {path: np.asarray(p.base().to_numpy()).copy() for path, p in module.named_params()}


def _fixed_grads(module, scale=1.0) -> Gradients:
    grads = {p.id: Tensor.from_numpy(np.full(p.shape, scale, dtype=np.float32)) for _, p in module.named_params()}
    return Gradients(grads)


def test_sgd_with_momentum_and_weight_decay_follows_the_formula():
    m = Mlp()
    before = _values(m)
    optim = SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    rng = np.random.default_rng(3)
    g1 = {path: rng.normal(size=v.shape).astype(np.float32) for path, v in before.items()}
    g2 = {path: rng.normal(size=v.shape).astype(np.float32) for path, v in before.items()}
    ids = {path: p.id for path, p in m.named_params()}
    m1 = optim.step(m, Gradients({ids[k]: Tensor.from_numpy(v) for k, v in g1.items()}))
    m2 = optim.step(m1, Gradients({ids[k]: Tensor.from_numpy(v) for k, v in g2.items()}))
    for path, p0 in before.items():
        d1 = g1[path] + 0.01 * p0
        v1 = d1
        p1 = p0 - 0.1 * v1
        d2 = g2[path] + 0.01 * p1
        v2 = 0.9 * v1 + d2
        p2 = p1 - 0.1 * v2
        np.testing.assert_allclose(_values(m1)[path], p1, rtol=1e-6)
        np.testing.assert_allclose(_values(m2)[path], p2, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(_values(m)["fc1.weight"], before["fc1.weight"])  # value semantics
    assert optim.step_count == 2
    assert [p.id for _, p in m2.named_params()] == [p.id for _, p in m.named_params()]


def test_adam_first_step_moves_each_weight_by_lr_against_the_gradient_sign():
    # m_hat = g, v_hat = g^2 on the first step: the update is lr * g / (|g| + eps)
    m = Mlp()
    before = _values(m)
    optim = Adam(lr=0.01, eps=1e-8)
    rng = np.random.default_rng(5)
    g = {p.id: rng.normal(size=p.shape).astype(np.float32) for _, p in m.named_params()}
    after = _values(optim.step(m, Gradients({k: Tensor.from_numpy(v) for k, v in g.items()})))
    for path, p in m.named_params():
        np.testing.assert_allclose(after[path], before[path] - 0.01 * np.sign(g[p.id]), rtol=1e-5, atol=1e-7)


def test_adam_matches_a_reference_implementation_over_several_steps():
    m = Mlp()
    optim = Adam(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    rng = np.random.default_rng(7)
    ref = {p.id: (np.asarray(p.base().to_numpy(), dtype=np.float64), 0.0, 0.0) for _, p in m.named_params()}
    for t in range(1, 4):
        g = {p.id: rng.normal(size=p.shape).astype(np.float32) for _, p in m.named_params()}
        m = optim.step(m, Gradients({k: Tensor.from_numpy(v) for k, v in g.items()}))
        for pid, (p, mom, vel) in ref.items():
            d = g[pid] + 0.1 * p
            mom = 0.8 * mom + 0.2 * d
            vel = 0.99 * vel + 0.01 * d * d
            p = p - 0.05 * (mom / (1 - 0.8 ** t)) / (np.sqrt(vel / (1 - 0.99 ** t)) + 1e-6)
            ref[pid] = (p, mom, vel)
    for _, param in m.named_params():
        np.testing.assert_allclose(param.base().to_numpy(), ref[param.id][0], rtol=1e-4, atol=1e-5)


class _Wide(op.Module):
    """One param larger than an update block (several blocks and a ragged last one) and a small one."""

    def __init__(self, rng):
        self.wide = op.Param.from_tensor(Tensor.from_numpy(rng.normal(size=(2 * 131072 + 37,)).astype(np.float32)))
        self.small = op.Param.from_tensor(Tensor.from_numpy(rng.normal(size=(3, 5)).astype(np.float32)))


def test_adam_and_sgd_give_the_float32_formula_bit_for_bit_across_update_blocks():
    # NOTE: the oracle is the docstring formula as whole-array numpy expressions in float32 (the
    # optimizers work in place, a cache-sized block at a time: every operation is elementwise and
    # correctly rounded, so the bits must be the formula's)
    rng = np.random.default_rng(11)
    for make in (lambda: Adam(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                 lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.2, nesterov=True)):
        m = _Wide(rng)
        optim = make()
        ref = {p.id: [np.asarray(p.base().to_numpy()).copy(), None, None] for _, p in m.named_params()}
        for t in range(1, 4):
            g = {p.id: rng.normal(size=p.shape).astype(np.float32) for _, p in m.named_params()}
            given = {k: v.copy() for k, v in g.items()}
            m = optim.step(m, Gradients({k: Tensor.from_numpy(v) for k, v in given.items()}))
            for pid, (p, a, b) in ref.items():
                if isinstance(optim, Adam):
                    d = g[pid] + 0.1 * p
                    a = (1 - 0.8) * d if a is None else 0.8 * a + (1 - 0.8) * d
                    b = (d * d) * (1 - 0.99) if b is None else 0.99 * b + (1 - 0.99) * (d * d)
                    p = p - 0.05 * ((a / (1 - 0.8 ** t)) / (np.sqrt(b / (1 - 0.99 ** t)) + 1e-6))
                else:
                    d = g[pid] + 0.01 * p
                    a = d.copy() if a is None else 0.9 * a + (1 - 0.2) * d
                    p = p - 0.1 * (d + 0.9 * a)
                assert p.dtype == np.float32
                ref[pid] = [p, a, b]
                np.testing.assert_array_equal(given[pid], g[pid])  # the caller's gradient is not written
        for _, param in m.named_params():
            np.testing.assert_array_equal(param.base().to_numpy(), ref[param.id][0])


def test_frozen_params_and_params_without_gradients_are_not_updated():
    m = Mlp().freeze_group(op.ParamGroup.from_regex(r"^fc1\."))
    before = _values(m)
    after = _values(SGD(lr=1.0).step(m, _fixed_grads(m)))
    for path in before:
        if path.startswith("fc1."):
            assert after[path].tobytes() == before[path].tobytes()
        else:
            np.testing.assert_allclose(after[path], before[path] - 1.0)
    partial = Gradients({m.fc2.bias.id: Tensor.from_numpy(np.ones(3, dtype=np.float32))})
    after = _values(SGD(lr=1.0).step(m, partial))
    assert after["fc2.weight"].tobytes() == before["fc2.weight"].tobytes()


def test_training_loop_lowers_the_loss():
    m = Mlp()
    x, t = _data()
    optim = Adam(lr=0.02)
    first = float(grad(_loss, m, x, t)[0].to_numpy())
    for _ in range(40):
        loss, grads = grad(_loss, m, x, t)
        m = optim.step(m, grads)
    assert float(loss.to_numpy()) < 0.5 * first


def test_adam_record_names_tensors_by_param_id_and_field(tmp_path):
    m = Mlp()
    optim = Adam(lr=0.01)
    optim.step(m, _fixed_grads(m))
    path = optim.save_file(tmp_path / "optim")
    assert path.name == "optim.bpk"
    with bp.read(path) as f:
        names = set(f.tensors)
        pid = m.fc1.weight.id
        entry = f.tensors[f"{int(pid)}.moment_1"]
        assert entry.param_id == int(pid)
        assert entry.shape == (6, 8) and entry.dtype is DType.F32
        assert f.scalars["step"] == bp.Scalar("Int", 1)
        assert f.scalars[f"{int(pid)}.time"] == bp.Scalar("Int", 1)
        assert f.metadata["optimizer"] == "Adam"
    assert names == {f"{int(p.id)}.{field}" for _, p in m.named_params() for field in ("moment_1", "moment_2")}


@pytest.mark.parametrize("make", [lambda: Adam(lr=0.02, weight_decay=0.01), lambda: SGD(lr=0.1, momentum=0.9)],
                         ids=["adam", "sgd_momentum"])
def test_training_resumes_identically_after_saving_and_loading_state(tmp_path, make):
    x, t = _data(1)
    batches = [(x[i:i + 8], t[i:i + 8]) for i in (0, 8)] * 3
    start = Mlp()

    def train(module, optim, steps):
        for xb, tb in steps:
            _, grads = grad(_loss, module, xb, tb)
            module = optim.step(module, grads)
        return module

    straight = train(start, make(), batches)

    optim = make()
    half = train(start, optim, batches[:3])
    half.save_file(tmp_path / "model.bpk")
    optim.save_file(tmp_path / "optim.bpk")
    del optim, half

    resumed_optim = make().load_file(tmp_path / "optim.bpk")
    assert resumed_optim.step_count == 3
    resumed = train(Mlp().load_file(tmp_path / "model.bpk"), resumed_optim, batches[3:])
    for (path, a), (_, b) in zip(straight.named_params(), resumed.named_params()):
        assert a.id == b.id
        assert np.asarray(a.base().to_numpy()).tobytes() == np.asarray(b.base().to_numpy()).tobytes(), path


def test_loading_state_of_another_optimizer_is_refused(tmp_path):
    m = Mlp()
    optim = Adam(lr=0.01)
    optim.step(m, _fixed_grads(m))
    optim.save_file(tmp_path / "adam.bpk")
    with pytest.raises(op.RecordError, match="holds Adam state; this optimizer is Sgd"):
        SGD(lr=0.1, momentum=0.9).load_file(tmp_path / "adam.bpk")
    m.save_file(tmp_path / "model.bpk")
    with pytest.raises(op.RecordError, match="no 'optimizer' metadata"):
        Adam(lr=0.01).load_file(tmp_path / "model.bpk")


def test_optimizer_arguments_are_checked():
    with pytest.raises(op.OptimizerError, match="betas must lie in") as info:
        Adam(lr=0.1, betas=(1.0, 0.9))
    assert isinstance(info.value, ValueError)  # code catching the builtin keeps working
    with pytest.raises(op.OptimizerError, match="SGD needs lr"):
        SGD(lr=-1.0)


@pytest.mark.parametrize("make", [lambda: SGD(lr=0.1), lambda: Adam(lr=0.01)])
def test_a_step_with_only_gradients_of_another_module_is_refused(make):
    base = Mlp()
    adapted = base.apply_lora(op.LoraConfig(rank=2, seed=0))
    x, t = _data()
    _, grads = grad(_loss, adapted, Tensor.from_numpy(x), Tensor.from_numpy(t))
    assert len(grads) == 4  # the LoRA factors only: base weights are frozen by apply_lora
    optim = make()
    with pytest.raises(op.RecordError, match=r"none of the 4 gradient\(s\) .*'fc1\.weight\.lora\.a'.* is for a "
                                             r"param of the Mlp being stepped \(4 params\).*base module instead of "
                                             r"the LoRA-adapted one") as info:
        optim.step(base, grads)  # the typo: the base module, not the adapted one
    assert isinstance(info.value, ValueError)
    assert optim.step_count == 0 and optim.state == {}
    with pytest.raises(op.RecordError, match=r"none of the 4 gradient\(s\)"):
        optim.step(Mlp(), _fixed_grads(Mlp()))  # another instance: other ids
    # partial overlap stays allowed: the module's params step by the formula, the others are skipped
    m = Mlp()
    before = _values(m)
    mixed = Gradients({**dict(_fixed_grads(m).items()), **dict(grads.items())})
    after = _values(SGD(lr=0.5).step(m, mixed))
    for path in before:
        np.testing.assert_allclose(after[path], before[path] - 0.5, rtol=1e-6)
    unchanged = _values(make().step(m, Gradients({})))  # an empty Gradients is no error
    assert all(unchanged[path].tobytes() == before[path].tobytes() for path in before)


def test_a_gradient_of_another_shape_is_a_shape_mismatch_error():
    m = Mlp()
    bad = Gradients({m.fc2.bias.id: Tensor.from_numpy(np.ones(4, dtype=np.float32))})
    with pytest.raises(op.ShapeMismatchError, match=r"gradient for 'fc2.bias' has shape \[4\], the param \[3\]"):
        SGD(lr=0.1).step(m, bad)
