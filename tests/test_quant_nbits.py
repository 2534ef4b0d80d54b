"""4-bit weights below opset 21 (``com.microsoft.MatMulNBits``) and their import back as QFloat.

Oracles: numpy unpacking of ``MatMulNBits``' ``B`` / ``scales`` / ``zero_points`` written here from
ORT's documented layout (ONNX Runtime contrib operator spec: ``com.microsoft.MatMulNBits``), numpy's
symmetric 4-bit formula (``scale = max|w| / 7``, ``q = round(w / scale)``), plain ONNX Runtime
running the files, and ``onnxruntime.quantization``'s own ``MatMulNBitsQuantizer``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.quant import QuantizationWarning, Quantizer, QuantScheme, QuantValue, qdq_options, quantized_ops

RNG = np.random.default_rng(11)


def run(path, **feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def unpack_nbits(node: onnx.NodeProto, inits: dict) -> np.ndarray:
    """The float ``[K, N]`` weight of a 4-bit ``MatMulNBits`` node, per ORT's documented layout:
    ``B`` uint8 ``[N, n_blocks, block / 2]`` (low nibble first), ``scales`` ``[N * n_blocks]``,
    optional packed uint8 ``zero_points`` ``[N * ceil(n_blocks / 2)]`` (default 8)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    assert attrs["bits"] == 4
    b = numpy_helper.to_array(inits[node.input[1]])
    blocks = -(-k // block)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, blocks * block).astype(np.float32)
    scales = numpy_helper.to_array(inits[node.input[2]]).astype(np.float32).reshape(n, blocks)
    zero = np.full((n, blocks), 8.0, np.float32)
    if len(node.input) > 3 and node.input[3]:
        zp = numpy_helper.to_array(inits[node.input[3]]).reshape(n, -1)
        zero = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    w = (codes - np.repeat(zero, block, axis=1)) * np.repeat(scales, block, axis=1)
    return w[:, :k].T


def linear_graph(tmp_path, op_type: str, w: np.ndarray, c: np.ndarray | None, opset: int, trans_b: int = 0):
    inputs = ["x", "w"] + (["c"] if c is not None else [])
    attrs = {"transB": trans_b} if op_type == "Gemm" else {}
    node = helper.make_node(op_type, inputs, ["y"], **attrs)
    d_in = w.shape[1] if trans_b else w.shape[0]
    inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(c, "c")] if c is not None else [])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", d_in])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    path = tmp_path / f"{op_type}{trans_b}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def numpy_q4s(w: np.ndarray) -> np.ndarray:
    """Symmetric per-tensor 4-bit: ``round(w / s) * s`` with ``s = max|w| / 7``."""
    scale = np.float32(np.abs(w).max() / 7)
    return np.clip(np.round(w / scale), -7, 7).astype(np.float32) * scale


# -- export: 4-bit below opset 21 is really 4-bit ----------------------------------------------------


@pytest.mark.parametrize("op_type, trans_b", [("MatMul", 0), ("Gemm", 0), ("Gemm", 1)])
def test_four_bit_linear_weights_below_opset_21_are_matmul_nbits_under_0_6x_the_int8_file(op_type, trans_b, tmp_path):
    k, n = 256, 192
    w = RNG.normal(size=(n, k) if trans_b else (k, n)).astype(np.float32)
    c = RNG.normal(size=(n,)).astype(np.float32) if op_type == "Gemm" else None
    src = linear_graph(tmp_path, op_type, w, c, 17, trans_b)
    q8 = op.export_onnx(op.import_onnx(src).quantize_weights(Quantizer(QuantScheme(QuantValue.Q8S))), tmp_path / "8.onnx")
    model = op.import_onnx(src).quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S)))
    q4 = op.export_onnx(model, tmp_path / "4.onnx")
    assert q4.stat().st_size < 0.6 * q8.stat().st_size
    graph = onnx.load(str(q4)).graph
    inits = {i.name: i for i in graph.initializer}
    assert not [i.name for i in graph.initializer if i.data_type == TensorProto.INT8]
    nbits = [node for node in graph.node if node.op_type == "MatMulNBits"]
    assert len(nbits) == 1 and nbits[0].domain == "com.microsoft"
    assert [(r["op"], r["form"]) for r in quantized_ops(q4)] == [(op_type, "4-bit MatMulNBits")]
    w_kn = w.T if trans_b else w
    np.testing.assert_allclose(unpack_nbits(nbits[0], inits), numpy_q4s(w_kn), rtol=1e-6, atol=1e-7)
    x = RNG.normal(size=(5, k)).astype(np.float32)
    expected = x @ numpy_q4s(w_kn) + (c if c is not None else 0)
    np.testing.assert_allclose(run(q4, x=x), expected, rtol=1e-4, atol=1e-4)


def test_four_bit_conv_below_opset_21_is_float_with_a_reason_never_int8(tmp_path):
    w = RNG.normal(size=(8, 3, 3, 3)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    src = tmp_path / "conv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    model = op.import_onnx(src).quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S)))
    with qdq_options(prefer="size"), pytest.warns(QuantizationWarning, match=r"'w' .*4-bit.* Conv .*float weight \(not as int8\)"):
        out = op.export_onnx(model, tmp_path / "q.onnx")
    saved = onnx.load(str(out)).graph
    assert [i.data_type for i in saved.initializer] == [TensorProto.FLOAT]
    rows = quantized_ops(out)
    assert [(r["op"], r["form"]) for r in rows] == [("Conv", "float")] and "no 4-bit form" in rows[0]["reason"]
    x = RNG.normal(size=(2, 3, 8, 8)).astype(np.float32)
    expected = run(_with_weight(src, numpy_q4s(w), tmp_path), x=x)  # the float graph with numpy's 4-bit weight
    np.testing.assert_allclose(run(out, x=x), expected, rtol=1e-5, atol=1e-5)


def _with_weight(src, w: np.ndarray, tmp_path):
    model = onnx.load(str(src))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, model.graph.initializer[0].name))
    path = tmp_path / "oracle.onnx"
    onnx.save(model, path)
    return path


# -- import: MatMulNBits -> QFloat --------------------------------------------------------------------


def nbits_weight(path) -> np.ndarray:
    """The numpy-unpacked ``[K, N]`` weight of the one ``MatMulNBits`` in ``path``."""
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    (node,) = [n for n in graph.node if n.op_type == "MatMulNBits"]
    return unpack_nbits(node, inits)


@pytest.mark.parametrize("op_type, quantizer", [
    ("MatMul", Quantizer(QuantScheme(QuantValue.Q4S))),
    ("MatMul", Quantizer(QuantScheme(QuantValue.Q4F, block_size=(32, 1)))),
    ("Gemm", Quantizer(QuantScheme(QuantValue.Q4S), per_channel=True)),
], ids=["matmul-per-tensor", "matmul-blocks-along-k", "gemm-transb-per-channel"])
def test_our_matmul_nbits_export_imports_back_as_the_same_qfloat_params(op_type, quantizer, tmp_path):
    trans_b = int(op_type == "Gemm")
    w = RNG.normal(size=(40, 96) if trans_b else (96, 40)).astype(np.float32)
    c = RNG.normal(size=(40,)).astype(np.float32) if trans_b else None
    model = op.import_onnx(linear_graph(tmp_path, op_type, w, c, 17, trans_b)).quantize_weights(quantizer)
    original = model.save_file(tmp_path / "a.bpk").read_bytes()
    exported = op.export_onnx(model, tmp_path / "q.onnx")
    imported = op.import_onnx(exported)
    param = imported.param_of("w")
    assert param.lazy_dtype() is op.DType.QFloat
    assert param.base()._quant.scheme == model.param_of("w").base()._quant.scheme
    unpacked = nbits_weight(exported)
    np.testing.assert_array_equal(param.val().to_numpy(), unpacked.T if trans_b else unpacked)
    assert imported.save_file(tmp_path / "b.bpk").read_bytes() == original
    x = RNG.normal(size=(4, 96)).astype(np.float32)
    np.testing.assert_allclose(imported(x).to_numpy(), run(exported, x=x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_ort_matmul_nbits_quantizer_output_imports_as_qfloat_equal_to_the_unpacked_weights(symmetric, tmp_path):
    nbits = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    w = RNG.normal(size=(96, 40)).astype(np.float32)
    quantizer = nbits.MatMulNBitsQuantizer(onnx.load(str(linear_graph(tmp_path, "MatMul", w, None, 17))),
                                           block_size=32, is_symmetric=symmetric)
    quantizer.process()
    src = tmp_path / "ort_q4.onnx"
    onnx.save(quantizer.model.model, src)
    imported = op.import_onnx(src)
    ((name, param),) = list(imported.named_params())
    qt = param.base()._quant
    assert param.lazy_dtype() is op.DType.QFloat and qt.scheme.block.size.dims[-2:] == (32, 1)
    # Burn has no zero point: asymmetric codes minus their zero points span -15..15, held as 8 bits
    assert qt.scheme.value in ((QuantValue.Q4S, QuantValue.Q4F) if symmetric else (QuantValue.Q8S,))
    np.testing.assert_array_equal(param.val().to_numpy(), nbits_weight(src))
    x = RNG.normal(size=(4, 96)).astype(np.float32)
    expected = run(src, x=x)
    np.testing.assert_allclose(imported(x).to_numpy(), expected, rtol=1e-5, atol=1e-5)
    out = op.export_onnx(imported, tmp_path / "back.onnx")
    before = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(src)).graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer}
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    np.testing.assert_array_equal(run(out, x=x), expected)
