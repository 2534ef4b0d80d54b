"""Whole-model gradients of torch-exported transformers, imported, against torch autograd.

Tiny BERT, GPT-2, LLaMA (GQA, rotary embeddings), a T5 encoder (relative-position buckets) and
ViT (CLS token expanded to the batch) (``transformers``, random weights, tiny configs, every weight perturbed so
no two initializers are equal and the exporter shares none) are exported by torch's
TorchScript exporter with dynamic batch and sequence dims, imported with ``import_onnx``, and
``grad`` of a loss on the imported module is compared with torch autograd of the same loss on
the same weights and inputs: every param's gradient within 1e-3 of torch's (relative to the
largest entry of that gradient, with an absolute floor for gradients that are zero in exact
arithmetic, such as the attention key bias). Three sequence lengths and batch sizes run; the
file's dynamic dims are symbolic from the first call: ONE training graph and session serve every
shape (the autodiff cache is counted). Then a LoRA fine-tuning step lowers the loss.

Token ids start at 1: torch's ``nn.Embedding(padding_idx=0)`` zeroes row 0's gradient by
convention, which no ONNX graph encodes (the gradient of the exported function has row 0).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # exporting the two models takes ~10 s each on this CPU

import onnxparam as op  # noqa: E402
from onnxparam.autodiff import _training, grad  # noqa: E402
from onnxparam.autodiff._tables import PERIODIC  # noqa: E402

HIDDEN = 16
VOCAB = 50
PROJ = np.random.default_rng(7).normal(size=(HIDDEN,)).astype(np.float32)
SHAPES = [(2, 5), (3, 7), (4, 3)]  # the 2nd call changes both dims: its symbolic graph serves the 3rd


class _LastHidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(input_ids=ids).last_hidden_state


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertModel(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="eager")  # GQA; torch's exporter has no GQA SDPA
    return transformers.LlamaModel(cfg)


def _t5():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                                dropout_rate=0.0, relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return transformers.T5EncoderModel(cfg)  # relative-position buckets computed at run time


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    return transformers.ViTModel(cfg, add_pooling_layer=False)  # the CLS token expanded to the batch


class _Pixels(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(pixel_values=ids).last_hidden_state


def _inputs(name: str, rng, batch: int, seq: int) -> np.ndarray:
    """Token ids ``[batch, seq]`` (from 1), or for ViT images ``[batch, 3, 16, 16]`` (``seq`` unused)."""
    if name == "vit":
        return rng.normal(size=(batch, 3, 16, 16)).astype(np.float32)
    return rng.integers(1, VOCAB, (batch, seq)).astype(np.int64)


@pytest.fixture(scope="module", params=["bert", "gpt2", "llama", "t5", "vit"])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    build = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5, "vit": _vit}[request.param]
    model = (_Pixels if request.param == "vit" else _LastHidden)(build()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.onnx"
    ids = torch.from_numpy(_inputs(request.param, np.random.default_rng(0), 2, 5))
    axes = {"ids": {0: "batch"}, "h": {0: "batch"}} if request.param == "vit" else \
        {"ids": {0: "batch", 1: "seq"}, "h": {0: "batch", 1: "seq"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), str(path), input_names=["ids"], output_names=["h"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)
    return request.param, model, path


def _loss(m, ids):
    h = m(ids=ids)
    return ((h * op.Tensor.from_numpy(PROJ)).sum(-1) ** 2).mean()


def _torch_grads(model, ids):
    model.zero_grad()
    h = model(torch.from_numpy(ids))
    loss = ((h * torch.from_numpy(PROJ)).sum(-1) ** 2).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _torch_param_for(onnx_value: np.ndarray, path: str, tparams: dict):
    """The torch param an imported param is: by name (the exporter keeps module paths), else
    by value (``MatMul`` weights are exported transposed, under generated names)."""
    if path in tparams:
        return path, False
    for name, p in tparams.items():
        t = p.detach().numpy()
        if t.shape == onnx_value.shape and np.array_equal(t, onnx_value):
            return name, False
        if t.ndim == 2 and t.T.shape == onnx_value.shape and np.array_equal(t.T, onnx_value):
            return name, True
    return None, False


def test_every_param_gradient_matches_torch_autograd_at_three_shapes_with_one_symbolic_session(exported):
    name, model, path = exported
    module = op.import_onnx(str(path))
    tparams = dict(model.named_parameters())
    params = {p: v.val().to_numpy() for p, v in module.named_params()}
    mapping = {p: _torch_param_for(v, p, tparams) for p, v in params.items()}
    matched = {p: m for p, m in mapping.items() if m[0] is not None}
    _training.clear_cache()
    rng = np.random.default_rng(1)
    for batch, seq in SHAPES:
        ids = _inputs(name, rng, batch, seq)
        loss, grads = grad(_loss, module, op.Tensor.from_numpy(ids))
        t_loss, t_grads = _torch_grads(model, ids)
        used = {n for n, g in t_grads.items() if g is not None}  # BERT's pooler is not exported
        assert used <= {m[0] for m in matched.values()}, "every torch param the loss uses has an imported twin"
        assert float(loss.to_numpy()) == pytest.approx(t_loss, rel=1e-5)
        by_path = grads.by_path()
        for p, (tname, transposed) in matched.items():
            tg = t_grads[tname].numpy()
            tg = tg.T if transposed else tg
            assert p in by_path, f"{name}: no gradient for {p}"
            g = by_path[p].to_numpy()
            scale = max(float(np.abs(tg).max()), 1e-4)
            err = float(np.abs(g - tg).max()) / scale
            assert err < 1e-3, f"{name} {batch}x{seq}: {p} ({tname}) relative error {err:.2e}"
    if name == "llama":  # the rotary inv_freq buffer: found from the graph, frozen at import
        assert list(module.onnx_tables.values()) == [PERIODIC]
        assert not any(v.require_grad for p, v in module.named_params() if p in module.onnx_tables)
    # the declared dynamic dims symbolic from the first call: one training graph and session served every shape
    assert len(_training._graphs) == 1 and len(_training._sessions) == 1


def test_a_lora_step_on_the_imported_model_lowers_the_loss(exported):
    from onnxparam.optim import Adam

    name, _, path = exported
    module = op.import_onnx(str(path)).apply_lora(op.LoraConfig(rank=2, alpha=4, seed=0))
    ids = op.Tensor.from_numpy(_inputs(name, np.random.default_rng(2), 2, 6))
    loss0, grads = grad(_loss, module, ids)
    assert grads and all(".lora." in p for p in grads.by_path()), sorted(grads.by_path())
    optim = Adam(lr=1e-2)
    for _ in range(3):
        module = optim.step(module, grads)
        loss, grads = grad(_loss, module, ids)
    assert float(loss.to_numpy()) < float(loss0.to_numpy())


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost exception ``error`` was raised from."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "t5", "vit"])
def test_dynamo_exports_match_torch_autograd_too(name, tmp_path):
    """The same models exported by torch's dynamo exporter (``torch.export`` dims for batch and
    sequence, ViT's batch only; opset 18): every param's gradient within 1e-3 of torch autograd at
    three shapes."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    build = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5, "vit": _vit}[name]
    model = (_Pixels if name == "vit" else _LastHidden)(build()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / f"{name}.onnx"
    ids = torch.from_numpy(_inputs(name, np.random.default_rng(0), 2, 5))
    dims = {"ids": {0: torch.export.Dim("batch", min=1, max=64)}}
    if name != "vit":
        dims["ids"][1] = torch.export.Dim("seq", min=2, max=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, (ids,), str(path), input_names=["ids"], output_names=["h"], dynamic_shapes=dims,
                              dynamo=True, opset_version=18)
        except torch.onnx.OnnxExporterError as e:  # torch's own limitation: nothing of this library ran
            pytest.skip(f"torch {torch.__version__}'s dynamo exporter cannot export {name} with dynamic batch and "
                        f"sequence: {_root_cause(e)}")
    module = op.import_onnx(str(path))
    tparams = dict(model.named_parameters())
    rng = np.random.default_rng(1)
    for batch, seq in SHAPES:
        x = _inputs(name, rng, batch, seq)
        loss, grads = grad(_loss, module, op.Tensor.from_numpy(x))
        t_loss, t_grads = _torch_grads(model, x)
        assert float(loss.to_numpy()) == pytest.approx(t_loss, rel=1e-5)
        by_path = grads.by_path()
        seen = set()
        for p, v in module.named_params():
            tname, transposed = _torch_param_for(v.val().to_numpy(), p, tparams)
            if tname is None or t_grads[tname] is None:
                continue
            seen.add(tname)
            tg = t_grads[tname].numpy()
            tg = tg.T if transposed else tg
            assert p in by_path, f"{name}: no gradient for {p}"
            err = float(np.abs(by_path[p].to_numpy() - tg).max()) / max(float(np.abs(tg).max()), 1e-4)
            assert err < 1e-3, f"{name} {batch}x{seq}: {p} ({tname}) relative error {err:.2e}"
        assert seen == {n for n, g in t_grads.items() if g is not None}


def test_lora_fine_tuning_then_the_merged_export_equals_torch_with_merged_weights_in_plain_onnx_runtime(exported,
                                                                                                       tmp_path):
    """LoRA on the imported model, five Adam steps (the loss falls), then ``export_onnx(lora="merge")``:
    plain ONNX Runtime on the written file equals the module's own call and torch's model whose
    adapted weights are replaced by ``base + (alpha / rank) * a @ b`` (computed here from the factors,
    in the weight's layout: ``MatMul`` weights are torch's transposed)."""
    import copy

    import onnxruntime as ort

    from onnxparam.optim import Adam

    name, model, path = exported
    rank, alpha = 2, 4
    module = op.import_onnx(str(path)).apply_lora(op.LoraConfig(rank=rank, alpha=alpha, seed=0))
    ids = op.Tensor.from_numpy(_inputs(name, np.random.default_rng(2), 2, 6))
    loss0, grads = grad(_loss, module, ids)
    optim = Adam(lr=1e-2)
    for _ in range(5):
        module = optim.step(module, grads)
        loss, grads = grad(_loss, module, ids)
    assert float(loss.to_numpy()) < float(loss0.to_numpy())

    params = {p: v for p, v in module.named_params()}
    tparams = dict(model.named_parameters())
    merged_torch = copy.deepcopy(model)
    adapted = [p[:-len(".lora.a")] for p in params if p.endswith(".lora.a")]
    assert adapted
    with torch.no_grad():
        for p in adapted:
            base = params[p].base().to_numpy()
            a, b = params[p + ".lora.a"].val().to_numpy(), params[p + ".lora.b"].val().to_numpy()
            delta = (alpha / rank) * (a @ b)
            assert delta.shape == base.shape and np.abs(delta).max() > 0, p
            tname, transposed = _torch_param_for(base, p, tparams)
            assert tname is not None, f"{name}: no torch twin of the adapted weight {p}"
            w = base + delta
            merged_torch.get_parameter(tname).copy_(torch.from_numpy(w.T if transposed else w))
    out = op.export_onnx(module, tmp_path / "merged.onnx", lora="merge")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch, seq in [(2, 6), (3, 4)]:
        x = _inputs(name, np.random.default_rng(batch), batch, seq)
        got = session.run(None, {"ids": x})[0]
        with torch.no_grad():
            want = merged_torch(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name}: merged file vs torch")
        np.testing.assert_allclose(module(ids=op.Tensor.from_numpy(x)).to_numpy(), got, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: module call vs merged file")
