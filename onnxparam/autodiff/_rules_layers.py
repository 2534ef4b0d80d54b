"""Gradient rules of the operators the wider layer set emits (:mod:`onnxparam.ops._activation`):
``ConvTranspose``, ``PRelu`` and the elementwise activations ``Elu``, ``Selu``, ``Celu``,
``HardSigmoid``, ``HardSwish``, ``Softplus``, ``Softsign``, ``Resize``, and the variadic
elementwise ``Max`` / ``Min`` of imported models (conventions and
notation: :mod:`._rules`; forward semantics: the ONNX operator specification).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..core.errors import TraceError
from ._emitter import Emitter, dims, np_dtype, static_dims
from ._rules import attr, const_array, rule
from ._rules_nn import conv_operands, conv_weight_grad

__all__ = []


@rule("ConvTranspose")
def _conv_transpose(e, node, gout, need):
    """``y = ConvTranspose(x, w) + b`` (ONNX spec: ConvTranspose; ``w`` is
    ``[C_in, C_out / group, k...]``) is the adjoint of ``Conv(., w)`` with the same strides,
    dilations, pads and group, so:

    * ``dx = Conv(g, w)`` (the same attributes; cut to ``x``'s size when ``output_padding``
      made the output longer than the convolution reads back);
    * ``dw`` is ``Conv``'s weight gradient with the roles exchanged: input ``g``, output
      gradient ``x`` (:func:`._rules_nn.conv_weight_grad`);
    * ``db = sum(g, axes=[0, 2, ...])``.

    Raises:
        TraceError: for ``output_shape`` or ``auto_pad`` forms (the ops never emit them).
    """
    if "output_shape" in node.attributes or attr(node, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        raise TraceError(f"node {node.name!r}: ConvTranspose with output_shape / auto_pad has no gradient rule")
    x, w, b, g, xd, wd, yd, nd, kernel, group, strides, dilations, begin, end = conv_operands(node, gout)
    out = [None] * len(node.inputs)
    if need[0]:
        dx = e.op("Conv", g, w, strides=strides, dilations=dilations, pads=list(begin) + list(end), group=group)
        if not all(isinstance(d, int) for d in tuple(xd[2:]) + tuple(yd[2:])):
            dx = e.op("Slice", dx, e.ints([0] * nd), e.dims_of(x, 2), e.ints(range(2, 2 + nd)))
            out[0] = dx
        read = [(yd[2 + i] + begin[i] + end[i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
                for i in range(nd)] if out[0] is None else list(xd[2:])
        if read != list(xd[2:]):
            dx = e.op("Slice", dx, e.ints([0] * nd), e.ints(xd[2:]), e.ints(range(2, 2 + nd)))
        out[0] = dx
    if need[1]:
        out[1] = conv_weight_grad(e, g, x, yd, xd, wd[0], kernel, strides, dilations, begin, end, group, x,
                                  node.outputs[0], channels=wd[1] * group if isinstance(wd[1], int) else None)
    if b is not None and need[2]:
        out[2] = e.reduce_sum(g, [0] + list(range(2, 2 + nd)), keepdims=False)
    return out


def _where_positive(e: Emitter, x, if_positive, otherwise, strict: bool = True):
    test = e.op("Greater" if strict else "GreaterOrEqual", x, e.scalar_like(0.0, x))
    return e.op("Where", test, if_positive, otherwise)


@rule("PRelu")
def _prelu(e, node, gout, need):
    """``y = x if x >= 0 else slope * x`` (``slope`` broadcast to ``x``):
    ``dx = g if x >= 0 else slope * g``; ``dslope = unb(g * x if x < 0 else 0, slope)``."""
    x, slope = node.inputs
    g = gout[0]
    out = [None, None]
    if need[0]:
        out[0] = _where_positive(e, x, g, e.op("Mul", g, slope), strict=False)
    if need[1]:
        shape = static_dims(node.outputs[0], "PRelu's gradient")
        masked = _where_positive(e, x, e.scalar_like(0.0, x), e.op("Mul", g, x), strict=False)
        out[1] = e.unbroadcast(masked, slope, shape)
    return out


@rule("Elu")
def _elu(e, node, gout, need):
    """``y = x if x >= 0 else alpha * (exp(x) - 1)``: ``dx = g if x > 0 else g * (y + alpha)``."""
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    alpha = float(attr(node, "alpha", 1.0))
    return [_where_positive(e, x, g, e.op("Mul", g, e.op("Add", y, e.scalar_like(alpha, y))))]


@rule("Selu")
def _selu(e, node, gout, need):
    """``y = gamma * x if x > 0 else gamma * alpha * (exp(x) - 1)``:
    ``dx = gamma * g if x > 0 else g * (y + gamma * alpha)``."""
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    alpha = float(attr(node, "alpha", 1.67326319217681884765625))
    gamma = float(attr(node, "gamma", 1.05070102214813232421875))
    return [_where_positive(e, x, e.op("Mul", g, e.scalar_like(gamma, g)),
                            e.op("Mul", g, e.op("Add", y, e.scalar_like(gamma * alpha, y))))]


@rule("Celu")
def _celu(e, node, gout, need):
    """``y = max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``:
    ``dx = g if x > 0 else g * (y / alpha + 1)`` (``= g * exp(x / alpha)``)."""
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    alpha = float(attr(node, "alpha", 1.0))
    slope = e.op("Add", e.op("Mul", y, e.scalar_like(1.0 / alpha, y)), e.scalar_like(1.0, y))
    return [_where_positive(e, x, g, e.op("Mul", g, slope))]


@rule("HardSigmoid")
def _hard_sigmoid(e, node, gout, need):
    """``y = clamp(alpha * x + beta, 0, 1)``: ``dx = alpha * g`` where ``0 < alpha * x + beta < 1``,
    else 0."""
    x, g = node.inputs[0], gout[0]
    alpha, beta = float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5))
    v = e.op("Add", e.op("Mul", x, e.scalar_like(alpha, x)), e.scalar_like(beta, x))
    inside = e.op("And", e.op("Greater", v, e.scalar_like(0.0, x)), e.op("Less", v, e.scalar_like(1.0, x)))
    return [e.op("Where", inside, e.op("Mul", g, e.scalar_like(alpha, g)), e.scalar_like(0.0, x))]


@rule("HardSwish")
def _hard_swish(e, node, gout, need):
    """``y = x * clamp(x / 6 + 1 / 2, 0, 1)``: ``dy/dx`` is 0 for ``x <= -3``, ``x / 3 + 1 / 2``
    on ``(-3, 3)``, 1 for ``x >= 3``."""
    x, g = node.inputs[0], gout[0]
    middle = e.op("Add", e.op("Mul", x, e.scalar_like(1.0 / 3.0, x)), e.scalar_like(0.5, x))
    slope = e.op("Where", e.op("GreaterOrEqual", x, e.scalar_like(3.0, x)), e.scalar_like(1.0, x),
                 e.op("Where", e.op("Greater", x, e.scalar_like(-3.0, x)), middle, e.scalar_like(0.0, x)))
    return [e.op("Mul", g, slope)]


@rule("Softplus")
def _softplus(e, node, gout, need):
    """``y = log(1 + exp(x))``: ``dx = g * sigmoid(x)``."""
    return [e.op("Mul", gout[0], e.op("Sigmoid", node.inputs[0]))]


@rule("Softsign")
def _softsign(e, node, gout, need):
    """``y = x / (1 + |x|)``: ``dx = g / (1 + |x|)^2``."""
    x = node.inputs[0]
    d = e.op("Add", e.op("Abs", x), e.scalar_like(1.0, x))
    return [e.op("Div", gout[0], e.op("Mul", d, d))]


_RESIZE_ATTRS = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a", "exclude_outside",
                 "extrapolation_value", "antialias")


def _resize_matrix(node, n_in: int, n_out: int, scale, opset: int) -> np.ndarray:
    """The ``(n_out, n_in)`` matrix ``A`` of ``node``'s 1-D resampling along one axis
    (``y = A @ x``): ONNX Runtime's own ``Resize`` (the engine that runs the forward, at the
    graph's opset, with every attribute of the node, ``antialias`` included) applied to the
    identity. Resize resamples each axis independently (ONNX spec: Resize), so the full
    operator is these matrices per axis."""
    import onnxruntime as ort

    attrs = {}
    for name in _RESIZE_ATTRS:
        value = attr(node, name, None)
        if value is not None:
            attrs[name] = value.decode() if isinstance(value, bytes) else value
    if node.op_type == "Upsample":  # (deprecated since opset 10): ORT's Upsample-9 itself
        opset = 9
        mode = attr(node, "mode", "nearest")
        resize = helper.make_node("Upsample", ["X", "S"], ["Y"], mode=mode.decode() if isinstance(mode, bytes) else mode)
    else:
        opset = max(int(opset), 11)
        # NOTE: roi and scales are required inputs at opsets 11-12 ("" is refused there): empty
        # tensors stand for them, as exporters (paddle2onnx) write them
        inputs = ["X", "roi", "S"] if scale is not None else ["X", "roi", "" if opset >= 13 else "no_scales", "S"]
        resize = helper.make_node("Resize", inputs, ["Y"], **attrs)
    s_type = TensorProto.FLOAT if scale is not None else TensorProto.INT64
    graph = helper.make_graph([resize], "resize_matrix",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [n_in, 1, 1, n_in]),
                               helper.make_tensor_value_info("S", s_type, [4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("roi", TensorProto.FLOAT, [0], []),
                               helper.make_tensor("no_scales", TensorProto.FLOAT, [0], [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feed = np.array([1, 1, 1, scale], np.float32) if scale is not None else np.array([n_in, 1, 1, n_out], np.int64)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        y = session.run(None, {"X": np.eye(n_in, dtype=np.float32).reshape(n_in, 1, 1, n_in), "S": feed})[0]
    except Exception as err:  # noqa: BLE001 - ORT refuses this Resize form
        raise TraceError(f"node {node.name!r}: cannot rebuild its resampling matrix with ONNX Runtime: {err}") from None
    if y.shape != (n_in, 1, 1, n_out):
        raise TraceError(f"node {node.name!r}: cannot rebuild its resampling ({n_in} -> {n_out}, got {y.shape})")
    return y[:, 0, 0, :].T.astype(np.float64)


@rule("Resize", "Upsample")
def _resize(e, node, gout, need):
    """``y = Resize(x)`` (or the older ``Upsample``) over the last one or two axes is linear and
    separable: ``y = A_h @ x @ A_w^T`` with constant interpolation matrices (one per resized
    axis, rebuilt by ONNX Runtime itself from the node's mode and coordinate attributes), so
    ``dx = A_h^T @ g @ A_w`` (``MatMul`` s; an axis whose size does not change and whose matrix
    is the identity is skipped).

    Raises:
        TraceError: for a resized axis other than the last two, a ``roi`` input
            (``tf_crop_and_resize``) or scales / sizes that are not constants.
    """
    x, g = node.inputs[0], gout[0]
    xd = static_dims(x, "Resize's gradient")
    yd = static_dims(node.outputs[0], "Resize's gradient")
    rank = len(xd)
    if len(node.inputs) > 1 and node.inputs[1] is not None and const_array(node.inputs[1]) is None:
        raise TraceError(f"node {node.name!r}: Resize with a computed roi has no gradient rule")
    mode = attr(node, "coordinate_transformation_mode", "half_pixel")
    if (mode.decode() if isinstance(mode, bytes) else mode) == "tf_crop_and_resize":
        raise TraceError(f"node {node.name!r}: Resize in tf_crop_and_resize mode has no gradient rule")
    axes = [int(a) % rank for a in (attr(node, "axes", None) or range(rank))]
    scales = const_array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    if node.op_type == "Upsample":
        scales = const_array(node.inputs[1]) if len(node.inputs) > 1 else np.asarray(attr(node, "scales"), np.float32)
        if scales is None:
            raise TraceError(f"node {node.name!r}: Upsample with computed scales has no gradient rule")
    if scales is not None and scales.size == 0:
        scales = None
    dtype = np_dtype(x)
    dx = g
    for i, a in enumerate(axes):
        scale = None if scales is None else float(scales[i if scales.size == len(axes) else a])
        matrix = _resize_matrix(node, xd[a], yd[a], scale, e.opset)
        if matrix.shape[0] == matrix.shape[1] and np.allclose(matrix, np.eye(matrix.shape[0])):
            continue
        if a == rank - 1:
            dx = e.op("MatMul", dx, e.const(matrix.astype(dtype), dtype))
        elif a == rank - 2:
            dx = e.op("MatMul", e.const(np.ascontiguousarray(matrix.T).astype(dtype), dtype), dx)
        else:
            raise TraceError(f"node {node.name!r}: Resize's gradient supports resized last two axes only; "
                             f"axis {a} of {list(xd)} changes")
    return [dx] + [None] * (len(node.inputs) - 1)


@rule("Max", "Min")
def _max_min(e, node, gout, need):
    """``y = max(x_1, ..., x_n)`` elementwise, numpy broadcasting (ONNX spec: Max, Min): the
    gradient goes to the inputs equal to ``y``, ties sharing it equally (PyTorch's ``maximum``
    rule): ``dx_i = unb(g * [x_i == y] / #{j: x_j == y}, x_i)``."""
    g, y = gout[0], node.outputs[0]
    shape, to = dims(y), int(y.dtype)
    masks = [e.op("Cast", e.op("Equal", x, y), to=to) for x in node.inputs]
    count = masks[0]
    for mask in masks[1:]:
        count = e.op("Add", count, mask)
    share = e.op("Div", g, count) if len(masks) > 1 else g
    return [e.unbroadcast(e.op("Mul", share, mask), x, shape) if n else None
            for x, mask, n in zip(node.inputs, masks, need)]


@rule("GlobalMaxPool")
def _global_max_pool(e, node, gout, need):
    """``y = max of x over its spatial dims`` (kept as 1; ONNX spec: GlobalMaxPool): as
    ``ReduceMax``, ties share: ``dx = g * [x == y] / #{x == y}``."""
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    mask = e.op("Cast", e.op("Equal", x, y), to=int(x.dtype))
    count = e.reduce_sum(mask, list(range(2, len(dims(x)))), keepdims=True)
    return [e.op("Mul", mask, e.op("Div", g, count))]
