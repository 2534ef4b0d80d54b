"""Batched LoRA through torch's ``nn.MultiheadAttention`` (``onnxparam/lora/_batch_axis.py``, the
batch as a factor of an axis): a ``TransformerEncoderLayer`` views ``[seq, batch * heads, d]``
inside its attention and feeds ``out_proj`` ``[seq * batch, d]`` (the batch the inner factor),
with ``batch_first`` True and False. Every target (``out_proj`` and the feed-forward ``linear1`` /
``linear2`` after it) takes each row's adapter, in the ``lora="batched"`` export (plain ONNX
Runtime) and in ``module(x, adapter_index=...)``, from files written by torch's TorchScript and
dynamo exporters; and a ``TransformerDecoderLayer`` (self- and cross-attention, two inputs).

Oracle: torch itself with each adapter merged, ``W + scale * B @ A`` for the row's adapter
(``scale = alpha / r``), the factors drawn by PEFT. PEFT cannot be the oracle here: its LoRA on
``out_proj`` (a ``lora.Linear``) is bypassed by ``nn.MultiheadAttention``'s functional forward,
which reads ``out_proj.weight`` directly (PEFT's docs say so), and PEFT's ``MultiheadAttention``
LoRA layer (targeting ``self_attn``) adapts ``in_proj`` and ``out_proj`` together and refuses
mixed batches (``adapter_names=``). "No adapter" rows equal plain ONNX Runtime on the original file
(bit for bit with ONNX Runtime's graph optimizations off on both sides).
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from torch_peft import export, import_with_adapters, peft_lora, quiet, randomize, session  # noqa: E402

from onnxparam import LoraError, Tensor, export_onnx, import_onnx, load_peft_adapter  # noqa: E402

ATOL = 1e-5
ADAPTERS = {"s1": (2, 4), "s2": (3, 5)}  # name: (r, alpha)
ROWS = ["s1", None, "s2", "s1"]
TARGETS = ["linear1", "linear2", "out_proj"]


class Encoder(torch.nn.Module):
    """``TransformerEncoderLayer(16, 2 heads, 32)`` on a batch-first ``[B, T, 16]`` input; with
    ``batch_first=False`` the layer runs sequence-first inside (``x.transpose(0, 1)``)."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)

    def forward(self, x):
        if self.batch_first:
            return self.layer(x)
        return self.layer(x.transpose(0, 1)).transpose(0, 1)


def _merged(model, lora_model, name: str):
    """A copy of ``model`` with PEFT's adapter of ``lora_model`` merged by hand: ``W + scale * B @ A``."""
    merged = copy.deepcopy(model)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for path, layer in lora_model.named_modules():
            if not (hasattr(layer, "lora_A") and "default" in getattr(layer, "lora_A", {})):
                continue
            delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
            modules[path.removeprefix("base_model.model.")].weight += delta
    return merged


def _setup(batch_first: bool, exporter: str, tmp_path, targets=TARGETS):
    """``(module with the named adapters, per-row torch outputs, plain ORT output, x)``."""
    torch.manual_seed(0)
    model = randomize(Encoder(batch_first).eval(), seed=7)
    x = torch.randn(4, 3, 16)
    path = export(model, (x,), tmp_path / "model.onnx", exporter, dynamic={0: "batch"}, input_names=["x"],
                  output_names=["y"])
    return (*_adapted(model, path, x, tmp_path, targets), x.numpy())


def _adapted(model, path, x, tmp_path, targets=TARGETS):
    """``(the import of path with ADAPTERS drawn by PEFT on model, expected rows, plain ORT output)``:
    row ``n`` of ``x`` is torch with ``ROWS[n]``'s adapter merged, or plain ORT on ``path``."""
    outputs = {}
    for k, (name, (r, alpha)) in enumerate(ADAPTERS.items()):
        lora_model = peft_lora(model, targets, r, alpha, seed=40 + k, folder=tmp_path / name)
        with torch.no_grad():
            outputs[name] = _merged(model, lora_model, name)(x).numpy()
    plain = session(path).run(None, {"x": x.numpy()})[0]
    expected = np.stack([plain[n] if r is None else outputs[r][n] for n, r in enumerate(ROWS)])
    module = import_with_adapters(path, {name: tmp_path / name for name in ADAPTERS})
    return module, expected, plain


def _unfused(path):
    """Plain ONNX Runtime on ``path`` with every graph optimization off (CPU)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _index():
    return np.asarray([0 if r is None else list(ADAPTERS).index(r) + 1 for r in ROWS], dtype=np.int64)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_each_row_of_a_transformer_encoder_layer_takes_its_adapter(tmp_path, batch_first, exporter):
    module, expected, plain, x = _setup(batch_first, exporter, tmp_path)
    assert not np.allclose(expected[0], plain[0], atol=1e-3)  # the adapters change the rows
    exported = export_onnx(module, tmp_path / "batched.onnx", x, lora="batched")
    run = session(exported)
    got = run.run(None, {"x": x, "adapter_index": _index()})[0]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    # the "no adapter" row: exactly the base's, with ONNX Runtime's graph fusions off on both sides
    # (with them on, the two graphs' nodes fuse differently: a few float32 ulps)
    np.testing.assert_array_equal(_unfused(exported).run(None, {"x": x, "adapter_index": _index()})[0][1],
                                  _unfused(tmp_path / "model.onnx").run(None, {"x": x})[0][1])
    np.testing.assert_allclose(run.run(None, {"x": x[:2], "adapter_index": _index()[:2]})[0], expected[:2],
                               atol=ATOL, rtol=0)
    called = module(Tensor.from_numpy(x), adapter_index=ROWS).to_numpy()
    np.testing.assert_allclose(called, expected, atol=ATOL, rtol=0)


def test_a_symbolic_sequence_length_is_a_symbolic_co_factor(tmp_path):
    """dynamo with the sequence dynamic too: ``out_proj`` reads ``[seq * batch, d]`` with ``seq``
    a symbol; the export runs at another sequence length (TorchScript bakes the traced length into
    the key / value reshapes, so its file runs at that length only)."""
    torch.manual_seed(0)
    model = randomize(Encoder(True).eval(), seed=7)
    path = export(model, (torch.randn(4, 3, 16),), tmp_path / "model.onnx", "dynamo", dynamic={0: "batch", 1: "seq"},
                  input_names=["x"], output_names=["y"])
    x = torch.randn(4, 5, 16)
    module, expected, _ = _adapted(model, path, x, tmp_path)
    exported = export_onnx(module, tmp_path / "batched.onnx", x.numpy()[:, :3], lora="batched")
    got = session(exported).run(None, {"x": x.numpy(), "adapter_index": _index()})[0]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


class Decoder(torch.nn.Module):
    """``TransformerDecoderLayer(16, 2 heads, 32)``: self-attention on ``x`` ``[B, T, 16]``, then
    cross-attention on ``memory`` ``[B, S, 16]`` (TorchScript: the query and key / value
    projections are slices of ``in_proj_weight``)."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.layer = torch.nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)

    def forward(self, x, memory):
        if self.batch_first:
            return self.layer(x, memory)
        return self.layer(x.transpose(0, 1), memory.transpose(0, 1)).transpose(0, 1)


@pytest.mark.parametrize("exporter,batch_first", [
    ("torchscript", False), pytest.param("dynamo", True, marks=pytest.mark.slow),
    pytest.param("torchscript", True, marks=pytest.mark.slow), pytest.param("dynamo", False, marks=pytest.mark.slow)])
def test_each_row_of_a_transformer_decoder_layer_takes_its_adapter(tmp_path, exporter, batch_first):
    """Both attentions' ``out_proj`` and the feed-forward: the same oracle (torch, merged per row)."""
    torch.manual_seed(0)
    model = randomize(Decoder(batch_first).eval(), seed=7)
    x, memory = torch.randn(4, 3, 16), torch.randn(4, 5, 16)
    path = tmp_path / "model.onnx"
    with quiet(), contextlib.redirect_stdout(None):
        if exporter == "dynamo":
            batch = torch.export.Dim("batch")
            torch.onnx.export(model, (x, memory), str(path), dynamo=True, dynamic_shapes=({0: batch}, {0: batch}),
                              input_names=["x", "memory"], verbose=False)
        else:
            torch.onnx.export(model, (x, memory), str(path), dynamo=False, input_names=["x", "memory"],
                              dynamic_axes={"x": {0: "batch"}, "memory": {0: "batch"}})
    outputs = {}
    for k, (name, (r, alpha)) in enumerate(ADAPTERS.items()):
        lora_model = peft_lora(model, TARGETS, r, alpha, seed=40 + k, folder=tmp_path / name)
        with torch.no_grad():
            outputs[name] = _merged(model, lora_model, name)(x, memory).numpy()
    feeds = {"x": x.numpy(), "memory": memory.numpy()}
    plain = session(path).run(None, feeds)[0]
    expected = np.stack([plain[n] if r is None else outputs[r][n] for n, r in enumerate(ROWS)])
    module = import_with_adapters(path, {name: tmp_path / name for name in ADAPTERS})
    assert {"layer.self_attn.out_proj.weight", "layer.multihead_attn.out_proj.weight"} <= set(
        module.lora_adapters.adapters("s1"))  # both attentions' out_proj are adapted
    exported = export_onnx(module, tmp_path / "batched.onnx", feeds["x"], feeds["memory"], lora="batched")
    got = session(exported).run(None, {**feeds, "adapter_index": _index()})[0]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    called = module(Tensor.from_numpy(feeds["x"]), Tensor.from_numpy(feeds["memory"]), adapter_index=ROWS).to_numpy()
    np.testing.assert_allclose(called, expected, atol=ATOL, rtol=0)


class MixedRows(torch.nn.Module):
    """``fc`` (a ``Gemm``) on ``x + x.flip(0)``: each row of its input mixes two batch elements."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x + x.flip(0))


def test_rows_that_mix_batch_elements_are_still_refused_naming_the_weight_and_node(tmp_path):
    torch.manual_seed(0)
    model = randomize(MixedRows().eval(), seed=7)
    x = torch.randn(4, 16)
    path = export(model, (x,), tmp_path / "model.onnx", "torchscript", dynamic={0: "batch"}, input_names=["x"],
                  output_names=["y"])
    peft_lora(model, ["fc"], 2, 4, seed=40, folder=tmp_path / "s1")
    imported = import_onnx(path)
    module = imported.add_adapter("s1", load_peft_adapter(imported, tmp_path / "s1"))
    for run in (lambda: export_onnx(module, tmp_path / "batched.onnx", x.numpy(), lora="batched"),
                lambda: module(Tensor.from_numpy(x.numpy()), adapter_index=[1, 0, 1, 0])):
        with pytest.raises(LoraError, match=r"'fc\.weight' is adapted at node '\S*Gemm' \(Gemm\).*lost at node '\S*Slice' \(Slice\)"):
            run()
