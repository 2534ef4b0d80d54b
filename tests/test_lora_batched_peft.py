"""Many adapters in one batch (``lora="batched"``, ``module(x, adapter_index=...)``) against
PEFT's mixed-batch forward.

Oracle: ``peft.PeftModel`` in torch with three adapters loaded (ranks 2 / 4 / 8, alpha != rank,
one rsLoRA) and ``model(ids, adapter_names=[...])``: PEFT runs each row with its own adapter
(``"__base__"``: none). The models are a tiny BERT and a tiny LLaMA-style decoder
(``transformers``, random weights; BERT's word-embedding table adapted too: an embedding
``Gather``) written by torch's TorchScript exporter (dynamo: ``slow``);
the adapters are PEFT's saved folders, loaded here with ``load_peft_adapter`` and named with
``add_adapter``. One batched ONNX file, run by plain ONNX Runtime, and the runtime's
``module(ids, adapter_index=names)`` must give each row PEFT's output for its adapter within
1e-5; the base rows also equal the plain torch model's rows. The batch and sequence sizes differ
from the export's example (dynamic dims).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import onnxruntime as ort  # noqa: E402
from torch_peft import (  # noqa: E402
    Hidden, export, ids_for, import_with_adapters, peft_lora, peft_rows, peft_with_adapters, randomize,
)

from onnxparam import Tensor, check_batched_adapters, export_onnx  # noqa: E402
from onnxparam import write_batched_adapter  # noqa: E402
from onnxparam.lora._batched import batched_metadata  # noqa: E402

ATOL = 1e-5

# name: (r, alpha, use_rslora)
ADAPTERS = {"sql": (2, 5, False), "chat": (4, 3, True), "code": (8, 12, False)}
ROWS = ["chat", "__base__", "sql", "code", "__base__", "sql"]  # PEFT's adapter_names, one per row


def bert():
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16)
    torch.manual_seed(0)
    return randomize(Hidden(transformers.BertModel(config)).eval(), seed=1), ["query", "value", "dense", "word_embeddings"]


def llama():
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = randomize(Hidden(transformers.LlamaModel(config)).eval(), seed=2, std=0.2)
    return model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


MODELS = {"bert": bert, "llama": llama}
CASES = [("bert", "torchscript"), ("llama", "torchscript"),
         pytest.param("bert", "dynamo", marks=pytest.mark.slow), pytest.param("llama", "dynamo", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def built(request, tmp_path_factory):
    """``{(model, exporter): (torch model, PEFT reference, our module with the three named
    adapters, folder)}``, built on first use."""
    cache = {}

    def get(name, exporter):
        if (name, exporter) not in cache:
            model, targets = MODELS[name]()
            folder = tmp_path_factory.mktemp(f"{name}-{exporter}")
            ids = torch.tensor([[1, 5, 7, 3, 9], [2, 8, 4, 6, 0]], dtype=torch.int64)
            path = export(model, (ids,), folder / "model.onnx", exporter, dynamic={0: "batch", 1: "seq"},
                          input_names=["input_ids"], output_names=["hidden"])
            for k, (adapter, (r, alpha, rslora)) in enumerate(ADAPTERS.items()):
                peft_lora(model, targets, r, alpha, rslora=rslora, seed=30 + k, folder=folder / adapter)
            reference = peft_with_adapters(model, {adapter: folder / adapter for adapter in ADAPTERS})
            module = import_with_adapters(path, {adapter: folder / adapter for adapter in ADAPTERS}, allow_partial=True)
            cache[(name, exporter)] = (model, reference, module, folder)
        return cache[(name, exporter)]

    return get


@pytest.mark.parametrize("name,exporter", CASES)
def test_batched_export_gives_each_row_pefts_output_for_its_adapter(built, name, exporter, tmp_path):
    model, reference, module, _ = built(name, exporter)
    path = export_onnx(module, tmp_path / "batched.onnx", lora="batched")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = list(ADAPTERS)
    for seq in (7, 3):  # neither the example's batch (2) nor its sequence (5)
        ids = ids_for(len(ROWS), seq)
        expected = peft_rows(reference, ids, ROWS)
        index = np.asarray([0 if r == "__base__" else names.index(r) + 1 for r in ROWS], dtype=np.int64)
        got = session.run(None, {"input_ids": ids.numpy(), "adapter_index": index})[0]
        for row, adapter in enumerate(ROWS):
            np.testing.assert_allclose(got[row], expected[row], atol=ATOL, rtol=0, err_msg=f"row {row} ({adapter})")
        with torch.no_grad():  # a base row is exactly the base model's
            plain = model(ids).numpy()
        base_rows = [i for i, r in enumerate(ROWS) if r == "__base__"]
        np.testing.assert_allclose(got[base_rows], plain[base_rows], atol=ATOL, rtol=0)
    # the stacked set as one .onnx_adapter (stack inputs named after the file's own weight names)
    # fits the export and, activated, gives the same rows
    file = write_batched_adapter(module, tmp_path / "set.onnx_adapter", model=path)
    shapes = check_batched_adapters(path, file)
    assert len(shapes) == 2 * len(batched_metadata(path)["targets"])
    options, adapter = ort.RunOptions(), ort.LoraAdapter()
    adapter.Load(str(file))
    options.add_active_adapter(adapter)
    ids = ids_for(len(ROWS), 4)
    np.testing.assert_allclose(session.run(None, {"input_ids": ids.numpy(), "adapter_index": index}, options)[0],
                               peft_rows(reference, ids, ROWS), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name,exporter", CASES[:2])
def test_module_call_with_adapter_index_gives_each_row_pefts_output(built, name, exporter):
    _, reference, module, _ = built(name, exporter)
    ids = ids_for(len(ROWS), 6)
    expected = peft_rows(reference, ids, ROWS)
    got = module(Tensor.from_numpy(ids.numpy()), adapter_index=[None if r == "__base__" else r for r in ROWS])
    np.testing.assert_allclose(got.to_numpy(), expected, atol=ATOL, rtol=0)
    # the same rows through integer indices, one row, and every row on one adapter (a length-1 index)
    names = list(ADAPTERS)
    index = np.asarray([0 if r == "__base__" else names.index(r) + 1 for r in ROWS], dtype=np.int64)
    np.testing.assert_allclose(module(Tensor.from_numpy(ids.numpy()), adapter_index=index).to_numpy(), expected,
                               atol=ATOL, rtol=0)
    np.testing.assert_allclose(module(Tensor.from_numpy(ids.numpy()[3:4]), adapter_index=["code"]).to_numpy(),
                               expected[3:4], atol=ATOL, rtol=0)
    np.testing.assert_allclose(module(Tensor.from_numpy(ids.numpy()), adapter_index="sql").to_numpy(),
                               peft_rows(reference, ids, ["sql"] * len(ROWS)), atol=ATOL, rtol=0)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_gemm_targets_of_a_torchscript_mlp_give_each_row_pefts_output(tmp_path):
    """TorchScript writes ``nn.Linear`` on 2-d inputs as ``Gemm transB=1``: the rows of its
    ``[batch, d]`` input are the batch rows."""
    import onnx

    model = randomize(Mlp().eval(), seed=3)
    x = torch.randn(2, 6)
    path = export(model, (x,), tmp_path / "mlp.onnx", "torchscript", dynamic={0: "batch"}, input_names=["x"],
                  output_names=["y"])
    assert {n.op_type for n in onnx.load(str(path)).graph.node} >= {"Gemm"}
    for k, (adapter, (r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        peft_lora(model, ["fc1", "fc2"], r, alpha, rslora=rslora, seed=60 + k, folder=tmp_path / adapter)
    names = list(ADAPTERS)
    reference = peft_with_adapters(model, {adapter: tmp_path / adapter for adapter in names})
    module = import_with_adapters(path, {adapter: tmp_path / adapter for adapter in names})
    batch = torch.randn(len(ROWS), 6)
    with torch.no_grad():
        expected = reference(batch, adapter_names=ROWS).numpy()
    index = np.asarray([0 if r == "__base__" else names.index(r) + 1 for r in ROWS], dtype=np.int64)
    exported = export_onnx(module, tmp_path / "batched.onnx", lora="batched")
    got = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"]).run(
        None, {"x": batch.numpy(), "adapter_index": index})[0]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    got = module(Tensor.from_numpy(batch.numpy()), adapter_index=index).to_numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
