"""Every quantized export is a file ONNX Runtime loads, and a weight the export leaves float keeps
what it should: its original values when the float module is known (``QdqOptions.float_module``,
what ``onnxparam quantize`` passes), the dequantized ones otherwise; the CLI says when nothing got
smaller or faster, and the static per-op table names the op that takes each weight.

Oracles: plain ONNX Runtime (session creation, and runs of the float source file), ``onnx.checker``
with shape inference, numpy's symmetric quantization formulas (``s = max|w| / 127`` per tensor,
``max|w| / 7`` per block of 32), the source file's initializers, and the source graph's node names.
"""

from __future__ import annotations

import itertools
import json
import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.cli import main
from onnxparam.core.errors import OnnxParamError
from onnxparam.quant import QuantizationWarning, Quantizer, QuantScheme, QuantValue, qdq_options, quantized_ops

OPSETS = (13, 15, 17, 19, 21)
SCHEMES = ("Q8S", "Q8F", "Q4S", "Q4F")
GRIDS = {"per-tensor": (None, False), "block 32": ((32,), False), "block 16": ((16,), False),
         "block 32,1": ((32, 1), False), "per-channel": (None, True)}
X_SHAPE = (2, 8, 95)


def session(path):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def mixed_model(path, opset: int):
    """A Conv (weight [16, 8, 32]), a Mul ([1, 16, 64]) and an Add ([1, 1, 64], the magika
    ``Dense_0/Reshape:0`` case) weight, a MatMul ([64, 64]) and two Gemms (transB 0 and 1)."""
    rng = np.random.default_rng(opset)
    weights = {"wc": (16, 8, 32), "bc": (16,), "m": (1, 16, 64), "a": (1, 1, 64), "wm": (64, 64),
               "g1": (1024, 64), "c1": (64,), "g2": (32, 64), "c2": (32,)}
    inits = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32), k) for k, s in weights.items()]
    nodes = [helper.make_node("Conv", ["x", "wc", "bc"], ["y1"], name="conv"),
             helper.make_node("Mul", ["y1", "m"], ["y2"], name="mul"),
             helper.make_node("Add", ["y2", "a"], ["y3"], name="add"),
             helper.make_node("MatMul", ["y3", "wm"], ["y4"], name="matmul"),
             helper.make_node("Flatten", ["y4"], ["y5"], axis=1),
             helper.make_node("Gemm", ["y5", "g1", "c1"], ["y6"], name="gemm"),
             helper.make_node("Gemm", ["y6", "g2", "c2"], ["y"], name="gemm_t", transB=1)]
    graph = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(X_SHAPE))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed")
    return {opset: mixed_model(folder / f"mixed{opset}.onnx", opset) for opset in OPSETS}


def export_quantized(src, out, scheme: str, grid: str, prefer: str, float_module: bool = False):
    block, per_channel = GRIDS[grid]
    model = op.import_onnx(src)
    # NOTE: the Add / Mul constants are no weights (issue 27: left float by default); a group that
    # names every param quantizes them too, which these export checks need
    quantized = model.quantize_weights_group(Quantizer(QuantScheme(QuantValue[scheme], block_size=block),
                                                       per_channel=per_channel), op.ParamGroup.all())
    with qdq_options(prefer=prefer, float_module=model if float_module else None):
        return op.export_onnx(quantized, out)


def check_loads(src, out, scheme, grid, prefer):
    """ORT loads the export and runs it to the source's output shape, and onnx.checker (with
    shape inference) accepts it; or the export raised a library error naming a param."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QuantizationWarning)  # float fallbacks say so; not the point here
            export_quantized(src, out, scheme, grid, prefer)
    except OnnxParamError as e:  # allowed, if it names the param
        assert any(name in str(e) for name in ("wc", "'m'", "'a'", "wm", "g1", "g2")), str(e)
        return
    x = np.random.default_rng(0).normal(size=X_SHAPE).astype(np.float32)
    (y,) = session(out).run(None, {"x": x})
    assert y.shape == session(src).run(None, {"x": x})[0].shape
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("grid", ["per-tensor", "block 32"])
def test_onnx_runtime_loads_every_quantized_export_of_matmul_gemm_conv_add_and_mul_weights(
        sources, opset, scheme, grid, tmp_path):
    check_loads(sources[opset], tmp_path / "q.onnx", scheme, grid, "size")


@pytest.mark.slow
@pytest.mark.parametrize("opset", OPSETS)
def test_onnx_runtime_loads_the_quantized_export_for_every_scheme_grid_and_preference(sources, opset, tmp_path):
    for scheme, grid, prefer in itertools.product(SCHEMES, GRIDS, ("speed", "size")):
        check_loads(sources[opset], tmp_path / f"{scheme}-{grid}-{prefer}.onnx", scheme, grid, prefer)


def fp16_cast_model(path, opset: int):
    """Float16 weights each followed by ``Cast(to=float)`` (an fp16-converted model with float32
    inputs): a Conv ``[8, 4, 3, 3]`` weight and a MatMul ``[64, 16]`` one."""
    rng = np.random.default_rng(opset)
    inits = [numpy_helper.from_array(rng.normal(size=(8, 4, 3, 3)).astype(np.float16), "wc16"),
             numpy_helper.from_array(rng.normal(size=(64, 16)).astype(np.float16), "wm16")]
    nodes = [helper.make_node("Cast", ["wc16"], ["wc"], to=TensorProto.FLOAT),
             helper.make_node("Conv", ["x", "wc"], ["h"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Reshape", ["h", "shape"], ["h2"]),
             helper.make_node("Cast", ["wm16"], ["wm"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["h2", "wm"], ["y"], name="matmul")]
    inits.append(numpy_helper.from_array(np.array([2, 64], np.int64), "shape"))
    graph = helper.make_graph(nodes, "fp16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("prefer", ["speed", "size"])
def test_onnx_runtime_loads_every_quantized_export_of_float16_weights_cast_to_float(opset, scheme, prefer, tmp_path):
    src = fp16_cast_model(tmp_path / "fp16.onnx", opset)
    out = tmp_path / "q.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationWarning)
        export_quantized(src, out, scheme, "per-tensor", prefer, float_module=True)
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    x = np.random.default_rng(0).normal(size=(2, 4, 2, 4)).astype(np.float32)
    expected = session(src).run(None, {"x": x})[0]
    (y,) = session(out).run(None, {"x": x})
    assert y.shape == expected.shape
    original, written = source_weights(src), source_weights(out)
    for name in ("wc16", "wm16"):  # a weight kept float holds the original float16 bytes
        if written[name].dtype.kind == "f":
            assert written[name].dtype == np.float16 and written[name].tobytes() == original[name].tobytes(), name
    if prefer == "speed":  # an uncalibrated Conv's weight stays float: the conv computes as in the source
        assert written["wc16"].dtype == np.float16
        rows = {r["weight"]: r for r in quantized_ops(out)}
        assert rows["wc16"]["op"] == "Conv" and rows["wc16"]["form"] == "float"


def test_a_blocked_4bit_add_weight_below_opset_21_is_written_float_with_its_reason(sources, tmp_path):
    with pytest.warns(QuantizationWarning) as caught:
        out = export_quantized(sources[15], tmp_path / "q.onnx", "Q4S", "block 32", "size")
    assert any(re.search(r"'a' .*4-bit.*Add '/Add' has no 4-bit form below opset 21", str(w.message)) for w in caught)
    rows = {r["weight"]: r for r in quantized_ops(out)}
    assert rows["a"]["op"] == "Add" and rows["a"]["form"] == "float"
    assert takes_weight(onnx.load(str(out)), rows["a"]["node"], "Add", "a")
    assert "4-bit below opset 21" in rows["a"]["reason"]
    assert f"Add {rows['a']['node']!r} has no 4-bit form" in rows["a"]["reason"]  # the written graph's name
    inits = {t.name: t for t in onnx.load(str(out)).graph.initializer}
    assert inits["a"].data_type == TensorProto.FLOAT
    # without the float module: the dequantized values, numpy's symmetric 4-bit per block of 32
    a = numpy_helper.to_array({t.name: t for t in onnx.load(str(sources[15])).graph.initializer}["a"])
    blocks = a.reshape(-1, 32)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(7)
    expected = (np.clip(np.round(blocks / scale), -8, 7) * scale).reshape(a.shape)
    np.testing.assert_allclose(numpy_helper.to_array(inits["a"]), expected, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(numpy_helper.to_array(inits["a"]), a)


def takes_weight(model: onnx.ModelProto, node_name: str, op_type: str, weight: str) -> bool:
    """Whether the node ``node_name`` of ``model`` is an ``op_type`` one of whose inputs is the
    initializer ``weight``, directly or through ``QuantizeLinear`` / ``DequantizeLinear`` nodes."""
    producers = {out: n for n in model.graph.node for out in n.output}

    def reaches(value: str) -> bool:
        if value == weight:
            return True
        n = producers.get(value)
        return n is not None and n.op_type in ("QuantizeLinear", "DequantizeLinear") and reaches(n.input[0])

    found = [n for n in model.graph.node if n.name == node_name]
    return len(found) == 1 and found[0].op_type == op_type and any(reaches(i) for i in found[0].input)


def source_weights(path) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("opset, scheme, grid, prefer", [
    (15, "Q4S", "block 32", "size"),  # 4-bit without a MatMulNBits form: float by force
    (13, "Q8S", "block 32", "size"),  # blocks need opset 21: the scale grid has no ONNX form
    (17, "Q8S", "per-tensor", "speed"),  # uncalibrated Conv / Gemm: float for speed
])
def test_weights_written_float_keep_their_original_values_given_the_float_module(
        sources, opset, scheme, grid, prefer, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationWarning)
        out = export_quantized(sources[opset], tmp_path / "q.onnx", scheme, grid, prefer, float_module=True)
    original, written = source_weights(sources[opset]), source_weights(out)
    floats = [name for name in ("wc", "m", "a", "wm", "g1", "g2")
              if written[name].dtype == np.float32 and written[name].shape == original[name].shape]
    assert floats, "some weight was written float"
    for name in floats:
        assert written[name].tobytes() == original[name].tobytes(), name
    assert {r["weight"] for r in quantized_ops(out) if r["form"] == "float"} <= set(floats)


def conv_only_model(path):
    """Three 3x3 convs (8 -> 32 -> 32 -> 16 channels, ReLU between): no weight has a faster
    quantized form without calibration data."""
    rng = np.random.default_rng(3)
    shapes = {"w1": (32, 8, 3, 3), "b1": (32,), "w2": (32, 32, 3, 3), "b2": (32,), "w3": (16, 32, 3, 3), "b3": (16,)}
    inits = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32) * 0.2, k) for k, s in shapes.items()]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["h2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Relu", ["h2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["y"], pads=[1, 1, 1, 1], name="conv3")]
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def run_main(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("scheme", ["q8s", "q4s"])
def test_quantizing_a_conv_only_model_by_default_gives_the_float_model_and_says_so(scheme, tmp_path, capsys):
    src = conv_only_model(tmp_path / "convs.onnx")
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--scheme", scheme)
    assert code == 0, err
    assert "ops:       3 with quantized weights: 3 Conv float" in stdout
    assert "nothing got smaller or faster" in err and "3 Conv" in err
    assert "--calibrate INPUTS.npz" in err and "--prefer size" in err
    x = np.random.default_rng(0).normal(size=(1, 8, 16, 16)).astype(np.float32)
    assert np.array_equal(session(out).run(None, {"x": x})[0], session(src).run(None, {"x": x})[0])
    original, written = source_weights(src), source_weights(out)
    assert all(written[k].tobytes() == original[k].tobytes() for k in original)


def test_prefer_size_makes_the_conv_only_model_smaller_with_int8_weights(tmp_path, capsys):
    src = conv_only_model(tmp_path / "convs.onnx")
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--prefer", "size")
    assert code == 0, err
    assert "3 Conv dequantize" in stdout and "nothing got smaller" not in err
    types = {t.name: t.data_type for t in onnx.load(str(out)).graph.initializer}
    assert types["w1"] == types["w2"] == types["w3"] == TensorProto.INT8
    assert out.stat().st_size < 0.35 * src.stat().st_size  # 4 bytes -> 1 per weight value (+ metadata)
    # the source file with numpy's symmetric int8 per tensor (s = max|w| / 127) applied to its weights
    model = onnx.load(str(src))
    for t in model.graph.initializer:
        if t.name.startswith("w"):
            w = numpy_helper.to_array(t)
            s = np.abs(w).max() / np.float32(127)
            t.CopyFrom(numpy_helper.from_array((np.clip(np.round(w / s), -127, 127) * s).astype(np.float32), t.name))
    reference = tmp_path / "dequantized.onnx"
    onnx.save(model, reference)
    x = np.random.default_rng(0).normal(size=(1, 8, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(session(out).run(None, {"x": x})[0], session(reference).run(None, {"x": x})[0],
                               rtol=1e-4, atol=1e-4)


def test_the_static_table_names_the_add_that_takes_a_quantized_weight(tmp_path, capsys):
    rng = np.random.default_rng(4)
    # NOTE: 256 columns: smaller ones stay float, their quantized form (with its nodes) not smaller (issue 27)
    inits = [numpy_helper.from_array(rng.normal(size=(16, 256)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(size=(1, 256)).astype(np.float32), "shift")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="project"),
             helper.make_node("Add", ["h", "shift"], ["y"], name="shift_add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 256])], inits)
    src = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    np.savez(tmp_path / "calib.npz", x=rng.normal(size=(16, 16)).astype(np.float32))
    out = tmp_path / "q.onnx"
    # NOTE: 'shift' feeds an Add, no weight: quantized only when --include names it (issue 27)
    code, stdout, err = run_main(capsys, "quantize", src, out, "--calibrate", tmp_path / "calib.npz",
                                 "--include", "^(w|shift)$")
    assert code == 0, err
    rows = {r["weight"]: r for r in quantized_ops(out)}
    written = onnx.load(str(out))
    assert rows["shift"]["op"] == "Add" and takes_weight(written, rows["shift"]["node"], "Add", "shift")
    assert rows["w"]["op"] == "MatMul" and takes_weight(written, rows["w"]["node"], "MatMul", "w")
    assert "QuantizeLinear" not in stdout.split("ops:")[1].splitlines()[0]
    assert any(line.split()[:3] == [rows["shift"]["node"], "Add", "shift"] for line in stdout.splitlines())


def test_a_file_barely_smaller_gets_a_warning_naming_the_float_ops_and_the_ways_out(tmp_path, capsys):
    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array(rng.normal(size=(64, 64, 3, 3)).astype(np.float32), "big"),
             numpy_helper.from_array(rng.normal(size=(64, 8)).astype(np.float32), "small")]
    nodes = [helper.make_node("Conv", ["x", "big"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["h"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"], axis=1),
             helper.make_node("MatMul", ["f", "small"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)
    src = tmp_path / "big_conv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out)
    assert code == 0, err
    assert "1 Conv float, 1 MatMul dynamic int8" in stdout
    ratio = out.stat().st_size / src.stat().st_size
    assert ratio > 0.9  # the float conv is nearly all of the file
    assert f"little got smaller: 1 of 2 ops keep float weights (1 Conv; original values); the output is {ratio:.0%}" in err
    assert "--calibrate INPUTS.npz" in err and "--prefer size" in err
    inits = source_weights(out)
    assert inits["big"].tobytes() == source_weights(src)["big"].tobytes()


def test_4bit_weights_without_a_4bit_form_at_the_opset_are_named_with_the_way_out(sources, tmp_path, capsys):
    out = tmp_path / "q.onnx"
    # NOTE: --include names the Mul / Add constants, which are no weights (issue 27)
    code, stdout, err = run_main(capsys, "quantize", sources[15], out, "--scheme", "q4s", "--block-size", "32",
                                 "--prefer", "size", "--include", ".")
    assert code == 0, err
    rows = quantized_ops(out)
    # NOTE: 'a' ([1, 1, 64]) is no longer in the table: 4-bit codes + scales + its nodes are not smaller
    # than its 256 float bytes, so it stays float before export (issue 27); it is still written as it was
    assert {r["weight"] for r in rows if r["form"] == "float"} >= {"wc", "m"}
    assert "have no quantized form here (reasons above)" in err and "--scheme q8s" in err
    session(out)  # ORT loads it
    original, written = source_weights(sources[15]), source_weights(out)
    for name in ("wc", "m", "a"):
        assert written[name].tobytes() == original[name].tobytes(), name


def recurrent_model(path, op_type: str):
    """One LSTM / GRU / RNN (input 16, hidden 32) with its W, R and B initializers (ONNX operator
    spec: ``[1, gates * 32, 16]``, ``[1, gates * 32, 32]``, ``[1, 2 * gates * 32]``), then a MatMul [32, 16]
    (large enough that its int8 form is smaller)."""
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op_type]
    rng = np.random.default_rng(5)
    shapes = {"W": (1, gates * 32, 16), "R": (1, gates * 32, 32), "B": (1, 2 * gates * 32), "wm": (32, 16)}
    inits = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32) * 0.2, k) for k, s in shapes.items()]
    nodes = [helper.make_node(op_type, ["x", "W", "R", "B"], ["seq"], hidden_size=32, name="rnn"),
             helper.make_node("Squeeze", ["seq", "one"], ["h"]),
             helper.make_node("MatMul", ["h", "wm"], ["y"], name="matmul")]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    graph = helper.make_graph(nodes, "rnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 2, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 2, 16])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("op_type", ["LSTM", "GRU", "RNN"])
def test_default_quantize_keeps_recurrent_weights_float_and_bit_identical_with_the_reason(op_type, tmp_path, capsys):
    src = recurrent_model(tmp_path / "rnn.onnx", op_type)
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out)
    assert code == 0, err
    original, written = source_weights(src), source_weights(out)
    for name in ("W", "R", "B"):  # ORT has no integer LSTM: a weight-only DequantizeLinear only costs time
        assert written[name].dtype == np.float32 and written[name].tobytes() == original[name].tobytes(), name
    assert not any(n.op_type == "DequantizeLinear" and n.input[0] in ("W", "R", "B")
                   for n in onnx.load(str(out)).graph.node)
    rows = {r["weight"]: r for r in quantized_ops(out)}
    for name in ("W", "R"):
        assert rows[name]["op"] == op_type and rows[name]["form"] == "float"
        assert f"no integer {op_type} kernel" in rows[name]["reason"]
    # the bias B is no weight: never quantized by default (issue 27), its reason in the metadata
    kept = {r["weight"]: r["reason"] for r in json.loads(
        {p.key: p.value for p in onnx.load(str(out)).metadata_props}["onnxparam.quant.kept_float"])}
    assert "B" not in rows and "a bias" in kept["B"] and "B is float: a bias" in stdout
    assert rows["wm"]["form"] != "float"  # the MatMul still gets its integer form
    x = np.random.default_rng(0).normal(size=(5, 2, 16)).astype(np.float32)
    expected = session(src).run(None, {"x": x})[0]
    # NOTE: 0.15: on AVX2-only CPUs ORT's u8s8 int8 GEMM saturates some pair sums (several steps off)
    np.testing.assert_allclose(session(out).run(None, {"x": x})[0], expected, atol=0.15 * np.abs(expected).max())
