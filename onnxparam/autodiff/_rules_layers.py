"""Gradient rules of the operators the wider layer set emits (:mod:`onnxparam.ops._activation`):
``ConvTranspose``, ``PRelu`` and the elementwise activations ``Elu``, ``Selu``, ``Celu``,
``HardSigmoid``, ``HardSwish``, ``Softplus``, ``Softsign``, ``Resize``, and the variadic
elementwise ``Max`` / ``Min`` of imported models (conventions and
notation: :mod:`._rules`; forward semantics: the ONNX operator specification).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
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
    is the identity is skipped). With run-time dims, computed scales or sizes, or a resized
    axis before the last two, the matrices are built in the graph instead
    (:func:`_resize_dynamic`): one backward graph for every size.

    Raises:
        TraceError: for a computed ``roi``, ``tf_crop_and_resize``, or run-time sizes with a
            ``keep_aspect_ratio_policy`` other than ``stretch``: the registered ``Resize`` /
            ``Upsample`` rule, :func:`._rules_sampling._resize_rule`, handles
            ``tf_crop_and_resize`` and ``keep_aspect_ratio_policy`` with sizes itself and calls
            this for the other forms.
    """
    x, g = node.inputs[0], gout[0]
    xd, yd = dims(x), dims(node.outputs[0])
    rank = len(xd)
    if node.op_type == "Resize" and len(node.inputs) > 1 and node.inputs[1] is not None \
            and e.opset >= 11 and const_array(node.inputs[1]) is None:
        raise TraceError(f"node {node.name!r}: Resize with a computed roi has no gradient rule")
    mode = attr(node, "coordinate_transformation_mode", "half_pixel")
    if (mode.decode() if isinstance(mode, bytes) else mode) == "tf_crop_and_resize":
        raise TraceError(f"node {node.name!r}: Resize in tf_crop_and_resize mode has no gradient rule")
    axes = [int(a) % rank for a in (attr(node, "axes", None) or range(rank))]
    scale_input = _resize_scales_input(node, e.opset)
    sizes_input = node.inputs[3] if node.op_type == "Resize" and len(node.inputs) > 3 else None
    if node.op_type == "Upsample" and scale_input is None:
        scales = np.asarray(attr(node, "scales"), np.float32)
    else:
        scales = const_array(scale_input) if scale_input is not None else None
    if scales is not None and scales.size == 0:
        scales, scale_input = None, None
    static = all(isinstance(d, int) for d in tuple(xd) + tuple(yd))
    outer = [a for a in axes if a < rank - 2 and (not static or xd[a] != yd[a])]
    if not static or outer or (scales is None and scale_input is not None) or \
            (scales is None and sizes_input is not None and const_array(sizes_input) is None):
        return [_resize_dynamic(e, node, g, axes, scale_input if scales is None else None, scales)] \
            + [None] * (len(node.inputs) - 1)
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
        else:  # (an outer axis whose size stays, with a non-identity matrix)
            return [_resize_dynamic(e, node, g, axes, None, scales)] + [None] * (len(node.inputs) - 1)
    return [dx] + [None] * (len(node.inputs) - 1)


def _resize_scales_input(node, opset: int):
    """The scales input of a ``Resize`` (input 1 at opset 10, 2 after) / ``Upsample`` (input 1
    from opset 9), or ``None``."""
    index = 1 if node.op_type == "Upsample" or opset < 11 else 2
    if len(node.inputs) > index and node.inputs[index] is not None:
        return node.inputs[index]
    return None


def _axis_identity(e: Emitter, n_in):
    """The identity ``[n_in, 1, 1, n_in]`` (float32, ``EyeLike`` of the run-time size ``n_in``,
    an int64 ``[1]``): a resampling operator applied to it along its last axis gives that axis's
    matrix ``A^T`` ``[n_in, 1, 1, n_out]``."""
    f32 = np.float32
    square = e.op("Concat", n_in, n_in, axis=0)
    eye = e.op("EyeLike", e.op("Expand", e.const(0.0, f32), square))
    return e.op("Reshape", eye, e.concat_ints(n_in, [1, 1], n_in))


def _along_axis(e: Emitter, dx, resized, n_in, n_out, a: int, rank: int, dtype):
    """``A^T g`` along axis ``a`` of ``dx`` (rank ``rank``, ``n_out`` long there): ``resized``
    is :func:`_axis_identity` resampled (``A^T`` as ``[n_in, 1, 1, n_out]``), cast to ``dtype``
    (the input's element type); the axis is moved last for the ``MatMul`` and back."""
    matrix = e.op("Reshape", resized, e.concat_ints(n_in, n_out))  # A^T: [n_in, n_out]
    if dtype is not None and dtype != ir.DataType.FLOAT:
        matrix = e.op("Cast", matrix, to=int(dtype))
    perm = [d for d in range(rank) if d != a] + [a]
    moved = e.transpose(dx, perm)  # [..., n_out]
    back = e.op("MatMul", moved, e.op("Transpose", matrix, perm=[1, 0]))  # [..., n_in]
    inverse = [0] * rank
    for j, p_ in enumerate(perm):
        inverse[p_] = j
    return e.transpose(back, inverse)


def _resize_dynamic(e: Emitter, node, g, axes: list, scale_value, scales):
    """:func:`_resize`'s gradient with run-time sizes or scales: each resized axis's matrix is
    built in the graph, by the same operator (the node's attributes, at the graph's opset)
    applied along one axis to an identity ``[n_in, 1, 1, n_in]`` (``EyeLike``) with that axis's
    scale (``scale_value`` the run-time scales, ``scales`` constant ones) or with the sizes
    ``[n_in, 1, 1, n_out]`` (read from the shapes); then ``dx = A^T g`` along the axis
    (``MatMul``, the axis moved last)."""
    x, y = node.inputs[0], node.outputs[0]
    rank = len(dims(x))
    policy = attr(node, "keep_aspect_ratio_policy", "stretch")
    if (policy.decode() if isinstance(policy, bytes) else policy) != "stretch" and scales is None \
            and scale_value is None:
        raise TraceError(f"node {node.name!r}: Resize's gradient with run-time sizes supports "
                         "keep_aspect_ratio_policy='stretch' only")
    attrs = {}
    for name in _RESIZE_ATTRS:
        value = attr(node, name, None)
        if value is not None:
            attrs[name] = value.decode() if isinstance(value, bytes) else value
    f32 = np.float32
    dx = g
    for i, a in enumerate(axes):
        n_in, n_out = e.reshape(e.dim_scalar(x, a), [1]), e.reshape(e.dim_scalar(y, a), [1])
        if scales is not None:
            s = float(scales[i if scales.size == len(axes) else a])
            if s == 1.0 and isinstance(dims(x)[a], int) and dims(x)[a] == dims(y)[a]:
                continue
            scale4 = e.const(np.array([1, 1, 1, s], f32), f32)
        elif scale_value is not None:
            one = e.op("Gather", scale_value, e.ints([i]), axis=0)
            scale4 = e.op("Concat", e.const(np.ones(3, f32), f32), e.op("Cast", one, to=int(TensorProto.FLOAT)),
                          axis=0)
        else:
            scale4 = None
        eye4 = _axis_identity(e, n_in)
        if node.op_type == "Upsample":
            if e.opset >= 9:
                resized = e.op("Upsample", eye4, scale4, **attrs)
            else:
                resized = e.op("Upsample", eye4, scales=[1.0, 1.0, 1.0, float(scales[a])], **attrs)
        elif e.opset < 11:
            resized = e.op("Resize", eye4, scale4, **attrs)
        else:
            roi = e.const(np.zeros(0, f32), f32)
            empty = e.const(np.zeros(0, f32), f32)
            if scale4 is not None:
                resized = e.op("Resize", eye4, roi if e.opset < 13 else None, scale4, **attrs)
            else:
                sizes4 = e.concat_ints(n_in, [1, 1], n_out)
                resized = e.op("Resize", eye4, roi if e.opset < 13 else None, empty if e.opset < 13 else None,
                               sizes4, **attrs)
        dx = _along_axis(e, dx, resized, n_in, n_out, a, rank, x.dtype)
    return dx


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
