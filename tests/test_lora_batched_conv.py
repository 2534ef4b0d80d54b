"""``lora="batched"`` on convolution weights (PEFT's conv LoRA) and biases (PEFT's
``lora_bias``), against PEFT's mixed-batch forward.

Oracle: ``peft.PeftModel`` in torch with three adapters on a small conv net (a 3x3
``Conv2d`` with stride / padding and a ``Linear``; ranks 2 / 3 / 4, alpha != rank, one rsLoRA,
``lora_bias=True`` on two of them) and ``model(x, adapter_names=[...])``, each row run with its
own adapter (``"__base__"``: none). The net is written by torch's TorchScript exporter (``Conv``
with a bias input, ``Gemm`` with ``C``; dynamo: ``slow``) and imported here; the adapters are PEFT's saved folders
loaded with ``load_peft_adapter``. The batched ONNX file run by plain ONNX Runtime and
``module(x, adapter_index=...)`` must give each row PEFT's output within 1e-5, at a batch size
other than the export's.

Grouped convolutions (PEFT: ``lora_A`` a conv of every input channel, ``lora_B`` a 1x1 conv with
the base's ``groups``; the rank divisible by the groups): the same oracle on a net with a
grouped (groups=2) and a depthwise (groups=6, stride 2) conv, per-module ranks
(``rank_pattern``); one active adapter in ``"keep"`` / ``"inputs"`` equals PEFT's forward, and
merging it is refused. A weight delta on a grouped conv (not PEFT's layout) is refused by name.
The torch / PEFT setup is ``tests/torch_peft.py``'s.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import onnxruntime as ort  # noqa: E402
from torch_peft import export, peft_lora, peft_with_adapters, randomize, session  # noqa: E402

from safetensors.numpy import load_file  # noqa: E402

from onnxparam import (  # noqa: E402
    BatchedLora,
    LoraError,
    RecordError,
    Tensor,
    check_batched_adapters,
    export_onnx,
    import_onnx,
    load_peft_adapter,
    load_peft_adapters,
    write_batched_adapter,
    write_batched_peft,
    write_onnx_adapter,
)
from onnxparam.lora._batched import batched_metadata  # noqa: E402
from onnxparam.lora._batched_run import batched_adapter_params  # noqa: E402

ATOL = 1e-5

# name: (r, alpha, use_rslora, lora_bias)
ADAPTERS = {"one": (2, 5, False, True), "two": (3, 2, True, False), "three": (4, 6, False, True)}
ROWS = ["two", "__base__", "one", "three", "one", "__base__", "three"]


class ConvNet(torch.nn.Module):
    def __init__(self, groups: int = 1):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=groups)
        self.fc = torch.nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def export_net(model, in_shape, path, exporter="torchscript"):
    """``model`` on ``[batch, *in_shape]`` written by torch's ``exporter`` (input ``x``, a dynamic batch)."""
    return export(model, (torch.randn(2, *in_shape),), path, exporter, dynamic={0: "batch"}, input_names=["x"],
                  output_names=["y"])


def build(folder, exporter, model, adapters, rows, in_shape, targets=("conv", "fc"), rank_patterns=None):
    """``(module with the named adapters, x, PEFT's mixed-batch rows, the base model's rows,
    folder, PEFT's model, the torch model)``: ``model`` exported by ``exporter`` and imported, each adapter
    ``{name: (r, alpha, rslora, lora_bias)}`` (``rank_patterns[name]``: its PEFT rank_pattern)
    saved by PEFT and loaded into both."""
    imported = import_onnx(export_net(model, in_shape, folder / "net.onnx", exporter))
    for k, (name, (r, alpha, rslora, lora_bias)) in enumerate(adapters.items()):
        peft_lora(model, list(targets), r, alpha, rslora=rslora, lora_bias=lora_bias, seed=40 + k, folder=folder / name,
                  rank_pattern=(rank_patterns or {}).get(name))
    reference = peft_with_adapters(model, {name: folder / name for name in adapters})
    module = imported
    for name in adapters:
        module = module.add_adapter(name, load_peft_adapter(imported, folder / name))
    x = torch.from_numpy(np.random.default_rng(7).normal(size=(len(rows), *in_shape)).astype(np.float32))
    with torch.no_grad():
        expected = reference(x, adapter_names=list(rows)).numpy()
        plain = model(x).numpy()
    return module, x.numpy(), expected, plain, folder, reference, model


def run_batched(path, x, rows, names):
    """Plain ONNX Runtime on the batched export ``path``, row ``n`` with adapter ``rows[n]``."""
    index = np.asarray([0 if n == "__base__" else list(names).index(n) + 1 for n in rows], dtype=np.int64)
    return session(path).run(None, {"x": x, "adapter_index": index})[0], index


@pytest.fixture(scope="module", params=["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def built(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"conv-{request.param}")
    model = randomize(ConvNet().eval(), seed=3)
    return build(folder, request.param, model, ADAPTERS, ROWS, (2, 6, 6))


def test_conv_and_lora_bias_rows_equal_pefts_mixed_batch_in_onnx_runtime(built, tmp_path):
    module, x, expected, plain, *_ = built
    adapted = {p for _, ads in [(n, module.lora_adapters.adapters(n)) for n in ADAPTERS] for p in ads}
    assert {"conv.weight", "conv.bias", "fc.weight", "fc.bias"} <= adapted
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora="batched")
    kinds = {t["path"]: t["kind"] for t in batched_metadata(path)["targets"]}
    assert kinds["conv.weight"] == "conv" and kinds["conv.bias"] == "bias" and kinds["fc.bias"] == "bias"
    got, index = run_batched(path, x, ROWS, ADAPTERS)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    base_rows = index == 0
    np.testing.assert_allclose(got[base_rows], plain[base_rows], atol=ATOL, rtol=0)
    assert np.abs(expected[~base_rows] - plain[~base_rows]).max(axis=1).min() > 0.1  # every adapter matters
    assert check_batched_adapters(path, module)  # the module's set fits its own export


def test_conv_and_lora_bias_rows_equal_pefts_mixed_batch_through_module_call(built):
    module, x, expected, *_ = built
    names = [None if n == "__base__" else n for n in ROWS]
    got = module(Tensor.from_numpy(x), adapter_index=names).to_numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_a_weight_delta_on_a_grouped_convolution_is_refused_by_name(tmp_path):
    """An adapter whose ``a`` covers the grouped weight's own ``in / groups`` channels (a weight
    delta, not PEFT's layout) has no per-row branch: refused, naming the weight, node and group."""
    from onnxparam import LoraAdapter, Param

    model = randomize(ConvNet(groups=2).eval(), seed=5)
    imported = import_onnx(export_net(model, (2, 6, 6), tmp_path / "grouped.onnx"))
    shape = tuple(imported.conv.weight.lazy_shape())  # (4, 1, 3, 3)
    a = Param.from_tensor(Tensor.from_numpy(np.ones((int(np.prod(shape[1:])), 2), np.float32)))
    b = Param.from_tensor(Tensor.from_numpy(np.ones((2, shape[0]), np.float32)))
    module = imported.add_adapter("g", {"conv.weight": LoraAdapter(a, b, 1.0, transposed=True)})
    with pytest.raises(LoraError, match=r"'conv.weight' \[4, 1, 3, 3\] is the weight of Conv node .* group=2, but "
                                        r"its adapters' a has 9 rows"):
        export_onnx(module, tmp_path / "g.onnx", np.ones((2, 2, 6, 6), np.float32), lora="batched")


# -- grouped convolutions (PEFT: lora_A a conv of every input channel, lora_B a grouped 1x1 conv) --


class GroupedNet(torch.nn.Module):
    """A grouped conv (4 -> 6 channels, groups=2) and a depthwise one (6 channels, groups=6,
    stride 2), then a Linear."""

    def __init__(self):
        super().__init__()
        self.grouped = torch.nn.Conv2d(4, 6, 3, padding=1, groups=2)
        self.depthwise = torch.nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6)
        self.fc = torch.nn.Linear(6 * 3 * 3, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.depthwise(torch.relu(self.grouped(x)))).flatten(1))


# PEFT needs each conv's rank divisible by its groups: rank_pattern gives the grouped conv its own
GROUPED = {"one": (6, 5, False, True), "two": (12, 2, True, False), "three": (6, 4, False, True)}
GROUPED_RANKS = {"one": {"grouped": 2}, "two": {"grouped": 4}, "three": {}}
GROUPED_ROWS = ["three", "__base__", "one", "two", "one", "__base__", "three", "two"]
GROUPED_TARGETS = ("grouped", "depthwise", "fc")


@pytest.fixture(scope="module", params=["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def grouped(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"grouped-{request.param}")
    model = randomize(GroupedNet().eval(), seed=11)
    return build(folder, request.param, model, GROUPED, GROUPED_ROWS, (4, 6, 6), GROUPED_TARGETS, GROUPED_RANKS)


def test_grouped_and_depthwise_rows_equal_pefts_mixed_batch_in_onnx_runtime(grouped, tmp_path):
    module, x, expected, plain, *_ = grouped
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora="batched")
    targets = {t["path"]: t for t in batched_metadata(path)["targets"]}
    assert targets["grouped.weight"]["kind"] == targets["depthwise.weight"]["kind"] == "conv"
    assert targets["depthwise.weight"]["d_in"] == 6 * 3 * 3  # every input channel: PEFT's lora_A
    got, index = run_batched(path, x, GROUPED_ROWS, GROUPED)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    base_rows = index == 0
    np.testing.assert_allclose(got[base_rows], plain[base_rows], atol=ATOL, rtol=0)
    assert np.abs(expected[~base_rows] - plain[~base_rows]).max(axis=1).min() > 0.1  # every adapter matters
    assert check_batched_adapters(path, module)


@pytest.mark.parametrize("capacity", [None, 5])
def test_a_negative_index_fails_in_ort_on_grouped_and_depthwise_convs(grouped, tmp_path, capacity):
    """fresh6 F1: plain ONNX Runtime refuses a negative entry (``-1``: the last adapter, or a
    spare slot with capacity 5) instead of reading it from the end; the valid rows of the same
    session stay PEFT's mixed batch."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

    module, x, expected, *_ = grouped
    lora = "batched" if capacity is None else BatchedLora(capacity=capacity)
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora=lora)
    sess = session(path)
    for bad in ([-1] * len(x), [-1]):
        with pytest.raises((Fail, InvalidArgument), match="Gather_negative_index_refused"):
            sess.run(None, {"x": x, "adapter_index": np.array(bad, dtype=np.int64)})
    got, _ = run_batched(path, x, GROUPED_ROWS, GROUPED)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_grouped_and_depthwise_rows_equal_pefts_mixed_batch_through_module_call(grouped):
    module, x, expected, *_ = grouped
    got = module(Tensor.from_numpy(x), adapter_index=[None if n == "__base__" else n for n in GROUPED_ROWS])
    np.testing.assert_allclose(got.to_numpy(), expected, atol=ATOL, rtol=0)


def test_a_grouped_conv_adapter_runs_as_a_branch_when_active_and_is_never_merged(grouped, tmp_path):
    """One active adapter (``module(x)`` in every ``lora_mode``: ``"merge"``, the default, runs
    it as ``"keep"``; a ``"keep"`` export) equals PEFT's forward with that adapter; a
    ``"merge"`` export is refused naming the weight: it is no weight delta, PEFT refuses too."""
    from onnxparam.runtime import SessionConfig, set_session_config

    module, x, _, _, _, reference, _ = grouped
    active = module.set_adapter("two")
    with torch.no_grad():
        expected = reference(torch.from_numpy(x), adapter_names=["two"] * len(x)).numpy()
    kept = export_onnx(active, tmp_path / "keep.onnx", x[:2], lora="keep")
    np.testing.assert_allclose(session(kept).run(None, {"x": x})[0], expected, atol=ATOL, rtol=0)
    for mode in ("keep", "inputs", "merge"):
        set_session_config(active, SessionConfig(lora_mode=mode))
        np.testing.assert_allclose(active(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL, rtol=0, err_msg=mode)
    set_session_config(active, SessionConfig())
    with pytest.raises(LoraError, match=r"weight 'grouped.weight'.*grouped convolution.*groups=2.*cannot be merged"):
        export_onnx(active, tmp_path / "merged.onnx", x[:2], lora="merge")
    with pytest.raises(LoraError, match=r"'grouped.weight': .*grouped convolution.*groups=2.*cannot be merged"):
        active.merge_lora()


def test_an_inputs_export_of_grouped_and_depthwise_adapters_runs_without_an_adapter_as_the_base(grouped, tmp_path):
    """``lora="inputs"`` (fresh7 F12): with no adapter fed the zero-rank defaults make the grouped
    and depthwise convs' LoRA branches empty (``[n, 0, h, w]``), and the file must still run and
    equal plain ONNX Runtime on torch's own export of the base net exactly; with the adapter's
    ``.onnx_adapter`` active it equals PEFT's forward."""
    module, x, _, _, folder, reference, _ = grouped
    active = module.set_adapter("one")
    path = export_onnx(active, tmp_path / "inputs.onnx", x[:2], lora="inputs")
    sess = session(path)
    base = session(folder / "net.onnx").run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], base)
    options = ort.RunOptions()
    adapter = ort.LoraAdapter()
    adapter.Load(str(write_onnx_adapter(active, tmp_path / "one.onnx_adapter")))
    options.add_active_adapter(adapter)
    with torch.no_grad():
        expected = reference(torch.from_numpy(x), adapter_names=["one"] * len(x)).numpy()
    np.testing.assert_allclose(sess.run(None, {"x": x}, options)[0], expected, atol=ATOL, rtol=0)


class GroupedConvs(torch.nn.Module):
    """:class:`GroupedNet`'s two convs alone: no Linear, so height and width can be dynamic."""

    def __init__(self):
        super().__init__()
        net = GroupedNet()
        self.grouped, self.depthwise = net.grouped, net.depthwise

    def forward(self, x):
        return self.depthwise(torch.relu(self.grouped(x)))


def test_an_inputs_export_with_dynamic_height_and_width_runs_without_an_adapter_as_the_base(tmp_path):
    """As above with the grouped / depthwise convs' height and width dynamic in torch's export
    (the branch cannot flatten by constant dims): no adapter fed equals ONNX Runtime on torch's
    file exactly, the adapter active equals PEFT, at a size other than the export's."""
    model = randomize(GroupedConvs().eval(), seed=11)
    net = export(model, (torch.randn(2, 4, 6, 6),), tmp_path / "net.onnx", "torchscript",
                 dynamic={0: "batch", 2: "h", 3: "w"}, input_names=["x"], output_names=["y"])
    peft_lora(model, ["grouped", "depthwise"], 6, 5, seed=3, folder=tmp_path / "one", rank_pattern={"grouped": 2})
    reference = peft_with_adapters(model, {"one": tmp_path / "one"})
    adapted = load_peft_adapter(import_onnx(net), tmp_path / "one")
    path = export_onnx(adapted, tmp_path / "inputs.onnx", np.zeros((2, 4, 6, 6), np.float32), lora="inputs")
    x = np.random.default_rng(0).normal(size=(3, 4, 9, 7)).astype(np.float32)
    sess = session(path)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], session(net).run(None, {"x": x})[0])
    options = ort.RunOptions()
    adapter = ort.LoraAdapter()
    adapter.Load(str(write_onnx_adapter(adapted, tmp_path / "one.onnx_adapter")))
    options.add_active_adapter(adapter)
    with torch.no_grad():
        expected = reference(torch.from_numpy(x), adapter_names=["one"] * len(x)).numpy()
    np.testing.assert_allclose(sess.run(None, {"x": x}, options)[0], expected, atol=ATOL, rtol=0)


# -- the stacked set written back as PEFT's multi-adapter folder ------------------------------------


def check_written_peft_folders(fixture, names, rows, tmp_path):
    """The batched export's default stacks written by ``write_batched_peft``: PEFT loads the
    folders (``lora_A`` a conv of every input channel, ``lora_B`` a 1x1 conv with the base's
    groups, ``lora_bias``) and its mixed batch equals PEFT's on the source adapters; the
    folders read back by ``load_peft_adapters`` give the same stacks."""
    module, x, expected, _, folder, _, model = fixture
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora="batched")
    out = write_batched_peft(None, tmp_path / "peft", model=path)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    written = peft_with_adapters(model, {name: out / name for name in names})
    with torch.no_grad():
        got = written(torch.from_numpy(x), adapter_names=list(rows)).numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    back = load_peft_adapters(import_onnx(folder / "net.onnx"), out)
    stacks, original = batched_adapter_params(back, model=path, names=names), batched_adapter_params(module, model=path)
    assert stacks.keys() == original.keys()
    for key in stacks:
        np.testing.assert_allclose(stacks[key], original[key], atol=1e-6, rtol=1e-6, err_msg=key)
    return out


def test_conv_and_lora_bias_stacks_written_as_peft_folders_give_each_rows_adapter_in_peft(built, tmp_path):
    out = check_written_peft_folders(built, list(ADAPTERS), ROWS, tmp_path)
    config = json.loads((out / "one" / "adapter_config.json").read_text())
    assert config["lora_bias"] and not json.loads((out / "two" / "adapter_config.json").read_text())["lora_bias"]


def test_grouped_and_depthwise_stacks_written_as_peft_folders_give_each_rows_adapter_in_peft(grouped, tmp_path):
    out = check_written_peft_folders(grouped, list(GROUPED), GROUPED_ROWS, tmp_path)
    config = json.loads((out / "one" / "adapter_config.json").read_text())
    assert config["r"] == 6 and config["rank_pattern"] == {"grouped": 2}  # PEFT's own ranks, alpha = r


def test_a_bias_only_spare_slot_is_written_with_zero_factors_and_a_grouped_b_off_its_blocks_is_refused(
        grouped, tmp_path):
    """A spare slot whose only adapter is a bias delta (arrays fed to the export): PEFT's
    lora_bias needs its module's factors, written as zeros; PEFT's rows for it equal plain ONNX
    Runtime's with the same stacks fed. A grouped conv's ``b`` with an entry outside its
    groups' blocks is not PEFT's layout: refused, naming the weight."""
    module, x, _, _, _, _, model = grouped
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora=BatchedLora(capacity=4))
    targets = {t["path"]: t for t in batched_metadata(path)["targets"]}
    params = batched_adapter_params(module, model=path)
    bias = targets["fc.bias"]
    params[bias["a"]][4, 0, 0] = 1.0
    params[bias["b"]][4, 0, :] = np.random.default_rng(3).normal(size=bias["d_out"])
    names = [*GROUPED, "extra"]
    out = write_batched_peft(params, tmp_path / "peft", model=path, names=names)
    tensors = load_file(str(out / "extra" / "adapter_model.safetensors"))
    assert sorted(tensors) == [f"base_model.model.fc.{k}" for k in ("lora_A.weight", "lora_B.bias", "lora_B.weight")]
    assert not tensors["base_model.model.fc.lora_A.weight"].any()
    written = peft_with_adapters(model, {name: out / name for name in names})
    rows = ["extra", "__base__", "two", "extra"]
    index = np.asarray([0 if r == "__base__" else names.index(r) + 1 for r in rows], dtype=np.int64)
    expected = session(path).run(None, {"x": x[:4], "adapter_index": index, **params})[0]
    with torch.no_grad():
        got = written(torch.from_numpy(x[:4]), adapter_names=rows).numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    depthwise = targets["depthwise.weight"]
    params[depthwise["b"]][2, 0, 5] = 0.5  # row 0 is group 0's, column 5 group 5's
    with pytest.raises(RecordError, match=r"slot 2 \('two'\): the stacks of 'depthwise.weight': b is not zero "
                                          r"outside each group's 2 rows at rank 12 \(a conv with groups=6\)"):
        write_batched_peft(params, tmp_path / "refused", model=path, names=names)


# -- onnxparam lora check on conv stacks ---------------------------------------------------------


def test_cli_lora_check_of_grouped_conv_stacks(grouped, tmp_path):
    """``onnxparam lora check`` on a batched export with grouped / depthwise conv and bias
    stacks: the module's own stacked file fits (every stack listed with ONNX Runtime's shapes);
    a per-group ``a`` (a weight delta's rows), a float64 stack, more slots than the capacity and
    a missing stack are each named."""
    from cli_run import run_cli

    module, x, *_ = grouped
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora=BatchedLora(capacity=4))
    file = write_batched_adapter(module, tmp_path / "set.onnx_adapter", model=path)
    code, out, err = run_cli("lora", "check", path, file, "--json")
    assert code == 0, err
    result = json.loads(out)["results"]["check"]
    truth = {k: list(v.numpy().shape) for k, v in ort.AdapterFormat.read_adapter(str(file)).get_parameters().items()}
    assert result["inputs"] == truth and result["slots"] == 5 and result["adapters"] == list(GROUPED)
    assert truth["depthwise.weight.lora.a_stack"] == [5, 6 * 3 * 3, 12]  # all 6 channels, rank 12 ("two")
    targets = {t["path"]: t for t in batched_metadata(path)["targets"]}
    params = batched_adapter_params(module, model=path)
    bad = dict(params)
    grouped_a = targets["grouped.weight"]["a"]
    bad[grouped_a] = params[grouped_a][:, : 2 * 3 * 3]  # a per-group a: 2 of the 4 input channels
    bad[targets["fc.weight"]["b"]] = params[targets["fc.weight"]["b"]].astype(np.float64)
    del bad[targets["depthwise.bias"]["b"]]
    code, _, err = run_cli("lora", "check", path, write_onnx_adapter(bad, tmp_path / "bad.onnx_adapter"))
    assert code == 1, err
    for words in (f"'{grouped_a}' has shape [5, 18, 6], the export needs (slots, 36, r) (a convolution "
                  "[6, 2, 3, 3] with groups=2: a's rows are all 4 input channels times the kernel's 9 taps",
                  f"'{targets['fc.weight']['b']}' is float64, the export's input is float32",
                  f"'{targets['depthwise.bias']['b']}' is missing"):
        assert words in err, err
    over = {k: np.concatenate([v, v[1:2]]) for k, v in params.items()}  # 6 slots, capacity 4
    code, _, err = run_cli("lora", "check", path, write_onnx_adapter(over, tmp_path / "over.onnx_adapter"))
    assert code == 1 and "the stacks hold 6 slots; the export's capacity is 4 adapters" in err, err


def test_grouped_conv_adapters_saved_by_save_peft_adapters_load_in_peft(grouped, tmp_path):
    """A module's named adapters on grouped / depthwise convs written by ``save_peft_adapters``
    (PEFT's own alphas and ranks): PEFT loads them and its mixed batch equals PEFT's on the
    source adapters."""
    from onnxparam import save_peft_adapters

    module, x, expected, _, _, _, model = grouped
    out = save_peft_adapters(module, tmp_path / "saved")
    written = peft_with_adapters(model, {name: out / name for name in GROUPED})
    with torch.no_grad():
        got = written(torch.from_numpy(x), adapter_names=list(GROUPED_ROWS)).numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["keep", "inputs"])
def test_a_grouped_conv_branch_imports_back_as_the_adapter(grouped, tmp_path, mode):
    """A ``"keep"`` export of a module with grouped / depthwise conv adapters imports back with
    the adapters on their weights (the branch removed from the graph): its ``module(x)`` and
    its re-export run in plain ONNX Runtime equal PEFT's forward with that adapter. An
    ``"inputs"`` export's zero-rank defaults import as the base model (the torch model's
    output), no branch left."""
    module, x, _, plain, _, reference, _ = grouped
    active = module.set_adapter("one")
    with torch.no_grad():
        expected = reference(torch.from_numpy(x), adapter_names=["one"] * len(x)).numpy()
    back = import_onnx(export_onnx(active, tmp_path / f"{mode}.onnx", x[:2], lora=mode))
    adapted = {path for path, p in back.named_params() if p.adapter() is not None}
    factors = {f"{w}.lora.{f}" for w in adapted for f in "ab"}
    assert {path for path, _ in back.named_params()} - factors == {
        "grouped.weight", "grouped.bias", "depthwise.weight", "depthwise.bias", "fc.weight", "fc.bias"}
    if mode == "inputs":
        assert not adapted
        np.testing.assert_allclose(back(Tensor.from_numpy(x)).to_numpy(), plain, atol=ATOL, rtol=0)
        return
    assert adapted == {"grouped.weight", "grouped.bias", "depthwise.weight", "depthwise.bias", "fc.weight", "fc.bias"}
    np.testing.assert_allclose(back(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL, rtol=0)
    again = export_onnx(back, tmp_path / "again.onnx", x[:2], lora="keep")
    np.testing.assert_allclose(session(again).run(None, {"x": x})[0], expected, atol=ATOL, rtol=0)


def test_grouped_conv_adapter_gradients_equal_torch_autograd_through_peft(tmp_path):
    """Training a grouped / depthwise conv's adapter here: the loss and the gradients of ``a``
    and ``b`` equal torch autograd through PEFT (``b``'s within each group's block; zero outside,
    so training keeps PEFT's grouped ``lora_B``), within 1e-4."""
    from onnxparam.autodiff import grad, mse

    model = randomize(GroupedNet().eval(), seed=11)
    reference = peft_lora(model, list(GROUPED_TARGETS), 6, 5, seed=3, folder=tmp_path / "a",
                          rank_pattern={"grouped": 2})
    ours = load_peft_adapter(import_onnx(export_net(model, (4, 6, 6), tmp_path / "net.onnx")), tmp_path / "a")
    rng = np.random.default_rng(2)
    x, t = rng.normal(size=(4, 4, 6, 6)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)
    loss, grads = grad(lambda m, x, t: mse(m(x), t), ours, x, t)
    got = grads.by_path()
    expected = torch.mean((reference(torch.from_numpy(x)) - torch.from_numpy(t)) ** 2)
    expected.backward()
    np.testing.assert_allclose(float(loss.to_numpy()), float(expected.detach()), rtol=1e-5)
    torch_grads = {n.replace("base_model.model.", ""): p.grad.numpy() for n, p in reference.named_parameters()
                   if p.grad is not None}
    for m, groups in (("grouped", 2), ("depthwise", 6)):
        A, B = torch_grads[f"{m}.lora_A.default.weight"], torch_grads[f"{m}.lora_B.default.weight"]
        rank, per_in, per_out = A.shape[0], B.shape[1], B.shape[0] // groups
        np.testing.assert_allclose(got[f"{m}.weight.lora.a"].to_numpy(), A.reshape(rank, -1).T, rtol=1e-4, atol=1e-6,
                                   err_msg=m)
        dense = np.zeros((rank, B.shape[0]), np.float32)  # PEFT's grouped lora_B as this library's b
        for g in range(groups):
            rows, cols = slice(g * per_in, (g + 1) * per_in), slice(g * per_out, (g + 1) * per_out)
            dense[rows, cols] = B[cols, :, 0, 0].T
        np.testing.assert_allclose(got[f"{m}.weight.lora.b"].to_numpy(), dense, rtol=1e-4, atol=1e-6, err_msg=m)


def test_grouped_conv_adapters_trained_here_save_as_peft_and_load_with_the_same_outputs(grouped, tmp_path):
    """Adam steps on the grouped / depthwise adapters here keep ``b`` inside its groups' blocks,
    so ``save_peft_adapter`` writes PEFT's grouped ``lora_B`` and PEFT's forward with the written
    adapter equals the trained module's."""
    import peft as peft_module

    from onnxparam import save_peft_adapter
    from onnxparam.autodiff import grad, mse
    from onnxparam.optim import Adam

    _, x, _, _, folder, _, model = grouped
    # load_peft_adapter freezes the adapted bases; "one" has lora_bias on every module: only factors train
    ours = load_peft_adapter(import_onnx(folder / "net.onnx"), folder / "one")
    t = np.random.default_rng(4).normal(size=(len(x), 5)).astype(np.float32)
    optim = Adam(lr=5e-2)
    before = ours(Tensor.from_numpy(x)).to_numpy()
    for _ in range(3):
        _, grads = grad(lambda m, x, t: mse(m(x), t), ours, x, t)
        assert all(".lora." in path for path in grads.by_path()), sorted(grads.by_path())
        ours = optim.step(ours, grads)
    trained = ours(Tensor.from_numpy(x)).to_numpy()
    assert np.abs(trained - before).max() > 1e-2  # it trained
    folder = save_peft_adapter(ours, tmp_path / "trained")
    loaded = peft_with_adapters(model, {"default": folder})
    with torch.no_grad():
        np.testing.assert_allclose(loaded(torch.from_numpy(x)).numpy(), trained, atol=2e-4)
    assert isinstance(loaded, peft_module.PeftModel)


def test_a_grouped_adapter_on_this_librarys_conv2d_equals_the_torch_formula(tmp_path):
    """This library's ``nn.Conv2d(groups=2)`` (a traced module, not an import) with a grouped
    adapter attached by hand (``a`` over all 4 input channels, ``b`` block-diagonal): ``module(x)``
    (``"merge"`` runs it as ``"keep"``), a ``"batched"`` export in plain ONNX Runtime and
    ``module(x, adapter_index=...)`` equal ``conv2d(x, W, groups=2) + scale * conv1x1(conv2d(x,
    A), B)`` in torch's functional ops; base rows equal the base conv."""
    import torch.nn.functional as F

    from onnxparam import LoraAdapter, Module, Param, nn

    class Net(Module):
        def __init__(self):
            self.conv = nn.Conv2d((4, 6), (3, 3), padding=(1, 1), groups=2)

        def forward(self, x):
            return self.conv(x)

    rng = np.random.default_rng(0)
    net, rank = Net(), 4
    a = rng.normal(size=(4 * 9, rank)).astype(np.float32)
    b = np.zeros((rank, 6), np.float32)
    b[:2, :3], b[2:, 3:] = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    factor = (lambda v: Param.from_tensor(Tensor.from_numpy(v)))
    module = net.add_adapter("g", {"conv.weight": LoraAdapter(factor(a), factor(b), 0.5, transposed=True)})
    x = rng.normal(size=(3, 4, 5, 5)).astype(np.float32)
    weight, bias = (torch.from_numpy(np.array(p.val().to_numpy())) for p in (net.conv.weight, net.conv.bias))
    base = F.conv2d(torch.from_numpy(x), weight, bias, padding=1, groups=2)
    h = F.conv2d(torch.from_numpy(x), torch.from_numpy(a.T.reshape(rank, 4, 3, 3)), padding=1)
    expected = (base + 0.5 * torch.einsum("nrhw,ro->nohw", h, torch.from_numpy(b))).numpy()
    tol = {"atol": 1e-5, "rtol": 1e-5}
    np.testing.assert_allclose(module.set_adapter("g")(Tensor.from_numpy(x)).to_numpy(), expected, **tol)
    path = export_onnx(module, tmp_path / "batched.onnx", x, lora="batched")
    feed = {session(path).get_inputs()[0].name: x, "adapter_index": np.array([1, 0, 1])}
    got = session(path).run(None, feed)[0]
    np.testing.assert_allclose(got[[0, 2]], expected[[0, 2]], **tol)
    np.testing.assert_allclose(got[1], base.numpy()[1], **tol)
    rows = module(Tensor.from_numpy(x), adapter_index=["g", None, "g"]).to_numpy()
    np.testing.assert_allclose(rows, got, **tol)
