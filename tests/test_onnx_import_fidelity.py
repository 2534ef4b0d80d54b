"""The graph of an imported model is the model: export(import(m)) is m, and public models with
control flow and fp16 weights import, run, export, quantize and take LoRA as plain ONNX Runtime
runs them.

Oracles: the original file's own structure (nodes, names, attributes, opsets, value types,
subgraphs, functions, weights byte for byte) and plain ONNX Runtime on the original file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_cases
import pytest
from onnx import numpy_helper

import onnxparam as op
from onnxparam.runtime import sessions_built

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).parent / "data" / "onnx"
REPO_MODELS = sorted(DATA.glob("*.onnx"))
BACKEND_MODELS = [c.model_path for c in onnx_cases.model_cases()]
OWN_KEYS = ("onnxparam.",)


def _graph_structure(g: onnx.GraphProto) -> dict:
    def typed(values):
        return [(v.name, v.type.SerializeToString(deterministic=True)) for v in values]

    nodes = []
    for n in g.node:
        attrs = []
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                value = _graph_structure(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                value = [_graph_structure(x) for x in a.graphs]
            elif a.type == onnx.AttributeProto.TENSOR:
                value = (a.t.data_type, list(a.t.dims), numpy_helper.to_array(a.t).tobytes())
            else:
                value = a.SerializeToString(deterministic=True)
            attrs.append((a.name, a.type, value))
        nodes.append((n.op_type, n.domain, n.name, list(n.input), list(n.output), attrs))
    return {
        "name": g.name,
        "inputs": typed(g.input),
        "outputs": typed(g.output),
        "value_info": typed(g.value_info),  # initializers' entries too: exactly those the file declares
        "initializers": [(t.name, t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes()) for t in g.initializer],
        "sparse_initializers": [s.SerializeToString(deterministic=True) for s in g.sparse_initializer],
        "nodes": nodes,
    }


def structure(model: onnx.ModelProto) -> dict:
    """Everything of a model an export must keep, weights' bytes included (their storage and
    onnxparam's own metadata entries excluded)."""
    return {
        "ir_version": model.ir_version,
        "opsets": sorted((o.domain, o.version) for o in model.opset_import),
        "producer": (model.producer_name, model.producer_version, model.domain, model.model_version),
        "doc": model.doc_string,
        "metadata": sorted((p.key, p.value) for p in model.metadata_props if not p.key.startswith(OWN_KEYS)),
        "functions": [f.SerializeToString(deterministic=True) for f in model.functions],
        "graph": _graph_structure(model.graph),
    }


def _assert_same_structure(path: Path, tmp_path: Path) -> None:
    exported = op.export_onnx(op.import_onnx(path), tmp_path / "exported.onnx")
    original = onnx.load(str(path))
    written = onnx.load(str(exported))
    want, got = structure(original), structure(written)
    for key in want:
        if key == "graph":
            for part in want["graph"]:
                assert got["graph"][part] == want["graph"][part], f"{path.name}: graph {part} differs"
        else:
            assert got[key] == want[key], f"{path.name}: {key} differs"


@pytest.mark.parametrize("path", REPO_MODELS, ids=[p.name for p in REPO_MODELS])
def test_every_model_the_repository_holds_exports_as_the_same_graph(path, tmp_path):
    _assert_same_structure(path, tmp_path)


@pytest.mark.parametrize("path", BACKEND_MODELS, ids=[str(p.parent.relative_to(p.parents[2])) for p in BACKEND_MODELS])
def test_every_onnx_backend_model_exports_as_the_same_graph(path, tmp_path):
    _assert_same_structure(path, tmp_path)


# -- public models with control flow and fp16 weights (silero-vad, MIT; see data/onnx/README.md) ---


def _silero_feeds(path: Path, batch: int = 1, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"input": (rng.normal(size=(batch, 512)) * 0.1).astype(np.float32),
             "state": (rng.normal(size=(2, batch, 128)) * 0.1).astype(np.float32)}
    if "sr" in [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]:
        feeds["sr"] = np.array(16000, np.int64)
    return feeds


def _plain(path, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


SILERO = [DATA / "silero_vad.onnx", DATA / "silero_vad_half.onnx"]


@pytest.mark.parametrize("path", SILERO, ids=[p.name for p in SILERO])
def test_a_public_model_with_if_bodies_holding_lstms_runs_and_exports_as_plain_onnx_runtime(path, tmp_path):
    module = op.import_onnx(path)
    for batch in (1, 3):  # new input shapes: the same session
        feeds = _silero_feeds(path, batch)
        before = sessions_built()
        got = module(**feeds)
        assert sessions_built() - before <= (1 if batch == 1 else 0)
        for g, w in zip(got, _plain(path, feeds), strict=True):
            np.testing.assert_array_equal(g.to_numpy(), w)
    exported = op.export_onnx(module, tmp_path / "vad.onnx")
    feeds = _silero_feeds(path, 2, seed=1)
    for g, w in zip(_plain(exported, feeds), _plain(path, feeds), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("path", SILERO, ids=[p.name for p in SILERO])
def test_a_quantized_public_model_exports_dequantize_linear_weights_that_compute_as_its_call(path, tmp_path):
    quantized = op.import_onnx(path).quantize_weights(op.Quantizer(op.QuantScheme(value=op.QuantValue.Q8S)))
    feeds = _silero_feeds(path)
    got = quantized(**feeds)
    exported = op.export_onnx(quantized, tmp_path / "q.onnx")
    written = onnx.load(str(exported))
    ops = [n.op_type for g in _graphs(written.graph) for n in g.node]
    assert "DequantizeLinear" in ops and "MatMulInteger" not in ops
    for g, w in zip(_plain(exported, feeds), got, strict=True):
        np.testing.assert_allclose(g, w.to_numpy(), rtol=1e-5, atol=1e-5)
    # each DequantizeLinear holds its param's int8 values and scale: it computes the param's value
    checked = 0
    for graph in _graphs(written.graph):
        inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        for node in graph.node:
            if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
                continue
            q, scale = inits[node.input[0]].astype(np.float32), inits[node.input[1]]
            assert inits[node.input[0]].dtype == np.int8 and scale.size == 1  # Q8S, per tensor
            want = quantized.param_of(node.input[0]).val().to_numpy()
            np.testing.assert_array_equal(q * scale, want)
            checked += 1
    assert checked == sum(1 for _, p in quantized.named_params() if p.dtype is op.DType.QFloat)


@pytest.mark.parametrize("path", SILERO, ids=[p.name for p in SILERO])
def test_lora_on_a_public_model_starts_as_the_original_and_its_merged_export_computes_as_its_call(path, tmp_path):
    imported = op.import_onnx(path)
    config = op.LoraConfig(rank=4, alpha=8)
    # the models' only rank-2 weights are LSTM weights read through Slice: no linear map's
    # matrix, so apply_lora adapts nothing, and says so (an error, a warning with allow_empty)
    assert not [p for p, layout in imported.lora_weight_layouts().items() if layout in ("in_out", "out_in")]
    why = r"got a LoRA adapter: \d+ rank-2 float param\(s\) are not the matrix of a linear map"
    with pytest.raises(op.LoraError, match=why):
        imported.apply_lora(config)
    with pytest.warns(UserWarning, match=why):
        adapted = imported.apply_lora(config, allow_empty=True)
    assert not [p for p, q in adapted.named_params() if q.adapter() is not None]
    feeds = _silero_feeds(path)
    want = _plain(path, feeds)
    for g, w in zip(adapted(**feeds), want, strict=True):  # b = 0: the adapter adds nothing yet
        np.testing.assert_array_equal(g.to_numpy(), w)
    for mode in ("merge", "keep"):
        exported = op.export_onnx(adapted, tmp_path / f"lora_{mode}.onnx", lora=mode)
        for g, w in zip(_plain(exported, feeds), want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_kept_lora_on_an_imported_graph_adds_the_adapter_branch_and_reimports_as_the_adapter(tmp_path):
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[N, 4] x) => (float[N, 3] y) <float[4, 3] w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}> {
        y = MatMul(x, w)
    }""")
    adapted = op.import_onnx(model).apply_lora(op.LoraConfig(rank=2, alpha=4))
    adapted = adapted.map(lambda path, p: p.map(lambda t: op.Tensor.from_numpy(np.full(t.shape, 0.1, np.float32)))
                          if path.endswith("lora.b") else p)
    a = adapted.param_of("w").adapter().a.val().to_numpy()
    w = numpy_helper.to_array(model.graph.initializer[0])
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    want = x @ w + 2.0 * (x @ a) @ np.full((2, 3), 0.1, np.float32)  # scale = alpha / rank (Hu et al. 2021)
    np.testing.assert_allclose(adapted(x).to_numpy(), want, rtol=1e-5)
    exported = op.export_onnx(adapted, tmp_path / "keep.onnx", lora="keep")
    written = onnx.load(str(exported))
    assert sorted(t.name for t in written.graph.initializer if t.name.startswith("w.lora.")) == ["w.lora.a", "w.lora.b", "w.lora.scale"]
    assert [n.op_type for n in written.graph.node].count("MatMul") == 3  # x @ w, then (x @ a) @ b: no a @ b
    np.testing.assert_allclose(_plain(exported, {"x": x})[0], want, rtol=1e-5)
    again = op.import_onnx(exported)
    assert again.param_of("w").adapter() is not None
    np.testing.assert_allclose(again(x).to_numpy(), want, rtol=1e-5)


def _graphs(g):
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g)
            for sub in a.graphs:
                yield from _graphs(sub)


# -- graphs the tracer-based importer could not take ------------------------------------------------


def _same_as_plain(model: onnx.ModelProto, feeds_list: list, tmp_path: Path) -> None:
    """import -> call -> export: each equal to plain ORT on ``model``; the export is the same graph."""
    path = tmp_path / "source.onnx"
    onnx.save(model, str(path))
    module = op.import_onnx(path)
    exported = op.export_onnx(module, tmp_path / "exported.onnx")
    for feeds in feeds_list:
        want = _plain(path, feeds)
        got = module(**feeds)
        got = list(got) if isinstance(got, tuple) else [got]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g.to_numpy() if hasattr(g, "to_numpy") else g, w)
        for g, w in zip(_plain(exported, feeds), want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert structure(onnx.load(str(exported)))["graph"]["nodes"] == structure(model)["graph"]["nodes"]


def test_sibling_if_branches_may_hold_weights_of_the_same_name(tmp_path):
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (bool cond, float[2] x) => (float[2] y) {
        y = If(cond) <
            then_branch = then_g () => (float[2] t) <float[2] w = {2, 3}> { t = Mul(x, w) },
            else_branch = else_g () => (float[2] e) <float[2] w = {5, 7}> { e = Mul(x, w) }
        >
    }""")
    x = np.array([1.0, -1.0], np.float32)
    _same_as_plain(model, [{"cond": np.array(True), "x": x}, {"cond": np.array(False), "x": x}], tmp_path)
    module = op.import_onnx(model)
    assert sorted(module.onnx_names.values()) == ["w", "w"]  # two params, each at its own path
    assert len(set(module.onnx_names)) == 2


def test_a_sparse_initializer_imports_as_its_dense_weight(tmp_path):
    from onnx import helper

    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "W")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([1, 3], np.int64), "i"), [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [4])], [helper.make_tensor_value_info("y", 1, [4])],
                              sparse_initializer=[sparse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    path = tmp_path / "sparse.onnx"
    onnx.save(model, str(path))
    x = np.arange(4, dtype=np.float32)
    module = op.import_onnx(path)
    np.testing.assert_array_equal(module.param_of("W").val().to_numpy(), [0, 1, 0, 2])
    np.testing.assert_array_equal(module(x).to_numpy(), _plain(path, {"x": x})[0])


def test_a_com_microsoft_operator_without_an_onnx_schema_runs_and_exports_as_plain_onnx_runtime(tmp_path):
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13, "com.microsoft" : 1]>
    g (float[N, 4] x) => (y) <float[4, 3] w = {1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1}> {
        h = com.microsoft.FusedMatMul <alpha: float = 0.5> (x, w)
        y = com.microsoft.Gelu (h)
    }""")
    rng = np.random.default_rng(3)
    _same_as_plain(model, [{"x": rng.normal(size=(n, 4)).astype(np.float32)} for n in (2, 5)], tmp_path)


def test_an_int64_constant_at_opset_8_stays_as_the_file_wrote_it(tmp_path):
    model = onnx.parser.parse_model("""
    <ir_version: 4, opset_import: ["" : 8]>
    g (float[2, 3] x) => (float[3, 2] y) {
        shape = Constant <value = int64[2] {3, 2}> ()
        y = Reshape(x, shape)
    }""")
    _same_as_plain(model, [{"x": np.arange(6, dtype=np.float32).reshape(2, 3)}], tmp_path)


def test_an_imported_qdq_graph_reexports_as_the_same_dequantize_linear_matmul(tmp_path):
    rng = np.random.default_rng(5)
    q = rng.integers(-127, 128, size=(8, 4)).astype(np.int8)
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[N, 8] x) => (float[N, 4] y) <float s = {0.05}> {
        w = DequantizeLinear(wq, s)
        y = MatMul(x, w)
    }""")
    model.graph.initializer.append(numpy_helper.from_array(q, "wq"))
    path = tmp_path / "qdq.onnx"
    onnx.save(model, str(path))
    module = op.import_onnx(path)
    assert module.param_of("wq").dtype is op.DType.QFloat
    x = rng.normal(size=(3, 8)).astype(np.float32)
    # NOTE: the module's sessions compute DequantizeLinear -> MatMul in float32 (accuracy level
    # 1); plain ORT's default may quantize the activations, so the call's oracle is the formula
    np.testing.assert_allclose(module(x).to_numpy(), x @ (q.astype(np.float32) * np.float32(0.05)), rtol=1e-5)
    exported = op.export_onnx(module, tmp_path / "exported.onnx")
    np.testing.assert_array_equal(_plain(exported, {"x": x})[0], _plain(path, {"x": x})[0])
    written = onnx.load(str(exported))
    assert structure(written)["graph"] == structure(model)["graph"]
    assert [n.op_type for n in written.graph.node] == ["DequantizeLinear", "MatMul"]
    np.testing.assert_array_equal(numpy_helper.to_array(next(t for t in written.graph.initializer if t.name == "wq")), q)


def test_an_imported_model_inside_another_modules_forward_runs_as_plain_onnx_runtime():
    # the fp16 silero model: an If whose output rank ONNX shape inference leaves unknown
    path = DATA / "silero_vad_half.onnx"

    class Scaled(op.Module):
        onnx_opset_imports = {"": 16}  # the imported graph's opset

        def __init__(self, vad):
            self.vad = vad

        def forward(self, x, state):
            out, new_state = self.vad(x, state)
            return out * 2.0, new_state

    feeds = _silero_feeds(path)
    want = _plain(path, feeds)
    got = Scaled(op.import_onnx(path))(op.Tensor.from_numpy(feeds["input"]), op.Tensor.from_numpy(feeds["state"]))
    np.testing.assert_allclose(got[0].to_numpy(), 2.0 * want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1].to_numpy(), want[1], rtol=1e-6, atol=1e-7)


def test_value_info_of_initializers_comes_back_exactly_as_the_file_declares_it(tmp_path):
    # `a` declared in value_info (as onnx_ir-based exporters write it), `b` not: an export of
    # the import declares the same, in both directions
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    agraph (float[2, 3] x) => (float[2, 3] y) <float[2, 3] a = {1, 2, 3, 4, 5, 6}, float[2, 3] b = {6, 5, 4, 3, 2, 1}> {
        t = Add(x, a)
        y = Mul(t, b)
    }
    """)
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2, 3]))
    path = tmp_path / "declared.onnx"
    onnx.save(model, str(path))
    written = onnx.load(str(op.export_onnx(op.import_onnx(path), tmp_path / "exported.onnx")))
    assert [v.name for v in written.graph.value_info] == ["a"]
    assert structure(written)["graph"] == structure(onnx.load(str(path)))["graph"]
