"""Gradient rules of the sequence and optional operators and of ``Unique``
(``onnxparam/autodiff/_rules_sequence.py``, ``SequenceMap``: ``_rules_seqmap.py``), and the up-front refusal of the operators without
one (``SwiGLU``, which ONNX Runtime does not run).

Each case is a small ONNX model whose batch dim ``N`` is symbolic, differentiated at two input
shapes with one training session (``check_op`` of ``tests/test_grad_more_rules.py``): oracles
are central finite differences in float64 of the same loss on plain ONNX Runtime runs of the
original file with one initializer entry perturbed, and, where PyTorch has the computation
(``split`` / ``cat`` / ``stack``), torch autograd in float64. ``torch.unique`` has no gradient:
``Unique`` is checked by finite differences only (its input has no ties, so the output's size
is locally constant).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxparam as op
from onnxparam.autodiff import GRADIENT_OPS, NOT_DIFFERENTIABLE, check_gradients
from test_grad_more_rules import RNG, check_op


def _scales(*names, size=3):
    return {n: RNG.uniform(0.5, 1.5, (size,)) for n in names}


def test_construct_then_concat_and_stack():
    """``SequenceConstruct`` of two scaled copies, concatenated along the dynamic axis and
    stacked along a new last axis: both gradients of the one sequence are summed."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["a"]),
             helper.make_node("Mul", ["x", "t"], ["b"]),
             helper.make_node("SequenceConstruct", ["a", "b"], ["seq"]),
             helper.make_node("ConcatFromSequence", ["seq"], ["c"], axis=0),
             helper.make_node("ConcatFromSequence", ["seq"], ["d"], axis=-1, new_axis=1),
             helper.make_node("ReduceSum", ["d", "minus1"], ["d1"], keepdims=0),
             helper.make_node("Concat", ["c", "d1"], ["cd"], axis=0),
             helper.make_node("Mul", ["cd", "cd"], ["y"])]

    def torch_fn(x, s, t, minus1):
        import torch

        a, b = x * s, x * t
        cd = torch.cat([torch.cat([a, b], 0), torch.stack([a, b], -1).sum(-1)], 0)
        return cd * cd

    inits = {**_scales("s", "t"), "minus1": np.array([-1], np.int64)}
    check_op(nodes, ["N", 3], [(2, 3), (4, 3)], inits, 17, torch_fn=torch_fn)


def test_split_then_read_at_negative_and_positive_positions():
    """``SplitToSequence`` with explicit lengths; ``SequenceAt(-1)`` and ``SequenceAt(0)`` of the
    same sequence (two gradient sequences summed, zeros elsewhere)."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("SplitToSequence", ["xs", "split"], ["seq"], axis=1),
             helper.make_node("SequenceAt", ["seq", "last"], ["a"]),
             helper.make_node("SequenceAt", ["seq", "first"], ["b"]),
             helper.make_node("Mul", ["a", "b"], ["ab"]),
             helper.make_node("Mul", ["ab", "t"], ["y"])]

    def torch_fn(x, s, t, split, last, first):
        import torch

        parts = torch.split(x * s, split.tolist(), dim=1)
        return parts[-1] * parts[0] * t

    inits = {"s": RNG.uniform(0.5, 1.5, (4,)), "t": RNG.uniform(0.5, 1.5, (3,)),
             "split": np.array([1, 3], np.int64), "last": np.array(-1, np.int64), "first": np.array(0, np.int32)}
    check_op(nodes, ["N", 4], [(2, 4), (5, 4)], inits, 17, torch_fn=torch_fn)


def test_split_along_the_dynamic_axis_insert_erase_and_stack():
    """``SplitToSequence`` into ``N`` rows (``keepdims=0``: as many elements as the batch),
    ``SequenceInsert`` at ``-1`` (before the last), ``SequenceErase`` at ``0``, of the last (no
    position) and at ``-3`` (an int32 of shape ``[1]``), stacked back: the positions move with
    the length."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("SplitToSequence", ["xs"], ["seq"], axis=0, keepdims=0),
             helper.make_node("Mul", ["t", "t"], ["tt"]),
             helper.make_node("SequenceInsert", ["seq", "tt", "minus1"], ["ins"]),
             helper.make_node("SequenceInsert", ["ins", "t"], ["ins2"]),
             helper.make_node("SequenceErase", ["ins2", "zero"], ["er"]),
             helper.make_node("SequenceErase", ["er"], ["er2"]),
             helper.make_node("SequenceErase", ["er2", "minus3"], ["er3"]),
             helper.make_node("ConcatFromSequence", ["er3"], ["y"], axis=0, new_axis=1)]

    def torch_fn(x, s, t, minus1, zero, minus3):
        import torch

        rows = list(torch.unbind(x * s, 0))
        rows.insert(len(rows) - 1, t * t)
        rows.append(t)
        rows = rows[1:-1]
        rows.pop(len(rows) - 3)
        return torch.stack(rows, 0)

    inits = {**_scales("s", "t"), "minus1": np.array(-1, np.int64), "zero": np.array(0, np.int64),
             "minus3": np.array([-3], np.int32)}
    check_op(nodes, ["N", 3], [(3, 3), (5, 3)], inits, 17, torch_fn=torch_fn)


def test_optional_wrap_and_unwrap():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Optional", ["xs"], ["o"]),
             helper.make_node("OptionalGetElement", ["o"], ["a"]),
             helper.make_node("SequenceConstruct", ["a", "xs"], ["seq"]),
             helper.make_node("Optional", ["seq"], ["os"]),
             helper.make_node("OptionalGetElement", ["os"], ["seq2"]),
             helper.make_node("ConcatFromSequence", ["seq2"], ["c"], axis=1),
             helper.make_node("Mul", ["c", "c"], ["y"])]
    check_op(nodes, ["N", 3], [(2, 3), (4, 3)], _scales("s"), 18)


@pytest.mark.parametrize("axis", [None, 0, -1])
def test_unique_scatters_the_gradient_to_first_occurrences(axis):
    """``Y = X[indices]``: a ``Unique`` of distinct values (sorted, so the output's order comes
    from the values) or rows / columns; the gradient goes to the first occurrence."""
    kw = {} if axis is None else {"axis": axis}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Unique", ["xs"], ["u"], sorted=1, **kw),
             helper.make_node("Mul", ["u", "u"], ["y"])]
    check_op(nodes, ["N", 3], [(2, 3), (4, 3)], _scales("s"), 17)


def test_unique_with_all_outputs_and_ties_keeps_the_first_occurrence():
    """``X`` with repeated rows: only the first of each pair gets the gradient; the finite
    difference of a first occurrence is taken where the tie holds on both sides (moving the
    rows together, through ``s``)."""
    nodes = [helper.make_node("Concat", ["x", "x"], ["xx"], axis=0),
             helper.make_node("Mul", ["xx", "s"], ["xs"]),
             helper.make_node("Unique", ["xs"], ["u", "idx", "inv", "cnt"], axis=0, sorted=0),
             helper.make_node("Mul", ["u", "u"], ["y"])]
    check_op(nodes, ["N", 3], [(2, 3), (3, 3)], _scales("s"), 17)


def _one_node_model(op_type, inputs, outputs, opset, **attrs):
    graph = helper.make_graph([helper.make_node(op_type, [n for n, _ in inputs], [n for n, _ in outputs], **attrs)],
                              "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_onnx_runtime_does_not_run_swiglu_and_the_check_says_so():
    """The oracle for the refusal: ONNX Runtime itself cannot build a session for ``SwiGLU``
    (when it can, this fails: write the rule). The check names the node and says why."""
    model = _one_node_model("SwiGLU", [("a", [2, 4]), ("b", [2, 4])], [("y", [2, 4])], 28)
    with pytest.raises(Exception, match="Swish|SwiGLU"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert "SwiGLU" not in GRADIENT_OPS and "SwiGLU" not in NOT_DIFFERENTIABLE
    from onnx import numpy_helper

    model.graph.initializer.append(numpy_helper.from_array(np.ones((2, 4), np.float32), "b"))
    del model.graph.input[1]
    module = op.import_onnx(model)
    x = op.Tensor.from_numpy(np.ones((2, 4), np.float32))
    missing = check_gradients(lambda m, a: m(a).sum(), module, x)
    assert [(m.op, "ONNX Runtime does not implement SwiGLU" in m.reason) for m in missing] == [("SwiGLU", True)]


def test_sequence_map_with_a_whole_tensor_and_an_outer_param():
    """``SequenceMap`` over the rows of ``x * s`` (as many as the batch) with a tensor ``u``
    passed whole and a param ``c`` the body reads from outside: ``row^2 * u + c``; the
    gradients of ``u`` and ``c`` are summed over the rows."""
    body = helper.make_graph([helper.make_node("Mul", ["e", "e"], ["ee"]),
                              helper.make_node("Mul", ["ee", "uu"], ["f"]),
                              helper.make_node("Add", ["f", "c"], ["out"])], "body",
                             [helper.make_tensor_value_info("e", TensorProto.DOUBLE, None),
                              helper.make_tensor_value_info("uu", TensorProto.DOUBLE, None)],
                             [helper.make_tensor_value_info("out", TensorProto.DOUBLE, None)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("SplitToSequence", ["xs"], ["seq"], axis=0, keepdims=0),
             helper.make_node("SequenceMap", ["seq", "u"], ["mapped"], body=body),
             helper.make_node("ConcatFromSequence", ["mapped"], ["y"], axis=0, new_axis=1)]

    def torch_fn(x, s, u, c):
        return (x * s) ** 2 * u + c

    check_op(nodes, ["N", 3], [(2, 3), (4, 3)], _scales("s", "u", "c"), 17, torch_fn=torch_fn)


def test_a_loop_carrying_a_sequence_unchanged_passes_its_gradient_through():
    """A ``Loop`` whose body returns its sequence state as is: the gradient of the concatenated
    result reaches ``x * s`` element by element (numpy: ``d sum(x * s) / ds = sum(x, 0)``)."""
    from onnx import numpy_helper

    from onnxparam.autodiff import grad

    seq_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    body = helper.make_graph([helper.make_node("Identity", ["c_in"], ["c_out"]),
                              helper.make_node("Identity", ["seq_in"], ["seq_out"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                              helper.make_value_info("seq_in", seq_type)],
                             [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                              helper.make_value_info("seq_out", seq_type)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("SequenceConstruct", ["xs"], ["seq"]),
             helper.make_node("Loop", ["trips", "", "seq"], ["looped"], body=body),
             helper.make_node("ConcatFromSequence", ["looped"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones(3, np.float32), "s"),
                               numpy_helper.from_array(np.array(2, np.int64), "trips")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = RNG.normal(size=(2, 3)).astype(np.float32)
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    _, grads = grad(lambda m, a: m(a).sum(), op.import_onnx(model), op.Tensor.from_numpy(x))
    np.testing.assert_allclose(grads.by_path()["s"].to_numpy(), x.sum(0), rtol=1e-6)


def test_a_loop_state_entering_as_an_empty_optional_and_leaving_as_a_sequence():
    """As ONNX's ``loop16_seq_none`` case: an empty optional enters, the body returns a sequence
    (``xs`` appended each of the 2 iterations; numpy: ``d sum(y) / ds = 2 sum(x, 0)``)."""
    from onnx import numpy_helper

    from onnxparam.autodiff import grad

    seq_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    opt_type = helper.make_optional_type_proto(seq_type)
    then = helper.make_graph([helper.make_node("OptionalGetElement", ["o_in"], ["got"])], "then", [],
                             [helper.make_value_info("got", seq_type)])
    other = helper.make_graph([helper.make_node("SequenceEmpty", [], ["none"], dtype=TensorProto.FLOAT)], "else", [],
                              [helper.make_value_info("none", seq_type)])
    body = helper.make_graph([helper.make_node("Identity", ["c_in"], ["c_out"]),
                              helper.make_node("OptionalHasElement", ["o_in"], ["has"]),
                              helper.make_node("If", ["has"], ["seq"], then_branch=then, else_branch=other),
                              helper.make_node("SequenceInsert", ["seq", "xs"], ["seq_out"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                              helper.make_value_info("o_in", opt_type)],
                             [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                              helper.make_value_info("seq_out", seq_type)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Optional", [], ["o0"], type=seq_type),
             helper.make_node("Loop", ["trips", "", "o0"], ["looped"], body=body),
             helper.make_node("ConcatFromSequence", ["looped"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones(3, np.float32), "s"),
                               numpy_helper.from_array(np.array(2, np.int64), "trips")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = RNG.normal(size=(2, 3)).astype(np.float32)
    assert ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0].shape == (4, 3)
    _, grads = grad(lambda m, a: m(a).sum(), op.import_onnx(model), op.Tensor.from_numpy(x))
    np.testing.assert_allclose(grads.by_path()["s"].to_numpy(), 2 * x.sum(0), rtol=1e-6)


def test_every_default_domain_sequence_and_optional_op_has_a_rule_or_a_declaration():
    ops = ("SequenceConstruct", "SequenceAt", "SequenceInsert", "SequenceErase", "ConcatFromSequence",
           "SplitToSequence", "Optional", "OptionalGetElement", "Unique", "SequenceMap")
    assert [o for o in ops if o not in GRADIENT_OPS] == []
    assert [o for o in ("SequenceEmpty", "SequenceLength", "OptionalHasElement") if o not in NOT_DIFFERENTIABLE] == []
