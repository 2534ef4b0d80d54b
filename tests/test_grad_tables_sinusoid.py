"""Sinusoidal position tables are found by their values and frozen at import (rule 5 of
:mod:`onnxparam.autodiff._tables`), while learned position tables of the same graph shape stay
trainable.

Oracles: the tables' formulas as their models define them (Whisper's ``sinusoids``, fairseq's
``[sin | cos]`` with a zeroed padding row, Vaswani et al. 2017's interleaved form), and PyTorch's
own ``requires_grad`` flags on a transformers ``WhisperEncoder`` exported by torch.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from onnxparam.autodiff._tables import SINUSOID, is_sinusoid_table


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's ``sinusoids`` (``[sin | cos]`` over a geometric range of timescales)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    scaled = np.arange(length)[:, None] * np.exp(-increment * np.arange(channels // 2))[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)


def vaswani(positions: int, channels: int) -> np.ndarray:
    """Attention Is All You Need, section 3.5: sin on even channels, cos on odd ones."""
    angle = np.arange(positions)[:, None] / np.power(10000.0, 2 * (np.arange(channels) // 2) / channels)[None, :]
    out = np.empty((positions, channels), np.float32)
    out[:, 0::2], out[:, 1::2] = np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])
    return out


def fairseq(positions: int, channels: int, padding_idx: int = 1) -> np.ndarray:
    table = whisper_sinusoids(positions, channels)
    table[padding_idx] = 0
    return table


@pytest.mark.parametrize("table", [
    whisper_sinusoids(1500, 384), whisper_sinusoids(16, 8), vaswani(512, 64), fairseq(100, 32),
    whisper_sinusoids(64, 32).T, whisper_sinusoids(64, 32)[None], whisper_sinusoids(64, 32).astype(np.float16),
    whisper_sinusoids(64, 32).astype(ml_dtypes.bfloat16)],
    ids=["whisper", "whisper-small", "vaswani", "fairseq-padding-row", "transposed", "batch-dim", "float16",
         "bfloat16"])
def test_sinusoidal_position_tables_are_recognized(table):
    assert is_sinusoid_table(table)


def _perturbed(rng):
    return whisper_sinusoids(64, 32) + rng.normal(size=(64, 32)).astype(np.float32) * 0.01


@pytest.mark.parametrize("make", [
    lambda rng: rng.normal(size=(64, 32)).astype(np.float32),
    _perturbed,
    lambda rng: np.ones((64, 32), np.float32),
    lambda rng: np.eye(64, 32, dtype=np.float32),
    lambda rng: np.stack([np.linspace(0, 1, 64), np.linspace(1, 0, 64)] * 4, 1).astype(np.float32),
    lambda rng: whisper_sinusoids(6, 8),
    lambda rng: np.arange(64 * 32).reshape(64, 32)],
    ids=["learned", "trained-from-sinusoids", "ones", "one-hot", "linear-ramps", "too-few-positions", "integers"])
def test_other_tables_are_not_sinusoidal(make):
    assert not is_sinusoid_table(make(np.random.default_rng(0)))


def _export(model, x, path, dynamic, dynamo=False):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (torch.from_numpy(x),), str(path), input_names=["x"], output_names=["y"],
                              opset_version=18, dynamo=True, external_data=False)
            return
        torch.onnx.export(model, (torch.from_numpy(x),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}} if dynamic else None,
                          opset_version=17, dynamo=False)


def _trainable_match(module, model) -> tuple:
    """``(imported trainable params without a trainable torch twin, torch trainable params without an
    imported trainable twin)``, twins found by value (as is or transposed)."""
    torch_values = {n: p.detach().numpy() for n, p in model.named_parameters() if p.requires_grad}
    ours = {path: p.val().to_numpy() for path, p in module.named_params() if p.require_grad}

    def same(a, b):
        return (a.shape == b.shape and np.array_equal(a, b)) or (a.ndim == 2 and a.T.shape == b.shape
                                                                and np.array_equal(a.T, b))

    return (sorted(p for p, v in ours.items() if not any(same(v, t) for t in torch_values.values())),
            sorted(n for n, t in torch_values.items() if not any(same(v, t) for v in ours.values())))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_whisper_encoder_imports_with_its_position_table_frozen_as_torch_has_it(tmp_path, dynamo):
    """TorchScript writes ``embed_positions.weight`` unmarked (the value heuristic freezes it).
    dynamo folds the position lookup (``Gather`` by ``arange``) into a new initializer
    ``embedding`` without an ``InputSpec`` mark (only ``folded_from``), so the heuristic decides
    there too. (Had dynamo kept the table itself, it would carry ``PARAMETER``, the mark would win
    and it would train: the mark does not record ``requires_grad=False``.)"""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    import onnxparam as op

    cfg = transformers.WhisperConfig(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, d_model=16,
                                     encoder_ffn_dim=32, max_source_positions=8, dropout=0.0)
    torch.manual_seed(0)
    encoder = WhisperEncoder(cfg).eval()
    assert not encoder.embed_positions.weight.requires_grad  # transformers' own flag: the oracle

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = encoder

        def forward(self, x):
            return self.m(x).last_hidden_state

    x = np.random.default_rng(0).normal(size=(2, 8, 16)).astype(np.float32)
    _export(LastHidden(), x, tmp_path / "whisper.onnx", dynamic=True, dynamo=dynamo)
    module = op.import_onnx(tmp_path / "whisper.onnx")
    positions = encoder.embed_positions.weight.detach().numpy()
    frozen = {path: reason for path, reason in module.onnx_tables.items()
              if np.array_equal(dict(module.named_params())[path].val().to_numpy(), positions)}
    assert list(frozen.values()) == [SINUSOID]
    assert _trainable_match(module, encoder) == ([], [])


def test_a_learned_position_table_of_the_same_graph_shape_stays_trainable(tmp_path):
    torch = pytest.importorskip("torch")

    import onnxparam as op

    class Learned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.randn(1, 16, 8) * 0.02)  # ViT's pos_embed
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x + self.pos)

    torch.manual_seed(0)
    model = Learned().eval()
    _export(model, np.zeros((2, 16, 8), np.float32), tmp_path / "learned.onnx", dynamic=True)
    module = op.import_onnx(tmp_path / "learned.onnx")
    assert module.onnx_tables == {}
    assert _trainable_match(module, model) == ([], [])
