"""Gradient rules of the sampling forms the older rules refuse: ``Resize`` in
``tf_crop_and_resize`` mode, ``GridSample`` with bicubic sampling, reflection padding or a 3-D
grid, ``MaxRoiPool``, and ``RoiAlign`` in ``max`` mode. Each rule here handles its new forms and
hands the others to the older rule (:mod:`._rules_layers` ``Resize``, :mod:`._rules_spatial`
``GridSample`` / ``RoiAlign``), so it is registered after them.

Conventions (a rule's signature, ``g = dL/dy``) are those of :mod:`onnxparam.autodiff._rules`;
layouts ONNX's (``x`` ``[N, C, spatial...]``); forward semantics: the ONNX operator
specification (https://onnx.ai/onnx/operators/) as ONNX Runtime (the engine that runs the
forward) implements it. No rule here needs a static dim.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, dims
from ._rules import attr, rule
from ._rules_layers import _RESIZE_ATTRS, _resize, _resize_scales_input

__all__ = []

_F32 = np.float32


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- Resize, tf_crop_and_resize ---------------------------------------------------------------------


@rule("Resize", "Upsample")
def _resize_rule(e, node, gout, need):
    """``Resize`` with ``coordinate_transformation_mode="tf_crop_and_resize"``: along each resized
    axis ``a`` the output samples ``x_in = start (n_in - 1) + i (end - start) (n_in - 1) /
    (n_out - 1)`` of the crop ``[start, end]`` (``roi``) and writes ``extrapolation_value`` where
    that falls outside ``[0, n_in - 1]`` (ONNX spec: Resize). Per axis the map from ``x`` is the
    matrix ``A`` (an output row outside the image is 0; the extrapolated constant does not depend
    on ``x``), so ``dx = A^T g`` along each axis. ``A^T`` is built in the graph by the same
    operator (the node's attributes with ``extrapolation_value=0``, its scale or the sizes read
    from the shapes, the axis's ``[start, end]`` taken from ``roi`` at run time) applied to an
    identity ``[n_in, 1, 1, n_in]``: every choice is ONNX Runtime's. ``roi``, ``scales`` and
    ``sizes`` get no gradient (not differentiable). Other modes: :func:`~._rules_layers._resize`.
    """
    mode = _text(attr(node, "coordinate_transformation_mode", "half_pixel"))
    if node.op_type != "Resize" or mode != "tf_crop_and_resize":
        return _resize(e, node, gout, need)
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    roi = node.inputs[1] if len(node.inputs) > 1 else None
    if roi is None:
        raise TraceError(f"node {node.name!r}: Resize in tf_crop_and_resize mode without a roi")
    rank = len(dims(x))
    given_axes = attr(node, "axes", None)
    axes = [int(a) % rank for a in (given_axes or range(rank))]
    scale_input = _resize_scales_input(node, e.opset)
    attrs = {}
    for name in _RESIZE_ATTRS:
        value = attr(node, name, None)
        if value is not None:
            attrs[name] = _text(value)
    attrs["extrapolation_value"] = 0.0
    roi32 = e.op("Cast", roi, to=int(ir.DataType.FLOAT))
    count = len(axes) if given_axes else rank
    dx = g
    for i, a in enumerate(axes):
        k = i if given_axes else a
        n_in, n_out = e.reshape(e.dim_scalar(x, a), [1]), e.reshape(e.dim_scalar(y, a), [1])
        start = e.op("Slice", roi32, e.ints([k]), e.ints([k + 1]), e.ints([0]))
        end = e.op("Slice", roi32, e.ints([count + k]), e.ints([count + k + 1]), e.ints([0]))
        roi4 = e.op("Concat", e.const(np.zeros(3, _F32), _F32), start, e.const(np.ones(3, _F32), _F32), end, axis=0)
        square = e.op("Concat", n_in, n_in, axis=0)
        eye = e.op("EyeLike", e.op("Expand", e.const(0.0, _F32), square))
        eye4 = e.op("Reshape", eye, e.concat_ints(n_in, [1, 1], n_in))
        scales = None
        if scale_input is not None and (scale_input.shape is None or dims(scale_input) != (0,)):
            one = e.op("Gather", e.op("Cast", scale_input, to=int(ir.DataType.FLOAT)), e.ints([i]), axis=0)
            scales = e.op("Concat", e.const(np.ones(3, _F32), _F32), one, axis=0)
        if scales is not None:
            resized = e.op("Resize", eye4, roi4, scales, **attrs)
        else:
            empty = e.const(np.zeros(0, _F32), _F32) if e.opset < 13 else None
            resized = e.op("Resize", eye4, roi4, empty, e.concat_ints(n_in, [1, 1], n_out), **attrs)
        matrix = e.op("Reshape", resized, e.concat_ints(n_in, n_out))  # A^T: [n_in, n_out]
        if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
            matrix = e.op("Cast", matrix, to=int(x.dtype))
        perm = [d for d in range(rank) if d != a] + [a]
        moved = e.transpose(dx, perm)  # [..., n_out]
        back = e.op("MatMul", moved, e.op("Transpose", matrix, perm=[1, 0]))  # [..., n_in]
        inverse = [0] * rank
        for j, p_ in enumerate(perm):
            inverse[p_] = j
        dx = e.transpose(back, inverse)
    return [dx] + [None] * (len(node.inputs) - 1)
