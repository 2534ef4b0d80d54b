"""``convert(..., pytorch=True)`` without a module decides each rank-2 weight's layout from the
file's own evidence (issue 28): Hugging Face's GPT-2 ``Conv1D`` stores ``(in, out)`` (Burn's
layout, kept), BERT's ``nn.Linear`` stores ``(out, in)`` (transposed); square weights follow
their family or the whole file; a file without evidence leaves them untouched and says why.

Oracles: transformers' own GPT-2 / BERT modules (random weights from tiny configs) run by
torch, and each Conv1D / nn.Linear sub-module run by torch on a probe input against Burn's
``Linear`` formula ``x @ W + b`` (numpy) on the converted file's tensors.
"""

import numpy as np
import pytest

import onnxparam as op
from onnxparam import nn
from onnxparam.convert import PyTorchAdapter, apply_record, convert, load_pytorch, read_record

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(config).eval()


def _bert():
    torch.manual_seed(1)
    config = transformers.BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=12, vocab_size=40, max_position_embeddings=16)
    return transformers.BertModel(config).eval()


IDS = torch.tensor([[1, 5, 7, 3, 2]])


def _out(model) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=IDS).last_hidden_state.numpy()


def _bpk_tensors(path) -> dict:
    return {n: s.to_data().to_numpy() for n, s in read_record(path).items()}


def _as_torch_names(tensors: dict) -> dict:
    """Burn's norm ``gamma`` / ``beta`` back to torch's ``weight`` / ``bias`` (names only)."""
    out = {}
    for name, value in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
        out[f"{prefix}.{leaf}" if prefix else leaf] = torch.from_numpy(np.array(value))
    return out


def _linear_layers_match_torch(model, tensors: dict) -> int:
    """Every Conv1D / nn.Linear of ``model``, run by torch, against ``x @ W + b`` on the
    converted tensors (Burn's Linear); returns how many were checked."""
    checked = 0
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    for name, sub in model.named_modules():
        weight, bias = tensors.get(f"{name}.weight"), tensors.get(f"{name}.bias")
        if weight is None or weight.ndim != 2 or bias is None:
            continue
        probe = x[:, : weight.shape[0]]
        with torch.no_grad():
            expected = sub(torch.from_numpy(probe)).numpy()
        np.testing.assert_allclose(probe @ weight + bias, expected, rtol=1e-5, atol=1e-5, err_msg=name)
        checked += 1
    return checked


def test_gpt2_conv1d_weights_square_and_not_all_stay_in_place_and_run_as_torch(tmp_path):
    model = _gpt2()
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    report = convert(tmp_path / "gpt2.pt", tmp_path / "gpt2.bpk", pytorch=True)
    assert report.transposed == []  # Conv1D already stores (in, out): none moves
    kept = dict(report.kept)
    assert "h.0.attn.c_proj.weight" in kept and "follows" in kept["h.0.attn.c_proj.weight"]  # the square one
    assert "h.1.mlp.c_fc.weight" in kept and "bias follows dim 1" in kept["h.1.mlp.c_fc.weight"]
    untouched = dict(report.untouched)
    assert set(untouched) == {"wte.weight", "wpe.weight"}
    assert "without a bias" in untouched["wte.weight"]  # the true reason: no bias at all
    tensors = _bpk_tensors(tmp_path / "gpt2.bpk")
    assert _linear_layers_match_torch(model, tensors) == 8  # 2 layers x c_attn, attn.c_proj, c_fc, mlp.c_proj
    back = _gpt2()
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    back.load_state_dict(_as_torch_names(tensors), strict=False)
    np.testing.assert_allclose(_out(back), _out(model), rtol=1e-5, atol=1e-5)


def test_bert_linear_weights_square_and_not_are_all_transposed_and_come_back_to_torch(tmp_path):
    model = _bert()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    torch.save(state, tmp_path / "bert.pt")
    report = convert(tmp_path / "bert.pt", tmp_path / "bert.bpk", pytorch=True)
    moved = {name for name, _, _ in report.transposed}
    assert "encoder.layer.0.attention.self.query.weight" in moved  # square [8, 8]
    assert "encoder.layer.1.intermediate.dense.weight" in moved  # [12, 8]
    assert "pooler.dense.weight" in moved  # square, its own family: follows the file
    assert report.kept == []
    tensors = _bpk_tensors(tmp_path / "bert.bpk")
    assert _linear_layers_match_torch(model, tensors) == 2 * 6 + 1
    # and back: Burn -> PyTorch layout, loaded strictly by torch
    safetensors_torch = pytest.importorskip("safetensors.torch")
    convert(tmp_path / "bert.bpk", tmp_path / "bert.safetensors", pytorch=True, lossless=False)
    back = _bert()
    missing, unexpected = back.load_state_dict(safetensors_torch.load_file(str(tmp_path / "bert.safetensors")),
                                               strict=False)
    assert not unexpected and all(k.endswith("position_ids") for k in missing)
    np.testing.assert_allclose(_out(back), _out(model), rtol=1e-5, atol=1e-5)


def test_the_cli_converts_gpt2_with_pytorch_keeping_every_conv1d_weight(tmp_path):
    from onnxparam.cli import main

    torch.save(_gpt2().state_dict(), tmp_path / "gpt2.pt")
    assert main(["convert", str(tmp_path / "gpt2.pt"), str(tmp_path / "gpt2.bpk"), "--pytorch", "-q"]) == 0
    source = torch.load(tmp_path / "gpt2.pt")
    written = _bpk_tensors(tmp_path / "gpt2.bpk")
    for name in ("h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.weight"):
        np.testing.assert_array_equal(written[name], source[name].numpy())


def test_a_file_without_evidence_leaves_its_square_weights_untouched_and_says_why(tmp_path):
    rng = np.random.default_rng(3)
    state = {"a.weight": torch.from_numpy(rng.standard_normal((4, 4)).astype(np.float32)),
             "a.bias": torch.from_numpy(rng.standard_normal(4).astype(np.float32))}
    torch.save(state, tmp_path / "sq.pt")
    report = convert(tmp_path / "sq.pt", tmp_path / "sq.bpk", pytorch=True)
    assert report.transposed == [] and report.kept == []
    (name, why), = report.untouched
    assert name == "a.weight" and "fits both dims" in why and "no non-square weight" in why
    np.testing.assert_array_equal(_bpk_tensors(tmp_path / "sq.bpk")["a.weight"], state["a.weight"].numpy())
    assert "a.weight: square weight [4, 4]" in str(report)


def test_a_family_with_both_layouts_or_a_bias_that_fits_no_dim_is_untouched_with_its_reason(tmp_path):
    z = lambda *s: torch.zeros(*s)  # noqa: E731
    state = {"f.0.p.weight": z(4, 6), "f.0.p.bias": z(4),  # (out, in)
             "f.1.p.weight": z(6, 4), "f.1.p.bias": z(4),  # (in, out)
             "f.2.p.weight": z(4, 4), "f.2.p.bias": z(4),  # square, its family says both
             "g.weight": z(3, 5), "g.bias": z(7)}  # bias fits neither dim
    torch.save(state, tmp_path / "mixed.pt")
    report = convert(tmp_path / "mixed.pt", tmp_path / "mixed.bpk", pytorch=True)
    untouched = dict(report.untouched)
    assert "family 'f.*.p' holds both layouts" in untouched["f.2.p.weight"]
    assert "length 7, which is neither dim of [3, 5]" in untouched["g.weight"]
    assert [n for n, _, _ in report.transposed] == ["f.0.p.weight"]
    assert [n for n, _ in report.kept] == ["f.1.p.weight"]


class _Block(op.Module):
    def __init__(self):
        self.c_attn = nn.Linear(8, 24)
        self.c_proj = nn.Linear(8, 8)


class _Gpt2Layers(op.Module):
    """GPT-2's Conv1D layers of one block as Burn Linears (same paths)."""

    def __init__(self):
        self.attn = _Block()


def test_with_a_module_a_conv1d_file_is_refused_with_the_no_transpose_that_loads_it(tmp_path):
    model = _gpt2()
    state = {k: v for k, v in model.state_dict().items() if k.startswith("h.0.attn.c_")}
    state = {k[len("h.0."):]: v for k, v in state.items()}
    torch.save(state, tmp_path / "block.pt")
    with pytest.raises(op.RecordError) as info:
        load_pytorch(_Gpt2Layers(), tmp_path / "block.pt")
    text = "\n".join(info.value.problems)
    assert "'attn.c_proj.weight' is a Linear weight, but the file stores it (in, out)" in text  # square: caught
    assert "Conv1D" in text and "no_transpose" in text
    import re

    suggested = re.search(r'no_transpose=r"([^"]+)"', text).group(1)  # the adapter the message names
    adapter = PyTorchAdapter(no_transpose=suggested)
    loaded = load_pytorch(_Gpt2Layers(), tmp_path / "block.pt", adapter=adapter)
    x = np.random.default_rng(4).standard_normal((2, 8)).astype(np.float32)
    for name in ("c_attn", "c_proj"):
        with torch.no_grad():
            expected = getattr(model.h[0].attn, name)(torch.from_numpy(x)).numpy()
        got = getattr(loaded.attn, name)(op.Tensor.from_numpy(x)).to_numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # nn.Linear files still load by layer type
    lin = torch.nn.Linear(8, 8)
    layer = apply_record(nn.Linear(8, 8), lin.state_dict(), adapter="pytorch")
    with torch.no_grad():
        np.testing.assert_allclose(layer(op.Tensor.from_numpy(x)).to_numpy(), lin(torch.from_numpy(x)).numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_load_safetensors_with_the_pytorch_adapter_refuses_a_conv1d_file_the_same_way(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from onnxparam.convert import load_safetensors

    model = _gpt2()
    state = {k[len("h.0."):]: v.contiguous() for k, v in model.state_dict().items() if k.startswith("h.0.attn.c_")}
    safetensors_torch.save_file(state, str(tmp_path / "block.safetensors"))
    with pytest.raises(op.RecordError, match="Conv1D"):
        load_safetensors(_Gpt2Layers(), tmp_path / "block.safetensors", adapter="pytorch")
    adapter = PyTorchAdapter(no_transpose=r"^attn\.(c_attn|c_proj)\.weight$")
    loaded = load_safetensors(_Gpt2Layers(), tmp_path / "block.safetensors", adapter=adapter)
    x = np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32)
    with torch.no_grad():
        expected = model.h[0].attn.c_attn(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(loaded.attn.c_attn(op.Tensor.from_numpy(x)).to_numpy(), expected, rtol=1e-5, atol=1e-5)


def test_gptj_style_bias_free_projections_are_untouched_and_said_so_the_rest_follows_its_bias(tmp_path):
    torch.manual_seed(3)
    config = transformers.GPTJConfig(n_embd=8, n_layer=2, n_head=2, rotary_dim=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPTJForCausalLM(config).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("masked_bias", ".bias_mask"))}
    state = {k: v for k, v in state.items() if v.dtype.is_floating_point}
    torch.save(state, tmp_path / "gptj.pt")
    report = convert(tmp_path / "gptj.pt", tmp_path / "gptj.bpk", pytorch=True)
    moved = {n for n, _, _ in report.transposed}
    assert {"transformer.h.0.mlp.fc_in.weight", "transformer.h.1.mlp.fc_out.weight", "lm_head.weight"} <= moved
    untouched = dict(report.untouched)
    assert "without a bias" in untouched["transformer.h.0.attn.q_proj.weight"]  # nn.Linear(bias=False): no evidence
    tensors = _bpk_tensors(tmp_path / "gptj.bpk")
    np.testing.assert_array_equal(tensors["transformer.h.0.attn.q_proj.weight"],
                                  state["transformer.h.0.attn.q_proj.weight"].numpy())  # left as it was
    assert _linear_layers_match_torch(model, tensors) == 2 * 2 + 1  # fc_in, fc_out per layer, lm_head
    # back into torch: what was transposed is transposed back, the rest is as written
    back = {}
    for name, value in _as_torch_names(tensors).items():
        back[name] = value.T.contiguous() if name in moved else value
    restored = transformers.GPTJForCausalLM(config).eval()
    missing, unexpected = restored.load_state_dict(back, strict=False)
    assert not unexpected
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        np.testing.assert_allclose(restored(input_ids=ids).logits.numpy(), model(input_ids=ids).logits.numpy(),
                                   rtol=1e-5, atol=1e-5)
