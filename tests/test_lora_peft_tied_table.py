"""PEFT adapters on a tied embedding table (GPT-2's ``wte`` / ``lm_head``) of a torch-exported
file: read and written under the ``nn.Embedding`` that owns the table (fresh7 F6).

torch's dynamo exporter names the tied table's initializer ``lm_head.weight`` (its ``Gather``
has ``name_scopes`` ``['', 'wte', 'embedding']``; the projection reads a transposed copy),
TorchScript ``wte.weight`` (``Gather`` node ``/wte/Gather``). PEFT puts an Embedding LoRA on
``wte``; written under ``lm_head`` (an ``nn.Linear``) PEFT would wrap it as a Linear LoRA and
drop the factors with only a warning. Oracle: PEFT in torch: the adapters load here without a
``key_map`` and give PEFT's output; ``save_peft_adapter`` and ``write_batched_peft`` folders
loaded by PEFT reproduce each adapter's rows (``adapter_names=``) within 1e-5; a tied table whose
graph names no owning module is refused naming the table, unless ``key_map`` names it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import onnx_ir as ir  # noqa: E402
from torch_peft import export, peft_lora, peft_with_adapters, randomize  # noqa: E402
from torch_tied import VOCAB, TinyLm  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from onnxparam import (  # noqa: E402
    LoraError,
    Tensor,
    export_onnx,
    import_onnx,
    load_peft_adapter,
    save_peft_adapter,
    write_batched_peft,
)

ATOL = 1e-5
ROWS = ["s2", "__base__", "s1", "s2"]


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def tied(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tied-{request.param}")
    model = randomize(TinyLm().eval(), seed=5)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, VOCAB, size=(len(ROWS), 5)))
    path = export(model, (ids,), folder / "lm.onnx", request.param, dynamic={0: "batch"},
                  input_names=["ids"], output_names=["logits"])
    peft_lora(model, ["wte", "mlp"], 2, 4, seed=1, folder=folder / "s1")
    peft_lora(model, ["mlp"], 3, 2, seed=2, folder=folder / "s2")
    reference = peft_with_adapters(model, {"s1": folder / "s1", "s2": folder / "s2"})
    with torch.no_grad():
        expected = reference(ids, adapter_names=list(ROWS)).numpy()
    return request.param, path, model, ids.numpy(), expected, folder


def test_the_exporters_name_the_tied_table_as_this_test_expects(tied):
    exporter, path, *_ = tied
    tables = [n.inputs[0].name for n in ir.load(str(path)).graph if n.op_type == "Gather"]
    assert tables == (["lm_head.weight"] if exporter == "dynamo" else ["wte.weight"])


def test_peft_adapters_on_wte_load_without_key_map_and_equal_peft(tied):
    _, path, _, ids, expected, folder = tied
    base = import_onnx(path)
    s1, report = load_peft_adapter(base, folder / "s1", return_report=True)
    table = "lm_head.weight" if tied[0] == "dynamo" else "wte.weight"
    assert report.matched["base_model.model.wte"] == table
    rows = [k for k, n in enumerate(ROWS) if n == "s1"]
    np.testing.assert_allclose(s1(Tensor.from_numpy(ids[rows])).to_numpy(), expected[rows], atol=ATOL, rtol=0)


def test_save_peft_adapter_writes_the_table_under_wte_and_peft_reproduces_it(tied, tmp_path):
    _, path, model, ids, expected, folder = tied
    s1 = load_peft_adapter(import_onnx(path), folder / "s1")
    out = save_peft_adapter(s1, tmp_path / "saved")
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["mlp", "wte"]
    keys = set(load_file(str(out / "adapter_model.safetensors")))
    assert {"base_model.model.wte.lora_embedding_A", "base_model.model.wte.lora_embedding_B"} <= keys
    assert not any("lm_head" in k for k in keys)
    written = peft_with_adapters(model, {"s1": out})
    rows = [k for k, n in enumerate(ROWS) if n == "s1"]
    with torch.no_grad():
        got = written(torch.from_numpy(ids[rows])).numpy()
    np.testing.assert_allclose(got, expected[rows], atol=ATOL, rtol=0)


def test_write_batched_peft_folders_give_each_rows_adapter_in_peft(tied, tmp_path):
    _, path, model, ids, expected, folder = tied
    base = import_onnx(path)
    module = base.add_adapter("s1", load_peft_adapter(base, folder / "s1"))
    module = module.add_adapter("s2", load_peft_adapter(base, folder / "s2"))
    served = export_onnx(module, tmp_path / "served.onnx", ids[:2], lora="batched")
    out = write_batched_peft(None, tmp_path / "peft", model=served, names=["s1", "s2"])
    assert "wte" in json.loads((out / "s1" / "adapter_config.json").read_text())["target_modules"]
    written = peft_with_adapters(model, {"s1": out / "s1", "s2": out / "s2"})
    with torch.no_grad():
        got = written(torch.from_numpy(ids), adapter_names=list(ROWS)).numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_a_tied_table_without_owner_evidence_is_refused_naming_it_unless_key_map_names_it(tied, tmp_path):
    exporter, path, model, ids, expected, folder = tied
    if exporter != "torchscript":
        pytest.skip("one file without evidence is enough")
    stripped = ir.load(str(path))
    for node in stripped.graph:
        if node.op_type == "Gather":
            node.name = "gather_0"  # no /wte/Gather scope: nothing says which module owns the table
    ir.save(stripped, str(tmp_path / "stripped.onnx"))
    s1 = load_peft_adapter(import_onnx(tmp_path / "stripped.onnx"), folder / "s1")
    with pytest.raises(LoraError, match=r"embedding table 'wte.weight' is tied.*key_map"):
        save_peft_adapter(s1, tmp_path / "refused")
    served = export_onnx(s1.add_adapter("s1", s1), tmp_path / "served.onnx", ids[:2], lora="batched")
    with pytest.raises(LoraError, match=r"embedding table 'wte.weight' is tied.*key_map"):
        write_batched_peft(None, tmp_path / "refused_batched", model=served, names=["s1"])
    out = save_peft_adapter(s1, tmp_path / "named", key_map=[(r"^wte$", "wte")])
    written = peft_with_adapters(model, {"s1": out})
    rows = [k for k, n in enumerate(ROWS) if n == "s1"]
    with torch.no_grad():
        np.testing.assert_allclose(written(torch.from_numpy(ids[rows])).numpy(), expected[rows], atol=ATOL, rtol=0)


def test_a_peft_adapter_on_the_tied_lm_head_loads_onto_the_projection_and_saves_back(tied, tmp_path):
    """PEFT's Linear LoRA on ``lm_head`` (the tied projection): where dynamo named the table
    ``lm_head.weight`` it must not land on the table (an embedding) but on the weight the
    projection's MatMul reads; written back it is ``lm_head``'s ``lora_A`` / ``lora_B``."""
    _, path, model, ids, _, folder = tied
    peft_lora(model, ["lm_head"], 2, 3, seed=9, folder=folder / "s3")
    reference = peft_with_adapters(model, {"s3": folder / "s3"})
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).numpy()
    s3 = load_peft_adapter(import_onnx(path), folder / "s3")
    np.testing.assert_allclose(s3(Tensor.from_numpy(ids)).to_numpy(), expected, atol=ATOL, rtol=0)
    out = save_peft_adapter(s3, tmp_path / "s3")
    assert set(load_file(str(out / "adapter_model.safetensors"))) == {
        "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"}
    with torch.no_grad():
        got = peft_with_adapters(model, {"s3": out})(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
