"""Issue 27, the rest of it: ``--include`` quantizes 1-D biases (one scale per tensor), the API
export settles value infos as the CLI does, and a ``.bpk`` output keeps its accuracy report.

Oracles: numpy's symmetric int8 formula (``s = max|b| / 127``, codes rounded half away from zero,
Burn's MinMax), plain ONNX Runtime on the written file vs ``x @ W + dequantized(b)`` in numpy,
ONNX's own shape inference on the same graph, and the accuracy numbers of the two models run in
plain ONNX Runtime.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from quantized_files import sklearn_mlp

from onnxparam.cli import main

RNG = np.random.default_rng(2727)
D_IN, D_OUT = 64, 256


def run_main(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def linear(path):
    """``MatMul(x, w) + b`` (a 1-D bias, as torch exports ``nn.Linear``)."""
    w = (RNG.normal(size=(D_IN, D_OUT)) / 8).astype(np.float32)
    b = RNG.normal(size=(D_OUT,)).astype(np.float32)
    b[3] = 2.5  # one large entry: the scale follows it
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", D_IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", D_OUT])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path, w, b


def run(path, x):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def symmetric_int8(b: np.ndarray) -> tuple:
    scale = np.float32(np.abs(b).max() / np.float32(127))
    r = b / scale
    return (np.sign(r) * np.floor(np.abs(r) + 0.5)).astype(np.int8), scale


@pytest.mark.parametrize("per_channel", [False, True])
def test_include_quantizes_a_1d_bias_per_tensor_as_numpy_does(tmp_path, capsys, per_channel):
    src, w, b = linear(tmp_path / "linear.onnx")
    out = tmp_path / "q.onnx"
    extra = ["--per-channel"] if per_channel else []
    code, stdout, err = run_main(capsys, "quantize", src, out, "--include", "^b$", *extra, "--json")
    assert code == 0, err
    written = {t.name: t for t in onnx.load(str(out)).graph.initializer}
    assert written["b"].data_type == TensorProto.INT8
    assert written["w"].data_type == TensorProto.FLOAT  # --include names the bias only
    codes, scale = symmetric_int8(b)
    np.testing.assert_array_equal(numpy_helper.to_array(written["b"]), codes)
    (dq,) = [n for n in onnx.load(str(out)).graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "b"]
    file_scale = numpy_helper.to_array(written[dq.input[1]])
    assert file_scale.shape == () and file_scale == scale  # one scale per tensor, even with --per-channel
    x = RNG.normal(size=(5, D_IN)).astype(np.float32)
    np.testing.assert_allclose(run(out, x), x @ w + codes.astype(np.float32) * scale, rtol=1e-5, atol=1e-5)
    assert json.loads(stdout)["results"]["quantized"]["params"] == 1


def test_the_api_quantizes_a_1d_bias_with_min_rank_1_per_tensor_under_per_channel(tmp_path):
    from onnxparam import ParamGroup
    from onnxparam.onnx_io import import_onnx
    from onnxparam.quant import Quantizer
    from onnxparam.quant._module import quantize_weights

    src, w, b = linear(tmp_path / "linear.onnx")
    module = quantize_weights(import_onnx(src), Quantizer(min_rank=1, per_channel=True), ParamGroup.from_regex("^b$"))
    params = dict(module.named_params())
    qt = params["b"].base()._quant
    codes, scale = symmetric_int8(b)
    np.testing.assert_array_equal(np.asarray(qt.values), codes)
    assert np.asarray(qt.scales).size == 1 and np.float32(np.asarray(qt.scales).ravel()[0]) == scale


# -- the API export settles value infos as the CLI does --------------------------------------------


def _dims(vi) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in vi.type.tensor_type.shape.dim]


def test_the_api_export_of_a_quantized_import_settles_value_infos_as_onnx_shape_inference_does(tmp_path):
    """A ``Reshape`` to a shape computed from ``Shape(x)`` (as transformer exports write): without
    settling, the export's value infos of the computed shape have an unknown dim; the API export
    (``export_onnx`` of ``quantize_weights``, no CLI) holds what ONNX shape inference gives."""
    from onnxparam import export_onnx
    from onnxparam.onnx_io import import_onnx
    from onnxparam.quant import Quantizer

    w = (RNG.normal(size=(D_IN, D_IN)) / 8).astype(np.float32)
    nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Slice", ["sx", "s0", "s2"], ["nb"]),
             helper.make_node("Concat", ["nb", "m1"], ["shp"], axis=0), helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Reshape", ["h", "shp"], ["h2"]), helper.make_node("Add", ["h2", "x"], ["r"]),
             helper.make_node("LayerNormalization", ["r", "g", "b"], ["y"], axis=-1)]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0], np.int64), "s0"),
             numpy_helper.from_array(np.array([2], np.int64), "s2"),
             numpy_helper.from_array(np.array([-1], np.int64), "m1"),
             numpy_helper.from_array(np.ones(D_IN, np.float32), "g"),
             numpy_helper.from_array(np.zeros(D_IN, np.float32), "b")]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "s", D_IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "s", D_IN])], inits)
    src = tmp_path / "block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = export_onnx(import_onnx(src).quantize_weights(Quantizer()), tmp_path / "q.onnx")
    model = onnx.load(str(out))
    computed = {o for node in model.graph.node for o in node.output}
    got = {vi.name: _dims(vi) for vi in model.graph.value_info if vi.name in computed}
    assert got["nb"] == [2] and got["shp"] == [3]
    assert all(None not in dims for dims in got.values()), got
    stripped = onnx.load(str(out))
    del stripped.graph.value_info[:]
    oracle = {vi.name: _dims(vi) for vi in onnx.shape_inference.infer_shapes(stripped).graph.value_info}
    assert set(got) == set(oracle)
    for name, dims in oracle.items():  # the same dims (symbols are named per run: compared by kind)
        assert [d if isinstance(d, int) else "sym" for d in got[name]] == [
            d if isinstance(d, int) else "sym" for d in dims], name
    x = RNG.normal(size=(2, 3, D_IN)).astype(np.float32)
    assert run(out, x).shape == (2, 3, D_IN)


# -- a .bpk output keeps its accuracy report -------------------------------------------------------


def mlp(path, sizes=(64, 256, 10)):
    """``MatMul`` + ``Add`` + ``Relu`` layers, then ``Softmax`` (a scikit-learn MLP's graph)."""
    return sklearn_mlp(path, sizes, RNG)


def numpy_mlp(x, weights, quantized: bool) -> np.ndarray:
    h = x.astype(np.float64)
    for i, (w, c) in enumerate(weights):
        if quantized:
            codes, scale = symmetric_int8(w)
            w = codes.astype(np.float32) * scale
        h = h @ w.astype(np.float64) + c
        if i < len(weights) - 1:
            h = np.maximum(h, 0)
    e = np.exp(h - h.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_a_bpk_output_stores_its_accuracy_report_and_inspect_shows_it(tmp_path, capsys):
    from onnxparam import burnpack

    src, weights = mlp(tmp_path / "mlp.onnx")
    out = tmp_path / "q.bpk"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--json")
    assert code == 0, err
    report = json.loads(stdout)["results"]["accuracy"]
    stored = burnpack.read(out).metadata
    assert json.loads(stored["onnxparam.quant.accuracy"]) == report
    assert json.loads(stored["onnxparam.quant.kept_float"]) == json.loads(stdout)["results"]["kept_float"]
    # the numbers: the float model and the weights' numpy rounding, on the inputs the report names
    from onnxparam.quant._accuracy import sample_inputs

    feeds, described = sample_inputs(src, None)
    assert described == report["inputs"]
    ref, got = numpy_mlp(feeds["x"], weights, False), numpy_mlp(feeds["x"], weights, True)
    (row,) = report["outputs"]
    cosine = float(ref.ravel() @ got.ravel() / np.sqrt((ref.ravel() @ ref.ravel()) * (got.ravel() @ got.ravel())))
    assert row["cosine"] == pytest.approx(cosine, abs=1e-6)
    assert row["max_abs_error"] == pytest.approx(float(np.abs(ref - got).max()), abs=1e-6)

    code, stdout, err = run_main(capsys, "inspect", out)
    assert code == 0, err
    assert f"accuracy:  vs the float model on {report['inputs']}" in stdout
    assert f"probabilities  cosine {row['cosine']:.6f}  max abs error {row['max_abs_error']:.6g}" in stdout
    onnx_out = tmp_path / "q.onnx"  # the .onnx output shows the same table
    assert run_main(capsys, "quantize", src, onnx_out)[0] == 0
    code, stdout, err = run_main(capsys, "inspect", onnx_out)
    assert code == 0 and "accuracy:  vs the float model on" in stdout and "probabilities  cosine" in stdout


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def test_weights_in_constant_nodes_are_searched_alone_and_all_together(tmp_path, capsys):
    """Paddle2ONNX stores every weight as a ``Constant`` node (the PP-OCR models): below
    ``--min-cosine`` the search for the weights that move the outputs most finds them there (it
    used to find none and put the whole error on the integer kernels), and the report gives the
    cosine with all of them dequantized at once. Oracle: the MLP in numpy with one weight, or
    every weight, rounded by numpy's symmetric int8 formula, on the inputs the report names."""
    from onnxparam.quant._accuracy import sample_inputs

    src, weights = mlp(tmp_path / "mlp.onnx")
    model = onnx.load(str(src))
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in model.graph.initializer]
    nodes += list(model.graph.node)
    del model.graph.initializer[:]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    src = tmp_path / "constants.onnx"
    onnx.save(model, str(src))
    code, stdout, err = run_main(capsys, "quantize", src, tmp_path / "q.onnx", "--min-cosine", "0.9999999", "--json")
    assert code == 0, err
    report = json.loads(stdout)["results"]["accuracy"]
    feeds, described = sample_inputs(src, None)
    assert described == report["inputs"]
    ref = numpy_mlp(feeds["x"], weights, False)

    def rounded_only(layer):
        codes, scale = symmetric_int8(weights[layer][0])
        changed = [(codes.astype(np.float32) * scale, c) if i == layer else (w, c) for i, (w, c) in enumerate(weights)]
        return cosine(ref, numpy_mlp(feeds["x"], changed, False))

    alone = {row["weight"]: row["cosine"] for row in report["sensitivity"]}
    assert alone.keys() == {"coef_0", "coef_1"}
    for layer in (0, 1):
        assert alone[f"coef_{layer}"] == pytest.approx(rounded_only(layer), abs=1e-6)
    together = cosine(ref, numpy_mlp(feeds["x"], weights, True))
    assert report["weights_together"] == pytest.approx(together, abs=1e-6)
    assert together < 0.9999999  # the premise: the rounding alone is below the threshold
    assert f"all the quantized weights' rounding together (activations float): cosine {together:.6f}" in err
    assert "none found" not in err and "coef_0 (alone: cosine" in err
