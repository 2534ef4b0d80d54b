"""Batched LoRA on Hugging Face models served with a padding mask (``attention_mask`` input).

``transformers`` builds the attention mask as ``padding_mask[batch_idx, kv_idx]`` with
``batch_idx = arange(batch)``: TorchScript writes a ``Gather`` of the flattened mask, dynamo a
``GatherND``; the batch analysis (``onnxparam/lora/_batch_axis.py``, ``_batch_index.py``) must
see that row ``i`` of the result is row ``i`` of the mask.

Oracle: PEFT's mixed-batch forward (``model(..., adapter_names=rows)``) in torch, with two
adapters (ranks 2 / 4, one rsLoRA) saved by PEFT and loaded with ``load_peft_adapter``; the
"no adapter" rows also equal the plain torch model. The batched export runs in plain ONNX
Runtime; the runtime's ``module(..., adapter_index=...)`` runs the same rows. Batch and sequence
differ from the export's example (dynamic dims). BERT is compared at every position (padded
ones too: BERT is deterministic there), LLaMA and GPT-2 (left padding) at the unpadded positions,
RoBERTa and DistilBERT (left padding) at every position. TorchScript files of all, dynamo (slow) of BERT, LLaMA.
A value mixing the batch's rows (a mean over the batch, a reversed ``arange(batch)`` gather)
is still refused. Learned queries expanded to the batch (``queries.expand(x.shape[0], -1, -1)``,
DETR / Perceiver) give each row its adapter as PEFT does; projected before the expand (no batch
at the adapted weight) they are refused. A ``ScatterND`` writing rows by index loses the batch
(it used to pass whenever its output's dim 0 was named as the batch), a ``ScatterElements``
within rows keeps it (oracle: ONNX Runtime, which rows of the output a perturbed input row moves).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from torch_peft import import_with_adapters, peft_lora, peft_with_adapters, quiet, randomize, session  # noqa: E402

from onnxparam import LoraError, Tensor, export_onnx, import_onnx, load_peft_adapter  # noqa: E402

ATOL = 1e-5
ADAPTERS = {"a1": (2, 5, False), "a2": (4, 3, True)}  # name: (r, alpha, use_rslora)
ROWS = ["a2", "__base__", "a1", "a2", "__base__", "a1"]  # PEFT's adapter_names, one per row
INDEX = np.asarray([0 if r == "__base__" else list(ADAPTERS).index(r) + 1 for r in ROWS], dtype=np.int64)


class Bert(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state


class Llama(torch.nn.Module):
    """A model's last hidden state (``LlamaModel``, ``GPT2Model``, ``RobertaModel`` ...) from ids and a
    padding mask."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def bert():
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16)
    torch.manual_seed(0)
    model = randomize(Bert(transformers.BertModel(config, add_pooling_layer=False)).eval(), seed=1)
    return model, ["query", "value", "dense", "word_embeddings"]


def llama():
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      use_cache=False)
    torch.manual_seed(0)
    model = randomize(Llama(transformers.LlamaModel(config)).eval(), seed=2, std=0.2)
    return model, ["q_proj", "v_proj", "o_proj", "down_proj"]


def roberta():
    config = transformers.RobertaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=24, max_position_embeddings=40, pad_token_id=1)
    torch.manual_seed(0)
    model = randomize(Llama(transformers.RobertaModel(config, add_pooling_layer=False)).eval(), seed=4, std=0.2)
    return model, ["query", "value", "dense"]


def distilbert():
    config = transformers.DistilBertConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, hidden_dim=24,
                                           max_position_embeddings=40)
    torch.manual_seed(0)
    return randomize(Llama(transformers.DistilBertModel(config)).eval(), seed=5, std=0.2), ["q_lin", "v_lin", "lin1"]


def gpt2():
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return randomize(Llama(transformers.GPT2Model(config)).eval(), seed=3, std=0.2), ["c_attn", "c_proj"]


def feeds(name: str, rows: int, seq: int) -> dict:
    """Inputs of ``rows`` sequences of length ``seq``, every other one padded (BERT on the right,
    LLaMA on the left), seeded by the shape."""
    rng = np.random.default_rng(rows * 100 + seq)
    ids = rng.integers(1, 40, size=(rows, seq)).astype(np.int64)
    mask = np.ones((rows, seq), dtype=np.int64)
    for row in range(1, rows, 2):
        cut = 1 + row % (seq - 1)
        if name == "bert":
            mask[row, seq - cut:] = 0
        else:
            mask[row, :cut] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if name == "bert":
        types = np.zeros((rows, seq), dtype=np.int64)
        types[:, seq // 2:] = 1
        out["token_type_ids"] = types
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``{(model, exporter): (torch model, PEFT model, our module with both adapters, file)}``."""
    cache = {}

    def get(name, exporter):
        if (name, exporter) not in cache:
            model, targets = {"bert": bert, "llama": llama, "gpt2": gpt2, "roberta": roberta,
                              "distilbert": distilbert}[name]()
            folder = tmp_path_factory.mktemp(f"mask-{name}-{exporter}")
            example = {k: torch.from_numpy(v) for k, v in feeds(name, 4, 6).items()}
            path = folder / "model.onnx"
            kwargs = {"input_names": list(example), "output_names": ["hidden"]}
            if exporter == "dynamo":
                pytest.importorskip("onnxscript")
                batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
                kwargs["dynamic_shapes"] = tuple({0: batch, 1: seq} for _ in example)
                kwargs["verbose"] = False
            else:
                kwargs["dynamic_axes"] = {k: {0: "batch", 1: "seq"} for k in example}
            with quiet(), contextlib.redirect_stdout(None):
                torch.onnx.export(model, tuple(example.values()), str(path), dynamo=exporter == "dynamo", **kwargs)
            for k, (adapter, (r, alpha, rslora)) in enumerate(ADAPTERS.items()):
                peft_lora(model, targets, r, alpha, rslora=rslora, seed=40 + k, folder=folder / adapter)
            reference = peft_with_adapters(model, {a: folder / a for a in ADAPTERS})
            module = import_with_adapters(path, {adapter: folder / adapter for adapter in ADAPTERS})
            cache[(name, exporter)] = (model, reference, module, folder)
        return cache[(name, exporter)]

    return get


def expected_rows(model, reference, inputs: dict):
    """PEFT's mixed batch and the plain torch model on ``inputs``."""
    args = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with torch.no_grad():
        mixed = reference(**args, adapter_names=list(ROWS)).numpy()
        plain = model(**args).numpy()
    return mixed, plain


def check(name, got, mixed, plain, mask):
    keep = mask.astype(bool) if name in ("llama", "gpt2") else np.ones_like(mask, dtype=bool)
    for row, adapter in enumerate(ROWS):
        np.testing.assert_allclose(got[row][keep[row]], mixed[row][keep[row]], atol=ATOL, rtol=0,
                                   err_msg=f"row {row} ({adapter})")
        if adapter == "__base__":
            np.testing.assert_allclose(got[row][keep[row]], plain[row][keep[row]], atol=ATOL, rtol=0)


CASES = [("bert", "torchscript"), ("llama", "torchscript"), ("gpt2", "torchscript"), ("roberta", "torchscript"),
         ("distilbert", "torchscript"),
         pytest.param("bert", "dynamo", marks=pytest.mark.slow),
         pytest.param("llama", "dynamo", marks=pytest.mark.slow)]  # dynamo: ~10 s per model to build


@pytest.mark.parametrize("name,exporter", CASES)
def test_module_call_with_adapter_index_and_a_padding_mask_gives_pefts_rows(built, name, exporter):
    model, reference, module, _ = built(name, exporter)
    inputs = feeds(name, len(ROWS), 7)
    mixed, plain = expected_rows(model, reference, inputs)
    got = module(**{k: Tensor.from_numpy(v) for k, v in inputs.items()},
                 adapter_index=[None if r == "__base__" else r for r in ROWS]).to_numpy()
    check(name, got, mixed, plain, inputs["attention_mask"])


@pytest.mark.parametrize("name,exporter", CASES)
def test_batched_export_with_a_padding_mask_gives_pefts_rows(built, name, exporter, tmp_path):
    model, reference, module, _ = built(name, exporter)
    example = feeds(name, 4, 6)
    path = export_onnx(module, tmp_path / "batched.onnx", *example.values(), input_names=list(example),
                       lora="batched")
    run = session(path)
    for rows_seq in (7, 3):
        inputs = feeds(name, len(ROWS), rows_seq)
        mixed, plain = expected_rows(model, reference, inputs)
        got = run.run(None, {**inputs, "adapter_index": INDEX})[0]
        check(name, got, mixed, plain, inputs["attention_mask"])


class MeanOverBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True))


class ReversedRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        n = x.shape[0]
        return self.fc(x[torch.arange(n - 1, -1, -1)])  # an index built from the batch's size, not the identity


@pytest.mark.parametrize("net", [MeanOverBatch, ReversedRows])
def test_a_value_mixing_the_batchs_rows_is_still_refused(net, tmp_path):
    model = randomize(net().eval(), seed=5)
    path = tmp_path / "net.onnx"
    with quiet(), contextlib.redirect_stdout(None):
        torch.onnx.export(model, (torch.randn(3, 4),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    peft_lora(model, ["fc"], 2, 4, seed=7, folder=tmp_path / "a1")
    imported = import_onnx(path)
    module = imported.add_adapter("a1", load_peft_adapter(imported, tmp_path / "a1"))
    x = Tensor.from_numpy(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
    with pytest.raises(LoraError, match="batch axis was lost at node"):
        module(x, adapter_index=["a1", None, "a1"])
    with pytest.raises(LoraError, match="batch axis was lost at node"):
        export_onnx(module, tmp_path / "batched.onnx", lora="batched")


class Queries(torch.nn.Module):
    """Learned queries (DETR / Perceiver): ``q_proj(queries.expand(batch, -1, -1))`` (``"repeat"``:
    ``queries.repeat(batch, 1, 1)``, HF DETR's) attending over ``k_proj(x)``; ``"before"``:
    ``q_proj(queries).expand(...)``, no batch at ``q_proj``."""

    def __init__(self, mode: str = "expand"):
        super().__init__()
        self.mode = mode
        self.queries = torch.nn.Parameter(torch.randn(1, 3, 8))
        self.q_proj, self.k_proj, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        b = x.shape[0]
        if self.mode == "before":
            q = self.q_proj(self.queries).expand(b, -1, -1)
        else:
            q = self.q_proj(self.queries.expand(b, -1, -1) if self.mode == "expand" else self.queries.repeat(b, 1, 1))
        att = torch.softmax(q @ self.k_proj(x).transpose(1, 2) / 8 ** 0.5, -1)
        return self.out(att @ x)


def queries_module(tmp_path, exporter: str, mode: str = "expand"):
    model = randomize(Queries(mode).eval(), seed=6)
    path = tmp_path / "queries.onnx"
    kwargs = {"input_names": ["x"], "output_names": ["y"]}
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
        kwargs.update(dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},), verbose=False)
    else:
        kwargs["dynamic_axes"] = {"x": {0: "batch", 1: "seq"}}
    with quiet(), contextlib.redirect_stdout(None):
        torch.onnx.export(model, (torch.randn(4, 5, 8),), str(path), dynamo=exporter == "dynamo", **kwargs)
    for k, (adapter, (r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        peft_lora(model, ["q_proj", "k_proj", "out"], r, alpha, rslora=rslora, seed=50 + k, folder=tmp_path / adapter)
    reference = peft_with_adapters(model, {a: tmp_path / a for a in ADAPTERS})
    module = import_with_adapters(path, {adapter: tmp_path / adapter for adapter in ADAPTERS})
    return model, reference, module, path


@pytest.mark.parametrize("exporter,mode", [("torchscript", "expand"), ("torchscript", "repeat"),
                                           pytest.param("dynamo", "expand", marks=pytest.mark.slow)])
def test_learned_queries_expanded_to_the_batch_take_each_rows_adapter(exporter, mode, tmp_path):
    model, reference, module, _ = queries_module(tmp_path, exporter, mode)
    x = np.random.default_rng(1).normal(size=(len(ROWS), 7, 8)).astype(np.float32)
    with torch.no_grad():
        mixed = reference(torch.from_numpy(x), adapter_names=list(ROWS)).numpy()
        plain = model(torch.from_numpy(x)).numpy()
    got = module(Tensor.from_numpy(x), adapter_index=[None if r == "__base__" else r for r in ROWS]).to_numpy()
    check("queries", got, mixed, plain, np.ones(got.shape[:2], dtype=np.int64))
    path = export_onnx(module, tmp_path / "batched.onnx", x[:4, :5], input_names=["x"], lora="batched")
    got = session(path).run(None, {"x": x, "adapter_index": INDEX})[0]
    check("queries", got, mixed, plain, np.ones(got.shape[:2], dtype=np.int64))


def test_queries_projected_before_the_expand_are_refused(tmp_path):
    """No batch at ``q_proj``: one row for every batch element (PEFT cannot mix adapters there either)."""
    _, _, module, _ = queries_module(tmp_path, "torchscript", "before")
    x = Tensor.from_numpy(np.zeros((3, 5, 8), dtype=np.float32))
    with pytest.raises(LoraError, match="does not depend on the batch input"):
        module(x, adapter_index=["a1", None, "a2"])


def scatter_model(op_type: str):
    """``y = op(x, ...)`` on ``x [batch, 4]`` with ``y`` declared ``[batch, 4]`` (the fallback's
    test, dim 0 the batch, holds): ``ScatterND`` writes row ``batch - 1 - i`` into row ``i``
    (torch's ``y[arange(b - 1, -1, -1)] = x``); ``ScatterElements`` (axis 1) moves entries within
    each row."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    inits = [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("one", TensorProto.INT64, [], [1]),
             helper.make_tensor("minus", TensorProto.INT64, [], [-1]),
             helper.make_tensor("last", TensorProto.INT64, [1], [-1])]
    if op_type == "ScatterND":
        nodes = [helper.make_node("Shape", ["x"], ["shape"]),
                 helper.make_node("Gather", ["shape", "zero"], ["b"], axis=0),
                 helper.make_node("Sub", ["b", "one"], ["top"]),
                 helper.make_node("Range", ["top", "minus", "minus"], ["rev"]),
                 helper.make_node("Unsqueeze", ["rev", "last"], ["idx"]),
                 helper.make_node("ScatterND", ["x", "idx", "x"], ["y"])]
    else:
        inits.append(helper.make_tensor("k", TensorProto.INT64, [1], [3]))
        nodes = [helper.make_node("Shape", ["x"], ["shape"]),
                 helper.make_node("ConstantOfShape", ["shape"], ["idx"],
                                  value=helper.make_tensor("v", TensorProto.INT64, [1], [3])),
                 helper.make_node("ScatterElements", ["x", "idx", "x"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op_type,mixes", [("ScatterND", True), ("ScatterElements", False)])
def test_a_scatter_across_rows_loses_the_batch_one_within_rows_keeps_it(op_type, mixes):
    """Oracle: ONNX Runtime on the graph, row 2 of ``x`` perturbed: row 0 of ``y`` changes
    exactly when the analysis must say the batch is lost."""
    import onnx_ir as ir
    import onnxruntime as ort

    from onnxparam.lora._batch_axis import batch_layouts

    model = scatter_model(op_type)
    run = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    bumped = x.copy()
    bumped[2] += 10
    changed = not np.array_equal(run.run(None, {"x": x})[0][0], run.run(None, {"x": bumped})[0][0])
    assert changed == mixes
    graph = ir.from_proto(model).graph
    layout = batch_layouts(graph)[id(graph.outputs[0])]
    assert (layout.kind == "unknown") == mixes, layout
    assert mixes or (layout.kind, layout.axis) == ("axis", 0)
