"""The tensor operator table of the core (:class:`onnxparam.core.extension.TensorOps`):
``Tensor``'s operators delegate to these ops, and ``Param.val()`` asks :func:`param_value`
for a param's value inside a trace."""

from __future__ import annotations

from ..trace.values import _CURRENT
from . import (  # noqa: F401  (the table: the ops that Tensor's methods call)
    abs,
    add,
    argmax,
    cast,
    clamp,
    div,
    equal,
    erf,
    exp,
    expand,
    flatten,
    gelu,
    getitem,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    log_softmax,
    logical_not,
    matmul,
    max,
    mean,
    min,
    mul,
    neg,
    permute,
    pow,
    relu,
    reshape,
    sigmoid,
    softmax,
    sqrt,
    squeeze,
    sub,
    sum,
    tanh,
    transpose,
    unsqueeze,
)


def param_value(param):
    """``param``'s graph initializer in the active trace (a symbolic ``Tensor``), or ``None``
    outside a trace."""
    tracer = _CURRENT.get()
    return None if tracer is None else tracer.param_value(param)
