"""Batched LoRA follows the batch through the graph (``onnxparam/lora/_batch_axis.py``): a row's
adapter lands on that row's values whatever layout the adapted node sees, or the export / call
is refused naming the weight and the node where the batch axis was lost; never rows mixed.

Oracle: PEFT in torch with two adapters (ranks 2 / 3), run per row with ``set_adapter`` (row
``n`` of the whole batch's output under adapter ``rows[n]``; ``disable_adapter`` for the base
rows): PEFT's own ``adapter_names=`` splits dim 0 of each adapted layer's input, which is not
the batch in a sequence-first model. Both the ``lora="batched"`` export in plain ONNX Runtime and
``module(x, adapter_index=...)`` must match it within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from torch_peft import export, import_with_adapters, peft_lora, peft_with_adapters, randomize, session  # noqa: E402

from onnxparam import Tensor, export_onnx  # noqa: E402

ATOL = 1e-5
ADAPTERS = {"s1": (2, 4), "s2": (3, 5)}  # name: (r, alpha)
ROWS = ["s1", None, "s2", "s1"]


class SeqFirst(torch.nn.Module):
    """``fc`` on ``[T, B, D]`` (``x.transpose(0, 1)``), back to batch-first, then ``out``."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.fc(x.transpose(0, 1)).transpose(0, 1))


class PermutedRows(torch.nn.Module):
    """``fc`` on ``x.permute(1, 0, 2).reshape(-1, D)``: rows in (t, b) order, a ``Gemm``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x.permute(1, 0, 2).reshape(-1, 6))
        return h.reshape(x.shape[1], x.shape[0], 6).permute(1, 0, 2)


class FoldedConv(torch.nn.Module):
    """``Conv1d`` on ``[B * T, C, L]`` (``x.reshape(-1, 2, 5)`` of ``[B, T, 2, 5]``)."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = torch.nn.Conv1d(2, 4, 3, padding=1), torch.nn.Linear(4 * 3 * 5, 3)

    def forward(self, x):
        return self.out(self.conv(x.reshape(-1, 2, 5)).reshape(x.shape[0], -1))


class Tagger(torch.nn.Module):
    """Embedding -> batch-first LSTM -> Linear over each token."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 6)
        self.lstm = torch.nn.LSTM(6, 5, batch_first=True)
        self.head = torch.nn.Linear(5, 4)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


class SeqFirstIds(torch.nn.Module):
    """An embedding of sequence-first ids ``[T, B]`` (``ids.t()``), ``out`` on ``[T, B, D]``, back
    batch-first."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(20, 6), torch.nn.Linear(6, 3)

    def forward(self, ids):
        return self.out(self.emb(ids.t())).transpose(0, 1)


class SeqFirstGru(torch.nn.Module):
    """``fc`` -> sequence-first bidirectional GRU (``layout=0``: the batch on axis 1 of X, 2 of
    Y) -> ``head`` on ``[T, B, 2 * H]`` -> batch-first."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(10, 3)
        self.gru = torch.nn.GRU(6, 5, bidirectional=True)

    def forward(self, x):
        return self.head(self.gru(self.fc(x).transpose(0, 1))[0]).transpose(0, 1)


def _setup(model, x, targets, tmp_path, exporter="torchscript", lora_bias=False):
    """``(module with the named adapters, per-row PEFT outputs, the torch input as numpy)``."""
    randomize(model.eval(), seed=7)
    path = export(model, (x,), tmp_path / "model.onnx", exporter, dynamic={0: "batch"}, input_names=["x"],
                  output_names=["y"])
    for k, (name, (r, alpha)) in enumerate(ADAPTERS.items()):
        peft_lora(model, targets, r, alpha, seed=40 + k, folder=tmp_path / name, lora_bias=lora_bias)
    reference = peft_with_adapters(model, {name: tmp_path / name for name in ADAPTERS})
    rows = []
    with torch.no_grad():
        for n, name in enumerate(ROWS):
            if name is None:
                with reference.disable_adapter():
                    rows.append(reference(x)[n].numpy())
            else:
                reference.set_adapter(name)
                rows.append(reference(x)[n].numpy())
    module = import_with_adapters(path, {name: tmp_path / name for name in ADAPTERS})
    return module, np.stack(rows), x.numpy()


def _index():
    return np.asarray([0 if r is None else list(ADAPTERS).index(r) + 1 for r in ROWS], dtype=np.int64)


def _both(module, x, tmp_path, expected):
    """The batched export in plain ONNX Runtime (the whole batch, and its first two rows: a
    dynamic batch) and ``module(x, adapter_index=...)`` give each row ``expected``'s."""
    exported = export_onnx(module, tmp_path / "batched.onnx", x, lora="batched")
    run = session(exported)
    np.testing.assert_allclose(run.run(None, {"x": x, "adapter_index": _index()})[0], expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(run.run(None, {"x": x[:2], "adapter_index": _index()[:2]})[0], expected[:2],
                               atol=ATOL, rtol=0)
    called = module(Tensor.from_numpy(x), adapter_index=ROWS).to_numpy()
    np.testing.assert_allclose(called, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seq", [3, 4])  # seq 4 = the batch: the dims alone cannot tell the axes apart
def test_a_sequence_first_linear_takes_each_rows_adapter_on_its_batch_axis(tmp_path, seq):
    torch.manual_seed(0)
    module, expected, x = _setup(SeqFirst(), torch.randn(4, seq, 6), ["fc"], tmp_path)
    _both(module, x, tmp_path, expected)


def test_rows_flattened_in_sequence_major_order_take_each_rows_adapter(tmp_path):
    """``[T * B, D]`` rows (the batch the inner factor of axis 0): followed as a factor of the
    axis and viewed per row (refused before the factor was followed; wrong numbers before that)."""
    torch.manual_seed(0)
    module, expected, x = _setup(PermutedRows(), torch.randn(4, 3, 6), ["fc"], tmp_path)
    _both(module, x, tmp_path, expected)


@pytest.mark.parametrize("lora_bias", [False, True])
def test_a_conv_whose_input_folds_the_batch_takes_each_rows_adapter(tmp_path, lora_bias):
    """``lora_bias``: the conv's bias adapter too, added per row to the ``[batch * T, C, L]``
    output (refused before)."""
    torch.manual_seed(0)
    module, expected, x = _setup(FoldedConv(), torch.randn(4, 3, 2, 5), ["conv"], tmp_path, lora_bias=lora_bias)
    _both(module, x, tmp_path, expected)


def test_a_batch_first_lstm_tagger_keeps_its_embedding_and_head_rows(tmp_path):
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 20, size=(4, 5)))
    module, expected, x = _setup(Tagger(), ids, ["emb", "head"], tmp_path)
    _both(module, x, tmp_path, expected)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_sequence_first_embedding_ids_take_each_rows_adapter(tmp_path, exporter):
    """Ids ``[T, B]`` (the batch on axis 1; refused before): the branch reads them batch-first."""
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, 20, size=(4, 5)))
    module, expected, x = _setup(SeqFirstIds(), ids, ["emb", "out"], tmp_path, exporter)
    _both(module, x, tmp_path, expected)


@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_a_sequence_first_bidirectional_gru_keeps_the_rows_of_the_layers_around_it(tmp_path, exporter):
    torch.manual_seed(0)
    module, expected, x = _setup(SeqFirstGru(), torch.randn(4, 3, 6), ["fc", "head"], tmp_path, exporter)
    _both(module, x, tmp_path, expected)


class _Last(torch.nn.Module):
    """A ``transformers`` model's last hidden state from one input (``input_ids`` / ``pixel_values``)."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(**{self.key: x}).last_hidden_state


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    model = randomize(_Last(transformers.GPT2Model(config), "input_ids").eval(), seed=1)
    return model, torch.from_numpy(np.random.default_rng(0).integers(0, 40, size=(4, 5))), ["c_attn", "c_proj",
                                                                                              "c_fc", "wte"]


def _vit():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=24)
    torch.manual_seed(0)
    model = randomize(_Last(transformers.ViTModel(config, add_pooling_layer=False), "pixel_values").eval(), seed=2,
                      std=0.2)
    return model, torch.randn(4, 3, 8, 8), ["query", "value", "dense", "projection"]


@pytest.mark.parametrize("name,exporter,lora_bias", [
    ("gpt2", "torchscript", False), ("vit", "torchscript", False), ("gpt2", "dynamo", True),
    pytest.param("gpt2", "dynamo", False, marks=pytest.mark.slow),
    pytest.param("vit", "dynamo", False, marks=pytest.mark.slow)])
def test_gpt2_and_vit_rows_are_followed_through_their_reshapes(tmp_path, name, exporter, lora_bias):
    """GPT-2's ``Conv1D`` (``[batch * seq, d]`` ``Gemm`` s between reshapes; dynamo: a ``Split``,
    and the attention output ``[b * s, d]`` flattened from ``[b, s, h, hd]`` with ``h`` a symbolic
    dim: with ``lora_bias`` its ``Gemm`` output must keep the rows too) and ViT's patch ``Conv`` +
    class token ``Concat``: every target accepted, each row PEFT's mixed-batch output
    (``adapter_names=``: batch-major models)."""
    model, x, targets = {"gpt2": _gpt2, "vit": _vit}[name]()
    dynamic = {0: "batch", 1: "seq"} if lora_bias else {0: "batch"}  # a symbolic seq leaves h unknown
    path = export(model, (x,), tmp_path / "model.onnx", exporter, dynamic=dynamic, input_names=["x"],
                  output_names=["y"])
    for k, (adapter, (r, alpha)) in enumerate(ADAPTERS.items()):
        # NOTE: PEFT has no lora_bias for an Embedding: the bias variant leaves wte out
        peft_lora(model, [t for t in targets if not (lora_bias and t == "wte")], r, alpha, seed=50 + k,
                  folder=tmp_path / adapter, lora_bias=lora_bias)
    reference = peft_with_adapters(model, {adapter: tmp_path / adapter for adapter in ADAPTERS})
    with torch.no_grad():
        expected = reference(x, adapter_names=["__base__" if r is None else r for r in ROWS]).numpy()
    module = import_with_adapters(path, {adapter: tmp_path / adapter for adapter in ADAPTERS}, allow_partial=True)
    _both(module, x.numpy(), tmp_path, expected)
