"""Ops of the remaining Burn layers: deformable convolution (``DeformConv``), folding
(``Col2Im``, the adjoint of :func:`onnxparam.ops.unfold4d`), 3-D adaptive average pooling and
training-mode RReLU.

Gradient rules for ``DeformConv`` and ``Col2Im``: :mod:`onnxparam.autodiff._rules_deform`;
adaptive 3-D pooling is ``GlobalAveragePool`` / ``AveragePool`` / ``MatMul`` (existing rules).
"""

from __future__ import annotations

import numpy as np

from ..core.tensor import Tensor
from ._core import _emit, _int64s, _ntuple, _op, _require_opset, _t, _tracer
from ._elementwise import less, mul, where
from ._linalg import matmul
from ._nn import _adaptive_matrix
from ._shape import reshape

__all__ = ["deform_conv2d", "fold4d", "adaptive_avg_pool3d", "rrelu_train"]


def _static(x: Tensor, rank: int, what: str, batch: bool = False) -> tuple:
    """``x``'s dims; all static, or (``batch``) all but the first."""
    if x.rank != rank or not all(isinstance(d, int) for d in x.shape[1 if batch else 0:]):
        kind = "static dims after the batch dim" if batch else "a static shape"
        raise ValueError(f"{what} expects {kind}, rank {rank}; got {list(x.shape)}")
    return tuple(x.shape)


@_op
def deform_conv2d(x, offset, weight, mask=None, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                  weight_groups: int = 1, offset_groups: int = 1) -> Tensor:
    """Deformable 2-D convolution v2 (Dai et al. 2017; Zhu et al. 2019, "Deformable ConvNets v2"),
    Burn's ``deform_conv2d``:

    ``y[n, o, p] = b[o] + sum_{c, k} w[o, c, k] * m[n, g(c) * K + k, p]
    * bilinear(x[n, c], p * s - pad + k * d + offset[n, g(c), k, p])``

    with ``g(c)`` the offset group of input channel ``c``, ``K = kH * kW`` and samples outside the
    image reading 0.

    Args:
        x: ``(N, C_in, H, W)``.
        offset: ``(N, 2 * offset_groups * kH * kW, H_out, W_out)``, ``(dy, dx)`` pairs per kernel
            position, offset-group major (Burn's, ONNX's and torchvision's layout).
        weight: ``(C_out, C_in / weight_groups, kH, kW)``.
        mask: ``(N, offset_groups * kH * kW, H_out, W_out)`` modulation, or ``None`` (all ones,
            deformable convolution v1).
        bias: ``(C_out,)`` or ``None``.
        stride, padding, dilation: ints or pairs (padding symmetric).
        weight_groups: ``C_in`` and ``C_out`` split into this many groups (ONNX ``group``).
        offset_groups: ``C_in`` split into this many groups sharing offsets (ONNX ``offset_group``).

    ONNX: ``DeformConv`` (opset 19, ONNX spec: DeformConv).

    Raises:
        ValueError: for non-static or mismatched shapes; TraceError below opset 19.
    """
    _require_opset("DeformConv", 19)
    x, offset, weight = _t(x), _t(offset), _t(weight)
    n, c_in, h, w = _static(x, 4, "deform_conv2d's input", batch=True)
    c_out, c_per_group, kh, kw = _static(weight, 4, "deform_conv2d's weight")
    sh, sw = _ntuple(stride, 2, "stride")
    ph, pw = _ntuple(padding, 2, "padding")
    dh, dw = _ntuple(dilation, 2, "dilation")
    wg, og = int(weight_groups), int(offset_groups)
    if wg < 1 or og < 1 or c_in % wg or c_out % wg or c_in % og or c_per_group * wg != c_in:
        raise ValueError(f"deform_conv2d: channels (in {c_in}, out {c_out}, weight {list(weight.shape)}) do not "
                         f"fit weight_groups={wg}, offset_groups={og}")
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"deform_conv2d: the kernel does not fit the padded input {[h, w]}")
    want = (2 * og * kh * kw, ho, wo)
    if offset.rank != 4 or tuple(offset.shape[1:]) != want:
        raise ValueError(f"deform_conv2d: offset must have shape {['N', *want]}; got {list(offset.shape)}")
    inputs = [x, weight, offset, None if bias is None else _t(bias)]
    if mask is not None:
        mask = _t(mask)
        if mask.rank != 4 or tuple(mask.shape[1:]) != (og * kh * kw, ho, wo):
            raise ValueError(f"deform_conv2d: mask must have shape {['N', og * kh * kw, ho, wo]}; "
                             f"got {list(mask.shape)}")
        inputs.append(mask)
    while inputs[-1] is None:
        inputs.pop()
    attrs = {"kernel_shape": [kh, kw], "strides": [sh, sw], "pads": [ph, pw, ph, pw], "dilations": [dh, dw],
             "group": wg, "offset_group": og}
    return _emit("DeformConv", inputs, attrs, types=[(x.dtype, (n, c_out, ho, wo))])


@_op
def fold4d(x, output_size, kernel_size, stride=(1, 1), padding=(0, 0), dilation=(1, 1)) -> Tensor:
    """Combine sliding local blocks ``[N, C * kH * kW, L]`` into ``[N, C, H, W]``, summing
    overlaps (col2im; Burn's ``fold4d``, PyTorch's ``nn.Fold``): the adjoint of
    :func:`onnxparam.ops.unfold4d`, row ``c * kH * kW + i * kW + j`` of block ``l`` adds into
    ``y[n, c, h_l * s + i * d - p, w_l * s + j * d - p]``.

    ONNX: ``Col2Im`` (opset 18, ONNX spec: Col2Im). NOTE: ONNX Runtime 1.32's CPU provider has
    ``Col2Im`` for float32 only (a float64 graph fails at session creation, naming the node).

    Raises:
        ValueError: when the rows are not a multiple of ``kH * kW`` or ``L`` is not the number of
            blocks ``output_size`` holds; TraceError below opset 18.
    """
    _require_opset("Col2Im", 18)
    x = _t(x)
    if x.rank != 3 or not isinstance(x.shape[1], int):
        raise ValueError(f"fold4d expects [N, C * kH * kW, L] with static rows; got {list(x.shape)}")
    n, rows, length = x.shape
    oh, ow = _ntuple(output_size, 2, "output_size")
    kh, kw = _ntuple(kernel_size, 2, "kernel_size")
    sh, sw = _ntuple(stride, 2, "stride")
    ph, pw = _ntuple(padding, 2, "padding")
    dh, dw = _ntuple(dilation, 2, "dilation")
    blocks_h = (oh + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    blocks_w = (ow + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if rows % (kh * kw) or blocks_h < 1 or blocks_w < 1 or (isinstance(length, int) and length != blocks_h * blocks_w):
        raise ValueError(f"fold4d: input {[n, rows, length]} does not fit output_size {[oh, ow]}, kernel "
                         f"{[kh, kw]} ({blocks_h} x {blocks_w} blocks of C * {kh * kw} rows expected)")
    attrs = {"strides": [sh, sw], "pads": [ph, pw, ph, pw], "dilations": [dh, dw]}
    return _emit("Col2Im", [x, _int64s([oh, ow]), _int64s([kh, kw])], attrs,
                 types=[(x.dtype, (n, rows // (kh * kw), oh, ow))])


@_op
def adaptive_avg_pool3d(x, output_size) -> Tensor:
    """Average pooling of ``[N, C, D, H, W]`` to ``(oD, oH, oW)`` (an int for a cube), windows as
    PyTorch's / Burn's ``AdaptiveAvgPool3d`` (window ``i`` of an axis of length ``n`` is
    ``[floor(i n / o), ceil((i + 1) n / o))``).

    ONNX: ``GlobalAveragePool`` for ``(1, 1, 1)``; ``AveragePool`` when each input size is a
    multiple of the output size; else ``MatMul`` s with constant averaging matrices.

    Raises:
        ValueError: for a non-static input of another rank or a non-positive size.
    """
    x = _t(x)
    n, c, d, h, w = _static(x, 5, "adaptive_avg_pool3d", batch=True)
    size = _ntuple(output_size, 3, "output_size")
    if any(s < 1 for s in size):
        raise ValueError(f"adaptive_avg_pool3d: output_size must be positive; got {list(size)}")
    od, oh, ow = size
    if size == (1, 1, 1):
        return _emit("GlobalAveragePool", [x], types=[(x.dtype, (n, c, 1, 1, 1))])
    if d % od == 0 and h % oh == 0 and w % ow == 0:
        k = [d // od, h // oh, w // ow]
        return _emit("AveragePool", [x], {"kernel_shape": k, "strides": k}, types=[(x.dtype, (n, c, od, oh, ow))])
    y = x
    if ow != w:
        y = matmul(y, _tracer().constant(np.ascontiguousarray(_adaptive_matrix(w, ow, x.dtype).T)))
    if oh != h:
        y = matmul(_tracer().constant(_adaptive_matrix(h, oh, x.dtype)), y)
    if od != d:
        y = reshape(matmul(_tracer().constant(_adaptive_matrix(d, od, x.dtype)), reshape(y, [0, c, d, oh * ow])),
                    [0, c, od, oh, ow])
    return y


@_op
def rrelu_train(x, lower: float = 0.125, upper: float = 1.0 / 3.0, seed=None) -> Tensor:
    """Training-mode randomized leaky ReLU (Xu et al. 2015, "Empirical Evaluation of Rectified
    Activations in Convolutional Network"; Burn's ``RRelu::forward`` on an autodiff backend):
    ``x if x >= 0 else a * x`` with a slope ``a ~ U[lower, upper)`` drawn per element at every
    run. (Inference mode is ``leaky_relu(x, (lower + upper) / 2)``.)

    ``seed``: the ``RandomUniformLike`` node's ``seed`` attribute, or ``None`` for ONNX
    Runtime's own (see :func:`onnxparam.ops.dropout_train`).

    ONNX: ``RandomUniformLike`` (``low``, ``high``), ``Less``, ``Mul``, ``Where``; the gradient
    is ``a`` for negative inputs and 1 elsewhere, with the forward's slopes.

    Raises:
        ValueError: when ``lower > upper``.
    """
    if float(lower) > float(upper):
        raise ValueError(f"rrelu: lower bound ({lower}) must be <= upper bound ({upper})")
    x = _t(x)
    attrs = {"low": float(lower), "high": float(upper), "seed": None if seed is None else float(seed)}
    slope = _emit("RandomUniformLike", [x], attrs, types=[(x.dtype, x.shape)])
    return where(less(x, 0.0), mul(x, slope), x)
