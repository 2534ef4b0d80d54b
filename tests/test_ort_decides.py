"""ONNX Runtime decides what runs: no import refusal ORT would not make, every element type and
every size through the runtime (issue 26).

Oracles: plain ONNX Runtime on the original file (``onnx_cases.run_plain_ort``, which feeds every
element type through OrtValues built from ONNX's own packing, apart from onnxparam's boundary),
numpy formulas, and ORT's own refusal where the library refuses.

ORT's test models (``onnxruntime/test/testdata``) ship in ORT's source tree, not in the wheel, and
no network is reachable here: each is rebuilt below as a small equivalent holding the feature that
was refused, named after the file it stands for.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import onnx_cases

ort = pytest.importorskip("onnxruntime")

import onnxparam as op  # noqa: E402
from onnxparam import nn, ops  # noqa: E402
OnnxFormatError = op.OnnxFormatError

RNG = np.random.default_rng(26)


def rand(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def model(nodes, opsets, inputs, outputs, inits=(), ir_version=8, sparse=(), value_info=()):
    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits), sparse_initializer=list(sparse),
                         value_info=list(value_info))
    m = h.make_model(graph, opset_imports=[h.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = ir_version
    return m


def vi(name, elem, shape):
    return h.make_tensor_value_info(name, elem, shape)


def plain(m, inputs):
    data = m if isinstance(m, (str, bytes)) else m.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return onnx_cases.run_plain_ort(data if isinstance(data, bytes) else data, inputs, options)


def as_numpy(x):
    return x.to_numpy() if hasattr(x, "to_numpy") else np.asarray(x)


def same(got, want) -> bool:
    got, want = as_numpy(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind in "OUS":
        return got.tolist() == want.tolist()
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-5, atol=1e-6, equal_nan=True))


def round_trip(m, inputs, tmp_path):
    """import -> module(*inputs) -> export -> plain ORT, each equal to plain ORT on ``m``."""
    want = plain(m, inputs)
    module = op.import_onnx(m)
    got = module(*[onnx_cases.library_value(x) for x in inputs])
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == len(want) and all(same(g, w) for g, w in zip(got, want)), (got, want)
    path = op.export_onnx(module, tmp_path / "export.onnx")
    again = plain(str(path), inputs)
    assert all(same(g, w) for g, w in zip(again, want))
    return module


# -- 1. validation: no refusal ORT would not make --------------------------------------------------

X23 = vi("x", T.FLOAT, [2, 3])
Y = vi("y", T.FLOAT, None)


def _layer_norm(opset):
    """ORT testdata transform/fusion/layer_norm*.onnx, embed_layer_norm_format*.onnx (BERT /
    GPT-2 fusion models): LayerNormalization in the default domain below opset 17."""
    inits = [h.make_tensor("gamma", T.FLOAT, [3], [1.0, 2.0, 0.5]), h.make_tensor("beta", T.FLOAT, [3], [0, 1, 0])]
    nodes = [h.make_node("Add", ["x", "x"], ["s"]),
             h.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    return model(nodes, [("", opset)], [X23], [Y], inits)


def _gelu_no_import():
    """ORT testdata transform/approximation/gelu.onnx: a com.microsoft node, no com.microsoft opset."""
    return model([h.make_node("Gelu", ["x"], ["y"], domain="com.microsoft")], [("", 13)], [X23], [Y])


def _gelu_add_bias_no_import():
    """ORT testdata transform/approximation/gelu_add_bias.onnx: Add, then com.microsoft Gelu."""
    inits = [h.make_tensor("bias", T.FLOAT, [3], [0.1, -0.2, 0.3])]
    nodes = [h.make_node("Add", ["x", "bias"], ["a"]), h.make_node("Gelu", ["a"], ["y"], domain="com.microsoft")]
    return model(nodes, [("", 13)], [X23], [Y], inits)


def _onnx_imported_twice():
    """An ORT test model importing ai.onnx twice (opsets 21 and 1): ORT counts the last entry."""
    return model([h.make_node("Gelu", ["x"], ["y"])], [("ai.onnx", 1), ("", 21)], [X23], [Y])


def _skl2onnx_duplicate_opset():
    """skl2onnx 1.20's GradientBoostingRegressor: ("", 17) listed twice, a TreeEnsembleRegressor."""
    tree = h.make_node(
        "TreeEnsembleRegressor", ["x"], ["v"], domain="ai.onnx.ml", n_targets=1,
        nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[1, 0, 0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"], nodes_values=[0.5, 0.0, 0.0],
        nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0], nodes_hitrates=[1.0, 1.0, 1.0],
        nodes_missing_value_tracks_true=[0, 0, 0], target_treeids=[0, 0], target_nodeids=[1, 2],
        target_ids=[0, 0], target_weights=[-1.5, 2.5], base_values=[0.25], post_transform="NONE")
    nodes = [tree, h.make_node("Relu", ["v"], ["y"])]
    return model(nodes, [("", 17), ("", 17), ("ai.onnx.ml", 1)], [X23], [vi("y", T.FLOAT, [None, 1])])


def _upsample_scales():
    """ORT testdata test_resize.onnx: Upsample's ``scales`` is an initializer that ORT's shape
    inference reads when the session is built."""
    inits = [h.make_tensor("scales", T.FLOAT, [4], [1.0, 1.0, 2.0, 3.0])]
    return model([h.make_node("Upsample", ["x", "scales"], ["y"], mode="nearest")], [("", 9)],
                 [vi("x", T.FLOAT, [1, 2, 2, 2])], [vi("y", T.FLOAT, [1, 2, 4, 6])], inits)


def _resize_scales():
    inits = [h.make_tensor("roi", T.FLOAT, [0], []), h.make_tensor("scales", T.FLOAT, [4], [1.0, 1.0, 2.0, 1.5])]
    return model([h.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="linear")], [("", 13)],
                 [vi("x", T.FLOAT, [1, 2, 2, 2])], [Y], inits)


def _sparse_initializer_shadowing_an_input():
    """ORT testdata ort_minimal_test_models/sparse_initializer_handling.onnx: a sparse initializer
    of the same name as a graph input: ORT gives the input the initializer's value."""
    sparse = h.make_sparse_tensor(h.make_tensor("w", T.FLOAT, [2], [5.0, 7.0]),
                                  h.make_tensor("w_idx", T.INT64, [2], [0, 4]), [2, 3])
    return model([h.make_node("Add", ["x", "w"], ["y"])], [("", 13)], [X23, vi("w", T.FLOAT, [2, 3])], [Y],
                 sparse=[sparse])


def _no_default_domain_import():
    """A model importing only com.microsoft while using ai.onnx nodes: ORT runs ai.onnx at its newest opset."""
    nodes = [h.make_node("Relu", ["x"], ["r"]), h.make_node("Gelu", ["r"], ["y"], domain="com.microsoft")]
    return model(nodes, [("com.microsoft", 1)], [X23], [Y])


ORT_TESTDATA_EQUIVALENTS = {
    "no ai.onnx import, ai.onnx and com.microsoft nodes": (_no_default_domain_import, [rand(2, 3)]),
    "transform/fusion/layer_norm (opset 11)": (lambda: _layer_norm(11), [rand(2, 3)]),
    "transform/fusion/layer_norm (opset 12)": (lambda: _layer_norm(12), [rand(2, 3)]),
    "transform/fusion/embed_layer_norm_format (opset 13)": (lambda: _layer_norm(13), [rand(2, 3)]),
    "transform/approximation/gelu.onnx": (_gelu_no_import, [rand(2, 3)]),
    "transform/approximation/gelu_add_bias.onnx": (_gelu_add_bias_no_import, [rand(2, 3)]),
    "ai.onnx imported twice (21 and 1)": (_onnx_imported_twice, [rand(2, 3)]),
    "skl2onnx GradientBoostingRegressor, ('', 17) twice": (_skl2onnx_duplicate_opset, [rand(2, 3)]),
    "test_resize.onnx (Upsample scales)": (_upsample_scales, [rand(1, 2, 2, 2)]),
    "Resize scales initializer": (_resize_scales, [rand(1, 2, 2, 2)]),
    "ort_minimal_test_models/sparse_initializer_handling.onnx": (_sparse_initializer_shadowing_an_input,
                                                                 [rand(2, 3)]),
}


@pytest.mark.parametrize("name", sorted(ORT_TESTDATA_EQUIVALENTS))
def test_an_ort_test_model_plain_ort_runs_imports_runs_equal_and_reexports(name, tmp_path):
    build, inputs = ORT_TESTDATA_EQUIVALENTS[name]
    round_trip(build(), inputs, tmp_path)


def test_the_sweep_of_ort_test_models_refuses_none_that_plain_ort_runs(tmp_path):
    runs, refused = 0, []
    for name, (build, inputs) in ORT_TESTDATA_EQUIVALENTS.items():
        m = build()
        plain(m, inputs)  # plain ORT runs every one of them (else this raises)
        runs += 1
        try:
            round_trip(m, inputs, tmp_path)
        except OnnxFormatError as e:
            refused.append(f"{name}: {e}")
    assert runs == len(ORT_TESTDATA_EQUIVALENTS) and refused == []


def test_duplicate_opset_imports_count_as_ort_counts_them_the_last_entry():
    # ("", 21) then ("ai.onnx", 1): ORT runs the graph at opset 1, where Gelu does not exist
    m = model([h.make_node("Gelu", ["x"], ["y"])], [("", 21), ("ai.onnx", 1)], [X23], [Y])
    with pytest.raises(Exception, match="Gelu"):
        plain(m, [rand(2, 3)])
    with pytest.raises(OnnxFormatError, match="registers an operator 'Gelu' up to opset 1"):
        op.import_onnx(m)


def test_what_ort_refuses_is_still_refused_naming_node_and_domain():
    custom = model([h.make_node("Foo", ["x"], ["y"], domain="my.domain")], [("", 13)], [X23], [Y])
    unknown = model([h.make_node("Foo", ["x"], ["y"])], [("", 13)], [X23], [Y])
    for m, message in ((custom, "domain 'my.domain', which the model imports no opset of"),
                       (unknown, "neither ONNX nor ONNX Runtime registers an operator 'Foo' up to opset 13")):
        with pytest.raises(Exception):
            plain(m, [rand(2, 3)])  # ORT refuses it too
        with pytest.raises(OnnxFormatError, match=message):
            op.import_onnx(m)


def test_a_model_with_duplicate_opsets_quantizes_and_takes_lora(tmp_path):
    inits = [h.make_tensor("w", T.FLOAT, [3, 4], rand(3, 4).ravel().tolist())]
    m = model([h.make_node("MatMul", ["x", "w"], ["y"])], [("", 17), ("", 17)], [X23], [Y], inits)
    x = rand(2, 3)
    want = plain(m, [x])[0]
    module = op.import_onnx(m)
    quantized = module.quantize_weights(op.Quantizer(op.QuantScheme(value=op.QuantValue.Q8S)))
    np.testing.assert_allclose(quantized(x).to_numpy(), want, atol=0.1)  # 8-bit weights: near the float result
    adapted = module.apply_lora(op.LoraConfig(rank=2, alpha=4, seed=0))
    np.testing.assert_allclose(adapted(x).to_numpy(), want, rtol=1e-5, atol=1e-6)  # LoRA's b starts at 0


def test_shape_data_initializers_are_no_params_and_stay_constants():
    module = op.import_onnx(_upsample_scales())
    assert [path for path, _ in module.named_params()] == []
    x = rand(1, 2, 2, 2)
    np.testing.assert_array_equal(module(x).to_numpy(), x.repeat(2, axis=2).repeat(3, axis=3))


def test_a_sparse_initializer_is_never_an_input_and_has_its_dense_value():
    module = op.import_onnx(_sparse_initializer_shadowing_an_input())
    x = rand(2, 3)
    dense = np.zeros(6, np.float32)
    dense[[0, 4]] = [5.0, 7.0]
    np.testing.assert_allclose(module(x).to_numpy(), x + dense.reshape(2, 3))


# -- 2. every element type through the runtime ------------------------------------------------------

RAW_TYPES = [
    (T.BFLOAT16, ml_dtypes.bfloat16, 13), (T.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 19),
    (T.FLOAT8E4M3FNUZ, ml_dtypes.float8_e4m3fnuz, 19), (T.FLOAT8E5M2, ml_dtypes.float8_e5m2, 19),
    (T.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz, 19), (T.INT4, ml_dtypes.int4, 21),
    (T.UINT4, ml_dtypes.uint4, 21),
]


@pytest.mark.parametrize("elem,np_type,opset", RAW_TYPES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_inputs_and_outputs_of_every_element_type_cross_module_calls_with_their_real_dtype(elem, np_type, opset,
                                                                                         tmp_path):
    # x (elem) -> Cast float -> *2 -> Cast elem: an elem input and an elem output
    nodes = [h.make_node("Cast", ["x"], ["f"], to=T.FLOAT), h.make_node("Add", ["f", "f"], ["g"]),
             h.make_node("Cast", ["g"], ["y"], to=elem), h.make_node("Identity", ["f"], ["z"])]
    m = model(nodes, [("", opset)], [vi("x", elem, [2, 3])], [vi("y", elem, [2, 3]), vi("z", T.FLOAT, [2, 3])],
              ir_version=10)
    values = [1, 2, 3, -1, 0, 2] if np.dtype(np_type).name.startswith("int") else [1, 2, 3, 1, 0, 2]
    x = np.array(values, dtype=np.float32).reshape(2, 3).astype(np_type)
    if np.dtype(np_type).name.startswith("uint4"):
        x = np.array([1, 2, 3, 4, 0, 5], dtype=np.uint8).reshape(2, 3).astype(np_type)
    module = round_trip(m, [x], tmp_path)
    y, z = module(onnx_cases.library_value(x))
    assert as_numpy(y).dtype == np.dtype(np_type)  # ml_dtypes, not uint8
    np.testing.assert_array_equal(as_numpy(z), x.astype(np.float32))
    np.testing.assert_array_equal(as_numpy(y).astype(np.float32), 2 * x.astype(np.float32))


def test_string_inputs_and_outputs_cross_module_calls(tmp_path):
    m = model([h.make_node("Identity", ["x"], ["y"])], [("", 17)], [vi("x", T.STRING, [3])],
              [vi("y", T.STRING, [3])])
    x = np.array(["a", "bb", ""], dtype=object)
    module = round_trip(m, [x], tmp_path)
    assert as_numpy(module(x)).tolist() == ["a", "bb", ""]


def test_a_bfloat16_input_crosses_a_traced_module_through_io_binding_and_grad():
    class Net(op.Module):
        def __init__(self):
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(ops.cast(x, op.DType.F32))

    net = Net()
    x = np.array([[1.5, -2.0, 0.25]], dtype=ml_dtypes.bfloat16)
    w, b = net.fc.weight.val().to_numpy(), net.fc.bias.val().to_numpy()
    want = x.astype(np.float32) @ w + b
    np.testing.assert_allclose(net(op.Tensor.from_numpy(x)).to_numpy(), want, rtol=1e-6)

    def loss_fn(m, x):
        return m(x).sum()

    loss, grads = op.autodiff.grad(loss_fn, net, op.Tensor.from_numpy(x))
    np.testing.assert_allclose(float(loss.to_numpy()), want.sum(), rtol=1e-5)
    # d sum(x @ w + b) / d w = x^T 1 (numpy formula)
    np.testing.assert_allclose(grads[net.fc.weight].to_numpy(), x.astype(np.float32).T @ np.ones((1, 2), np.float32),
                               rtol=1e-6)


def test_a_bfloat16_input_of_an_imported_model_runs_and_differentiates():
    w = RNG.normal(size=(3, 2)).astype(np.float32)
    m = model([h.make_node("Cast", ["x"], ["f"], to=T.FLOAT), h.make_node("MatMul", ["f", "w"], ["y"])], [("", 19)],
              [vi("x", T.BFLOAT16, [1, 3])], [vi("y", T.FLOAT, [1, 2])],
              [h.make_tensor("w", T.FLOAT, [3, 2], w.ravel().tolist())])
    module = op.import_onnx(m)
    x = np.array([[1.5, -2.0, 0.25]], dtype=ml_dtypes.bfloat16)
    np.testing.assert_allclose(module(op.Tensor.from_numpy(x)).to_numpy(), plain(m, [x])[0], rtol=1e-6)
    loss, grads = op.autodiff.grad(lambda mm, x: mm(x).sum(), module, op.Tensor.from_numpy(x))
    np.testing.assert_allclose(float(loss.to_numpy()), float(plain(m, [x])[0].sum()), rtol=1e-5)
    np.testing.assert_allclose(grads.by_path()["w"].to_numpy(), x.astype(np.float32).T @ np.ones((1, 2), np.float32),
                               rtol=1e-6)  # d sum(x @ w) / d w = x^T 1


def test_eager_ops_take_and_give_bfloat16_through_the_runtime():
    x = np.array([1.5, -2.0, 3.0], dtype=ml_dtypes.bfloat16)
    up = ops.cast(op.Tensor.from_numpy(x), op.DType.F32)
    np.testing.assert_array_equal(up.to_numpy(), x.astype(np.float32))
    down = ops.cast(op.Tensor.from_numpy(np.array([1.5, 2.0, 3.0], np.float32)), op.DType.BF16)
    assert down.dtype is op.DType.BF16 and down.to_numpy().dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(down.to_numpy().astype(np.float32), [1.5, 2.0, 3.0])


# -- 4. sizes 0 and 1 -------------------------------------------------------------------------------


class Heads(op.Module):
    """Heads split and merged by reshapes of computed dims (what failed at size 0)."""

    def __init__(self, d=8, heads=2):
        self.heads = heads
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        y = self.fc(x).reshape(b, s, self.heads, -1).transpose(1, 2)       # (b, h, s, d/h)
        return y.transpose(1, 2).reshape(b, s, -1).flatten(0, 1)          # (b*s, d)


def heads_numpy(m, x):
    w, b = m.fc.weight.val().to_numpy(), m.fc.bias.val().to_numpy()
    return (x @ w + b).reshape(-1, x.shape[-1])


def test_module_calls_at_batch_and_sequence_0_and_1_after_going_dynamic_equal_numpy():
    m = Heads()
    for shape in ((2, 5, 8), (3, 7, 8), (0, 5, 8), (2, 0, 8), (1, 1, 8), (1, 0, 8), (0, 0, 8), (4, 3, 8)):
        x = rand(*shape)
        got = m(x).to_numpy()
        want = heads_numpy(m, x)
        assert got.shape == want.shape, shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_export_with_dynamic_axes_runs_in_plain_ort_at_sizes_0_and_1(tmp_path):
    m = Heads()
    path = op.export_onnx(m, tmp_path / "heads.onnx", rand(2, 5, 8), dynamic_axes={"x": {0: "batch", 1: "seq"}})
    reshapes = [n for n in onnx.load(path).graph.node if n.op_type == "Reshape"]
    assert reshapes and all(any(a.name == "allowzero" and a.i == 1 for a in n.attribute) for n in reshapes)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((3, 0, 8), (0, 4, 8), (1, 1, 8), (0, 0, 8), (2, 5, 8)):
        x = rand(*shape)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], heads_numpy(m, x), rtol=1e-5, atol=1e-6)


class Reverse(op.Module):
    def __init__(self):
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)[::-1]


class LastB(op.Module):
    def __init__(self):
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        return y[-y.shape[0]:]


class SplitLast(op.Module):
    def __init__(self):
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x).reshape(-1, 2, 2)[:, 0, :]  # the -1 is the batch again


@pytest.mark.parametrize("cls,formula", [(Reverse, lambda y: y[::-1]), (LastB, lambda y: y[-len(y):] if len(y) else y),
                                         (SplitLast, lambda y: y.reshape(-1, 2, 2)[:, 0, :])])
def test_dynamic_batch_exports_slices_counted_from_the_end_with_static_output_dims(cls, formula, tmp_path):
    m = cls()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = op.export_onnx(m, tmp_path / "m.onnx", rand(3, 8), dynamic_batch=True)
    out = onnx.load(path).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in out] == ["batch", 2 if cls is SplitLast else 4]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    w, b = m.fc.weight.val().to_numpy(), m.fc.bias.val().to_numpy()
    for batch in (0, 1, 5):
        x = rand(batch, 8)
        np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x})[0], formula(x @ w + b),
                                   rtol=1e-5, atol=1e-6)


def test_layer_normalization_below_opset_17_differentiates_equal_to_the_numpy_formula():
    module = op.import_onnx(_layer_norm(11))
    x = rand(2, 3)
    loss, grads = op.autodiff.grad(lambda m, x: m(x).sum(), module, x)
    s = 2.0 * x.astype(np.float64)  # the graph normalizes x + x
    xhat = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-5)
    got = grads.by_path()
    np.testing.assert_allclose(got["gamma"].to_numpy(), xhat.sum(0), rtol=1e-4, atol=1e-5)  # d sum(y) / d gamma
    np.testing.assert_allclose(got["beta"].to_numpy(), [2.0, 2.0, 2.0])                      # rows per beta_j
    np.testing.assert_allclose(float(loss.to_numpy()), (xhat * [1.0, 2.0, 0.5] + [0, 1, 0]).sum(), rtol=1e-4)


def test_a_com_microsoft_node_without_an_import_runs_inside_another_modules_trace():
    inner = op.import_onnx(_gelu_add_bias_no_import())

    class Outer(op.Module):
        onnx_opset_imports = {"": 13}  # the imported graph's opset (Add differs at newer ones)

        def __init__(self):
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2.0

    x = rand(2, 3)
    np.testing.assert_allclose(Outer()(x).to_numpy(), 2 * plain(_gelu_add_bias_no_import(), [x])[0], rtol=1e-5,
                               atol=1e-6)


def test_shape_data_kept_in_an_external_data_file_stays_a_constant_of_the_session(tmp_path):
    inits = [h.make_tensor("scales", T.FLOAT, [4], [1.0, 1.0, 2.0, 2.0]),
             h.make_tensor("shape", T.INT64, [2], [2, -1]),
             h.make_tensor("w", T.FLOAT, [16, 3], rand(16, 3).ravel().tolist())]
    nodes = [h.make_node("Upsample", ["x", "scales"], ["u"], mode="nearest"),
             h.make_node("Reshape", ["u", "shape"], ["r"]), h.make_node("MatMul", ["r", "w"], ["y"])]
    m = model(nodes, [("", 9)], [vi("x", T.FLOAT, [1, 2, 2, 2])], [Y], inits)
    path = tmp_path / "external.onnx"
    onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="external.data",
              size_threshold=0)
    x = rand(1, 2, 2, 2)
    want = plain(str(path), [x])[0]
    module = op.import_onnx(path)
    assert [p for p, _ in module.named_params()] == ["w"]
    np.testing.assert_allclose(module(x).to_numpy(), want, rtol=1e-5, atol=1e-6)


def test_gradients_at_batch_and_sequence_0_and_1_equal_the_numpy_formula():
    m = Heads()
    for shape in ((2, 5, 8), (0, 5, 8), (2, 0, 8), (1, 1, 8), (1, 0, 8)):
        x = rand(*shape)
        loss, grads = op.autodiff.grad(lambda mm, x: mm(x).sum(), m, x)
        rows = x.reshape(-1, 8).astype(np.float64)
        got = grads.by_path()
        # loss = sum(x @ w + b): d/dw[i, j] = sum_n x[n, i], d/db[j] = number of rows
        np.testing.assert_allclose(got["fc.weight"].to_numpy(), np.repeat(rows.sum(0)[:, None], 8, 1), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(got["fc.bias"].to_numpy(), np.full(8, len(rows)))
        np.testing.assert_allclose(float(loss.to_numpy()), heads_numpy(m, x).astype(np.float64).sum(), rtol=1e-4,
                                   atol=1e-4)
