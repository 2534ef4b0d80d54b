"""Gradient rule of ``SequenceMap`` (its body applied to each element of its sequences).

``out_i[k] = f(s_1[k], ..., s_m[k], t_1, ..., t_r)`` for each position ``k`` (``s`` the
sequence inputs, ``t`` the tensor inputs passed whole, and the outer values the body reads).
The backward is a ``SequenceMap`` too: its body recomputes ``f`` at position ``k`` (the forward
body cloned) and sweeps it in reverse (the same rules, :func:`~._rules_control.backprop`) from
the gradients ``d out_i[k]`` (the gradient sequences are further inputs of the backward map),
giving one element per position of ``d s_j`` (a sequence: the gradient of ``s_j``) and of the
gradients of the whole tensors and outer values, which are summed over the positions
(``ConcatFromSequence`` stacking, then ``ReduceSum``). The forward body is computed twice.

Semantics: the ONNX specification of ``SequenceMap-17``, https://onnx.ai/onnx/operators/.
"""

from __future__ import annotations

import onnx_ir as ir

from ._rules import rule
from ._rules_control import _dead_code, _fresh_clone, backprop, captured, child_emitter, requires_in
from ._rules_sequence import is_sequence

__all__: list = []


@rule("SequenceMap")
def _sequence_map(e, node, gout, need):
    """``out_i[k] = f(s[k], t)``: ``ds[k], dt_k = backward of f at k``; ``dt = sum_k dt_k``
    (module docstring)."""
    body = node.attributes["body"].value
    inputs = list(node.inputs)
    caps = captured(node)
    n_in = len(inputs)
    wanted_in = [j for j in range(n_in) if need[j]]
    wanted_caps = [v for v, n in zip(caps, need[n_in:]) if n]
    if not wanted_in and not wanted_caps:
        return [None] * len(need)
    g_idx = [i for i, g in enumerate(gout) if g is not None]
    tag = node.name or "SequenceMap"
    clone = _fresh_clone(e, body, "bwd")
    ce = child_emitter(e, clone)
    fwd_in, fwd_out = list(clone.inputs), list(clone.outputs)
    g_in = [ir.Value(name=e.unique(f"{tag}_dout"), type=fwd_out[i].type) for i in g_idx]
    clone.inputs.extend(g_in)
    grads: dict = {}
    for i, g in zip(g_idx, g_in):
        out = fwd_out[i]
        grads[out] = g if out not in grads else ce.op("Add", grads[out], g)
    start = {fwd_in[j] for j in wanted_in} | set(wanted_caps)
    grads = backprop(ce, list(clone), grads, requires_in(list(clone), start), f"in the body of {tag!r} (SequenceMap)")
    likes = [fwd_in[j] for j in wanted_in] + wanted_caps
    results = []
    for v in likes:
        g = grads.get(v)
        if g is None:  # (the body does not use it on a path to a differentiated output)
            g = ce.op("Expand", ce.scalar_like(0.0, v), ce.op("Shape", v))
        out = ce.op("Identity", g)
        out.type = ir.TensorType(v.dtype)
        results.append(out)
    clone.outputs.clear()
    clone.outputs.extend(results)
    _dead_code(clone)
    outs = e.nodes("SequenceMap", inputs + [gout[i] for i in g_idx], {"body": clone}, num_outputs=len(results))
    for out, v in zip(outs, likes):
        out.type = ir.SequenceType(ir.TensorType(v.dtype))
    originals = [inputs[j] for j in wanted_in] + wanted_caps
    summed = []
    for out, v in zip(outs, originals):
        if is_sequence(v):
            summed.append(out)
            continue
        stacked = e.op("ConcatFromSequence", out, axis=0, new_axis=1)
        stacked.type = ir.TensorType(v.dtype)
        summed.append(e.reduce_sum(stacked, [0], keepdims=False))
    result: list = [None] * len(need)
    it = iter(summed)
    for j in wanted_in:
        result[j] = next(it)
    for k, n in enumerate(need[n_in:]):
        if n:
            result[n_in + k] = next(it)
    return result


_sequence_map.multi_output = True  # (every output's gradient sequence feeds the backward map)
