"""Empty inputs that would reach an ``LSTM`` / ``GRU`` node: refused before ONNX Runtime runs.

ONNX Runtime 1.2x's CPU ``LSTM`` with a batch of 0 (``X`` ``[seq, 0, input]``), and its ``GRU``
with a batch or a sequence of 0, end the whole process (``std::terminate``: "terminate called
without an active exception", exit 134), in plain ONNX Runtime too; a Python caller cannot catch
it. ``RNN`` returns an empty output, and an ``LSTM`` with a sequence of 0 too, so those run.

:func:`check_empty_recurrent` is called by ``module(x)`` (and so by ``grad``, whose loss calls
the module) on the values bound to the graph inputs: a value with a 0-sized dim bound to a
graph input from which such a node's ``X`` is computed raises :class:`CallArgumentError`
naming the input, the dim and the node. A graph input that *is* ``X`` is checked exactly (the
dims the kernel dies on); one that reaches ``X`` through other nodes is refused for a 0 in any
dim (how dims map through reshapes is not followed: an empty input nearly always gives an empty
``X``). Only the main graph's nodes are looked at (not those in ``If`` / ``Loop`` bodies).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_ir as ir

from ..core.errors import CallArgumentError

__all__ = ["check_empty_recurrent"]

_CACHE_KEY = "empty_recurrent_feeds"
# op -> the X dims ([seq, batch, input], layout 0: ONNX Runtime runs no other) an empty size ends the process on
_FATAL_DIMS = {"LSTM": (1,), "GRU": (0, 1)}
_DIM_NAMES = {0: "sequence", 1: "batch"}
# ops whose output depends on their input's shape only, never on its (absent) elements
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _feeds(source) -> dict:
    """``{graph input name: [(node name, op, direct)]}``: the recurrent nodes whose ``X`` each
    graph input computes (``direct``: it is ``X``). Built once per source."""
    feeds = source.cache.get(_CACHE_KEY)
    if feeds is not None:
        return feeds
    feeds = {}
    inputs = {id(v): v for v in source.inputs}
    graph = source.loaded.model.graph
    for node in graph:
        if node.domain not in ("", "ai.onnx") or node.op_type not in _FATAL_DIMS or not node.inputs \
                or node.inputs[0] is None:
            continue
        x = node.inputs[0]
        seen, stack = set(), [x]
        while stack:
            value = stack.pop()
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if id(value) in inputs:
                feeds.setdefault(value.name, []).append((node.name or node.op_type, node.op_type, value is x))
                continue
            producer = value.producer()
            if producer is None or producer.op_type in _SHAPE_ONLY:
                continue
            stack.extend(producer.inputs)
    source.cache[_CACHE_KEY] = feeds
    return feeds


def _shape_of(x) -> Optional[tuple]:
    if isinstance(x, np.ndarray):
        return x.shape
    shape = getattr(x, "shape", None)
    if getattr(x, "rank_known", True) and isinstance(shape, tuple):
        return shape
    return None


def check_empty_recurrent(source, bound: dict) -> None:
    """Refuse an empty value bound to a graph input that computes an ``LSTM`` / ``GRU``'s ``X``
    (see the module docstring).

    Args:
        source: the module's ``_SourceGraph``.
        bound: graph input name -> the value given (``Tensor``, numpy array, ...).

    Raises:
        CallArgumentError: (a ``TypeError``) naming the graph input, its shape, the dim and the node.
    """
    feeds = _feeds(source)
    if not feeds:
        return
    for name, nodes in feeds.items():
        shape = _shape_of(bound.get(name))
        if shape is None or all(not (isinstance(d, (int, np.integer)) and d == 0) for d in shape):
            continue
        for node, op, direct in nodes:
            if direct:
                dims = [d for d in _FATAL_DIMS[op] if d < len(shape) and shape[d] == 0]
                if not dims:
                    continue
                what = " and ".join(f"a {_DIM_NAMES[d]} of 0 (dim {d} of X [seq, batch, input])" for d in dims)
            else:
                zero = [axis for axis, d in enumerate(shape) if isinstance(d, (int, np.integer)) and d == 0]
                what = f"a 0-sized dim {zero[0]}, which reaches its X"
            raise CallArgumentError(
                f"graph input {name!r} of shape {list(int(d) for d in shape)} gives {op} node {node!r} {what}: "
                f"ONNX Runtime's {op} ends the whole process on an empty batch"
                + (" or sequence" if op == "GRU" else "") + ", so an empty input reaching it is refused "
                "before the run; call the module with at least one row (and one step)")
