"""LoRA through ONNX: the merge / keep / inputs export modes, module(x) in each mode, ONNX
Runtime's multi-LoRA adapters (.onnx_adapter files), import of kept adapters, adapters on
imported MatMul / Gemm(transB=1) weights, and burnpack -> ONNX -> module round trips.

Oracles: numpy's ``x @ (W + (alpha / r) * A @ B) + bias`` on the factors the test itself draws,
and plain ONNX Runtime sessions on the written files (never this library's runtime).
"""

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

import onnxparam as op
from onnxparam import LoraConfig, LoraError, Module, Param, Tensor, export_onnx, import_onnx, write_onnx_adapter
from onnxparam.lora._adapter_file import adapter_params
from onnxparam.nn import Linear
from onnxparam.runtime import SessionConfig, sessions_built, set_session_config

RANK, ALPHA = 4, 6.0  # scale 1.5: alpha != rank
SCALE = ALPHA / RANK
ATOL = 1e-4


class Mlp(Module):
    def __init__(self):
        self.fc1 = Linear(8, 16)
        self.fc2 = Linear(16, 5)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_with_adapter(path, feeds: dict, module, folder):
    """Plain ONNX Runtime on ``path`` with ``module``'s adapters written to an
    ``.onnx_adapter`` file and activated through ``RunOptions`` (ORT's multi-LoRA API)."""
    file = write_onnx_adapter(module, folder / f"{path.stem}.onnx_adapter")
    lora = ort.LoraAdapter()
    lora.Load(str(file))
    options = ort.RunOptions()
    options.add_active_adapter(lora)
    return session(path).run(None, feeds, options)[0]


def with_factors(module, seed: int):
    """``module`` with every adapter's factors replaced by non-zero random ones (ids kept)."""
    rng = np.random.default_rng(seed)

    def fill(path, param):
        if path.endswith((".lora.a", ".lora.b")):
            value = rng.normal(0.0, 0.5, size=param.lazy_shape()).astype(np.float32)
            return Param(param.id, value=Tensor.from_numpy(value), require_grad=param.require_grad)
        return param

    return module.map(fill)


def adapted_base(adapted, path, param):
    """``param`` of a fresh Mlp replaced by the base value ``adapted`` has at ``path``."""
    return Param(param.id, value=dict(adapted.named_params())[path].base(), require_grad=False)


def arrays(module) -> dict:
    return {path: np.asarray(p.base().to_numpy()) for path, p in module.named_params()}


def numpy_mlp(v: dict, x, adapted=True):
    """The oracle: ``x @ (W + (alpha / r) * A @ B) + bias`` per layer, from raw arrays."""
    h = x
    for i, name in enumerate(("fc1", "fc2")):
        w = v[f"{name}.weight"]
        if adapted:
            w = w + SCALE * (v[f"{name}.weight.lora.a"] @ v[f"{name}.weight.lora.b"])
        h = h @ w + v[f"{name}.bias"]
        if i == 0:
            h = np.maximum(h, 0.0)
    return h


@pytest.fixture(scope="module")
def adapted():
    return with_factors(Mlp().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0)), seed=1)


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(7).normal(size=(3, 8)).astype(np.float32)


def test_module_call_in_every_lora_mode_equals_numpy(adapted, x):
    expected = numpy_mlp(arrays(adapted), x)
    for mode in ("merge", "keep", "inputs"):
        module = adapted.map(lambda p, q: q)
        set_session_config(module, SessionConfig(lora_mode=mode))
        np.testing.assert_allclose(module(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL, err_msg=mode)


def test_merge_lora_is_exact_in_float32(adapted):
    merged = adapted.merge_lora()
    v = arrays(adapted)
    params = dict(merged.named_params())
    assert list(params) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for name in ("fc1", "fc2"):
        w = v[f"{name}.weight"] + SCALE * (v[f"{name}.weight.lora.a"] @ v[f"{name}.weight.lora.b"])
        np.testing.assert_array_equal(params[f"{name}.weight"].val().to_numpy(), w)
        assert params[f"{name}.weight"].id == dict(adapted.named_params())[f"{name}.weight"].id


def test_exports_in_every_mode_equal_numpy_in_plain_onnx_runtime(adapted, x, tmp_path):
    expected = numpy_mlp(arrays(adapted), x)
    for mode in ("merge", "keep", "inputs"):
        path = export_onnx(adapted, tmp_path / f"{mode}.onnx", x, lora=mode, dynamic_axes={"x": {0: "batch"}})
        onnx.checker.check_model(str(path), full_check=True)
        y = run_with_adapter(path, {"x": x}, adapted, tmp_path) if mode == "inputs" else session(path).run(None, {"x": x})[0]
        np.testing.assert_allclose(y, expected, atol=ATOL, err_msg=mode)


def test_merged_export_has_one_initializer_per_weight_and_no_factors(adapted, x, tmp_path):
    model = onnx.load(str(export_onnx(adapted, tmp_path / "m.onnx", x, lora="merge")))
    assert [i.name for i in model.graph.initializer] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_kept_graph_never_forms_a_at_b_and_names_factors_by_record_path(adapted, x, tmp_path):
    model = onnx.load(str(export_onnx(adapted, tmp_path / "k.onnx", x, lora="keep")))
    inits = {i.name for i in model.graph.initializer}
    assert {"fc1.weight.lora.a", "fc1.weight.lora.b", "fc2.weight.lora.a", "fc2.weight.lora.b"} <= inits
    factors = {n for n in inits if ".lora." in n and not n.endswith("scale")}
    for node in model.graph.node:
        if node.op_type == "MatMul":  # a@b would be a MatMul of two factor initializers
            assert not set(node.input) <= factors, node
    # the kept base is the raw weight, not the merged one
    base = next(i for i in model.graph.initializer if i.name == "fc1.weight")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(base), arrays(adapted)["fc1.weight"])
    assert [i.name for i in model.graph.input] == ["x"]


def test_inputs_export_switches_adapters_with_onnx_adapter_files(adapted, x, tmp_path):
    path = export_onnx(adapted, tmp_path / "i.onnx", x, lora="inputs")
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["x", "fc1.weight.lora.a", "fc1.weight.lora.b",
                                                   "fc2.weight.lora.a", "fc2.weight.lora.b"]
    other = with_factors(adapted, seed=2)
    first = write_onnx_adapter(adapted, tmp_path / "first.onnx_adapter")
    second = write_onnx_adapter(other, tmp_path / "second.onnx_adapter")
    # the adapter's names are the model's inputs by construction
    names = set(ort.AdapterFormat.read_adapter(str(second)).get_parameters())
    assert names == {i.name for i in model.graph.input} - {"x"}
    sess = session(path)

    def run(adapter_file):
        options = ort.RunOptions()
        if adapter_file is not None:
            lora = ort.LoraAdapter()
            lora.Load(str(adapter_file))
            options.add_active_adapter(lora)
        return sess.run(None, {"x": x}, options)[0]

    np.testing.assert_allclose(run(second), numpy_mlp(arrays(other), x), atol=ATOL)
    np.testing.assert_allclose(run(first), numpy_mlp(arrays(adapted), x), atol=ATOL)
    np.testing.assert_allclose(run(second), numpy_mlp(arrays(other), x), atol=ATOL)
    # no active adapter: the zero-rank defaults, exactly the base model
    np.testing.assert_array_equal(run(None), session(export_onnx(Mlp().map(lambda p, q: adapted_base(adapted, p, q)),
                                                                 tmp_path / "base.onnx", x)).run(None, {"x": x})[0])
    np.testing.assert_allclose(run(None), numpy_mlp(arrays(adapted), x, adapted=False), atol=ATOL)


def test_inputs_export_without_adapter_equals_the_base_model_when_b_is_zero(x, tmp_path):
    fresh = Mlp().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0))  # b = 0: the base model
    path = export_onnx(fresh, tmp_path / "i.onnx", x, lora="inputs")
    base = numpy_mlp(arrays(fresh), x, adapted=False)
    np.testing.assert_allclose(session(path).run(None, {"x": x})[0], base, atol=ATOL)
    trained = with_factors(fresh, seed=5)
    write_onnx_adapter(trained, tmp_path / "t.onnx_adapter")
    lora = ort.LoraAdapter()
    lora.Load(str(tmp_path / "t.onnx_adapter"))
    options = ort.RunOptions()
    options.add_active_adapter(lora)
    np.testing.assert_allclose(session(path).run(None, {"x": x}, options)[0], numpy_mlp(arrays(trained), x),
                               atol=ATOL)


def test_inputs_mode_switches_adapters_in_module_calls_without_new_sessions(adapted, x):
    module = adapted.map(lambda p, q: q)
    set_session_config(module, SessionConfig(lora_mode="inputs"))
    module(Tensor.from_numpy(x))
    before = sessions_built()
    for seed in (11, 12):
        other = with_factors(module, seed)
        np.testing.assert_allclose(other(Tensor.from_numpy(x)).to_numpy(), numpy_mlp(arrays(other), x), atol=ATOL)
    assert sessions_built() == before


def test_io_binding_switches_adapters_by_binding_the_factors(adapted, x, tmp_path):
    """ONNX Runtime ignores active adapters under IO binding; binding the factor inputs works."""
    path = export_onnx(adapted, tmp_path / "i.onnx", x, lora="inputs")
    sess = session(path)
    other = with_factors(adapted, seed=3)
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    for name, value in adapter_params(other).items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
    binding.bind_output("output")
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], numpy_mlp(arrays(other), x), atol=ATOL)


def test_inputs_export_imports_back_as_the_base_model_without_adapters(adapted, x, tmp_path):
    path = export_onnx(adapted, tmp_path / "i.onnx", x, lora="inputs")
    imported = import_onnx(path)
    params = dict(imported.named_params())
    assert sorted(params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert all(p.adapter() is None for p in params.values())
    np.testing.assert_allclose(imported(Tensor.from_numpy(x)).to_numpy(), numpy_mlp(arrays(adapted), x, adapted=False),
                               atol=ATOL)


@pytest.mark.parametrize("mode", ["keep"])
def test_kept_export_imports_back_with_adapters_attached(adapted, x, tmp_path, mode):
    path = export_onnx(adapted, tmp_path / f"{mode}.onnx", x, lora=mode)
    imported = import_onnx(path)
    params = dict(imported.named_params())
    original = dict(adapted.named_params())
    w = params["fc1.weight"]
    assert w.adapter() is not None and w.adapter().scale == SCALE and not w.adapter().transposed
    assert params["fc1.weight.lora.a"] is w.adapter().a
    for name in ("fc1.weight", "fc1.weight.lora.a", "fc2.weight.lora.b"):
        assert params[name].id == original[name].id
        np.testing.assert_array_equal(params[name].base().to_numpy(), original[name].base().to_numpy())
    expected = numpy_mlp(arrays(adapted), x)
    np.testing.assert_allclose(imported(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL)
    # the LoRA nodes are gone from the imported graph (the adapter is applied once)
    assert not any(".lora." in (v.name or "") for n in imported.ir_model.graph for v in n.inputs if v is not None)
    # and it exports again in any mode
    for again in ("merge", "keep", "inputs"):
        out = export_onnx(imported, tmp_path / f"{mode}-{again}.onnx", lora=again)
        y = (run_with_adapter(out, {"x": x}, imported, tmp_path) if again == "inputs"
             else session(out).run(None, {"x": x})[0])
        np.testing.assert_allclose(y, expected, atol=ATOL, err_msg=again)


def test_burnpack_with_factors_round_trips_and_goes_through_onnx(adapted, x, tmp_path):
    file = adapted.save_file(tmp_path / "adapted.bpk")
    template = Mlp().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA))
    loaded = template.load_file(file)
    assert {p: q.id for p, q in loaded.named_params()} == {p: q.id for p, q in adapted.named_params()}
    for path, value in arrays(adapted).items():
        np.testing.assert_array_equal(arrays(loaded)[path], value)
    onnx_path = export_onnx(loaded, tmp_path / "adapted.onnx", x, lora="keep")
    back = import_onnx(onnx_path)
    np.testing.assert_allclose(back(Tensor.from_numpy(x)).to_numpy(), numpy_mlp(arrays(adapted), x), atol=ATOL)
    again = back.save_file(tmp_path / "again.bpk")
    reread = op.burnpack.read(again)
    assert set(reread.tensors) == set(arrays(adapted))
    for name, entry in reread.tensors.items():
        np.testing.assert_array_equal(entry.to_numpy(), arrays(adapted)[name])
        assert entry.param_id == int(dict(adapted.named_params())[name].id)


GEMM_MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N, 6] x) => (float[N, 4] y) <int64[1] axes = {1}, float[4, 6] w_t = {%s}, float[6, 5] w_mm = {%s}, float[4] c = {1, 2, 3, 4}>
{
    h = Gemm <transB: int = 1, alpha: float = 0.5> (x, w_t, c)
    z = MatMul (x, w_mm)
    zs = ReduceSum <keepdims: int = 1> (z, axes)
    y = Add (h, zs)
}
"""


def test_adapters_on_imported_matmul_and_gemm_trans_b_weights_use_the_weights_layouts(tmp_path):
    rng = np.random.default_rng(3)
    w_t = rng.normal(size=(4, 6)).astype(np.float32)  # Gemm B with transB=1: (out, in)
    w_mm = rng.normal(size=(6, 5)).astype(np.float32)  # MatMul B: (in, out)
    text = GEMM_MODEL % (", ".join(map(repr, w_t.ravel().tolist())), ", ".join(map(repr, w_mm.ravel().tolist())))
    model = onnx.parser.parse_model(text)
    imported = import_onnx(model)
    assert imported.lora_transposed_paths() == ["w_t"]
    adapted = with_factors(imported.apply_lora(LoraConfig(rank=2, alpha=3.0, seed=0)), seed=4)
    params = dict(adapted.named_params())
    assert params["w_t"].adapter().transposed and params["w_t.lora.a"].lazy_shape() == (6, 2)
    assert params["w_t.lora.b"].lazy_shape() == (2, 4)
    assert not params["w_mm"].adapter().transposed and params["w_mm.lora.a"].lazy_shape() == (6, 2)
    s = 3.0 / 2
    a_t, b_t = (params[f"w_t.lora.{k}"].val().to_numpy() for k in "ab")
    a_m, b_m = (params[f"w_mm.lora.{k}"].val().to_numpy() for k in "ab")
    x = rng.normal(size=(3, 6)).astype(np.float32)
    eff_t = w_t + s * (a_t @ b_t).T  # the delta in the weight's own (out, in) layout
    eff_m = w_mm + s * (a_m @ b_m)
    expected = 0.5 * x @ eff_t.T + np.array([1, 2, 3, 4], np.float32) + (x @ eff_m).sum(axis=1, keepdims=True)
    for mode in ("merge", "keep", "inputs"):
        module = adapted.map(lambda p, q: q)
        set_session_config(module, SessionConfig(lora_mode=mode))
        np.testing.assert_allclose(module(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL, err_msg=mode)
        path = export_onnx(adapted, tmp_path / f"{mode}.onnx", lora=mode)
        y = (run_with_adapter(path, {"x": x}, adapted, tmp_path) if mode == "inputs"
             else session(path).run(None, {"x": x})[0])
        np.testing.assert_allclose(y, expected, atol=ATOL, err_msg=mode)
        if mode == "keep":
            back = import_onnx(path)
            assert dict(back.named_params())["w_t"].adapter().transposed
            np.testing.assert_allclose(back(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL)


class Tied(Module):
    """The adapted weight is used by a MatMul and by something else (a ReduceSum of it)."""

    def __init__(self):
        self.fc = Linear(4, 3, bias=False)

    def forward(self, x):
        w = self.fc.weight.val()
        return op.ops.matmul(x, w) + w.sum()


def test_other_uses_of_an_adapted_weight_get_the_merged_weight_in_the_graph(x, tmp_path):
    module = with_factors(Tied().apply_lora(LoraConfig(rank=2, alpha=5.0, seed=0)), seed=6)
    v = arrays(module)
    w = v["fc.weight"] + 2.5 * (v["fc.weight.lora.a"] @ v["fc.weight.lora.b"])
    x4 = x[:, :4].copy()
    expected = x4 @ w + w.sum()
    for mode in ("keep", "inputs"):
        path = export_onnx(module, tmp_path / f"{mode}.onnx", x4, lora=mode)
        y = (run_with_adapter(path, {"x": x4}, module, tmp_path) if mode == "inputs"
             else session(path).run(None, {"x": x4})[0])
        np.testing.assert_allclose(y, expected, atol=ATOL, err_msg=mode)
        back = import_onnx(path)
        assert (dict(back.named_params())["fc.weight"].adapter() is not None) == (mode == "keep")
        base = x4 @ v["fc.weight"] + v["fc.weight"].sum()
        np.testing.assert_allclose(back(Tensor.from_numpy(x4)).to_numpy(), expected if mode == "keep" else base,
                                   atol=ATOL)


def test_unknown_lora_mode_is_rejected(tmp_path):
    with pytest.raises(LoraError, match=r"lora_mode must be one of merge, keep, inputs; got 'fuse'"):
        SessionConfig(lora_mode="fuse")
    module = Mlp().apply_lora(LoraConfig(rank=2))
    with pytest.raises(LoraError, match=r"unknown LoRA mode 'bogus': expected one of 'merge'") as info:
        export_onnx(module, tmp_path / "x.onnx", np.zeros((2, 8), np.float32), lora="bogus")
    assert isinstance(info.value, op.OnnxParamError) and isinstance(info.value, ValueError)
    assert not (tmp_path / "x.onnx").exists()


def test_unknown_lora_mode_is_rejected_without_adapters_too(tmp_path):
    """The mode is checked before anything else: a module with no adapter (built or imported,
    the imported one exported from its own graph) refuses a typo as an adapted one does."""
    x2 = np.zeros((2, 8), np.float32)
    imported = import_onnx(export_onnx(Mlp(), tmp_path / "plain.onnx", x2))
    for module in (Mlp(), imported):
        with pytest.raises(LoraError, match=r"unknown LoRA mode 'bogus': expected one of 'merge'"):
            export_onnx(module, tmp_path / "x.onnx", x2, lora="bogus")
        assert not (tmp_path / "x.onnx").exists()


def test_writing_an_adapter_of_a_module_without_adapters_says_to_apply_lora(tmp_path):
    with pytest.raises(LoraError, match=r"no LoRA adapter to write to .*none.onnx_adapter.*: Mlp has no LoRA adapters \(apply_lora"):
        write_onnx_adapter(Mlp(), tmp_path / "none.onnx_adapter")


def test_one_inputs_export_runs_adapters_of_any_rank_alpha_and_rslora_at_their_own_strength(x, tmp_path):
    """The export's own rank 4 / alpha 6 is nowhere in the graph: a rank-2 alpha-7 adapter and
    a rank-8 rsLoRA adapter (scale alpha / sqrt(r)) run in the same session, each equal to
    ``x @ (W + scale * A @ B)``, and no adapter is the base model."""
    exported = Mlp().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0))
    path = export_onnx(exported, tmp_path / "i.onnx", x, lora="inputs", dynamic_axes={"x": {0: "batch"}})
    sess = session(path)
    base = {p: q.base() for p, q in exported.named_params()}

    def rebased(config, seed):
        fresh = Mlp().map(lambda p, q: Param(q.id, value=base[p], require_grad=False)).apply_lora(config)
        return with_factors(fresh, seed)

    for config, seed in ((LoraConfig(rank=2, alpha=7.0, seed=1), 21),
                         (LoraConfig(rank=8, alpha=3.0, use_rslora=True, seed=2), 22)):
        other = rebased(config, seed)
        scale = config.alpha / (np.sqrt(config.rank) if config.use_rslora else config.rank)
        v = arrays(other)
        h = x
        for i, name in enumerate(("fc1", "fc2")):
            h = h @ (v[f"{name}.weight"] + scale * v[f"{name}.weight.lora.a"] @ v[f"{name}.weight.lora.b"]) \
                + v[f"{name}.bias"]
            h = np.maximum(h, 0.0) if i == 0 else h
        file = write_onnx_adapter(other, tmp_path / f"r{config.rank}.onnx_adapter")
        lora = ort.LoraAdapter()
        lora.Load(str(file))
        options = ort.RunOptions()
        options.add_active_adapter(lora)
        np.testing.assert_allclose(sess.run(None, {"x": x}, options)[0], h, atol=ATOL, err_msg=str(config.rank))
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], numpy_mlp(arrays(exported), x, adapted=False), atol=ATOL)


def test_a_matmul_whose_input_shape_the_file_leaves_undeclared_gets_the_branch_not_a_merged_weight(tmp_path):
    """torch's TorchScript exporter declares no shape for intermediate values: the adapter still
    goes after the ``MatMul`` (``W`` itself stays the only weight the ``MatMul`` reads, and no
    ``W + a @ b`` is formed per run in ``"inputs"`` mode)."""
    rng = np.random.default_rng(9)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["h"]), onnx.helper.make_node("MatMul", ["h", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        initializer=[onnx.numpy_helper.from_array(w, "w")])  # no value_info for h
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "src.onnx"))
    adapted = with_factors(import_onnx(tmp_path / "src.onnx").apply_lora(LoraConfig(rank=2, alpha=3.0, seed=0)), 3)
    v = arrays(adapted)
    x = rng.normal(size=(2, 4)).astype(np.float32)
    expected = np.maximum(x, 0) @ (w + 1.5 * v["w.lora.a"] @ v["w.lora.b"])
    for mode in ("keep", "inputs"):
        path = export_onnx(adapted, tmp_path / f"{mode}.onnx", x, lora=mode)
        nodes = onnx.load(str(path)).graph.node
        assert [n.op_type for n in nodes if "w" in n.input] == ["MatMul"], mode  # no W + a @ b
        y = (run_with_adapter(path, {"x": x}, adapted, tmp_path) if mode == "inputs"
             else session(path).run(None, {"x": x})[0])
        np.testing.assert_allclose(y, expected, atol=ATOL, err_msg=mode)
