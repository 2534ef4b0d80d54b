"""Reproducible training-mode dropout under ``onnxparam.nn.seed``, and training-mode tests of the
transformer layers with dropout on.

Oracles: the same seed replayed (within one process and in two fresh processes), a plain ONNX
Runtime session on the exported training-mode graph, the dropout-free model (``valid()`` and
``dropout=0``), and central finite differences of a train-mode encoder layer with its masks held
fixed by reseeding before every evaluation.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from nn_layer_checks import tensor

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.autodiff import cross_entropy, grad, mse
from onnxparam.optim import Adam

RNG = np.random.default_rng(20)
X = np.ones((4, 16), np.float32)


def _masks(seed_value, calls=3, prob=0.5):
    nn.seed(seed_value)
    layer = nn.Dropout(prob).train()
    return [layer(tensor(X)).to_numpy() for _ in range(calls)]


def test_seeded_dropout_masks_repeat_run_after_run_and_change_step_by_step():
    first, again = _masks(7), _masks(7)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    assert all(set(np.unique(m)) <= {0.0, 2.0} for m in first)
    other = _masks(8)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_dropout_seeds_do_not_move_the_param_draws():
    nn.seed(0)
    plain = nn.Linear(16, 4).weight.val().to_numpy()
    nn.seed(0)
    nn.Dropout(0.5).train()(tensor(X))  # draws a dropout seed first
    with_dropout = nn.Linear(16, 4).weight.val().to_numpy()
    np.testing.assert_array_equal(plain, with_dropout)


def test_the_seed_is_an_attribute_of_the_exported_training_graph_and_plain_ort_replays_the_masks(tmp_path):
    layer = nn.Dropout(0.3).train()
    nn.seed(11)
    path = op.export_onnx(layer, tmp_path / "dropout.onnx", tensor(X))
    (node,) = [n for n in onnx.load(str(path)).graph.node if n.op_type == "RandomUniformLike"]
    assert [a.name for a in node.attribute] == ["seed"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    from_file = [session.run(None, {name: X})[0] for _ in range(2)]
    nn.seed(11)
    from_module = [layer(tensor(X)).to_numpy() for _ in range(2)]
    for a, b in zip(from_file, from_module):
        np.testing.assert_array_equal(a, b)


_SCRIPT = textwrap.dedent("""
    import numpy as np
    from onnxparam import Tensor, nn
    nn.seed(5)
    layer = nn.Dropout(0.5).train()
    x = Tensor.from_numpy(np.ones((3, 8), np.float32))
    print("".join("1" if v else "0" for _ in range(2) for v in layer(x).to_numpy().ravel()))
""")


def test_seeded_masks_are_the_same_in_two_fresh_processes():
    # the two processes run at the same time (each mostly imports): half the wall time of one after the other
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, err
        outs.append(out.strip())
    assert outs[0] == outs[1] and len(outs[0]) == 48 and "0" in outs[0] and "1" in outs[0]


# -- transformer layers in training mode ------------------------------------------------------------


class Classifier(op.Module):
    def __init__(self, dropout=0.2, vocab=10, d_model=8):
        self.embedding = nn.Embedding(vocab, d_model)
        self.positions = nn.PositionalEncoding(d_model, max_sequence_size=16)
        self.encoder = nn.TransformerEncoder(d_model, 16, 2, 2, dropout=dropout)
        self.head = nn.Linear(d_model, 2)

    def forward(self, tokens, mask_pad):
        h = self.encoder(self.positions(self.embedding(tokens)), mask_pad)
        return self.head(ops.mean(h, 1))


TOKENS = RNG.integers(0, 10, size=(6, 5)).astype(np.int64)
LABELS = (TOKENS[:, 0] >= 5).astype(np.int64)
PAD = np.zeros((6, 5), bool)
PAD[::2, 4] = True


def _classifier_loss(m, tokens, pad, labels):
    return cross_entropy(m(tokens, pad), labels)


def _weights() -> dict:
    nn.seed(0)
    return {path: p.val().to_numpy() for path, p in Classifier().named_params()}


WEIGHTS = _weights()


def _train(seed_value, dropout=0.2, steps=4):
    """Train from the same initial weights; only the dropout stream depends on ``seed_value``."""
    nn.seed(seed_value)
    model, opt, losses = Classifier(dropout).load_record(WEIGHTS).train(), Adam(lr=0.02), []
    for _ in range(steps):
        loss, grads = grad(_classifier_loss, model, TOKENS, PAD, LABELS)
        losses.append(float(loss.to_numpy()))
        model = opt.step(model, grads)
    return model, losses


def test_training_a_transformer_encoder_with_dropout_is_reproducible_under_a_seed():
    model, losses = _train(3)
    again_model, again = _train(3)
    assert losses == again
    for (path, a), (_, b) in zip(model.named_params(), again_model.named_params()):
        np.testing.assert_array_equal(a.val().to_numpy(), b.val().to_numpy(), err_msg=path)
    _, other = _train(4)
    assert other != losses  # the same weights, another dropout stream
    assert _train(3, dropout=0.0)[1] == _train(4, dropout=0.0)[1]  # no dropout: the seed plays no part
    # in valid mode the trained model is its dropout-free twin
    twin = Classifier(0.0).load_record({path: p.val().to_numpy() for path, p in model.named_params()})
    np.testing.assert_allclose(model.valid()(tensor(TOKENS), tensor(PAD)).to_numpy(),
                               twin(tensor(TOKENS), tensor(PAD)).to_numpy(), rtol=1e-6, atol=1e-6)


def test_train_mode_dropout_changes_the_encoder_output_and_dropout_zero_does_not():
    nn.seed(1)
    model = Classifier(0.3)
    valid = model(tensor(TOKENS), tensor(PAD)).to_numpy()
    trained = model.train()
    runs = [trained(tensor(TOKENS), tensor(PAD)).to_numpy() for _ in range(2)]
    assert not np.allclose(runs[0], valid) and not np.allclose(runs[0], runs[1])
    nn.seed(1)
    no_dropout = Classifier(0.0)
    np.testing.assert_allclose(no_dropout.train()(tensor(TOKENS), tensor(PAD)).to_numpy(),
                               no_dropout(tensor(TOKENS), tensor(PAD)).to_numpy(), rtol=1e-6, atol=1e-6)


def _layer_loss(m, x, target):
    return mse(m(x), target)


def test_train_mode_encoder_layer_gradients_match_finite_differences_with_the_masks_held():
    nn.seed(2)
    base = nn.TransformerEncoder(8, 12, 2, 1, dropout=0.25)
    x = RNG.normal(size=(2, 3, 8)).astype(np.float32)
    target = RNG.normal(size=(2, 3, 8)).astype(np.float32)
    record = {p: v.val().to_numpy() for p, v in base.named_params()}
    layer = base.load_record(record).train()

    def loss_at(module):
        nn.seed(99)  # the same first masks on every evaluation
        return grad(_layer_loss, module, x, target)

    loss, grads = loss_at(layer)
    assert float(loss.to_numpy()) != pytest.approx(float(grad(_layer_loss, layer.valid(), x, target)[0].to_numpy()))
    params = dict(layer.named_params())
    checked = 0
    for path in ("layers.0.mha.query.weight", "layers.0.pwff.linear_inner.weight", "layers.0.norm_2.gamma"):
        if path not in params:
            continue
        value = params[path].val().to_numpy()
        g = grads[params[path].id].to_numpy()
        for j in RNG.choice(value.size, size=2, replace=False):
            probes = []
            for sign in (1, -1):
                moved = value.copy()
                moved.flat[j] += sign * 1e-2
                probe = base.load_record({**record, path: moved}).train()
                probes.append(float(loss_at(probe)[0].to_numpy()))
            want = (probes[0] - probes[1]) / 2e-2
            assert g.flat[j] == pytest.approx(want, rel=3e-2, abs=3e-3), path
            checked += 1
    assert checked >= 4


# -- RRelu (Burn's activation/rrelu.rs) ---------------------------------------------------------------


def test_rrelu_in_valid_mode_is_leaky_relu_with_the_midpoint_slope_as_burns_test_and_torch():
    layer = nn.RReluConfig().with_lower(0.1).with_upper(0.3).init()
    x = np.array([[-2.0, -1.0, 0.0], [0.5, 1.0, 2.0]], np.float32)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), [[-0.4, -0.2, 0.0], [0.5, 1.0, 2.0]], rtol=1e-6)
    cfg = nn.RReluConfig()
    assert (cfg.lower, cfg.upper) == (0.125, 1.0 / 3.0)
    assert list(nn.RRelu().named_params()) == []
    with pytest.raises(ValueError, match="upper bound"):
        nn.RReluConfig(0.5, 0.2).init()
    torch = pytest.importorskip("torch")
    z = RNG.normal(size=(3, 7)).astype(np.float32)
    ref = torch.nn.RReLU(0.125, 1.0 / 3.0).eval()(torch.from_numpy(z)).numpy()
    np.testing.assert_allclose(nn.RRelu()(tensor(z)).to_numpy(), ref, rtol=1e-6, atol=1e-7)


def _holder_sum(m):
    return ops.sum(m())


def test_training_rrelu_draws_slopes_in_range_reproducibly_and_its_gradient_is_the_slope():
    x = RNG.normal(size=(20, 30)).astype(np.float32)
    nn.seed(4)
    layer = nn.RRelu(0.1, 0.3).train()
    y1, y2 = layer(tensor(x)).to_numpy(), layer(tensor(x)).to_numpy()
    neg = x < 0
    np.testing.assert_array_equal(y1[~neg], x[~neg])  # positives pass through
    slopes = y1[neg] / x[neg]
    assert slopes.min() >= 0.1 - 1e-6 and slopes.max() < 0.3 + 1e-6 and slopes.std() > 0.03
    assert not np.array_equal(y1, y2)  # new slopes at every run
    nn.seed(4)
    np.testing.assert_array_equal(nn.RRelu(0.1, 0.3).train()(tensor(x)).to_numpy(), y1)

    class Holder(op.Module):
        def __init__(self):
            self.x = op.Param.initialized(op.ParamId(), tensor(x))
            self.act = nn.RRelu(0.1, 0.3)

        def forward(self):
            return self.act(self.x.val())

    holder = Holder().train()
    loss, grads = grad(_holder_sum, holder)
    g = grads[holder.x.id].to_numpy()
    np.testing.assert_array_equal(g[~neg], 1.0)
    assert g[neg].min() >= 0.1 - 1e-6 and g[neg].max() < 0.3 + 1e-6
    # forward and backward share the slopes: the loss is sum(x * dloss/dx)
    assert float(loss.to_numpy()) == pytest.approx(float((x * g).sum()), rel=1e-5)


def test_training_rrelu_exports_with_its_seed_and_plain_ort_replays_it(tmp_path):
    layer = nn.RRelu().train()
    x = RNG.normal(size=(4, 6)).astype(np.float32)
    nn.seed(21)
    path = op.export_onnx(layer, tmp_path / "rrelu.onnx", tensor(x))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    nn.seed(21)
    np.testing.assert_array_equal(got, layer(tensor(x)).to_numpy())
    valid_path = op.export_onnx(layer.valid(), tmp_path / "rrelu_valid.onnx", tensor(x))
    assert [n.op_type for n in onnx.load(str(valid_path)).graph.node] == ["LeakyRelu"]
