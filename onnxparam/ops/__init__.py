"""Functional tensor ops: each emits ONNX nodes (the op contract, ``docs/ops_contract.md``).

Every op takes and returns :class:`~onnxparam.Tensor` s; Python scalars are accepted where an
operand is numeric. Layouts are Burn's / ONNX's: NCHW / NCL, conv weight
``[out, in/groups, k...]``, Linear weight ``[d_in, d_out]``. Each docstring names the ONNX
operator(s) emitted; the semantics (and formulas) are the ONNX operator specification's,
https://onnx.ai/onnx/operators/ (cited as "ONNX spec: <Op>").

Inside a trace (a module's ``forward``, see :mod:`onnxparam.trace.tracer`) an op appends nodes to the
graph and returns symbolic tensors. Outside a trace, an op on concrete tensors runs *eagerly*:
the op is traced into a small graph whose inputs are its tensor arguments, run through ONNX
Runtime, and the session cached by signature (shapes, dtypes, devices, other arguments) in
:mod:`onnxparam.runtime`.

Dtype rules: tensor operands of one op must have the same dtype (cast one with :func:`cast`);
a Python scalar takes the tensor operand's dtype, except that a float scalar with an int/bool
tensor casts the tensor to ``F32`` first, and an int scalar with a bool tensor casts it to
``I64`` (PyTorch's promotion of scalars).

Opsets: the ops target ``ai.onnx`` 13 and newer natively (``Gelu`` from 20,
``LayerNormalization`` from 17, axes as inputs of ``Reduce*`` from 18), and emit the older
attribute forms where a graph is traced at an older opset (an imported model keeps its own);
an op ONNX lacks at that opset raises :class:`~onnxparam.TraceError`.

Modules: :mod:`._elementwise`, :mod:`._linalg` (matmul, linear, activations), :mod:`._shape`,
:mod:`._reduce`, :mod:`._nn` (convolution, pooling, normalization), :mod:`._conv_transpose`, :mod:`._norm_train`, :mod:`._activation` (transposed
convolution, group / RMS normalization, Burn's wider activations, training-mode batch norm and
dropout), :mod:`._nn_spatial` (3-D convolution, 1-D pooling, pixel shuffle, unfold, LRN,
interpolation), :mod:`._nn_deform` (deformable convolution, fold, 3-D adaptive pooling), :mod:`._custom`; import the ops from ``onnxparam.ops``.
"""

from ._activation import (
    celu,
    elu,
    glu,
    hard_shrink,
    hard_sigmoid,
    hard_swish,
    hardtanh,
    leaky_relu,
    log_sigmoid,
    mish,
    prelu,
    relu6,
    selu,
    silu,
    soft_shrink,
    softplus,
    softsign,
    tanhshrink,
    threshold,
    thresholded_relu,
)
from ._conv_transpose import (
    conv_transpose1d,
    conv_transpose2d,
)
from ._creation import arange, full, ones, zeros
from ._custom import custom, subgraph
from ._elementwise import (
    abs,
    add,
    cast,
    clamp,
    div,
    equal,
    erf,
    exp,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    logical_and,
    logical_not,
    logical_or,
    mul,
    neg,
    pow,
    relu,
    sigmoid,
    sqrt,
    sub,
    tanh,
    where,
)
from ._linalg import gelu, linear, log_softmax, matmul, softmax
from ._nn import adaptive_avg_pool2d, avg_pool2d, batch_norm, conv1d, conv2d, dropout, layer_norm, max_pool2d
from ._nn_deform import adaptive_avg_pool3d, deform_conv2d, fold4d, rrelu_train
from ._nn_spatial import (
    adaptive_avg_pool1d,
    avg_pool1d,
    conv3d,
    conv_transpose3d,
    interpolate,
    local_response_norm,
    max_pool1d,
    pixel_shuffle,
    unfold4d,
)
from ._norm_train import (
    batch_norm_train,
    dropout_train,
    group_norm,
    rms_norm,
)
from ._reduce import argmax, max, mean, min, sum
from ._sequence_layers import gru, lstm, mask_fill, quiet_softmax
from ._shape import (
    concat,
    embedding,
    expand,
    flatten,
    gather,
    gather_elements,
    getitem,
    permute,
    reshape,
    slice,
    split,
    squeeze,
    transpose,
    unsqueeze,
)

__all__ = [
    # elementwise
    "add", "sub", "mul", "div", "pow", "neg", "abs", "sqrt", "exp", "log", "erf", "tanh",
    "sigmoid", "relu", "clamp", "equal", "less", "greater", "less_equal", "greater_equal",
    "logical_not", "logical_and", "logical_or", "where", "cast",
    # linear algebra and activations
    "matmul", "linear", "gelu", "softmax", "log_softmax",
    # shapes
    "reshape", "flatten", "transpose", "permute", "squeeze", "unsqueeze", "concat", "split",
    "slice", "gather", "gather_elements", "embedding", "expand", "getitem",
    # creation (sizes may be symbolic)
    "zeros", "ones", "full", "arange",
    # reductions
    "sum", "mean", "max", "min", "argmax",
    # convolution, pooling, normalization
    "conv1d", "conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm",
    "layer_norm", "dropout",
    # sequence layers
    "quiet_softmax", "mask_fill", "lstm", "gru",
    # wider layer set (nn_layers)
    "conv_transpose1d", "conv_transpose2d", "group_norm", "rms_norm", "prelu", "leaky_relu", "elu", "selu",
    "celu", "hard_sigmoid", "hard_swish", "softplus", "softsign", "silu", "mish", "glu", "batch_norm_train",
    "dropout_train", "relu6", "hardtanh", "log_sigmoid", "tanhshrink", "hard_shrink", "soft_shrink", "thresholded_relu",
    "threshold",
    # spatial layers (nn_spatial)
    "conv3d", "conv_transpose3d", "max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "pixel_shuffle", "unfold4d",
    "local_response_norm", "interpolate",
    # deformable convolution, fold, 3-D adaptive pooling (nn_deform)
    "deform_conv2d", "fold4d", "adaptive_avg_pool3d", "rrelu_train",
    # any node
    "custom", "subgraph",
]
