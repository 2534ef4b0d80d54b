"""MultiHeadAttention, CrossAttention, PositionWiseFeedForward, TransformerEncoder/Decoder,
PositionalEncoding and RotaryEncoding: Burn's record names, numpy formulas (Vaswani et al.
2017; RoFormer), values from Burn's own unit tests, torch's modules with the same weights
(through :mod:`onnxparam.convert._torch_layers`), gradients against central finite
differences, the exported graph in plain ONNX Runtime, and a small encoder trained through ORT.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest

import onnxparam as op
from onnxparam import DType, Tensor, nn, ops
from onnxparam.autodiff import cross_entropy, grad
from onnxparam.convert._torch_layers import (
    mha_from_torch,
    mha_to_torch,
    transformer_decoder_layer_from_torch,
    transformer_encoder_layer_from_torch,
    transformer_encoder_layer_to_torch,
)
from onnxparam.core.errors import RecordError
from onnxparam.optim import Adam

RNG = np.random.default_rng(2017)


def record(module) -> dict:
    return {path: p.val().to_numpy() for path, p in module.named_params()}


def randomized(module, dtype=np.float32, scale=0.5):
    values = {path: (RNG.normal(size=p.lazy_shape()) * scale).astype(dtype) for path, p in module.named_params()}
    return module.load_record(values)


def t(a) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a))


# -- record names: Burn's, from burn-nn/src/modules/{attention,transformer}/*.rs --------------------

LINEAR = ["weight", "bias"]
BURN_MHA = [f"{n}.{p}" for n in ("query", "key", "value", "output") for p in LINEAR]
BURN_PWFF = [f"{n}.{p}" for n in ("linear_inner", "linear_outer") for p in LINEAR]
BURN_ENCODER_LAYER = ([f"mha.{n}" for n in BURN_MHA] + [f"pwff.{n}" for n in BURN_PWFF]
                      + ["norm_1.gamma", "norm_1.beta", "norm_2.gamma", "norm_2.beta"])
BURN_DECODER_LAYER = ([f"cross_attn.{n}" for n in BURN_MHA] + [f"self_attn.{n}" for n in BURN_MHA]
                      + [f"pwff.{n}" for n in BURN_PWFF]
                      + [f"norm_{i}.{p}" for i in (1, 2, 3) for p in ("gamma", "beta")])


@pytest.mark.parametrize("build, names, shapes", [
    (lambda: nn.MultiHeadAttention(8, 2), BURN_MHA, {"query.weight": (8, 8), "output.bias": (8,)}),
    (lambda: nn.CrossAttention(8, 6, 4, 2, 3), BURN_MHA,
     {"query.weight": (8, 12), "key.weight": (6, 6), "value.bias": (6,), "output.weight": (12, 8)}),
    (lambda: nn.PositionWiseFeedForward(8, 16), BURN_PWFF,
     {"linear_inner.weight": (8, 16), "linear_outer.weight": (16, 8)}),
    (lambda: nn.TransformerEncoder(8, 16, 2, 2), [f"layers.{i}.{n}" for i in (0, 1) for n in BURN_ENCODER_LAYER],
     {"layers.1.norm_2.gamma": (8,)}),
    (lambda: nn.TransformerDecoder(8, 16, 2, 1), [f"layers.0.{n}" for n in BURN_DECODER_LAYER],
     {"layers.0.cross_attn.key.weight": (8, 8)}),
    (lambda: nn.PositionalEncoding(8), [], {}),
    (lambda: nn.RotaryEncoding(16, 8), [], {}),
])
def test_attention_layers_have_burns_record_names_and_shapes(build, names, shapes):
    params = dict(build().named_params())
    assert list(params) == names
    for path, shape in shapes.items():
        assert tuple(params[path].lazy_shape()) == shape


def test_mha_without_biases_and_configs_build_the_same_layer():
    cfg = nn.MultiHeadAttentionConfig(8, 2).with_enable_key_bias(False).with_quiet_softmax(True)
    module = cfg.init("cpu")
    assert "key.bias" not in dict(module.named_params()) and module.quiet_softmax
    assert nn.TransformerEncoderConfig(8, 16, 2, 3).with_norm_first(True).init().layers[2].norm_first


# -- numpy oracles ------------------------------------------------------------------------------------

def softmax(s, quiet=False):
    e = np.exp(s - s.max(-1, keepdims=True))
    extra = np.exp(-s.max(-1, keepdims=True)) if quiet else 0.0
    return e / (e.sum(-1, keepdims=True) + extra)


def numpy_mha(rec, q, k, v, n_heads, mask_pad=None, mask_attn=None, quiet=False, prefix=""):
    def lin(name, x):
        return x @ rec[f"{prefix}{name}.weight"] + rec[f"{prefix}{name}.bias"]

    def heads(x):
        b, s, d = x.shape
        return x.reshape(b, s, n_heads, d // n_heads).transpose(0, 2, 1, 3)

    qh, kh, vh = heads(lin("query", q)), heads(lin("key", k)), heads(lin("value", v))
    scores = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(qh.shape[-1])
    if mask_pad is not None:
        scores = np.where(mask_pad[:, None, None, :], -1e4, scores)
    if mask_attn is not None:
        scores = np.where(mask_attn[:, None], -1e4, scores)
    w = softmax(scores, quiet)
    ctx = (w @ vh).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], -1)
    return lin("output", ctx), w


@pytest.mark.parametrize("quiet", [False, True])
def test_mha_matches_the_numpy_formula_with_both_masks(quiet):
    module = randomized(nn.MultiHeadAttention(8, 2, quiet_softmax=quiet))
    q, kv = RNG.normal(size=(2, 4, 8)).astype(np.float32), RNG.normal(size=(2, 5, 8)).astype(np.float32)
    pad = np.zeros((2, 5), bool)
    pad[1, 3:] = True
    attn = RNG.random((2, 4, 5)) < 0.3
    ctx, weights = module(t(q), t(kv), t(kv), t(pad), t(attn))
    want_ctx, want_w = numpy_mha(record(module), q, kv, kv, 2, pad, attn, quiet)
    np.testing.assert_allclose(ctx.to_numpy(), want_ctx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weights.to_numpy(), want_w, rtol=1e-5, atol=1e-6)
    if quiet:  # the weights may sum to less than one
        assert (weights.to_numpy().sum(-1) < 1).all()


def test_cross_attention_with_grouped_kv_heads_matches_the_numpy_formula():
    module = randomized(nn.CrossAttention(8, 6, n_heads=4, n_heads_kv=2, d_head=3))
    q, ctx = RNG.normal(size=(2, 4, 8)).astype(np.float32), RNG.normal(size=(2, 5, 6)).astype(np.float32)
    mask = np.zeros((2, 5), bool)
    mask[0, 4] = True
    rec = record(module)

    def heads(x, n):
        return x.reshape(x.shape[0], x.shape[1], n, 3).transpose(0, 2, 1, 3)

    qh = heads(q @ rec["query.weight"] + rec["query.bias"], 4)
    kh = np.repeat(heads(ctx @ rec["key.weight"] + rec["key.bias"], 2), 2, axis=1)  # kv head j serves 2j, 2j+1
    vh = np.repeat(heads(ctx @ rec["value.weight"] + rec["value.bias"], 2), 2, axis=1)
    scores = np.where(mask[:, None, None], -1e4, qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(3))
    want = (softmax(scores) @ vh).transpose(0, 2, 1, 3).reshape(2, 4, 12) @ rec["output.weight"] + rec["output.bias"]
    np.testing.assert_allclose(module(t(q), t(ctx), t(mask)).to_numpy(), want, rtol=1e-5, atol=1e-5)


def test_position_wise_feed_forward_is_gelu_between_two_linears():
    module = randomized(nn.PositionWiseFeedForward(4, 6))
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    rec = record(module)
    erf = np.vectorize(math.erf)
    h = x @ rec["linear_inner.weight"] + rec["linear_inner.bias"]
    want = (0.5 * h * (1 + erf(h / math.sqrt(2)))) @ rec["linear_outer.weight"] + rec["linear_outer.bias"]
    np.testing.assert_allclose(module(t(x)).to_numpy(), want, rtol=1e-5, atol=1e-5)


def test_positional_encoding_adds_burns_sinusoids():
    # Burn's pos_encoding.rs test values (d_model 6, three positions), from PyTorch's tutorial.
    burn_values = np.array([[0.00000, 1.00000, 0.00000, 1.00000, 0.00000, 1.00000],
                            [0.84147, 0.54030, 0.04640, 0.99892, 0.00215, 1.00000],
                            [0.90930, -0.41615, 0.09270, 0.99569, 0.00431, 0.99999]])
    x = RNG.normal(size=(2, 3, 6)).astype(np.float32)
    got = nn.PositionalEncoding(6)(t(x)).to_numpy()
    np.testing.assert_allclose(got - x, np.broadcast_to(burn_values, (2, 3, 6)), atol=2e-5)
    assert list(nn.PositionalEncoding(6).named_params()) == []


def test_rotary_encoding_matches_burns_values_and_the_rotation_formula():
    # Burn's rope_encoding.rs test: RotaryEncodingConfig(10, 4), input [[1..4], [5..8]].
    x = np.array([[[1.0, 2, 3, 4], [5, 6, 7, 8]], [[9, 10, 11, 12], [13, 14, 15, 16]]], np.float32)
    want_burn = np.array([[[1.0, 2, 3, 4], [-2.3473, 7.4492, 6.9197, 8.0696]],
                          [[9.0, 10, 11, 12], [-4.7567, 18.5034, 14.8393, 16.1492]]])
    np.testing.assert_allclose(nn.RotaryEncoding(10, 4)(t(x)).to_numpy(), want_burn, atol=1e-4)
    # Any rank, any start: y[2i] = x[2i] cos - x[2i+1] sin, y[2i+1] = x[2i] sin + x[2i+1] cos.
    x4 = RNG.normal(size=(2, 3, 5, 6)).astype(np.float32)
    got = nn.RotaryEncoding(16, 6, theta=500.0)(t(x4), start=4).to_numpy()
    angle = np.arange(4, 9)[:, None] * 500.0 ** (-np.arange(0, 6, 2) / 6)
    c, s = np.cos(angle), np.sin(angle)
    want = np.empty_like(x4)
    want[..., 0::2] = x4[..., 0::2] * c - x4[..., 1::2] * s
    want[..., 1::2] = x4[..., 0::2] * s + x4[..., 1::2] * c
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- torch's modules with the same weights ------------------------------------------------------------

def _state(module) -> dict:
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def test_mha_loaded_from_torch_gives_torchs_context_and_weights():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    module = nn.MultiHeadAttention(8, 2).load_record(mha_from_torch(_state(reference)))
    q, kv = RNG.normal(size=(2, 4, 8)).astype(np.float32), RNG.normal(size=(2, 6, 8)).astype(np.float32)
    pad = np.zeros((2, 6), bool)
    pad[0, 5:] = True
    causal = np.triu(np.ones((4, 6), bool), k=1)
    with torch.no_grad():
        want_ctx, want_w = reference(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(kv),
                                     key_padding_mask=torch.from_numpy(pad), attn_mask=torch.from_numpy(causal),
                                     average_attn_weights=False)
    ctx, weights = module(t(q), t(kv), t(kv), t(pad), t(np.broadcast_to(causal, (1, 4, 6))))
    np.testing.assert_allclose(ctx.to_numpy(), want_ctx.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights.to_numpy(), want_w.numpy(), rtol=1e-5, atol=1e-6)
    for name, value in mha_to_torch(record(module)).items():
        np.testing.assert_array_equal(value, _state(reference)[name])


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_loaded_from_torch_gives_torchs_outputs(norm_first):
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=norm_first)
    reference = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    state = _state(reference)
    rec = {}
    for i in range(2):
        sub = {k[len(f"layers.{i}."):]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        rec.update({f"layers.{i}.{k}": v for k, v in transformer_encoder_layer_from_torch(sub, norm_first).items()})
        assert transformer_encoder_layer_to_torch(
            {k[len(f"layers.{i}."):]: v for k, v in rec.items() if k.startswith(f"layers.{i}.")}, norm_first).keys() \
            == sub.keys()
    module = nn.TransformerEncoder(8, 16, 2, 2, norm_first=norm_first).load_record(rec)
    x = RNG.normal(size=(3, 5, 8)).astype(np.float32)
    pad = np.zeros((3, 5), bool)
    pad[2, 3:] = True
    with torch.no_grad():
        want = reference(torch.from_numpy(x), src_key_padding_mask=torch.from_numpy(pad)).numpy()
    got = module(t(x), t(pad)).to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_decoder_loaded_from_torch_gives_torchs_outputs(norm_first):
    torch = pytest.importorskip("torch")
    torch.manual_seed(2)
    reference = torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True,
                                                 norm_first=norm_first).eval()
    rec = {f"layers.0.{k}": v for k, v in transformer_decoder_layer_from_torch(_state(reference), norm_first).items()}
    module = nn.TransformerDecoder(8, 16, 2, 1, norm_first=norm_first).load_record(rec)
    target, memory = RNG.normal(size=(2, 4, 8)).astype(np.float32), RNG.normal(size=(2, 6, 8)).astype(np.float32)
    causal = nn.generate_autoregressive_mask(2, 4)
    with torch.no_grad():
        want = reference(torch.from_numpy(target), torch.from_numpy(memory),
                         tgt_mask=torch.from_numpy(causal.to_numpy()[0].copy())).numpy()
    got = module(t(target), t(memory), None, causal).to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_torch_attention_mapping_rejects_separate_projections():
    with pytest.raises(RecordError, match="no 'in_proj_weight'; separate q/k/v projections"):
        mha_from_torch({"q_proj_weight": np.zeros((4, 4))})


# -- gradients: central finite differences ---------------------------------------------------------

def _export_with_fed_weights(module, inputs) -> tuple:
    """A plain ONNX Runtime session on ``module``'s ONNX export whose weights (initializers named
    by their param paths) are also graph inputs, so a moved weight is fed, not rebuilt; and the
    feeds of ``inputs`` (``None`` ones are not inputs of the export)."""
    import tempfile
    from pathlib import Path

    import onnx

    with tempfile.TemporaryDirectory() as folder:
        path = op.export_onnx(module, Path(folder) / "m.onnx", *[None if a is None else t(a) for a in inputs])
        model = onnx.load(str(path))
    feeds = dict(zip([i.name for i in model.graph.input], [a for a in inputs if a is not None]))
    for init in model.graph.initializer:  # overridable initializers: fed values replace them
        model.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), feeds


def check_module_grad(module, inputs, eps=1e-6):
    """grad() of ``sum(module(*inputs)[0] * r)`` against central differences, every param.

    NOTE: the differences are of plain ONNX Runtime on the module's export with the moved
    weight fed (one session for all; building a module and its training graph per moved value
    took seconds a test)."""
    out = module(*[None if a is None else t(a) for a in inputs])
    first = out[0] if isinstance(out, tuple) else out
    r = RNG.normal(size=first.shape)

    def loss_fn(m, r, *xs):
        y = m(*xs)
        return ops.sum(ops.mul(y[0] if isinstance(y, tuple) else y, r))

    _, grads = grad(loss_fn, module, r, *inputs)
    base = record(module)
    session, feeds = _export_with_fed_weights(module, inputs)

    def plain_loss(path, moved):
        return float((np.asarray(session.run(None, {**feeds, path: moved})[0], np.float64) * r).sum())

    for path, param in module.named_params():
        got, want = grads[param.id].to_numpy(), np.zeros_like(base[path])
        for j in range(base[path].size):
            values = []
            for sign in (1, -1):
                moved = base[path].copy()
                moved.flat[j] += sign * eps
                values.append(plain_loss(path, moved))
            want.flat[j] = (values[0] - values[1]) / (2 * eps)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8, err_msg=path)


@pytest.mark.parametrize("quiet", [False, True])
def test_mha_gradients_with_masks_match_finite_differences(quiet):
    module = randomized(nn.MultiHeadAttention(4, 2, quiet_softmax=quiet, dtype=DType.F64), np.float64)
    x = RNG.normal(size=(2, 3, 4))
    pad = np.array([[False, False, True], [False, False, False]])
    attn = np.triu(np.ones((2, 3, 3), bool), k=1)
    check_module_grad(module, [x, x, x, pad, attn])


def test_cross_attention_gradients_match_finite_differences():
    module = randomized(nn.CrossAttention(4, 3, 2, 1, 2, dtype=DType.F64), np.float64)
    check_module_grad(module, [RNG.normal(size=(1, 2, 4)), RNG.normal(size=(1, 3, 3))])


def test_encoder_layer_gradients_match_finite_differences():
    module = randomized(nn.TransformerEncoder(4, 6, 2, 1, norm_first=True, activation="relu", dtype=DType.F64),
                        np.float64)
    check_module_grad(module, [RNG.normal(size=(2, 3, 4))])


def test_rotary_encoding_input_gradient_is_the_inverse_rotation():
    # d(sum(rope(x) * r))/dx = R^T r: rotating r back by the same angles.
    rope = nn.RotaryEncoding(8, 4)

    class Holder(op.Module):
        def __init__(self, x):
            self.x = op.Param.initialized(op.ParamId(), t(x))

        def forward(self, r):
            return ops.sum(ops.mul(rope(self.x.val()), r))

    x, r = RNG.normal(size=(1, 3, 4)), RNG.normal(size=(1, 3, 4))
    holder = Holder(x)
    _, grads = grad(lambda m, r: m(r), holder, r)
    angle = np.arange(3)[:, None] * 10000.0 ** (-np.arange(0, 4, 2) / 4)
    c, s = np.cos(angle), np.sin(angle)
    want = np.empty_like(r)
    want[..., 0::2] = r[..., 0::2] * c + r[..., 1::2] * s
    want[..., 1::2] = -r[..., 0::2] * s + r[..., 1::2] * c
    np.testing.assert_allclose(grads[holder.x.id].to_numpy(), want, rtol=1e-10, atol=1e-12)


# -- export and training ---------------------------------------------------------------------------

class Classifier(op.Module):
    """A small transformer encoder classifier: embedding + sinusoids -> encoder -> mean -> Linear."""

    def __init__(self, vocab=10, d_model=8, classes=2):
        self.embedding = nn.Embedding(vocab, d_model)
        self.positions = nn.PositionalEncoding(d_model, max_sequence_size=32)
        self.encoder = nn.TransformerEncoder(d_model, 16, 2, 2, dropout=0.0)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens, mask_pad):
        h = self.encoder(self.positions(self.embedding(tokens)), mask_pad)
        return self.head(ops.mean(h, 1))


def test_transformer_encoder_trains_through_ort_and_exports_to_plain_onnxruntime(tmp_path):
    nn.seed(3)
    tokens = RNG.integers(0, 10, size=(6, 5)).astype(np.int64)
    labels = (tokens[:, 0] >= 5).astype(np.int64)  # learnable: the class is in the first token
    pad = np.zeros((6, 5), bool)
    pad[::2, 4] = True

    def loss_fn(m, tokens, pad, labels):
        return cross_entropy(m(tokens, pad), labels)

    model, opt, losses = Classifier(), Adam(lr=0.02), []
    for _ in range(8):
        loss, grads = grad(loss_fn, model, tokens, pad, labels)
        losses.append(float(loss.to_numpy()))
        model = opt.step(model, grads)
    assert losses[-1] < 0.8 * losses[0]
    path = op.export_onnx(model, tmp_path / "encoder.onnx", t(tokens), t(pad),
                          dynamic_axes={"tokens": {0: "batch"}, "mask_pad": {0: "batch"}})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (6, 2):  # the batch size is not baked in
        feeds = dict(zip([i.name for i in session.get_inputs()], [tokens[:batch], pad[:batch]]))
        got = session.run(None, feeds)[0]
        np.testing.assert_allclose(got, model(t(tokens[:batch]), t(pad[:batch])).to_numpy(), rtol=1e-5, atol=1e-6)


def test_exported_decoder_with_a_causal_mask_runs_in_plain_onnxruntime(tmp_path):
    module = nn.TransformerDecoder(8, 16, 2, 1, dropout=0.0)
    target, memory = RNG.normal(size=(2, 4, 8)).astype(np.float32), RNG.normal(size=(2, 3, 8)).astype(np.float32)
    causal = nn.generate_autoregressive_mask(2, 4)
    path = op.export_onnx(module, tmp_path / "decoder.onnx", t(target), t(memory), None, causal)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, dict(zip([i.name for i in session.get_inputs()],
                                     [target, memory, causal.to_numpy()])))[0]
    np.testing.assert_allclose(got, module(t(target), t(memory), None, causal).to_numpy(), rtol=1e-6, atol=1e-6)


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: nn.MultiHeadAttention(8, 3), "n_heads=3 must divide d_model=8"),
    (lambda: nn.CrossAttention(8, 8, 4, 3, 2), r"n_heads_kv=3 must divide n_heads=4"),
    (lambda: nn.PositionWiseFeedForward(4, 8, activation="swish"), r"activation must be one of \['gelu', 'relu'\]"),
    (lambda: nn.RotaryEncoding(8, 5), "RotaryEncoding needs an even d_model; got 5"),
    (lambda: nn.PositionalEncoding(8, max_sequence_size=100, max_timescale=50), r"max_timescale \(50\) must be >="),
])
def test_attention_configurations_raise_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("module, shape, message", [
    (nn.MultiHeadAttention(8, 2), (2, 3, 6), r"MultiHeadAttention expects query with 8 features"),
    (nn.PositionalEncoding(8, max_sequence_size=4), (1, 5, 8), "sequence length 5 exceeds max_sequence_size=4"),
    (nn.RotaryEncoding(4, 8), (1, 6, 8), r"positions 0..6 exceed max_sequence_length=4"),
])
def test_attention_layers_reject_mis_shaped_input(module, shape, message):
    with pytest.raises(op.TraceError, match=message):
        module(t(np.zeros(shape, np.float32)))


def test_decoder_layer_gradients_match_finite_differences():
    module = randomized(nn.TransformerDecoder(4, 4, 2, 1, activation="relu", dtype=DType.F64), np.float64)
    causal = np.triu(np.ones((1, 2, 2), bool), k=1)
    check_module_grad(module, [RNG.normal(size=(1, 2, 4)), RNG.normal(size=(1, 3, 4)), None, causal])


@pytest.mark.parametrize("name, module, shapes", [
    ("mha", nn.MultiHeadAttention(8, 4, quiet_softmax=True), [(2, 3, 8), (2, 5, 8)]),
    ("cross", nn.CrossAttention(8, 6, 4, 2, 2), [(2, 3, 8), (2, 5, 6)]),
    ("pwff", nn.PositionWiseFeedForward(8, 16), [(2, 3, 8)]),
    ("rope", nn.RotaryEncoding(16, 8), [(2, 2, 5, 8)]),
    ("sinusoids", nn.PositionalEncoding(8), [(2, 5, 8)]),
])
def test_exported_attention_layers_run_in_plain_onnxruntime_for_another_batch_size(tmp_path, name, module, shapes):
    inputs = [RNG.normal(size=s).astype(np.float32) for s in shapes]
    names = [f"x{i}" for i in range(len(inputs))]
    path = op.export_onnx(module, tmp_path / f"{name}.onnx", *[t(a) for a in inputs], input_names=names,
                          dynamic_axes={n: {0: "batch"} for n in names})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    other = [np.concatenate([a, a[:1]]) for a in inputs]  # batch + 1
    got = session.run(None, dict(zip(names, other)))[0]
    want = module(*[t(a) for a in other])
    want = want[0] if isinstance(want, tuple) else want
    np.testing.assert_allclose(got, want.to_numpy(), rtol=1e-5, atol=1e-6)


def test_quiet_softmax_and_mask_fill_ops_match_their_formulas():
    x = RNG.normal(size=(2, 3, 5)) * 30  # large values: the stable form must not overflow
    got = ops.quiet_softmax(t(x), 1).to_numpy()
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(got, e / (e.sum(1, keepdims=True) + np.exp(-x.max(1, keepdims=True))), rtol=1e-12)
    assert np.isfinite(got).all()
    mask = RNG.random((1, 3, 5)) < 0.5
    np.testing.assert_array_equal(ops.mask_fill(t(x), t(mask), -7.0).to_numpy(), np.where(mask, -7.0, x))


def test_a_torch_transformer_classifier_state_dict_loads_and_gives_torchs_logits():
    torch = pytest.importorskip("torch")
    from onnxparam.convert._torch_layers import torch_state_dict_to_record

    class TorchClassifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(10, 8)
            layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True,
                                                     norm_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(8, 2)

        def forward(self, tokens, pad):
            return self.head(self.encoder(self.embedding(tokens), src_key_padding_mask=pad).mean(1))

    class Same(op.Module):
        def __init__(self):
            self.embedding = nn.Embedding(10, 8)
            self.encoder = nn.TransformerEncoder(8, 16, 2, 2, norm_first=True)
            self.head = nn.Linear(8, 2)

        def forward(self, tokens, pad):
            return self.head(ops.mean(self.encoder(self.embedding(tokens), pad), 1))

    torch.manual_seed(7)
    reference = TorchClassifier().eval()
    model = Same().load_record(torch_state_dict_to_record(Same(), _state(reference)))
    tokens = RNG.integers(0, 10, size=(3, 5)).astype(np.int64)
    pad = np.zeros((3, 5), bool)
    pad[1, 3:] = True
    with torch.no_grad():
        want = reference(torch.from_numpy(tokens), torch.from_numpy(pad)).numpy()
    np.testing.assert_allclose(model(t(tokens), t(pad)).to_numpy(), want, rtol=1e-4, atol=1e-5)
