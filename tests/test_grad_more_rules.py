"""Gradient rules of the operators added last (CumProd, Det, LRN, LpPool, MaxUnpool, GridSample,
RoiAlign, Attention, ...) and the pooling / Col2Im / Resize rules on dynamic dims.

Each case is a small ONNX model ``y = op(x * s, ...)`` (``s`` and the op's float weights are
initializers, so params of the imported model) whose batch / spatial / sequence dims are
symbolic, differentiated at two input shapes. Oracles: central finite differences of the same
loss on plain ONNX Runtime runs of the original file with one initializer entry perturbed
(``tests/grad_check.py``; float64 where ORT has the op's double kernel, else float32 with a
larger step), and, where PyTorch has the op, torch autograd of the same loss in float64.
The two shapes share one symbolic training graph after the first (counted in the cache).
Further variants of a case are ``slow``.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from grad_check import _weights, check_model_grads
from onnxparam.autodiff import grad

RNG = np.random.default_rng(7)
D, F = TensorProto.DOUBLE, TensorProto.FLOAT


def _model(nodes, x_dims, inits, opset, dtype, extra_inputs=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, x_dims), *extra_inputs],
                              [helper.make_tensor_value_info("y", dtype, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _runs_in_double(nodes, x_dims, inits, opset, extra_inputs=()):
    """Whether ONNX Runtime runs the model with every float retyped to double."""
    inits64 = {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in inits.items()}
    model = _model(nodes, x_dims, inits64, opset, D, extra_inputs)
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return True
    except Exception:  # noqa: BLE001 - no double kernel
        return False


def check_op(nodes, x_dims, shapes, inits, opset, *, torch_fn=None, x_range=(-1.0, 1.0), extra=None,
             extra_inputs=(), f32_tol=(1e-2, 2e-3, 2e-4), feed_map=None):
    """``check_model_grads`` at each shape in ``shapes`` (float64 when ORT can, else float32), and
    torch autograd of ``sum(w * torch_fn(x, **params))`` in float64 on the last shape, against
    ``grad``'s gradients of every float initializer. ``extra(shape)`` gives further feeds;
    ``feed_map`` edits the drawn ``x``."""
    double = _runs_in_double(nodes, x_dims, inits, opset, extra_inputs)
    dt, npdt = (D, np.float64) if double else (F, np.float32)
    inits = {k: v.astype(npdt) if np.issubdtype(v.dtype, np.floating) else v for k, v in inits.items()}
    model = _model(nodes, x_dims, inits, opset, dt, extra_inputs)
    feeds = []
    for shape in shapes:
        feed = {"x": RNG.uniform(*x_range, size=shape).astype(npdt)}
        if feed_map is not None:
            feed["x"] = feed_map(feed["x"])
        if extra is not None:
            feed.update({k: (v.astype(npdt) if np.issubdtype(v.dtype, np.floating) else v)
                         for k, v in extra(shape).items()})
        feeds.append(feed)
    eps, rtol, atol = (1e-5, 1e-5, 1e-7) if double else f32_tol
    counts = check_model_grads(model, feeds, eps=eps, rtol=rtol, atol=atol)
    # the declared dynamic dims are symbolic from the first call; a second graph only where the
    # loss weights' dims (the output's: derived sizes) first matched a declared dim by size
    assert counts["graphs"] == counts["sessions"] and counts["graphs"] <= 2, counts
    if torch_fn is not None:
        torch = pytest.importorskip("torch")
        feed = feeds[-1]
        y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
        w = _weights(y.shape, npdt)
        params = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in inits.items()
                  if np.issubdtype(v.dtype, np.floating)}
        others = {k: torch.from_numpy(v if not np.issubdtype(v.dtype, np.floating) else v.astype(np.float64))
                  for k, v in feed.items()}
        consts = {k: torch.from_numpy(v) for k, v in inits.items() if not np.issubdtype(v.dtype, np.floating)}
        out = torch_fn(**others, **params, **consts)
        (out * torch.from_numpy(w.astype(np.float64))).sum().backward()
        module = op.import_onnx(model)
        names = list(feed)
        _, grads = grad(lambda m, ww, *xs: (m(**dict(zip(names, xs))) * ww).sum(), module, op.Tensor.from_numpy(w),
                        *[op.Tensor.from_numpy(feed[n]) for n in names])
        by_path = grads.by_path()
        tol = dict(rtol=1e-6, atol=1e-8) if double else dict(rtol=2e-4, atol=2e-5)
        weights = set(module.onnx_names.values())  # (initializers the importer keeps constant are not params)
        for k, t in params.items():
            if k not in weights:
                continue
            np.testing.assert_allclose(by_path[module.path_of(k)].to_numpy(), t.grad.numpy(), err_msg=k, **tol)


# -- pooling / Col2Im / Resize on dynamic dims ---------------------------------------------------


def _pool_shapes(nodes, torch_fn):
    """Batch and image size changing (a scale per channel), then the channel count changing too (a
    scalar scale: the rules then work per ``[n, c]`` plane)."""
    check_op(nodes, ["N", "C", "H", "W"], [(2, 3, 6, 7), (1, 3, 9, 5)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))},
             17, torch_fn=torch_fn)
    check_op(nodes, ["N", "C", "H", "W"], [(2, 3, 6, 7), (1, 4, 9, 5)], {"s": RNG.uniform(0.5, 1.5, (1,))}, 17,
             torch_fn=torch_fn)


@pytest.mark.parametrize("kernel,strides,pads", [([2, 2], [2, 2], [0, 0, 0, 0]),
                                                  pytest.param([3, 3], [2, 1], [1, 1, 1, 0], marks=pytest.mark.slow)])
def test_max_pool_on_dynamic_batch_channels_and_image(kernel, strides, pads):
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("MaxPool", ["xs"], ["y"], kernel_shape=kernel, strides=strides, pads=pads)]

    def torch_fn(x, s):
        import torch

        p = torch.nn.functional.pad(x * s, (pads[1], pads[3], pads[0], pads[2]), value=-float("inf"))
        return torch.nn.functional.max_pool2d(p, kernel, strides)

    _pool_shapes(nodes, torch_fn)


@pytest.mark.parametrize("count_include_pad", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_average_pool_on_dynamic_channels_and_image(count_include_pad):
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("AveragePool", ["xs"], ["y"], kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1],
                              count_include_pad=count_include_pad)]

    def torch_fn(x, s):
        import torch

        xs = torch.nn.functional.pad(x * s, (0, 1, 0, 0))  # the asymmetric end pad of W
        y = torch.nn.functional.avg_pool2d(xs, (3, 2), (2, 1), padding=(1, 0), count_include_pad=True)
        if count_include_pad:
            return y
        ones = torch.nn.functional.pad(torch.ones_like(x), (0, 1, 0, 0))
        return y * 6 / (torch.nn.functional.avg_pool2d(torch.nn.functional.pad(ones, (0, 0, 1, 1)), (3, 2), (2, 1)) * 6)

    _pool_shapes(nodes, torch_fn)


def test_col2im_on_a_dynamic_batch():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Col2Im", ["xs", "image", "block"], ["y"], strides=[1, 1], pads=[1, 0, 0, 1])]
    inits = {"s": RNG.uniform(0.5, 1.5, size=(1, 12, 1)), "image": np.array([4, 5], np.int64),
             "block": np.array([2, 2], np.int64)}
    # [N, C * 4, L] with C = 3, L = 4 * 5 output positions of a 2x2 block over the padded 4x5 image
    check_op(nodes, ["N", 12, 20], [(2, 12, 20), (3, 12, 20)], inits, 18,
             torch_fn=lambda x, s, image, block: _fold(x * s))


def _fold(cols):
    """Col2Im of the test above in torch: fold over the image padded by (top 1, left 0, bottom 0,
    right 1), cropped back."""
    import torch

    full = torch.nn.functional.fold(cols, (5, 6), (2, 2))
    return full[:, :, 1:5, 0:5]


# -- CumProd, Det, Mod, CastLike, OneHot, DequantizeLinear ----------------------------------------


def _torch_cumprod(x, axis, exclusive, reverse):
    import torch

    if reverse:
        x = x.flip(axis)
    c = torch.cumprod(x, axis)
    if exclusive:
        c = torch.cat([torch.ones_like(c.narrow(axis, 0, 1)), c.narrow(axis, 0, c.shape[axis] - 1)], axis)
    return c.flip(axis) if reverse else c


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 1), pytest.param(0, 1, marks=pytest.mark.slow)])
def test_cumprod_along_a_dynamic_axis_with_zeros(exclusive, reverse):
    """Along the batch axis (its size changes); a zero in ``x`` (the gradient divides by nothing)."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("CumProd", ["xs", "axis"], ["y"], exclusive=exclusive, reverse=reverse)]
    inits = {"s": RNG.uniform(0.5, 1.5, size=(4,)), "axis": np.array(0, np.int64)}

    check_op(nodes, ["N", 4], [(3, 4), (5, 4)], inits, 26, x_range=(-1.5, 1.5),
             torch_fn=lambda x, s, axis: _torch_cumprod(x * s, 0, exclusive, reverse), feed_map=_zero_first)


def _zero_first(x):
    x = x.copy()
    x[1, 2] = 0.0
    return x


def test_det_of_a_batch_of_matrices():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Det", ["xs"], ["y"])]
    check_op(nodes, ["N", 3, 3], [(2, 3, 3), (4, 3, 3)], {"s": RNG.uniform(0.5, 1.5, size=(3, 3))}, 22,
             torch_fn=lambda x, s: __import__("torch").linalg.det(x * s))


def test_float_mod_gradient_of_both_operands():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Mod", ["xs", "b"], ["y"], fmod=1)]
    inits = {"s": RNG.uniform(0.5, 1.5, size=(3,)), "b": np.array([2.5, -3.0, 3.5])}
    check_op(nodes, ["N", 3], [(4, 3), (6, 3)], inits, 13, x_range=(-6, 6),
             torch_fn=lambda x, s, b: __import__("torch").fmod(x * s, b))


def test_cast_like_passes_the_gradient_through():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("CastLike", ["xs", "like"], ["c"]),
             helper.make_node("Tanh", ["c"], ["y"])]
    check_op(nodes, ["N", 3], [(2, 3), (3, 3)], {"s": RNG.uniform(0.5, 1.5, size=(3,)), "like": np.zeros(1)}, 21)


def test_one_hot_values_gradient():
    nodes = [helper.make_node("OneHot", ["ids", "depth", "values"], ["hot"], axis=-1),
             helper.make_node("Mul", ["x", "hot"], ["y"])]
    inits = {"values": np.array([0.3, 1.7]), "depth": np.array(4, np.int64)}
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])
    check_op(nodes, ["N", 4], [(3, 4), (5, 4)], inits, 13, extra_inputs=[ids],
             extra=lambda shape: {"ids": RNG.integers(0, 4, size=shape[:1]).astype(np.int64)})


@pytest.mark.parametrize("per_axis", [False, True])
def test_dequantize_linear_scale_gradient(per_axis):
    """The quantized tensor is fed (an initializer would be imported as a frozen quantized weight),
    the scale is a param."""
    inits = {"zp": np.array([3, -2, 0], np.int8) if per_axis else np.array(5, np.int8),
             "scale": RNG.uniform(0.01, 0.05, size=(3,)) if per_axis else np.array(0.02)}
    nodes = [helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    q = helper.make_tensor_value_info("q", TensorProto.INT8, [4, 3])
    fixed = RNG.integers(-100, 100, size=(4, 3)).astype(np.int8)

    def torch_fn(x, q, scale, zp):
        return x @ ((q.double() - zp.double()) * scale)

    check_op(nodes, ["N", 4], [(2, 4), (5, 4)], inits, 19, torch_fn=torch_fn, f32_tol=(1e-3, 2e-3, 2e-4),
             extra_inputs=[q], extra=lambda shape: {"q": fixed})


# -- LRN, LpPool, GlobalLpPool, MaxUnpool -----------------------------------------------------------


@pytest.mark.parametrize("size", [3, pytest.param(5, marks=pytest.mark.slow)])  # (ONNX Runtime runs odd sizes only)
def test_lrn_across_channels(size):
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("LRN", ["xs"], ["y"], size=size, alpha=0.3, beta=0.75, bias=1.5)]

    def torch_fn(x, s):
        import torch

        return torch.nn.functional.local_response_norm(x * s, size, alpha=0.3, beta=0.75, k=1.5)

    check_op(nodes, ["N", 5, "H", "W"], [(2, 5, 3, 4), (1, 5, 2, 6)], {"s": RNG.uniform(0.5, 1.5, (1, 5, 1, 1))},
             13, torch_fn=torch_fn, x_range=(-2, 2))


@pytest.mark.parametrize("p,pads", [(2, [0, 0, 0, 0]), (3, [1, 0, 0, 1])])
def test_lp_pool(p, pads):
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("LpPool", ["xs"], ["y"], kernel_shape=[2, 3], strides=[1, 2], p=p, pads=pads)]

    def torch_fn(x, s):
        import torch

        return torch.nn.functional.lp_pool2d(x * s, 2.0, (2, 3), (1, 2))

    check_op(nodes, ["N", "C", "H", "W"], [(2, 3, 5, 7), (1, 3, 4, 6)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))},
             18, torch_fn=torch_fn if p == 2 and not any(pads) else None)


def test_global_lp_pool():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("GlobalLpPool", ["xs"], ["y"], p=3)]
    check_op(nodes, ["N", 3, "H", "W"], [(2, 3, 4, 5), (1, 3, 3, 2)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))}, 18,
             torch_fn=lambda x, s: (x * s).abs().pow(3).sum((2, 3), keepdim=True).pow(1 / 3))


def test_max_unpool_of_max_pool():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("MaxPool", ["xs"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Tanh", ["p"], ["t"]),
             helper.make_node("MaxUnpool", ["t", "i"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]

    def torch_fn(x, s):
        import torch

        pooled, idx = torch.nn.functional.max_pool2d(x * s, 2, 2, return_indices=True)
        return torch.nn.functional.max_unpool2d(torch.tanh(pooled), idx, 2, 2)

    check_op(nodes, ["N", "C", "H", "W"], [(2, 3, 4, 6), (1, 3, 6, 4)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))}, 22,
             torch_fn=torch_fn)


# -- the up-front check lists the nodes inside control-flow bodies too ----------------------------


def test_check_lists_every_node_without_a_rule_in_the_graph_and_in_if_and_loop_bodies_at_once():
    """A main-graph node, one in each ``If`` branch and one in a ``Loop`` body (each fed by a
    param), all without rules: listed together by ``check_gradients`` and ``grad``'s error, before
    any rule runs; an ``If`` branch node that only the other branch's params reach is listed as
    well (the sweep of each branch would meet it), a node off the param -> loss path is not."""
    from onnxparam.autodiff import check_gradients

    def out(name):
        return helper.make_tensor_value_info(name, F, [3])

    then = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["tw"]),
                              helper.make_node("Twist", ["tw"], ["then_y"], domain="com.example", name="then_twist")],
                             "then", [], [out("then_y")], value_info=[out("tw")])
    els = helper.make_graph([helper.make_node("Add", ["x", "w"], ["ew"]),
                             helper.make_node("Turn", ["ew"], ["else_y"], domain="com.example", name="else_turn"),
                             helper.make_node("Turn", ["x"], ["unused"], domain="com.example", name="off_path")],
                            "else", [], [out("else_y")], value_info=[out("ew"), out("unused")])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Mul", ["acc_in", "v"], ["scaled"]),
         helper.make_node("Bend", ["scaled"], ["acc_out"], domain="com.example", name="loop_bend")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", F, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("acc_out", F, [3])],
        value_info=[helper.make_tensor_value_info("scaled", F, [3])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=els, name="the_if"),
             helper.make_node("Loop", ["trips", "", "branch"], ["looped"], name="the_loop", body=body),
             helper.make_node("Mul", ["looped", "u"], ["mu"]),
             helper.make_node("Spin", ["mu"], ["y"], domain="com.example", name="main_spin")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3])], [out("y")],
                              value_info=[out("mu"), out("branch"), out("looped")], initializer=[numpy_helper.from_array(np.array(2, np.int64), "trips"),
                               numpy_helper.from_array(np.array(0, np.float32), "zero"),
                               *[numpy_helper.from_array(RNG.normal(size=3).astype(np.float32), k) for k in "wvu"]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    module = op.import_onnx(model)
    x = op.Tensor.from_numpy(np.ones(3, np.float32))

    def loss(m, x):
        return m(x).sum()

    listed = check_gradients(loss, module, x)
    ops = sorted(m.op for m in listed)
    assert ops == ["com.example:Bend", "com.example:Spin", "com.example:Turn", "com.example:Twist"], listed
    where = {m.op: m.reason for m in listed}
    assert "then_branch" in where["com.example:Twist"] and "else_branch" in where["com.example:Turn"]
    assert "body" in where["com.example:Bend"] and "Loop" in where["com.example:Bend"]
    with pytest.raises(op.TraceError, match=r"(?s)4 node\(s\).*Spin.*Twist.*Turn.*Bend"):
        grad(loss, module, x)


# -- Attention (opset 23) ------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [0.0, pytest.param(1.5, marks=pytest.mark.slow)])
def test_attention_3d_gqa_causal_on_dynamic_batch_and_sequence(softcap):
    """Projections ``x @ w`` into 3-D Q (4 heads) and K / V (2 heads: grouped-query), causal;
    against torch's ``scaled_dot_product_attention`` (no softcap there: finite differences only)."""
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv"], ["v"]),
             helper.make_node("Attention", ["q", "k", "v"], ["y"], q_num_heads=4, kv_num_heads=2, is_causal=1,
                              softcap=softcap)]
    inits = {"wq": RNG.normal(size=(6, 8)) * 0.5, "wk": RNG.normal(size=(6, 4)) * 0.5, "wv": RNG.normal(size=(6, 4))}

    def torch_fn(x, wq, wk, wv):
        import torch

        n, s, _ = x.shape
        q = (x @ wq).view(n, s, 4, 2).transpose(1, 2)
        k = (x @ wk).view(n, s, 2, 2).transpose(1, 2)
        v = (x @ wv).view(n, s, 2, 2).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(n, s, 8)

    check_op(nodes, ["N", "S", 6], [(2, 5, 6), (3, 7, 6)], inits, 23, torch_fn=None if softcap else torch_fn)


# -- Resize with run-time sizes / scales -----------------------------------------------------------


def test_resize_linear_upsampling_on_dynamic_image_size():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "", "scales"], ["y"], mode="linear")]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2, 1, 1)), "scales": np.array([1, 1, 2, 2], np.float32)}

    def torch_fn(x, s, scales):
        import torch

        return torch.nn.functional.interpolate(x * s, scale_factor=2, mode="bilinear", align_corners=False)

    check_op(nodes, ["N", 2, "H", "W"], [(2, 2, 3, 4), (1, 2, 5, 2)], inits, 18, torch_fn=torch_fn)


@pytest.mark.parametrize("mode,antialias", [("cubic", 1), pytest.param("linear", 0, marks=pytest.mark.slow),
                                            pytest.param("nearest", 0, marks=pytest.mark.slow)])
def test_resize_to_sizes_computed_from_the_input_shape(mode, antialias):
    """``sizes = [N, C, H + 3, W - 2]`` from ``Shape`` (upsampling one axis, downsampling the
    other, antialiased for cubic)."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Add", ["shape", "delta"], ["sizes"]),
             helper.make_node("Resize", ["xs", "", "", "sizes"], ["y"], mode=mode, antialias=antialias)]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2, 1, 1)), "delta": np.array([0, 0, 3, -2], np.int64)}
    check_op(nodes, ["N", 2, "H", "W"], [(2, 2, 4, 7), (1, 2, 6, 5)], inits, 18)


def test_resize_with_scales_fed_at_run_time_and_a_resized_channel_axis():
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "", "scales"], ["y"], mode="nearest", axes=[1, 3])]
    scales = helper.make_tensor_value_info("scales", F, [2])
    check_op(nodes, ["N", 3, "H", "W"], [(2, 3, 2, 4), (1, 3, 3, 6)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))}, 18,
             extra_inputs=[scales], extra=lambda shape: {"scales": np.array([2.0, 0.5], np.float32)})


# -- GridSample --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,padding,align", [("linear", "zeros", 0),
                                                pytest.param("linear", "border", 1, marks=pytest.mark.slow),
                                                pytest.param("nearest", "zeros", 0, marks=pytest.mark.slow)])
def test_grid_sample_input_and_grid_gradients(mode, padding, align):
    """The grid is a fed grid times a param (so the grid's gradient is checked too); batch, image
    and grid sizes change between the two shapes."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Mul", ["grid", "sg"], ["gs"]),
             helper.make_node("GridSample", ["xs", "gs"], ["y"], mode=mode, padding_mode=padding, align_corners=align)]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2, 1, 1)), "sg": RNG.uniform(0.8, 1.2, (2,))}
    grid = helper.make_tensor_value_info("grid", D, ["N", "Ho", "Wo", 2])

    def extra(shape):
        return {"grid": RNG.uniform(-1.1, 1.1, size=(shape[0], shape[2] + 1, shape[3] - 1, 2))}

    def torch_fn(x, grid, s, sg):
        import torch

        return torch.nn.functional.grid_sample(x * s, grid * sg, mode="bilinear" if mode == "linear" else mode,
                                               padding_mode=padding, align_corners=bool(align))

    check_op(nodes, ["N", 2, "H", "W"], [(2, 2, 4, 5), (1, 2, 5, 3)], inits, 20, torch_fn=torch_fn,
             extra_inputs=[grid], extra=extra)


@pytest.mark.parametrize("align", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_affine_grid_theta_gradient_through_grid_sample(align):
    """``theta = x_theta * s`` -> ``AffineGrid`` at a run-time size -> sampled image: the gradient
    reaches ``s`` through the grid; the image size changes between the two shapes."""
    nodes = [helper.make_node("Mul", ["theta", "s"], ["ts"]), helper.make_node("Shape", ["x"], ["size"]),
             helper.make_node("AffineGrid", ["ts", "size"], ["grid"], align_corners=align),
             helper.make_node("GridSample", ["x", "grid"], ["y"], align_corners=align)]
    theta = helper.make_tensor_value_info("theta", D, ["N", 2, 3])

    def extra(shape):
        base = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
        return {"theta": base + RNG.uniform(-0.3, 0.3, size=(shape[0], 2, 3))}

    def torch_fn(x, theta, s):
        import torch

        grid = torch.nn.functional.affine_grid(theta * s, list(x.shape), align_corners=bool(align))
        return torch.nn.functional.grid_sample(x, grid, align_corners=bool(align))

    check_op(nodes, ["N", 2, "H", "W"], [(2, 2, 4, 5), (1, 2, 6, 3)], {"s": RNG.uniform(0.8, 1.2, (2, 3))}, 20,
             torch_fn=torch_fn, extra_inputs=[theta], extra=extra)


# -- RoiAlign --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling_ratio,mode", [(2, "half_pixel"),
                                                  pytest.param(0, "output_half_pixel", marks=pytest.mark.slow)])
def test_roi_align_input_gradient_on_a_dynamic_feature_map(sampling_ratio, mode):
    """Rois on both images of the batch (one image twice), the feature map's batch and size change;
    torchvision's ``roi_align`` (aligned=True is ONNX's half_pixel) where installed."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("RoiAlign", ["xs", "rois", "bi"], ["y"], output_height=2, output_width=3,
                              sampling_ratio=sampling_ratio, spatial_scale=0.5, coordinate_transformation_mode=mode)]
    rois = helper.make_tensor_value_info("rois", D, ["R", 4])
    bi = helper.make_tensor_value_info("bi", TensorProto.INT64, ["R"])

    def extra(shape):
        n, _, h, w = shape
        boxes = np.array([[0.5, 1.0, 2 * w - 3, 2 * h - 2], [2.0, 0.0, 2 * w - 1, h], [1.0, 1.5, w, 2 * h - 1.5]])
        return {"rois": boxes, "bi": np.array([0, n - 1, 0], np.int64)}

    torch_fn = None
    if mode == "half_pixel":
        try:
            import torchvision  # noqa: F401

            def torch_fn(x, rois, bi, s):
                import torch
                from torchvision.ops import roi_align

                boxes = torch.cat([bi.double()[:, None], rois], 1)
                return roi_align(x * s, boxes, (2, 3), 0.5, sampling_ratio, aligned=True)
        except ImportError:
            pass
    check_op(nodes, ["N", 3, "H", "W"], [(2, 3, 5, 6), (3, 3, 6, 4)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))}, 16,
             torch_fn=torch_fn, extra_inputs=[rois, bi], extra=extra)


# -- batch-first (layout=1) recurrent nodes -------------------------------------------------------


@pytest.mark.parametrize("op_type,direction", [("LSTM", "bidirectional"), ("GRU", "reverse"), ("RNN", "forward")])
def test_batch_first_recurrent_nodes_run_and_train_after_the_import_rewrite(op_type, direction):
    """ONNX Runtime refuses ``layout=1``; the importer rewrites it (``onnx_io._rnn_layout``). Oracles:
    the numpy recurrence of ``tests/rnn_reference.py`` run batch-first (outputs), and its central
    differences in float64 (every param: X, W, R, B, initial states, peepholes)."""
    import rnn_reference
    from test_grad_rnn import _arrays, _model

    arrays = _arrays(op_type, T=3, N=2, I=2, H=2, direction=direction, layout=1, lens=[3, 2], states=True,
                     peep=op_type == "LSTM", bias=True, seed=3)
    attrs = {"hidden_size": 2, "direction": direction, "layout": 1}
    model = _model(op_type, arrays, attrs)
    f32 = {k: (v.astype(np.float32).astype(np.float64) if v.dtype == np.float64 else v) for k, v in arrays.items()}
    want = rnn_reference.run(op_type, f32, attrs)
    module = op.import_onnx(model)
    got = module()
    for g_, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(g_.to_numpy(), w_, rtol=1e-5, atol=1e-5)
    coefs = [np.random.default_rng(9).normal(size=w_.shape) for w_ in want]

    def np_loss(values):
        return sum(float((o * c).sum()) for o, c in zip(rnn_reference.run(op_type, values, attrs), coefs))

    def loss_fn(m):
        total = None
        for o, c in zip(m(), coefs):
            term = (o * op.Tensor.from_numpy(c.astype(np.float32))).sum()
            total = term if total is None else total + term
        return total

    _, grads = grad(loss_fn, module)
    by_path = grads.by_path()
    eps = 1e-6
    for name in [k for k, v in arrays.items() if v.dtype == np.float64]:
        got_g = by_path[name].to_numpy().astype(np.float64)
        for idx in list(np.ndindex(*f32[name].shape))[::3]:
            plus, minus = dict(f32), dict(f32)
            plus[name], minus[name] = f32[name].copy(), f32[name].copy()
            plus[name][idx] += eps
            minus[name][idx] -= eps
            fd = (np_loss(plus) - np_loss(minus)) / (2 * eps)
            np.testing.assert_allclose(got_g[idx], fd, rtol=1e-3, atol=1e-4, err_msg=f"d/d{name}{idx}")


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_cache_and_update_gradients_on_a_dynamic_batch(mode):
    """A KV-cache write (opset 24): ``cache [N, 2, 5, 3] * s`` with ``update [N, 2, 2, 3] * su``
    written from ``write_indices[n]`` (wrapping around with ``circular``)."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["cache"]), helper.make_node("Mul", ["upd", "su"], ["u"]),
             helper.make_node("TensorScatter", ["cache", "u", "wi"], ["y"], axis=2, mode=mode)]
    upd = helper.make_tensor_value_info("upd", D, ["N", 2, 2, 3])
    wi = helper.make_tensor_value_info("wi", TensorProto.INT64, ["N"])
    last = 4 if mode == "circular" else 3

    def extra(shape):
        return {"upd": RNG.normal(size=(shape[0], 2, 2, 3)), "wi": RNG.integers(0, last + 1, size=shape[0])}

    check_op(nodes, ["N", 2, 5, 3], [(2, 2, 5, 3), (3, 2, 5, 3)],
             {"s": RNG.uniform(0.5, 1.5, (3,)), "su": RNG.uniform(0.5, 1.5, (3,))}, 24, extra_inputs=[upd, wi], extra=extra)


@pytest.mark.parametrize("op_type", ["AveragePool", "LpPool"])
def test_pools_with_ceil_mode_on_dynamic_image_sizes(op_type):
    """``ceil_mode=1``: the last window of each row runs past the end (for some sizes only)."""
    extra_attrs = {"count_include_pad": 0} if op_type == "AveragePool" else {"p": 2}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node(op_type, ["xs"], ["y"], kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 0, 0],
                              ceil_mode=1, **extra_attrs)]

    def torch_fn(x, s):
        import torch

        xs = torch.nn.functional.pad(x * s, (0, 0, 1, 0))  # (the top pad; counted out below)
        if op_type == "LpPool":
            return torch.nn.functional.lp_pool2d(xs, 2.0, (3, 2), (2, 2), ceil_mode=True)
        total = torch.nn.functional.avg_pool2d(xs, (3, 2), (2, 2), ceil_mode=True, divisor_override=1)
        cells = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(torch.ones_like(x), (0, 0, 1, 0)), (3, 2),
                                               (2, 2), ceil_mode=True, divisor_override=1)
        return total / cells

    check_op(nodes, ["N", "C", "H", "W"], [(2, 3, 6, 7), (1, 3, 5, 4)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))},
             19, torch_fn=torch_fn if op_type == "AveragePool" else None)
