"""Whole-model gradients of more torch-exported models, imported, against torch autograd.

A Whisper encoder (``transformers``, tiny config), ResNet18 and MobileNetV3-small (torchvision's
architectures, tests/torch_zoo.py), and a bidirectional LSTM tagger and GRU tagger are exported
by torch's TorchScript exporter and by its dynamo exporter (``torch.export`` dims), with a
dynamic batch dim and, where the model has one, a dynamic sequence length (the taggers) or
image height and width (the CNNs; Whisper's encoder accepts only its fixed frame count), imported
with ``import_onnx``, and ``grad`` of ``(model(x) * c).sum()`` on the imported module is compared
with torch autograd of the same loss on the same weights and inputs at three shapes: every
trainable param's gradient within 1e-3 of torch's, relative to the largest entry of torch's
gradient. The file's dynamic dims are symbolic from the first call: one training graph and session serve
the three shapes. Then LoRA (the default targets: the linear layers, the taggers' embedding)
is fine-tuned on the same file for three Adam steps (the loss falls) and the ``lora="merge"``
export, run by plain ONNX Runtime, equals torch's model with the merged weights.

Which torch tensor an imported param is: found by value (a random perturbation makes every
weight distinct), as is, transposed (``MatMul`` weights), or, for the recurrent weights, in
ONNX's layout (both directions stacked, gates reordered, the two biases concatenated), the same
composition applied to torch's gradients.

BatchNormalization (the CNNs; torch in eval mode, which uses the running statistics as the
imported graph does): both exporters' default eval exports fold each BatchNorm into the
preceding convolution's weight and bias (TorchScript's eval peephole; the dynamo exporter's
ONNX optimizer), so torch's oracle for those files is the same network with each BatchNorm
replaced by the identity and each convolution given the file's folded weight and bias (the
values copied from the file, convolutions paired in execution order, shapes checked). The
TorchScript export with ``training=PRESERVE`` keeps ``BatchNormalization`` nodes: there the
BatchNorm scale and shift are params compared with torch's, and the running mean and variance
are frozen tables on import (PyTorch buffers), as torch's eval mode treats them.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnx  # noqa: E402

import onnxparam as op  # noqa: E402
from onnxparam.autodiff import _training, grad  # noqa: E402

import torch_zoo  # noqa: E402

VOCAB = 30
RNN_BLOCKS = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2]}  # torch's gate blocks in ONNX's order (iofc, zrh)


def _whisper():
    transformers = pytest.importorskip("transformers")
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, encoder_attention_heads=2,
                                     decoder_layers=1, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, d_model=16, max_source_positions=8, max_target_positions=8,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                                     bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    return _LastHidden(WhisperEncoder(cfg))


class _LastHidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(x).last_hidden_state


# name -> (builder, input of (rng, batch, n), the input's dynamic dims, the output's, three (batch, n))
MODELS = {
    "whisper": (_whisper, lambda rng, b, n: rng.normal(size=(b, 8, 16)).astype(np.float32),
                {0: "batch"}, {0: "batch"}, [(2, 0), (3, 0), (1, 0)]),
    "resnet18": (lambda: torch_zoo.ResNet18(num_classes=10),
                 lambda rng, b, n: rng.normal(size=(b, 3, n, n + 8)).astype(np.float32),
                 {0: "batch", 2: "height", 3: "width"}, {0: "batch"}, [(2, 32), (3, 40), (1, 24)]),
    "mobilenet_v3_small": (lambda: torch_zoo.MobileNetV3Small(num_classes=10),
                           lambda rng, b, n: rng.normal(size=(b, 3, n, n + 8)).astype(np.float32),
                           {0: "batch", 2: "height", 3: "width"}, {0: "batch"}, [(2, 32), (3, 40), (1, 24)]),
    "lstm_tagger": (lambda: torch_zoo.Tagger("LSTM", vocab=VOCAB),
                    lambda rng, b, n: rng.integers(0, VOCAB, (b, n)).astype(np.int64),
                    {0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}, [(2, 5), (3, 7), (4, 3)]),
    "gru_tagger": (lambda: torch_zoo.Tagger("GRU", vocab=VOCAB),
                   lambda rng, b, n: rng.integers(0, VOCAB, (b, n)).astype(np.int64),
                   {0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}, [(2, 5), (3, 7), (4, 3)]),
}


def build(name: str):
    """The torch model in eval mode, every param and BatchNorm statistic perturbed (distinct values)."""
    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn_like(m.running_mean) * 0.1)
                m.running_var.copy_(torch.rand_like(m.running_var) + 0.5)
    return model


def export(model, name: str, exporter: str, path) -> None:
    """``exporter``: ``torchscript`` (default eval export), ``torchscript-preserve`` (BatchNorm
    kept) or ``dynamo``; input ``x`` and output ``y`` with the model's dynamic dims."""
    _, make, in_axes, out_axes, shapes = MODELS[name]
    x = torch.from_numpy(make(np.random.default_rng(0), *shapes[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            pytest.importorskip("onnxscript")  # the dynamo exporter's ONNX builder
            dims = ({k: torch.export.Dim(v, min=1 if k == 0 else 2, max=256) for k, v in in_axes.items()},)
            torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"], dynamic_shapes=dims,
                              dynamo=True, opset_version=18, verbose=False)
        else:
            extra = {"training": torch.onnx.TrainingMode.PRESERVE} if exporter.endswith("preserve") else {}
            torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": in_axes, "y": out_axes}, opset_version=17, dynamo=False, **extra)


def _initializer_values(model: onnx.ModelProto) -> dict:
    """Initializer and Constant-node float values by name, through Identity nodes."""
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = onnx.numpy_helper.to_array(node.attribute[0].t)
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in values:
            values[node.output[0]] = values[node.input[0]]
    return values


def fold_batchnorm_like(model, onnx_model: onnx.ModelProto, x):
    """torch's oracle for a file whose exporter folded BatchNorm into the convolutions: a copy of
    ``model`` with every BatchNorm the identity and every convolution holding the file's weight and
    bias (the file's ``Conv`` nodes and torch's convolutions paired in execution order)."""
    folded = copy.deepcopy(model)
    order = []
    hooks = [m.register_forward_hook(lambda mod, i, o: order.append(mod)) for m in folded.modules()
             if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        folded(x)
    for h in hooks:
        h.remove()
    values = _initializer_values(onnx_model)
    nodes = [n for n in onnx_model.graph.node if n.op_type == "Conv"]
    assert len(nodes) == len(order), (len(nodes), len(order))
    with torch.no_grad():
        for conv, node in zip(order, nodes):
            w = values[node.input[1]]
            assert tuple(w.shape) == tuple(conv.weight.shape), (node.name, w.shape, conv.weight.shape)
            conv.weight.copy_(torch.from_numpy(w.copy()))
            b = values[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros(w.shape[0], np.float32)
            conv.bias = torch.nn.Parameter(torch.from_numpy(b.copy()))
    for parent in folded.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, torch.nn.BatchNorm2d):
                setattr(parent, child_name, torch.nn.Identity())
    return folded.eval()


def _candidates(model) -> list:
    """``(label, sources, fn)``: ``fn(tensors by torch name)`` is a tensor some exporter stores as
    one initializer: each param as is and transposed, and each recurrent layer's W / R / B in ONNX's
    layout (both directions stacked, gates reordered, the input and hidden biases concatenated)."""
    out = []
    for name, p in model.named_parameters():
        out.append((name, (name,), lambda d, n=name: d[n]))
        if p.ndim == 2:
            out.append((name + ".T", (name,), lambda d, n=name: d[n].T))
    for mname, m in model.named_modules():
        if not isinstance(m, (torch.nn.LSTM, torch.nn.GRU)):
            continue
        blocks = RNN_BLOCKS[type(m).__name__]
        h = m.hidden_size
        sfx = ["", "_reverse"] if m.bidirectional else [""]

        def onnx_order(a, blocks=blocks, h=h):
            return np.concatenate([a[k * h:(k + 1) * h] for k in blocks], axis=0)

        for layer in range(m.num_layers):
            def names(kind, layer=layer, mname=mname, sfx=sfx):
                return [f"{mname}.{kind}_l{layer}{s}" for s in sfx]

            for label, kinds in (("W", ["weight_ih"]), ("R", ["weight_hh"]), ("B", ["bias_ih", "bias_hh"])):
                src = [n for k in kinds for n in names(k)]
                out.append((f"{mname} layer {layer} {label}", tuple(src),
                            lambda d, kinds=kinds, names=names, f=onnx_order, dirs=len(sfx): np.stack(
                                [np.concatenate([f(d[names(k)[i]]) for k in kinds]) for i in range(dirs)])))
    return out


def match_params(module, model) -> dict:
    """Imported trainable param path -> ``(label, sources, fn)`` of the torch tensor it holds."""
    values = {n: p.detach().numpy() for n, p in model.named_parameters()}
    cands = _candidates(model)
    built = [(c, c[2](values)) for c in cands]
    matched = {}
    for path, param in module.named_params():
        if not param.require_grad:
            continue
        v = param.val().to_numpy()
        hits = [c for c, t in built if t.shape == v.shape and np.array_equal(t, v)]
        assert len(hits) == 1, f"imported param {path} {v.shape}: torch twins {[h[0] for h in hits]}"
        matched[path] = hits[0]
    return matched


def _loss(m, x, c):
    return (m(x=x) * c).sum()


def torch_grads(model, x: np.ndarray, c: np.ndarray):
    for p in model.parameters():
        p.requires_grad_(True)  # also the frozen ones (Whisper's position table): the import trains them
    model.zero_grad()
    loss = (model(torch.from_numpy(x)) * torch.from_numpy(c)).sum()
    loss.backward()
    return float(loss.detach()), {n: (np.zeros(tuple(p.shape), np.float32) if p.grad is None else p.grad.numpy())
                                  for n, p in model.named_parameters()}


def torch_oracle(name: str, path):
    """The torch model the file at ``path`` computes: :func:`build`'s, with BatchNorm folded as
    the file has it (:func:`fold_batchnorm_like`) when the file has no BatchNormalization node."""
    model = build(name)
    onnx_model = onnx.load(str(path))
    _, make, _, _, shapes = MODELS[name]
    has_bn = any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    if has_bn and not any(n.op_type == "BatchNormalization" for n in onnx_model.graph.node):
        model = fold_batchnorm_like(model, onnx_model, torch.from_numpy(make(np.random.default_rng(0), *shapes[0])))
    return model


def check_lora_fine_tune(name: str, exporter: str, path, tmp_path, rank=2, alpha=4, group=None) -> None:
    """LoRA on the imported model (its default targets, or ``group``), three Adam steps lower the loss; the
    ``lora="merge"`` export in plain ONNX Runtime equals torch's model with each adapted weight
    replaced by ``base + (alpha / rank) * a @ b`` (from the factors, in the weight's layout) and the
    module's own call, at a second shape."""
    import onnxruntime as ort

    from onnxparam.optim import Adam

    model = torch_oracle(name, path)
    _, make, _, _, shapes = MODELS[name]
    config = op.LoraConfig(rank=rank, alpha=alpha, seed=0)
    module = op.import_onnx(str(path)).apply_lora(config if group is None else config.with_param_group(group))
    rng = np.random.default_rng(3)
    x = make(rng, *shapes[0])
    with torch.no_grad():
        c = rng.normal(size=tuple(model(torch.from_numpy(x)).shape)).astype(np.float32)
    inputs = (op.Tensor.from_numpy(x), op.Tensor.from_numpy(c))
    loss0, grads = grad(_loss, module, *inputs)
    assert grads.by_path() and all(".lora." in p for p in grads.by_path()), sorted(grads.by_path())
    optim = Adam(lr=1e-2)
    for _ in range(3):
        module = optim.step(module, grads)
        loss, grads = grad(_loss, module, *inputs)
    assert float(loss.to_numpy()) < float(loss0.to_numpy()), f"{name}/{exporter}: LoRA steps did not lower the loss"

    from onnxparam.onnx_io._naming import onnx_name_to_path

    # a Gemm with transB=1 holds its weight [out, in]: the product a @ b [in, out] goes in transposed
    out_in = {onnx_name_to_path(n.input[1]) for n in onnx.load(str(path)).graph.node
              if n.op_type == "Gemm" and any(a.name == "transB" and a.i == 1 for a in n.attribute)}
    params = dict(module.named_params())
    values = {n: p.detach().numpy() for n, p in model.named_parameters()}
    adapted = [p[:-len(".lora.a")] for p in params if p.endswith(".lora.a")]
    assert adapted
    with torch.no_grad():
        for p in adapted:
            base = params[p].base().to_numpy()
            delta = (alpha / rank) * (params[p + ".lora.a"].val().to_numpy() @ params[p + ".lora.b"].val().to_numpy())
            delta = delta.T if p in out_in else delta
            assert delta.shape == base.shape and np.abs(delta).max() > 0, p
            twins = [n for n, v in values.items() if v.shape == base.shape and np.array_equal(v, base)]
            twins += [n + ".T" for n, v in values.items() if v.ndim == 2 and v.T.shape == base.shape
                      and np.array_equal(v.T, base)]
            assert len(twins) == 1, f"{name}/{exporter}: adapted weight {p}: torch twins {twins}"
            merged = base + delta
            tname = twins[0].removesuffix(".T")
            model.get_parameter(tname).copy_(torch.from_numpy(merged.T if twins[0].endswith(".T") else merged))
    out = op.export_onnx(module, tmp_path / "merged.onnx", lora="merge")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = make(rng, *shapes[1])
    got = session.run(None, {"x": x})[0]
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{name}/{exporter}: file vs torch")
    np.testing.assert_allclose(module(x=op.Tensor.from_numpy(x)).to_numpy(), got, rtol=1e-5, atol=1e-6 * scale,
                               err_msg=f"{name}/{exporter}: module call vs merged file")


def check_against_torch(name: str, exporter: str, path) -> float:
    """Every imported trainable param's gradient vs torch autograd at the model's three shapes;
    returns the worst relative error."""
    model = torch_oracle(name, path)
    _, make, _, _, shapes = MODELS[name]
    module = op.import_onnx(str(path))
    matched = match_params(module, model)
    covered = {s for _, sources, _ in matched.values() for s in sources}
    assert covered == {n for n, _ in model.named_parameters()}, "every torch param has an imported twin"
    _training.clear_cache()
    rng = np.random.default_rng(1)
    worst = 0.0
    for batch, n in shapes:
        x = make(rng, batch, n)
        with torch.no_grad():
            y = model(torch.from_numpy(x)).numpy()
        c = rng.normal(size=y.shape).astype(np.float32)
        loss, grads = grad(_loss, module, op.Tensor.from_numpy(x), op.Tensor.from_numpy(c))
        t_loss, t_grads = torch_grads(model, x, c)
        assert float(loss.to_numpy()) == pytest.approx(t_loss, rel=1e-4, abs=1e-4 * float(np.abs(y).sum()))
        by_path = grads.by_path()
        for path_, (label, _, fn) in matched.items():
            assert path_ in by_path, f"{name}/{exporter}: no gradient for {path_} ({label})"
            tg = fn(t_grads)
            err = float(np.abs(by_path[path_].to_numpy() - tg).max()) / max(float(np.abs(tg).max()), 1e-4)
            worst = max(worst, err)
            assert err < 1e-3, f"{name}/{exporter} {x.shape}: {path_} ({label}) relative error {err:.2e}"
    # the declared dynamic dims symbolic from the first call: one training graph and session served every shape
    assert len(_training._graphs) == 1 and len(_training._sessions) == 1
    return worst


EXPORTERS = ["torchscript", "dynamo"]
CASES = [(m, e) for m in MODELS for e in EXPORTERS] + [("resnet18", "torchscript-preserve"),
                                                      ("mobilenet_v3_small", "torchscript-preserve")]


@pytest.mark.slow
@pytest.mark.parametrize("name,exporter", CASES, ids=[f"{m}-{e}" for m, e in CASES])
def test_every_param_gradient_matches_torch_autograd_and_a_lora_fine_tune_merges_into_a_file_equal_to_torch(
        name, exporter, tmp_path):
    model = build(name)
    path = tmp_path / f"{name}.onnx"
    export(model, name, exporter, path)
    worst = check_against_torch(name, exporter, path)
    print(f"{name}/{exporter}: worst relative error {worst:.2e}")
    check_lora_fine_tune(name, exporter, path, tmp_path)


def test_lstm_tagger_torchscript_export_gradients_match_torch_autograd_and_lora_on_its_embedding_trains(tmp_path):
    """The quick representative of the slow sweep above (about a second to export): LoRA on the
    embedding before the LSTM and on the linear head. The embedding is named in the param_group:
    the default targets linear maps only, as PEFT's (embeddings only when asked)."""
    path = tmp_path / "tagger.onnx"
    export(build("lstm_tagger"), "lstm_tagger", "torchscript", path)
    assert check_against_torch("lstm_tagger", "torchscript", path) < 1e-3
    imported = op.import_onnx(str(path))
    head = next(p for p, n in imported.onnx_names.items() if n.startswith("onnx::MatMul"))
    assert "emb.weight" in imported.lora_default_skips()  # not a default target
    group = op.ParamGroup.from_paths(["emb.weight", head])
    check_lora_fine_tune("lstm_tagger", "torchscript", path, tmp_path, group=group)
