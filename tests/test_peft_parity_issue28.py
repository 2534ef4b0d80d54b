"""PEFT parity points of issue 28: ``LoraConfig``'s defaults are PEFT's, PEFT's trainable tokens
are refused under their own name, and the README's interpolation convention holds.

Oracles: ``peft.LoraConfig``'s own defaults and scale, torch's ``F.interpolate``.
"""

import json

import numpy as np
import pytest

import onnxparam as op
from onnxparam import LoraConfig, nn


def test_lora_config_defaults_are_pefts():
    peft = pytest.importorskip("peft")
    theirs = peft.LoraConfig()
    ours = LoraConfig()
    assert (ours.rank, ours.alpha) == (theirs.r, theirs.lora_alpha)
    four = peft.LoraConfig(r=4)
    assert LoraConfig(rank=4).scale == four.lora_alpha / four.r


def _peft_folder(tmp_path, config, tensors):
    from safetensors.numpy import save_file

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


class _Net(op.Module):
    def __init__(self):
        self.emb = nn.Embedding(5, 3)
        self.proj = nn.Linear(3, 2)


def test_trainable_token_indices_is_refused_under_its_own_name(tmp_path):
    from onnxparam import load_peft_adapter

    f32 = np.float32
    folder = _peft_folder(tmp_path, {"trainable_token_indices": {"emb": [0, 3]}},
                          {"base_model.model.proj.lora_A.weight": np.ones((2, 3), f32),
                           "base_model.model.proj.lora_B.weight": np.ones((2, 2), f32),
                           "base_model.model.emb.token_adapter.trainable_tokens_delta": np.ones((2, 3), f32)})
    with pytest.raises(op.RecordError) as info:
        load_peft_adapter(_Net(), folder)
    text = str(info.value) + " ".join(getattr(info.value, "problems", []))
    assert "trainable_token_indices" in text and "modules_to_save" not in text
    folder2 = tmp_path / "b"
    folder2.mkdir()
    (folder / "adapter_config.json").rename(folder2 / "adapter_config.json")
    (folder2 / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    (folder / "adapter_model.safetensors").rename(folder2 / "adapter_model.safetensors")
    with pytest.raises(op.RecordError) as info:
        load_peft_adapter(_Net(), folder2)
    assert "trained token rows (trainable_token_indices)" in " ".join(info.value.problems)


def test_interpolate_with_a_scale_factor_is_torchs_recompute_scale_factor_convention():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 7)).astype(np.float32)
    ours = nn.Interpolate2d(scale_factor=(1.7, 1.7), mode="linear", align_corners=False)(op.Tensor.from_numpy(x))
    t = torch.from_numpy(x)
    recomputed = torch.nn.functional.interpolate(t, scale_factor=1.7, mode="bilinear", align_corners=False,
                                                 recompute_scale_factor=True).numpy()
    default = torch.nn.functional.interpolate(t, scale_factor=1.7, mode="bilinear", align_corners=False).numpy()
    np.testing.assert_allclose(ours.to_numpy(), recomputed, rtol=1e-5, atol=1e-5)
    assert np.abs(ours.to_numpy() - default).max() > 0.1  # the README's warning is real
