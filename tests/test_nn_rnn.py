"""Lstm, BiLstm and Gru: Burn's record names, numpy formulas, torch's modules with the same
weights (through the PyTorch layout mappings), gradients against central finite differences,
the exported graph in plain ONNX Runtime, and a small LSTM tagger trained through ORT.

Oracles: the recurrences written out in numpy from the papers (Hochreiter & Schmidhuber 1997;
Cho et al. 2014, both reset placements), ``torch.nn.LSTM`` / ``torch.nn.GRU`` with the same
weights, central differences of the forward loss, and plain ``onnxruntime`` on the export.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxparam as op
from onnxparam import DType, Tensor, nn, ops
from onnxparam.autodiff import cross_entropy, grad
from onnxparam.convert._torch_layers import gru_from_torch, gru_to_torch, lstm_from_torch, lstm_to_torch
from onnxparam.core.errors import RecordError
from onnxparam.optim import Adam

RNG = np.random.default_rng(20)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def record(module) -> dict:
    return {path: p.val().to_numpy() for path, p in module.named_params()}


def with_random_weights(module, dtype=np.float32):
    """``module`` with N(0, 0.5) weights (the default init is fine too; this makes biases count)."""
    values = {path: (RNG.normal(size=p.lazy_shape()) * 0.5).astype(dtype) for path, p in module.named_params()}
    return module.load_record(values)


# -- record names: Burn's, from burn-nn/src/modules/rnn/{gate_controller,lstm,gru}.rs ----------

GATE = ["input_transform.weight", "input_transform.bias", "hidden_transform.weight", "hidden_transform.bias"]
BURN_LSTM_NAMES = [f"{g}.{p}" for g in ("input_gate", "forget_gate", "output_gate", "cell_gate") for p in GATE]
BURN_GRU_NAMES = [f"{g}.{p}" for g in ("update_gate", "reset_gate", "new_gate") for p in GATE]
BURN_BILSTM_NAMES = [f"{d}.{n}" for d in ("forward", "reverse") for n in BURN_LSTM_NAMES]
BURN_BIGRU_NAMES = [f"{d}.{n}" for d in ("forward", "reverse") for n in BURN_GRU_NAMES]


@pytest.mark.parametrize("build, names", [
    (lambda: nn.Lstm(3, 5), BURN_LSTM_NAMES),
    (lambda: nn.Gru(3, 5), BURN_GRU_NAMES),
    (lambda: nn.BiLstm(3, 5), BURN_BILSTM_NAMES),
    (lambda: nn.BiGru(3, 5), BURN_BIGRU_NAMES),
])
def test_recurrent_layers_have_burns_record_names_in_field_order_and_shapes(build, names):
    module = build()
    params = dict(module.named_params())
    assert list(params) == names
    for path, param in params.items():
        d_in = 3 if "input_transform" in path else 5
        want = (d_in, 5) if path.endswith("weight") else (5,)
        assert tuple(param.lazy_shape()) == want, path


def test_lstm_without_bias_has_no_bias_params_and_config_builds_the_same_layer():
    module = nn.LstmConfig(3, 4, bias=False).init("cpu")
    assert [p for p, _ in module.named_params()] == [n for n in BURN_LSTM_NAMES if not n.endswith("bias")]
    assert nn.LstmConfig(3, 4).with_reverse(True).init().reverse is True
    assert nn.GruConfig(3, 4).with_reset_after(False).init().reset_after is False


def test_recurrent_default_init_is_xavier_normal_with_each_linears_fans():
    nn.seed(0)
    module = nn.Lstm(30, 50)
    w = module.cell_gate.input_transform.weight.val().to_numpy()
    u = module.cell_gate.hidden_transform.weight.val().to_numpy()
    # Burn's XavierNormal(gain=1): std = sqrt(2 / (fan_in + fan_out)).
    assert abs(w.std() - np.sqrt(2 / 80)) < 0.1 * np.sqrt(2 / 80)
    assert abs(u.std() - np.sqrt(2 / 100)) < 0.1 * np.sqrt(2 / 100)
    assert abs(w.mean()) < 0.02


# -- numpy oracles --------------------------------------------------------------------------------

def numpy_lstm(rec, x, state=None, reverse=False, clip=None, input_forget=False, prefix=""):
    """The LSTM recurrence on ``x [batch, seq, d]`` with Burn-named weights."""
    def gate(name, xt, h):
        w = lambda k: rec[f"{prefix}{name}.{k}"]  # noqa: E731
        return xt @ w("input_transform.weight") + w("input_transform.bias") + h @ w("hidden_transform.weight") \
            + w("hidden_transform.bias")

    batch, seq, _ = x.shape
    d = rec[f"{prefix}input_gate.hidden_transform.weight"].shape[0]
    c, h = (np.zeros((batch, d)), np.zeros((batch, d))) if state is None else state
    out = np.zeros((batch, seq, d))
    for t in (reversed(range(seq)) if reverse else range(seq)):
        i = sigmoid(gate("input_gate", x[:, t], h))
        f = 1 - i if input_forget else sigmoid(gate("forget_gate", x[:, t], h))
        o = sigmoid(gate("output_gate", x[:, t], h))
        g = np.tanh(gate("cell_gate", x[:, t], h))
        c = f * c + i * g
        if clip is not None:
            c = np.clip(c, -clip, clip)
        h = o * np.tanh(c)
        out[:, t] = h
    return out, c, h


def numpy_gru(rec, x, state=None, reset_after=True):
    def part(name, kind, v):
        return v @ rec[f"{name}.{kind}.weight"] + rec[f"{name}.{kind}.bias"]

    batch, seq, _ = x.shape
    d = rec["update_gate.hidden_transform.weight"].shape[0]
    h = np.zeros((batch, d)) if state is None else state
    out = np.zeros((batch, seq, d))
    for t in range(seq):
        z = sigmoid(part("update_gate", "input_transform", x[:, t]) + part("update_gate", "hidden_transform", h))
        r = sigmoid(part("reset_gate", "input_transform", x[:, t]) + part("reset_gate", "hidden_transform", h))
        if reset_after:
            n = np.tanh(part("new_gate", "input_transform", x[:, t]) + r * part("new_gate", "hidden_transform", h))
        else:
            n = np.tanh(part("new_gate", "input_transform", x[:, t]) + part("new_gate", "hidden_transform", r * h))
        h = (1 - z) * n + z * h
        out[:, t] = h
    return out


class WithState(op.Module):
    """Feeds an explicit initial state (graph inputs) to a recurrent layer."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, x, cell, hidden):
        return self.inner(x, nn.LstmState(cell, hidden))


@pytest.mark.parametrize("options", [{}, {"reverse": True}, {"clip": 0.3}, {"input_forget": True}])
def test_lstm_matches_the_numpy_recurrence(options):
    module = with_random_weights(nn.Lstm(3, 4, **options))
    x = RNG.normal(size=(2, 5, 3)).astype(np.float32)
    out, cell, hidden = module(Tensor.from_numpy(x))
    want_out, want_c, want_h = numpy_lstm(record(module), x, **options)
    np.testing.assert_allclose(out.to_numpy(), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cell.to_numpy(), want_c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hidden.to_numpy(), want_h, rtol=1e-5, atol=1e-5)


def test_lstm_starts_from_a_given_state_and_takes_seq_first_input():
    module = with_random_weights(nn.Lstm(3, 4, batch_first=False))
    x = RNG.normal(size=(5, 2, 3)).astype(np.float32)  # [seq, batch, d_input]
    c0, h0 = (RNG.normal(size=(2, 4)).astype(np.float32) for _ in range(2))
    out, cell, hidden = WithState(module)(*(Tensor.from_numpy(a) for a in (x, c0, h0)))
    want_out, want_c, want_h = numpy_lstm(record(module), x.transpose(1, 0, 2), state=(c0, h0))
    np.testing.assert_allclose(out.to_numpy(), want_out.transpose(1, 0, 2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cell.to_numpy(), want_c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hidden.to_numpy(), want_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reset_after", [True, False])
def test_gru_matches_the_numpy_recurrence_for_both_reset_placements(reset_after):
    module = with_random_weights(nn.Gru(3, 4, reset_after=reset_after))
    x = RNG.normal(size=(2, 6, 3)).astype(np.float32)
    h0 = RNG.normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_allclose(module(Tensor.from_numpy(x)).to_numpy(),
                               numpy_gru(record(module), x, reset_after=reset_after), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(module(Tensor.from_numpy(x), Tensor.from_numpy(h0)).to_numpy(),
                               numpy_gru(record(module), x, h0, reset_after=reset_after), rtol=1e-5, atol=1e-5)


def test_bilstm_concatenates_the_forward_and_reverse_directions():
    module = with_random_weights(nn.BiLstm(3, 4))
    x = RNG.normal(size=(2, 5, 3)).astype(np.float32)
    out, cell, hidden = module(Tensor.from_numpy(x))
    rec = record(module)
    fo, fc, fh = numpy_lstm(rec, x, prefix="forward.")
    ro, rc, rh = numpy_lstm(rec, x, reverse=True, prefix="reverse.")
    np.testing.assert_allclose(out.to_numpy(), np.concatenate([fo, ro], -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cell.to_numpy(), np.stack([fc, rc]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hidden.to_numpy(), np.stack([fh, rh]), rtol=1e-5, atol=1e-5)


# -- torch's modules with the same weights ---------------------------------------------------------

def _torch_state(module) -> dict:
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def test_lstm_loaded_from_a_torch_state_dict_gives_torchs_outputs():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    reference = torch.nn.LSTM(3, 4, batch_first=True)
    module = nn.Lstm(3, 4).load_record(lstm_from_torch(_torch_state(reference)))
    x = RNG.normal(size=(2, 5, 3)).astype(np.float32)
    c0, h0 = (RNG.normal(size=(2, 4)).astype(np.float32) for _ in range(2))
    with torch.no_grad():
        initial = (torch.from_numpy(h0)[None], torch.from_numpy(c0)[None])
        want, (want_h, want_c) = reference(torch.from_numpy(x), initial)
    out, cell, hidden = WithState(module)(*(Tensor.from_numpy(a) for a in (x, c0, h0)))
    np.testing.assert_allclose(out.to_numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cell.to_numpy(), want_c[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hidden.to_numpy(), want_h[0].numpy(), rtol=1e-5, atol=1e-6)
    back = lstm_to_torch(record(module))
    assert set(back) == set(_torch_state(reference))
    for name, value in _torch_state(reference).items():
        np.testing.assert_array_equal(back[name], value)


def test_bidirectional_torch_lstm_maps_to_bilstm():
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    reference = torch.nn.LSTM(3, 4, batch_first=True, bidirectional=True)
    module = nn.BiLstm(3, 4).load_record(lstm_from_torch(_torch_state(reference)))
    x = RNG.normal(size=(2, 6, 3)).astype(np.float32)
    with torch.no_grad():
        want, (want_h, want_c) = reference(torch.from_numpy(x))
    out, cell, hidden = module(Tensor.from_numpy(x))
    np.testing.assert_allclose(out.to_numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cell.to_numpy(), want_c.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hidden.to_numpy(), want_h.numpy(), rtol=1e-5, atol=1e-6)
    assert set(lstm_to_torch(record(module))) == set(_torch_state(reference))


def test_gru_loaded_from_a_torch_state_dict_gives_torchs_outputs():
    torch = pytest.importorskip("torch")
    torch.manual_seed(2)
    reference = torch.nn.GRU(3, 4, batch_first=True)
    module = nn.Gru(3, 4).load_record(gru_from_torch(_torch_state(reference)))
    x = RNG.normal(size=(2, 5, 3)).astype(np.float32)
    h0 = RNG.normal(size=(2, 4)).astype(np.float32)
    with torch.no_grad():
        want, _ = reference(torch.from_numpy(x), torch.from_numpy(h0)[None])
    got = module(Tensor.from_numpy(x), Tensor.from_numpy(h0))
    np.testing.assert_allclose(got.to_numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    back = gru_to_torch(record(module))
    for name, value in _torch_state(reference).items():
        np.testing.assert_array_equal(back[name], value)


def test_torch_mappings_reject_what_burn_cannot_hold():
    torch = pytest.importorskip("torch")
    projected = _torch_state(torch.nn.LSTM(3, 4, proj_size=2))
    with pytest.raises(RecordError, match=r"'weight_hr_l0' is an LSTM projection"):
        lstm_from_torch(projected)
    with pytest.raises(RecordError, match=r"lstm_from_torch: the PyTorch state_dict has no 'weight_hh_l0'"):
        lstm_from_torch({"weight_ih_l0": np.zeros((8, 3))})
    with pytest.raises(RecordError, match=r"'weight_ih_l0' has shape \(7, 3\); expected a first dim divisible by 3"):
        gru_from_torch({"weight_ih_l0": np.zeros((7, 3)), "weight_hh_l0": np.zeros((6, 2))})


# -- gradients: central finite differences --------------------------------------------------------

def _check_module_grad(module, x, extra=(), eps=1e-6):
    out = module(Tensor.from_numpy(x), *[Tensor.from_numpy(a) for a in extra])
    outs = out if isinstance(out, tuple) else (out,)
    weights = [RNG.normal(size=o.shape) for o in outs]

    def loss_fn(m, x, *rest):
        n = len(rest) - len(weights)
        ys = m(x, *rest[:n])
        ys = ys if isinstance(ys, tuple) else (ys,)
        total = None
        for y, r in zip(ys, rest[n:]):
            term = ops.sum(ops.mul(y, r))
            total = term if total is None else ops.add(total, term)
        return total

    args = [x, *extra, *weights]
    _, grads = grad(loss_fn, module, *args)
    base = record(module)
    for path, param in module.named_params():
        # a param the forward never reads (forget_gate with input_forget) gets no gradient: zero
        got = grads[param.id].to_numpy() if param.id in grads else np.zeros_like(base[path])
        want = np.zeros_like(base[path])
        for j in range(base[path].size):
            values = []
            for sign in (1, -1):
                moved = base[path].copy()
                moved.flat[j] += sign * eps
                probe = module.load_record({**base, path: moved})
                values.append(float(grad(loss_fn, probe, *args)[0].to_numpy()))
            want.flat[j] = (values[0] - values[1]) / (2 * eps)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8, err_msg=path)


def test_lstm_gradients_match_finite_differences():
    module = with_random_weights(nn.Lstm(2, 2, clip=0.8, dtype=DType.F64), np.float64)
    _check_module_grad(module, RNG.normal(size=(2, 3, 2)))


def test_lstm_gradients_with_an_initial_state_match_finite_differences():
    module = WithState(with_random_weights(nn.Lstm(2, 2, reverse=True, dtype=DType.F64), np.float64))
    _check_module_grad(module, RNG.normal(size=(1, 3, 2)), extra=[RNG.normal(size=(1, 2)), RNG.normal(size=(1, 2))])


@pytest.mark.parametrize("reset_after", [True, False])
def test_gru_gradients_match_finite_differences(reset_after):
    module = with_random_weights(nn.Gru(2, 2, reset_after=reset_after, dtype=DType.F64), np.float64)
    _check_module_grad(module, RNG.normal(size=(2, 3, 2)), extra=[RNG.normal(size=(2, 2))])


# -- export, training ------------------------------------------------------------------------------

def test_exported_bilstm_runs_in_plain_onnxruntime_for_any_batch_size(tmp_path):
    module = with_random_weights(nn.BiLstm(3, 4))
    x = RNG.normal(size=(2, 5, 3)).astype(np.float32)
    path = op.export_onnx(module, tmp_path / "bilstm.onnx", Tensor.from_numpy(x), dynamic_axes={"x": {0: "batch"}})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (2, 3):
        xb = RNG.normal(size=(batch, 5, 3)).astype(np.float32)
        got = session.run(None, {session.get_inputs()[0].name: xb})
        want = module(Tensor.from_numpy(xb))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.to_numpy(), rtol=1e-6, atol=1e-6)


class Tagger(op.Module):
    """A small LSTM tagger: embedding -> Lstm -> per-token Linear."""

    def __init__(self, vocab=12, d_model=8, d_hidden=8, tags=3):
        self.embedding = nn.Embedding(vocab, d_model)
        self.lstm = nn.Lstm(d_model, d_hidden)
        self.head = nn.Linear(d_hidden, tags)

    def forward(self, tokens):
        out, _, _ = self.lstm(self.embedding(tokens))
        return self.head(out)


def test_lstm_tagger_trains_through_ort_and_its_export_gives_the_same_outputs(tmp_path):
    nn.seed(5)
    tokens = RNG.integers(0, 12, size=(4, 6)).astype(np.int64)
    tags = tokens % 3  # a learnable tagging: the tag is a function of the token

    def loss_fn(m, tokens, tags):
        logits = m(tokens)
        return cross_entropy(ops.reshape(logits, [-1, 3]), ops.reshape(tags, [-1]))

    model, opt, losses = Tagger(), Adam(lr=0.05), []
    for _ in range(8):
        loss, grads = grad(loss_fn, model, tokens, tags)
        losses.append(float(loss.to_numpy()))
        model = opt.step(model, grads)
    assert losses[-1] < 0.7 * losses[0]
    path = op.export_onnx(model, tmp_path / "tagger.onnx", Tensor.from_numpy(tokens))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: tokens})[0]
    np.testing.assert_allclose(got, model(Tensor.from_numpy(tokens)).to_numpy(), rtol=1e-6, atol=1e-6)
    # The trained weights recompute the same logits in numpy.
    rec = record(model)
    emb = rec["embedding.weight"][tokens]
    lstm_rec = {k[len("lstm."):]: v for k, v in rec.items() if k.startswith("lstm.")}
    want = numpy_lstm(lstm_rec, emb)[0] @ rec["head.weight"] + rec["head.bias"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, x_shape, message", [
    (lambda: nn.Lstm(3, 4), (2, 5), r"Lstm expects a rank-3 input \[batch, seq, d_input\]; got shape \[2, 5\]"),
    (lambda: nn.Lstm(3, 4), (2, 5, 7), r"Lstm expects d_input=3 features in the last dim; got shape \[2, 5, 7\]"),
    (lambda: nn.Gru(3, 4), (2, 5, 2), r"Gru expects d_input=3 features"),
])
def test_recurrent_layers_reject_mis_shaped_input(build, x_shape, message):
    with pytest.raises(op.TraceError, match=message):
        build()(Tensor.from_numpy(np.zeros(x_shape, np.float32)))


@pytest.mark.parametrize("build, message", [
    (lambda: nn.Lstm(3, 0), "d_hidden must be a positive integer; got 0"),
    (lambda: nn.Lstm(3, 4, gate_activation="swish"), r"gate_activation must be one of \['relu', 'sigmoid', 'tanh'\]"),
    (lambda: nn.Gru(3, 4, clip=-1.0), "clip must be a positive number or None; got -1.0"),
    (lambda: nn.BiLstm(3, 4, dtype=DType.I64), "Lstm params must have a plain float dtype"),
])
def test_recurrent_configurations_raise_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_bilstm_with_an_initial_state_matches_torch_and_round_trips_through_burnpack(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    reference = torch.nn.LSTM(3, 4, batch_first=True, bidirectional=True)
    module = nn.BiLstm(3, 4).load_record(lstm_from_torch(_torch_state(reference)))
    x = RNG.normal(size=(2, 4, 3)).astype(np.float32)
    c0, h0 = (RNG.normal(size=(2, 2, 4)).astype(np.float32) for _ in range(2))  # [direction, batch, d_hidden]
    with torch.no_grad():
        want, (want_h, want_c) = reference(torch.from_numpy(x), (torch.from_numpy(h0), torch.from_numpy(c0)))
    out, cell, hidden = WithState(module)(*(Tensor.from_numpy(a) for a in (x, c0, h0)))
    np.testing.assert_allclose(out.to_numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cell.to_numpy(), want_c.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hidden.to_numpy(), want_h.numpy(), rtol=1e-5, atol=1e-6)
    module.save_file(tmp_path / "bilstm")
    loaded = nn.BiLstm(3, 4).load_file(tmp_path / "bilstm.bpk")
    assert [p for p, _ in loaded.named_params()] == BURN_BILSTM_NAMES
    xt = Tensor.from_numpy(x)
    np.testing.assert_array_equal(loaded(xt)[0].to_numpy(), module(xt)[0].to_numpy())


def test_gru_reproduces_burns_unit_test_values():
    # Burn's gru.rs tests_forward_seq_len_3: d_input = d_hidden = 1, no bias, every gate's input
    # and hidden weights 0.5 (update), 0.6 (reset), 0.7 (new); the same values for both resets.
    for reset_after in (True, False):
        module = nn.Gru(1, 1, bias=False, reset_after=reset_after)
        weights = {"update_gate": 0.5, "reset_gate": 0.6, "new_gate": 0.7}
        module = module.load_record({f"{g}.{k}.weight": np.array([[w]], np.float32)
                                     for g, w in weights.items() for k in ("input_transform", "hidden_transform")})
        got = module(Tensor.from_numpy(np.array([[[0.1], [0.2], [0.3]]], np.float32))).to_numpy()
        np.testing.assert_allclose(got[0, :, 0], [0.0341, 0.0894, 0.1575], atol=1e-4)


def test_bigru_loaded_from_a_bidirectional_torch_gru_gives_torchs_outputs():
    torch = pytest.importorskip("torch")
    torch.manual_seed(4)
    reference = torch.nn.GRU(3, 4, batch_first=False, bidirectional=True)
    module = nn.BiGru(3, 4, batch_first=False).load_record(gru_from_torch(_torch_state(reference)))
    x = RNG.normal(size=(5, 2, 3)).astype(np.float32)  # [seq, batch, d_input]
    h0 = RNG.normal(size=(2, 2, 4)).astype(np.float32)
    for state in (None, h0):
        with torch.no_grad():
            want, want_h = reference(torch.from_numpy(x), None if state is None else torch.from_numpy(state))
        args = [Tensor.from_numpy(x)] + ([] if state is None else [Tensor.from_numpy(state)])
        out, hidden = module(*args)
        np.testing.assert_allclose(out.to_numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(hidden.to_numpy(), want_h.numpy(), rtol=1e-5, atol=1e-6)
    back = gru_to_torch(record(module))
    for name, value in _torch_state(reference).items():
        np.testing.assert_array_equal(back[name], value)


def test_bigru_gradients_match_finite_differences():
    module = with_random_weights(nn.BiGru(2, 2, dtype=DType.F64), np.float64)
    _check_module_grad(module, RNG.normal(size=(1, 3, 2)), extra=[RNG.normal(size=(2, 1, 2))])


@pytest.mark.parametrize("name, build", [
    ("gru", lambda: nn.Gru(3, 4, reset_after=False)),
    ("bigru", lambda: nn.BiGru(3, 4)),
    ("lstm", lambda: nn.Lstm(3, 4, batch_first=False, clip=0.5)),
])
def test_exported_recurrent_layers_run_in_plain_onnxruntime(tmp_path, name, build):
    module = with_random_weights(build())
    x = RNG.normal(size=(5, 2, 3)).astype(np.float32)
    path = op.export_onnx(module, tmp_path / f"{name}.onnx", Tensor.from_numpy(x), dynamic_batch=False)  # dim 0: the static sequence
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x})
    want = module(Tensor.from_numpy(x))
    for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
        np.testing.assert_allclose(g, w.to_numpy(), rtol=1e-6, atol=1e-6)


# -- onnx_op=True: ONNX's own LSTM / GRU operators ---------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"reverse": True}, {"input_forget": True}, {"batch_first": False}])
def test_lstm_as_onnxs_lstm_operator_matches_the_numpy_recurrence(options, tmp_path):
    module = with_random_weights(nn.Lstm(3, 4, onnx_op=True, **options))
    x = RNG.normal(size=(2, 5, 3) if options.get("batch_first", True) else (5, 2, 3)).astype(np.float32)
    c0, h0 = (RNG.normal(size=(2, 4)).astype(np.float32) for _ in range(2))
    out, cell, hidden = WithState(module)(*(Tensor.from_numpy(a) for a in (x, c0, h0)))
    xb = x if options.get("batch_first", True) else x.transpose(1, 0, 2)
    rec = record(module)
    want_out, want_c, want_h = numpy_lstm(rec, xb, state=(c0, h0), reverse=options.get("reverse", False),
                                          input_forget=options.get("input_forget", False))
    if not options.get("batch_first", True):
        want_out = want_out.transpose(1, 0, 2)
    np.testing.assert_allclose(out.to_numpy(), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cell.to_numpy(), want_c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hidden.to_numpy(), want_h, rtol=1e-5, atol=1e-5)
    path = op.export_onnx(module, tmp_path / "lstm.onnx", Tensor.from_numpy(x), dynamic_batch=False)
    assert [n.op_type for n in onnx.load(str(path)).graph.node].count("LSTM") == 1
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x})[0],
                               module(Tensor.from_numpy(x))[0].to_numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reset_after", [True, False])
def test_gru_and_bigru_as_onnxs_gru_operator_match_the_numpy_recurrence(reset_after):
    module = with_random_weights(nn.Gru(3, 4, reset_after=reset_after, onnx_op=True))
    x = RNG.normal(size=(2, 5, 3)).astype(np.float32)
    h0 = RNG.normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_allclose(module(Tensor.from_numpy(x), Tensor.from_numpy(h0)).to_numpy(),
                               numpy_gru(record(module), x, h0, reset_after=reset_after), rtol=1e-5, atol=1e-5)
    unrolled = with_random_weights(nn.BiGru(3, 4, reset_after=reset_after))
    fused = nn.BiGru(3, 4, reset_after=reset_after, onnx_op=True).load_record(record(unrolled))
    for a, b in zip(unrolled(Tensor.from_numpy(x)), fused(Tensor.from_numpy(x))):
        np.testing.assert_allclose(b.to_numpy(), a.to_numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer", ["lstm", "bigru_reset_after", "gru"])
def test_onnx_op_layers_train_with_the_gradients_of_the_unrolled_recurrence(layer):
    # oracle: the unrolled layers (elementwise rules, checked against finite differences above)
    make = {"lstm": lambda **k: nn.Lstm(3, 4, **k),
            "bigru_reset_after": lambda **k: nn.BiGru(3, 4, reset_after=True, **k),
            "gru": lambda **k: nn.Gru(3, 4, reset_after=False, **k)}[layer]
    unrolled = with_random_weights(make())
    fused = make(onnx_op=True).load_record(record(unrolled))
    x = RNG.normal(size=(2, 5, 3)).astype(np.float32)
    weights = RNG.normal(size=(2, 5, 8 if layer.startswith("bi") else 4)).astype(np.float32)

    def loss_fn(m, x):
        out = m(x)
        out = out[0] if isinstance(out, tuple) else out
        return ops.sum(out * Tensor.from_numpy(weights))

    _, want = grad(loss_fn, unrolled, Tensor.from_numpy(x))
    _, got = grad(loss_fn, fused, Tensor.from_numpy(x))
    want, got = want.by_path(), got.by_path()
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_allclose(got[path].to_numpy(), want[path].to_numpy(), rtol=1e-4, atol=1e-5, err_msg=path)


def test_onnx_op_layers_have_no_state_clip():
    with pytest.raises(ValueError, match=r"Lstm\(onnx_op=True\) cannot clip"):
        nn.Lstm(2, 2, clip=1.0, onnx_op=True)
    with pytest.raises(ValueError, match=r"Gru\(onnx_op=True\) cannot clip"):
        nn.GruConfig(2, 2).with_clip(0.5).with_onnx_op(True).init()


def test_a_torch_lstm_tagger_state_dict_loads_into_the_same_tagger_and_gives_torchs_logits():
    torch = pytest.importorskip("torch")
    from onnxparam.convert._torch_layers import torch_state_dict_to_record

    class TorchTagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(12, 8)
            self.lstm = torch.nn.LSTM(8, 8, batch_first=True)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, tokens):
            return self.head(self.lstm(self.embedding(tokens))[0])

    torch.manual_seed(6)
    reference = TorchTagger().eval()
    model = Tagger().load_record(torch_state_dict_to_record(Tagger(), _torch_state(reference)))
    tokens = RNG.integers(0, 12, size=(3, 7)).astype(np.int64)
    with torch.no_grad():
        want = reference(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(model(Tensor.from_numpy(tokens)).to_numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RecordError, match=r"1 PyTorch tensor\(s\) match no param of Tagger") as info:
        torch_state_dict_to_record(Tagger(), {**_torch_state(reference), "extra.weight": np.zeros(2)})
    assert "unexpected 'extra.weight' (2,)" in str(info.value)


def test_bilstm_gradients_with_an_initial_state_match_finite_differences():
    module = WithState(with_random_weights(nn.BiLstm(2, 2, input_forget=True, dtype=DType.F64), np.float64))
    state = [RNG.normal(size=(2, 1, 2)), RNG.normal(size=(2, 1, 2))]
    _check_module_grad(module, RNG.normal(size=(1, 3, 2)), extra=state)


def test_bidirectional_configs_hold_burns_fields_in_order_with_their_defaults_and_build_their_layers():
    import dataclasses

    bilstm = [(f.name, f.default) for f in dataclasses.fields(nn.BiLstmConfig)]
    assert bilstm == [("d_input", dataclasses.MISSING), ("d_hidden", dataclasses.MISSING), ("bias", True),
                      ("initializer", nn.Initializer.XavierNormal(gain=1.0)), ("batch_first", True), ("clip", None),
                      ("input_forget", False), ("gate_activation", "sigmoid"), ("cell_activation", "tanh"),
                      ("hidden_activation", "tanh"), ("onnx_op", False)]
    bigru = [(f.name, f.default) for f in dataclasses.fields(nn.BiGruConfig)]
    assert bigru == [("d_input", dataclasses.MISSING), ("d_hidden", dataclasses.MISSING), ("bias", True),
                     ("reset_after", True), ("initializer", nn.Initializer.XavierNormal(gain=1.0)), ("batch_first", True),
                     ("gate_activation", "sigmoid"), ("hidden_activation", "tanh"), ("clip", None),
                     ("onnx_op", False)]
    config = nn.BiLstmConfig(4, 3).with_clip(2.0).with_batch_first(False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.clip = 1.0
    layer = config.init(dtype=DType.F64)
    assert isinstance(layer, nn.BiLstm) and not layer.batch_first and layer.reverse.clip == 2.0
    assert layer.forward_lstm.clip == 2.0 and layer.reverse.reverse and layer.d_hidden == 3
    assert layer.reverse.input_gate.input_transform.weight.lazy_dtype() is DType.F64
    gru = nn.BiGruConfig(4, 3, reset_after=False, batch_first=False).init()
    assert isinstance(gru, nn.BiGru) and not gru.batch_first and not gru.forward_gru.reset_after
    assert repr(nn.BiGruConfig(2, 5)).startswith("BiGruConfig(d_input=2, d_hidden=5, bias=True, reset_after=True")
