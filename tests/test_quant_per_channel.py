"""Per-channel (per output channel) int8 / int4 weights, MatMulNBits below opset 21, F16 scales
and the burnpack rule for ONNX-only schemes (onnxparam.quant).

Oracles: numpy's ``max |w| / 127`` per output channel, the ONNX operator spec's axes (Conv ``W``
``[M, C/g, k...]``: axis 0; ConvTranspose ``W`` ``[C, M/g, k...]``: axis 1), plain ONNX Runtime on
the float original, the optimized graph ORT writes (``SessionOptions.optimized_model_filepath``),
and the digits' labels.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from quantized_files import optimized_ops

import onnxparam as op
from onnxparam import nn
from onnxparam.core.errors import OnnxParamError
from onnxparam.onnx_io import import_onnx
from onnxparam.quant import (
    Quantizer,
    QuantScheme,
    QuantValue,
    qdq_options,
    quantize_activations,
    quantized_ops,
)
from onnxparam.zoo import mnist

RNG = np.random.default_rng(7)


def run(path, **feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def conv_graph(tmp_path, op_type: str, w: np.ndarray, x_shape, opset: int = 21):
    """A one-node ONNX graph ``y = op_type(x, w)`` written to ``tmp_path / f"{op_type}.onnx"``."""
    node = helper.make_node(op_type, ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    path = tmp_path / f"{op_type}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def dequantize_node(path, weight: str):
    """``(scale array, axis)`` of the DequantizeLinear that reads initializer ``weight``."""
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == weight)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return inits[node.input[1]], attrs.get("axis", 1)


# -- scales and axes ------------------------------------------------------------------------------


@pytest.mark.parametrize("c_in", [300, 12], ids=["onnx-per-axis", "burn-blocks"])
def test_conv_scales_are_numpy_max_abs_over_127_per_output_channel_on_axis_0(c_in, tmp_path):
    w = RNG.normal(size=(16, c_in, 3, 3)).astype(np.float32)
    src = conv_graph(tmp_path, "Conv", w, (1, c_in, 8, 8))
    model = import_onnx(src).quantize_weights(Quantizer(per_channel=True))
    with qdq_options(prefer="size"):
        out = op.export_onnx(model, tmp_path / "q.onnx")
    scale, axis = dequantize_node(out, "w")
    assert axis == 0
    np.testing.assert_allclose(scale.reshape(-1), np.abs(w).reshape(16, -1).max(axis=1) / 127, rtol=1e-7)
    x = RNG.normal(size=(1, c_in, 8, 8)).astype(np.float32)
    expected = run(src, x=x)
    np.testing.assert_allclose(run(out, x=x), expected, atol=0.02 * np.abs(expected).max())


def test_conv_transpose_weights_get_one_scale_per_output_channel_on_axis_1(tmp_path):
    w = RNG.normal(size=(6, 10, 3, 3)).astype(np.float32)  # [C_in, C_out, kh, kw]
    w[:, 3] *= 20  # one loud output channel: a per-input-channel scale would crush the others
    src = conv_graph(tmp_path, "ConvTranspose", w, (1, 6, 5, 5))
    model = import_onnx(src).quantize_weights(Quantizer(per_channel=True))
    with qdq_options(prefer="size"):
        out = op.export_onnx(model, tmp_path / "q.onnx")
    scale, axis = dequantize_node(out, "w")
    assert axis == 1
    np.testing.assert_allclose(scale.reshape(-1), np.abs(w).max(axis=(0, 2, 3)) / 127, rtol=1e-7)
    x = RNG.normal(size=(1, 6, 5, 5)).astype(np.float32)
    expected = run(src, x=x)
    got = run(out, x=x)
    for c in range(10):  # every output channel keeps its own precision
        err = np.abs(got[:, c] - expected[:, c]).max()
        assert err <= 0.02 * np.abs(expected[:, c]).max(), c


def test_default_export_of_a_conv_transpose_keeps_the_float_weight(tmp_path):
    w = RNG.normal(size=(6, 10, 3, 3)).astype(np.float32)
    src = conv_graph(tmp_path, "ConvTranspose", w, (1, 6, 5, 5))
    model = import_onnx(src).quantize_weights(Quantizer(per_channel=True))
    out = op.export_onnx(model, tmp_path / "q.onnx")
    assert [(r["op"], r["form"]) for r in quantized_ops(out)] == [("ConvTranspose", "float")]
    assert onnx.load(str(out)).graph.initializer[0].data_type == TensorProto.FLOAT


def test_linear_weights_get_one_scale_per_column_and_ort_fuses_the_integer_matmul(tmp_path):
    model = nn.LinearConfig(300, 64).init()
    model.weight = op.Param.from_tensor(op.Tensor.from_numpy(RNG.normal(size=(300, 64)).astype(np.float32)))
    q = model.quantize_weights(Quantizer(per_channel=True))
    x = RNG.normal(size=(4, 300)).astype(np.float32)
    out = op.export_onnx(q, tmp_path / "q.onnx", x)
    graph = onnx.load(str(out)).graph
    mmi = next(n for n in graph.node if n.op_type == "MatMulInteger")
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    w = model.weight.val().to_numpy()
    scale = next(v for k, v in inits.items() if k.startswith("weight_scale"))
    np.testing.assert_allclose(scale, np.abs(w).max(axis=0) / 127, rtol=1e-7)
    assert mmi.input[1] == "weight"
    ops = optimized_ops(out, tmp_path)
    assert "DynamicQuantizeMatMul" in ops or "MatMulIntegerToFloat" in ops
    expected = x @ w + model.bias.val().to_numpy()
    np.testing.assert_allclose(run(out, x=x), expected, atol=0.03 * np.abs(expected).max())
    exact = x @ q.weight.val().to_numpy() + q.bias.val().to_numpy()  # module(x): the dequantized weight
    np.testing.assert_allclose(q(op.Tensor.from_numpy(x)).to_numpy(), exact, rtol=1e-5, atol=1e-5)


def test_calibrated_per_channel_conv_runs_qlinear_conv(tmp_path):
    w = RNG.normal(size=(16, 8, 3, 3)).astype(np.float32)
    src = conv_graph(tmp_path, "Conv", w, ("n", 8, 8, 8))
    model = import_onnx(src).quantize_weights(Quantizer(per_channel=True))
    x = RNG.normal(size=(16, 8, 8, 8)).astype(np.float32)
    static = quantize_activations(model, x)
    out = op.export_onnx(static, tmp_path / "q.onnx")
    assert "QLinearConv" in optimized_ops(out, tmp_path)
    assert [r["form"] for r in quantized_ops(out)] == ["static int8"]
    expected = run(src, x=x[:2])
    np.testing.assert_allclose(run(out, x=x[:2]), expected, atol=0.03 * np.abs(expected).max())


# -- 4-bit below opset 21 ---------------------------------------------------------------------------


def matmul_graph(tmp_path, w: np.ndarray, opset: int):
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    path = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


@pytest.mark.parametrize("quantizer", [Quantizer(QuantScheme(QuantValue.Q4S)),
                                       Quantizer(QuantScheme(QuantValue.Q4S), per_channel=True),
                                       Quantizer(QuantScheme(QuantValue.Q4S, block_size=(32, 1)))],
                         ids=["per-tensor", "per-channel", "blocks-along-k"])
@pytest.mark.parametrize("opset", [17, 21])
def test_four_bit_matmul_is_written_as_matmul_nbits_with_float32_compute(quantizer, opset, tmp_path):
    # below opset 21 no INT4 DequantizeLinear exists; from 21 on MatMulNBits is written directly so the
    # file carries accuracy_level 0 (float32 compute, as MatMulNBitsQuantizer writes), not ORT's
    # session default 4 for a fused DQ -> MatMul (int8 activations)
    w = RNG.normal(size=(96, 40)).astype(np.float32)
    src = matmul_graph(tmp_path, w, opset)
    model = import_onnx(src).quantize_weights(quantizer)
    out = op.export_onnx(model, tmp_path / "q.onnx")
    graph = onnx.load(str(out)).graph
    assert [n.op_type for n in graph.node] == ["MatMulNBits"]
    assert {a.name: helper.get_attribute_value(a) for a in graph.node[0].attribute}.get("accuracy_level", 0) == 0
    packed = next(i for i in graph.initializer if i.name == "w")
    assert packed.data_type == TensorProto.UINT8 and packed.dims[0] == 40  # [N, blocks, block / 2]
    assert [(r["op"], r["form"]) for r in quantized_ops(out)] == [("MatMul", "4-bit MatMulNBits")]
    x = RNG.normal(size=(5, 96)).astype(np.float32)
    exact = x @ model.param_of("w").val().to_numpy()  # the stored 4-bit values, dequantized
    np.testing.assert_allclose(run(out, x=x), exact, rtol=1e-4, atol=1e-4)
    assert np.abs(exact - x @ w).max() <= 0.25 * np.abs(x @ w).max()


# -- F16 ------------------------------------------------------------------------------------------------


def test_float16_weights_get_float16_scales_and_dequantize_to_the_same_values(tmp_path):
    class Scaled(op.Module):
        def __init__(self):
            self.w = op.Param.from_tensor(op.Tensor.from_numpy(RNG.normal(size=(8, 6)).astype(np.float16)))

        def forward(self, x):
            return op.ops.mul(x, self.w.val())

    model = Scaled().quantize_weights(Quantizer(per_channel=True))
    x = RNG.normal(size=(8, 6)).astype(np.float16)
    out = op.export_onnx(model, tmp_path / "q.onnx", x, dynamic_batch=False)  # x * w: both [8, 6]
    graph = onnx.load(str(out)).graph
    scale = next(i for i in graph.initializer if i.name.startswith("w_scale"))
    assert scale.data_type == TensorProto.FLOAT16
    assert "Cast" not in [n.op_type for n in graph.node]
    np.testing.assert_array_equal(run(out, x=x), x * model.w.val().to_numpy())


# -- burnpack --------------------------------------------------------------------------------------------


def test_burnpack_refuses_an_onnx_only_per_axis_weight_naming_it_and_keeps_burn_blocks(tmp_path):
    wide = nn.Conv2dConfig((300, 8), (3, 3)).init().quantize_weights(Quantizer(per_channel=True))
    with pytest.raises(OnnxParamError, match=r"'weight'.*per-axis scale along axis 0 .* burnpack file cannot store"):
        wide.save_file(tmp_path / "wide.bpk")
    assert not list(tmp_path.iterdir())
    narrow = nn.Conv2dConfig((30, 8), (3, 3)).init().quantize_weights(Quantizer(per_channel=True))
    narrow.save_file(tmp_path / "narrow.bpk")
    loaded = nn.Conv2dConfig((30, 8), (3, 3)).init().quantize_weights(Quantizer(per_channel=True))
    loaded = loaded.load_file(tmp_path / "narrow.bpk")
    assert loaded.weight.base()._quant.scheme.describe() == "Q8S Native per-block (30, 3, 3) F32"
    np.testing.assert_array_equal(loaded.weight.val().to_numpy(), narrow.weight.val().to_numpy())


# -- MNIST ---------------------------------------------------------------------------------------------------


def test_mnist_per_channel_int8_variants_stay_within_one_point_of_float32(tmp_path):
    images, labels = mnist.load_digits()
    images = images.astype(np.float32)
    model = mnist.load_pretrained()

    def accuracy(path):
        logits = run(path, x=images)
        return float((logits.argmax(axis=1) == labels).mean())

    axes = {0: {0: "batch"}}
    base = accuracy(op.export_onnx(model, tmp_path / "f32.onnx", images[:1], dynamic_axes=axes))
    per_channel = model.quantize_weights(Quantizer(per_channel=True))
    variants = {"default": op.export_onnx(per_channel, tmp_path / "pc.onnx", images[:1], dynamic_axes=axes),
                "static": op.export_onnx(quantize_activations(per_channel, images[::9]), tmp_path / "st.onnx",
                                         images[:1], dynamic_axes=axes)}
    with qdq_options(prefer="size"):
        variants["size"] = op.export_onnx(per_channel, tmp_path / "sz.onnx", images[:1], dynamic_axes=axes)
    for name, path in variants.items():
        assert accuracy(path) >= base - 0.01, name


# -- Gemm -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trans_b", [1, 0])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_gemm_weights_run_as_ort_integer_matmul_by_default(trans_b, per_channel, tmp_path):
    w = RNG.normal(size=(48, 32)).astype(np.float32)  # [N, K] with transB=1, else [K, N]
    c = RNG.normal(size=(48 if trans_b else 32,)).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=trans_b)
    d_in = 32 if trans_b else 48
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", d_in])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    src = tmp_path / "gemm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), src)
    model = import_onnx(src).quantize_weights(Quantizer(per_channel=per_channel))
    out = op.export_onnx(model, tmp_path / "q.onnx")
    assert [(r["op"], r["form"]) for r in quantized_ops(out)] == [("Gemm", "dynamic int8")]
    if per_channel:  # one scale per output column: axis 0 of a transB weight, else axis 1
        inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer}
        scale = next(v for k, v in inits.items() if k.startswith("w_scale"))
        np.testing.assert_allclose(scale, np.abs(w).max(axis=1 if trans_b else 0) / 127, rtol=1e-7)
    ops = optimized_ops(out, tmp_path)
    assert "DynamicQuantizeMatMul" in ops or "MatMulIntegerToFloat" in ops
    x = RNG.normal(size=(6, d_in)).astype(np.float32)
    expected = run(src, x=x)
    np.testing.assert_allclose(run(out, x=x), expected, atol=0.03 * np.abs(expected).max())


def test_per_column_four_bit_matmul_is_matmul_nbits_at_opset_21_and_logs_the_summary(tmp_path, caplog):
    import logging

    w = RNG.normal(size=(96, 40)).astype(np.float32)
    src = matmul_graph(tmp_path, w, 21)
    model = import_onnx(src).quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S), per_channel=True))
    with caplog.at_level(logging.INFO, logger="onnxparam.quant"):
        out = op.export_onnx(model, tmp_path / "q.onnx")
    assert "quantized export: 1 MatMul 4-bit MatMulNBits" in caplog.text
    model_proto = onnx.load(str(out))
    inits = {i.name: numpy_helper.to_array(i) for i in model_proto.graph.initializer}
    (node,) = model_proto.graph.node
    assert node.op_type == "MatMulNBits"
    scales = inits[node.input[2]].reshape(40, -1)  # [N * blocks], n major: one column's scale per block
    np.testing.assert_allclose(scales, np.repeat(np.abs(w).max(axis=0)[:, None] / 7, scales.shape[1], 1),
                               rtol=1e-6)  # Q4S: max|w| / 7 per column
    assert "MatMulNBits" in optimized_ops(out, tmp_path)
    with qdq_options(matmul="dequantize"):  # the standard-ONNX form: INT4 DequantizeLinear, ORT fuses it
        out = op.export_onnx(model, tmp_path / "dq.onnx")
    scale, axis = dequantize_node(out, "w")
    assert axis == 1
    np.testing.assert_allclose(scale.reshape(-1), np.abs(w).max(axis=0) / 7, rtol=1e-6)
    assert "MatMulNBits" in optimized_ops(out, tmp_path)
