"""Integer-kernel weights never saturate: ONNX Runtime's uint8 x int8 kernels on x86 CPUs without
VNNI add pairs of products with ``VPMADDUBSW`` into a saturating int16, so the exporter stores every
weight an integer kernel reads (``DynamicQuantizeLinear -> MatMulInteger``, QDQ pairs ORT fuses
into ``QLinearMatMul`` / ``QLinearConv``) as uint8 codes ``q + 128`` with zero point 128
(``onnxparam.quant._qdq_forms.unsigned_for_integer_kernels``).

Oracles: numpy int64 products; the ONNX operator spec of ``DynamicQuantizeLinear`` computed in
numpy; ONNX's ``ReferenceEvaluator`` on the exported QDQ graph (float compute, no fusion); the
quantized module's own ``param.val()`` (Burn's values). Inputs sit at the ends of the activation
range and the weights at +-max (codes +-127), where pairs of ``u8 * s8`` products reach
``2 * 255 * 127 = 64770 > 32767``. These tests pass on any CPU; on one with AVX2 but no VNNI the
int8 layout failed them.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxparam as op
from onnxparam.onnx_io import import_onnx
from onnxparam.quant import Quantizer, quantize_activations, quantized_ops

LO, HI = np.float32(-0.5), np.float32(2.0)
"""Activation range ends: DynamicQuantizeLinear's scale 2.5 / 255 puts LO at code 0, 0 at 51 and
HI at 255, far from rounding ties."""


def session(path_or_bytes, optimized=True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path_or_bytes, so, providers=["CPUExecutionProvider"])


def matmul_integer(a: np.ndarray, b: np.ndarray, b_zero_point=None) -> np.ndarray:
    """Plain ORT ``MatMulInteger(a uint8 [M, K], b [K, N][, a_zero_point 0, b_zero_point])``."""
    b_type = TensorProto.UINT8 if b.dtype == np.uint8 else TensorProto.INT8
    inputs = ["a", "b"] + (["a_zp", "b_zp"] if b_zero_point is not None else [])
    inits = [] if b_zero_point is None else [numpy_helper.from_array(np.uint8(0), "a_zp"),
                                             numpy_helper.from_array(b_zero_point, "b_zp")]
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", inputs, ["y"])], "mmi",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape)),
         helper.make_tensor_value_info("b", b_type, list(b.shape))],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return session(model.SerializeToString()).run(None, {"a": a, "b": b})[0]


def vpmaddubsw_model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` as an AVX2 ``VPMADDUBSW`` kernel sums it: products of neighbouring k summed in
    pairs and clamped to int16, then added in int32."""
    pairs = a[:, 0::2, None].astype(np.int64) * b[0::2] + a[:, 1::2, None].astype(np.int64) * b[1::2]
    return np.clip(pairs, -32768, 32767).sum(axis=1)


def test_ort_u8_x_s8_matmul_integer_may_saturate_where_the_u8_x_u8_form_is_exact():
    a = np.full((1, 16), 255, np.uint8)
    b = np.full((16, 4), 127, np.int8)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    assert exact[0, 0] == 518160 and vpmaddubsw_model(a, b)[0, 0] == 262136
    # u8 x s8: exact on VNNI (or non-x86) CPUs, the saturated sums on AVX2 without VNNI
    signed = matmul_integer(a, b)
    assert np.array_equal(signed, exact) or np.array_equal(signed, vpmaddubsw_model(a, b))
    # the same products with the weight stored as uint8 codes + 128, zero point 128: exact everywhere
    rng = np.random.default_rng(0)
    a = rng.choice(np.array([0, 255], np.uint8), size=(8, 64))
    b = rng.choice(np.array([-128, -127, 127], np.int8), size=(64, 8))
    a[0], b[:, 0] = 255, 127
    unsigned = (b.astype(np.int16) + 128).astype(np.uint8)
    expected = a.astype(np.int64) @ b.astype(np.int64)
    np.testing.assert_array_equal(matmul_integer(a, unsigned, np.uint8(128)), expected)
    np.testing.assert_array_equal(matmul_integer(a, unsigned, np.full(8, 128, np.uint8)), expected)


# -- the library's exports ---------------------------------------------------------------------------------


def extreme_weight(shape, channel_axis: int, per_channel: bool) -> np.ndarray:
    """+-1 entries (codes +-127 after max-abs quantization), each output channel scaled by its
    own factor when ``per_channel`` (codes stay +-127, scales differ)."""
    rng = np.random.default_rng(1)
    w = np.where(rng.random(shape) < 0.7, 1.0, -1.0).astype(np.float32)
    w.reshape(-1)[:8] = 1.0  # a run of +max codes
    if per_channel:
        factor = np.linspace(0.5, 2.0, shape[channel_axis], dtype=np.float32)
        dims = [1] * len(shape)
        dims[channel_axis] = -1
        w = w * factor.reshape(dims)
    return w


def extreme_inputs(shape) -> np.ndarray:
    """Rows at HI, at LO, alternating HI / LO, and a HI / 0 / LO mix (every activation code 0, 51
    or 255)."""
    n = int(np.prod(shape[1:]))
    rows = [np.full(n, HI), np.full(n, LO), np.where(np.arange(n) % 2 == 0, HI, LO),
            np.array([HI, np.float32(0.0), LO] * n)[:n]]
    return np.stack(rows).astype(np.float32).reshape((4,) + tuple(shape[1:]))


def save(tmp_path, name, nodes, x_shape, inits) -> str:
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return str(path)


def initializers(path) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def dynamic_quantize_linear(x: np.ndarray):
    """ONNX operator spec ``DynamicQuantizeLinear`` (uint8), in float32 numpy."""
    lo, hi = np.minimum(np.float32(0), x.min()), np.maximum(np.float32(0), x.max())
    scale = np.float32((hi - lo) / np.float32(255))
    zero = np.uint8(np.clip(np.round(np.float32(0) - lo / scale), 0, 255))
    q = np.clip(np.round(x / scale) + zero, 0, 255).astype(np.uint8)
    return q, scale, zero


def stored_weight(inits: dict, name: str) -> tuple:
    """``(codes, zero point, scale)`` of the exported weight ``name``."""
    zp = next(v for k, v in inits.items() if k.startswith(f"{name}_zero_point"))
    scale = next(v for k, v in inits.items() if k.startswith(f"{name}_scale"))
    return inits[name], zp, scale


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("kind", ["MatMul", "Gemm-transB"])
def test_dynamic_int8_exports_equal_numpy_on_extreme_inputs(kind, per_channel, tmp_path):
    k, n = 64, 8
    if kind == "MatMul":
        w = extreme_weight((k, n), 1, per_channel)
        src = save(tmp_path, "mm", [helper.make_node("MatMul", ["x", "w"], ["y"])], ["n", k], {"w": w})
    else:
        w = extreme_weight((n, k), 0, per_channel)
        src = save(tmp_path, "gemm", [helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)], ["n", k],
                   {"w": w, "c": np.linspace(-1, 1, n, dtype=np.float32)})
    model = import_onnx(src).quantize_weights(Quantizer(per_channel=per_channel))
    out = op.export_onnx(model, tmp_path / "q.onnx")
    assert [r["form"] for r in quantized_ops(out)] == ["dynamic int8"]

    codes, zp, scale = stored_weight(initializers(out), "w")
    assert codes.dtype == np.uint8 and zp.dtype == np.uint8 and np.all(zp == 128) and zp.shape == scale.shape
    q = codes.astype(np.int64) - 128
    assert q.min() == -127 and q.max() == 127
    burn = dict(model.named_params())["w"].val().to_numpy()
    axis = 1 if kind == "MatMul" else 0
    per_column = scale if scale.ndim == 0 else np.expand_dims(scale, 1 - axis)
    np.testing.assert_array_equal(q.astype(np.float32) * per_column, burn)  # Burn's values, exactly

    x = extreme_inputs((4, k))
    xq, xs, xz = dynamic_quantize_linear(x)
    assert set(np.unique(xq)) <= {0, 51, 255} and xz == 51
    wq = q if kind == "MatMul" else q.T
    acc = (xq.astype(np.int64) - int(xz)) @ wq
    expected = acc.astype(np.float32) * (xs * scale.astype(np.float32))
    if kind != "MatMul":
        expected = expected + np.linspace(-1, 1, n, dtype=np.float32)
    got = session(str(out)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_static_int8_exports_equal_the_onnx_reference_on_extreme_inputs(tmp_path):
    c, m = 16, 8
    conv_w = extreme_weight((m, c, 3, 3), 0, per_channel=False)
    mm_w = extreme_weight((m * 4 * 4, 8), 1, per_channel=True)
    nodes = [helper.make_node("Conv", ["x", "conv_w"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["h"], ["f"]),
             helper.make_node("MatMul", ["f", "mm_w"], ["y"])]
    src = save(tmp_path, "convmm", nodes, ["n", c, 4, 4], {"conv_w": conv_w, "mm_w": mm_w})
    x = extreme_inputs((4, c, 4, 4))
    for per_channel in (False, True):
        model = import_onnx(src).quantize_weights(Quantizer(per_channel=per_channel))
        out = op.export_onnx(quantize_activations(model, x), tmp_path / f"static{per_channel}.onnx")
        assert {r["weight"]: r["form"] for r in quantized_ops(out)} == {"conv_w": "static int8", "mm_w": "static int8"}
        inits = initializers(out)
        for name in ("conv_w", "mm_w"):
            codes, zp, _ = stored_weight(inits, name)
            assert codes.dtype == np.uint8 and np.all(zp == 128)
            assert codes.min() == 1 and codes.max() == 255  # +-127 codes: both extremes present
        assert np.isclose(inits["x_scale"], (HI - LO) / 255) and inits["x_zero_point"] == 51

        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        got = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        fused = [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
        assert "QLinearConv" in fused and "QLinearMatMul" in fused
        expected = ReferenceEvaluator(str(out)).run(None, {"x": x})[0]
        last = next(node for node in onnx.load(str(out)).graph.node if node.output[0] == "y")
        assert last.op_type == "DequantizeLinear"
        step = float(inits[last.input[1]])  # the output's quantization step
        # the fused kernels requantize their int32 sums once, the reference in float: one output step apart
        np.testing.assert_allclose(got, expected, rtol=0, atol=step * 1.01)


@pytest.mark.parametrize(("lowest", "value"), [(1, op.QuantValue.Q8S), (0, op.QuantValue.Q8F)])
def test_uint8_codes_with_zero_point_128_import_as_burn_s_symmetric_scheme_where_it_holds_them(
        lowest, value, tmp_path):
    # no scheme metadata (a file another tool wrote): Q8S holds codes -127..127 (Burn's symmetric
    # int8), so a uint8 code 0 (-128 after the zero point) needs Q8F
    codes = np.array([[lowest, 128, 255], [200, 100, 30]], np.uint8)
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "s", "z"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    src = save(tmp_path, "u8", nodes, ["n", 2], {"w_q": codes, "s": np.float32(0.1), "z": np.uint8(128)})
    param = dict(import_onnx(src).named_params())["w_q"]
    assert param.lazy_dtype() is op.DType.QFloat and param.base().into_data().scheme.value is value
    np.testing.assert_array_equal(param.val().to_numpy(), (codes.astype(np.float32) - 128) * np.float32(0.1))


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_a_gemm_trans_b_dynamic_export_imports_as_qfloat_and_converts_back_byte_for_byte(per_channel, tmp_path):
    from onnxparam import convert

    w = extreme_weight((8, 32), 0, per_channel)  # [N, K], transB=1
    c = np.linspace(-1, 1, 8, dtype=np.float32)
    src = save(tmp_path, "gemm", [helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)], ["n", 32],
               {"w": w, "c": c})
    quantized = import_onnx(src).quantize_weights(Quantizer(per_channel=per_channel))
    out = op.export_onnx(quantized, tmp_path / "q.onnx")  # Transpose(uint8 codes) -> MatMulInteger

    back = import_onnx(out)
    params = dict(back.named_params())
    assert params["w"].lazy_dtype() is op.DType.QFloat and sorted(params) == ["c", "w"]
    np.testing.assert_array_equal(params["w"].val().to_numpy(), dict(quantized.named_params())["w"].val().to_numpy())
    x = extreme_inputs((4, 32))
    np.testing.assert_allclose(back(op.Tensor.from_numpy(x)).to_numpy(), session(str(out)).run(None, {"x": x})[0],
                               rtol=1e-6, atol=1e-6)
    convert.convert(out, tmp_path / "q.bpk")
    convert.convert(tmp_path / "q.bpk", tmp_path / "back.onnx", graph=out)
    expected = initializers(out)
    assert {k: v.tobytes() for k, v in initializers(tmp_path / "back.onnx").items()} == {
        k: v.tobytes() for k, v in expected.items()}


def test_int8_kernel_weights_opt_in_keeps_burn_s_codes_and_warns_where_the_cpu_is_not_known_safe(
        monkeypatch, tmp_path):
    import warnings

    from onnxparam.core.errors import QuantizationWarning
    from onnxparam.quant import QdqOptions, _qdq_forms, qdq_options

    this_cpu_exact = _qdq_forms.cpu_runs_int8_kernels_exactly()
    k, n = 64, 8
    w = extreme_weight((k, n), 1, per_channel=False)
    src = save(tmp_path, "mm", [helper.make_node("MatMul", ["x", "w"], ["y"])], ["n", k], {"w": w})
    model = import_onnx(src).quantize_weights(Quantizer())
    monkeypatch.setattr(_qdq_forms, "cpu_runs_int8_kernels_exactly", lambda: False)
    with qdq_options(kernel_weights="int8"), pytest.warns(QuantizationWarning, match=r"'w'.*saturating int16"):
        out = op.export_onnx(model, tmp_path / "q.onnx")
    monkeypatch.setattr(_qdq_forms, "cpu_runs_int8_kernels_exactly", lambda: True)
    with qdq_options(kernel_weights="int8"), warnings.catch_warnings():
        warnings.simplefilter("error")
        op.export_onnx(model, tmp_path / "q2.onnx")

    # ORT's quantize_dynamic layout: INT8 codes (numpy round(w / (max|w| / 127))), no zero point
    (mmi,) = [node for node in onnx.load(str(out)).graph.node if node.op_type == "MatMulInteger"]
    assert len(mmi.input) == 3
    inits = initializers(out)
    codes, scale = inits["w"], inits[next(name for name in inits if name.startswith("w_scale"))]
    assert codes.dtype == np.int8
    np.testing.assert_array_equal(codes, np.round(w / (np.abs(w).max() / 127)).astype(np.int8))
    # what ORT computes with it: exact where u8 x s8 kernels add into int32 (VNNI), else possibly the
    # saturated VPMADDUBSW sums: the reason the default stores uint8 codes
    x = extreme_inputs((4, k))
    xq, xs, xz = dynamic_quantize_linear(x)
    exact = (xq.astype(np.int64) @ codes.astype(np.int64) - int(xz) * codes.astype(np.int64).sum(0))
    saturated = vpmaddubsw_model(xq, codes) - int(xz) * codes.astype(np.int64).sum(0)
    got = session(str(out)).run(None, {"x": x})[0]
    close = [np.allclose(got, acc.astype(np.float32) * (xs * scale), rtol=1e-6, atol=1e-6)
             for acc in (exact, saturated)]
    assert close[0] or close[1]
    if this_cpu_exact:  # VNNI in this machine's own flags
        assert close[0]
    with pytest.raises(ValueError, match="kernel_weights must be one of uint8, int8"):
        QdqOptions(kernel_weights="s8")
