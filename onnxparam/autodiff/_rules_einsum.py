"""Gradient rule of ``Einsum`` equations with an ellipsis or a repeated letter in one operand
(a diagonal); the plain ones are :func:`~._rules_more._einsum`'s, so this module is registered
after :mod:`._rules_more`.

Conventions (a rule's signature, ``g = dL/dy``) are those of :mod:`onnxparam.autodiff._rules`;
forward semantics: the ONNX operator specification (Einsum; numpy's ``einsum``). Ranks are
read from the forward values' types, sizes at run time: no static dim needed.
"""

from __future__ import annotations

import string

import numpy as np

from ..core.errors import TraceError
from ._emitter import dims
from ._rules import attr, rule
from ._rules_more import _einsum

__all__ = []


def _explicit(node) -> tuple:
    """``(terms, out)`` of ``node``'s equation with every ellipsis replaced by letters of its
    own (right-aligned across the operands, numpy's broadcasting) and the implicit output made
    explicit (the ellipsis' letters, then the letters used once, sorted)."""
    eq = attr(node, "equation")
    eq = (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    free = [c for c in string.ascii_letters if c not in eq]
    lengths = []
    for term, x in zip(terms, node.inputs):
        lengths.append(len(dims(x)) - (len(term) - 3) if "..." in term else 0)
    width = max(lengths + [0])
    if width > len(free):
        raise TraceError(f"node {node.name!r}: Einsum's gradient: too many ellipsis dims")
    ellipsis = "".join(free[:width])
    terms = [t.replace("...", ellipsis[width - n:]) for t, n in zip(terms, lengths)]
    if not arrow:
        letters = sorted(set(c for c in lhs if c.isalpha()))
        out = ("..." if width else "") + "".join(c for c in letters if lhs.count(c) == 1)
    out = out.replace("...", ellipsis)
    return terms, out, set(ellipsis)


def _sum_broadcast(e, d, x, term: str, ellipsis: set):
    """``d`` summed (dims kept) over the ellipsis dims where ``x`` has size 1 (numpy
    broadcasting against a larger result), chosen at run time from ``x``'s shape. NOTE: not
    from ``d``'s shape: ONNX's Einsum shape inference takes the first operand's ellipsis dims
    without broadcasting, so a folded ``Shape`` of the result can be wrong."""
    axes = [k for k, c in enumerate(term) if c in ellipsis]
    if not axes:
        return d
    if e.opset < 13:  # (ReduceSum's axes an attribute: the dims known to be 1 while tracing)
        ones = [k for k in axes if dims(x)[k] == 1]
        return e.op("ReduceSum", d, axes=ones, keepdims=1) if ones else d
    sizes = e.op("Gather", e.op("Shape", x), e.ints(axes), axis=0)
    picked = e.op("Compress", e.ints(axes), e.op("Equal", sizes, e.const(1, np.int64)), axis=0)
    return e.op("ReduceSum", d, picked, keepdims=1, noop_with_empty_axes=1)


@rule("Einsum")
def _einsum_rule(e, node, gout, need):
    """``dx_i = einsum("y, others -> u_i", g, other operands)`` with ``u_i`` the distinct letters
    of ``x_i``'s subscripts (an ellipsis spelled out in letters of its own), expanded over the
    letters only ``x_i`` has, summed over the ellipsis dims where ``x_i`` has size 1 against a
    larger result (broadcasting; the dims compared at run time), and, for a letter repeated in
    ``x_i`` (a diagonal ``ii``), placed on the diagonal: ``dx[.., i, j] = d[.., i] * I[i, j]`` (an ``Einsum`` with
    ``EyeLike`` identities of that dim's run-time size). Plain equations:
    :func:`~._rules_more._einsum`.

    Raises:
        TraceError: when the ellipses need more letters than the equation leaves free.
    """
    eq = attr(node, "equation")
    eq = (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")
    terms_raw = eq.partition("->")[0].split(",")
    if "." not in eq and all(len(set(t)) == len(t) for t in terms_raw):
        return _einsum(e, node, gout, need)
    terms, out, ellipsis = _explicit(node)
    res = []
    for i, (term, x, n) in enumerate(zip(terms, node.inputs, need)):
        if not n:
            res.append(None)
            continue
        unique = "".join(dict.fromkeys(term))
        repeated = len(unique) != len(term)
        others = [(out, gout[0])] + [(t, v) for j, (t, v) in enumerate(zip(terms, node.inputs)) if j != i]
        have = set("".join(t for t, _ in others))
        kept = "".join(c for c in unique if c in have)
        d = e.op("Einsum", *[v for _, v in others], equation=",".join(t for t, _ in others) + "->" + kept)
        first = [term.index(c) for c in unique]
        if kept != unique:
            missing = [k for k, c in enumerate(unique) if c not in have]
            shape = e.op("Gather", e.op("Shape", x), e.ints(first), axis=0)
            d = e.op("Expand", e.unsqueeze(d, missing), shape)
        if not repeated:
            res.append(_sum_broadcast(e, d, x, term, ellipsis))
            continue
        fresh = [c for c in string.ascii_letters if c not in eq and c not in ellipsis]
        target, eyes, seen = "", [], set()
        for k, c in enumerate(term):
            if c not in seen:
                seen.add(c)
                target += c
                continue
            j = fresh.pop(0)
            size = e.op("Gather", e.op("Shape", x), e.ints([k]), axis=0)
            eye = e.op("EyeLike", e.op("Expand", e.scalar_like(0.0, x), e.op("Concat", size, size, axis=0)))
            eyes.append((c + j, eye))
            target += j
        d = e.op("Einsum", d, *[v for _, v in eyes],
                 equation=",".join([unique] + [t for t, _ in eyes]) + "->" + target)
        res.append(_sum_broadcast(e, d, x, term, ellipsis))
    return res

