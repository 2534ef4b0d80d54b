"""``convert(..., pytorch=True)`` records which rank-2 tensors PyTorch holds transposed, so a
Burn-layout file converted back gives the module's own layout.

Oracle: Hugging Face ``transformers``' GPT-2 (``Conv1D`` layers, ``(in, out)`` weights) with a tiny
random config: its ``state_dict`` goes ``.pt -> .bpk -> .safetensors`` (both with ``pytorch=True``)
and must load into a fresh GPT-2 with ``strict=True`` and give the original logits; a BERT
(``nn.Linear``) file must still be transposed both ways.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from onnxparam.convert import convert  # noqa: E402


def _gpt2(n_embd=32):
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=n_embd, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.numpy()


@pytest.mark.parametrize("n_embd", [32])
def test_gpt2_pt_to_bpk_to_safetensors_loads_strictly_with_the_original_logits(tmp_path, n_embd):
    """n_embd=32: c_attn [32, 96], c_fc [32, 128], mlp.c_proj [128, 32] are not square (a wrong
    transpose fails load_state_dict); attn.c_proj [32, 32] is (a wrong transpose loads silently:
    the logits catch it)."""
    model = _gpt2(n_embd)
    ids = torch.tensor([[1, 7, 3, 9, 4]])
    expected = _logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "gpt2.pt")

    to_burn = convert(tmp_path / "gpt2.pt", tmp_path / "gpt2.bpk", pytorch=True)
    conv1d = [k for k, v in state.items() if k.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))]
    assert len(conv1d) == 8 and not to_burn.transposed
    back = convert(tmp_path / "gpt2.bpk", tmp_path / "back.safetensors", pytorch=True)
    assert back.transposed == []
    assert sorted(n for n, _ in back.kept) == sorted(conv1d)

    loaded = safetensors_torch.load_file(str(tmp_path / "back.safetensors"))
    fresh = _gpt2(n_embd)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    # lm_head.weight is tied to wte: the file holds it once per name; strict=True checks every key
    fresh.load_state_dict(loaded, strict=True)
    for name, value in state.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value.numpy(), err_msg=name)
    np.testing.assert_allclose(_logits(fresh, ids), expected, rtol=0, atol=0)


def test_a_burn_file_without_a_record_is_transposed_as_linear_with_a_note(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    # Burn layout (in, out) = (3, 5): the bias follows dim 1
    save_file({"fc.weight": rng.standard_normal((3, 5)).astype(np.float32),
               "fc.bias": rng.standard_normal(5).astype(np.float32)}, str(tmp_path / "burn.safetensors"))
    convert(tmp_path / "burn.safetensors", tmp_path / "burn.bpk")  # no pytorch=True: no record
    report = convert(tmp_path / "burn.bpk", tmp_path / "pt.safetensors", pytorch=True)
    assert [t[0] for t in report.transposed] == ["fc.weight"]
    assert any("--no-transpose" in note and "fc.weight" in note for note in report.notes)
    kept = convert(tmp_path / "burn.bpk", tmp_path / "pt2.safetensors", pytorch=True, no_transpose=[r"^fc\.weight$"])
    assert kept.transposed == [] and not any("--no-transpose" in note for note in kept.notes)


def test_linear_weights_are_recorded_as_transposed_and_go_back_transposed(tmp_path):
    linear = torch.nn.Linear(4, 6)
    state = {k: v.detach().clone() for k, v in linear.state_dict().items()}
    torch.save(state, tmp_path / "lin.pt")
    to_burn = convert(tmp_path / "lin.pt", tmp_path / "lin.bpk", pytorch=True)
    assert [t[0] for t in to_burn.transposed] == ["weight"]
    back = convert(tmp_path / "lin.bpk", tmp_path / "lin.safetensors", pytorch=True)
    assert [t[0] for t in back.transposed] == ["weight"]
    assert not any("--no-transpose" in note for note in back.notes)  # recorded, not guessed
    loaded = safetensors_torch.load_file(str(tmp_path / "lin.safetensors"))
    fresh = torch.nn.Linear(4, 6)
    fresh.load_state_dict(loaded, strict=True)
    x = torch.randn(2, 4)
    np.testing.assert_array_equal(fresh(x).detach().numpy(), linear(x).detach().numpy())


def test_a_renaming_conversion_between_burn_files_carries_the_record_under_the_new_names(tmp_path):
    model = _gpt2()
    ids = torch.tensor([[2, 5, 8]])
    expected = _logits(model, ids)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "gpt2.pt")
    convert(tmp_path / "gpt2.pt", tmp_path / "a.bpk", pytorch=True)
    convert(tmp_path / "a.bpk", tmp_path / "b.bpk", remap=[(r"^transformer\.", "t.")])
    back = convert(tmp_path / "b.bpk", tmp_path / "back.safetensors", pytorch=True, remap=[(r"^t\.", "transformer.")])
    assert back.transposed == []
    fresh = _gpt2()
    fresh.load_state_dict(safetensors_torch.load_file(str(tmp_path / "back.safetensors")), strict=True)
    np.testing.assert_array_equal(_logits(fresh, ids), expected)
