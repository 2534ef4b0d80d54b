"""Shape ops: reshape, flatten, transpose / permute, (un)squeeze, concat, split, slice, gather."""

from __future__ import annotations

import builtins
import math
from typing import Sequence

import numpy as np

from ..core.dtype import DType
from ..core.errors import TraceError
from ..core.tensor import Tensor
from ..trace.symint import SymInt
from ._core import (
    _axes_operand,
    _emit,
    _int64_input,
    _int64s,
    _is_scalar,
    _norm_dim,
    _norm_dims,
    _op,
    _opset,
    _require_opset,
    _static_dims,
    _t,
    _tracer,
)
from ._elementwise import cast

__all__ = [
    "reshape", "flatten", "transpose", "permute", "squeeze", "unsqueeze", "concat", "split", "slice", "gather",
    "gather_elements", "embedding", "expand", "getitem",
]
@_op
def reshape(x, shape) -> Tensor:
    """``x`` with a new shape; ``-1`` infers one dim, ``0`` copies the input dim at that index.
    ``shape`` is a sequence of ints or a 1-D int tensor. ONNX: ``Reshape`` (ONNX spec: Reshape,
    ``allowzero=0``)."""
    x = _t(x)
    types = None
    if not isinstance(shape, Tensor) and not isinstance(shape, (int, np.integer, SymInt)):
        dims = list(shape)
        symbolic = builtins.any(isinstance(d, SymInt) for d in list(x.shape) + dims)
        if symbolic:
            out = _reshape_dims(x.shape, dims)
            types = None if -1 in [d for d in out if isinstance(d, int)] else [(x.dtype, out)]
        if _opset() >= 14 and (symbolic or builtins.any(d == 0 for d in x.shape if isinstance(d, int))):
            # NOTE: a size that is or may be 0: the target is written out in full (no "0 copies",
            # no -1 where it can be computed) and read with allowzero=1 (Reshape-14), so a 0
            # stays 0 and no -1 sits next to a 0 ("Product cannot be 0 in combination with -1")
            return _reshape_to(x, _reshape_dims(x.shape, dims, resolve_hole=True))
    return _emit("Reshape", [x, _int64_input(shape)], types=types)


def _reshape_to(x: Tensor, dims) -> Tensor:
    """``Reshape`` of ``x`` to ``dims`` as written (ints and SymInts; a 0 is a size 0, not "copy
    the input dim"), read with ``allowzero=1`` (Reshape-14; the caller checks the opset)."""
    dims = tuple(dims)
    symbolic = builtins.any(isinstance(d, SymInt) for d in list(x.shape) + list(dims))
    return _emit("Reshape", [x, _int64_input(dims)], {"allowzero": 1},
                 types=[(x.dtype, dims)] if symbolic and -1 not in [d for d in dims if isinstance(d, int)] else None)


def _reshape_dims(in_shape, dims, resolve_hole: bool = False) -> tuple:
    """The output dims of ``Reshape`` (``allowzero=0``) with sizes that may be symbolic."""
    out = [in_shape[i] if isinstance(d, (int, np.integer)) and d == 0 else d for i, d in enumerate(dims)]
    holes = [i for i, d in enumerate(out) if isinstance(d, (int, np.integer)) and d == -1]
    if len(holes) > 1:
        raise ValueError(f"reshape: more than one -1 in {list(dims)}")
    if holes:  # the input's dims over the others, common factors cancelled ([b, 8, -1] of [b, 8, L]: L)
        rest = list(in_shape)
        known = []
        for i, d in enumerate(out):
            if i == holes[0]:
                continue
            same = next((j for j, r in enumerate(rest) if r is d or (
                isinstance(r, SymInt) and isinstance(d, SymInt) and r.expr == d.expr) or (
                isinstance(r, int) and isinstance(d, (int, np.integer)) and r == d)), None)
            if same is None:
                known.append(d)
            else:
                rest.pop(same)
        divisor = math.prod(known)
        if (resolve_hole and isinstance(divisor, SymInt)) or (not isinstance(divisor, SymInt) and divisor == 0):
            pass  # NOTE: a division by a size that may be 0 at run time: the -1 is left to ONNX Runtime
        elif not isinstance(divisor, SymInt) and math.prod(d for d in rest if not isinstance(d, SymInt)) % divisor == 0:
            # NOTE: the ints cancel first ([-1, 2, 2] of [b, 4]: b, not (b*4)//4)
            whole = math.prod(d for d in rest if not isinstance(d, SymInt)) // divisor
            out[holes[0]] = math.prod([d for d in rest if isinstance(d, SymInt)] + [whole])
        else:
            out[holes[0]] = math.prod(rest) // divisor
    return tuple(int(d) if isinstance(d, np.integer) else d for d in out)


@_op
def flatten(x, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Merge dims ``start_dim..end_dim`` (inclusive) into one (Burn's ``flatten``).

    ONNX: ``Flatten`` (axis=1 for ``[N, ...] -> [N, rest]``) or ``Reshape`` (with ``Shape`` +
    ``Concat`` when dims after ``end_dim`` are dynamic).
    """
    x = _t(x)
    rank = x.rank
    if rank == 0:
        return reshape(x, [1])
    start, end = _norm_dim(start_dim, rank, "start_dim"), _norm_dim(end_dim, rank, "end_dim")
    if start > end:
        raise ValueError(f"flatten: start_dim {start_dim} is after end_dim {end_dim}")
    merged = x.shape[start:end + 1]
    size = math.prod(merged)  # an int, or a SymInt product (emitted only if used)
    out_shape = x.shape[:start] + (size,) + x.shape[end + 1:]
    types = [(x.dtype, out_shape)]
    if start == end:
        return x
    if start == 1 and end == rank - 1:
        return _emit("Flatten", [x], {"axis": 1}, types=types)
    tail = x.shape[end + 1:]
    if _opset() >= 14 and (not _static_dims(x.shape[:end + 1]) or builtins.any(d == 0 for d in x.shape[:end + 1])):
        return _reshape_to(x, out_shape)  # sizes that are or may be 0: written out (see reshape)
    if _static_dims(tail):
        return _emit("Reshape", [x, _int64s([0] * start + [-1] + list(tail))], types=types)
    if _opset() >= 15:
        shape_tail = _emit("Shape", [x], {"start": end + 1}, types=[(DType.I64, (len(tail),))])
    else:
        full = _emit("Shape", [x], types=[(DType.I64, (rank,))])
        shape_tail = slice(full, [end + 1], [rank])
    target = concat([_int64s([0] * start + [-1]), shape_tail], 0)
    return _emit("Reshape", [x, target], types=types)


@_op
def transpose(x, dim0: int = -2, dim1: int = -1) -> Tensor:
    """``x`` with dims ``dim0`` and ``dim1`` swapped (default: the last two, as Burn's
    ``transpose``). ONNX: ``Transpose``."""
    x = _t(x)
    d0, d1 = _norm_dim(dim0, x.rank), _norm_dim(dim1, x.rank)
    perm = list(range(x.rank))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute(x, perm)


@_op
def permute(x, dims) -> Tensor:
    """``x`` with its dims reordered: output dim ``i`` is input dim ``dims[i]``.
    ONNX: ``Transpose`` (``perm=dims``)."""
    x = _t(x)
    perm = _norm_dims(dims, x.rank)
    if sorted(perm) != list(range(x.rank)):
        raise ValueError(f"permute: {list(dims)} is not a permutation of the {x.rank} dims")
    return _emit("Transpose", [x], {"perm": perm}, types=[(x.dtype, tuple(x.shape[p] for p in perm))])


@_op
def squeeze(x, dims=None) -> Tensor:
    """``x`` without the size-1 dims ``dims`` (an int or a sequence; ``None``: every dim known
    to be 1; no node when there is none). ONNX: ``Squeeze`` (axes as an input from opset 13, an
    attribute before).

    Raises:
        ValueError: when a named dim is known not to be 1.
    """
    x = _t(x)
    # NOTE: a symbolic dim is compared too: decided by its bounds, else a TraceError (never
    # silently "not 1": the graph would differ from the concrete trace of a size-1 input)
    axes = [i for i, d in enumerate(x.shape) if d == 1] if dims is None else _norm_dims(dims, x.rank)
    for a in axes:
        if isinstance(x.shape[a], int) and x.shape[a] != 1:
            raise ValueError(f"squeeze: dim {a} of shape {list(x.shape)} has size {x.shape[a]}, not 1")
    if not axes:  # NOTE: an empty axes list would make ONNX Squeeze remove every size-1 dim
        return x
    shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    inputs, attrs = [x], {}
    _axes_operand(inputs, attrs, axes, 13)
    return _emit("Squeeze", inputs, attrs, types=[(x.dtype, shape)])


@_op
def unsqueeze(x, dims) -> Tensor:
    """``x`` with size-1 dims inserted at ``dims`` (positions in the output).
    ONNX: ``Unsqueeze`` (axes as an input from opset 13, an attribute before)."""
    x = _t(x)
    dims = [dims] if isinstance(dims, (int, np.integer)) else list(dims)
    out_rank = x.rank + len(dims)
    axes = sorted(_norm_dim(d, out_rank) for d in dims)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    inputs, attrs = [x], {}
    _axes_operand(inputs, attrs, axes, 13)
    return _emit("Unsqueeze", inputs, attrs, types=[(x.dtype, tuple(shape))])


@_op
def concat(tensors: Sequence, dim: int) -> Tensor:
    """Join tensors of one dtype along ``dim``. ONNX: ``Concat``."""
    ts = [_t(t) for t in tensors]
    if not ts:
        raise ValueError("concat needs at least one tensor")
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise TypeError(f"concat: tensors have different dtypes ({', '.join(sorted(d.name for d in dtypes))})")
    return _emit("Concat", ts, {"axis": _norm_dim(dim, ts[0].rank)})


@_op
def split(x, sizes, dim: int = 0) -> tuple:
    """Split ``x`` along ``dim``: ``sizes`` a list of chunk sizes (ONNX ``split``), or an int
    chunk size (Burn's ``split``: the last chunk may be smaller; needs a static dim).
    ONNX: ``Split`` (sizes as an input from opset 13, an attribute before). Returns a tuple."""
    x = _t(x)
    axis = _norm_dim(dim, x.rank)
    if isinstance(sizes, (int, np.integer)):
        length = x.shape[axis]
        if not isinstance(length, int):
            raise TraceError(f"split with a chunk size needs a static dim {axis}; got shape {list(x.shape)}")
        sizes = [int(sizes)] * (length // int(sizes)) + ([length % int(sizes)] if length % int(sizes) else [])
    sizes = [int(s) for s in sizes]
    if isinstance(x.shape[axis], int) and builtins.sum(sizes) != x.shape[axis]:
        raise ValueError(f"split: sizes {sizes} do not add up to dim {axis} of shape {list(x.shape)}")
    types = [(x.dtype, x.shape[:axis] + (s,) + x.shape[axis + 1:]) for s in sizes]
    if _opset() >= 13:
        outs = _emit("Split", [x, _int64s(sizes)], {"axis": axis}, types=types, num_outputs=len(sizes))
    else:
        outs = _emit("Split", [x], {"axis": axis, "split": sizes}, types=types, num_outputs=len(sizes))
    return outs if isinstance(outs, tuple) else (outs,)


@_op
def slice(x, starts, ends, axes=None, steps=None) -> Tensor:
    """``x[starts:ends:steps]`` along ``axes`` (default ``0..len(starts)-1``); out-of-range
    bounds are clamped, negative ones count from the end. ONNX: ``Slice`` (ONNX spec: Slice-13;
    bounds as inputs from opset 10, attributes before)."""
    x = _t(x)
    n = len(starts) if not isinstance(starts, Tensor) else None
    if _opset() < 10:
        if any(isinstance(v, Tensor) for v in (starts, ends, axes, steps)) or any(int(s) != 1 for s in steps or ()):
            raise TraceError(f"slice with tensor bounds or steps needs opset 10 or newer; this graph is traced at "
                             f"opset {_opset()}")
        attrs = {"starts": [int(v) for v in starts], "ends": [int(v) for v in ends],
                 "axes": None if axes is None else [_norm_dim(a, x.rank) for a in axes]}
        return _emit("Slice", [x], attrs)
    inputs = [x, _int64_input(starts), _int64_input(ends)]
    if axes is not None or steps is not None:
        if axes is None:
            axes = list(range(n if n is not None else len(ends)))
        inputs.append(_int64_input([_norm_dim(a, x.rank) for a in axes] if not isinstance(axes, Tensor) else axes))
    if steps is not None:
        inputs.append(_int64_input(steps))
    return _emit("Slice", inputs, types=_slice_types(x, starts, ends, axes, steps))


def _decided(comparison):
    """``bool(comparison())`` of sizes, or ``None`` when a symbolic comparison is undecidable."""
    try:
        return bool(comparison())
    except TraceError:
        return None


def _slice_len(d, start, end, step):
    """The length of ``range(d)[start:end:step]`` (ONNX Slice bounds: ``_INT64_MAX`` /
    ``_INT64_MIN`` for open ends) when it is decidable for a symbolic ``d``, else ``None``."""
    def is_int(v, value=None):
        return isinstance(v, (int, np.integer)) and (value is None or int(v) == value)

    if (step == 1 and is_int(start, 0) and is_int(end, _INT64_MAX)) or (
            step == -1 and is_int(start, -1) and is_int(end, _INT64_MIN)):
        return d  # the whole dim, forward or reversed (y[::-1])
    if step == 1 and is_int(end, _INT64_MAX):
        if isinstance(start, SymInt) and start._op == "-" and is_int(start._args[0], 0) and \
                isinstance(start._args[1], SymInt) and start._args[1].expr == d.expr:
            return d  # y[-n:] with n the dim itself (n = 0 too: y[0:])
        if isinstance(start, (int, np.integer)) and start >= 0 and _decided(lambda: start <= d):
            return d - int(start)
        if isinstance(start, (int, np.integer)) and start < 0 and _decided(lambda: -int(start) <= d):
            return -int(start)
    if step == 1 and is_int(start, 0):
        if isinstance(end, SymInt) and _decided(lambda: end == d):
            return d
        if isinstance(end, (int, np.integer)) and 0 <= end < _INT64_MAX and _decided(lambda: end <= d):
            return int(end)
        if isinstance(end, (int, np.integer)) and end < 0 and _decided(lambda: -int(end) <= d):
            return d + int(end)
    return None


def _slice_types(x, starts, ends, axes, steps):
    """The output type of a ``Slice`` of ``x`` whose dims are symbolic, where every sliced
    length is decidable (:func:`_slice_len`); ``None`` leaves it to ONNX's inference."""
    if _static_dims(x.shape) or builtins.any(isinstance(v, Tensor) for v in (starts, ends, axes, steps)):
        return None
    axes = list(range(len(starts))) if axes is None else [_norm_dim(a, x.rank) for a in axes]
    steps = [1] * len(starts) if steps is None else list(steps)
    if not builtins.all(isinstance(s, (int, np.integer)) for s in steps):
        return None
    dims = list(x.shape)
    for a, start, end, step in zip(axes, starts, ends, steps):
        d = dims[a]
        if not isinstance(d, SymInt):
            return None  # static dims: ONNX's inference computes them exactly
        n = _slice_len(d, start, end, int(step))
        if n is None:
            return None
        dims[a] = n
    return [(x.dtype, tuple(dims))]


def _indices(indices) -> Tensor:
    if isinstance(indices, (list, tuple)) or _is_scalar(indices):
        return _tracer().constant(np.asarray(indices, dtype=np.int64))
    idx = _t(indices)
    if idx.dtype not in (DType.I64, DType.I32):
        if not idx.dtype.is_int:
            raise TypeError(f"indices must be integers; got {idx.dtype.name}")
        idx = cast(idx, DType.I64)
    return idx


@_op
def gather(x, indices, dim: int = 0) -> Tensor:
    """Select slices of ``x`` along ``dim`` by ``indices`` (numpy ``take``; Burn's ``select``):
    output shape ``x.shape[:dim] + indices.shape + x.shape[dim+1:]``. Negative indices count
    from the end. ONNX: ``Gather`` (ONNX spec: Gather). For Burn's element-wise ``gather`` use
    :func:`gather_elements`."""
    x = _t(x)
    return _emit("Gather", [x, _indices(indices)], {"axis": _norm_dim(dim, x.rank)})


@_op
def gather_elements(x, indices, dim: int) -> Tensor:
    """Element-wise gather (Burn's ``gather``, PyTorch's ``gather``):
    ``out[i][j] = x[indices[i][j]][j]`` for ``dim=0``; ``indices`` has ``x``'s rank.
    ONNX: ``GatherElements``."""
    _require_opset("gather_elements (GatherElements)", 11)
    x = _t(x)
    return _emit("GatherElements", [x, _indices(indices)], {"axis": _norm_dim(dim, x.rank)})


@_op
def embedding(weight, indices) -> Tensor:
    """Rows of ``weight`` ``(n, d)`` picked by integer ``indices`` ``(...)``: ``(..., d)``.
    ONNX: ``Gather`` (``axis=0``)."""
    return _emit("Gather", [_t(weight), _indices(indices)], {"axis": 0})



@_op
def expand(x, shape) -> Tensor:
    """``x`` broadcast to ``shape`` (ints and :class:`~onnxparam.trace.symint.SymInt` s; ``-1`` or
    ``1`` keeps the input dim, as PyTorch's ``expand``; leading new dims allowed).
    ONNX: ``Expand`` (ONNX spec: Expand-13, numpy broadcasting)."""
    x = _t(x)
    dims = list(shape)
    rank = builtins.max(len(dims), x.rank)
    in_dims = [1] * (rank - x.rank) + list(x.shape)
    given = [-1] * (rank - len(dims)) + dims
    out = []
    for g, d in zip(given, in_dims):
        keep = isinstance(g, (int, np.integer)) and int(g) in (-1, 1)
        out.append(d if keep else g)
    target = [1 if isinstance(g, (int, np.integer)) and int(g) == -1 else g for g in dims]
    return _emit("Expand", [x, _int64_input(target)], types=[(x.dtype, tuple(out))])


_INT64_MIN = int(np.iinfo(np.int64).min)
_INT64_MAX = int(np.iinfo(np.int64).max)


@_op
def getitem(x, key) -> Tensor:
    """``x[key]`` with basic indexing: ints (the dim is removed; ONNX ``Gather``), slices with
    int or :class:`~onnxparam.trace.symint.SymInt` bounds and int steps (ONNX ``Slice``), ``None``
    (a new dim; ``Unsqueeze``), ``...``; one 1-D int tensor picks along its dim (``Gather``)."""
    x = _t(x)
    key = key if isinstance(key, tuple) else (key,)
    used = builtins.sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > x.rank:
        raise IndexError(f"too many indices ({used}) for a tensor of rank {x.rank}")
    if builtins.sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have one ellipsis (...)")
    expanded = []
    for k in key:
        expanded.extend([builtins.slice(None)] * (x.rank - used) if k is Ellipsis else [k])
    expanded += [builtins.slice(None)] * (x.rank - builtins.sum(1 for k in expanded if k is not None))
    starts, ends, axes, steps, picks, news = [], [], [], [], [], []
    axis = out_pos = 0
    for k in expanded:
        if k is None:
            news.append(out_pos)
            out_pos += 1
            continue
        if isinstance(k, builtins.slice):
            step = 1 if k.step is None else int(k.step)
            if step == 0:
                raise ValueError("slice step cannot be zero")
            if not (k.start is None and k.stop is None and step == 1):
                lo, hi = (0, _INT64_MAX) if step > 0 else (-1, _INT64_MIN)
                starts.append(lo if k.start is None else k.start)
                ends.append(hi if k.stop is None else k.stop)
                axes.append(axis)
                steps.append(step)
            out_pos += 1
        elif isinstance(k, (Tensor, np.ndarray, list)):
            picks.append((axis, k))
            out_pos += 1
        else:
            picks.append((axis, k if isinstance(k, SymInt) else int(k)))
        axis += 1
    y = x
    if axes:
        y = slice(y, starts, ends, axes, steps)
    removed = 0
    for ax, k in picks:
        if isinstance(k, SymInt):
            idx = k.scalar()
        elif isinstance(k, int):
            idx = _tracer().constant(np.asarray(k, dtype=np.int64))
        else:
            idx = _indices(k)
        y = _emit("Gather", [y, idx], {"axis": ax - removed})
        removed += 1 if idx.rank == 0 else 0
    if news:
        y = unsqueeze(y, news)
    return y
