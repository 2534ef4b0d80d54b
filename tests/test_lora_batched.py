"""``lora="batched"`` on a traced module: the graph, capacity, replacing the stacks in one
session, the stacked ``.onnx_adapter`` writer, the fit check (API and ``onnxparam lora check``),
and the refusals.

Oracle: the LoRA formula in numpy on the params' own values, row by row
(``relu(x @ W1 + c1 + s * (x @ A1) @ B1) @ W2 + c2 + s * ...``, ``s = alpha / r`` or
``alpha / sqrt(r)`` for rsLoRA), run through plain ONNX Runtime sessions on the written files.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import onnxruntime as ort
import pytest

from onnxparam import LoraConfig, LoraError, Module, Param, RecordError, Tensor, export_onnx
from onnxparam.lora._batched import BatchedLora, batched_metadata
from onnxparam.lora._batched_run import batched_adapter_params, check_batched_adapters, write_batched_adapter
from onnxparam.cli import main
from onnxparam.nn import Conv1dConfig, Conv2dConfig, EmbeddingConfig, LinearConfig

# name: (r, alpha, use_rslora)
ADAPTERS = {"one": (2, 5.0, False), "two": (4, 3.0, True), "three": (3, 1.5, False)}


class Net(Module):
    def __init__(self):
        self.fc1 = LinearConfig(6, 8).init()
        self.fc2 = LinearConfig(8, 4).init()

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


BASE = Net()


def adapted(r, alpha, rslora, seed):
    """``BASE`` with fresh adapters whose ``b`` is random (not zero)."""
    module = BASE.apply_lora(LoraConfig(rank=r, alpha=alpha, use_rslora=rslora, seed=seed))
    rng = np.random.default_rng(seed)
    return module.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(
        (rng.normal(size=p.lazy_shape()) * 0.5).astype(np.float32)), require_grad=True)
        if path.endswith("lora.b") else p)


SOURCES = {name: adapted(r, alpha, rs, seed=10 + k) for k, (name, (r, alpha, rs)) in enumerate(ADAPTERS.items())}


def with_adapters(names):
    module = BASE
    for name in names:
        module = module.add_adapter(name, SOURCES[name])
    return module


def oracle(x, name):
    """One adapter's (``None``: the base's) forward in numpy, from the param values."""
    def linear(h, layer, source_layer):
        w = np.asarray(layer.weight.val().to_numpy(), np.float64)
        out = h @ w + np.asarray(layer.bias.val().to_numpy(), np.float64)
        if source_layer is not None:
            adapter = source_layer.weight.adapter()
            r, alpha, rs = ADAPTERS[name]
            scale = alpha / (math.sqrt(r) if rs else r)
            a = np.asarray(adapter.a.val().to_numpy(), np.float64)
            b = np.asarray(adapter.b.val().to_numpy(), np.float64)
            out = out + scale * (h @ a) @ b
        return out

    source = SOURCES[name] if name is not None else None
    h = np.maximum(linear(x.astype(np.float64), BASE.fc1, source and source.fc1), 0)
    return linear(h, BASE.fc2, source and source.fc2)


def session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


X = np.random.default_rng(0).normal(size=(5, 3, 6)).astype(np.float32)


def test_rows_follow_their_adapter_and_index_zero_is_the_base(tmp_path):
    module = with_adapters(["one", "two", "three"])
    path = export_onnx(module, tmp_path / "b.onnx", X[:2], lora="batched",
                       dynamic_axes={"x": {0: "batch", 1: "seq"}, "output": {0: "batch", 1: "seq"}})
    sess = session(path)
    inputs = {i.name: i for i in sess.get_inputs()}
    assert inputs["adapter_index"].type == "tensor(int64)" and inputs["adapter_index"].shape == ["batch"]
    stacks = {i.name: i for i in sess.get_overridable_initializers()}
    assert stacks["fc1.weight.lora.a_stack"].shape == ["lora.slots", 6, "fc1.weight.lora.rank"]
    assert stacks["fc2.weight.lora.b_stack"].shape == ["lora.slots", "fc2.weight.lora.rank", 4]
    meta = batched_metadata(path)
    assert meta["adapters"] == ["one", "two", "three"] and meta["base_index"] == 0 and meta["slots"] == 4
    index = np.array([2, 0, 1, 3, 2], dtype=np.int64)
    for seq in (3, 1):  # a batch and a sequence other than the example's
        got = sess.run(None, {"x": X[:, :seq], "adapter_index": index})[0]
        for row, k in enumerate(index):
            name = None if k == 0 else list(ADAPTERS)[k - 1]
            np.testing.assert_allclose(got[row], oracle(X[row:row + 1, :seq], name)[0], atol=1e-5, rtol=0)
    # base rows are the base model's own export, bit for bit
    plain = session(export_onnx(BASE, tmp_path / "base.onnx", X[:2])).run(None, {"x": X})[0]
    got = sess.run(None, {"x": X, "adapter_index": np.zeros(5, np.int64)})[0]
    np.testing.assert_array_equal(got, plain)
    # the runtime runs the same thing
    names = [None, "one", "__base__", "three", "two"]
    got = module(Tensor.from_numpy(X), adapter_index=names).to_numpy()
    for row, name in enumerate(names):
        np.testing.assert_allclose(got[row], oracle(X[row:row + 1], None if name == "__base__" else name)[0],
                                   atol=1e-5, rtol=0)


def test_two_d_inputs_and_a_length_one_index(tmp_path):
    module = with_adapters(["one", "two"])
    x = X[:, 0]  # [batch, 6]: the reshape path ([rows, -1, d_in] view)
    path = export_onnx(module, tmp_path / "b.onnx", x[:2], lora="batched")
    got = session(path).run(None, {"x": x, "adapter_index": np.array([1, 2, 0, 0, 1])})[0]
    for row, name in enumerate(["one", "two", None, None, "one"]):
        np.testing.assert_allclose(got[row], oracle(x[row:row + 1], name)[0], atol=1e-5, rtol=0)
    got = module(Tensor.from_numpy(x), adapter_index=["two"]).to_numpy()  # one index: every row
    np.testing.assert_allclose(got, oracle(x, "two"), atol=1e-5, rtol=0)


def test_capacity_leaves_zero_slots_that_new_stacks_fill_in_the_same_session(tmp_path):
    module = with_adapters(["one"])
    path = export_onnx(module, tmp_path / "b.onnx", X[:2], lora=BatchedLora(capacity=3))
    meta = batched_metadata(path)
    assert meta["capacity"] == 3 and meta["slots"] == 4
    sess = session(path)
    index = np.array([1, 3, 0, 2, 1], dtype=np.int64)
    got = sess.run(None, {"x": X, "adapter_index": index})[0]  # empty slots add nothing
    for row, k in enumerate(index):
        np.testing.assert_allclose(got[row], oracle(X[row:row + 1], "one" if k == 1 else None)[0], atol=1e-5, rtol=0)
    # two adapters added later, fed into the same session by name (stacks of the export's ranks)
    grown = with_adapters(["one", "two", "three"])
    feeds = batched_adapter_params(grown, model=path)
    assert check_batched_adapters(path, feeds)["fc1.weight.lora.a_stack"] == (4, 6, 4)
    got = sess.run(None, {"x": X, "adapter_index": index, **feeds})[0]
    for row, k in enumerate(index):
        name = [None, "one", "two", "three"][k]
        np.testing.assert_allclose(got[row], oracle(X[row:row + 1], name)[0], atol=1e-5, rtol=0)
    # the same stacks as one .onnx_adapter file, activated per run
    file = write_batched_adapter(grown, tmp_path / "grown.onnx_adapter", model=path)
    assert set(check_batched_adapters(path, file)) == set(feeds)
    assert check_batched_adapters(path, grown) == check_batched_adapters(path, feeds)
    options, adapter = ort.RunOptions(), ort.LoraAdapter()
    adapter.Load(str(file))
    options.add_active_adapter(adapter)
    np.testing.assert_array_equal(sess.run(None, {"x": X, "adapter_index": index}, options)[0], got)
    # or bound through IO binding (where ONNX Runtime ignores active adapters)
    binding = sess.io_binding()
    values = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))
              for name, value in {"x": X, "adapter_index": index, **feeds}.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("output")
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], got)


def test_check_lists_every_misfit(tmp_path):
    module = with_adapters(["one", "two"])
    path = export_onnx(module, tmp_path / "b.onnx", X[:2], lora=BatchedLora(capacity=2))
    good = batched_adapter_params(module, model=path)
    bad = dict(good)
    bad["fc1.weight.lora.a_stack"] = good["fc1.weight.lora.a_stack"].astype(np.float64)
    bad["fc2.weight.lora.b_stack"] = np.ones((3, 4, 5), np.float32)  # d_out 4 expected
    bad["nope.lora.a_stack"] = good["fc1.weight.lora.a_stack"]
    del bad["fc2.weight.lora.a_stack"]
    with pytest.raises(RecordError) as info:
        check_batched_adapters(path, bad)
    text = "\n".join(info.value.problems)
    assert "'fc1.weight.lora.a_stack' is float64, the export's input is float32" in text
    assert "'fc2.weight.lora.b_stack' has shape [3, 4, 5], the export needs (slots, r, 4)" in text
    assert "'nope.lora.a_stack' is not a stack input" in text
    assert "'fc2.weight.lora.a_stack' is missing" in text
    over = {k: np.concatenate([v, v[:2]]) for k, v in good.items()}  # 5 slots: capacity 2 + base = 3
    with pytest.raises(RecordError, match="at most 3"):
        check_batched_adapters(path, over)
    dirty = {k: v.copy() for k, v in good.items()}
    dirty["fc1.weight.lora.b_stack"][0] += 1
    with pytest.raises(RecordError, match="slot 0 .* is not all zeros"):
        check_batched_adapters(path, dirty)
    # a module: the export's names first, in index order, within the capacity
    with pytest.raises(RecordError, match=r"adapters are \['one', 'two'\].*in another order"):
        check_batched_adapters(path, with_adapters(["two", "one"]))
    with pytest.raises(RecordError, match="do not fit the export's capacity 2"):
        check_batched_adapters(path, with_adapters(["one", "two", "three"]))
    with pytest.raises(LoraError, match="not a batched LoRA export"):
        check_batched_adapters(export_onnx(module, tmp_path / "m.onnx", X[:2]), good)


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def test_cli_lora_check(tmp_path):
    module = with_adapters(["one", "two"])
    path = export_onnx(module, tmp_path / "b.onnx", X[:2], lora=BatchedLora(capacity=3))
    file = write_batched_adapter(module, tmp_path / "s.onnx_adapter", model=path)
    code, out, err = run_cli("lora", "check", path, file, "--json")
    assert code == 0, err
    result = json.loads(out)["results"]["check"]
    assert result["kind"] == "batched" and result["adapters"] == ["one", "two"] and result["slots"] == 4
    # fewer slots (capacity 1) fit: the slot and rank dims are symbolic
    small = write_batched_adapter(with_adapters(["one"]), tmp_path / "small.onnx_adapter")
    assert run_cli("lora", "check", path, small)[0] == 0
    # stacks of a wider model do not
    from onnxparam import write_onnx_adapter

    params = batched_adapter_params(module, model=path)
    params["fc1.weight.lora.a_stack"] = np.zeros((4, 7, 4), np.float32)
    wide = write_onnx_adapter(params, tmp_path / "wide.onnx_adapter")
    code, out, err = run_cli("lora", "check", path, wide)
    assert code != 0 and "'fc1.weight.lora.a_stack' has shape [4, 7, 4], the export needs (slots, 6, r)" in err, err
    code, out, err = run_cli("lora", "check", path, file, "--alpha", "2")
    assert code != 0 and "--alpha does not apply" in err
    # one adapter's file (an 'inputs' export's) says a batched export takes write_batched_adapter's stacks
    single = write_onnx_adapter(SOURCES["one"], tmp_path / "single.onnx_adapter")
    code, out, err = run_cli("lora", "check", path, single)
    assert code != 0 and "holds one adapter's factors" in err and "write_batched_adapter(module, path" in err, err
    assert err.count("\n") <= 2, err  # one message, not every tensor listed


def test_index_entries_are_checked():
    module = with_adapters(["one", "two"])
    with pytest.raises(LoraError, match="no adapter named 'nope'"):
        module(Tensor.from_numpy(X), adapter_index=["nope"] * 5)
    with pytest.raises(LoraError, match=r"adapter_index 3 is outside \[0, 3\)"):
        module(Tensor.from_numpy(X), adapter_index=[3, 0, 0, 0, 0])
    with pytest.raises(LoraError, match="has no LoRA adapters to stack"):
        BASE(Tensor.from_numpy(X), adapter_index=[0] * 5)


class TakesIndex(Net):
    def forward(self, x, adapter_index=None):
        return self.fc1(x) * 0 if adapter_index is not None else self.fc1(x)


def test_a_forward_with_its_own_adapter_index_keyword_gets_it():
    module = TakesIndex().add_adapter("one", TakesIndex().apply_lora(LoraConfig(rank=2, alpha=1.0, seed=0)))
    x = Tensor.from_numpy(X)
    np.testing.assert_array_equal(module(x, adapter_index=1).to_numpy(), np.zeros((5, 3, 8), np.float32))


class Embed(Module):
    def __init__(self):
        self.embed = EmbeddingConfig(10, 6).init()
        self.fc = LinearConfig(6, 4).init()

    def forward(self, ids):
        return self.fc(self.embed(ids))


class ConvNet(Module):
    def __init__(self):
        self.conv = Conv2dConfig((2, 3), (1, 1)).init()

    def forward(self, x):
        return self.conv(x)


def test_embedding_tables_take_each_rows_adapter_at_its_ids(tmp_path):
    base = Embed()
    sources = {}
    for k, (name, (r, alpha, rs)) in enumerate(ADAPTERS.items()):
        rng = np.random.default_rng(50 + k)
        sources[name] = base.apply_lora(LoraConfig(rank=r, alpha=alpha, use_rslora=rs, seed=k)).map(
            lambda path, p: Param(p.id, value=Tensor.from_numpy((rng.normal(size=p.lazy_shape()) * 0.5).astype(
                np.float32))) if path.endswith("lora.b") else p)
    module = base
    for name, source in sources.items():
        module = module.add_adapter(name, source)

    def oracle_rows(ids, name):
        def adapt(h, x, param, source_param, lookup):
            if name is None:
                return h
            adapter = source_param.adapter()
            r, alpha, rs = ADAPTERS[name]
            scale = alpha / (math.sqrt(r) if rs else r)
            a = np.asarray(adapter.a.val().to_numpy(), np.float64)
            b = np.asarray(adapter.b.val().to_numpy(), np.float64)
            return h + scale * ((a[x] if lookup else x @ a) @ b)

        table = np.asarray(base.embed.weight.val().to_numpy(), np.float64)
        h = adapt(table[ids], ids, base.embed.weight, name and sources[name].embed.weight, True)
        w = np.asarray(base.fc.weight.val().to_numpy(), np.float64)
        out = h @ w + np.asarray(base.fc.bias.val().to_numpy(), np.float64)
        return adapt(out, h, base.fc.weight, name and sources[name].fc.weight, False)

    ids = np.random.default_rng(1).integers(0, 10, size=(5, 4))
    path = export_onnx(module, tmp_path / "e.onnx", ids[:2], lora="batched",
                       dynamic_axes={"ids": {0: "batch", 1: "seq"}, "output": {0: "batch", 1: "seq"}})
    index = np.array([3, 0, 1, 2, 1], dtype=np.int64)
    for seq in (4, 1):
        got = session(path).run(None, {"ids": ids[:, :seq], "adapter_index": index})[0]
        for row, k in enumerate(index):
            name = [None, *ADAPTERS][k]
            np.testing.assert_allclose(got[row], oracle_rows(ids[row:row + 1, :seq], name)[0], atol=1e-5, rtol=0)
    got = module(Tensor.from_numpy(ids), adapter_index=[None, "three", "two", None, "one"]).to_numpy()
    for row, name in enumerate([None, "three", "two", None, "one"]):
        np.testing.assert_allclose(got[row], oracle_rows(ids[row:row + 1], name)[0], atol=1e-5, rtol=0)


class DilatedConv(Module):
    def __init__(self):
        self.conv = Conv2dConfig((2, 3), (3, 2), dilation=(2, 1)).init()

    def forward(self, x):
        return self.conv(x)


def _factor(rng, *shape):
    from onnxparam import Param

    return Param.from_tensor(Tensor.from_numpy((rng.normal(size=shape) * 0.5).astype(np.float32)))


def test_conv_weights_and_biases_take_each_rows_adapter(tmp_path):
    """PEFT's conv LoRA (a transposed adapter ``a`` ``(in * kh * kw, r)``, ``b`` ``(r, out)``,
    delta ``(a @ b).T`` reshaped to the weight) and ``lora_bias`` (a 1-d bias with ``a``
    ``(1, 1)``): numpy convolution (dilation 2 x 1) and biases, row by row."""
    from onnxparam import LoraAdapter

    rng = np.random.default_rng(3)
    base = DilatedConv()
    w = np.asarray(base.conv.weight.val().to_numpy(), np.float64)  # (3, 2, 3, 2)
    c = np.asarray(base.conv.bias.val().to_numpy(), np.float64)
    specs = {"p": {"conv.weight": (2, 1.5), "conv.bias": (1, 0.5)}, "q": {"conv.weight": (3, 0.75)},
             "r": {"conv.bias": (1, 2.0)}}
    module, deltas = base, {}
    for name, spec in specs.items():
        adapters, deltas[name] = {}, {"conv.weight": 0.0, "conv.bias": 0.0}
        for path, (r, scale) in spec.items():
            d_in, d_out = (12, 3) if path == "conv.weight" else (1, 3)
            a, b = _factor(rng, d_in, r), _factor(rng, r, d_out)
            adapters[path] = LoraAdapter(a, b, scale, transposed=path == "conv.weight")
            delta = scale * np.asarray(a.val().to_numpy(), np.float64) @ np.asarray(b.val().to_numpy(), np.float64)
            deltas[name][path] = delta.T.reshape(w.shape) if path == "conv.weight" else delta.reshape(-1)
        module = module.add_adapter(name, adapters)

    def oracle(x, name):
        d = deltas.get(name, {"conv.weight": 0.0, "conv.bias": 0.0})
        weight, bias = w + d["conv.weight"], c + d["conv.bias"]
        windows = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), (5, 2), axis=(2, 3))[..., ::2, :]
        return np.einsum("nchwuv,ocuv->nohw", windows, weight) + bias[None, :, None, None]

    x = rng.normal(size=(6, 2, 8, 5)).astype(np.float32)
    path = export_onnx(module, tmp_path / "conv.onnx", x[:2], lora="batched")
    meta = batched_metadata(path)
    assert {t["path"]: (t["kind"], t["d_in"], t["rank"]) for t in meta["targets"]} == {
        "conv.weight": ("conv", 12, 3), "conv.bias": ("bias", 1, 1)}
    index = np.array([1, 0, 3, 2, 1, 3], dtype=np.int64)
    got = session(path).run(None, {"x": x, "adapter_index": index})[0]
    names = [None, "p", "q", "r"]
    for row, k in enumerate(index):
        np.testing.assert_allclose(got[row], oracle(x[row:row + 1], names[k])[0], atol=1e-5, rtol=0)
    got = module(Tensor.from_numpy(x), adapter_index=[names[k] for k in index[::-1]]).to_numpy()
    for row, k in enumerate(index[::-1]):
        np.testing.assert_allclose(got[row], oracle(x[row:row + 1], names[k])[0], atol=1e-5, rtol=0)
    got = session(path).run(None, {"x": x, "adapter_index": np.array([2])})[0]  # one index: every row
    np.testing.assert_allclose(got, oracle(x, "q"), atol=1e-5, rtol=0)


class StridedConv1d(Module):
    def __init__(self):
        self.conv = Conv1dConfig(2, 3, 3, stride=2, padding=1).init()

    def forward(self, x):
        return self.conv(x)


def test_a_strided_padded_conv1d_takes_each_rows_adapter(tmp_path):
    """The ``Conv``'s own strides and pads carry over to the adapter's conv: numpy ``conv1d``."""
    from onnxparam import LoraAdapter

    rng = np.random.default_rng(5)
    base = StridedConv1d()
    w = np.asarray(base.conv.weight.val().to_numpy(), np.float64)  # (3, 2, 3)
    c = np.asarray(base.conv.bias.val().to_numpy(), np.float64)
    module, deltas = base, [0.0]
    for k, (r, scale) in enumerate(((1, 2.0), (3, 0.5))):
        a, b = _factor(rng, 6, r), _factor(rng, r, 3)
        module = module.add_adapter(f"k{k}", {"conv.weight": LoraAdapter(a, b, scale, transposed=True)})
        deltas.append(scale * (np.asarray(a.val().to_numpy(), np.float64)
                               @ np.asarray(b.val().to_numpy(), np.float64)).T.reshape(w.shape))

    def oracle(x, k):
        padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1)))
        windows = np.lib.stride_tricks.sliding_window_view(padded, 3, axis=2)[:, :, ::2]  # [n, c, l, 3]
        return np.einsum("nclu,ocu->nol", windows, w + deltas[k]) + c[None, :, None]

    x = rng.normal(size=(4, 2, 9)).astype(np.float32)
    path = export_onnx(module, tmp_path / "c1.onnx", x[:1], lora="batched")
    index = np.array([2, 1, 0, 2], dtype=np.int64)
    got = session(path).run(None, {"x": x, "adapter_index": index})[0]
    for row, k in enumerate(index):
        np.testing.assert_allclose(got[row], oracle(x[row:row + 1], k)[0], atol=1e-5, rtol=0)


def test_a_linear_bias_adapter_adds_per_row_after_the_add(tmp_path):
    from onnxparam import LoraAdapter

    rng = np.random.default_rng(4)
    module, deltas = BASE, {}
    for name, scale in (("u", 0.5), ("v", 3.0)):
        a, b = _factor(rng, 1, 1), _factor(rng, 1, 8)
        module = module.add_adapter(name, {"fc1.bias": LoraAdapter(a, b, scale)})
        deltas[name] = scale * np.asarray(a.val().to_numpy(), np.float64) @ np.asarray(b.val().to_numpy(), np.float64)

    def oracle(x, name):
        w1, c1 = (np.asarray(p.val().to_numpy(), np.float64) for p in (BASE.fc1.weight, BASE.fc1.bias))
        w2, c2 = (np.asarray(p.val().to_numpy(), np.float64) for p in (BASE.fc2.weight, BASE.fc2.bias))
        h = x.astype(np.float64) @ w1 + c1 + (deltas[name][0] if name else 0.0)
        return np.maximum(h, 0) @ w2 + c2

    for x in (X, X[:, 0]):  # [batch, seq, d] and [batch, d] (the [rows, -1, d] view)
        path = export_onnx(module, tmp_path / f"bias{x.ndim}.onnx", x[:2], lora="batched")
        index = np.array([2, 0, 1, 1, 2], dtype=np.int64)
        got = session(path).run(None, {"x": x, "adapter_index": index})[0]
        for row, k in enumerate(index):
            np.testing.assert_allclose(got[row], oracle(x[row:row + 1], [None, "u", "v"][k])[0], atol=1e-5, rtol=0)


def test_an_adapter_that_fits_no_batched_use_is_refused_by_name(tmp_path):
    from onnxparam import LoraAdapter

    conv = ConvNet()
    a = Param.from_tensor(Tensor.from_numpy(np.ones((2, 1), np.float32)))
    b = Param.from_tensor(Tensor.from_numpy(np.ones((1, 3), np.float32)))
    conv = conv.add_adapter("c", {"conv.weight": LoraAdapter(a, b, 1.0, transposed=False)})  # not PEFT's layout
    with pytest.raises(LoraError, match=r"'conv.weight' \[3, 2, 1, 1\] with factors \(2, 1\).*transposed=False"):
        export_onnx(conv, tmp_path / "c.onnx", np.ones((1, 2, 4, 4), np.float32), lora="batched")


def test_the_readme_serving_example_runs(tmp_path, monkeypatch):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    script = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if 'lora=op.BatchedLora' in block)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    exec(compile(script, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    x, y, y3 = namespace["x"], namespace["y"], namespace["y3"]
    sources = {"sql": namespace["fresh"](1, 4), "chat": namespace["fresh"](2, 8), "code": namespace["fresh"](3, 2)}
    for row, name in enumerate(["sql", None, "chat", "sql"]):
        expected = (sources[name] if name else namespace["base"])(Tensor.from_numpy(x[row:row + 1])).to_numpy()
        np.testing.assert_allclose(y[row:row + 1], expected, atol=1e-5, rtol=0)
    for row, name in enumerate(["code", "code", None, "sql"]):
        expected = (sources[name] if name else namespace["base"])(Tensor.from_numpy(x[row:row + 1])).to_numpy()
        np.testing.assert_allclose(y3[row:row + 1], expected, atol=1e-5, rtol=0)


def test_an_index_outside_the_slots_fails_in_ort_for_a_conv_only_export(tmp_path):
    """A conv target's mask gathers the index like every other target: ONNX Runtime refuses an
    entry past the slots instead of giving that row no adapter, and a negative one where the
    index enters (``Gather`` alone would read ``-1`` as the last slot)."""
    from onnxparam import LoraAdapter
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

    rng = np.random.default_rng(5)
    module = DilatedConv()
    for name in ("p", "q"):
        module = module.add_adapter(name, {"conv.weight": LoraAdapter(_factor(rng, 12, 2), _factor(rng, 2, 3), 1.0,
                                                                      transposed=True)})
    x = rng.normal(size=(2, 2, 8, 5)).astype(np.float32)
    path = export_onnx(module, tmp_path / "conv.onnx", x, lora="batched")
    sess = session(path)
    with pytest.raises((Fail, InvalidArgument), match="Gather_index.*out of data bounds"):
        sess.run(None, {"x": x, "adapter_index": np.array([3, 0], dtype=np.int64)})
    last = sess.run(None, {"x": x, "adapter_index": np.array([2, 2], dtype=np.int64)})[0]
    base = sess.run(None, {"x": x, "adapter_index": np.array([0, 0], dtype=np.int64)})[0]
    assert np.abs(last - base).max() > 1e-3
    with pytest.raises((Fail, InvalidArgument), match="Gather_negative_index_refused"):
        sess.run(None, {"x": x, "adapter_index": np.array([-1, -1], dtype=np.int64)})


def _negative_index_cases():
    """``(name, module, x, rows oracle or None)`` for each target kind: Linear (MatMul), an
    embedding table (Gather) with a Linear, a dilated Conv (weight and bias)."""
    from onnxparam import LoraAdapter

    cases = [("linear", with_adapters(["one", "two"]), X[:4],
              lambda x, k: oracle(x, [None, "one", "two"][k]) if k < 3 else oracle(x, None))]
    rng = np.random.default_rng(9)
    emb = Embed()
    for name in ("p", "q"):
        emb = emb.add_adapter(name, {"embed.weight": LoraAdapter(_factor(rng, 10, 2), _factor(rng, 2, 6), 1.0),
                                     "fc.weight": LoraAdapter(_factor(rng, 6, 3), _factor(rng, 3, 4), 0.5)})
    cases.append(("embedding", emb, rng.integers(0, 10, size=(4, 3)), None))
    conv = DilatedConv()
    for name in ("p", "q"):
        conv = conv.add_adapter(name, {"conv.weight": LoraAdapter(_factor(rng, 12, 2), _factor(rng, 2, 3), 1.0,
                                                                  transposed=True),
                                       "conv.bias": LoraAdapter(_factor(rng, 1, 1), _factor(rng, 1, 3), 1.0)})
    cases.append(("conv", conv, rng.normal(size=(4, 2, 8, 5)).astype(np.float32), None))
    return cases


@pytest.mark.parametrize("capacity", [None, 4])
@pytest.mark.parametrize("case", range(3), ids=["linear", "embedding", "conv"])
def test_a_negative_index_fails_in_ort_for_every_target_kind(tmp_path, case, capacity):
    """fresh6 F1: a negative entry (``-1``, a common "no adapter" sentinel) is refused by plain
    ONNX Runtime on the export, as by ``module(x, adapter_index=...)``, whether slot ``-1`` is
    the last adapter (capacity == adapters) or a spare empty slot (capacity 4 > 2 adapters),
    instead of ``Gather`` reading it counting from the end. Valid indices still give each row
    its adapter: the numpy formula (Linear), the runtime (every kind), and one slot's run of
    the whole batch, row by row."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

    name, module, x, rows_oracle = _negative_index_cases()[case]
    lora = "batched" if capacity is None else BatchedLora(capacity=capacity)
    path = export_onnx(module, tmp_path / f"{name}.onnx", x[:2], lora=lora)
    sess = session(path)
    feed = next(i.name for i in sess.get_inputs() if i.name != "adapter_index")
    slots = batched_metadata(path)["slots"]
    assert slots == (3 if capacity is None else capacity + 1)
    for bad in ([-1, -1, -1, -1], [0, 1, -1, 2], [-1], [-slots] * 4, [np.iinfo(np.int64).min] * 4):
        with pytest.raises((Fail, InvalidArgument), match="Gather_negative_index_refused"):
            sess.run(None, {feed: x, "adapter_index": np.array(bad, dtype=np.int64)})
        with pytest.raises(LoraError, match="outside"):
            module(Tensor.from_numpy(x), adapter_index=[int(b) for b in bad])
    index = np.array([2, 0, 1, slots - 1], dtype=np.int64)
    got = sess.run(None, {feed: x, "adapter_index": index})[0]
    runtime = module(Tensor.from_numpy(x), adapter_index=[min(int(k), 2) for k in index]).to_numpy()
    for row, k in enumerate(index):
        alone = sess.run(None, {feed: x, "adapter_index": np.array([k], dtype=np.int64)})[0]
        np.testing.assert_allclose(got[row], alone[row], atol=1e-5, rtol=0)
        if k < 3:  # a spare slot is the base model: the runtime has no index past its adapters
            np.testing.assert_allclose(got[row], runtime[row], atol=1e-5, rtol=0)
        if rows_oracle is not None:
            np.testing.assert_allclose(got[row], rows_oracle(x[row:row + 1], int(k))[0], atol=1e-5, rtol=0)
    if slots > 3:  # the spare slot's row is the base row
        np.testing.assert_allclose(got[3], sess.run(None, {feed: x, "adapter_index": np.zeros(4, np.int64)})[0][3],
                                   atol=0, rtol=0)


@pytest.mark.parametrize("two_d", [False, True])
def test_an_index_neither_one_entry_nor_one_per_row_is_refused(tmp_path, two_d):
    """The documented rule: ``adapter_index`` has 1 entry (every row) or one per row (dim 0 of
    the input); any other length is an error in the runtime (``LoraError`` naming both lengths)
    and in the exported graph under plain ONNX Runtime, never rows read as a ``[batch * seq]``
    layout. Oracle: the numpy LoRA formula per row for the lengths that are allowed."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

    module = with_adapters(["one", "two"])
    x = X[:4, 0] if two_d else X[:4]
    sess = session(export_onnx(module, tmp_path / "b.onnx", x[:2], lora="batched"))
    for batch, index in ((4, [1, 2]), (4, [1, 2, 0]), (4, [1, 2, 0, 1, 2]), (1, [1, 2])):
        with pytest.raises(LoraError, match=f"adapter_index has {len(index)} entries, the batch has {batch} rows"):
            module(Tensor.from_numpy(x[:batch]), adapter_index=index)
        with pytest.raises((Fail, InvalidArgument), match="lora.batched/(Expand|Reshape)_index"):
            sess.run(None, {"x": x[:batch], "adapter_index": np.array(index, dtype=np.int64)})
    for batch, index in ((4, [2]), (4, [2, 0, 1, 1]), (1, [1])):
        names = [None if k == 0 else list(ADAPTERS)[k - 1] for k in index] * (batch // len(index))
        got = sess.run(None, {"x": x[:batch], "adapter_index": np.array(index, dtype=np.int64)})[0]
        runtime = module(Tensor.from_numpy(x[:batch]), adapter_index=index).to_numpy()
        for row, name in enumerate(names):
            expected = oracle(x[row:row + 1], name)[0]
            np.testing.assert_allclose(got[row], expected, atol=1e-5, rtol=0)
            np.testing.assert_allclose(runtime[row], expected, atol=1e-5, rtol=0)
