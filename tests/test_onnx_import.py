"""ONNX import: names -> paths, which tensors are weights, lazy params, the module tree, running
the graph as it is (control flow, custom domains, overridable and tied weights), module features.

Oracle: plain ONNX Runtime on the original model (or on a copy changed with numpy), never this
project's own runtime against itself.
"""

import mmap
import string

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

import onnxparam as op
from onnxparam import DType, Module, ModuleRecord, ParamGroup, ParamId, Tensor, TraceError
from onnxparam.core.module import Module as ModuleClass
from onnxparam.onnx_io import OnnxModule, OnnxScope, import_onnx, onnx_name_to_path, path_to_onnx_name
from onnxparam.onnx_io._naming import RESERVED_SEGMENTS, is_valid_path

DATA = __import__("pathlib").Path(__file__).parent / "data" / "onnx"


# -- helpers ------------------------------------------------------------------------------------


def parse(text: str, ir_version: int = 8, check: bool = True) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.ir_version = ir_version
    if check:
        onnx.checker.check_model(model)
    return model


def ort_run(model, feeds: dict) -> list:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def with_initializer(model: onnx.ModelProto, name: str, array: np.ndarray) -> onnx.ModelProto:
    """A copy of ``model`` whose initializer or Constant output ``name`` holds ``array``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for init in copy.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(array, name))
            return copy
    for node in copy.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(array))
            return copy
    raise KeyError(name)


def t(array) -> Tensor:
    return Tensor.from_numpy(np.asarray(array))


# -- naming -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, path", [
    ("layer1.0.conv1.weight", "layer1.0.conv1.weight"),
    ("gpu_0/conv1_w_0", "gpu_0.conv1_w_0_x_"),
    ("MagikaV2/Dense_0/Reshape:0", "MagikaV2.Dense_0.Reshape_x3a_0_x_"),
    ("onnx::Conv_12", "onnx_x3a__x3a_Conv_12"),
    ("a/b.c/d", "a.b_x2e_c.d_x_"),
    ("box_x", "box_x5f_x"),
    ("map", "x_map"),
    ("_orig_mod.fc", "x__orig_mod.fc"),
    ("x_y", "x_x_y"),
    ("a//b", "a.x_.b_x_"),
    ("a/x", "a.x_x_x_"),
    ("/x", "x_.x_x_x_"),
    ("", "x_"),
])
def test_onnx_names_map_to_documented_paths_and_back(name, path):
    assert onnx_name_to_path(name) == path
    assert path_to_onnx_name(path) == name
    assert is_valid_path(path)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(string.ascii_letters + string.digits + "_./:-x@ \u00e9\u4e2d"), max_size=24))
def test_naming_is_a_bijection_onto_valid_paths(name):
    path = onnx_name_to_path(name)
    assert is_valid_path(path), path
    assert path_to_onnx_name(path) == name


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(string.ascii_lowercase + "_./:x"), max_size=12),
       st.text(alphabet=st.sampled_from(string.ascii_lowercase + "_./:x"), max_size=12))
def test_different_names_never_share_a_path(a, b):
    if a != b:
        assert onnx_name_to_path(a) != onnx_name_to_path(b)


@pytest.mark.parametrize("path, problem", [
    ("conv.w/0", "characters outside"),
    ("a..b", "characters outside"),
    ("a_x3A_", "canonical"),
    ("a_x_.b", "slash mark"),
    ("a_x3a", "unterminated"),
])
def test_paths_no_name_maps_to_are_rejected(path, problem):
    with pytest.raises(ValueError, match=problem):
        path_to_onnx_name(path)


def test_reserved_segments_cover_every_public_module_attribute():
    public = {n for cls in (ModuleClass, OnnxModule, OnnxScope) for n in dir(cls) if not n.startswith("_")}
    assert public <= RESERVED_SEGMENTS, sorted(public - RESERVED_SEGMENTS)


# -- which tensors are weights ------------------------------------------------------------------

WEIGHTS_MODEL = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[1, 2, 4, 4] x) => (float[1, 3, 4, 4] y, float[3] s) <float[3, 2, 1, 1] "conv.weight" = {1, 2, 3, 4, 5, 6},
        int64[2] flat_shape = {1, 48}, float scale0 = {2.0}, int64[4] axes = {0, 1, 2, 3}> {
    c = Conv(x, "conv.weight")
    learned = Constant<value = float[1] {0.5}>()
    m = Mul(c, learned)
    lit = Constant<value = float {3.0}>()
    a = Add(m, lit)
    sc = Constant<value = float[4] {1.0, 1.0, 1.0, 1.0}>()
    roi = Constant<value = float[0] {}>()
    r = Resize(a, roi, sc)
    big = Constant<value = int64[70] {0,1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9}>()
    bigf = Cast<to = 1>(big)
    bigs = ReduceSum<keepdims = 0>(bigf)
    y0 = Mul(r, scale0)
    f = Reshape(y0, flat_shape)
    y1 = Reshape(f, shape_back)
    shape_back = Constant<value = int64[4] {1, 3, 4, 4}>()
    y = Add(y1, bigs)
    s = Constant<value = float[3] {7, 8, 9}>()
}
"""


def test_weights_are_initializers_and_constants_that_feed_differentiable_inputs():
    module = import_onnx(parse(WEIGHTS_MODEL, check=False))
    params = dict(module.named_params())
    # conv.weight: Conv's W; learned: Mul's operand ([1], from a Constant); big: an int table
    # of 70 elements; s: a graph output; scale0: a 0-d float initializer (a scalar nn.Parameter
    # is written as one). Not weights: Reshape shapes, Resize scales / roi, the 0-d Constant
    # literal, a 4-element int vector used nowhere.
    assert sorted(params) == ["big", "conv.weight", "learned", "s", "scale0"]
    assert params["scale0"].shape == () and params["scale0"].require_grad
    assert params["conv.weight"].shape == (3, 2, 1, 1) and params["conv.weight"].dtype is DType.F32
    assert params["big"].dtype is DType.I64 and not params["big"].require_grad
    assert params["learned"].require_grad


def test_a_graph_with_weights_in_constants_and_unsorted_nodes_runs_as_in_onnx_runtime():
    model = parse(WEIGHTS_MODEL, check=False)  # Reshape uses shape_back before its Constant
    x = np.random.default_rng(0).normal(size=(1, 2, 4, 4)).astype(np.float32)
    expected = ort_run(model, {"x": x})
    y, s = import_onnx(model)(t(x))
    np.testing.assert_array_equal(y.to_numpy(), expected[0])
    np.testing.assert_array_equal(s.to_numpy(), expected[1])


def test_paddle_constant_held_weights_become_params_with_their_names():
    module = import_onnx(DATA / "ppocr_mobile_v2_cls.onnx")
    params = dict(module.named_params())
    assert len(params) == 213
    assert params["fc_0.w_0"].shape == (200, 2)
    assert params["conv1_weights"].shape == (8, 3, 3, 3)


# -- the module tree ------------------------------------------------------------------------------


def test_paths_build_a_tree_of_scopes_and_keep_conflicting_names_exact():
    model = parse("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2] x) => (float[2] y) <float[2] "enc.w" = {1, 2}, float[2] "enc.w.extra" = {3, 4},
                                    float[2] "dec/w:0" = {5, 6}> {
        a = Add(x, "enc.w")
        b = Mul(a, "enc.w.extra")
        y = Sub(b, "dec/w:0")
    }""")
    module = import_onnx(model)
    assert [p for p, _ in module.named_params()] == ["enc.w", "enc.w.extra", "dec.w_x3a_0_x_"]
    assert isinstance(module.enc, OnnxScope) and isinstance(module.dec, OnnxScope)
    assert getattr(module.enc, "w.extra") is module.param_of("enc.w.extra")
    assert module.onnx_names["dec.w_x3a_0_x_"] == "dec/w:0"
    assert module.path_of("dec/w:0") == "dec.w_x3a_0_x_"
    with pytest.raises(KeyError, match="no weight named 'nope'"):
        module.path_of("nope")


def test_display_shows_scopes_shapes_and_counts_without_reading_weights():
    module = import_onnx(DATA / "magika_standard_v3_3.onnx")
    text = repr(module)
    assert text.startswith("OnnxModule(magika_standard_v3_3.onnx, opset ai.onnx:15, ai.onnx.ml:2, 95 nodes) {")
    assert "MagikaV2: OnnxScope {" in text and "transpose_3_x3a_0_x_: [512, 256, 5, 1] F32" in text
    assert not any(p.is_initialized() for _, p in module.named_params())


# -- laziness -------------------------------------------------------------------------------------


def test_import_reads_no_weight_and_external_data_is_memory_mapped(tmp_path):
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    model = parse("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2, 64] x) => (float[2, 64] y) <float[64, 64] "fc.weight" = {0}> { y = MatMul(x, "fc.weight") }""",
                  check=False)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "fc.weight"))
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="m.data", size_threshold=0)
    module = import_onnx(path)
    param = module.param_of("fc.weight")
    assert not param.is_initialized()
    array = param.val().to_numpy()
    np.testing.assert_array_equal(array, w)
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    assert isinstance(base, mmap.mmap), "the weight is not a view of the memory-mapped data file"
    x = np.ones((2, 64), np.float32)
    np.testing.assert_array_equal(module(t(x)).to_numpy(), ort_run(path, {"x": x})[0])


def test_param_ids_and_flags_recorded_in_metadata_are_taken():
    model = parse("""
    <ir_version: 10, opset_import: ["" : 13]>
    g (float[2] x) => (float[2] y) <float[2] a = {1, 2}, float[2] b = {3, 4}> { c = Add(x, a)  y = Mul(c, b) }""",
                  ir_version=10)
    entry = model.graph.initializer[0].metadata_props.add()
    entry.key, entry.value = "onnxparam.param_id", "18446744073709551615"
    entry = model.graph.initializer[0].metadata_props.add()
    entry.key, entry.value = "onnxparam.require_grad", "false"
    entry = model.metadata_props.add()
    entry.key, entry.value = "onnxparam.params", '{"b": {"param_id": "42", "require_grad": true}}'
    module = import_onnx(model)
    a, b = module.param_of("a"), module.param_of("b")
    assert a.id == ParamId(2**64 - 1) and a.require_grad is False
    assert b.id == ParamId(42) and b.require_grad is True


# -- running the graph ----------------------------------------------------------------------------

TWO_IN_TWO_OUT = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[N, 3] x, float[N, 3] z) => (float[N, 3] sum, float[N, 3] prod) <float[3] bias = {1, 2, 3}> {
    sum = Add(x, bias)
    prod = Mul(z, sum)
}
"""


def test_inputs_go_positionally_in_graph_order_or_by_name_and_outputs_come_as_a_tuple():
    model = parse(TWO_IN_TWO_OUT)
    module = import_onnx(model)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    z = np.full((2, 3), 2.0, np.float32)
    expected = ort_run(model, {"x": x, "z": z})
    for out in (module(t(x), t(z)), module(t(x), z=t(z)), module(z=t(z), x=t(x))):
        assert isinstance(out, tuple) and len(out) == 2
        np.testing.assert_array_equal(out[0].to_numpy(), expected[0])
        np.testing.assert_array_equal(out[1].to_numpy(), expected[1])
    assert module.input_names == ("x", "z") and module.output_names == ("sum", "prod")


def test_bad_calls_name_the_graph_inputs():
    module = import_onnx(parse(TWO_IN_TWO_OUT))
    x = t(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match=r"missing graph input\(s\) 'z'; the graph takes 'x', 'z' in this order"):
        module(x)
    with pytest.raises(TypeError, match=r"the ONNX graph has no input 'y'; its inputs are 'x', 'z'"):
        module(x, x, y=x)
    with pytest.raises(TypeError, match=r"graph input 'x' was given twice"):
        module(x, x, x=x)
    with pytest.raises(TypeError, match=r"graph input 'z' takes F32 values, got I64"):
        module(x, t(np.zeros((2, 3), np.int64)))
    with pytest.raises(TypeError, match=r"graph input 'x' takes shape \['N', 3\], got \[2, 4\]"):
        module(t(np.zeros((2, 4), np.float32)), x)


def test_initializers_that_are_graph_inputs_can_be_overridden_by_name():
    model = parse("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[3] x, float[3] bias) => (float[3] y) <float[3] bias = {1, 2, 3}> { y = Add(x, bias) }""")
    module = import_onnx(model)
    assert module.input_names == ("x",) and module.override_names == ("bias",)
    x = np.ones(3, np.float32)
    other = np.array([10, 20, 30], np.float32)
    np.testing.assert_array_equal(module(t(x)).to_numpy(), ort_run(model, {"x": x})[0])
    np.testing.assert_array_equal(module(t(x), bias=t(other)).to_numpy(), ort_run(model, {"x": x, "bias": other})[0])


def test_ir3_initializer_inputs_are_constants_as_in_onnx_runtime():
    model = parse("""
    <ir_version: 3, opset_import: ["" : 9]>
    g (float[3] x, float[3] bias) => (float[3] y) <float[3] bias = {1, 2, 3}> { y = Add(x, bias) }""", ir_version=3)
    module = import_onnx(model)
    assert module.override_names == ()
    assert [p for p, _ in module.named_params()] == ["bias"]


def test_a_tied_weight_is_one_param_and_a_new_value_reaches_every_use():
    model = parse("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2, 2] x) => (float[2, 2] y) <float[2, 2] shared = {1, 2, 3, 4}> {
        a = MatMul(x, shared)
        y = MatMul(a, shared)
    }""")
    module = import_onnx(model)
    assert [p for p, _ in module.named_params()] == ["shared"]
    new = np.array([[0, 1], [1, 0]], np.float32)
    record = ModuleRecord({"shared": op.TensorSnapshot(DType.F32, (2, 2), ParamId(5), lambda: t(new).into_data())})
    loaded = module.load_record(record)
    x = np.array([[1, 2], [3, 4]], np.float32)
    np.testing.assert_array_equal(loaded(t(x)).to_numpy(), ort_run(with_initializer(model, "shared", new), {"x": x})[0])
    np.testing.assert_array_equal(module(t(x)).to_numpy(), ort_run(model, {"x": x})[0])
    assert loaded.param_of("shared").id == ParamId(5)


CONTROL_FLOW = """
<ir_version: 8, opset_import: ["" : 13]>
g (bool[1] cond, float[2] x, int64[1] trip) => (float[2] y, float[2] acc) <float[2] outer_w = {10, 20}> {
    y = If(cond) <
        then_branch = then_g () => (float[2] t_out) <float[2] then_w = {1, 2}> {
            t_out = Add(x, then_w)
        },
        else_branch = else_g () => (float[2] e_out) {
            e_w = Constant<value = float[2] {3, 4}>()
            e_mid = Mul(x, e_w)
            e_out = Add(e_mid, outer_w)
        }
    >
    init = Identity(x)
    true_ = Constant<value = bool {1}>()
    acc = Loop(trip, true_, init) <
        body = loop_g (int64 i, bool c_in, float[2] a_in) => (bool c_out, float[2] a_out) {
            c_out = Identity(c_in)
            step = Constant<value = float[2] {0.5, 0.25}>()
            scaled = Mul(a_in, step)
            a_out = Add(scaled, outer_w)
        }
    >
}
"""


@pytest.mark.parametrize("cond", [True, False])
def test_control_flow_runs_with_subgraph_weights_as_params(cond):
    model = parse(CONTROL_FLOW)
    module = import_onnx(model)
    assert sorted(p for p, _ in module.named_params()) == ["e_w", "outer_w", "step", "then_w"]
    feeds = {"cond": np.array([cond]), "x": np.array([1.5, -2.0], np.float32), "trip": np.array([3], np.int64)}
    expected = ort_run(model, feeds)
    y, acc = module(*(t(v) for v in feeds.values()))
    np.testing.assert_array_equal(y.to_numpy(), expected[0])
    np.testing.assert_array_equal(acc.to_numpy(), expected[1])
    # a subgraph weight changed in the module changes what the subgraph computes
    new = np.array([100, 200], np.float32)
    changed = module.map(lambda path, p: p.map(lambda v: t(new)) if path == "then_w" else p)
    expected = ort_run(with_initializer_in_subgraph(model, "then_w", new), feeds)
    np.testing.assert_array_equal(changed(*(t(v) for v in feeds.values()))[0].to_numpy(), expected[0])


def with_initializer_in_subgraph(model, name, array):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                for init in attr.g.initializer:
                    if init.name == name:
                        init.CopyFrom(numpy_helper.from_array(array, name))
    return copy


def test_custom_domain_nodes_run_at_the_model_opset_version():
    model = parse("""
    <ir_version: 8, opset_import: ["" : 13, "ai.onnx.ml" : 1]>
    g (float[2, 3] x) => (float[2, 3] y) <float[3] offset = {0.5, 1, 2}> {
        s = Add(x, offset)
        y = ai.onnx.ml.Binarizer<threshold = 1.5>(s)
    }""")
    module = import_onnx(model)
    assert module.onnx_opset_imports == {"": 13, "ai.onnx.ml": 1}
    x = np.array([[0, 1, 2], [3, -1, 0.25]], np.float32)
    np.testing.assert_array_equal(module(t(x)).to_numpy(), ort_run(model, {"x": x})[0])


def test_an_imported_graph_inlines_into_an_enclosing_module_at_a_compatible_opset():
    model = parse(TWO_IN_TWO_OUT)
    inner = import_onnx(model)

    class Outer(Module):
        onnx_opset_imports = {"": 13}  # the imported graph's opset: Add and Mul changed in 14

        def __init__(self):
            self.inner = inner

        def forward(self, x):
            s, p = self.inner(x, x)
            return p.relu()

    x = np.array([[-3, 1, 2], [0, -1, 5]], np.float32)
    expected = np.maximum(ort_run(model, {"x": x, "z": x})[1], 0)
    np.testing.assert_array_equal(Outer()(t(x)).to_numpy(), expected)


def test_an_imported_graph_refuses_an_enclosing_trace_whose_operators_differ():
    inner = import_onnx(parse(TWO_IN_TWO_OUT))

    class Outer(Module):
        def __init__(self):
            self.inner = inner

        def forward(self, x):
            return self.inner(x, x)[0]

    with pytest.raises(TraceError, match=r"uses domain 'ai.onnx' at version 13, the enclosing trace at 21, and these "
                                         r"operators differ between the two: Add, Mul; trace the enclosing module at opset 13"):
        Outer()(t(np.zeros((1, 3), np.float32)))


def test_forward_outside_a_call_explains_itself():
    module = import_onnx(parse(TWO_IN_TWO_OUT))
    with pytest.raises(TraceError, match=r"OnnxModule.forward emits graph nodes: call the module"):
        module.forward(t(np.zeros((1, 3), np.float32)), t(np.zeros((1, 3), np.float32)))


# -- module features on an imported model ---------------------------------------------------------


def test_imported_params_group_freeze_record_and_reload(tmp_path):
    module = import_onnx(DATA / "magika_standard_v3_3.onnx")
    frozen = module.freeze_group(ParamGroup.from_path("jax2tf_get_logits_.pjit_get_logits_.MagikaV2.Conv_0"))
    flags = {p: prm.require_grad for p, prm in frozen.named_params()}
    assert flags["jax2tf_get_logits_.pjit_get_logits_.MagikaV2.Conv_0.transpose_3_x3a_0_x_"] is False
    assert flags["jax2tf_get_logits_.Const_24_x3a_0_x_"] is True
    assert all(module.param_of(n).require_grad for n in ["jax2tf_get_logits_/Const_24:0"])
    record = module.into_record()
    assert list(record) == [p for p, _ in module.named_params()]
    saved = module.save_file(tmp_path / "magika.bpk")
    again = import_onnx(DATA / "magika_standard_v3_3.onnx").load_file(saved)
    for (path, a), (_, b) in zip(module.named_params(), again.named_params()):
        assert a.id == b.id
        np.testing.assert_array_equal(a.val().to_numpy(), b.val().to_numpy())


def test_loading_new_weights_changes_what_the_graph_computes():
    model = onnx.load(DATA / "ppocr_mobile_v2_cls.onnx")
    module = import_onnx(model)
    w = np.asarray(module.param_of("fc_0.w_0").val().to_numpy())
    new = (w[:, ::-1] * 0.5).astype(np.float32)
    snap = op.TensorSnapshot(DType.F32, new.shape, None, lambda: t(new).into_data())
    loaded = module.try_load_record(ModuleRecord({"fc_0.w_0": snap}), allow_partial=True)
    x = np.random.default_rng(1).normal(size=(1, 3, 48, 192)).astype(np.float32)
    expected = ort_run(with_initializer(model, "fc_0.w_0", new), {"x": x})[0]
    np.testing.assert_allclose(loaded(t(x)).to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_scan_bodies_with_their_own_weights_and_outer_references_run_as_the_original():
    model = parse("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2] init, float[3, 2] xs) => (float[2] last, float[3, 2] ys) <float[2] w = {2, 3}> {
        last, ys = Scan(init, xs) <num_scan_inputs = 1, body = sb (float[2] s_in, float[2] x_in) => (float[2] s_out, float[2] y_out)
                                   <float[2] b = {0.5, 0.5}> {
            u = Mul(x_in, w)
            v = Add(u, b)
            s_out = Add(s_in, v)
            y_out = Identity(s_out)
        }>
    }""")
    module = import_onnx(model)
    assert [p for p, _ in module.named_params()] == ["w", "b"]
    feeds = {"init": np.zeros(2, np.float32), "xs": np.arange(6, dtype=np.float32).reshape(3, 2)}
    for got, want in zip(module(t(feeds["init"]), t(feeds["xs"])), ort_run(model, feeds), strict=True):
        np.testing.assert_array_equal(got.to_numpy(), want)


def test_a_graph_with_sequence_values_runs_as_in_onnx_runtime():
    import onnx.parser

    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) {
            s = SequenceConstruct(x, x)
            y = SequenceAt(s, zero)
        }
    """)
    zero = onnx.helper.make_tensor("zero", onnx.TensorProto.INT64, [], [0])
    model.graph.initializer.append(zero)
    module = op.import_onnx(model)
    x = np.array([1.5, -2.0], np.float32)
    np.testing.assert_array_equal(module(x).to_numpy(), x)  # SequenceAt(SequenceConstruct(x, x), 0) is x
