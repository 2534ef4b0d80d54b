"""PEFT LoRA checkpoints (adapter_config.json + adapter_model.safetensors) loaded onto modules.

Oracle: a numpy computation in PyTorch's convention on the tiny matrices written by the test
itself: ``y = x @ (W_torch + scale * B @ A).T + bias`` with ``W_torch`` ``(out, in)``, PEFT's
``A`` ``(r, in)`` and ``B`` ``(out, r)``.
"""

import json

import numpy as np
import onnx.parser
import pytest
from safetensors.numpy import save_file

from onnxparam import LoraConfig, Module, RecordError, Tensor, import_onnx, load_peft_adapter
from onnxparam.nn import Linear

W_TORCH = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], np.float32)  # (out=2, in=3)
BIAS = np.array([0.25, -0.5], np.float32)
A = np.array([[1.0, 0.0, 2.0], [0.0, -1.0, 1.0]], np.float32)  # lora_A: (r=2, in=3)
B = np.array([[0.5, 1.0], [-2.0, 0.25]], np.float32)  # lora_B: (out=2, r=2)
X = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], np.float32)


def torch_oracle(scale: float) -> np.ndarray:
    return X @ (W_TORCH + scale * (B @ A)).T + BIAS


class Net(Module):
    def __init__(self):
        self.proj = Linear(3, 2)

    def forward(self, x):
        return self.proj(x)


def net() -> Net:
    """Burn layout: the weight is (in, out) = W_torch.T."""
    module = Net()
    return module.map(lambda path, p: p.map(lambda t: Tensor.from_numpy(
        W_TORCH.T.copy() if path == "proj.weight" else BIAS)))


def write_peft(folder, config: dict, tensors: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "bias": "none", **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def factors(name="base_model.model.encoder.proj"):
    return {f"{name}.lora_A.weight": A, f"{name}.lora_B.weight": B}


KEY_MAP = [(r"^encoder\.", "")]


def test_peft_adapter_on_a_burn_layout_linear_gives_the_pytorch_result(tmp_path):
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3}, factors())
    module = load_peft_adapter(net(), folder, key_map=KEY_MAP)
    adapter = module.proj.weight.adapter()
    assert adapter.scale == 1.5 and not adapter.transposed and module.proj.weight.require_grad is False
    np.testing.assert_array_equal(adapter.a.val().to_numpy(), A.T)
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), torch_oracle(1.5), rtol=1e-5)


def test_base_layer_tensors_stored_by_save_embedding_layers_load_when_equal_and_are_refused_when_not(tmp_path):
    # PEFT's save_embedding_layers stores the base layer in PyTorch's layout, (out, in): equal to
    # the Burn-layout (in, out) weight here, it changes nothing; off by 0.5 in one value, refused
    base = "base_model.model.encoder.proj.base_layer"
    stored = {f"{base}.weight": W_TORCH, f"{base}.bias": BIAS}
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3}, {**factors(), **stored})
    module = load_peft_adapter(net(), folder, key_map=KEY_MAP)
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), torch_oracle(1.5), rtol=1e-5)
    changed = W_TORCH.copy()
    changed[1, 2] += 0.5
    for key, value in [(f"{base}.weight", changed), (f"{base}.bias", BIAS + 1)]:
        folder = write_peft(tmp_path / key, {"r": 2, "lora_alpha": 3}, {**factors(), **stored, key: value})
        with pytest.raises(RecordError) as info:
            load_peft_adapter(net(), folder, key_map=KEY_MAP)
        (text,) = info.value.problems
        which = key.rsplit(".", 1)[1]
        assert text.startswith(f"{key!r}: PEFT stored the base {which} of module 'base_model.model.encoder.proj'")
        assert f"differs from 'proj.{which}'" in text and "save_embedding_layers=False" in text, text
        assert ("max |difference| 0.5 (1 of 6 values)" if which == "weight" else "max |difference| 1 (2 of 2") in text


def test_rslora_scales_by_alpha_over_sqrt_rank(tmp_path):
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3, "use_rslora": True}, factors())
    module = load_peft_adapter(net(), [folder / "adapter_config.json", folder / "adapter_model.safetensors"],
                               key_map=KEY_MAP)
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), torch_oracle(3 / np.sqrt(2)), rtol=1e-5)


def test_alpha_pattern_overrides_alpha_per_module(tmp_path):
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3, "alpha_pattern": {"proj": 8}}, factors())
    module = load_peft_adapter(net(), folder, key_map=KEY_MAP)
    assert module.proj.weight.adapter().scale == 4.0


def test_peft_adapter_on_an_imported_gemm_trans_b_weight_keeps_the_pytorch_layout(tmp_path):
    text = """
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[N, 3] x) => (float[N, 2] y) <float[2, 3] proj_weight = {%s}, float[2] proj_bias = {0.25, -0.5}>
    { y = Gemm <transB: int = 1> (x, proj_weight, proj_bias) }
    """ % ", ".join(map(repr, W_TORCH.ravel().tolist()))
    imported = import_onnx(onnx.parser.parse_model(text))
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 2, "fan_in_fan_out": False}, factors("base_model.model.proj"))
    module = load_peft_adapter(imported, folder, key_map=[(r"^proj$", "proj_weight")])
    assert module.param_of("proj_weight").adapter().transposed
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), torch_oracle(1.0), rtol=1e-5)


def test_saving_a_weight_no_graph_names_a_module_for_needs_a_key_map_and_writes_under_it(tmp_path):
    from safetensors.numpy import load_file

    from onnxparam import save_peft_adapter

    text = """
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[N, 3] x) => (float[N, 2] y) <float[2, 3] proj_weight = {%s}>
    { y = Gemm <transB: int = 1> (x, proj_weight) }
    """ % ", ".join(map(repr, W_TORCH.ravel().tolist()))
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 2}, factors("base_model.model.proj"))
    module = load_peft_adapter(import_onnx(onnx.parser.parse_model(text)), folder,
                               key_map=[(r"^proj$", "proj_weight")])
    with pytest.raises(RecordError, match=r"'proj_weight' \[2, 3\]: .*give a key_map rule"):
        save_peft_adapter(module, tmp_path / "no_map")
    saved = load_file(str(save_peft_adapter(module, tmp_path / "out", key_map=[(r"^proj_weight$", "proj")])
                          / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(factors("base_model.model.proj"))
    np.testing.assert_array_equal(saved["base_model.model.proj.lora_A.weight"], A)
    np.testing.assert_array_equal(saved["base_model.model.proj.lora_B.weight"], B)


def test_loading_replaces_the_factors_of_an_existing_adapter_and_keeps_their_ids(tmp_path):
    adapted = net().apply_lora(LoraConfig(rank=2, alpha=3.0, seed=0))
    ids = (adapted.proj.weight.adapter().a.id, adapted.proj.weight.adapter().b.id)
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3}, factors())
    module = load_peft_adapter(adapted, folder, key_map=KEY_MAP)
    assert (module.proj.weight.adapter().a.id, module.proj.weight.adapter().b.id) == ids
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), torch_oracle(1.5), rtol=1e-5)


@pytest.mark.parametrize("option, message", [
    ({"use_dora": True}, r"use_dora=true \(DoRA\)"),
    ({"bias": "lora_only"}, r"bias='lora_only'.*only bias='none' is supported"),
    ({"peft_type": "IA3"}, r"peft_type 'IA3'"),
])
def test_unsupported_peft_variants_name_the_option(tmp_path, option, message):
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3, **option}, factors())
    with pytest.raises(RecordError, match=message):
        load_peft_adapter(net(), folder, key_map=KEY_MAP)


def test_unmatched_modules_and_misfit_shapes_are_all_reported(tmp_path):
    tensors = {**factors("base_model.model.decoder.out"), **factors(),
               "base_model.model.encoder.proj.bias": BIAS}
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3}, tensors)
    with pytest.raises(RecordError) as info:
        load_peft_adapter(net(), folder, key_map=KEY_MAP)
    text = str(info.value)
    assert "'decoder.out', which is not a param" in text and "add a key_map rule" in text
    assert "bias training" in text


def test_factors_that_do_not_fit_the_target_name_both_shapes(tmp_path):
    folder = write_peft(tmp_path / "ad", {"r": 2, "lora_alpha": 3},
                        {"base_model.model.proj.lora_A.weight": np.zeros((2, 5), np.float32),
                         "base_model.model.proj.lora_B.weight": B})
    with pytest.raises(RecordError, match=r"'proj.weight': the factors make a \(2, 5\) PyTorch weight \(in 5 -> out 2\), "
                                          r"the param is \[3, 2\], stored \(d_in, d_out\)"):
        load_peft_adapter(net(), folder)


def test_a_config_without_lora_alpha_gets_peft_default_alpha_8_not_r(tmp_path):
    # PEFT's LoraConfig declares lora_alpha: int = 8, so a file leaving it out means alpha 8
    folder = write_peft(tmp_path / "ad", {"r": 2}, factors())
    module = load_peft_adapter(net(), folder, key_map=KEY_MAP)
    adapter = module.proj.weight.adapter()
    assert adapter.scale == 8 / 2
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), torch_oracle(4.0), rtol=1e-5)


def test_saving_all_named_adapters_needs_some_and_loading_needs_a_peft_folder(tmp_path):
    from onnxparam import load_peft_adapters, save_peft_adapters

    with pytest.raises(RecordError, match="owns no named adapters"):
        save_peft_adapters(Net().apply_lora(LoraConfig(rank=2, alpha=2.0, seed=0)), tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="holds no PEFT adapter"):
        load_peft_adapters(Net(), tmp_path / "empty")
    adapted = Net().apply_lora(LoraConfig(rank=2, alpha=2.0, seed=0))
    with pytest.raises(RecordError, match=r"adapter names \['a/b'\] cannot be folder names"):
        save_peft_adapters(Net().add_adapter("a/b", adapted), tmp_path / "out")


def test_a_weight_named_as_several_modules_takes_the_biased_one_else_what_key_map_makes_of_them():
    """The documented rule of save_peft_adapter for a weight the graph names as several modules:
    the one whose ``<m>.bias`` the graph holds; else the one name the key_map rules make of all
    of them; else a problem naming the candidates."""
    from onnxparam.lora._peft_save import _one_module

    found, problems = ["b.0.qkv", "b.b.0.qkv"], []
    assert _one_module("w", (4, 4), found, {"b.0.qkv"}, [], problems) == "b.0.qkv"
    assert _one_module("w", (4, 4), found, {"b.0.qkv"}, [(r"^b\.", "m.")], problems) == "m.0.qkv"
    assert _one_module("w", (4, 4), found, set(), [(r"^b\.b\.", "b.")], problems) == "b.0.qkv"
    assert not problems
    assert _one_module("w", (4, 4), found, set(), [], problems) is None
    assert "several modules ['b.0.qkv', 'b.b.0.qkv']" in problems[0] and "key_map" in problems[0]
