"""``onnxparam quantize``'s accuracy report on a token-id model as torch dynamo writes GPT-2
(fresh7 F7): the ids reach the embedding ``Gather`` through a ``Reshape`` (dynamo's ``view``)
and the input declares a static batch ``[2, 7]``. The drawn ids must index the table (they
were drawn in [0, 256) for a 50-row table) and keep the declared batch (a retry cut it to 1),
so the report is measured instead of skipped.

Oracles: the ONNX spec's Gather index range ``[-rows, rows - 1]`` and the declared input
shape; plain ONNX Runtime running the float and quantized files on the report's inputs (the
cosine it prints is recomputed from those outputs).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnxruntime as ort
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxparam.cli import main

RNG = np.random.default_rng(17)
ROWS = 50


def _gpt2_like(path):
    table = RNG.normal(size=(ROWS, 16)).astype(np.float32)
    w = RNG.normal(size=(16, 64)).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["ids", "shape"], ["view"]),
             helper.make_node("Gather", ["table", "view"], ["emb"], name="node_embedding"),
             helper.make_node("MatMul", ["emb", "w"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 7])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 7, 64])],
                              [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w"),
                               numpy_helper.from_array(np.array([-1, 7], np.int64), "shape")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_ids_reaching_the_embedding_through_a_reshape_are_drawn_in_its_rows_at_the_declared_batch(tmp_path, capsys):
    from onnxparam.quant._accuracy import sample_inputs

    src, dst = tmp_path / "gpt2.onnx", tmp_path / "q.onnx"
    _gpt2_like(src)
    feeds, described = sample_inputs(src)
    ids = feeds["ids"]
    assert ids.shape == (2, 7) and ids.dtype == np.int64  # as declared
    assert ids.min() >= 0 and ids.max() < ROWS and len(np.unique(ids)) > 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "accuracy not measured" would be a QuantizationWarning
        code = main(["quantize", str(src), str(dst), "--scheme", "q8s", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)["results"]["accuracy"]
    assert report["inputs"] == described and described.startswith("2 inputs drawn")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(str(dst), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    a, b = ref.ravel().astype(np.float64), got.ravel().astype(np.float64)
    (row,) = report["outputs"]
    assert abs(row["cosine"] - float(a @ b / np.sqrt((a @ a) * (b @ b)))) < 1e-6


def test_a_model_taking_one_sample_at_a_time_is_measured_on_the_first_sample(tmp_path, capsys):
    # x declared ["n", 16] but reshaped to [1, 16]: only n = 1 runs (ONNX Reshape's element count)
    w = RNG.normal(size=(16, 64)).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["row"]), helper.make_node("MatMul", ["row", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([1, 16], np.int64), "shape")])
    src, dst = tmp_path / "one.onnx", tmp_path / "q.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    code = main(["quantize", str(src), str(dst), "--scheme", "q8s", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)["results"]["accuracy"]
    assert report["inputs"].endswith("of which the first only (the model takes one sample at a time)")
    assert report["outputs"][0]["cosine"] > 0.99
