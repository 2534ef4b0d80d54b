"""Convolution LoRA on convs whose input window PEFT's ``lora_A`` may not share: dilation, padding
modes, ``padding="same"``, asymmetric pads (``onnxparam.lora._conv_checks``).

PEFT 0.21's ``lora_A`` is ``ConvNd(in, r, kernel, stride, padding)``: the base's stride and
padding, no dilation, zero padding. Oracles, all PEFT in torch on the net the ONNX file came from
(TorchScript export; dynamo: ``slow``, it folds a ``ZeroPad2d`` into the ``Conv``'s pads):

* grouped convs (``groups=2``: no merged weight exists, PEFT's unmerged forward is the only
  definition) where ``lora_A`` reads the base's windows: ``padding="same"`` with an even kernel
  (``auto_pad``), a dilation on a length-1 kernel axis, a ``ZeroPad2d`` before the conv (a
  ``Pad`` node) and the same pad folded into the ``Conv``'s asymmetric ``pads``: the batched
  export in ONNX Runtime and ``module(x, adapter_index=...)`` equal PEFT's mixed batch
  (``adapter_names=``), and a ``"keep"`` export of one adapter equals PEFT's forward with it,
  within 1e-5; with ``groups=1`` the ``"merge"`` export equals them too;
* grouped convs where they differ (a dilated 3x3 kernel, where PEFT's forward still runs through
  stride 3; ``padding_mode="reflect"``, a ``Pad`` node; ``padding_mode="circular"``, a
  ``Concat`` of ``Slice`` s from TorchScript, a ``wrap`` ``Pad`` from dynamo): every branch mode
  refuses with a ``LoraError`` naming the weight, the node and the reason;
* the same convs with ``groups=1``: the adapter is a weight delta, every mode applies the
  merged weight: batched rows equal PEFT's merged model (``merge_and_unload``), whose output
  differs from PEFT's unmerged forward (asserted: the doubt is real).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_lora_batched_conv import export_net  # noqa: E402
from torch_peft import peft_lora, peft_with_adapters, quiet, randomize, session  # noqa: E402

from onnxparam import LoraError, Tensor, export_onnx, import_onnx, load_peft_adapter  # noqa: E402

ATOL = 1e-5
ADAPTERS = {"one": (2, 5, False), "two": (4, 3, True)}  # name: (r, alpha, rslora); ranks divisible by groups=2
ROWS = ["two", "__base__", "one", "two", "one"]
IN_SHAPE = (4, 6, 6)


class Net(torch.nn.Module):
    """``pad`` (or none) -> ``conv`` -> relu -> flatten -> ``Linear`` (the flat size from a probe)."""

    def __init__(self, conv, pad=None):
        super().__init__()
        self.pad = pad if pad is not None else torch.nn.Identity()
        self.conv = conv
        with torch.no_grad(), quiet():  # torch warns (once) of padding="same" with an even kernel
            size = self.conv(self.pad(torch.zeros(1, *IN_SHAPE))).numel()
        self.fc = torch.nn.Linear(size, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(self.pad(x))).flatten(1))


def fold_zero_pad(path, pads):
    """The exported file ``path`` with its ``Pad`` node removed and ``pads`` (ONNX order
    ``[top, left, bottom, right]``) set on the ``Conv`` it fed; nodes left unused are dropped
    (a file without ``Pad``: its ``Conv`` already has ``pads``)."""
    model = onnx.load(str(path))
    graph = model.graph
    pad = next((n for n in graph.node if n.op_type == "Pad"), None)
    if pad is None:  # torch's dynamo exporter folds a zero pad into the Conv itself
        conv = next(n for n in graph.node if n.op_type == "Conv")
        assert {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}["pads"] == list(pads)
        return path
    conv = next(n for n in graph.node if n.op_type == "Conv" and n.input[0] == pad.output[0])
    conv.input[0] = pad.input[0]
    for attr in [a for a in conv.attribute if a.name in ("pads", "auto_pad")]:
        conv.attribute.remove(attr)
    conv.attribute.append(onnx.helper.make_attribute("pads", list(pads)))
    graph.node.remove(pad)
    while True:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    onnx.save(model, str(path))
    return path


def build(tmp_path, model, fold=None, exporter="torchscript"):
    """``(module with the named adapters, x, PEFT's mixed-batch rows, PEFT's model)``: ``model``
    exported (``fold``: its zero ``Pad`` folded into the ``Conv``'s pads) and imported, each
    adapter of :data:`ADAPTERS` on ``conv`` saved by PEFT and loaded into both."""
    path = export_net(model, IN_SHAPE, tmp_path / "net.onnx", exporter)
    if fold is not None:
        path = fold_zero_pad(path, fold)
    imported = import_onnx(path)
    module = imported
    for k, (name, (r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        peft_lora(model, ["conv"], r, alpha, rslora=rslora, seed=60 + k, folder=tmp_path / name)
        module = module.add_adapter(name, load_peft_adapter(imported, tmp_path / name))
    reference = peft_with_adapters(model, {name: tmp_path / name for name in ADAPTERS})
    x = np.random.default_rng(5).normal(size=(len(ROWS), *IN_SHAPE)).astype(np.float32)
    with torch.no_grad():
        expected = reference(torch.from_numpy(x), adapter_names=list(ROWS)).numpy()
    return module, x, expected, reference


def batched_rows(module, x, tmp_path):
    """``(ONNX Runtime's rows of the batched export, module(x, adapter_index=...)'s)`` for :data:`ROWS`."""
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora="batched")
    index = np.asarray([0 if n == "__base__" else list(ADAPTERS).index(n) + 1 for n in ROWS], dtype=np.int64)
    sess = session(path)
    got = sess.run(None, {sess.get_inputs()[0].name: x, "adapter_index": index})[0]
    rows = module(Tensor.from_numpy(x), adapter_index=[None if n == "__base__" else n for n in ROWS]).to_numpy()
    return got, rows


def one_adapter(module, x, tmp_path, name, mode):
    """Plain ONNX Runtime on a ``mode`` export of ``module`` with adapter ``name`` active."""
    path = export_onnx(module.set_adapter(name), tmp_path / f"{mode}.onnx", x[:2], lora=mode)
    sess = session(path)
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


AGREE = {  # name: (conv, pad before it, the pad folded into the Conv's pads [top, left, bottom, right],
    #              what the exported graph holds: (the Conv's attribute, its value) or the op feeding it)
    "same-even-kernel": (lambda g: torch.nn.Conv2d(4, 4, 4, padding="same", groups=g), None, None,
                         ("auto_pad", b"SAME_UPPER")),
    "dilated-1-tap-axis": (lambda g: torch.nn.Conv2d(4, 4, (1, 3), padding=(0, 1), dilation=(2, 1), groups=g),
                           None, None, ("dilations", [2, 1])),
    "zero-pad-node": (lambda g: torch.nn.Conv2d(4, 4, 3, groups=g), (0, 1, 2, 0), None, "Pad"),
    "asymmetric-pads": (lambda g: torch.nn.Conv2d(4, 4, 3, groups=g), (0, 1, 2, 0), [2, 0, 0, 1],
                        ("pads", [2, 0, 0, 1])),
}


def check_graph(path, holds):  # TorchScript's graphs (dynamo folds a ZeroPad2d, pads padding="same")
    """The ``Conv`` of the file ``path`` has ``holds`` (``(attribute, value)``), or is fed by an op
    of type ``holds``."""
    graph = onnx.load(str(path)).graph
    conv = next(n for n in graph.node if n.op_type == "Conv")
    if isinstance(holds, str):
        assert next(n.op_type for n in graph.node if conv.input[0] in n.output) == holds
        return
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}
    assert attrs[holds[0]] == holds[1], attrs


EXPORTERS = ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)]


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("groups", [2, 1])
@pytest.mark.parametrize("case", list(AGREE))
def test_convs_whose_windows_lora_a_shares_equal_pefts_mixed_batch(tmp_path, case, groups, exporter):
    conv, pad, fold, holds = AGREE[case]
    model = randomize(Net(conv(groups), torch.nn.ZeroPad2d(pad) if pad else None).eval(), seed=21)
    module, x, expected, reference = build(tmp_path, model, fold, exporter)
    if exporter == "torchscript":
        check_graph(tmp_path / "net.onnx", holds)
    got, rows = batched_rows(module, x, tmp_path)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(rows, expected, atol=ATOL, rtol=0)
    with torch.no_grad():
        plain = model(torch.from_numpy(x)).numpy()
    assert np.abs(expected - plain).max(axis=1)[[0, 2, 3, 4]].min() > 1e-2  # every adapter row changes
    with torch.no_grad():
        two = reference(torch.from_numpy(x), adapter_names=["two"] * len(x)).numpy()
    for mode in ("keep", "merge") if groups == 1 else ("keep",):
        np.testing.assert_allclose(one_adapter(module, x, tmp_path, "two", mode), two, atol=ATOL, rtol=0,
                                   err_msg=mode)


DISAGREE = {  # name: (conv, pad module before it, what the refusal names)
    "dilated-kernel": (lambda g: torch.nn.Conv2d(4, 4, 3, stride=3, padding=1, dilation=2, groups=g), None,
                       r"dilations=\[2, 2\] with a \[3, 3\] kernel: PEFT's lora_A takes the base's stride and padding "
                       "but no dilation"),
    "reflect-padding": (lambda g: torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect", groups=g), None,
                        r"its input is padded by Pad node '[^']+' \(mode='reflect'\): torch writes that for a ConvNd "
                        "with padding_mode='reflect'"),
    # TorchScript: a Concat of Slices; dynamo: a Pad of mode 'wrap'
    "circular-padding": (lambda g: torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular", groups=g), None,
                         r"its input is (wrapped by Concat|padded by Pad) node '[^']+' .*torch.*writes that for a "
                         r"ConvNd with padding_mode='.*circular'"),
}


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("case", list(DISAGREE))
def test_grouped_convs_whose_windows_lora_a_does_not_share_are_refused_in_every_branch(tmp_path, case, exporter):
    conv, pad, words = DISAGREE[case]
    model = randomize(Net(conv(2), pad).eval(), seed=22)
    module, x, expected, _ = build(tmp_path, model, exporter=exporter)  # PEFT's own forward runs (stride 3: the same output size)
    weight = r"'conv.weight' \[4, 2, 3, 3\] is the weight of Conv node '[^']+' \(group=2, "
    for mode in ("batched", "keep", "inputs"):
        with pytest.raises(LoraError, match=f"lora='{mode}': {weight}.*{words}"):
            export_onnx(module.set_adapter("one") if mode != "batched" else module, tmp_path / f"{mode}.onnx", x[:2],
                        lora=mode)
    with pytest.raises(LoraError, match=words):
        module(Tensor.from_numpy(x), adapter_index=["one"])
    with pytest.raises(LoraError, match=words):
        module.set_adapter("one")(Tensor.from_numpy(x))


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("case", list(DISAGREE))
def test_a_weight_delta_on_such_a_conv_is_the_merged_weight_in_every_mode(tmp_path, case, exporter):
    """``groups=1``: batched rows, ``"merge"`` and ``"keep"`` exports equal PEFT's merged model
    (``merge_and_unload``, one adapter at a time), which differs from PEFT's unmerged forward."""
    conv, pad, _ = DISAGREE[case]
    model = randomize(Net(conv(1), pad).eval(), seed=23)
    module, x, unmerged, _ = build(tmp_path, model, exporter=exporter)
    merged = {}
    for name in ADAPTERS:
        with quiet():
            one = peft_with_adapters(model, {name: tmp_path / name}).merge_and_unload()
        with torch.no_grad():
            merged[name] = one(torch.from_numpy(x)).numpy()
    with torch.no_grad():
        merged["__base__"] = model(torch.from_numpy(x)).numpy()
    expected = np.stack([merged[n][i] for i, n in enumerate(ROWS)])
    got, rows = batched_rows(module, x, tmp_path)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(rows, expected, atol=ATOL, rtol=0)
    assert np.abs(unmerged - expected).max() > 1e-2  # PEFT's unmerged forward is another function here
    for mode in ("merge", "keep"):
        np.testing.assert_allclose(one_adapter(module, x, tmp_path, "two", mode), merged["two"], atol=ATOL, rtol=0,
                                   err_msg=mode)
