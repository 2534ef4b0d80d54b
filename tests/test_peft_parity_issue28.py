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


def _peft_no_bias(tmp_path):
    """A torch net with a bias-free Linear and a biased one, adapted by PEFT with lora_bias=True
    and random non-zero factors (lora_B.bias included), saved; returns (peft model, folder)."""
    import copy
    import warnings

    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 6, bias=False)
            self.fc2 = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    base = TorchNet().eval()
    config = peft.LoraConfig(r=2, lora_alpha=5, lora_bias=True, target_modules=["fc1", "fc2"],
                             init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns that the bias-free layer cannot be merged
        model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    folder = tmp_path / "peft"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(folder))
    return base, model, folder


class _Net(op.Module):
    def __init__(self):
        self.fc1 = nn.Linear(4, 6, bias=False)
        self.act = nn.Relu()
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _ours_from(base) -> "_Net":
    from onnxparam.convert import apply_record

    return apply_record(_Net(), {k: v.detach() for k, v in base.state_dict().items()}, adapter="pytorch")


def test_lora_bias_on_a_bias_free_layer_runs_unmerged_exports_and_merges_as_peft(tmp_path):
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    from onnxparam import load_peft_adapter
    from onnxparam.onnx_io import export_onnx

    base, model, folder = _peft_no_bias(tmp_path)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()  # PEFT, unmerged: the bias lives in lora_B
    ours = load_peft_adapter(_ours_from(base), folder)
    assert ours.fc1.bias is not None and ours.fc1.bias.adapter() is not None  # the adapter-owned bias
    np.testing.assert_allclose(ours(x).to_numpy(), expected, rtol=1e-5, atol=1e-5)
    for mode in ("keep", "merge"):
        path = export_onnx(ours, tmp_path / f"{mode}.onnx", x, lora=mode)
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=mode)
    from onnxparam import write_onnx_adapter

    path = export_onnx(ours, tmp_path / "inputs.onnx", x, lora="inputs")
    adapter_file = write_onnx_adapter(ours, tmp_path / "a.onnx_adapter")
    options = ort.RunOptions()
    lora = ort.LoraAdapter()
    lora.Load(str(adapter_file))
    options.add_active_adapter(lora)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x}, options)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg="inputs")
    del options, lora
    merged = ours.merge_lora()
    assert merged.fc1.bias.adapter() is None  # a new bias param: scale * lora_B.bias
    scale = 5 / 2
    np.testing.assert_allclose(merged.fc1.bias.val().to_numpy(),
                               scale * model.base_model.model.fc1.lora_B["default"].bias.detach().numpy(),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(merged(x).to_numpy(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="no bias"):  # PEFT itself refuses this merge
        model.merge_adapter()
