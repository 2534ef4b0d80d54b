"""Records of a module with named adapters (fresh8 F3): ``save_file`` / ``into_record`` hold every
named adapter by name (``<W>.lora.<name>.a`` / ``.b`` + metadata), ``load_file`` puts each back
into the adapter of its name, an old file's unnamed factors go where their ids say or are
refused, and a module without named adapters writes Burn's record as before.

Oracle: numpy, ``x @ (W + scale * A @ B) + bias (+ scale_bias * (a_b @ b_b))`` per row with the
factor values read from the saved module's params (never the library's forward).
"""

import json
import re

import numpy as np
import pytest

import onnxparam as op
from onnxparam import Param, Tensor, nn
from onnxparam.burnpack._module_file import save_module_file
from onnxparam.lora import LoraAdapter
from onnxparam.lora._records import LORA_METADATA_KEY


class Mlp(op.Module):
    def __init__(self):
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def _values(rng, shape, std=1.0):
    return Tensor.from_numpy((std * rng.normal(size=shape)).astype(np.float32))


def _with_b(module, seed):
    """``module`` with every LoRA ``b`` random (zero-init B would make every adapter a no-op)."""
    rng = np.random.default_rng(seed)
    return module.map(lambda path, p: Param(p.id, value=_values(rng, p.lazy_shape(), 0.3), require_grad=True)
                      if path.endswith("lora.b") else p)


def _bias_adapter(seed, d, scale):
    """PEFT's ``lora_bias`` on a Linear bias: ``a`` ``(1, 1)``, ``b`` ``(1, d)``."""
    rng = np.random.default_rng(seed)
    return LoraAdapter(Param.initialized(op.ParamId(), _values(rng, (1, 1))),
                       Param.initialized(op.ParamId(), _values(rng, (1, d))), scale)


def _adapters(module):
    from onnxparam.lora._adapters import _current_adapters

    return _current_adapters(module)


def make(base):
    sql = _adapters(_with_b(base.apply_lora(op.LoraConfig(rank=2, alpha=4, seed=1)), 11))
    sql["fc1.bias"] = _bias_adapter(12, 8, 0.5)
    chat = _adapters(_with_b(base.apply_lora(op.LoraConfig(rank=4, alpha=3, seed=2, use_rslora=True)), 21))
    tool = _adapters(_with_b(base.apply_lora(op.LoraConfig(rank=3, alpha=6, seed=3,
                                                           param_group=op.ParamGroup.from_path("fc1.weight"))), 31))
    return base.add_adapter("sql", sql).add_adapter("chat", chat).add_adapter("tool", tool)


def oracle(module, x, name):
    """numpy: the MLP with adapter ``name`` (None: the base) merged, from the params' values."""
    params = {path: p for path, p in module.named_params()}
    adapters = {} if name is None else module.lora_adapters.adapters(name)

    def weight(path):
        w = params[path].base().to_numpy().astype(np.float64)
        ad = adapters.get(path)
        if ad is not None:
            delta = ad.scale * (ad.a.val().to_numpy().astype(np.float64) @ ad.b.val().to_numpy().astype(np.float64))
            w = w + (delta.T if ad.transposed else delta).reshape(w.shape)
        return w

    h = np.maximum(x @ weight("fc1.weight") + weight("fc1.bias"), 0)
    return h @ weight("fc2.weight") + weight("fc2.bias")


def _train_one_step(module, name, x, t):
    from onnxparam.autodiff import grad
    from onnxparam.optim import SGD

    module = module.set_adapter(name)
    _, grads = grad(lambda m, x, t: ((m(x) - t) ** 2).mean(), module, x, t)
    return SGD(lr=0.1).step(module, grads)


@pytest.fixture(scope="module")
def base():
    nn.seed(5)
    return Mlp()


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(6, 6)).astype(np.float32), rng.normal(size=(6, 3)).astype(np.float32)


def test_every_adapter_saved_and_loaded_by_name(tmp_path, base, data):
    x, t = data
    trained = make(base)
    before = {n: {p: a.b.val().to_numpy() for p, a in trained.lora_adapters.adapters(n).items()} for n in ("sql", "tool")}
    trained = _train_one_step(trained, "sql", Tensor.from_numpy(x), Tensor.from_numpy(t))
    trained = _train_one_step(trained, "tool", Tensor.from_numpy(x), Tensor.from_numpy(t))
    for n in ("sql", "tool"):  # both trained adapters moved (sql while inactive now)
        assert any(not np.array_equal(before[n][p], a.b.val().to_numpy())
                   for p, a in trained.lora_adapters.adapters(n).items()), n
    path = trained.save_file(tmp_path / "trained")
    record = op.ModuleRecord.load_file(path)
    described = json.loads(record.metadata[LORA_METADATA_KEY])
    assert described["active"] == "tool" and list(described["adapters"]) == ["sql", "chat", "tool"]
    assert described["adapters"]["chat"]["fc1.weight"]["rank"] == 4
    assert described["adapters"]["chat"]["fc1.weight"]["scale"] == pytest.approx(3 / 2)
    assert described["adapters"]["sql"]["fc1.bias"]["scale"] == 0.5
    assert list(record) == [
        "fc1.weight", "fc1.weight.lora.sql.a", "fc1.weight.lora.sql.b", "fc1.weight.lora.chat.a",
        "fc1.weight.lora.chat.b", "fc1.weight.lora.tool.a", "fc1.weight.lora.tool.b",
        "fc1.bias", "fc1.bias.lora.sql.a", "fc1.bias.lora.sql.b",
        "fc2.weight", "fc2.weight.lora.sql.a", "fc2.weight.lora.sql.b", "fc2.weight.lora.chat.a",
        "fc2.weight.lora.chat.b", "fc2.bias"]
    saved_ids = {n: {p: (a.a.id, a.b.id) for p, a in trained.lora_adapters.adapters(n).items()}
                 for n in trained.lora_adapters.names}

    fresh = make(base).set_adapter("chat")  # another adapter active, fresh ids, untrained values
    loaded = fresh.load_file(path)
    assert loaded.active_adapter == "chat" and loaded.lora_adapters.names == ["sql", "chat", "tool"]
    assert {n: {p: (a.a.id, a.b.id) for p, a in loaded.lora_adapters.adapters(n).items()}
            for n in loaded.lora_adapters.names} == saved_ids
    rows = ["sql", "tool", None, "chat", "sql", "tool"]
    mixed = loaded(Tensor.from_numpy(x), adapter_index=rows).to_numpy()
    for i, name in enumerate(rows):
        np.testing.assert_allclose(mixed[i], oracle(trained, x, name)[i], atol=2e-5, err_msg=str(name))
    np.testing.assert_allclose(mixed, trained(Tensor.from_numpy(x), adapter_index=rows).to_numpy(), atol=1e-5)
    # the untrained module would differ on the trained adapters' rows: the check has teeth
    assert np.abs(oracle(fresh, x, "sql") - oracle(trained, x, "sql")).max() > 1e-2
    assert np.abs(oracle(fresh, x, "tool") - oracle(trained, x, "tool")).max() > 1e-2
    for name in ("sql", None, "tool", "chat"):
        np.testing.assert_allclose(loaded.set_adapter(name)(Tensor.from_numpy(x)).to_numpy(),
                                   oracle(trained, x, name), atol=2e-5, err_msg=str(name))
    # in memory: into_record / load_record (no file) is the same round trip
    again = make(base).load_record(trained.into_record())
    np.testing.assert_allclose(again.set_adapter("sql")(Tensor.from_numpy(x)).to_numpy(),
                               oracle(trained, x, "sql"), atol=2e-5)


def test_adapter_the_target_lacks_is_added(tmp_path, base, data):
    x, _ = data
    saved = make(base)
    path = saved.save_file(tmp_path / "three")
    only_chat = base.add_adapter("chat", make(base).lora_adapters.adapters("chat"))
    loaded = only_chat.set_adapter("chat").load_file(path)
    assert loaded.lora_adapters.names == ["chat", "sql", "tool"] and loaded.active_adapter == "chat"
    for name in ("sql", "tool", "chat"):
        np.testing.assert_allclose(loaded.set_adapter(name)(Tensor.from_numpy(x)).to_numpy(),
                                   oracle(saved, x, name), atol=2e-5, err_msg=name)
    # a plain module (no adapter at all) gets them all, none active as none was in the file
    plain = base.load_file(path)
    assert plain.lora_adapters.names == ["sql", "chat", "tool"] and plain.active_adapter is None
    np.testing.assert_allclose(plain(Tensor.from_numpy(x)).to_numpy(), oracle(saved, x, None), atol=2e-5)
    np.testing.assert_allclose(plain.set_adapter("sql")(Tensor.from_numpy(x)).to_numpy(), oracle(saved, x, "sql"),
                               atol=2e-5)
    # the file's active adapter is active where the target chose none: it computes as the saved module
    active_tool = saved.set_adapter("tool").save_file(tmp_path / "tool_active")
    for target in (base, make(base)):
        loaded = target.load_file(active_tool)
        assert loaded.active_adapter == "tool"
        np.testing.assert_allclose(loaded(Tensor.from_numpy(x)).to_numpy(), oracle(saved, x, "tool"), atol=2e-5)


def test_default_adapter_inactive_or_unnamed(tmp_path, base, data):
    """``add_adapter`` names unnamed adapters "default": a file whose only adapter is an inactive
    "default" keeps it (named, inactive) in a bare module; an active one loads into a module with
    unnamed adapters (``apply_lora``), which stay unnamed."""
    x, _ = data
    unnamed = _with_b(base.apply_lora(op.LoraConfig(rank=2, seed=1)), 3)
    only_default = unnamed.add_adapter("x", _adapters(unnamed)).delete_adapter("x").disable_adapter()
    assert only_default.lora_adapters.names == ["default"] and only_default.active_adapter is None
    path = only_default.save_file(tmp_path / "default")
    loaded = base.load_file(path)
    assert loaded.lora_adapters.names == ["default"] and loaded.active_adapter is None
    np.testing.assert_allclose(loaded.set_adapter("default")(Tensor.from_numpy(x)).to_numpy(),
                               oracle(only_default, x, "default"), atol=2e-5)
    active = only_default.set_adapter("default").save_file(tmp_path / "active_default")
    target = base.apply_lora(op.LoraConfig(rank=2, seed=9))  # unnamed, other values
    into_unnamed = target.load_file(active)
    assert into_unnamed.lora_adapters.names == [] and into_unnamed.active_adapter is None
    np.testing.assert_allclose(into_unnamed(Tensor.from_numpy(x)).to_numpy(), oracle(only_default, x, "default"),
                               atol=2e-5)


def test_mismatched_config_or_missing_adapter_is_refused(tmp_path, base):
    path = make(base).save_file(tmp_path / "three")
    other_alpha = make(base).delete_adapter("chat").add_adapter(
        "chat", _adapters(base.apply_lora(op.LoraConfig(rank=4, alpha=5, seed=2, use_rslora=True))))
    with pytest.raises(op.RecordError, match=r"adapter 'chat' on 'fc1\.weight': .* scale 1\.5, the module's adapter "
                                             r"has scale 2\.5"):
        other_alpha.load_file(path)
    extra = make(base).add_adapter("more", _adapters(base.apply_lora(op.LoraConfig(rank=2, seed=4))))
    with pytest.raises(op.RecordError, match=r"missing tensor 'fc1\.weight\.lora\.more\.a'"):
        extra.load_file(path)
    assert extra.try_load_file(path, allow_partial=True).lora_adapters.names == ["sql", "chat", "tool", "more"]


def test_old_file_goes_where_its_ids_say_or_is_refused(tmp_path, base, data):
    """An unnamed ``<W>.lora.a`` file (saved with "sql" active, before adapters were named in
    records) loaded where "chat" is active: into "sql" by its ids, never into "chat"."""
    x, _ = data
    m = make(base)
    sql = m.set_adapter("sql").map(lambda path, p: Param(p.id, value=Tensor.from_numpy(3 * p.val().to_numpy()),
                                                         require_grad=True) if path == "fc2.weight.lora.b" else p)
    old = save_module_file(sql, tmp_path / "old_sql.bpk")  # Burn's naming: the active adapter only
    record = op.ModuleRecord.load_file(old)
    assert "fc2.weight.lora.a" in record and LORA_METADATA_KEY not in record.metadata
    chat = sql.set_adapter("chat")
    loaded = chat.load_file(old)
    assert loaded.active_adapter == "chat"
    for name in ("chat", "sql", "tool"):
        np.testing.assert_allclose(loaded.set_adapter(name)(Tensor.from_numpy(x)).to_numpy(),
                                   oracle(sql if name == "sql" else chat, x, name), atol=2e-5, err_msg=name)
    assert np.abs(oracle(sql, x, "sql") - oracle(m, x, "sql")).max() > 1e-2  # the file's sql is not m's
    # a fresh build: the ids match none of its three adapters -> refused, naming file, tensor, adapters
    fresh = make(base).set_adapter("chat")
    with pytest.raises(op.RecordError, match=r"old_sql\.bpk.*unnamed LoRA factors.*\['sql', 'chat', 'tool'\]"
                                             r"(.|\n)*'fc2\.weight\.lora\.a' / 'fc2\.weight\.lora\.b': adapters "
                                             r"targeting 'fc2\.weight': \['sql', 'chat'\]"):
        fresh.load_file(old)
    np.testing.assert_allclose(fresh(Tensor.from_numpy(x)).to_numpy(), oracle(make(base), x, "chat"), atol=2e-5)
    # the rename the message gives chooses the adapter
    renamed = {re.sub(r"\.lora\.(a|b)$", r".lora.sql.\1", k): v for k, v in record.items()}
    chosen = fresh.try_load_record(renamed, allow_partial=True)
    np.testing.assert_allclose(chosen.set_adapter("sql")(Tensor.from_numpy(x)).to_numpy(), oracle(sql, x, "sql"),
                               atol=2e-5)
    # arrays without ids, at the paths named_params gives the active adapter's factors, go there
    chat3 = chat.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(3 * p.val().to_numpy()), require_grad=True)
                     if path == "fc2.weight.lora.b" else p)
    arrays = {k: v.to_data().array for k, v in op.ModuleRecord.from_module(chat3).items()}
    assert "fc2.weight.lora.b" in arrays
    by_path = fresh.load_record(arrays)
    assert by_path.active_adapter == "chat"
    np.testing.assert_allclose(by_path(Tensor.from_numpy(x)).to_numpy(), oracle(chat3, x, "chat"), atol=2e-5)
    assert np.abs(oracle(chat3, x, "chat") - oracle(chat, x, "chat")).max() > 1e-2
    # a module owning one named adapter takes the unnamed factors: no ambiguity
    one = base.add_adapter("only", m.lora_adapters.adapters("chat")).set_adapter("only")
    chat_old = save_module_file(chat, tmp_path / "old_chat.bpk")
    np.testing.assert_allclose(one.load_file(chat_old)(Tensor.from_numpy(x)).to_numpy(), oracle(chat, x, "chat"),
                               atol=2e-5)


def test_module_without_named_adapters_writes_burns_record(tmp_path, base):
    """No named adapter: the file is the one Burn's naming gives (``<W>.lora.a`` / ``.b``, the
    default metadata only), the same bytes as the plain record writer's."""
    adapted = _with_b(base.apply_lora(op.LoraConfig(rank=2, seed=1)), 3)
    path = adapted.save_file(tmp_path / "plain")
    legacy = save_module_file(adapted, tmp_path / "legacy.bpk")
    assert path.read_bytes() == legacy.read_bytes()
    record = op.ModuleRecord.load_file(path)
    assert sorted(record.metadata) == ["format", "producer", "version"]
    assert list(record) == ["fc1.weight", "fc1.weight.lora.a", "fc1.weight.lora.b", "fc1.bias",
                            "fc2.weight", "fc2.weight.lora.a", "fc2.weight.lora.b", "fc2.bias"]
    assert list(adapted.into_record()) == list(record)


def test_imported_model_round_trip_matches_plain_ort(tmp_path):
    """An imported ONNX model (``MatMul`` weight ``(in, out)`` and ``Gemm transB=1`` weight
    ``(out, in)``: a transposed adapter), two named adapters, one trained a step, saved and loaded
    into a fresh import with the other active. Oracle: plain ONNX Runtime on the original file with
    each adapter's merged weights (numpy) as initializers."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w1, w2 = rng.normal(size=(5, 7)).astype(np.float32), rng.normal(size=(4, 7)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    x, t = rng.normal(size=(4, 5)).astype(np.float32), rng.normal(size=(4, 4)).astype(np.float32)

    def build():
        base = op.import_onnx(tmp_path / "m.onnx")
        p = _adapters(_with_b(base.apply_lora(op.LoraConfig(rank=2, alpha=4, seed=1)), 41))
        q = _adapters(_with_b(base.apply_lora(op.LoraConfig(rank=3, alpha=2, seed=2, use_rslora=True)), 42))
        return base.add_adapter("p", p).add_adapter("q", q)

    trained = _train_one_step(build(), "q", Tensor.from_numpy(x), Tensor.from_numpy(t))
    assert trained.lora_adapters.adapters("q")["w2"].transposed
    path = trained.save_file(tmp_path / "trained")
    loaded = build().set_adapter("p").load_file(path)
    assert loaded.active_adapter == "p"

    def ort_oracle(name):
        weights = {"w1": w1, "w2": w2}
        for w, ad in trained.lora_adapters.adapters(name).items():
            delta = ad.scale * (ad.a.val().to_numpy().astype(np.float64) @ ad.b.val().to_numpy().astype(np.float64))
            weights[w] = (weights[w] + (delta.T if ad.transposed else delta)).astype(np.float32)
        changed = onnx.load(tmp_path / "m.onnx")
        for init in changed.graph.initializer:
            init.CopyFrom(numpy_helper.from_array(weights[init.name], init.name))
        onnx.save(changed, tmp_path / f"{name}.onnx")
        sess = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        return sess.run(None, {"x": x})[0]

    rows = ["q", "p", "q", None]
    mixed = loaded(Tensor.from_numpy(x), adapter_index=rows).to_numpy()
    expected = {"p": ort_oracle("p"), "q": ort_oracle("q"), None: loaded.disable_adapter()(Tensor.from_numpy(x)).to_numpy()}
    np.testing.assert_allclose(expected[None], np.maximum(x @ w1, 0) @ w2.T, atol=1e-5)
    for i, name in enumerate(rows):
        np.testing.assert_allclose(mixed[i], expected[name][i], atol=2e-5, err_msg=str(name))
    untrained = build()
    assert not np.allclose(untrained.set_adapter("q")(Tensor.from_numpy(x)).to_numpy(), expected["q"], atol=1e-3)


def test_cli_lora_refuses_a_file_with_named_adapters(tmp_path):
    """``onnxparam lora`` reads one unnamed adapter: a file with named ones is refused, naming
    them, instead of finding "no LoRA factors" (and fresh adapters silently replacing them)."""
    import contextlib
    import io

    from onnxparam.cli import main
    from onnxparam.zoo.mnist import Mnist

    base = Mnist()
    fresh = op.LoraConfig(rank=2, seed=1, param_group=op.ParamGroup.from_regex(r"^fc\d\.weight$"))
    named = base.add_adapter("x", _adapters(base.apply_lora(fresh))).add_adapter("y", _adapters(base.apply_lora(fresh)))
    named.set_adapter("y").save_file(tmp_path / "named.bpk")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["lora", "merge", str(tmp_path / "named.bpk"), str(tmp_path / "out.onnx"), "--zoo", "mnist",
                     "--alpha", "8", "--rank", "2"])
    assert code != 0 and "holds named LoRA adapters ['x', 'y']" in err.getvalue()
    assert not (tmp_path / "out.onnx").exists()


def test_safetensors_keep_every_named_adapter(tmp_path, base, data):
    """``save_safetensors`` writes the same named record (the description in ``__metadata__``);
    ``load_safetensors`` restores each adapter by name. A module without named adapters writes
    its tensors under Burn's names, as before."""
    st_load = pytest.importorskip("safetensors.numpy").load_file

    from onnxparam.convert import load_safetensors, save_safetensors

    x, _ = data
    saved = make(base).set_adapter("sql")
    save_safetensors(saved, tmp_path / "named.safetensors")
    assert "fc1.weight.lora.tool.a" in st_load(str(tmp_path / "named.safetensors"))
    loaded = load_safetensors(make(base).set_adapter("chat"), tmp_path / "named.safetensors")
    assert loaded.active_adapter == "chat"
    for name in ("sql", "chat", "tool"):
        np.testing.assert_allclose(loaded.set_adapter(name)(Tensor.from_numpy(x)).to_numpy(), oracle(saved, x, name),
                                   atol=2e-5, err_msg=name)
    plain = _with_b(base.apply_lora(op.LoraConfig(rank=2, seed=1)), 3)
    save_safetensors(plain, tmp_path / "plain.safetensors")
    written = st_load(str(tmp_path / "plain.safetensors"))
    assert sorted(written) == sorted(p for p, _ in plain.named_params())  # Burn's <W>.lora.a / .b
    for p, v in plain.named_params():
        np.testing.assert_array_equal(written[p], v.base().to_numpy())  # raw base, adapter apart
