"""ONNX models with map types import, run like plain ONNX Runtime and export the same graph.

``onnx_ir`` reads no map type by itself; the ONNX-ML operators make and take them (``ZipMap``'s
``seq(map(int64, float))`` output, ``DictVectorizer``'s ``map`` input). The oracle is plain ONNX
Runtime on the original file, and the original file's own protobuf.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as h
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnxparam as op

LOGREG = Path(__file__).parent / "data" / "onnx" / "logreg_iris.onnx"
IRIS = np.array([[5.1, 3.5], [1.4, 0.2], [6.7, 3.0]], np.float32)


def ort_run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_logreg_iris_with_a_zipmap_output_runs_like_onnxruntime():
    ref_label, ref_probabilities = ort_run(LOGREG, {"float_input": IRIS})
    label, probabilities = op.import_onnx(LOGREG)(IRIS)
    assert label.dtype is op.DType.I64
    np.testing.assert_array_equal(label.to_numpy(), ref_label)
    assert isinstance(probabilities, list) and len(probabilities) == 3
    assert probabilities == ref_probabilities  # a list of {class: probability} dicts, exactly


def test_logreg_iris_exports_the_same_graph_and_opsets(tmp_path):
    out = tmp_path / "logreg.onnx"
    op.export_onnx(op.import_onnx(LOGREG), out)
    original, exported = onnx.load(LOGREG), onnx.load(out)
    assert exported.graph == original.graph  # the seq(map(int64, float)) output type included
    assert list(exported.opset_import) == list(original.opset_import)
    assert exported.ir_version == original.ir_version
    assert ort_run(out, {"float_input": IRIS})[1] == ort_run(LOGREG, {"float_input": IRIS})[1]


def test_logreg_iris_used_inside_a_traced_forward_names_the_map_output():
    inner = op.import_onnx(LOGREG)

    class Outer(op.Module):
        def __init__(self):
            self.inner = inner

        def forward(self, x):
            return self.inner(x)[0]

    with pytest.raises(op.TraceError, match=r"output 'probabilities' .* is a Sequence\(Map\(INT64, Tensor\(FLOAT\)\)\)"):
        Outer()(IRIS)


def _dict_vectorizer(path):
    """``map(int64, float)`` input -> ``DictVectorizer`` -> ``Mul`` by a weight (ONNX-ML spec:
    DictVectorizer-1); the map's value type declares a scalar shape, which must survive."""
    value = h.make_tensor_type_proto(TensorProto.FLOAT, [])
    graph = h.make_graph(
        [h.make_node("DictVectorizer", ["m"], ["v"], domain="ai.onnx.ml", int64_vocabulary=[1, 2, 3]),
         h.make_node("Mul", ["v", "w"], ["y"])],
        "dv", [h.make_value_info("m", h.make_map_type_proto(TensorProto.INT64, value))],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [h.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("ai.onnx.ml", 3)], ir_version=8)
    onnx.save(model, path)
    return model


def test_a_map_input_takes_a_dict_like_onnxruntime(tmp_path):
    path = tmp_path / "dv.onnx"
    _dict_vectorizer(path)
    feed = {1: 0.5, 3: 2.0}
    (ref,) = ort_run(path, {"m": feed})
    module = op.import_onnx(path)
    np.testing.assert_array_equal(module(m=feed).to_numpy(), ref)
    np.testing.assert_array_equal(module(feed).to_numpy(), np.array([[0.5, 0.0, 6.0]], np.float32))


def test_a_map_input_exports_its_declared_type_verbatim(tmp_path):
    path = tmp_path / "dv.onnx"
    original = _dict_vectorizer(path)
    out = tmp_path / "out.onnx"
    op.export_onnx(op.import_onnx(path), out)
    exported = onnx.load(out)
    assert list(exported.graph.input) == list(original.graph.input)
    assert list(exported.graph.node) == list(original.graph.node)
    assert list(exported.graph.output) == list(original.graph.output)


def test_inspect_json_gives_the_whole_declared_type_of_a_map_output(capsys):
    import json

    from onnxparam.cli import main

    assert main(["inspect", str(LOGREG), "--json"]) == 0
    outputs = {o["name"]: o for o in json.loads(capsys.readouterr().out)["info"]["outputs"]}
    declared = next(o for o in onnx.load(LOGREG).graph.output if o.name == "probabilities").type
    key = TensorProto.DataType.Name(declared.sequence_type.elem_type.map_type.key_type)
    value = TensorProto.DataType.Name(declared.sequence_type.elem_type.map_type.value_type.tensor_type.elem_type)
    assert outputs["probabilities"]["dtype"] == f"Sequence(Map({key}, Tensor({value})))"
    assert outputs["label"]["dtype"] == TensorProto.DataType.Name(onnx.load(LOGREG).graph.output[0].type.tensor_type.elem_type)
