"""QDQ export and import of quantized params (onnxparam.quant._qdq).

Oracles: ``onnx.reference.ReferenceEvaluator`` (ONNX's own operator semantics), numpy formulas
(ONNX QuantizeLinear rounds half to even: ``np.round``), Burn's bytes from docs/burnpack.md §2.4, the
optimized graph ONNX Runtime writes (``SessionOptions.optimized_model_filepath``), and the digits'
labels.
"""

from __future__ import annotations

import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator
from quantized_files import optimized_nodes

import onnxparam as op
from onnxparam import nn
from onnxparam.quant import (
    QuantizationWarning,
    QuantizedTensor,
    Quantizer,
    QuantScheme,
    QuantValue,
    ScaleDtype,
    matmulnbits_accuracy_level,
    qdq_options,
    quantize,
    quantize_activations,
)
from onnxparam.zoo import mnist

X = np.array([[-1.0, -0.5, 0.3, 0.5], [1.0, 1.5, -2.0, 2.54]], np.float32)  # docs/burnpack.md §2.4


class Scaled(op.Module):
    """``x * w``: the weight feeds a Mul, so its DequantizeLinear is plain QDQ."""

    def __init__(self, w: op.Param):
        self.w = w

    def forward(self, x):
        return op.ops.mul(x, self.w.val())


class Stack(op.Module):
    """``n`` Linear layers with ReLU: the matmul-heavy benchmark model."""

    def __init__(self, d: int = 64, n: int = 2):
        self.layers = [nn.Linear(d, d) for _ in range(n)]

    def forward(self, x):
        for layer in self.layers:
            x = op.ops.relu(layer(x))
        return x


def qparam(array, scheme) -> op.Param:
    return op.Param.from_tensor(quantize(np.asarray(array, np.float32), scheme).to_tensor())


SCHEMES = [
    QuantScheme(QuantValue.Q8S),
    QuantScheme(QuantValue.Q8F),
    QuantScheme(QuantValue.Q4S),
    QuantScheme(QuantValue.Q4F),
    QuantScheme(QuantValue.Q2S),
    QuantScheme(QuantValue.Q2F),
    QuantScheme(QuantValue.Q8S, block_size=4),  # a whole row: per-axis 0
    QuantScheme(QuantValue.Q8S, block_size=(2, 1)),  # a whole column: per-axis 1
    QuantScheme(QuantValue.Q4S, block_size=(4, 2)),  # hmm: 2-D blocks handled below
    QuantScheme(QuantValue.Q8S, block_size=2),  # blocked along the last axis
    QuantScheme(QuantValue.Q4F, block_size=(1, 2)).with_scale_dtype(ScaleDtype.F16),
    QuantScheme(QuantValue.Q8S).per_block(2, ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32),
]
SCHEMES = [s for s in SCHEMES if s.block is None or sum(e > 1 for e in s.block.size.dims) <= 1]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
@pytest.mark.parametrize("unsigned", [False, True])
def test_dequantize_linear_nodes_agree_with_onnx_reference_and_burns_values(scheme, unsigned, tmp_path):
    x = np.random.default_rng(3).normal(size=(2, 4)).astype(np.float32) + X
    w = qparam(x, scheme)
    with qdq_options(unsigned=unsigned):
        path = op.export_onnx(Scaled(w), tmp_path / "m.onnx", np.ones((2, 4), np.float32), dynamic_batch=False)
    model = onnx.load(str(path))
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Mul"]
    init = {i.name: i for i in model.graph.initializer}
    bits = 4 if scheme.value in (QuantValue.Q4S, QuantValue.Q4F) else 8
    expected_type = {(8, False): onnx.TensorProto.INT8, (8, True): onnx.TensorProto.UINT8,
                     (4, False): onnx.TensorProto.INT4, (4, True): onnx.TensorProto.UINT4}[(bits, unsigned)]
    assert init["w"].data_type == expected_type
    got = ReferenceEvaluator(model).run(None, {"x": np.ones((2, 4), np.float32)})[0]
    burn = w.base()._quant
    np.testing.assert_array_equal(got, burn.dequantize())  # bit-exact: ONNX's (q - zp) * scale in f32
    np.testing.assert_array_equal(w.val().to_numpy(), got)


def test_blocked_scales_become_onnx_block_size_on_the_burn_axis(tmp_path):
    w = qparam(X, QuantScheme(block_size=2))
    path = op.export_onnx(Scaled(w), tmp_path / "m.onnx", np.ones((2, 4), np.float32), dynamic_batch=False)
    dq = onnx.load(str(path)).graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs == {"axis": 1, "block_size": 2}


def test_two_dimensional_blocks_export_the_float_weight_with_a_warning(tmp_path):
    w = qparam(np.ones((4, 4), np.float32), QuantScheme(QuantValue.Q8S, block_size=(2, 2)))
    with pytest.warns(QuantizationWarning, match="'w' .* cannot express .* exported as a float32 initializer"):
        path = op.export_onnx(Scaled(w), tmp_path / "m.onnx", np.ones((4, 4), np.float32), dynamic_batch=False)
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["Mul"]


def test_quantize_linear_pairs_agree_with_onnx_reference_and_half_to_even(tmp_path):
    rng = np.random.default_rng(0)
    m = Stack(16, 1).quantize_weights(Quantizer())
    calib = rng.normal(size=(64, 16)).astype(np.float32)
    s = quantize_activations(m, calib)
    path = op.export_onnx(s, tmp_path / "s.onnx", calib[:1], dynamic_axes={0: {0: "batch"}})
    model = onnx.load(str(path))
    q_nodes = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(q_nodes) == 2  # the MatMul's input and output
    init = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    scale, zero = init[q_nodes[0].input[1]], init[q_nodes[0].input[2]]
    assert scale.dtype == np.float32 and zero.dtype == np.uint8
    assert np.isclose(scale * 255, max(calib.max(), 0) - min(calib.min(), 0), rtol=1e-6)
    ties = ((np.arange(-20, 20) + 0.5) * scale).astype(np.float32)  # exactly between two codes
    node = onnx.helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
    graph = onnx.helper.make_graph([node], "q", [onnx.helper.make_tensor_value_info("x", 1, [40])],
                                   [onnx.helper.make_tensor_value_info("y", 2, [40])],
                                   [onnx.numpy_helper.from_array(scale, "s"), onnx.numpy_helper.from_array(zero, "z")])
    got = ReferenceEvaluator(onnx.helper.make_model(graph)).run(None, {"x": ties})[0]
    expected = np.clip(np.round(ties / scale) + zero, 0, 255).astype(np.uint8)  # np.round: half to even
    np.testing.assert_array_equal(got, expected)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    reference = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(s(op.Tensor.from_numpy(x)).to_numpy(), reference, atol=2 * float(scale) + 1e-3)


# -- MNIST ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    images, labels = mnist.load_digits()
    return images.astype(np.float32), labels


@pytest.fixture(scope="module")
def mnist_files(tmp_path_factory, digits):
    images, _ = digits
    work = tmp_path_factory.mktemp("mnist")
    model = mnist.load_pretrained()
    quantized = model.quantize_weights(Quantizer())
    axes = {0: {0: "batch"}}
    static = quantize_activations(quantized, images[::9])
    int8 = op.export_onnx(quantized, work / "int8.onnx", images[:1], dynamic_axes=axes)
    with qdq_options(prefer="size"):
        size = op.export_onnx(quantized, work / "size.onnx", images[:1], dynamic_axes=axes)
    return {
        "size": size,
        "float": op.export_onnx(model, work / "float.onnx", images[:1], dynamic_axes=axes),
        "int8": int8,
        "static": op.export_onnx(static, work / "static.onnx", images[:1], dynamic_axes=axes),
    }


def accuracy(path, digits) -> float:
    images, labels = digits
    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: images})[0]
    return float((logits.argmax(axis=1) == labels).mean())


def test_mnist_int8_weights_keep_accuracy_within_one_point_at_under_0_3x_size(mnist_files, digits):
    base = accuracy(mnist_files["float"], digits)
    assert base == pytest.approx(0.9204, abs=1e-4)
    for variant in ("int8", "size", "static"):
        assert accuracy(mnist_files[variant], digits) >= base - 0.01, variant
    assert os.path.getsize(mnist_files["size"]) <= 0.3 * os.path.getsize(mnist_files["float"])
    # the default keeps the (uncalibrated) conv weights float: 64 x 64 x 3 x 3 of them
    assert os.path.getsize(mnist_files["int8"]) <= 0.4 * os.path.getsize(mnist_files["float"])


def test_mnist_default_export_keeps_uncalibrated_convs_float_and_reports_each_op(mnist_files, tmp_path):
    from onnxparam.quant import quantized_ops

    graph = onnx.load(str(mnist_files["int8"])).graph
    weights = {i.name: i.data_type for i in graph.initializer}
    assert weights["conv1.conv.weight"] == weights["conv2.conv.weight"] == onnx.TensorProto.FLOAT
    # an integer kernel's weight: uint8 codes with zero point 128 (u8 x s8 kernels saturate without VNNI)
    assert weights["fc1.weight"] == onnx.TensorProto.UINT8
    assert not [n for n in graph.node if n.op_type == "DequantizeLinear"]
    forms = {(row["weight"], row["op"], row["form"]) for row in quantized_ops(mnist_files["int8"])}
    assert forms == {("conv1.conv.weight", "Conv", "float"), ("conv2.conv.weight", "Conv", "float"),
                     ("fc1.weight", "MatMul", "dynamic int8"), ("fc2.weight", "MatMul", "dynamic int8"),
                     ("fc3.weight", "MatMul", "dynamic int8")}
    static = {(row["weight"], row["form"]) for row in quantized_ops(mnist_files["static"])}
    assert ("conv2.conv.weight", "static int8") in static and ("fc1.weight", "static int8") in static
    size = {(row["weight"], row["form"]) for row in quantized_ops(mnist_files["size"])}
    assert ("conv2.conv.weight", "dequantize") in size


def test_mnist_static_activation_quantization_runs_qlinear_kernels(mnist_files, digits, tmp_path):
    assert accuracy(mnist_files["static"], digits) >= accuracy(mnist_files["float"], digits) - 0.01
    ops = [n.op_type for n in optimized_nodes(mnist_files["static"], tmp_path)]
    assert ops.count("QLinearConv") == 2 and ops.count("QLinearMatMul") == 3


def test_mnist_int8_weights_run_dynamic_quantize_matmul(mnist_files, tmp_path):
    ops = [n.op_type for n in optimized_nodes(mnist_files["int8"], tmp_path)]
    assert ops.count("DynamicQuantizeMatMul") == 3 and "MatMul" not in ops


# -- ORT's integer kernels ----------------------------------------------------------------------


def test_matmul_heavy_model_fuses_integer_kernels(tmp_path):
    model = Stack(64, 4).quantize_weights(Quantizer())
    x = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    path = op.export_onnx(model, tmp_path / "q.onnx", x)
    ops = [n.op_type for n in optimized_nodes(path, tmp_path)]
    assert ops.count("DynamicQuantizeMatMul") == 4
    reference = ReferenceEvaluator(onnx.load(str(path))).run(None, {"x": x})[0]
    with qdq_options():  # module(x) with the export's options runs the same graph
        np.testing.assert_allclose(model(op.Tensor.from_numpy(x)).to_numpy(), reference, rtol=1e-4, atol=1e-4)
    exact = model(op.Tensor.from_numpy(x)).to_numpy()  # weight-only by default: the dequantized weights
    expected = x
    for layer in model.layers:
        expected = np.maximum(expected @ layer.weight.val().to_numpy() + layer.bias.val().to_numpy(), 0)
    np.testing.assert_allclose(exact, expected, rtol=1e-4, atol=1e-4)


def test_dequantize_mode_fuses_matmulnbits_with_the_accuracy_level_asked(tmp_path):
    model = Stack(64, 2).quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S, block_size=(32, 1))))
    # NOTE: rank-3 activations; on 2-D ones ORT 1.32 may fuse MatMul + Add + Relu into FusedGemm first
    with qdq_options(matmul="dequantize"):  # the default writes MatMulNBits itself (accuracy_level 0)
        path = op.export_onnx(model, tmp_path / "q.onnx", np.ones((2, 5, 64), np.float32))
    for level in (1, 4):
        nodes = optimized_nodes(path, tmp_path, [matmulnbits_accuracy_level(level)])
        fused = [n for n in nodes if n.op_type == "MatMulNBits"]
        assert len(fused) == 2
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fused[0].attribute}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, 32, level)
    with pytest.raises(ValueError, match="accuracy_level is 0..4"):
        matmulnbits_accuracy_level(7)


def test_blocks_along_n_warn_and_reblock_reports_its_error(tmp_path):
    model = Stack(64, 1).quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S, block_size=32)))
    x = np.ones((1, 2, 64), np.float32)
    with pytest.warns(QuantizationWarning, match=r"'layers.0.weight' .* blocked along N .* dequantizes at every run"):
        op.export_onnx(model, tmp_path / "n.onnx", x)
    with pytest.warns(QuantizationWarning, match=r"re-quantized with blocks of 32 along K .* largest error (\S+)") as w:
        with qdq_options(reblock=True):
            path = op.export_onnx(model, tmp_path / "k.onnx", x)
    assert "MatMulNBits" in [n.op_type for n in optimized_nodes(path, tmp_path)]
    error = float(re.search(r"largest error (\S+) vs", str(w[0].message)).group(1))
    got = ReferenceEvaluator(onnx.load(str(path))).run(None, {"x": np.eye(64, dtype=np.float32)[None, :2]})[0][0]
    weight = model.layers[0].weight.val().to_numpy()[:2]
    bias = model.layers[0].bias.val().to_numpy()
    assert 0 < np.abs(got - np.maximum(weight + bias, 0)).max() <= error + 1e-6


# -- Burn QFloat <-> ONNX ------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [QuantScheme(), QuantScheme(block_size=2),
                                    QuantScheme(QuantValue.Q4S, store=op.QuantStore.PackedU32(0)),
                                    QuantScheme(QuantValue.Q8S).per_block(2, ScaleDtype.UE4M3).per_tensor()],
                         ids=lambda s: s.describe())
def test_burn_qfloat_to_onnx_to_burnpack_is_byte_identical(scheme, tmp_path):
    w = qparam(np.resize(X, (2, 8)) if scheme.value is QuantValue.Q4S else X, scheme)
    module = Scaled(w)
    original = module.save_file(tmp_path / "a.bpk").read_bytes()
    if scheme == QuantScheme():  # docs/burnpack.md §2.4 (a): the data bytes
        assert original.endswith(bytes.fromhex("cee70f19324b9c7f0ad7a33c"))
    if scheme == QuantScheme(block_size=2):  # §2.4 (b)
        assert original.endswith(bytes.fromhex("81c04c7f557f9c7f040201 3c0402813b0683413c0ad7a33c".replace(" ", "")))
    path = op.export_onnx(module, tmp_path / "w.onnx", np.ones(w.shape, np.float32), dynamic_batch=False)
    imported = op.import_onnx(path)
    param = imported.param_of("w")
    assert param.lazy_dtype() is op.DType.QFloat and param.id == w.id
    back = imported.save_file(tmp_path / "b.bpk").read_bytes()
    assert back == original


def test_a_qdq_model_with_zero_points_imports_as_quantized_params(tmp_path):
    q = np.array([[0, 128, 255], [100, 130, 200]], np.uint8)
    scale = np.array([0.5, 0.25, 0.125], np.float32)
    zero = np.array([128, 120, 130], np.uint8)
    model = onnx.parser.parse_model("""
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[2, 3] x) => (float[2, 3] y) <uint8[2, 3] w_q, float[3] w_s, uint8[3] w_z> {
            w = DequantizeLinear <axis: int = 1> (w_q, w_s, w_z)
            y = Add(x, w)
        }""")
    del model.graph.initializer[:]
    model.graph.initializer.extend([onnx.numpy_helper.from_array(q, "w_q"), onnx.numpy_helper.from_array(scale, "w_s"),
                                    onnx.numpy_helper.from_array(zero, "w_z")])
    onnx.save(model, tmp_path / "m.onnx")
    imported = op.import_onnx(tmp_path / "m.onnx")
    param = imported.param_of("w_q")
    qt = param.base()._quant
    assert isinstance(qt, QuantizedTensor) and qt.scheme.value is QuantValue.Q8F  # -128 occurs
    expected = ReferenceEvaluator(model).run(None, {"x": np.zeros((2, 3), np.float32)})[0]
    np.testing.assert_array_equal(param.val().to_numpy(), expected)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(imported(op.Tensor.from_numpy(x)).to_numpy(), expected + 1)
    with op.burnpack.read(imported.save_file(tmp_path / "m.bpk")) as f:
        assert f.tensors["w_q"].dtype is op.DType.QFloat


def test_our_dynamic_matmul_export_imports_back_as_the_same_qfloat_params(tmp_path):
    model = Stack(32, 2).quantize_weights(Quantizer())
    path = op.export_onnx(model, tmp_path / "q.onnx", np.ones((2, 32), np.float32))
    imported = op.import_onnx(path)
    for path_, param in model.named_params():
        other = imported.param_of(path_)
        assert other.lazy_dtype() is param.lazy_dtype() and other.id == param.id
        if param.lazy_dtype() is op.DType.QFloat:
            assert other.base()._quant.to_bytes() == param.base()._quant.to_bytes()


# -- QLoRA ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", ["merge", "keep"])
def test_qlora_exports_a_quantized_base_with_float_adapters(lora, tmp_path):
    model = Stack(32, 1).apply_qlora(op.LoraConfig(4, 8.0), Quantizer())
    layer = model.layers[0]
    adapter = layer.weight.adapter()
    b = np.random.default_rng(2).normal(size=(4, 32)).astype(np.float32)
    layer.weight = layer.weight.with_adapter(adapter.with_factors(adapter.a, op.Param.from_data(b)))
    x = np.random.default_rng(5).normal(size=(3, 32)).astype(np.float32)
    with qdq_options(matmul="dequantize"):
        path = op.export_onnx(model, tmp_path / "q.onnx", x, lora=lora)
    onnx_model = onnx.load(str(path))
    types = {i.name: i.data_type for i in onnx_model.graph.initializer}
    assert types["layers.0.weight"] == onnx.TensorProto.INT8
    assert types["layers.0.weight.lora.a"] == types["layers.0.weight.lora.b"] == onnx.TensorProto.FLOAT
    w = layer.weight.val().to_numpy()  # dequantized base + scale * a @ b
    expected = np.maximum(x @ w + layer.bias.val().to_numpy(), 0)
    got = ReferenceEvaluator(onnx_model).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
