"""Gradients through the further forms of ``Scan`` and ``Loop`` that ONNX Runtime runs
(``onnxparam/autodiff/_rules_control.py``): scan inputs and outputs along axes other than 0
(the batch-major ``[N, T, ...]`` layout tf2onnx writes), read and written in both directions;
``Loop`` states that are sequences (TorchScript's list-building loops) or optionals (of a tensor,
of a sequence) or tensors grown by ``Concat``; the opset-8 ``Scan`` (a batch axis, per-row
``sequence_lens``); nested loops; ``If`` branches returning sequences and optionals; contrib
operators inside a body.

Each case is a small ONNX model whose batch and sequence dims are symbolic, differentiated at
two input shapes with one training session (``check_op`` of ``tests/test_grad_more_rules.py``):
oracles are central finite differences in float64 of the same loss on plain ONNX Runtime runs of
the original file with one initializer entry perturbed, and torch autograd in float64 of the
same recurrence unrolled step by step.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from test_grad_more_rules import RNG, check_op

D = TensorProto.DOUBLE


def _vi(name, dims=None, dtype=D):
    return helper.make_tensor_value_info(name, dtype, dims)


def test_scan_along_axes_other_than_zero_in_both_directions():
    """``x`` ``[N, T, 3]`` is scanned along axis 1 forward and, transposed to ``[N, 3, T]``,
    along axis -1 in reverse; the body ``h' = tanh(h @ w + x_t * v) + c * z_t * h`` writes
    ``h' * u`` along axis 1 and ``h'`` along axis 2 in reverse; the initial state is computed
    from the input and the param ``a``."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w"], ["hw"]), helper.make_node("Mul", ["x_t", "v"], ["xv"]),
         helper.make_node("Add", ["hw", "xv"], ["pre"]), helper.make_node("Tanh", ["pre"], ["th"]),
         helper.make_node("Mul", ["z_t", "h"], ["zh"]), helper.make_node("Mul", ["zh", "c"], ["zhc"]),
         helper.make_node("Add", ["th", "zhc"], ["h_new"]), helper.make_node("Mul", ["h_new", "u"], ["y1_t"]),
         helper.make_node("Identity", ["h_new"], ["y2_t"])],
        "body", [_vi("h", [None, 3]), _vi("x_t", [None, 3]), _vi("z_t", [None, 3])],
        [_vi("h_new", [None, 3]), _vi("y1_t", [None, 3]), _vi("y2_t", [None, 3])])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Transpose", ["xs"], ["xz"], perm=[0, 2, 1]),
             helper.make_node("ReduceSum", ["xs", "one"], ["xsum"], keepdims=0),
             helper.make_node("Mul", ["xsum", "a"], ["xa"]),
             helper.make_node("Tanh", ["xa"], ["h0"]),
             helper.make_node("Scan", ["h0", "xs", "xz"], ["h_last", "y1", "y2"], body=body, num_scan_inputs=2,
                              scan_input_axes=[1, -1], scan_input_directions=[0, 1],
                              scan_output_axes=[1, 2], scan_output_directions=[0, 1]),
             helper.make_node("Transpose", ["y2"], ["y2t"], perm=[0, 2, 1]),
             helper.make_node("Unsqueeze", ["h_last", "one"], ["hl"]),
             helper.make_node("Add", ["y1", "y2t"], ["y12"]),
             helper.make_node("Add", ["y12", "hl"], ["y"])]

    def torch_fn(x, s, w, v, c, u, a, one):
        import torch

        xs = x * s
        h = torch.tanh(xs.sum(1) * a)
        t_len = xs.shape[1]
        y1, y2 = [], [None] * t_len
        for t in range(t_len):
            h = torch.tanh(h @ w + xs[:, t] * v) + c * xs[:, t_len - 1 - t] * h
            y1.append(h * u)
            y2[t_len - 1 - t] = h  # written in reverse along axis 2 (here: transposed back)
        return torch.stack(y1, 1) + torch.stack(y2, 1) + h.unsqueeze(1)

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.normal(size=(3, 3)) * 0.6, "v": RNG.normal(size=(3,)),
             "c": RNG.normal(size=(3,)) * 0.5, "u": RNG.normal(size=(3,)), "a": RNG.normal(size=(3,)),
             "one": np.array([1], np.int64)}
    check_op(nodes, ["N", "T", 3], [(2, 4, 3), (3, 6, 3)], inits, 17, torch_fn=torch_fn)


# -- Loop states that are sequences or optionals -----------------------------------------------

_SEQ = helper.make_sequence_type_proto(helper.make_tensor_type_proto(D, None))


@pytest.mark.parametrize("reads", [True, False])
def test_loop_carrying_a_sequence_it_appends_to(reads):
    """The list-building loop TorchScript writes: over the time steps of ``x`` ``[T, B, 3]``
    (a trip count from its shape), ``h' = tanh(h @ w + x_t + c * seq[-1])`` (``reads``; else
    ``c * h``, the sequence only appended to: the rule's prefix path, no log), ``seq`` gets
    ``h' * u`` appended; the sequence starts with one element computed from a param and is
    concatenated after the loop."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]),
         helper.make_node("Gather", ["xs", "i"], ["x_t"], axis=0),
         helper.make_node("SequenceAt", ["seq", "minus1"], ["last"]) if reads else
         helper.make_node("Identity", ["h"], ["last"]),
         helper.make_node("Mul", ["last", "c"], ["lc"]),
         helper.make_node("MatMul", ["h", "w"], ["hw"]), helper.make_node("Add", ["hw", "x_t"], ["p1"]),
         helper.make_node("Add", ["p1", "lc"], ["pre"]), helper.make_node("Tanh", ["pre"], ["h_new"]),
         helper.make_node("Mul", ["h_new", "u"], ["hu"]),
         helper.make_node("SequenceInsert", ["seq", "hu"], ["seq_new"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []), _vi("h", [None, 3]),
                 helper.make_value_info("seq", _SEQ)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _vi("h_new", [None, 3]),
         helper.make_value_info("seq_new", _SEQ)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Shape", ["xs"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["trips"], axis=0),
             helper.make_node("Gather", ["xs", "zero"], ["x0"], axis=0),
             helper.make_node("Mul", ["x0", "a"], ["x0a"]), helper.make_node("Tanh", ["x0a"], ["h0"]),
             helper.make_node("Mul", ["h0", "v"], ["first"]),
             helper.make_node("SequenceConstruct", ["first"], ["seq0"]),
             helper.make_node("Loop", ["trips", "", "h0", "seq0"], ["h_last", "seq_last"], body=body),
             helper.make_node("ConcatFromSequence", ["seq_last"], ["y"], axis=0, new_axis=1)]

    def torch_fn(x, s, w, c, u, a, v, zero, minus1):
        import torch

        xs = x * s
        h = torch.tanh(xs[0] * a)
        seq = [h * v]
        for t in range(xs.shape[0]):
            h = torch.tanh(h @ w + xs[t] + c * (seq[-1] if reads else h))
            seq.append(h * u)
        return torch.stack(seq, 0)

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.normal(size=(3, 3)) * 0.6, "c": RNG.normal(size=(3,)) * 0.5,
             "u": RNG.normal(size=(3,)), "a": RNG.normal(size=(3,)), "v": RNG.normal(size=(3,)),
             "zero": np.array(0, np.int64), "minus1": np.array(-1, np.int64)}
    check_op(nodes, ["T", "B", 3], [(3, 2, 3), (5, 1, 3)], inits, 17, torch_fn=torch_fn)


def test_loop_carrying_optionals_of_a_tensor_and_of_a_sequence():
    """Two optional states that enter the loop empty: ``o`` (of a tensor) holds the previous
    ``h`` (zeros before the first step), ``os`` (of a sequence) the list of ``h * u`` built so
    far; both are unwrapped after the loop."""
    t_opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(D, [None, 3]))
    s_opt = helper.make_optional_type_proto(_SEQ)
    prev_then = helper.make_graph([helper.make_node("OptionalGetElement", ["o"], ["got"])], "prev_then", [],
                                  [_vi("got", [None, 3])])
    prev_else = helper.make_graph([helper.make_node("Mul", ["x_t", "zero_f"], ["zeros"])], "prev_else", [],
                                  [_vi("zeros", [None, 3])])
    seq_then = helper.make_graph([helper.make_node("OptionalGetElement", ["os"], ["got_seq"])], "seq_then", [],
                                 [helper.make_value_info("got_seq", _SEQ)])
    seq_else = helper.make_graph([helper.make_node("SequenceEmpty", [], ["no_seq"], dtype=D)], "seq_else", [],
                                 [helper.make_value_info("no_seq", _SEQ)])
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]),
         helper.make_node("Gather", ["xs", "i"], ["x_t"], axis=0),
         helper.make_node("OptionalHasElement", ["o"], ["has"]),
         helper.make_node("If", ["has"], ["prev"], then_branch=prev_then, else_branch=prev_else),
         helper.make_node("MatMul", ["prev", "w"], ["pw"]), helper.make_node("Add", ["pw", "x_t"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h"]), helper.make_node("Optional", ["h"], ["o_new"]),
         helper.make_node("OptionalHasElement", ["os"], ["has_seq"]),
         helper.make_node("If", ["has_seq"], ["seq"], then_branch=seq_then, else_branch=seq_else),
         helper.make_node("Mul", ["h", "u"], ["hu"]),
         helper.make_node("SequenceInsert", ["seq", "hu"], ["seq_new"]),
         helper.make_node("Optional", ["seq_new"], ["os_new"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                 helper.make_value_info("o", t_opt), helper.make_value_info("os", s_opt)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), helper.make_value_info("o_new", t_opt),
         helper.make_value_info("os_new", s_opt)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Shape", ["xs"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["trips"], axis=0),
             helper.make_node("Optional", [], ["o0"], type=helper.make_tensor_type_proto(D, [None, 3])),
             helper.make_node("Optional", [], ["os0"], type=_SEQ),
             helper.make_node("Loop", ["trips", "", "o0", "os0"], ["o_last", "os_last"], body=body),
             helper.make_node("OptionalGetElement", ["o_last"], ["h_last"]),
             helper.make_node("OptionalGetElement", ["os_last"], ["seq_last"]),
             helper.make_node("ConcatFromSequence", ["seq_last"], ["stacked"], axis=0, new_axis=1),
             helper.make_node("Unsqueeze", ["h_last", "zero1"], ["hl"]),
             helper.make_node("Add", ["stacked", "hl"], ["y"])]

    def torch_fn(x, s, w, u, zero_f, zero, zero1):
        import torch

        xs = x * s
        h, seq = xs[0] * zero_f, []  # (the else branch: zeros, as x_0 * 0)
        for t in range(xs.shape[0]):
            h = torch.tanh(h @ w + xs[t])
            seq.append(h * u)
        return torch.stack(seq, 0) + h.unsqueeze(0)

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.normal(size=(3, 3)) * 0.6, "u": RNG.normal(size=(3,)),
             "zero_f": np.array(0.0), "zero": np.array(0, np.int64), "zero1": np.array([0], np.int64)}
    check_op(nodes, ["T", "B", 3], [(3, 2, 3), (4, 1, 3)], inits, 18, torch_fn=torch_fn)


@pytest.mark.parametrize("name", ["test_loop16_seq_none", "test_loop11", "test_scan9_sum", "test_scan_sum"])
def test_onnx_conformance_loop_and_scan_cases_match_finite_differences(name):
    """ONNX's own node cases (``tests/grad_conformance.py``: float inputs and constants made
    params, central differences on plain ONNX Runtime); ``loop16_seq_none``: an empty optional
    enters the loop, the body returns a sequence; ``scan_sum``: the opset-8 form."""
    import onnx_cases
    from grad_conformance import check_grad_case

    case = next(c for c in onnx_cases.node_cases() if c.name == name)
    assert check_grad_case(case)[0] == "pass"


# -- Scan-8: a batch axis and per-row sequence lengths --------------------------------------------


@pytest.mark.parametrize("ragged", [False, True])
def test_opset8_scan_with_a_batch_axis_and_sequence_lens(ragged):
    """The opset-8 ``Scan``: ``x`` ``[B, T, 3]`` read forward and in reverse, the body
    ``h' = tanh(h @ w + x_t * v) + c * z_t * h`` per batch row; with ``ragged``, each row runs
    ``lens[b]`` steps (its final state the one after them, its outputs zero beyond them)."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w"], ["hw"]), helper.make_node("Mul", ["x_t", "v"], ["xv"]),
         helper.make_node("Add", ["hw", "xv"], ["pre"]), helper.make_node("Tanh", ["pre"], ["th"]),
         helper.make_node("Mul", ["z_t", "h"], ["zh"]), helper.make_node("Mul", ["zh", "c"], ["zhc"]),
         helper.make_node("Add", ["th", "zhc"], ["h_new"]), helper.make_node("Mul", ["h_new", "u"], ["y_t"])],
        "body", [_vi("h", [3]), _vi("x_t", [3]), _vi("z_t", [3])], [_vi("h_new", [3]), _vi("y_t", [3])])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("ReduceSum", ["xs"], ["xsum"], axes=[1], keepdims=0),
             helper.make_node("Mul", ["xsum", "a"], ["xa"]), helper.make_node("Tanh", ["xa"], ["h0"]),
             helper.make_node("Scan", ["lens" if ragged else "", "h0", "xs", "xs"], ["h_last", "ys"], body=body,
                              num_scan_inputs=2, directions=[0, 1]),
             helper.make_node("Unsqueeze", ["h_last"], ["hl"], axes=[1]),
             helper.make_node("Add", ["ys", "hl"], ["y"])]

    def lengths(shape):
        b, t = shape[0], shape[1]
        return np.array([t - (k % t) for k in range(b)], np.int64) if ragged else np.full(b, t, np.int64)

    def torch_fn(x, s, w, v, c, u, a, lens=None):
        import torch

        xs = x * s
        rows = []
        for b in range(xs.shape[0]):
            n = int(lens[b]) if lens is not None else xs.shape[1]
            h = torch.tanh(xs[b].sum(0) * a)
            ys = []
            for t in range(n):
                h = torch.tanh(h @ w + xs[b, t] * v) + c * xs[b, n - 1 - t] * h
                ys.append(h * u)
            ys += [torch.zeros_like(h)] * (xs.shape[1] - n)
            rows.append(torch.stack(ys, 0) + h)
        return torch.stack(rows, 0)

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.normal(size=(3, 3)) * 0.6, "v": RNG.normal(size=(3,)),
             "c": RNG.normal(size=(3,)) * 0.5, "u": RNG.normal(size=(3,)), "a": RNG.normal(size=(3,))}
    extra = (lambda shape: {"lens": lengths(shape)}) if ragged else None
    extra_inputs = [helper.make_tensor_value_info("lens", TensorProto.INT64, ["B"])] if ragged else ()
    check_op(nodes, ["B", "T", 3], [(2, 4, 3), (3, 5, 3)], inits, 8, torch_fn=torch_fn, extra=extra,
             extra_inputs=extra_inputs)


def test_contrib_ops_onnx_cannot_type_inside_a_loop_body_train():
    """``com.microsoft`` ``FusedMatMul`` (``w`` transposed, scaled) then ``Gelu`` inside a
    ``Loop`` body: ONNX's shape inference does not know the domain (their outputs were untyped,
    and the gradient of the params before them silently zero); they are typed from their inputs
    and the params get the gradient of central differences on plain ONNX Runtime (float32: the
    contrib kernels are float only)."""
    from onnx import numpy_helper

    from grad_check import check_model_grads

    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]),
         helper.make_node("FusedMatMul", ["h", "w"], ["hw"], domain="com.microsoft", alpha=0.5, transB=1),
         helper.make_node("Gelu", ["hw"], ["g"], domain="com.microsoft"),
         helper.make_node("Add", ["g", "b"], ["h_new"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []), _vi("h", ["N", 3], f)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _vi("h_new", ["N", 3], f)])
    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.normal(size=(3, 3)), "b": RNG.normal(size=(3,))}
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Loop", ["trips", "", "xs"], ["y"], body=body)],
        "g", [_vi("x", ["N", 3], f)], [_vi("y", None, f)],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()]
        + [numpy_helper.from_array(np.array(2, np.int64), "trips")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    feeds = [{"x": RNG.uniform(-1, 1, (2, 3)).astype(np.float32)}, {"x": RNG.uniform(-1, 1, (4, 3)).astype(np.float32)}]
    counts = check_model_grads(model, feeds, eps=1e-2, rtol=2e-2, atol=2e-3, entries=6)
    assert counts["sessions"] == counts["graphs"] <= 2


def test_loop_growing_a_tensor_state_with_concat():
    """A tensor state whose shape changes every iteration (``acc = concat(tanh(acc), x_t)``
    along axis 0, the pattern of a TorchScript loop growing a tensor), the axes of its
    ``Unsqueeze`` read from a main-graph initializer: logged per iteration instead of saved as
    scan outputs (which must keep one shape)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Gather", ["xs", "i"], ["x_t"], axis=0),
         helper.make_node("Unsqueeze", ["x_t", "zero1"], ["x_u"]), helper.make_node("Tanh", ["acc"], ["acc_t"]),
         helper.make_node("Mul", ["acc_t", "c"], ["acc_c"]),
         helper.make_node("Concat", ["acc_c", "x_u"], ["acc_new"], axis=0)],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []), _vi("acc", [None, None, 3])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _vi("acc_new", [None, None, 3])])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Shape", ["xs"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["trips"], axis=0),
             helper.make_node("Slice", ["xs", "zero1", "one1"], ["acc0"]),
             helper.make_node("Loop", ["trips", "", "acc0"], ["y"], body=body)]

    def torch_fn(x, s, c, zero, zero1, one1):
        import torch

        xs = x * s
        acc = xs[:1]
        for t in range(xs.shape[0]):
            acc = torch.cat([torch.tanh(acc) * c, xs[t:t + 1]], 0)
        return acc

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "c": RNG.uniform(0.5, 1.5, (3,)), "zero": np.array(0, np.int64),
             "zero1": np.array([0], np.int64), "one1": np.array([1], np.int64)}
    check_op(nodes, ["T", "B", 3], [(3, 2, 3), (4, 1, 3)], inits, 17, torch_fn=torch_fn)


def test_nested_loops_with_a_sequence_state_outside_and_a_scan_inside():
    """A ``Loop`` over the time steps whose body runs a ``Scan`` over the features (an inner
    recurrence ``g' = tanh(g * w + h_f)``) and appends its result to a sequence state."""
    inner = helper.make_graph(
        [helper.make_node("Mul", ["g", "w"], ["gw"]), helper.make_node("Add", ["gw", "h_f"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["g_new"]), helper.make_node("Identity", ["g_new"], ["g_out"])],
        "inner", [_vi("g", [None]), _vi("h_f", [None])], [_vi("g_new", [None]), _vi("g_out", [None])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Gather", ["xs", "i"], ["x_t"], axis=0),
         helper.make_node("Add", ["h", "x_t"], ["hx"]), helper.make_node("Transpose", ["hx"], ["hxt"], perm=[1, 0]),
         helper.make_node("Scan", ["g0", "hxt"], ["g_last", "gs"], body=inner, num_scan_inputs=1),
         helper.make_node("Transpose", ["gs"], ["h_new"], perm=[1, 0]),
         helper.make_node("SequenceInsert", ["seq", "g_last"], ["seq_new"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []), _vi("h", ["B", 3]),
                 helper.make_value_info("seq", _SEQ)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _vi("h_new", ["B", 3]),
         helper.make_value_info("seq_new", _SEQ)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Shape", ["xs"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["trips"], axis=0),
             helper.make_node("Gather", ["xs", "zero"], ["h0"], axis=0),
             helper.make_node("Gather", ["h0", "zero"], ["row"], axis=1),
             helper.make_node("Mul", ["row", "a"], ["g0"]),
             helper.make_node("SequenceEmpty", [], ["seq0"], dtype=D),
             helper.make_node("Loop", ["trips", "", "h0", "seq0"], ["h_last", "seq_last"], body=body),
             helper.make_node("ConcatFromSequence", ["seq_last"], ["y"], axis=0, new_axis=1)]

    def torch_fn(x, s, w, a, zero):
        import torch

        xs = x * s
        h, out = xs[0], []
        g0 = xs[0][:, 0] * a
        for t in range(xs.shape[0]):
            hx, g, cols = h + xs[t], g0, []
            for f in range(hx.shape[1]):
                g = torch.tanh(g * w + hx[:, f])
                cols.append(g)
            h = torch.stack(cols, 1)
            out.append(g)
        return torch.stack(out, 0)

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.uniform(0.5, 1.5, (1,)), "a": RNG.uniform(0.5, 1.5, (1,)),
             "zero": np.array(0, np.int64)}
    check_op(nodes, ["T", "B", 3], [(3, 2, 3), (2, 4, 3)], inits, 17, torch_fn=torch_fn)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_whose_branches_return_sequences_and_optionals(sign):
    """An ``If`` on the data returning a sequence (built from params in either branch) and an
    optional of a tensor; both are unwrapped after it."""
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(D, None))
    then = helper.make_graph(
        [helper.make_node("Mul", ["xs", "w"], ["tw"]), helper.make_node("SequenceConstruct", ["tw", "xs"], ["t_seq"]),
         helper.make_node("Tanh", ["xs"], ["tt"]), helper.make_node("Optional", ["tt"], ["t_opt"])],
        "then", [], [helper.make_value_info("t_seq", _SEQ), helper.make_value_info("t_opt", opt)])
    other = helper.make_graph(
        [helper.make_node("Mul", ["xs", "v"], ["ev"]), helper.make_node("SequenceConstruct", ["xs", "ev"], ["e_seq"]),
         helper.make_node("Mul", ["ev", "ev"], ["ee"]), helper.make_node("Optional", ["ee"], ["e_opt"])],
        "else", [], [helper.make_value_info("e_seq", _SEQ), helper.make_value_info("e_opt", opt)])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("ReduceSum", ["xs"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero_f"], ["cond"]),
             helper.make_node("If", ["cond"], ["seq", "o"], then_branch=then, else_branch=other),
             helper.make_node("ConcatFromSequence", ["seq"], ["cat"], axis=0),
             helper.make_node("OptionalGetElement", ["o"], ["got"]),
             helper.make_node("Concat", ["cat", "got"], ["y"], axis=0)]

    def torch_fn(x, s, w, v, zero_f):
        import torch

        xs = x * s
        if sign > 0:
            return torch.cat([xs * w, xs, torch.tanh(xs)], 0) + 0 * (v.sum() + zero_f)
        return torch.cat([xs, xs * v, (xs * v) ** 2], 0) + 0 * (w.sum() + zero_f)

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.uniform(0.5, 1.5, (3,)), "v": RNG.uniform(0.5, 1.5, (3,)),
             "zero_f": np.array(0.0)}
    check_op(nodes, ["B", 3], [(2, 3), (3, 3)], inits, 18, torch_fn=torch_fn,
             x_range=(0.1, 1.0) if sign > 0 else (-1.0, -0.1))


def test_a_torchscript_exported_list_building_loop_trains_like_torch():
    """A scripted module whose ``for`` loop appends each step's output to a list, exported by
    ``torch.onnx.export`` (TorchScript: a ``Loop`` carrying the hidden state and a sequence, its
    ``Gemm`` s reading the weights from the main graph), imported: every param's gradient equals
    torch autograd of the scripted module at two (length, batch) shapes, with one session."""
    import io
    import warnings

    import onnx

    import onnxparam as op
    from onnxparam.autodiff import _training, grad

    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = torch.nn.Linear(3, 3)
            self.out = torch.nn.Linear(3, 2)

        def forward(self, x):
            h = torch.zeros(x.shape[1], 3)
            outs = []
            for t in range(x.shape[0]):
                h = torch.tanh(self.cell(h) + x[t])
                outs.append(self.out(h))
            return torch.stack(outs, 0)

    torch.manual_seed(0)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript is deprecated: it still is how such loops export)
        net = torch.jit.script(Net())
        torch.onnx.export(net, (torch.randn(4, 2, 3),), buffer, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "T", 1: "B"}}, opset_version=17, dynamo=False)
    model = onnx.load_from_string(buffer.getvalue())
    assert "Loop" in [n.op_type for n in model.graph.node]
    module = op.import_onnx(model)
    _training.clear_cache()

    def loss_fn(m, x, w):
        return (m(x) * w).sum()

    for shape in [(4, 2, 3), (6, 3, 3)]:
        x = torch.from_numpy(RNG.normal(size=shape).astype(np.float32))
        w = torch.from_numpy(RNG.normal(size=(shape[0], shape[1], 2)).astype(np.float32))
        net.zero_grad()
        (net(x) * w).sum().backward()
        loss, grads = grad(loss_fn, module, op.Tensor.from_numpy(x.numpy()), op.Tensor.from_numpy(w.numpy()))
        got = grads.by_path()
        for name, p in net.named_parameters():
            np.testing.assert_allclose(got[module.path_of(name)].to_numpy(), p.grad.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=name)
    assert len(_training._sessions) == 1
