"""A quantized ONNX file's burnpack goes back into that file as the template (``--graph``).

The oracle is the original file: its initializers, read with ``onnx.numpy_helper`` (the round
trip ``q.onnx -> q.bpk -> --graph q.onnx`` must give the same bytes), and plain ONNX Runtime
running it. A record re-quantized with a layout the template cannot hold is refused by name.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from quantized_files import Mlp, exact_options, initializers

import onnxparam as op
from onnxparam import burnpack, convert
from onnxparam.burnpack import TensorEntry
from onnxparam.core.errors import RecordError
from onnxparam.quant import quantize

RNG = np.random.default_rng(11)


def assert_same_initializers(got_path, expected_path):
    got, expected = initializers(got_path), initializers(expected_path)
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name


def run(path, feeds):
    return ort.InferenceSession(str(path), exact_options()).run(None, feeds)[0]


def round_trip(tmp_path, name) -> "tuple":
    src = tmp_path / f"{name}.onnx"
    convert.convert(src, tmp_path / f"{name}.bpk")
    convert.convert(tmp_path / f"{name}.bpk", tmp_path / f"{name}-back.onnx", graph=src)
    with burnpack.read(tmp_path / f"{name}.bpk") as stored:
        dtypes = {key: entry.dtype for key, entry in stored.tensors.items()}
    return tmp_path / f"{name}-back.onnx", dtypes


def per_axis_conv(path, zero_point: bool):
    """``Conv(x, DequantizeLinear(int8 codes [8, 3, 3, 3], scale [8], axis 0)) + bias``."""
    codes = RNG.integers(-127, 128, size=(8, 3, 3, 3)).astype(np.int8)
    scale = RNG.uniform(0.001, 0.05, size=(8,)).astype(np.float32)
    inits = [numpy_helper.from_array(codes, "w_q"), numpy_helper.from_array(scale, "w_scale"),
             numpy_helper.from_array(RNG.normal(size=(8,)).astype(np.float32), "b")]
    dq_inputs = ["w_q", "w_scale"]
    if zero_point:
        inits.append(numpy_helper.from_array(np.zeros(8, np.int8), "w_zp"))
        dq_inputs.append("w_zp")
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", dq_inputs, ["w"], axis=0),
         helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_the_library_s_own_int8_export_goes_back_into_it_byte_for_byte(tmp_path):
    x = RNG.normal(size=(8, 16)).astype(np.float32)
    q8 = Mlp().quantize_weights(op.Quantizer(op.QuantScheme(value=op.QuantValue.Q8S)))
    op.export_onnx(q8, tmp_path / "mlp.onnx", op.Tensor.from_numpy(x))  # MatMulInteger -> Cast -> Mul

    back, dtypes = round_trip(tmp_path, "mlp")

    assert dtypes["fc1.weight"] is op.DType.QFloat and dtypes["fc2.weight"] is op.DType.QFloat
    assert_same_initializers(back, tmp_path / "mlp.onnx")
    np.testing.assert_array_equal(run(back, {"x": x}), run(tmp_path / "mlp.onnx", {"x": x}))


@pytest.mark.parametrize("zero_point", [False, True])
def test_a_per_axis_dequantize_linear_conv_goes_back_into_it_byte_for_byte(tmp_path, zero_point):
    per_axis_conv(tmp_path / "conv.onnx", zero_point)
    x = RNG.normal(size=(1, 3, 6, 6)).astype(np.float32)

    back, dtypes = round_trip(tmp_path, "conv")

    assert dtypes["w_q"] is op.DType.QFloat
    assert_same_initializers(back, tmp_path / "conv.onnx")
    np.testing.assert_array_equal(run(back, {"x": x}), run(tmp_path / "conv.onnx", {"x": x}))


def test_a_blocked_dequantize_linear_matmul_goes_back_into_it_byte_for_byte(tmp_path):
    codes = RNG.integers(-127, 128, size=(8, 6)).astype(np.int8)
    scale = RNG.uniform(0.001, 0.05, size=(2, 6)).astype(np.float32)  # blocks of 4 along K (axis 0)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=0, block_size=4),
         helper.make_node("MatMul", ["x", "w"], ["y"])],
        "blocked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        [numpy_helper.from_array(codes, "w_q"), numpy_helper.from_array(scale, "w_scale")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "blocked.onnx")
    x = RNG.normal(size=(3, 8)).astype(np.float32)

    back, dtypes = round_trip(tmp_path, "blocked")

    assert dtypes["w_q"] is op.DType.QFloat
    assert_same_initializers(back, tmp_path / "blocked.onnx")
    np.testing.assert_array_equal(run(back, {"x": x}), run(tmp_path / "blocked.onnx", {"x": x}))


def test_onnx_runtime_s_quantize_static_conv_goes_back_into_it_byte_for_byte(tmp_path):
    quantization = pytest.importorskip("onnxruntime.quantization")
    w = RNG.normal(size=(4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["h"], ["y"])],
        "float", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 5])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(RNG.normal(size=(4,)).astype(np.float32), "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "float.onnx")
    samples = [{"x": RNG.normal(size=(1, 3, 5, 5)).astype(np.float32)} for _ in range(4)]

    class Reader(quantization.CalibrationDataReader):
        def __init__(self):
            self.items = iter(samples)

        def get_next(self):
            return next(self.items, None)

    quantization.quantize_static(str(tmp_path / "float.onnx"), str(tmp_path / "ort.onnx"), Reader(),
                                 quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                                 weight_type=quantization.QuantType.QInt8)

    back, dtypes = round_trip(tmp_path, "ort")

    assert op.DType.QFloat in dtypes.values()  # ORT's int8 weight is folded, not left as codes
    assert_same_initializers(back, tmp_path / "ort.onnx")
    x = samples[0]["x"]
    np.testing.assert_array_equal(run(back, {"x": x}), run(tmp_path / "ort.onnx", {"x": x}))


def test_a_weight_re_quantized_with_blocks_the_per_axis_template_cannot_hold_is_refused_by_name(tmp_path):
    per_axis_conv(tmp_path / "conv.onnx", zero_point=False)
    convert.convert(tmp_path / "conv.onnx", tmp_path / "conv.bpk")
    raw = initializers(tmp_path / "conv.onnx")
    weight = raw["w_q"].astype(np.float32) * raw["w_scale"].reshape(8, 1, 1, 1)
    # input channels rescaled so one scale per (output, input) channel pair is needed; the
    # template's DequantizeLinear has one per output channel
    scheme = op.QuantScheme(op.QuantValue.Q8S, block_size=(1, 1, 3, 3))
    requantized = quantize(weight * np.arange(1, 4, dtype=np.float32).reshape(1, 3, 1, 1), scheme)
    with burnpack.read(tmp_path / "conv.bpk") as stored:
        bias = stored.tensors["b"].to_data().to_numpy()
    burnpack.write(tmp_path / "requantized.bpk", [
        TensorEntry("w_q", op.DType.QFloat, (8, 3, 3, 3), requantized, scheme=scheme),
        TensorEntry.from_numpy("b", bias)])

    with pytest.raises(RecordError) as info:
        convert.convert(tmp_path / "requantized.bpk", tmp_path / "back.onnx", graph=tmp_path / "conv.onnx")

    message = str(info.value)
    assert "'w_q'" in message and "per-block (3, 3)" in message
    assert "DequantizeLinear per-axis (axis 0), scale [8]" in message
    assert not (tmp_path / "back.onnx").exists()


def test_a_matmul_nbits_template_weight_is_refused_by_name_not_written_as_floats(tmp_path):
    w = RNG.normal(size=(64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "f.onnx")
    q4 = op.import_onnx(tmp_path / "f.onnx").quantize_weights(op.Quantizer(op.QuantScheme(op.QuantValue.Q4S)))
    op.export_onnx(q4, tmp_path / "q4.onnx")
    assert [n.op_type for n in onnx.load(str(tmp_path / "q4.onnx")).graph.node] == ["MatMulNBits"]
    convert.convert(tmp_path / "q4.onnx", tmp_path / "q4.bpk")

    with pytest.raises(RecordError) as info:
        convert.convert(tmp_path / "q4.bpk", tmp_path / "back.onnx", graph=tmp_path / "q4.onnx")

    assert "'w'" in str(info.value) and "MatMulNBits" in str(info.value)
    assert not (tmp_path / "back.onnx").exists()


def test_two_weights_sharing_one_scale_initializer_go_back_unless_the_record_gives_them_different_scales(tmp_path):
    codes = [RNG.integers(-127, 128, size=(4, 4)).astype(np.int8) for _ in range(2)]
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["a_q", "s"], ["a"]),
         helper.make_node("DequantizeLinear", ["b_q", "s"], ["b"]),
         helper.make_node("MatMul", ["x", "a"], ["h"]), helper.make_node("MatMul", ["h", "b"], ["y"])],
        "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(codes[0], "a_q"), numpy_helper.from_array(codes[1], "b_q"),
         numpy_helper.from_array(np.float32(0.02), "s")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "shared.onnx")

    back, _ = round_trip(tmp_path, "shared")
    assert_same_initializers(back, tmp_path / "shared.onnx")

    scheme = op.QuantScheme(op.QuantValue.Q8S)
    doubled = quantize(codes[1].astype(np.float32) * np.float32(0.04), scheme)  # scale 0.04 for b_q alone
    with burnpack.read(tmp_path / "shared.bpk") as stored:
        a = stored.tensors["a_q"].to_data()
    burnpack.write(tmp_path / "changed.bpk", [TensorEntry("a_q", op.DType.QFloat, (4, 4), a, scheme=scheme),
                                              TensorEntry("b_q", op.DType.QFloat, (4, 4), doubled, scheme=scheme)])
    with pytest.raises(RecordError) as info:
        convert.convert(tmp_path / "changed.bpk", tmp_path / "changed.onnx", graph=tmp_path / "shared.onnx")
    assert "'b_q'" in str(info.value) and "share the template's scale initializer 's'" in str(info.value)
