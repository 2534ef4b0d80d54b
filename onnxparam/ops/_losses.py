"""Loss functions as graph ops (traced like any op; eager outside a trace).

Both return a 0-d float tensor, the batch mean, and are differentiated by the rules of the
ops they are made of (``LogSoftmax``, ``Equal``, ``ReduceSum``, ``ReduceMean`` ...).
"""

from __future__ import annotations

from typing import Optional

from .. import ops
from ..core.tensor import Tensor
from ..trace.symint import SymInt
from ..core.errors import TraceValueError
from ..core.dtype import DType
from ._core import _emit, _op, _t, _tracer

__all__ = ["cross_entropy", "mse", "IGNORE_INDEX"]


IGNORE_INDEX = -100
"""PyTorch's default ``ignore_index`` of ``cross_entropy``: rows whose class-index target is
this value are left out of the loss and of the mean (the Hugging Face padding label)."""


def cross_entropy(logits, targets, dim: int = -1, ignore_index: Optional[int] = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy of ``logits`` against ``targets`` (PyTorch's ``cross_entropy`` with
    ``reduction="mean"``, no weights or smoothing; Burn's ``CrossEntropyLoss``):

    ``loss = -sum_{n: t_n != ignore_index} log_softmax(logits)[n, t_n] / #{n: t_n != ignore_index}``
    for class indices (every row counts when none is ``ignore_index``; all rows ignored gives
    NaN, as PyTorch), or ``loss = -mean_n sum_c targets[n, c] * log_softmax(logits)[n, c]`` for
    probabilities (``ignore_index`` does not apply, as in PyTorch).

    Args:
        logits: ``(N, C)`` or ``(N, d1, ..., C)`` float (classes along ``dim``, the last by
            default).
        targets: integer class indices of ``logits``' shape without the class axis, each in
            ``0..C-1`` or equal to ``ignore_index``; or float probabilities of ``logits``' shape
            and dtype.
        dim: the class axis of ``logits``.
        ignore_index: the class-index target value whose rows are left out (PyTorch's
            ``ignore_index``, default -100); ``None``: every row counts.

    ONNX: ``LogSoftmax``, ``Equal`` + ``Cast`` (a one-hot mask of the indices; ``Range`` when
    the class count is dynamic), ``Mul`` + ``ReduceSum``, ``Div`` by the count of kept rows,
    ``Neg``: differentiable at opset 11. The targets are checked in the graph: a ``Gather``
    named ``cross_entropy_target_outside_0..C-1_and_not_ignore_index_<ignore_index>`` picks
    each kept target from ``0..C-1`` (a negative target is shifted below ``-C`` first), so
    a target outside ``0..C-1`` that is not ``ignore_index`` makes ONNX Runtime fail there
    (:class:`~onnxparam.ExecutionError` naming that node, as PyTorch raises) instead of
    being counted as a zero term.

    Raises:
        TraceValueError: when ``targets``' rank fits neither form, or for concrete (not traced)
            class-index targets outside ``0..C-1`` that are not ``ignore_index``.
        ExecutionError: at run time, for such targets in a traced graph.
    """
    ignore_index = None if ignore_index is None else int(ignore_index)
    check_concrete_targets(logits, targets, dim, () if ignore_index is None else (ignore_index,), "cross_entropy")
    return _cross_entropy(logits, targets, dim, ignore_index)


def check_concrete_targets(logits, targets, dim: int, ignored: tuple, what: str) -> None:
    """Raise :class:`TraceValueError` for concrete class-index ``targets`` outside ``0..C-1``
    that are not in ``ignored`` (the traced check, :func:`checked_targets`, fails only at run
    time, with ONNX Runtime's message). Symbolic or float targets pass."""
    import numpy as np

    if isinstance(targets, Tensor):
        if targets.is_symbolic or not targets.dtype.is_int:
            return
        values = targets.to_numpy()
    elif isinstance(targets, np.ndarray) and targets.dtype.kind in "iu":
        values = targets
    else:
        return
    shape = getattr(logits, "shape", None)
    if shape is None or not len(shape) or not -len(shape) <= dim < len(shape):
        return
    classes = shape[dim]
    if not isinstance(classes, (int, np.integer)):
        return
    bad = (values < 0) | (values >= classes)
    for token in ignored:
        bad &= values != token
    if bad.any():
        first = np.argwhere(bad)[0]
        skip = f"ignore_index={ignored[0]}" if what == "cross_entropy" and ignored else f"ignored {list(ignored)}"
        raise TraceValueError(
            f"{what}: target {int(values[tuple(first)])} at index {first.tolist()} is outside "
            f"0..{int(classes) - 1} (the {int(classes)} classes of logits {list(shape)} along dim {dim}) and "
            f"not {skip}; {int(bad.sum())} such target(s)")


def checked_targets(targets: Tensor, keep: Optional[Tensor], class_ids: Tensor, classes, label: str) -> Tensor:
    """``targets`` (symbolic, integer) with the rows ``keep`` is False for set to 0, passed
    through a ``Gather`` from ``class_ids`` (``0..C-1``) named ``label``: ONNX Runtime fails
    there, naming it, for a kept target outside ``0..C-1`` (a negative one is moved below
    ``-C`` first, as Gather would wrap it); the kept values come back unchanged."""
    kept = targets if keep is None else ops.where(keep, targets, 0)
    shifted = ops.where(ops.less(kept, 0), ops.sub(kept, classes), kept)
    return _tracer().emit("Gather", [class_ids, shifted], {"axis": 0}, name=label)[0]


@_op
def _cross_entropy(logits, targets, dim: int, ignore_index: Optional[int]) -> Tensor:
    logits, targets = _t(logits), _t(targets)
    logp = ops.log_softmax(logits, dim)
    if targets.dtype.is_float:
        if targets.rank != logits.rank:
            raise TraceValueError(f"cross_entropy: probability targets must have the logits' shape "
                                  f"{list(logits.shape)}; got {list(targets.shape)}")
        return ops.neg(ops.mean(ops.sum(ops.mul(targets, logp), dim)))
    axis = dim if dim >= 0 else logits.rank + dim
    if targets.rank != logits.rank - 1:
        expected = list(logits.shape[:axis]) + list(logits.shape[axis + 1:])
        raise TraceValueError(f"cross_entropy: class-index targets must have shape {expected} for logits "
                              f"{list(logits.shape)}; got {list(targets.shape)}")
    classes = logits.shape[axis]
    if not isinstance(classes, (int, SymInt)):  # a dim the trace cannot name: read it at run time
        import numpy as np

        tracer = _tracer()
        dims = _emit("Shape", [logits])
        count = _emit("Gather", [dims, tracer.constant(np.asarray(axis, np.int64))], {"axis": 0})
        if targets.dtype is not DType.I64:
            count = _emit("Cast", [count], {"to": targets.dtype})
        zero, one = (tracer.constant(np.asarray(v, targets.dtype.to_numpy())) for v in (0, 1))
        class_ids = _emit("Range", [zero, count, one])
        classes = ops.cast(count, targets.dtype)
    else:
        class_ids = ops.arange(classes, dtype=targets.dtype)  # a constant, or Range (opset 11) when dynamic
    # NOTE: a one-hot mask (Equal + Cast) rather than GatherElements, whose gradient needs
    # ScatterElements with reduction="add" (opset 16+): the loss stays differentiable at the
    # opset of the model it is added to (imported models are often opset 11-15)
    keep = None if ignore_index is None else ops.logical_not(ops.equal(targets, ignore_index))
    label = "cross_entropy_target_outside_0..C-1" + ("" if keep is None else f"_and_not_ignore_index_{ignore_index}")
    checked = checked_targets(targets, keep, class_ids, classes, label)
    trailing = logits.rank - 1 - axis
    if trailing:
        class_ids = ops.unsqueeze(class_ids, list(range(1, trailing + 1)))
    one_hot = ops.cast(ops.equal(ops.unsqueeze(checked, [axis]), class_ids), logp.dtype)
    picked = ops.sum(ops.mul(one_hot, logp), axis)
    if keep is None:
        return ops.neg(ops.mean(picked))
    picked = ops.where(keep, picked, 0.0)
    return ops.neg(ops.div(ops.sum(picked), ops.sum(ops.cast(keep, logp.dtype))))


@_op
def mse(pred, target) -> Tensor:
    """Mean squared error ``mean((pred - target)^2)`` over every element (Burn's ``MseLoss``
    with ``Reduction::Mean``). ``pred`` and ``target`` broadcast; float.

    ONNX: ``Sub``, ``Mul``, ``ReduceMean``.
    """
    diff = ops.sub(pred, target)
    return ops.mean(ops.mul(diff, diff))
