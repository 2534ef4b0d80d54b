"""A batched export's stacked adapter set written as PEFT's multi-adapter folder
(:func:`onnxparam.write_batched_peft`).

Oracles: PEFT itself (``PeftModel.from_pretrained`` + ``load_adapter`` of the written folder, its
mixed-batch forward ``adapter_names=``) against the PEFT adapters the set was built from and
against our module's ``module(ids, adapter_index=...)``, within 1e-5; plain ONNX Runtime on the
batched export with the stacks fed, for an adapter added in a spare slot; and the stacks read back
by :func:`onnxparam.load_peft_adapters` equal the written set. The model is a tiny BERT
(``transformers``, random weights) exported by torch's TorchScript exporter: renamed weights
(``onnx::MatMul_N``) and the word-embedding table (PEFT's ``Embedding`` LoRA) included.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import onnxruntime as ort  # noqa: E402
from torch_peft import Hidden, ids_for, peft_lora, peft_rows, peft_with_adapters, randomize  # noqa: E402
from torch_peft import export as torch_export  # noqa: E402

from onnxparam import (  # noqa: E402
    RecordError,
    Tensor,
    export_onnx,
    import_onnx,
    load_peft_adapter,
    load_peft_adapters,
    write_batched_adapter,
    write_batched_peft,
)
from onnxparam import BatchedLora  # noqa: E402
from onnxparam.lora._batched import batched_metadata  # noqa: E402
from onnxparam.lora._batched_run import batched_adapter_params  # noqa: E402

ATOL = 1e-5
# name: (r, alpha, use_rslora)
ADAPTERS = {"sql": (2, 5, False), "chat": (4, 3, True), "code": (8, 12, False)}
ROWS = ["chat", "__base__", "sql", "code", "__base__", "sql"]
TARGETS = ["query", "value", "dense", "word_embeddings"]


def peft_model(base, folder, names):
    """PEFT's model with the adapters ``folder/<name>`` (``"default"``: ``folder``) loaded."""
    return peft_with_adapters(base, {n: folder if n == "default" else folder / n for n in names})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(torch model, PEFT reference on the source adapters, our module, batched export path)."""
    folder = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16)
    torch.manual_seed(0)
    model = randomize(Hidden(transformers.BertModel(config)).eval(), seed=1)
    ids = torch.tensor([[1, 5, 7, 3, 9], [2, 8, 4, 6, 0]], dtype=torch.int64)
    torch_export(model, (ids,), folder / "model.onnx", "torchscript", dynamic={0: "batch", 1: "seq"},
                 input_names=["input_ids"], output_names=["hidden"])
    for k, (name, (r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        peft_lora(model, TARGETS, r, alpha, rslora=rslora, seed=30 + k, folder=folder / "source" / name)
    reference = peft_model(model, folder / "source", list(ADAPTERS))
    imported = import_onnx(folder / "model.onnx")
    module = imported
    for name in ADAPTERS:
        module = module.add_adapter(name, load_peft_adapter(imported, folder / "source" / name, allow_partial=True))
    export = export_onnx(module, folder / "batched.onnx", lora=BatchedLora(capacity=4))
    return model, reference, module, imported, export, folder / "source"


def test_the_written_folder_loads_in_peft_and_gives_each_rows_adapter(built, tmp_path):
    model, reference, module, imported, export, _ = built
    file = write_batched_adapter(module, tmp_path / "set.onnx_adapter", model=export)
    out = write_batched_peft(file, tmp_path / "peft", model=export, base_model_name_or_path="tiny-bert")
    names = list(ADAPTERS)
    # PEFT's multi-adapter layout: one folder per adapter (none named "default" here)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    config = json.loads((out / "code" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "tiny-bert"
    written = peft_model(model, out, names)
    ids = ids_for(len(ROWS), 6)
    expected = peft_rows(reference, ids, ROWS)  # the adapters the set was built from
    got = peft_rows(written, ids, ROWS)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    ours = module(Tensor.from_numpy(ids.numpy()), adapter_index=[None if r == "__base__" else r for r in ROWS])
    np.testing.assert_allclose(got, ours.to_numpy(), atol=ATOL, rtol=0)
    for name in names:  # each adapter alone, every row
        np.testing.assert_allclose(peft_rows(written, ids, [name] * len(ROWS)),
                                   module(Tensor.from_numpy(ids.numpy()), adapter_index=name).to_numpy(),
                                   atol=ATOL, rtol=0, err_msg=name)
    # read back by onnxparam: the same stacks (ranks cut to each adapter's own, scale 1)
    back = load_peft_adapters(imported, out)
    assert sorted(back.lora_adapters.names) == sorted(names)
    stacks = batched_adapter_params(back, model=export, names=names)
    original = batched_adapter_params(module, model=export)
    assert stacks.keys() == original.keys()
    for key in stacks:
        np.testing.assert_allclose(stacks[key], original[key], atol=1e-7, rtol=1e-6, err_msg=key)


def test_a_spare_slot_and_the_default_name(built, tmp_path):
    """A set with an adapter added in the export's spare slot (arrays fed to the session):
    unnamed, it is refused; named (``"default"``: the folder itself, as PEFT writes it), PEFT's
    rows equal plain ONNX Runtime's with the same stacks fed."""
    model, _, module, _, export, _ = built
    meta = batched_metadata(export)
    params = batched_adapter_params(module, model=export)
    rng = np.random.default_rng(5)
    for t in meta["targets"]:  # slot 4: a rank-3 adapter on every target
        params[t["a"]][4, :, :3] = rng.normal(0, 0.3, size=(t["d_in"], 3))
        params[t["b"]][4, :3, :] = rng.normal(0, 0.3, size=(3, t["d_out"]))
    with pytest.raises(RecordError, match="slot 4 holds an adapter but has no name"):
        write_batched_peft(params, tmp_path / "refused", model=export)
    names = ["default", "chat", "code", "extra"]
    out = write_batched_peft(params, tmp_path / "peft", model=export, names=names)
    assert (out / "adapter_config.json").is_file() and (out / "extra" / "adapter_model.safetensors").is_file()
    written = peft_model(model, out, names)
    rows = ["extra", "__base__", "default", "code", "extra", "chat"]
    index = np.asarray([0 if r == "__base__" else names.index(r) + 1 for r in rows], dtype=np.int64)
    ids = ids_for(len(rows), 5)
    session = ort.InferenceSession(str(export), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"input_ids": ids.numpy(), "adapter_index": index, **params})[0]
    np.testing.assert_allclose(peft_rows(written, ids, rows), expected, atol=ATOL, rtol=0)


def test_misfits_are_listed(built, tmp_path):
    _, _, module, _, export, _ = built
    params = batched_adapter_params(module, model=export)
    key = next(iter(params))
    bad = dict(params)
    bad[key] = bad[key][:, :-1]  # wrong d_in
    with pytest.raises(RecordError, match="do not fit the batched export"):
        write_batched_peft(bad, tmp_path / "bad", model=export)
    with pytest.raises(RecordError) as info:
        write_batched_peft(params, tmp_path / "bad", model=export, names=["a/b", "chat", "chat"])
    text = str(info.value)
    assert "cannot be folder names" in text and "repeat" in text
    zero = {k: v.copy() for k, v in params.items()}
    for k in zero:
        zero[k][2] = 0
    with pytest.raises(RecordError, match=r"slot 2 \('chat'\) is all zeros"):
        write_batched_peft(zero, tmp_path / "bad", model=export)
    assert not (tmp_path / "bad").exists()  # nothing written on a refusal


def test_a_modules_adapter_past_the_exports_fills_the_next_slot(built, tmp_path):
    """A module holding one more adapter than the export (its spare slot): written by default
    under its own name; PEFT's rows for it equal PEFT's rows for the source it was loaded from."""
    model, reference, module, imported, export, source = built
    grown = module.add_adapter("sql2", load_peft_adapter(imported, source / "sql", allow_partial=True))
    out = write_batched_peft(grown, tmp_path / "peft", model=export)
    assert sorted(p.name for p in out.iterdir()) == sorted(list(ADAPTERS) + ["sql2"])
    written = peft_model(model, out, ["sql2"])
    ids = ids_for(4, 5)
    np.testing.assert_allclose(peft_rows(written, ids, ["sql2", "__base__", "sql2", "sql2"]),
                               peft_rows(reference, ids, ["sql", "__base__", "sql", "sql"]), atol=ATOL, rtol=0)
