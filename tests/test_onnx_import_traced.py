"""An imported model called inside another module's traced ``forward``: its graph is inlined
into the trace and computes as the original file does.

Oracles: plain ONNX Runtime on the original file, then the enclosing forward's own op in numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

import onnxparam as op
from onnxparam.core.errors import TraceError

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).parent / "data" / "onnx"


def _plain(model, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    data = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _silero_feeds(batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"input": (rng.normal(size=(batch, 512)) * 0.1).astype(np.float32),
            "state": (rng.normal(size=(2, batch, 128)) * 0.1).astype(np.float32),
            "sr": np.array(16000, np.int64)}


class ScaledVad(op.Module):
    onnx_opset_imports = {"": 16}  # the imported graph's opset

    def __init__(self, vad):
        self.vad = vad

    def forward(self, x, state, sr):
        out, new_state = self.vad(x, state, sr)
        return out * 2.0, new_state


def test_silero_fp32_inside_a_traced_forward_computes_as_plain_onnx_runtime_on_the_file(tmp_path):
    # the file's If branches are valid only while the input dims stay unknown: plain ONNX
    # Runtime refuses the file itself once `input` is declared [1, 512]
    path = DATA / "silero_vad.onnx"
    module = ScaledVad(op.import_onnx(path))
    for batch in (1, 3):
        feeds = _silero_feeds(batch, seed=batch)
        want = _plain(path, feeds)
        got = module(*(op.Tensor.from_numpy(feeds[k]) for k in ("input", "state", "sr")))
        np.testing.assert_allclose(got[0].to_numpy(), 2.0 * want[0], rtol=1e-6)
        np.testing.assert_allclose(got[1].to_numpy(), want[1], rtol=1e-6, atol=1e-7)
    feeds = _silero_feeds(1)
    exported = op.export_onnx(module, tmp_path / "scaled.onnx",
                              *(op.Tensor.from_numpy(feeds[k]) for k in ("input", "state", "sr")))
    names = [i.name for i in onnx.load(str(exported)).graph.input]
    got = _plain(exported, dict(zip(names, (feeds[k] for k in ("input", "state", "sr")), strict=True)))
    want = _plain(path, feeds)
    np.testing.assert_allclose(got[0], 2.0 * want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-7)


SEQUENCES_AND_STRINGS = """
<ir_version: 8, opset_import: ["" : 17]>
agraph (float[N, 3] x) => (float[M, 3] y, float[N, 3] z, string[N, 3] t) {
    s = SequenceConstruct(x, x)
    y = ConcatFromSequence<axis = 0>(s)
    t = Cast<to = 8>(x)
    z = Cast<to = 1>(t)
}
"""


class Around(op.Module):
    onnx_opset_imports = {"": 17}

    def __init__(self, inner):
        self.inner = inner

    def forward(self, x):
        y, z, *text = self.inner(x)
        return (y + 1.0, z * 2.0, *text)


def test_an_imported_graph_with_sequence_and_string_values_inside_a_traced_forward_computes_as_the_file():
    model = onnx.parser.parse_model(SEQUENCES_AND_STRINGS)
    onnx.checker.check_model(model, full_check=True)
    x = (np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5) / 3.0
    want = _plain(model, {"x": x})
    got = Around(op.import_onnx(model))(op.Tensor.from_numpy(x))
    np.testing.assert_array_equal(got[0].to_numpy(), want[0] + np.float32(1.0))
    np.testing.assert_array_equal(got[1].to_numpy(), want[1] * np.float32(2.0))
    assert got[2].dtype is op.DType.String and got[2].to_numpy().tolist() == want[2].tolist()  # a string tensor


def test_a_sequence_output_of_an_imported_graph_inside_a_traced_forward_is_refused_naming_it():
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    agraph (float[N, 3] x) => (seq(float[N, 3]) s) {
        s = SequenceConstruct(x, x)
    }
    """)
    module = Around(op.import_onnx(model))
    with pytest.raises(TraceError, match=r"output 's' of the imported ONNX graph is a Sequence.*a traced forward can "
                                         r"pass on tensors only"):
        module(op.Tensor.from_numpy(np.ones((2, 3), np.float32)))


def test_an_imported_output_of_unknown_rank_flows_on_and_only_reading_its_shape_raises_naming_it(tmp_path):
    # a Loop state: ONNX's Loop inference drops its shape and the file declares none
    body = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         onnx.helper.make_node("Add", ["acc_in", "acc_in"], ["acc_out"])], "body",
        [onnx.helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         onnx.helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         onnx.helper.make_tensor_value_info("acc_in", onnx.TensorProto.FLOAT, None)],
        [onnx.helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         onnx.helper.make_tensor_value_info("acc_out", onnx.TensorProto.FLOAT, None)])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body)], "doubling",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.array(3, np.int64), "trips")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    seen = {}

    class Plus(op.Module):
        onnx_opset_imports = {"": 17}

        def __init__(self, inner):
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            try:
                y.shape
            except TraceError as e:
                seen["error"] = str(e)
            return y + 1.0

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = _plain(model, {"x": x})[0] + np.float32(1.0)
    # a symbolic batch: no probe run gives the Loop state's rank
    exported = op.export_onnx(Plus(op.import_onnx(model)), tmp_path / "plus.onnx", op.Tensor.from_numpy(x),
                              dynamic_axes={"x": {0: "batch"}})
    assert "the rank of traced value" in seen["error"] and "(output of Loop node" in seen["error"]
    name = onnx.load(str(exported)).graph.input[0].name
    np.testing.assert_array_equal(_plain(exported, {name: x})[0], want)
