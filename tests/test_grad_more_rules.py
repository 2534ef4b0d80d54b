"""Gradient rules of the operators added last (CumProd, Det, LRN, LpPool, MaxUnpool, GridSample,
RoiAlign, Attention, ...) and the pooling / Col2Im / Resize rules on dynamic dims.

Each case is a small ONNX model ``y = op(x * s, ...)`` (``s`` and the op's float weights are
initializers, so params of the imported model) whose batch / spatial / sequence dims are
symbolic, differentiated at two input shapes. Oracles: central finite differences of the same
loss on plain ONNX Runtime runs of the original file with one initializer entry perturbed
(``tests/grad_check.py``; float64 where ORT has the op's double kernel, else float32 with a
larger step), and, where PyTorch has the op, torch autograd of the same loss in float64.
The two shapes share one symbolic training graph after the first (counted in the cache).
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
             extra_inputs=(), f32_tol=(1e-2, 2e-3, 2e-4)):
    """``check_model_grads`` at each shape in ``shapes`` (float64 when ORT can, else float32), and
    torch autograd of ``sum(w * torch_fn(x, **params))`` in float64 on the last shape, against
    ``grad``'s gradients of every float initializer. ``extra(shape)`` gives further feeds."""
    double = _runs_in_double(nodes, x_dims, inits, opset, extra_inputs)
    dt, npdt = (D, np.float64) if double else (F, np.float32)
    inits = {k: v.astype(npdt) if np.issubdtype(v.dtype, np.floating) else v for k, v in inits.items()}
    model = _model(nodes, x_dims, inits, opset, dt, extra_inputs)
    feeds = []
    for shape in shapes:
        feed = {"x": RNG.uniform(*x_range, size=shape).astype(npdt)}
        if extra is not None:
            feed.update({k: (v.astype(npdt) if np.issubdtype(v.dtype, np.floating) else v)
                         for k, v in extra(shape).items()})
        feeds.append(feed)
    eps, rtol, atol = (1e-5, 1e-5, 1e-7) if double else f32_tol
    counts = check_model_grads(model, feeds, eps=eps, rtol=rtol, atol=atol)
    assert counts == {"graphs": 2, "sessions": 2}
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
        tol = dict(rtol=1e-7, atol=1e-9) if double else dict(rtol=2e-4, atol=2e-5)
        for k, t in params.items():
            np.testing.assert_allclose(by_path[module.path_of(k)].to_numpy(), t.grad.numpy(), err_msg=k, **tol)


# -- pooling / Col2Im / Resize on dynamic dims ---------------------------------------------------


def _pool_shapes(nodes, torch_fn):
    """Batch and image size changing (a scale per channel), then the channel count changing too (a
    scalar scale: the rules then work per ``[n, c]`` plane)."""
    check_op(nodes, ["N", "C", "H", "W"], [(2, 3, 6, 7), (1, 3, 9, 5)], {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1))},
             17, torch_fn=torch_fn)
    check_op(nodes, ["N", "C", "H", "W"], [(2, 3, 6, 7), (1, 4, 9, 5)], {"s": RNG.uniform(0.5, 1.5, (1,))}, 17,
             torch_fn=torch_fn)


@pytest.mark.parametrize("kernel,strides,pads", [([2, 2], [2, 2], [0, 0, 0, 0]), ([3, 3], [2, 1], [1, 1, 1, 0])])
def test_max_pool_on_dynamic_batch_channels_and_image(kernel, strides, pads):
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("MaxPool", ["xs"], ["y"], kernel_shape=kernel, strides=strides, pads=pads)]

    def torch_fn(x, s):
        import torch

        p = torch.nn.functional.pad(x * s, (pads[1], pads[3], pads[0], pads[2]), value=-float("inf"))
        return torch.nn.functional.max_pool2d(p, kernel, strides)

    _pool_shapes(nodes, torch_fn)


@pytest.mark.parametrize("count_include_pad", [0, 1])
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
