"""Converting a quantized ONNX file keeps every quantized weight, as QFloat with its scale.

The oracle is the file itself, read with the ``onnx`` package: each integer weight's codes times
the scale initializer beside it (the DequantizeLinear formula of the ONNX operator spec,
``y = (x - zero_point) * scale``, and the ``MatMulInteger -> Cast -> Mul(scale)`` form), and plain
ONNX Runtime running the original file.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from quantized_files import Mlp, exact_options, initializers

import onnxparam as op
from onnxparam import burnpack, convert
from onnxparam.core.errors import RecordError
from onnxparam.quant import quantize_activations

RNG = np.random.default_rng(7)


def dequantized(path) -> dict:
    """Every entry of a converted file, QFloat ones dequantized."""
    return {name: snap.to_tensor().to_numpy() for name, snap in convert.read_record(path).items()}


def test_the_library_s_own_int8_export_converts_to_burnpack_with_every_weight_and_its_scale(tmp_path):
    x = op.Tensor.from_numpy(RNG.normal(size=(8, 16)).astype(np.float32))
    q8 = Mlp().quantize_weights(op.Quantizer(op.QuantScheme(value=op.QuantValue.Q8S)))
    op.export_onnx(q8, tmp_path / "mlp-int8.onnx", x)
    raw = initializers(tmp_path / "mlp-int8.onnx")
    assert raw["fc1.weight"].dtype == np.uint8  # the file holds codes (+ 128, zero point 128), not floats

    report = convert.convert(tmp_path / "mlp-int8.onnx", tmp_path / "mlp.bpk")

    assert sorted(report.tensors) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"] and not report.skipped
    with burnpack.read(tmp_path / "mlp.bpk") as stored:
        dtypes = {name: entry.dtype for name, entry in stored.tensors.items()}
    assert dtypes == {
        "fc1.weight": op.DType.QFloat, "fc1.bias": op.DType.F32, "fc2.weight": op.DType.QFloat, "fc2.bias": op.DType.F32}
    values = dequantized(tmp_path / "mlp.bpk")
    for name in ("fc1.weight", "fc2.weight"):
        expected = (raw[name].astype(np.float32) - raw[name + "_zero_point"]) * raw[name + "_scale"]
        np.testing.assert_array_equal(values[name], expected)
    np.testing.assert_array_equal(values["fc1.bias"], raw["fc1.bias"])


def test_a_dequantize_linear_graph_nobody_here_wrote_converts_with_its_codes_and_scales(tmp_path):
    codes = RNG.integers(-127, 128, size=(6, 5)).astype(np.int8)
    scale = np.float32(0.031)
    bias = RNG.normal(size=(5,)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"]),
         helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("Add", ["h", "b"], ["y"])],
        "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [numpy_helper.from_array(codes, "w_q"), numpy_helper.from_array(scale, "w_scale"),
         numpy_helper.from_array(bias, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "qdq.onnx")

    convert.convert(tmp_path / "qdq.onnx", tmp_path / "qdq.bpk")

    values = dequantized(tmp_path / "qdq.bpk")
    assert set(values) == {"w_q", "b"}
    np.testing.assert_array_equal(values["w_q"], codes.astype(np.float32) * scale)
    # the record loads into the module imported from the same file, which then computes what
    # plain ONNX Runtime computes on the original by the ONNX semantics (graph optimizations off:
    # ORT's QDQ fusion would also quantize x, an approximation the graph does not ask for)
    x = RNG.normal(size=(2, 6)).astype(np.float32)
    expected = ort.InferenceSession(str(tmp_path / "qdq.onnx"), exact_options()).run(None, {"x": x})[0]
    module = op.import_onnx(tmp_path / "qdq.onnx").load_file(tmp_path / "qdq.bpk")
    np.testing.assert_allclose(module(x).to_numpy(), expected, rtol=1e-6, atol=1e-6)


def test_a_dtype_mismatch_names_the_function_that_takes_cast(tmp_path):
    net = Mlp()
    half = {path: param.val().to_numpy().astype(np.float16) for path, param in net.named_params()}

    with pytest.raises(RecordError) as info:
        convert.apply_record(Mlp(), half)

    message = str(info.value)
    assert "the module expects F32" in message and "F16" in message
    assert "apply_record(module, record, cast='module')" in message
    loaded = convert.apply_record(Mlp(), half, cast="module")  # and the hint works
    np.testing.assert_array_equal(loaded.fc1.weight.val().to_numpy(), half["fc1.weight"].astype(np.float32))


def test_asymmetric_uint8_codes_burn_cannot_hold_convert_as_codes_scale_and_zero_point(tmp_path):
    codes = RNG.integers(0, 256, size=(6, 5)).astype(np.uint8)
    scale, zero_point = np.float32(0.02), np.uint8(131)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"]),
         helper.make_node("MatMul", ["x", "w"], ["y"])],
        "u8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [numpy_helper.from_array(codes, "w_q"), numpy_helper.from_array(scale, "w_scale"),
         numpy_helper.from_array(zero_point, "w_zp")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "u8.onnx")

    convert.convert(tmp_path / "u8.onnx", tmp_path / "u8.bpk")
    convert.convert(tmp_path / "u8.bpk", tmp_path / "back.onnx", graph=tmp_path / "u8.onnx")

    values = dequantized(tmp_path / "u8.bpk")
    np.testing.assert_array_equal(values["w_q"], codes)
    assert values["w_scale"] == scale and values["w_zp"] == zero_point
    assert {n: a.tobytes() for n, a in initializers(tmp_path / "back.onnx").items()} == {
        n: a.tobytes() for n, a in initializers(tmp_path / "u8.onnx").items()}
    x = RNG.normal(size=(2, 6)).astype(np.float32)
    expected = x @ ((codes.astype(np.float32) - np.float32(zero_point)) * scale)  # ONNX spec: DequantizeLinear
    got = ort.InferenceSession(str(tmp_path / "back.onnx"), exact_options()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_per_channel_conv_over_255_input_channels_this_library_wrote_imports_and_converts_as_codes_and_scales(
        tmp_path):
    # the weight's per-channel block [1, 256, 1, 1] is over Burn's 255: it stays ONNX per-axis
    w = RNG.normal(size=(64, 256, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 256, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "wide.onnx")
    model = op.import_onnx(tmp_path / "wide.onnx").quantize_weights(op.Quantizer(per_channel=True))
    x = RNG.normal(size=(2, 256, 4, 4)).astype(np.float32)
    op.export_onnx(quantize_activations(model, x), tmp_path / "q.onnx")  # `quantize --calibrate --per-channel`
    raw = initializers(tmp_path / "q.onnx")
    codes, scale, zero_point = raw["w"], raw["w_scale"], raw["w_zero_point"]
    # a QLinearConv weight: uint8 codes + 128 with zero point 128 (ORT's u8 x s8 kernels saturate without VNNI)
    assert codes.dtype == np.uint8 and scale.shape == (64,) and np.all(zero_point == 128)

    imported = op.import_onnx(tmp_path / "q.onnx")
    # the oracle is plain ONNX Runtime with its default options, as module(x) runs the file (ORT fuses
    # this QDQ Conv into QLinearConv)
    expected = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(imported(op.Tensor.from_numpy(x)).to_numpy(), expected, rtol=1e-5, atol=1e-5)

    convert.convert(tmp_path / "q.onnx", tmp_path / "q.bpk")
    values = dequantized(tmp_path / "q.bpk")
    # Burn cannot hold the scale grid: codes, scales and zero points
    np.testing.assert_array_equal(values["w"], codes)
    np.testing.assert_array_equal(values["w_zero_point"], zero_point)
    def per_channel(v):
        return v.reshape(64, 1, 1, 1)

    np.testing.assert_array_equal(
        (values["w"].astype(np.float32) - per_channel(values["w_zero_point"])) * per_channel(values["w_scale"]),
        (codes.astype(np.float32) - per_channel(zero_point)) * per_channel(scale))
