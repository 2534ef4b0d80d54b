"""Issue 27: quantization changes only weights, shows its error, and is never bigger by default
(onnxparam.quant._roles, onnxparam.quant._module.quantize_weights, onnxparam.quant._accuracy,
onnxparam.cli.quantize).

Oracles: ONNX Runtime's own ``quantize_dynamic`` on the same float file (which initializers it
quantizes: the MatMul weights, not the arithmetic constants), the float file's initializer
bytes, numpy's dynamic int8 MatMul (ONNX operator spec of ``DynamicQuantizeLinear`` /
``MatMulInteger``) on the float model's own features, plain ONNX Runtime on the float and
quantized files with cosine / max abs error computed here in numpy, numpy's symmetric int8
formula (``round(w / s) * s``, ``s = max|w| / 127``), and ``os.stat``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from quantized_files import sklearn_mlp

from onnxparam.cli import main
from onnxparam.onnx_io import import_onnx
from onnxparam.quant import Quantizer

RNG = np.random.default_rng(27)


def run_main(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def session(path):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def initializers(path) -> dict:
    return {t.name: t for t in onnx.load(str(path)).graph.initializer}


def metadata(path) -> dict:
    props = onnx.load(str(path)).metadata_props
    return {p.key: json.loads(p.value) for p in props
            if p.key.startswith("onnxparam.quant.") and p.key != "onnxparam.quant.ops"}


# -- a detector exported from torch ---------------------------------------------------------------


def detector(path):
    """An SSD-like head: input normalisation (``Sub`` mean, ``Div`` std), a Conv, box deltas from a
    Linear plus anchors through ``Expand`` + ``Add``, class logits from a Linear; TorchScript export."""
    torch = pytest.importorskip("torch")

    class Det(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
            self.conv = torch.nn.Conv2d(3, 64, 3, stride=2, padding=1)
            self.head = torch.nn.Linear(64, 64)
            self.cls = torch.nn.Linear(64, 91)
            self.register_buffer("anchors", torch.rand(64, 4, generator=g) * 300)

        def forward(self, x):
            x = (x - self.mean) / self.std
            f = torch.relu(self.conv(x)).flatten(2).transpose(1, 2)
            boxes = self.head(f)[..., :4] + self.anchors.expand(f.shape[0], 64, 4)
            return boxes, self.cls(f)

    torch.manual_seed(0)
    with warnings.catch_warnings(), contextlib.redirect_stdout(None):
        warnings.simplefilter("ignore")
        torch.onnx.export(Det().eval(), (torch.rand(2, 3, 16, 16),), str(path), input_names=["image"],
                          output_names=["boxes", "logits"], dynamic_axes={"image": {0: "batch"}}, dynamo=False,
                          opset_version=17)
    return path


@pytest.fixture(scope="module")
def det(tmp_path_factory):
    return detector(tmp_path_factory.mktemp("det") / "det.onnx")


INTEGER_KERNEL_CODES = (TensorProto.INT8, TensorProto.UINT8)
"""A weight read by an integer kernel: int8 codes, or uint8 ``code + 128`` with zero point 128."""

NON_WEIGHTS = ("mean", "std", "anchors", "conv.bias", "head.bias", "cls.bias")


def numpy_dynamic_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` as ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` computes it (ONNX
    operator spec): x to uint8 with ``scale = (max(x, 0) - min(x, 0)) / 255``, zero point
    ``round(-min / scale)`` (ties to even); w symmetric int8 per tensor (``max|w| / 127``, Burn's
    rounding half away from zero); int64 sums, then one float32 product with both scales."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    xs = np.float32((hi - lo) / 255)
    xz = np.clip(np.rint(-lo / xs), 0, 255)
    xq = np.clip(np.rint(x / xs) + xz, 0, 255).astype(np.int64) - int(xz)
    ws = np.float32(np.abs(w).max() / np.float32(127))
    wq = (np.sign(w / ws) * np.floor(np.abs(w / ws) + 0.5)).astype(np.int64)
    return (xq @ wq).astype(np.float32) * np.float32(xs * ws)


def test_default_quantization_of_a_detector_keeps_non_weights_bit_exact_and_boxes_within_weight_noise(
        det, tmp_path, capsys):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", det, out)
    assert code == 0, err
    src, written = initializers(det), initializers(out)
    for name in NON_WEIGHTS + ("conv.weight",):  # the Conv weight is written float (prefer speed)
        assert written[name].data_type == TensorProto.FLOAT, name
        assert numpy_helper.to_array(written[name]).tobytes() == numpy_helper.to_array(src[name]).tobytes(), name
    for name in ("mean", "std", "anchors"):
        assert f"{name} is float: a constant feeding arithmetic" in stdout
    matmul_weights = sorted(n for n in src if n.startswith("onnx::MatMul"))
    assert len(matmul_weights) == 2 and "2 MatMul dynamic int8" in stdout

    # ONNX Runtime's own quantizer agrees on what is a weight: it quantizes exactly these two
    reference = tmp_path / "ort.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(str(det), str(reference), op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
    ort_quantized = sorted(t.name[:-len("_quantized")] for t in onnx.load(str(reference)).graph.initializer
                           if t.name.endswith("_quantized"))
    assert ort_quantized == matmul_weights

    # oracle for the boxes: numpy's int8 dynamic MatMul on the float model's own features, plus
    # the float bias and the float anchors (the noise of the two weights and the activation alone)
    model = onnx.load(str(det))
    head = next(n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] == matmul_weights[0])
    model.graph.output.append(helper.make_tensor_value_info(head.input[0], TensorProto.FLOAT, None))
    x = RNG.random((4, 3, 16, 16), dtype=np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    float_boxes, _, features = sess.run(None, {"image": x})
    w = numpy_helper.to_array(src[matmul_weights[0]])
    expected = (numpy_dynamic_matmul(features, w) + numpy_helper.to_array(src["head.bias"]))[..., :4]
    expected = expected + numpy_helper.to_array(src["anchors"])
    boxes = session(out).run(None, {"image": x})[0]
    np.testing.assert_allclose(boxes, expected, rtol=1e-5, atol=1e-3)
    assert np.abs(boxes - float_boxes).max() < 0.1  # far below a pixel (the issue: 280 px)

    # --include names the anchors: now they are quantized (int8 per tensor: up to max/254 off)
    code, stdout, err = run_main(capsys, "quantize", det, out, "--include", r"^anchors$|MatMul")
    assert code == 0, err
    assert initializers(out)["anchors"].data_type == TensorProto.INT8
    anchors = numpy_helper.to_array(src["anchors"])
    moved = np.abs(session(out).run(None, {"image": x})[0] - float_boxes).max()
    assert moved > 0.1 and moved <= np.abs(anchors).max() / 254 + 0.1


# -- biases, position embeddings, class tokens ------------------------------------------------------


def vit_like(path):
    """Patch tokens ``x [n, 16, 128]`` -> concat a class token ``[1, 1, 128]`` (``Expand`` +
    ``Concat``) -> add a position embedding ``[1, 17, 128]`` -> ``LayerNormalization`` (scale,
    shift ``[128]``) -> ``MatMul`` ``[128, 256]`` + 2-D bias ``[1, 256]``."""
    d, n = 128, 16
    inits = {"cls_token": RNG.normal(size=(1, 1, d)), "pos_embed": RNG.normal(size=(1, n + 1, d)) * 0.02,
             "ln_scale": 1 + RNG.normal(size=(d,)) * 0.1, "ln_shift": RNG.normal(size=(d,)) * 0.1,
             "fc_w": RNG.normal(size=(d, 256)) * 0.1, "fc_b": RNG.normal(size=(1, 256)) * 0.1}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
    inits.append(numpy_helper.from_array(np.array([1, 1, d], np.int64), "cls_shape"))
    nodes = [helper.make_node("Shape", ["x"], ["xs"], start=0, end=1),
             helper.make_node("Concat", ["xs", "one_d"], ["cls_dims"], axis=0),
             helper.make_node("Expand", ["cls_token", "cls_dims"], ["cls"]),
             helper.make_node("Concat", ["cls", "x"], ["tokens"], axis=1),
             helper.make_node("Add", ["tokens", "pos_embed"], ["t"], name="add_pos"),
             helper.make_node("LayerNormalization", ["t", "ln_scale", "ln_shift"], ["h"], axis=-1),
             helper.make_node("MatMul", ["h", "fc_w"], ["m"], name="fc"),
             helper.make_node("Add", ["m", "fc_b"], ["y"], name="fc_bias")]
    inits.append(numpy_helper.from_array(np.array([1, d], np.int64), "one_d"))
    graph = helper.make_graph(nodes, "vit", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", n, d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", n + 1, 256])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_biases_position_embeddings_and_class_tokens_stay_float_by_default_and_include_quantizes_them(
        tmp_path, capsys):
    src = vit_like(tmp_path / "vit.onnx")
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--json")
    assert code == 0, err
    doc = json.loads(stdout)["results"]
    original, written = initializers(src), initializers(out)
    kept = {r["weight"]: r["reason"] for r in doc["kept_float"]}
    for name in ("cls_token", "pos_embed", "fc_b"):
        assert written[name].data_type == TensorProto.FLOAT, name
        assert numpy_helper.to_array(written[name]).tobytes() == numpy_helper.to_array(original[name]).tobytes()
        assert f"--include '^{name}$' quantizes it" in kept[name]
    for name in ("ln_scale", "ln_shift"):  # rank 1, never candidates; still exact
        assert numpy_helper.to_array(written[name]).tobytes() == numpy_helper.to_array(original[name]).tobytes()
    assert "a bias or offset" in kept["fc_b"] and "Add 'fc_bias'" in kept["fc_b"]
    assert "Add 'add_pos'" in kept["pos_embed"] and "Expand" in kept["cls_token"]
    assert written["fc_w"].data_type in INTEGER_KERNEL_CODES
    assert metadata(out)["onnxparam.quant.kept_float"] == doc["kept_float"]

    code, stdout, err = run_main(capsys, "quantize", src, out, "--include", "^(cls_token|pos_embed|fc_b|fc_w)$")
    assert code == 0, err
    written = initializers(out)
    for name in ("cls_token", "pos_embed", "fc_b"):
        assert written[name].data_type == TensorProto.INT8, name
    assert written["fc_w"].data_type in INTEGER_KERNEL_CODES
    # the 2-D bias now carries int8 rounding: numpy's symmetric formula gives what the file dequantizes to
    b = numpy_helper.to_array(original["fc_b"])
    scale = np.abs(b).max() / np.float32(127)
    codes = numpy_helper.to_array(written["fc_b"]).astype(np.float32)
    np.testing.assert_allclose(codes * scale, b, atol=float(scale) / 2 + 1e-7)


def test_module_quantize_weights_on_an_imported_graph_decides_with_the_graph(tmp_path):
    """API: an embedding ``Gather`` (indices from the input) is a weight; a position table read
    through ``Gather(Range(Shape(ids)))`` and a ``-inf`` causal mask feeding ``Add`` are not."""
    from onnxparam.quant._module import kept_float

    vocab, d, t = 100, 32, 8
    mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)[None, None]
    inits = [numpy_helper.from_array(RNG.normal(size=(vocab, d)).astype(np.float32), "tok_embed"),
             numpy_helper.from_array(RNG.normal(size=(t, d)).astype(np.float32), "pos_table"),
             numpy_helper.from_array(mask, "mask"),
             numpy_helper.from_array(RNG.normal(size=(d, d)).astype(np.float32), "w_q"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "axis1")]
    nodes = [helper.make_node("Gather", ["tok_embed", "ids"], ["tok"]),
             helper.make_node("Shape", ["ids"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["len"]),
             helper.make_node("Range", ["zero", "len", "one"], ["pos"]),
             helper.make_node("Gather", ["pos_table", "pos"], ["p"], name="pos_gather"),
             helper.make_node("Add", ["tok", "p"], ["h"]),
             helper.make_node("MatMul", ["h", "w_q"], ["q"]),
             helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "qt"], ["s"]),
             helper.make_node("Unsqueeze", ["s", "axis1"], ["s4"]),
             helper.make_node("Add", ["s4", "mask"], ["y"], name="mask_add")]
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", t])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, t, t])], inits)
    src = tmp_path / "lm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    quantized = import_onnx(src).quantize_weights(Quantizer())
    dtypes = {path: param.lazy_dtype().name for path, param in quantized.named_params()}
    assert dtypes["tok_embed"] == dtypes["w_q"] == "QFloat"
    assert dtypes["pos_table"] == dtypes["mask"] == "F32"
    kept = kept_float(quantized)
    assert "a table read by position" in kept["pos_table"] and "pos_gather" in kept["pos_table"]
    assert "Add 'mask_add'" in kept["mask"]
    ids = RNG.integers(0, vocab, size=(2, t))
    y = quantized(ids).to_numpy()  # the -inf mask blocks nothing: it is not a weight
    assert np.isneginf(y[..., 0, 1]).all() and np.isfinite(np.diagonal(y, axis1=-2, axis2=-1)).all()


def test_a_non_finite_tensor_asked_for_explicitly_says_exclude_works(tmp_path, capsys):
    mask = np.triu(np.full((64, 64), -np.inf, np.float32), 1)
    inits = [numpy_helper.from_array(mask, "mask"),
             numpy_helper.from_array(RNG.normal(size=(64, 64)).astype(np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "mask"], ["y"])]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])], inits)
    src = tmp_path / "mask.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "q.onnx"
    code, _, err = run_main(capsys, "quantize", src, out)
    assert code == 0, err  # by default the mask is no weight
    assert numpy_helper.to_array(initializers(out)["mask"]).tobytes() == mask.tobytes()
    os.remove(out)
    code, _, err = run_main(capsys, "quantize", src, out, "--include", ".")
    assert code == 1 and "infinite element(s)" in err and "--exclude '^mask$'" in err and not out.exists()


# -- never bigger -------------------------------------------------------------------------------


def mlp(path, sizes: tuple):
    """What a scikit-learn MLPClassifier converts to: ``MatMul`` + ``Add`` intercept (``[1, n]``)
    + ``Relu`` per hidden layer, then ``Softmax``."""
    return sklearn_mlp(path, sizes, np.random.default_rng(len(sizes)), intercept_rows=True)[0]


def test_a_tiny_mlp_is_not_made_bigger(tmp_path, capsys):
    src = mlp(tmp_path / "tiny.onnx", (4, 10, 3))  # iris-sized: 40 + 30 weights
    out = tmp_path / "q.onnx"
    code, _, err = run_main(capsys, "quantize", src, out)
    # nothing is worth quantizing: refused with the reason, no file (so nothing bigger)
    assert code == 1 and not out.exists(), err
    assert "coef_0: not smaller quantized" in err and "nothing was written" in err
    assert "intercept_0: a bias or offset" in err


def test_a_larger_mlp_gets_smaller_and_its_intercepts_stay_exact(tmp_path, capsys):
    src = mlp(tmp_path / "mlp.onnx", (64, 256, 10))
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out)
    assert code == 0, err
    assert os.stat(out).st_size < 0.5 * os.stat(src).st_size
    original, written = initializers(src), initializers(out)
    assert written["coef_0"].data_type in INTEGER_KERNEL_CODES
    for name in ("intercept_0", "intercept_1"):
        assert numpy_helper.to_array(written[name]).tobytes() == numpy_helper.to_array(original[name]).tobytes()


# -- the accuracy report ---------------------------------------------------------------------------


def numpy_report(float_path, quant_path, feeds: dict) -> list:
    ref = session(float_path).run(None, feeds)
    got = session(quant_path).run(None, feeds)
    rows = []
    for a, b in zip(ref, got):
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        rows.append((float(a @ b / np.sqrt((a @ a) * (b @ b))), float(np.abs(a - b).max())))
    return rows


def test_the_accuracy_report_equals_numpy_on_the_two_files_run_in_plain_ort(tmp_path, capsys):
    src = mlp(tmp_path / "mlp.onnx", (64, 256, 10))
    x = RNG.normal(size=(20, 64)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--calibrate", tmp_path / "calib.npz", "--json")
    assert code == 0, err
    report = json.loads(stdout)["results"]["accuracy"]
    assert report["inputs"] == "the first 8 calibration samples" and report["min_cosine"] == 0.999
    (cosine, max_err), = numpy_report(src, out, {"x": x[:8]})
    (row,) = report["outputs"]
    assert row["output"] == "probabilities"
    assert row["cosine"] == pytest.approx(cosine, abs=1e-12)
    assert row["max_abs_error"] == pytest.approx(max_err, abs=1e-12)
    assert metadata(out)["onnxparam.quant.accuracy"] == report

    # drawn inputs when no calibration data: the numbers are still those of the two files
    code, stdout, err = run_main(capsys, "quantize", src, out, "--json")
    assert code == 0, err
    report = json.loads(stdout)["results"]["accuracy"]
    assert "drawn from the declared types and shapes (seed 0)" in report["inputs"]
    assert 0.99 < report["outputs"][0]["cosine"] <= 1.0 + 1e-12


def test_below_min_cosine_warns_naming_the_weights_that_move_outputs_most_and_strict_refuses(tmp_path, capsys):
    src = mlp(tmp_path / "mlp.onnx", (64, 256, 256, 10))
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--scheme", "q4s", "--block-size", "32,1",
                                 "--min-cosine", "0.9999999")
    assert code == 0, err
    assert "below --min-cosine 0.9999999" in err and "the quantized weights that move the outputs most: coef_" in err
    assert "alone: cosine" in err and out.exists()
    os.remove(out)
    code, stdout, err = run_main(capsys, "quantize", src, out, "--min-cosine", "0.9999999", "--strict")
    assert code == 1 and "--strict" in err and "nothing was written" in err and not out.exists()


def test_an_embedding_table_is_gathered_as_int8_and_only_the_rows_are_dequantized(tmp_path, capsys):
    """``quantize_dynamic``'s Gather form: ``DequantizeLinear(Gather(int8 table, ids))``; the
    values are numpy's ``codes[ids] * scale`` exactly."""
    table = RNG.normal(size=(1000, 64)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gather", ["tok_embed", "ids"], ["y"], name="embed")], "e",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", "s"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "s", 64])],
                              [numpy_helper.from_array(table, "tok_embed")])
    src = tmp_path / "embed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out)
    assert code == 0, err
    assert "Gather  tok_embed  int8 gather" in stdout
    written = onnx.load(str(out))
    codes = numpy_helper.to_array({t.name: t for t in written.graph.initializer}["tok_embed"])
    assert codes.dtype == np.int8
    producers = {o: n for n in written.graph.node for o in n.output}
    (dq,) = [n for n in written.graph.node if n.op_type == "DequantizeLinear"]
    assert producers[dq.input[0]].op_type == "Gather" and producers[dq.input[0]].input[0] == "tok_embed"
    ids = RNG.integers(0, 1000, size=(2, 5))
    scale = np.abs(table).max() / np.float32(127)
    expected = codes[ids].astype(np.float32) * np.float32(scale)
    got = session(out).run(None, {"ids": ids})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    np.testing.assert_allclose(got, table[ids], atol=float(scale) / 2 * 1.0001)


def test_an_output_not_smaller_than_its_input_is_a_warning_naming_why(tmp_path, capsys):
    """One MatMul weight worth quantizing among many small constants: the codes save less than
    the written form costs, and the command says so (the file is still written)."""
    inits = [numpy_helper.from_array(RNG.normal(size=(64, 24)).astype(np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h0"])]
    for i in range(60):  # small per-position offsets: no weights, kept float
        inits.append(numpy_helper.from_array(RNG.normal(size=(1, 24)).astype(np.float32), f"offset_{i}"))
        nodes.append(helper.make_node("Add", [f"h{i}", f"offset_{i}"], [f"h{i + 1}"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("h60", TensorProto.FLOAT, ["n", 24])], inits)
    src = tmp_path / "offsets.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out)
    assert code == 0, err
    out_bytes, in_bytes = os.stat(out).st_size, os.stat(src).st_size
    assert out_bytes >= in_bytes  # the premise: the written form costs more than the codes save
    assert f"the output ({out_bytes:,} bytes) is not smaller than the input ({in_bytes:,} bytes)" in err
    assert "only 1 param(s) were quantized (60 not weights stayed float)" in err


def test_a_low_cosine_the_weights_alone_do_not_explain_is_put_on_the_integer_kernels(tmp_path, capsys, monkeypatch):
    """The one-at-a-time weights each keep the outputs near 1.0 while the file does not: the
    warning says the integer kernels (not the rounding of any weight) moved them. The file's
    outputs are made far off by replacing the comparison (the oracle of the trigger is the
    numbers the warning quotes)."""
    from onnxparam.quant import _accuracy

    src = mlp(tmp_path / "mlp.onnx", (64, 256, 10))
    real = _accuracy.compare

    def skewed(float_path, quant_path, feeds, **kwargs):
        return [{**row, "cosine": 0.9} for row in real(float_path, quant_path, feeds, **kwargs)]

    monkeypatch.setattr(_accuracy, "compare", skewed)
    code, _, err = run_main(capsys, "quantize", src, tmp_path / "q.onnx")
    assert code == 0, err
    assert "cosine 0.900000 below --min-cosine 0.999" in err
    alone = [float(c) for c in re.findall(r"alone: cosine ([0-9.]+)", err)]
    assert alone and min(alone) > 0.975  # each weight alone: far above 0.9
    # the written MLP's MatMuls are the dynamic int8 form: the text names the ops the file holds
    assert re.search(r"the weights' rounding alone does not explain it: "
                     r"the integer kernels \([^)]*MatMulInteger[^)]*\) do", err), err


def test_a_constant_inside_an_if_branch_is_no_weight_either(tmp_path):
    from onnxparam.quant._module import kept_float

    then_graph = helper.make_graph(
        [helper.make_node("Add", ["h", "offset"], ["o1"])], "then", [],
        [helper.make_tensor_value_info("o1", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(RNG.normal(size=(64, 64)).astype(np.float32), "offset")])
    else_graph = helper.make_graph([helper.make_node("Identity", ["h"], ["o2"])], "else", [],
                                   [helper.make_tensor_value_info("o2", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("If", ["c"], ["y"], then_branch=then_graph, else_branch=else_graph)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(RNG.normal(size=(64, 64)).astype(np.float32), "w")])
    src = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    quantized = import_onnx(src).quantize_weights(Quantizer())
    dtypes = {path: param.lazy_dtype().name for path, param in quantized.named_params()}
    assert dtypes == {"w": "QFloat", "offset": "F32"}
    assert "Add" in kept_float(quantized)["offset"]
