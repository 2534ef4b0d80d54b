"""PEFT folders saved with PEFT's defaults for ``embed_tokens`` / ``lm_head`` targets (finding F2
of the session-8 fresh-user trial).

PEFT 0.21's ``save_pretrained`` defaults to ``save_embedding_layers="auto"``: when
``target_modules`` names ``embed_tokens`` or ``lm_head`` it stores their base layer
(``<m>.base_layer.weight``, PyTorch's layout) next to the factors, and with
``save_embedding_layers=True`` and no embedding targeted it stores the whole layers
(``<m>.weight``); PEFT's loader copies them into the base. ``load_peft_adapter`` accepts such a
tensor when it equals the module's (PEFT's load would change nothing) and refuses one that
differs, naming the key; ``modules_to_save`` (also a ``<m>.weight`` key) stays refused under
its own name.

Oracle: the ``peft.PeftModel`` in torch (``from_pretrained`` on the saved folder) on a tiny
``transformers`` ``LlamaForCausalLM`` (untied ``lm_head``, random weights) exported by torch's
TorchScript exporter; the loaded module's logits must equal PEFT's within 1e-5.
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402
from torch_peft import export, ids_for, quiet, randomize  # noqa: E402

from onnxparam import RecordError, Tensor, import_onnx, load_peft_adapter  # noqa: E402

ATOL = 1e-5
KEY_MAP = [("^", "model.")]  # the exported wrapper holds the LLaMA as `model`
WEIGHTS = "adapter_model.safetensors"


class Logits(torch.nn.Module):
    """The logits of a ``transformers`` causal LM (an all-ones attention mask, so LLaMA's mask
    code exports with TorchScript)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits


def peft_saved(base, folder, **config):
    """A PEFT LoRA model (rank 2, alpha 5, random factors) on a copy of ``base``, saved to
    ``folder`` with ``save_pretrained``'s defaults (``save_embedding_layers`` passed through when
    given); returns the folder's tensors."""
    save = {k: config.pop(k) for k in list(config) if k == "save_embedding_layers"}
    with quiet():  # PEFT says it sets save_embedding_layers
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, lora_alpha=5, init_lora_weights=False,
                                                                          **config))
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.save_pretrained(str(folder), **save)
    return load_file(str(folder / WEIGHTS))


def peft_logits(base, folder, ids):
    """PEFT's own load of ``folder`` onto a copy of ``base``: the oracle."""
    with quiet():
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``(torch LlamaForCausalLM, imported module)``: 1 layer, vocab 40, untied ``lm_head``."""
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      use_cache=False, attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = randomize(transformers.LlamaForCausalLM(config).eval(), seed=3, std=0.2)
    folder = tmp_path_factory.mktemp("llama")
    path = export(Logits(model), (ids_for(2, 5),), folder / "model.onnx", "torchscript", dynamic={0: "b", 1: "s"},
                  input_names=["input_ids"], output_names=["logits"])
    return model, import_onnx(path)


def run(module, ids):
    return module(Tensor.from_numpy(ids.numpy())).to_numpy()


@pytest.mark.parametrize("targets, save, stored", [
    (["embed_tokens", "q_proj", "lm_head"], {},  # PEFT's default: the targeted layers' base layers
     {"base_model.model.model.embed_tokens.base_layer.weight", "base_model.model.lm_head.base_layer.weight"}),
    (["q_proj", "v_proj"], {"save_embedding_layers": True},  # no embedding targeted: the whole layers
     {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"}),
])
def test_a_peft_folder_holding_the_unchanged_base_embedding_layers_loads_and_equals_peft(
        llama, tmp_path, targets, save, stored):
    model, imported = llama
    tensors = peft_saved(model, tmp_path / "a", target_modules=targets, **save)
    assert stored <= set(tensors)  # what PEFT wrote next to the factors (the case under test)
    loaded = load_peft_adapter(imported, tmp_path / "a", key_map=KEY_MAP)
    ids = ids_for(3, 6)
    expected = peft_logits(model, tmp_path / "a", ids)
    with torch.no_grad():
        assert np.abs(expected - model(input_ids=ids).logits.numpy()).max() > 1e-2  # the adapter does something
    np.testing.assert_allclose(run(loaded, ids), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("key, index, param", [
    ("base_model.model.model.embed_tokens.base_layer.weight", (3, 1), "model.model.embed_tokens.weight"),
    ("base_model.model.lm_head.base_layer.weight", (7, 2), None),  # (out, in): the graph's MatMul B is (in, out)
])
def test_a_stored_base_layer_that_differs_from_the_module_is_refused_naming_the_key(llama, tmp_path, key, index,
                                                                                      param):
    model, imported = llama
    tensors = peft_saved(model, tmp_path / "a", target_modules=["embed_tokens", "q_proj", "lm_head"])
    shutil.copytree(tmp_path / "a", tmp_path / "unchanged")
    changed = tensors[key].copy()
    changed[index] += 0.25  # a retrained row: PEFT's loader would write it into the base
    save_file({**tensors, key: changed}, str(tmp_path / "a" / WEIGHTS))
    ids = torch.arange(40).reshape(2, 20)  # every token; the oracle: PEFT applies it (moves off base + adapter)
    moved = peft_logits(model, tmp_path / "a", ids) - peft_logits(model, tmp_path / "unchanged", ids)
    assert np.abs(moved).max() > 1e-3
    with pytest.raises(RecordError) as info:
        load_peft_adapter(imported, tmp_path / "a", key_map=KEY_MAP)
    problems = info.value.problems
    assert len(problems) == 1, problems
    text = problems[0]
    assert str(tmp_path / "a" / WEIGHTS) in str(info.value)
    assert text.startswith(repr(key)) and "max |difference| 0.25 (1 of 640 values)" in text, text
    assert "save_embedding_layers=False" in text and "into the base model first" in text
    assert param is None or repr(param) in text


def test_a_stored_base_layer_of_another_vocabulary_size_is_refused_naming_both_shapes(llama, tmp_path):
    model, imported = llama
    tensors = peft_saved(model, tmp_path / "a", target_modules=["q_proj", "lm_head"])
    key = "base_model.model.lm_head.base_layer.weight"
    save_file({**tensors, key: np.concatenate([tensors[key], tensors[key][:2]])}, str(tmp_path / "a" / WEIGHTS))
    with pytest.raises(RecordError) as info:
        load_peft_adapter(imported, tmp_path / "a", key_map=KEY_MAP)
    (text,) = info.value.problems
    assert text.startswith(repr(key)) and "as [42, 16] (PyTorch's (out, in), transposed to the param's)" in text
    assert "is [16, 40]" in text, text


def test_modules_to_save_is_still_refused_under_its_own_name(llama, tmp_path):
    model, imported = llama
    tensors = peft_saved(model, tmp_path / "a", target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert "base_model.model.lm_head.weight" in tensors  # PEFT's key for the trained copy
    with pytest.raises(RecordError) as info:
        load_peft_adapter(imported, tmp_path / "a", key_map=KEY_MAP)
    (text,) = info.value.problems
    assert text.startswith("'base_model.model.lm_head.weight': a whole module trained in place "
                           "(modules_to_save=['lm_head'])"), text
    assert "save_embedding_layers" not in text
