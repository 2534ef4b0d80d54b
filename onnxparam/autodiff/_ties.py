"""Tied weights of imported ONNX models trained as one weight (as PyTorch trains a tied pair).

PyTorch's exporters write a tied ``lm_head`` / ``wte`` (GPT-2's) as two initializers: the
embedding table a ``Gather`` reads, ``(vocab, dim)``, and its transposed copy a ``MatMul``
reads, ``(dim, vocab)`` (``OnnxModule.onnx_ties`` lists the pairs the file ties, by its own
evidence: bit-equal values, the table read only by ``Gather``). Both import as params. The
backward gives each its own part of the gradient; torch's one weight gets their sum
(``wte.grad = g_table + g_projection^T``). :func:`tie_gradients` gives both params that sum
(the projection its transpose), so an elementwise optimizer (SGD, Adam) moves both exactly
alike: they stay bit-equal, the model stays tied, and each step equals torch's.

A pair is summed only while both sides require grad, hold plain float values (no quantized
param) of the tied shapes, and still hold the same values (compared on every call: a
checkpoint loaded into one side, or a side frozen and the other trained, unties them for
good, and each then gets its own gradient).
"""

from __future__ import annotations

import numpy as np

from ..core.dtype import DType
from ..core.module import named_modules
from ..core.tensor import Tensor

__all__ = ["module_ties", "tie_gradients"]


def module_ties(module) -> list:
    """``[(projection path, table path, transposed)]`` for the ties of every imported ONNX model
    inside ``module`` (paths from ``module``; read from each sub-module's ``onnx_ties``)."""
    found = []
    for prefix, sub in named_modules(module):
        if not isinstance(getattr(type(sub), "onnx_ties", None), property):
            continue  # not an imported ONNX model
        for head, (table, transposed) in sub.onnx_ties.items():
            join = (lambda p: f"{prefix}.{p}") if prefix else (lambda p: p)
            found.append((join(head), join(table), bool(transposed)))
    return found


def _plain(param) -> bool:
    dtype = param.lazy_dtype()
    return dtype is not DType.QFloat and dtype.is_float and not dtype.is_onnx_only


def tie_gradients(grads: dict, by_path: dict, ties: list) -> dict:
    """``grads`` (``ParamId -> Tensor``) with each tied pair's gradients summed (module
    docstring); ``by_path``: path -> param of the module. A side the loss does not reach counts
    as a zero gradient."""
    if not ties:
        return grads
    out = dict(grads)
    for head_path, table_path, transposed in ties:
        head, table = by_path.get(head_path), by_path.get(table_path)
        if head is None or table is None or head.id == table.id:
            continue
        if not (head.require_grad and table.require_grad and _plain(head) and _plain(table)):
            continue
        g_head, g_table = out.get(head.id), out.get(table.id)
        if g_head is None and g_table is None:
            continue
        head_shape, table_shape = tuple(head.lazy_shape()), tuple(table.lazy_shape())
        if head_shape != (table_shape[::-1] if transposed else table_shape):
            continue
        table_value = np.asarray(table.base().to_numpy())
        head_value = np.asarray(head.base().to_numpy())
        if not _equal(head_value, table_value, transposed):
            continue  # no longer tied (a checkpoint loaded into one side): two params
        g_table = None if g_table is None else np.asarray(g_table.to_numpy())
        g_head = None if g_head is None else np.asarray(g_head.to_numpy())
        total, head_total = _summed(g_table, g_head, transposed, table_shape)
        out[table.id] = Tensor.from_numpy(total)
        out[head.id] = Tensor.from_numpy(head_total) if transposed else out[table.id]
    return out


_COMPARE_ROWS = 256
_SUM_ROWS = 64
"""Rows of the table per block of a transposed comparison / sum. A GPT-2-small table (50257 x 768,
float32, 2 busy cores): compared in 0.19 s, summed in 0.30 s, 3.7x and 6x one contiguous add of
it (whole-array strided: about 3x longer each); the step itself takes seconds."""


def _equal(head: np.ndarray, table: np.ndarray, transposed: bool) -> bool:
    """``head == table.T`` (or ``== table``) bit for bit (compared as unsigned integers of the
    same width: a NaN equals itself, ``-0.0`` differs from ``0.0``); in row blocks of the table
    (a whole-array strided comparison misses the cache)."""
    if head.dtype != table.dtype or head.shape != (table.shape[::-1] if transposed else table.shape):
        return False
    if head.dtype.kind == "f" and head.dtype.itemsize in (2, 4, 8):
        bits = np.dtype(f"u{head.dtype.itemsize}")
        head, table = head.view(bits), table.view(bits)
    if not transposed:
        return bool(np.array_equal(head, table))
    for i in range(0, table.shape[0], _COMPARE_ROWS):
        if not np.array_equal(head[:, i:i + _COMPARE_ROWS], table[i:i + _COMPARE_ROWS].T):
            return False
    return True


def _summed(g_table, g_head, transposed: bool, table_shape: tuple) -> tuple:
    """``(g_table + g_head^T, its transpose)`` (``(sum, sum)`` untransposed), a missing side read as
    zeros; new contiguous arrays, in row blocks of the table."""
    if not transposed:
        total = (np.array(g_table, copy=True) if g_head is None else np.array(g_head, copy=True) if g_table is None
                 else np.add(g_table, g_head))
        return total, total
    total = np.empty(table_shape, dtype=(g_table if g_table is not None else g_head).dtype)
    head_total = np.empty(table_shape[::-1], dtype=total.dtype)
    for i in range(0, table_shape[0], _SUM_ROWS):
        rows = slice(i, i + _SUM_ROWS)
        if g_table is None:
            total[rows] = g_head[:, rows].T
        elif g_head is None:
            total[rows] = g_table[rows]
        else:
            np.add(g_table[rows], g_head[:, rows].T, out=total[rows])
        head_total[:, rows] = total[rows].T
    return total, head_total
