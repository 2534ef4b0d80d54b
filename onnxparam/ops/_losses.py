"""Loss functions as graph ops (traced like any op; eager outside a trace).

Both return a 0-d float tensor, the batch mean, and are differentiated by the rules of the
ops they are made of (``LogSoftmax``, ``Equal``, ``ReduceSum``, ``ReduceMean`` ...).
"""

from __future__ import annotations

from .. import ops
from ..core.tensor import Tensor
from ..trace.symint import SymInt
from ._core import _op, _t

__all__ = ["cross_entropy", "mse"]


@_op
def cross_entropy(logits, targets, dim: int = -1) -> Tensor:
    """Mean cross-entropy of ``logits`` against ``targets`` (Burn's ``CrossEntropyLoss``
    without smoothing or weights; PyTorch's ``cross_entropy``):

    ``loss = -mean_n log_softmax(logits)[n, targets[n]]`` for class indices, or
    ``loss = -mean_n sum_c targets[n, c] * log_softmax(logits)[n, c]`` for probabilities.

    Args:
        logits: ``(N, C)`` float (classes along ``dim``, the last by default).
        targets: ``(N,)`` integer class indices in ``0..C-1``, or ``(N, C)`` float
            probabilities of ``logits``' dtype.
        dim: the class axis of ``logits``.

    ONNX: ``LogSoftmax``, ``Equal`` + ``Cast`` (a one-hot mask of the indices; ``Range`` when
    the class count is dynamic, ``GatherElements`` when it is unknown), ``Mul`` + ``ReduceSum``,
    ``ReduceMean``, ``Neg``: differentiable at opset 11 (``GatherElements``' gradient needs 16).

    Raises:
        ValueError: when ``targets``' rank fits neither form.
    """
    logits, targets = _t(logits), _t(targets)
    logp = ops.log_softmax(logits, dim)
    if targets.dtype.is_float:
        if targets.rank != logits.rank:
            raise ValueError(f"probability targets must have the logits' shape {list(logits.shape)}; "
                             f"got {list(targets.shape)}")
        return ops.neg(ops.mean(ops.sum(ops.mul(targets, logp), dim)))
    if targets.rank != logits.rank - 1:
        raise ValueError(f"class-index targets must have shape {list(logits.shape[:-1])} for logits "
                         f"{list(logits.shape)}; got {list(targets.shape)}")
    axis = dim if dim >= 0 else logits.rank + dim
    classes = logits.shape[axis]
    if not isinstance(classes, (int, SymInt)):  # an unknown class count: nothing to compare with
        picked = ops.gather_elements(logp, ops.unsqueeze(targets, [axis]), axis)
        return ops.neg(ops.mean(picked))
    # NOTE: a one-hot mask (Equal + Cast) rather than GatherElements, whose gradient needs
    # ScatterElements with reduction="add" (opset 16+): the loss stays differentiable at the
    # opset of the model it is added to (imported models are often opset 11-15)
    class_ids = ops.arange(classes, dtype=targets.dtype)  # a constant, or Range (opset 11) when dynamic
    trailing = logits.rank - 1 - axis
    if trailing:
        class_ids = ops.unsqueeze(class_ids, list(range(1, trailing + 1)))
    one_hot = ops.cast(ops.equal(ops.unsqueeze(targets, [axis]), class_ids), logp.dtype)
    return ops.neg(ops.mean(ops.sum(ops.mul(one_hot, logp), axis)))


@_op
def mse(pred, target) -> Tensor:
    """Mean squared error ``mean((pred - target)^2)`` over every element (Burn's ``MseLoss``
    with ``Reduction::Mean``). ``pred`` and ``target`` broadcast; float.

    ONNX: ``Sub``, ``Mul``, ``ReduceMean``.
    """
    diff = ops.sub(pred, target)
    return ops.mean(ops.mul(diff, diff))
