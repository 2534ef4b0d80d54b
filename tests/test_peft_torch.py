"""PEFT adapters (made by Hugging Face PEFT in torch) on models exported by torch's exporters
(TorchScript and dynamo) and imported here: merge / keep / inputs all equal PEFT's forward; one ``lora="inputs"``
export serves every adapter through ONNX Runtime's ``LoraAdapter`` (and none = the base model,
PEFT's ``disable_adapter()``); adapters trained here go back to PEFT through a PEFT folder.

Oracles: ``peft.PeftModel`` forward in torch on the same weights, and plain ONNX Runtime
sessions on the written files. The dynamo exporter (it needs ``onnxscript``) folds
``nn.Linear``'s transpose into unnamed ``val_N`` initializers read by ``MatMul``; the TorchScript
one writes ``Gemm transB=1`` or ``Transpose -> MatMul``: each test runs on both.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from torch_peft import (  # noqa: E402
    EXPORTERS,
    ConvNet,
    export,
    peft_lora,
    quiet,
    randomize,
    run_options,
    session,
    with_torch_weights,
)

from onnxparam import (  # noqa: E402
    LoraConfig,
    Module,
    Tensor,
    export_onnx,
    import_onnx,
    load_peft_adapter,  # noqa: E402
    write_onnx_adapter,
)
from onnxparam.runtime import SessionConfig, set_session_config  # noqa: E402

ATOL = 2e-4

# (r, alpha, use_rslora, lora_bias): ranks 2 / 4 / 8, alpha != rank, rsLoRA, lora_bias
ADAPTERS = [(2, 5, False, False), (4, 3, True, False), (8, 12, False, True)]


def peft_model(base, folder, r, alpha, rslora, lora_bias, targets, seed):
    """A PEFT LoRA model on a copy of ``base`` with non-zero random factors, saved to ``folder``
    (torch's global generator seeded with ``seed`` first: the tests draw inputs from it after)."""
    torch.manual_seed(seed)
    return peft_lora(base, targets, r, alpha, rslora=rslora, lora_bias=lora_bias, seed=seed + 100, folder=folder)


class Wrapped(torch.nn.Module):
    """BERT's last hidden state as a plain output (input ids only)."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).last_hidden_state


@pytest.fixture(scope="module", params=EXPORTERS)
def bert(request, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16)
    torch.manual_seed(0)
    model = randomize(Wrapped(transformers.BertModel(config)).eval(), seed=1)
    ids = torch.tensor([[1, 5, 7, 3, 9], [2, 8, 4, 6, 0]], dtype=torch.int64)
    folder = tmp_path_factory.mktemp(f"bert-{request.param}")
    path = export(model, (ids,), folder / "bert.onnx", request.param, input_names=["input_ids"],
                  output_names=["hidden"], dynamic={0: "batch"})
    return model, import_onnx(path), ids, folder


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 8)  # square: a layout guess cannot tell its axes apart

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module", params=[(e, d) for e in EXPORTERS for d in ("2d", "3d")],
                ids=lambda p: "-".join(p))
def mlp(request, tmp_path_factory):
    """The MLP exported on 2-d and 3-d inputs by both exporters: TorchScript (no constant
    folding) writes ``Gemm transB=1`` for 2-d and ``Transpose -> MatMul`` for 3-d; dynamo writes
    ``Gemm transB=1`` on the named weight for 2-d and ``MatMul`` on a pre-transposed ``val_N``
    initializer for 3-d."""
    exporter, dims = request.param
    model = randomize(Mlp().eval(), seed=2)
    x = torch.randn(3, 6) if dims == "2d" else torch.randn(2, 3, 6)
    folder = tmp_path_factory.mktemp("-".join(request.param))
    extra = {} if exporter == "dynamo" else {"do_constant_folding": False}
    path = export(model, (x,), folder / "mlp.onnx", exporter, input_names=["x"], output_names=["y"], **extra)
    return model, import_onnx(path), x, folder


def assert_equal_in_every_mode(adapted, x, expected, folder=None, label=""):
    """``adapted`` (a module with a PEFT adapter loaded) called on the torch tensor ``x`` in each
    ``lora_mode`` (merge / keep / inputs) gives ``expected``; with ``folder``, so does its
    ``lora="inputs"`` export (input ``x``) run by plain ONNX Runtime with the adapter written as an
    ``.onnx_adapter`` file active."""
    for mode in ("merge", "keep", "inputs"):
        module = adapted.map(lambda p, q: q)
        set_session_config(module, SessionConfig(lora_mode=mode))
        np.testing.assert_allclose(module(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL,
                                   err_msg=f"{label} {mode}".strip())
    if folder is not None:
        path = export_onnx(adapted, folder / "inputs.onnx", x.numpy(), lora="inputs")
        options, keep = run_options(write_onnx_adapter(adapted, folder / "a.onnx_adapter"))
        np.testing.assert_allclose(session(path).run(None, {"x": x.numpy()}, options)[0], expected, atol=ATOL)


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: f"r{s[0]}-a{s[1]}{'-rs' if s[2] else ''}{'-bias' if s[3] else ''}")
def test_peft_adapters_on_a_torch_exported_mlp_equal_peft_in_every_mode(mlp, spec, tmp_path):
    model, imported, x, _ = mlp
    r, alpha, rslora, lora_bias = spec
    reference = peft_model(model, tmp_path / "ad", r, alpha, rslora, lora_bias, ["fc1", "fc2"], seed=r)
    with torch.no_grad():
        expected = reference(x).numpy()
    adapted, report = load_peft_adapter(imported, tmp_path / "ad", return_report=True)
    assert sorted(report.matched) == ["base_model.model.fc1", "base_model.model.fc2"] and not report.unmatched
    assert_equal_in_every_mode(adapted, x, expected, tmp_path)


def test_peft_adapters_on_a_torch_exported_bert_equal_peft_in_every_mode(bert, tmp_path):
    model, imported, ids, _ = bert
    targets = ["query", "value", "dense"]
    for r, alpha, rslora, lora_bias in ADAPTERS:
        reference = peft_model(model, tmp_path / f"r{r}", r, alpha, rslora, lora_bias, targets, seed=10 + r)
        with torch.no_grad():
            expected = reference(ids).numpy()
        # the pooler is not in the exported graph (only the last hidden state is an output)
        adapted, report = load_peft_adapter(imported, tmp_path / f"r{r}", allow_partial=True, return_report=True)
        assert len(report.matched) == 5  # query, value, 3 dense layers
        assert report.unmatched == ["base_model.model.bert.pooler.dense"]
        assert_equal_in_every_mode(adapted, ids, expected, label=f"r{r}")


def assert_switching_equals_peft(model, imported, x, input_name, targets, folder, seed, **export_kwargs):
    """One ``lora="inputs"`` export of ``imported``, one ORT session, the three PEFT adapters
    of :data:`ADAPTERS` and none active in turn: each run equals PEFT's forward (none:
    ``disable_adapter()``, and the plain torch model)."""
    references, files = [], []
    for r, alpha, rslora, lora_bias in ADAPTERS:
        references.append(peft_model(model, folder / f"r{r}", r, alpha, rslora, lora_bias, targets, seed=seed + r))
        adapted = load_peft_adapter(imported, folder / f"r{r}", allow_partial=True)
        files.append(write_onnx_adapter(adapted, folder / f"r{r}.onnx_adapter"))
    # exported once, from the module holding the lora_bias adapter (it has every factor input)
    path = export_onnx(adapted, folder / "inputs.onnx", x.numpy(), lora="inputs", **export_kwargs)
    sess = session(path)
    feeds = {input_name: x.numpy()}
    for index in (0, 1, 2, None, 1, 0):
        options, keep = run_options(None if index is None else files[index])
        got = sess.run(None, feeds, options)[0]
        reference = references[0 if index is None else index]
        with torch.no_grad():
            if index is None:
                with reference.disable_adapter():
                    expected = reference(x).numpy()
            else:
                expected = reference(x).numpy()
        np.testing.assert_allclose(got, expected, atol=ATOL, err_msg=str(index))
    with torch.no_grad():  # and "none" is exactly the base model's output
        np.testing.assert_allclose(sess.run(None, feeds)[0], model(x).numpy(), atol=ATOL)


def test_one_inputs_export_of_bert_switches_among_three_peft_adapters_and_none(bert, tmp_path):
    model, imported, ids, _ = bert
    assert_switching_equals_peft(model, imported, ids, "input_ids", ["query", "value", "dense"], tmp_path, seed=20,
                                 dynamic_axes={"input_ids": {0: "batch"}})


def test_one_inputs_export_of_an_mlp_switches_among_three_peft_adapters_and_none(mlp, tmp_path):
    model, imported, x, _ = mlp
    assert_switching_equals_peft(model, imported, x, "x", ["fc1", "fc2"], tmp_path, seed=40)


class BiasFreeMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8, bias=False)
        self.fc2 = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_peft_adapter_finds_bias_free_linears_that_the_dynamo_exporter_renamed(tmp_path):
    """dynamo writes ``MatMul(x, val_N)`` for a bias-free ``nn.Linear`` on 3-d inputs: no bias
    and no node name tell the module, only the node's ``name_scopes`` metadata does."""
    model = randomize(BiasFreeMlp().eval(), seed=7)
    x = torch.randn(2, 3, 6)
    imported = import_onnx(export(model, (x,), tmp_path / "m.onnx", "dynamo", input_names=["x"], output_names=["y"]))
    assert not any(name.endswith(".weight") for name in imported.onnx_names.values())  # renamed: val_N
    reference = peft_model(model, tmp_path / "ad", 4, 6, False, False, ["fc1", "fc2"], seed=8)
    with torch.no_grad():
        expected = reference(x).numpy()
    adapted, report = load_peft_adapter(imported, tmp_path / "ad", return_report=True)
    assert sorted(report.matched) == ["base_model.model.fc1", "base_model.model.fc2"]
    np.testing.assert_allclose(adapted(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL)


class OurMlp(Module):
    def __init__(self):
        from onnxparam.nn import Linear

        self.fc1 = Linear(6, 8)
        self.fc2 = Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def test_adapters_trained_here_load_in_peft_and_give_the_same_outputs(tmp_path):
    from onnxparam import save_peft_adapter
    from onnxparam.autodiff import grad
    from onnxparam.optim import Adam

    torch_model = randomize(Mlp().eval(), seed=3)
    ours = with_torch_weights(OurMlp(), torch_model).apply_lora(LoraConfig(rank=4, alpha=6.0, seed=0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    target = rng.normal(size=(16, 8)).astype(np.float32)

    def loss(model, xs, ts):
        diff = model(xs) - ts
        return (diff * diff).mean()

    optim = Adam(lr=5e-2)
    for _ in range(5):
        _, grads = grad(loss, ours, x, target)
        ours = optim.step(ours, grads)
    assert np.abs(ours.fc2.weight.adapter().b.val().to_numpy()).max() > 0  # it trained
    folder = save_peft_adapter(ours, tmp_path / "trained")
    with quiet():
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(folder)).eval()
    with torch.no_grad():
        expected = loaded(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL)
    # and back: the folder loads here onto the plain module with the same result
    back = load_peft_adapter(with_torch_weights(OurMlp(), torch_model), folder)
    np.testing.assert_allclose(back(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL)


def test_named_adapters_switch_disable_and_delete_like_peft(tmp_path):
    from onnxparam import LoraAdapterSet

    torch_model = randomize(Mlp().eval(), seed=4)
    ours = with_torch_weights(OurMlp(), torch_model)
    for name, (r, alpha, rslora, lora_bias) in zip(("one", "two"), ADAPTERS[:2]):
        peft_model(torch_model, tmp_path / name, r, alpha, rslora, lora_bias, ["fc1", "fc2"], seed=30 + r)
    with quiet():
        reference = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(tmp_path / "one"),
                                                   adapter_name="one").eval()
        reference.load_adapter(str(tmp_path / "two"), adapter_name="two")
    adapters = LoraAdapterSet().add("one", load_peft_adapter(ours, tmp_path / "one")) \
                               .add("two", load_peft_adapter(ours, tmp_path / "two"))
    x = torch.randn(4, 6)
    xt = Tensor.from_numpy(x.numpy())
    module = ours
    for name in ("two", "one", None, "two"):
        module = adapters.activate(module, name)
        with torch.no_grad():
            if name is None:
                with reference.disable_adapter():
                    expected = reference(x).numpy()
            else:
                reference.set_adapter(name)
                expected = reference(x).numpy()
        np.testing.assert_allclose(module(xt).to_numpy(), expected, atol=ATOL, err_msg=str(name))
    reference.delete_adapter("one")
    adapters = adapters.delete("one")
    assert adapters.names == ["two"] == list(reference.peft_config)
    with pytest.raises(KeyError, match=r"no adapter named 'one'; the set holds \['two'\]"):
        adapters.activate(module, "one")


class TorchEmbedLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids))


class OurEmbedLinear(Module):
    def __init__(self):
        from onnxparam.nn import Embedding, Linear

        self.emb = Embedding(10, 6)
        self.fc = Linear(6, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_embedding_and_linear_adapters_saved_here_load_in_peft_with_the_same_outputs(tmp_path):
    from onnxparam import Param, save_peft_adapter

    torch_model = randomize(TorchEmbedLinear().eval(), seed=5)
    ours = with_torch_weights(OurEmbedLinear(), torch_model, transposed=lambda path, _: path == "fc.weight")
    rng = np.random.default_rng(6)
    adapted = ours.apply_lora(LoraConfig(rank=3, alpha=5.0, use_rslora=True, seed=0)).map(
        lambda path, p: Param(p.id, value=Tensor.from_numpy(rng.normal(0, 0.5, size=p.lazy_shape()).astype(np.float32)),
                              require_grad=True) if ".lora." in path else p)
    folder = save_peft_adapter(adapted, tmp_path / "saved")
    with quiet():
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(folder)).eval()
    ids = torch.tensor([[1, 4, 9], [0, 7, 3]])
    with torch.no_grad():
        expected = loaded(ids).numpy()
    np.testing.assert_allclose(adapted(Tensor.from_numpy(ids.numpy())).to_numpy(), expected, atol=ATOL)


def test_a_module_owns_its_named_adapters_through_copies_loads_saves_and_exports(tmp_path):
    from onnxparam import Param, save_peft_adapter

    torch_model = randomize(Mlp().eval(), seed=9)
    base = with_torch_weights(OurMlp(), torch_model)
    names = ("one", "two", "three")
    for name, (r, alpha, rslora, lora_bias) in zip(names, ADAPTERS):
        peft_model(torch_model, tmp_path / name, r, alpha, rslora, lora_bias, ["fc1", "fc2"], seed=50 + r)
    with quiet():
        reference = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(tmp_path / "one"),
                                                   adapter_name="one").eval()
        for name in names[1:]:
            reference.load_adapter(str(tmp_path / name), adapter_name=name)
    x = torch.randn(4, 6)
    xt = Tensor.from_numpy(x.numpy())

    def peft_out(name):
        with torch.no_grad():
            if name is None:
                with reference.disable_adapter():
                    return reference(x).numpy()
            reference.set_adapter(name)
            return reference(x).numpy()

    module = base
    for name in names:
        module = module.add_adapter(name, load_peft_adapter(base, tmp_path / name))
    assert module.lora_adapters.names == list(names) and module.active_adapter is None
    np.testing.assert_allclose(module(xt).to_numpy(), peft_out(None), atol=ATOL)  # added, not active
    # copies (map), records (into_record / load_record) and switching keep the set
    module = module.set_adapter("two").map(lambda path, p: p)
    assert module.active_adapter == "two"
    reloaded = base
    for name in names:
        reloaded = reloaded.add_adapter(name, load_peft_adapter(base, tmp_path / name))
    module = reloaded.set_adapter("two").load_record(module.into_record())
    for name in ("two", "one", None, "three", "two"):
        module = module.set_adapter(name)
        np.testing.assert_allclose(module(xt).to_numpy(), peft_out(name), atol=ATOL, err_msg=str(name))
    # the active adapter lives in the params: new values (training, load_record) survive a switch
    module = module.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(2 * p.val().to_numpy()), require_grad=True)
                        if path == "fc1.weight.lora.b" else p)
    module = module.set_adapter("one").set_adapter("two")
    with torch.no_grad():
        reference.set_adapter("two")
        reference.base_model.model.fc1.lora_B["two"].weight.mul_(2)
    np.testing.assert_allclose(module(xt).to_numpy(), peft_out("two"), atol=ATOL)
    # saved by name, PEFT loads each folder with PEFT's own outputs
    for name in ("three", "two"):
        folder = save_peft_adapter(module, tmp_path / f"saved-{name}", adapter_name=name)
        with quiet():
            loaded = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(folder)).eval()
        with torch.no_grad():
            np.testing.assert_allclose(loaded(x).numpy(), peft_out(name), atol=ATOL, err_msg=name)
    # exported once (lora="inputs"), one .onnx_adapter per name, switched in one session
    path = export_onnx(module, tmp_path / "inputs.onnx", x.numpy(), lora="inputs")
    files = {name: write_onnx_adapter(module, tmp_path / f"{name}.onnx_adapter", adapter_name=name) for name in names}
    sess = session(path)
    for name in ("one", "three", None, "two"):
        options, keep = run_options(files.get(name))
        np.testing.assert_allclose(sess.run(None, {"x": x.numpy()}, options)[0], peft_out(name), atol=ATOL,
                                   err_msg=str(name))
    # deleting the active adapter leaves the base model; merging drops the named set
    module = module.set_adapter("one")
    merged = module.merge_lora()
    assert merged.lora_adapters.names == [] and merged.active_adapter is None
    np.testing.assert_allclose(merged(xt).to_numpy(), peft_out("one"), atol=ATOL)
    module = module.delete_adapter("one")
    reference.set_adapter("two")  # NOTE: PEFT would make another adapter active; here none is
    reference.delete_adapter("one")
    assert module.lora_adapters.names == ["two", "three"] == list(reference.peft_config)
    assert module.active_adapter is None
    np.testing.assert_allclose(module(xt).to_numpy(), peft_out(None), atol=ATOL)
    with pytest.raises(KeyError, match=r"no adapter named 'one'; the set holds \['two', 'three'\]"):
        module.set_adapter("one")


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_peft_conv_and_lora_bias_adapters_on_a_torch_exported_conv_net_equal_peft_in_every_mode(exporter, tmp_path):
    model = randomize(ConvNet().eval(), seed=11)
    x = torch.randn(2, 2, 5, 5)
    imported = import_onnx(export(model, (x,), tmp_path / "conv.onnx", exporter, input_names=["x"], output_names=["y"]))
    reference = peft_model(model, tmp_path / "ad", 3, 5, False, True, ["conv", "fc"], seed=12)
    with torch.no_grad():
        expected = reference(x).numpy()
    adapted, report = load_peft_adapter(imported, tmp_path / "ad", return_report=True)
    assert sorted(report.matched) == ["base_model.model.conv", "base_model.model.fc"]
    assert {path for path, p in adapted.named_params() if p.adapter() is not None} == {
        "conv.weight", "conv.bias", "fc.weight", "fc.bias"}  # lora_bias on both layers
    assert_equal_in_every_mode(adapted, x, expected, tmp_path)


def test_every_named_adapter_saves_in_peft_multi_adapter_layout_and_loads_back(tmp_path):
    from onnxparam import load_peft_adapters, save_peft_adapters

    torch_model = randomize(Mlp().eval(), seed=13)
    base = with_torch_weights(OurMlp(), torch_model)
    names = ("default", "sql", "chat")
    for name, (r, alpha, rslora, lora_bias) in zip(names, ADAPTERS):
        peft_model(torch_model, tmp_path / "given" / name, r, alpha, rslora, lora_bias, ["fc1", "fc2"], seed=60 + r)
    module = base
    for name in names:
        module = module.add_adapter(name, load_peft_adapter(base, tmp_path / "given" / name))
    folder = save_peft_adapters(module, tmp_path / "saved")
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["chat", "sql"]  # "default" at the top
    with quiet():  # PEFT reads the layout it writes: from_pretrained + load_adapter by sub-folder
        reference = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(folder)).eval()
        for name in names[1:]:
            reference.load_adapter(str(folder / name), adapter_name=name)
    back = load_peft_adapters(base, folder)
    assert sorted(back.lora_adapters.names) == sorted(names) and back.active_adapter is None
    x = torch.randn(4, 6)
    for name in names:
        reference.set_adapter(name)
        with torch.no_grad():
            expected = reference(x).numpy()
        np.testing.assert_allclose(back.set_adapter(name)(Tensor.from_numpy(x.numpy())).to_numpy(), expected,
                                   atol=ATOL, err_msg=name)
        with quiet():  # and each equals PEFT on the adapter as it was given
            given = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(tmp_path / "given" / name)).eval()
        with torch.no_grad():
            np.testing.assert_allclose(given(x).numpy(), expected, atol=ATOL, err_msg=name)


class EmbedNet(torch.nn.Module):
    """An embedding, a Linear with a bias and a bias-free one on 3-d activations: torch's
    exporters rename both Linear weights (dynamo ``val_N``, TorchScript with constant folding
    ``onnx::MatMul_N``)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 6)
        self.q = torch.nn.Linear(6, 8)
        self.k = torch.nn.Linear(8, 8, bias=False)

    def forward(self, ids):
        return self.k(torch.tanh(self.q(self.emb(ids))))


@pytest.fixture(scope="module", params=EXPORTERS)
def embed_net(request, tmp_path_factory):
    model = randomize(EmbedNet().eval(), seed=21)
    ids = torch.tensor([[1, 4, 19, 7], [0, 3, 3, 12]])
    folder = tmp_path_factory.mktemp(f"embed-{request.param}")
    path = export(model, (ids,), folder / "net.onnx", request.param, input_names=["ids"], output_names=["y"])
    return model, import_onnx(path), ids


@pytest.mark.parametrize("targets, lora_bias", [(["emb", "q", "k"], False), (["q"], True)],
                         ids=["embedding", "lora_bias"])
def test_peft_adapters_loaded_on_a_torch_exported_model_save_back_to_peft_with_the_same_outputs(
        embed_net, targets, lora_bias, tmp_path):
    from safetensors.numpy import load_file

    from onnxparam import save_peft_adapter

    model, imported, ids = embed_net
    assert not {"q.weight", "k.weight"} & set(imported.onnx_names.values())  # both renamed by the exporter
    reference = peft_model(model, tmp_path / "given", 3, 7, False, lora_bias, targets, seed=22)
    with torch.no_grad():
        expected = reference(ids).numpy()
    adapted = load_peft_adapter(imported, tmp_path / "given")
    folder = save_peft_adapter(adapted, tmp_path / "saved")
    given = load_file(str(tmp_path / "given" / "adapter_model.safetensors"))
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in given.items()}  # PEFT's keys and layout
    with quiet():
        back = peft.PeftModel.from_pretrained(copy.deepcopy(model), str(folder)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(ids).numpy(), expected, atol=ATOL)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(6, 6)
        self.ff = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 6))

    def forward(self, x):
        return x + self.ff(torch.tanh(self.qkv(x)))


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.b(x)


def test_a_sequential_of_blocks_export_saves_back_as_the_peft_adapter_it_loaded(tmp_path):
    """torch's TorchScript exporter renames each 3-d ``nn.Linear`` weight ``onnx::MatMul_N`` and
    names its node ``/b/b.0/qkv/MatMul``: the graph names the weight both ``b.b.0.qkv`` (the
    node) and ``b.0.qkv`` (its bias). save_peft_adapter writes it for the module whose bias the
    graph holds, as load_peft_adapter reads it. Oracle: real PEFT loading the saved folder gives
    the outputs of torch PEFT with the original adapter."""
    from onnxparam import save_peft_adapter

    base = randomize(Blocks().eval(), seed=21)
    x = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(22))
    reference = peft_model(base, tmp_path / "peft", 2, 5, False, False, ["qkv", "ff.0", "ff.2"], seed=23)
    imported = import_onnx(export(base, (x,), tmp_path / "m.onnx", "torchscript", input_names=["x"]))
    assert any(n.startswith("onnx::MatMul") for n in imported.onnx_names.values())
    folder = save_peft_adapter(load_peft_adapter(imported, tmp_path / "peft"), tmp_path / "back")
    with quiet():
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
    with torch.no_grad():
        expected, got = reference(x).numpy(), loaded(x).numpy()
    assert np.abs(expected - base(x).detach().numpy()).max() > 1e-2  # the adapter changes the output
    np.testing.assert_allclose(got, expected, atol=ATOL)
