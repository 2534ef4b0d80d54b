"""``onnxparam quantize --block-size``: a block size that divides no weight says so (naming the
weights and their dims), and blocked 8-bit weights an ``.onnx`` output cannot hold at the
model's opset (``DequantizeLinear`` takes blocked scales from opset 21: ONNX operator spec,
DequantizeLinear-21) are refused instead of being written float32 and counted as quantized.
Oracles: the weights' shapes (what divides what), the ONNX spec's opset of blocked scales, and
the written file's own initializers and nodes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_run import run_cli
from onnxparam.core.quant_scheme import QuantScheme, QuantValue
from onnxparam.core.tensor import quantize
from onnxparam.quant._qdq_layout import unwritable_blocks, weight_layout


def _mlp(path, opset: int, sizes=(64, 128, 32), table: bool = False):
    """``x @ W0 -> Relu -> @ W1``: two MatMul weights of ``sizes``; ``table``: plus a [4, 32]
    table gathered by a constant index and added (a weight of no integer-kernel op)."""
    rng = np.random.default_rng(3)
    nodes, inits, h = [], [], "x"
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        inits.append(numpy_helper.from_array((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [h, f"w{i}"], [f"m{i}"]))
        h = f"m{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [h], [f"r{i}"]))
            h = f"r{i}"
    if table:
        inits += [numpy_helper.from_array(rng.normal(size=(4, sizes[-1])).astype(np.float32), "table"),
                  numpy_helper.from_array(np.array([1], np.int64), "row")]
        nodes += [helper.make_node("Gather", ["table", "row"], ["t"]), helper.make_node("Add", [h, "t"], ["y"])]
        h = "y"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", sizes[0]])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["n", sizes[-1]])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def test_a_block_size_dividing_no_weight_names_the_weights_and_dims(tmp_path):
    src = _mlp(tmp_path / "mlp.onnx", 17, table=True)
    code, _, err = run_cli("quantize", src, tmp_path / "q.onnx", "--block-size", "7")
    assert code != 0
    # 128 and 32 (the weights' last dims) are not multiples of 7; the table stayed float for its
    # role, which is said after the cause, not instead of it
    assert "no weight's last dim is divisible by 7 (w0 [64, 128], w1 [128, 32]); the others stayed float: table:" in err
    assert not (tmp_path / "q.onnx").exists()


def test_blocked_8_bit_below_opset_21_is_refused_not_written_float_and_counted_as_quantized(tmp_path):
    src = _mlp(tmp_path / "mlp.onnx", 17)
    code, out, err = run_cli("quantize", src, tmp_path / "q.onnx", "--block-size", "8")
    assert code != 0
    assert "every weight it quantized (w0, w1) would be written as a float32 initializer" in err
    assert "DequantizeLinear takes blocked scales from opset 21, the model's opset is 17" in err
    assert "nothing would get smaller" in err and "nothing was written" in err
    assert "quantized:" not in out
    assert not (tmp_path / "q.onnx").exists()


def test_blocked_8_bit_at_opset_21_is_written_as_blocked_int8(tmp_path):
    src = _mlp(tmp_path / "mlp.onnx", 21)
    code, out, err = run_cli("quantize", src, tmp_path / "q.onnx", "--block-size", "8", "--prefer", "size")
    assert code == 0, err
    assert "quantized: 2 of 2 params" in out
    model = onnx.load(str(tmp_path / "q.onnx"))
    init = {i.name: i for i in model.graph.initializer}
    assert init["w0"].data_type == TensorProto.INT8 and init["w1"].data_type == TensorProto.INT8
    blocks = {n.input[0]: {a.name: helper.get_attribute_value(a) for a in n.attribute}
              for n in model.graph.node if n.op_type == "DequantizeLinear"}
    assert blocks["w0"]["block_size"] == 8 and blocks["w1"]["block_size"] == 8
    assert list(init["w0_scale"].dims) == [64, 128 // 8]  # one scale per 8 along the last axis


@pytest.mark.parametrize("shape, block", [((16, 48), (8,)), ((16, 48), (16,)), ((48, 16), (16,)), ((32, 48), (8, 8)),
                                          ((16, 48), (1, 16)), ((4, 8, 16), (8,)), ((16,), (8,))])
@pytest.mark.parametrize("opset", [17, 21])
def test_unwritable_blocks_agrees_with_the_layout_the_export_computes(shape, block, opset):
    """The shape-only check the CLI runs before exporting says "no DequantizeLinear form" exactly
    when the exporter's layout of real codes is ``None`` (8-bit)."""
    scheme = QuantScheme(QuantValue.Q8S, block_size=block)
    qt = quantize(np.random.default_rng(0).normal(size=shape).astype(np.float32), scheme)
    assert (unwritable_blocks(shape, scheme, opset) is not None) == (weight_layout(qt, opset) is None)
