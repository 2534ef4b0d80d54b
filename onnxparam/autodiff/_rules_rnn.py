"""Gradient rules of ONNX's recurrent operators ``LSTM``, ``GRU`` and ``RNN``: backpropagation
through time written as ONNX ``Scan`` nodes, so one backward graph serves every sequence length
and batch size (only the hidden size and the number of directions are read from the node).

Forward semantics: the ONNX operator specification (https://onnx.ai/onnx/operators/, LSTM-14,
GRU-14, RNN-14). Supported: every input (``X``, ``W``, ``R``, ``B``, ``sequence_lens``,
``initial_h``, ``initial_c``, the peepholes ``P``), ``direction`` forward / reverse /
bidirectional, ``layout`` 0 and 1, GRU's ``linear_before_reset`` 0 and 1, the default
activations (LSTM: Sigmoid, Tanh, Tanh; GRU: Sigmoid, Tanh; RNN: Tanh, and Relu / Sigmoid for
RNN). ``clip``, LSTM's ``input_forget`` and other activations are refused, naming the node.

Method, per direction (a reverse direction is a forward one on ``ReverseSequence`` d inputs
with its results reversed back, each batch entry within its own length):

* the hidden states the forward kept (``Y``) give ``H_{t-1}`` for every valid step (``h0``
  then ``Y[:-1]``), so every product with ``X`` or ``H_{t-1}`` is computed for all steps at once
  (``MatMul`` over ``[T, N, .]``);
* LSTM: a forward ``Scan`` recomputes the cell states ``C_t`` (and the gates, which read ``C``
  through the peepholes);
* a reverse ``Scan`` carries ``dL/dH`` (and ``dL/dC``) from the last step to the first: each
  step adds ``dL/dY_t``, forms the gradients of the gate pre-activations ``dpre_t`` and sends
  ``dpre_t @ R`` to the previous step. Steps past a batch entry's ``sequence_lens`` pass the
  carried gradients through unchanged and have ``dpre_t = 0`` (the forward copies the state
  there and writes zeros to ``Y``);
* then for all steps at once: ``dX = dpre @ W``, ``dW = sum_t dpre_t^T X_t``,
  ``dR = sum_t dpre_t^T H_{t-1}``, ``dB = [sum dpre, sum dpre]``, the peepholes' sums, and the
  final carries are ``d initial_h`` / ``d initial_c``.

Gate layouts: LSTM ``i, o, f, c`` (P: ``i, o, f``), GRU ``z, r, h``.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, np_dtype
from ._rules import attr, rule
from ._rules_control import child_emitter

__all__ = []

_DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}


def _check(e: Emitter, node: ir.Node) -> tuple:
    """``(hidden_size, directions, layout, activations)``; raises for what the rules lack."""
    where = f"node {node.name!r} ({node.op_type})"
    if e.opset < 10:
        raise TraceError(f"{where}: the recurrent gradients need opset 10+ (ReverseSequence, Slice with inputs); "
                         f"the graph's opset is {e.opset}")
    hidden = attr(node, "hidden_size")
    if hidden is None:
        raise TraceError(f"{where}: the gradient needs the hidden_size attribute")
    direction = attr(node, "direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    if direction not in ("forward", "reverse", "bidirectional"):
        raise TraceError(f"{where}: unknown direction {direction!r}")
    dirs = 2 if direction == "bidirectional" else 1
    if attr(node, "clip") is not None:
        raise TraceError(f"{where}: no gradient rule for clip (the cell clipping attribute)")
    if node.op_type == "LSTM" and int(attr(node, "input_forget", 0) or 0):
        raise TraceError(f"{where}: no gradient rule for input_forget=1")
    acts = attr(node, "activations")
    per = len(_DEFAULT_ACTIVATIONS[node.op_type])
    if acts is not None:
        acts = [a.decode() if isinstance(a, bytes) else str(a) for a in acts]
        if attr(node, "activation_alpha") is not None or attr(node, "activation_beta") is not None:
            raise TraceError(f"{where}: no gradient rule for activation_alpha / activation_beta")
        default = _DEFAULT_ACTIVATIONS[node.op_type]
        allowed = (lambda a: a in ("Tanh", "Relu", "Sigmoid")) if node.op_type == "RNN" else None
        for k in range(dirs):
            mine = acts[k * per:(k + 1) * per]
            if [a.lower() for a in mine] != [a.lower() for a in default] and not (allowed and all(map(allowed, mine))):
                raise TraceError(f"{where}: gradients support the default activations {default} "
                                 f"(RNN also Relu / Sigmoid); got {mine}")
        acts = [acts[k * per:(k + 1) * per] for k in range(dirs)]
    else:
        acts = [_DEFAULT_ACTIVATIONS[node.op_type]] * dirs
    return int(hidden), dirs, int(attr(node, "layout", 0) or 0), direction, acts


def _input(node: ir.Node, i: int) -> Optional[ir.Value]:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i] is not None else None


def _scalar(e: Emitter, k: int) -> ir.Value:
    """An int64 scalar (rank 0) initializer of the outermost graph (``Emitter.const`` makes
    rank-1 arrays of scalars)."""
    root = getattr(e, "_root", e)
    v = ir.Value(name=e.unique("/grad/scalar"), const_value=ir.tensor(np.array(k, np.int64)))
    root.typed(v, np.int64, ())
    root.graph.register_initializer(v)
    return v


def _scalar_index(e: Emitter, x: ir.Value, d: int, axis: int) -> ir.Value:
    """``x`` at index ``d`` of ``axis`` (that axis removed)."""
    return e.op("Gather", x, _scalar(e, d), axis=axis)


def _slice(e: Emitter, x: ir.Value, start: int, end: int, axis: int) -> ir.Value:
    return e.op("Slice", x, e.ints([start]), e.ints([end]), e.ints([axis]))


def _split(e: Emitter, x: ir.Value, hidden: int, k: int) -> list:
    """``x`` split along its last axis into ``k`` parts of ``hidden``."""
    if e.opset >= 13:
        return e.nodes("Split", [x, e.ints([hidden] * k)], {"axis": -1}, num_outputs=k)
    return e.nodes("Split", [x], {"axis": -1, "split": [hidden] * k}, num_outputs=k)


def _cat(e: Emitter, parts: list, axis: int = -1) -> ir.Value:
    return parts[0] if len(parts) == 1 else e.op("Concat", *parts, axis=axis)


def _one_minus(e: Emitter, x: ir.Value) -> ir.Value:
    return e.op("Sub", e.scalar_like(1.0, x), x)


def _sigmoid_grad(e: Emitter, y: ir.Value) -> ir.Value:
    """``s'(.) = y (1 - y)`` from the output ``y = s(.)``."""
    return e.op("Mul", y, _one_minus(e, y))


def _tanh_grad(e: Emitter, y: ir.Value) -> ir.Value:
    """``tanh'(.) = 1 - y^2`` from the output ``y = tanh(.)``."""
    return _one_minus(e, e.op("Mul", y, y))


def _weight_grad(e: Emitter, dpre: ir.Value, data: ir.Value) -> ir.Value:
    """``sum_t dpre_t^T data_t`` for ``dpre`` ``[T, N, rows]`` and ``data`` ``[T, N, width]``:
    ``[rows, width]``."""
    return e.reduce_sum(e.op("MatMul", e.transpose(dpre, [0, 2, 1]), data), [0], keepdims=False)


def _sum_steps(e: Emitter, x: ir.Value) -> ir.Value:
    """``x`` ``[T, N, k]`` summed over steps and batch: ``[k]``."""
    return e.reduce_sum(x, [0, 1], keepdims=False)


def _scan(e: Emitter, name: str, carries: list, seqs: list, body: Callable, n_out: int, reverse: bool,
          dtype: np.dtype) -> tuple:
    """A ``Scan`` over axis 0 of ``seqs`` with loop-carried ``carries``: ``body(be, carry_values,
    step_values) -> (new_carries, step_outputs)`` builds the body with the emitter ``be``.
    Returns ``(final carries, stacked step outputs)`` (outputs in time order)."""
    elem = ir.TensorType(ir.DataType.FLOAT if dtype == np.float32 else
                         ir.DataType.DOUBLE if dtype == np.float64 else ir.DataType.FLOAT16)
    graph = ir.Graph([], [], nodes=[], name=e.unique(f"{name}_body"))
    be = child_emitter(e, graph)

    def typed_input(v: ir.Value, tag: str) -> ir.Value:
        inp = ir.Value(name=e.unique(f"{name}_{tag}"), type=v.type if v.type is not None else elem)
        graph.inputs.append(inp)
        return inp

    carry_in = [typed_input(c, "carry") for c in carries]
    step_in = [typed_input(s, "step") for s in seqs]
    new_carries, outs = body(be, carry_in, step_in)
    results = []
    for v in list(new_carries) + list(outs):
        out = be.op("Identity", v)
        out.type = v.type if v.type is not None else elem
        results.append(out)
    graph.outputs.extend(results)
    k = len(seqs)
    values = e.nodes("Scan", list(carries) + list(seqs),
                     {"body": graph, "num_scan_inputs": k,
                      "scan_input_directions": [1 if reverse else 0] * k,
                      "scan_output_directions": [1 if reverse else 0] * n_out},
                     num_outputs=len(carries) + n_out)
    for v in values:
        v.type = elem
    return values[:len(carries)], values[len(carries):]


class _Direction:
    """The inputs of one direction, in its processing order (time-major ``[T, N, .]``)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _directions(e: Emitter, node: ir.Node, gout: list, gates: int, hidden: int, dirs: int, layout: int,
                direction: str, has_c: bool) -> tuple:
    """``(common, [per-direction])``: the time-major X, the masks and lengths, and for each
    direction its weights, initial states, hidden states Y and output gradients."""
    x = node.inputs[0]
    dtype = np_dtype(x)
    if layout:
        x = e.transpose(x, [1, 0, 2])
    shape = e.op("Shape", x)
    t_len = e.op("Gather", shape, _scalar(e, 0), axis=0)
    n_1d = _slice(e, shape, 1, 2, 0)
    zeros_nh = e.op("Expand", e.const(np.zeros((), dtype), dtype), _cat(e, [n_1d, e.ints([hidden])], 0))
    lens = _input(node, 4)
    if lens is not None:
        lens64 = e.op("Cast", lens, to=int(ir.DataType.INT64))
        steps = e.op("Range", _scalar(e, 0), t_len, _scalar(e, 1))
        mask = e.op("Less", e.unsqueeze(steps, [1, 2]), e.unsqueeze(lens64, [0, 2]))  # [T, N, 1]
    else:
        lens64 = e.op("Expand", e.unsqueeze(t_len, [0]), n_1d)
        mask = None
    y = node.outputs[0]
    if not y.name:  # the forward did not ask for Y: the backward reads it
        y.name = e.unique(f"{node.name or node.op_type}_Y")
    if layout:
        y = e.transpose(y, [1, 2, 0, 3])  # [N, T, D, H] -> [T, D, N, H]
    g_y, g_h = gout[0], gout[1] if len(gout) > 1 else None
    g_c = gout[2] if has_c and len(gout) > 2 else None
    if layout:
        g_y = None if g_y is None else e.transpose(g_y, [1, 2, 0, 3])
        g_h = None if g_h is None else e.transpose(g_h, [1, 0, 2])
        g_c = None if g_c is None else e.transpose(g_c, [1, 0, 2])
    w, r, b = node.inputs[1], node.inputs[2], _input(node, 3)
    h0, c0 = _input(node, 5), _input(node, 6) if has_c else None
    p = _input(node, 7) if has_c else None
    if layout:
        h0 = None if h0 is None else e.transpose(h0, [1, 0, 2])
        c0 = None if c0 is None else e.transpose(c0, [1, 0, 2])
    out = []
    for d in range(dirs):
        reverse = direction == "reverse" or (direction == "bidirectional" and d == 1)

        def rev(v, reverse=reverse):
            return v if v is None or not reverse else e.op("ReverseSequence", v, lens64, batch_axis=1, time_axis=0)

        wb = rb = None
        if b is not None:
            bd = _scalar_index(e, b, d, 0)
            wb, rb = _slice(e, bd, 0, gates * hidden, 0), _slice(e, bd, gates * hidden, 2 * gates * hidden, 0)
        out.append(_Direction(
            reverse=reverse, rev=rev,
            x=rev(x), y=rev(_scalar_index(e, y, d, 1)),
            w=_scalar_index(e, w, d, 0), r=_scalar_index(e, r, d, 0), wb=wb, rb=rb,
            h0=zeros_nh if h0 is None else _scalar_index(e, h0, d, 0),
            c0=zeros_nh if c0 is None else (_scalar_index(e, c0, d, 0) if has_c else None),
            p=None if p is None else _scalar_index(e, p, d, 0),
            g_y=rev(None if g_y is None else _scalar_index(e, g_y, d, 1)),
            g_h=None if g_h is None else _scalar_index(e, g_h, d, 0),
            g_c=None if g_c is None else _scalar_index(e, g_c, d, 0),
        ))
    common = _Direction(x=x, dtype=dtype, mask=mask, zeros_nh=zeros_nh, layout=layout)
    return common, out


def _h_prev(e: Emitter, dd: _Direction) -> ir.Value:
    """``H_{t-1}`` for every step: ``h0`` then ``Y[:-1]``."""
    return e.op("Concat", e.unsqueeze(dd.h0, [0]), _slice(e, dd.y, 0, -1, 0), axis=0)


def _masked(be: Emitter, m: Optional[ir.Value], when_valid: ir.Value, otherwise: ir.Value) -> ir.Value:
    return when_valid if m is None else be.op("Where", m, when_valid, otherwise)


def _assemble(e: Emitter, node: ir.Node, need: list, common: _Direction, dirs_: list, per_dir: list,
              has_c: bool) -> list:
    """The input gradients from the per-direction ``dict`` s (``x`` in processing order)."""
    results: list = [None] * len(need)
    dx = None
    for dd, g in zip(dirs_, per_dir):
        gx = dd.rev(g["x"])
        dx = gx if dx is None else e.op("Add", dx, gx)
    if need[0]:
        results[0] = e.transpose(dx, [1, 0, 2]) if common.layout else dx

    def stack(key):
        return _cat(e, [e.unsqueeze(g[key], [0]) for g in per_dir], 0)

    if need[1]:
        results[1] = stack("w")
    if need[2]:
        results[2] = stack("r")
    if len(need) > 3 and need[3]:
        results[3] = stack("b")
    if len(need) > 5 and need[5]:
        h = stack("h0")
        results[5] = e.transpose(h, [1, 0, 2]) if common.layout else h
    if has_c and len(need) > 6 and need[6]:
        c = stack("c0")
        results[6] = e.transpose(c, [1, 0, 2]) if common.layout else c
    if has_c and len(need) > 7 and need[7]:
        results[7] = stack("p")
    return results


# -- LSTM ---------------------------------------------------------------------------------------


@rule("LSTM", differentiates=(5, 6))
def _lstm(e, node, gout, need):
    """LSTM (module docstring). Per step: ``i = s(pi + Pi C_{t-1})``, ``f = s(pf + Pf C_{t-1})``,
    ``c~ = tanh(pc)``, ``C_t = f C_{t-1} + i c~``, ``o = s(po + Po C_t)``, ``H_t = o tanh(C_t)``,
    with ``p = X_t W^T + H_{t-1} R^T + Wb + Rb``. Backward step (``dH = dL/dH_t + dL/dY_t``):
    ``dpo = dH tanh(C_t) o(1-o)``, ``dC_t = dC + dH o (1 - tanh^2 C_t) + dpo Po``,
    ``dpi = dC_t c~ i(1-i)``, ``dpf = dC_t C_{t-1} f(1-f)``, ``dpc = dC_t i (1-c~^2)``,
    ``dC_{t-1} = dC_t f + dpi Pi + dpf Pf``, ``dH_{t-1} = [dpi dpo dpf dpc] @ R``."""
    hidden, dirs, layout, direction, _ = _check(e, node)
    common, dirs_ = _directions(e, node, gout, 4, hidden, dirs, layout, direction, has_c=True)
    dtype, mask, H = common.dtype, common.mask, hidden
    per_dir = []
    for dd in dirs_:
        h_prev = _h_prev(e, dd)
        pre = e.op("Add", e.op("MatMul", dd.x, e.transpose(dd.w, [1, 0])),
                   e.op("MatMul", h_prev, e.transpose(dd.r, [1, 0])))
        if dd.wb is not None:
            pre = e.op("Add", pre, e.op("Add", dd.wb, dd.rb))
        peep = None if dd.p is None else _split(e, dd.p, H, 3)  # Pi, Po, Pf

        def forward_body(be, carry, step, peep=peep):
            (c,), (p_t, *m) = carry, step
            pi, po, pf, pc = _split(be, p_t, H, 4)
            if peep is not None:
                pi, pf = be.op("Add", pi, be.op("Mul", peep[0], c)), be.op("Add", pf, be.op("Mul", peep[2], c))
            i, f, cc = be.op("Sigmoid", pi), be.op("Sigmoid", pf), be.op("Tanh", pc)
            c_new = be.op("Add", be.op("Mul", f, c), be.op("Mul", i, cc))
            if peep is not None:
                po = be.op("Add", po, be.op("Mul", peep[1], c_new))
            o = be.op("Sigmoid", po)
            carried = _masked(be, m[0] if m else None, c_new, c)
            return [carried], [c, c_new, i, f, cc, o]

        seqs = [pre] + ([mask] if mask is not None else [])
        _, (c_prev, c_new, i, f, cc, o) = _scan(e, "lstm_cells", [dd.c0], seqs, forward_body, 6, False, dtype)

        g_y = dd.g_y

        def backward_body(be, carry, step, peep=peep, r=dd.r, has_gy=g_y is not None):
            d_h, d_c = carry
            step = list(step)
            gy_t = step.pop(0) if has_gy else None
            cp, cn, i_, f_, cc_, o_ = step[:6]
            m = step[6] if len(step) > 6 else None
            dh = d_h if gy_t is None else be.op("Add", d_h, gy_t)
            tc = be.op("Tanh", cn)
            dpo = be.op("Mul", be.op("Mul", dh, tc), _sigmoid_grad(be, o_))
            dcn = be.op("Add", d_c, be.op("Mul", be.op("Mul", dh, o_), _tanh_grad(be, tc)))
            if peep is not None:
                dcn = be.op("Add", dcn, be.op("Mul", dpo, peep[1]))
            dpi = be.op("Mul", be.op("Mul", dcn, cc_), _sigmoid_grad(be, i_))
            dpf = be.op("Mul", be.op("Mul", dcn, cp), _sigmoid_grad(be, f_))
            dpc = be.op("Mul", be.op("Mul", dcn, i_), _tanh_grad(be, cc_))
            dcp = be.op("Mul", dcn, f_)
            if peep is not None:
                dcp = be.op("Add", dcp, be.op("Add", be.op("Mul", dpi, peep[0]), be.op("Mul", dpf, peep[2])))
            dpre = be.op("Concat", dpi, dpo, dpf, dpc, axis=-1)
            dhp = be.op("MatMul", dpre, r)
            if m is not None:
                dpre = be.op("Where", m, dpre, be.op("Sub", dpre, dpre))  # (zeros; dpre is finite)
                dhp, dcp = be.op("Where", m, dhp, d_h), be.op("Where", m, dcp, d_c)
            return [dhp, dcp], [dpre]

        seqs = ([g_y] if g_y is not None else []) + [c_prev, c_new, i, f, cc, o] + ([mask] if mask is not None else [])
        init = [dd.g_h if dd.g_h is not None else common.zeros_nh, dd.g_c if dd.g_c is not None else common.zeros_nh]
        (dh0, dc0), (dpre,) = _scan(e, "lstm_bptt", init, seqs, backward_body, 1, True, dtype)
        g = {"x": e.op("MatMul", dpre, dd.w), "w": _weight_grad(e, dpre, dd.x),
             "r": _weight_grad(e, dpre, h_prev), "h0": dh0, "c0": dc0}
        db = _sum_steps(e, dpre)
        g["b"] = e.op("Concat", db, db, axis=0)
        dpi, dpo, dpf, _ = _split(e, dpre, H, 4)

        def peep_sum(dp, c):
            return _sum_steps(e, e.op("Mul", dp, c))

        g["p"] = e.op("Concat", peep_sum(dpi, c_prev), peep_sum(dpo, c_new), peep_sum(dpf, c_prev), axis=0)
        per_dir.append(g)
    return _assemble(e, node, need, common, dirs_, per_dir, has_c=True)


# -- GRU ----------------------------------------------------------------------------------------


@rule("GRU", differentiates=(5,))
def _gru(e, node, gout, need):
    """GRU (module docstring). Per step, with ``x* = X_t W*^T + Wb*`` and ``h* = H_{t-1} R*^T``:
    ``z = s(xz + hz + Rbz)``, ``r = s(xr + hr + Rbr)``, ``h~ = tanh(xh + r (hh + Rbh))``
    (``linear_before_reset``) or ``tanh(xh + (r H_{t-1}) Rh^T + Rbh)``, ``H_t = (1-z) h~ + z H_{t-1}``.
    Every gate is computed for all steps at once from ``H_{t-1}``; the reverse scan carries
    ``dH`` only."""
    hidden, dirs, layout, direction, _ = _check(e, node)
    H = hidden
    lbr = int(attr(node, "linear_before_reset", 0) or 0)
    common, dirs_ = _directions(e, node, gout, 3, hidden, dirs, layout, direction, has_c=False)
    dtype, mask = common.dtype, common.mask
    per_dir = []
    for dd in dirs_:
        h_prev = _h_prev(e, dd)
        wz_r = _slice(e, dd.r, 0, 2 * H, 0)   # Rz, Rr: [2H, H]
        rh = _slice(e, dd.r, 2 * H, 3 * H, 0)  # Rh: [H, H]
        xp = e.op("MatMul", dd.x, e.transpose(dd.w, [1, 0]))
        if dd.wb is not None:
            xp = e.op("Add", xp, dd.wb)
        xz, xr, xh = _split(e, xp, H, 3)
        hzr = e.op("MatMul", h_prev, e.transpose(wz_r, [1, 0]))
        rbz = rbr = rbh = None
        if dd.rb is not None:
            rbz, rbr, rbh = _split(e, dd.rb, H, 3)
            hzr = e.op("Add", hzr, _cat(e, [rbz, rbr], -1))
        hz, hr = _split(e, hzr, H, 2)
        z = e.op("Sigmoid", e.op("Add", xz, hz))
        r = e.op("Sigmoid", e.op("Add", xr, hr))
        if lbr:
            a = e.op("MatMul", h_prev, e.transpose(rh, [1, 0]))
            if rbh is not None:
                a = e.op("Add", a, rbh)
            hh = e.op("Tanh", e.op("Add", xh, e.op("Mul", r, a)))
        else:
            a = e.op("Mul", r, h_prev)  # q = r H_{t-1}
            inner = e.op("MatMul", a, e.transpose(rh, [1, 0]))
            if rbh is not None:
                inner = e.op("Add", inner, rbh)
            hh = e.op("Tanh", e.op("Add", xh, inner))

        g_y = dd.g_y

        def body(be, carry, step, has_gy=g_y is not None):
            (d_h,), step = carry, list(step)
            gy_t = step.pop(0) if has_gy else None
            z_, r_, hh_, hp_, a_ = step[:5]
            m = step[5] if len(step) > 5 else None
            dh = d_h if gy_t is None else be.op("Add", d_h, gy_t)
            dhh = be.op("Mul", dh, _one_minus(be, z_))
            dz = be.op("Mul", dh, be.op("Sub", hp_, hh_))
            dhp = be.op("Mul", dh, z_)
            dph = be.op("Mul", dhh, _tanh_grad(be, hh_))
            if lbr:
                da = be.op("Mul", dph, r_)  # d(H_{t-1} Rh^T + Rbh)
                dr = be.op("Mul", dph, a_)
                dhp = be.op("Add", dhp, be.op("MatMul", da, rh))
                side_h = da
            else:
                dq = be.op("MatMul", dph, rh)
                dr = be.op("Mul", dq, hp_)
                dhp = be.op("Add", dhp, be.op("Mul", dq, r_))
                side_h = dph
            dpz = be.op("Mul", dz, _sigmoid_grad(be, z_))
            dpr = be.op("Mul", dr, _sigmoid_grad(be, r_))
            dzr = be.op("Concat", dpz, dpr, axis=-1)
            dhp = be.op("Add", dhp, be.op("MatMul", dzr, wz_r))
            dx = be.op("Concat", dzr, dph, axis=-1)
            side = be.op("Concat", dzr, side_h, axis=-1)
            if m is not None:
                zero = be.op("Sub", dx, dx)
                dx, side = be.op("Where", m, dx, zero), be.op("Where", m, side, be.op("Sub", side, side))
                dhp = be.op("Where", m, dhp, d_h)
            return [dhp], [dx, side]

        seqs = ([g_y] if g_y is not None else []) + [z, r, hh, h_prev, a] + ([mask] if mask is not None else [])
        init = [dd.g_h if dd.g_h is not None else common.zeros_nh]
        (dh0,), (dxp, side) = _scan(e, "gru_bptt", init, seqs, body, 2, True, dtype)
        g = {"x": e.op("MatMul", dxp, dd.w), "w": _weight_grad(e, dxp, dd.x), "h0": dh0}
        d_side_zr = _slice(e, side, 0, 2 * H, 2)
        d_side_h = _slice(e, side, 2 * H, 3 * H, 2)
        g_rzr = _weight_grad(e, d_side_zr, h_prev)
        g_rh = _weight_grad(e, d_side_h, h_prev if lbr else a)
        g["r"] = e.op("Concat", g_rzr, g_rh, axis=0)
        dwb, drb = _sum_steps(e, dxp), _sum_steps(e, side)
        g["b"] = e.op("Concat", dwb, drb, axis=0)
        per_dir.append(g)
    return _assemble(e, node, need, common, dirs_, per_dir, has_c=False)


# -- RNN ----------------------------------------------------------------------------------------


@rule("RNN", differentiates=(5,))
def _rnn(e, node, gout, need):
    """RNN (module docstring): ``H_t = act(X_t W^T + H_{t-1} R^T + Wb + Rb)``; the derivative of
    the activation is read from ``H_t = Y_t`` (Tanh ``1 - H^2``, Sigmoid ``H (1 - H)``, Relu
    ``H > 0``); the reverse scan carries ``dH``, ``dH_{t-1} = dpre_t @ R``."""
    hidden, dirs, layout, direction, acts = _check(e, node)
    H = hidden
    common, dirs_ = _directions(e, node, gout, 1, hidden, dirs, layout, direction, has_c=False)
    dtype, mask = common.dtype, common.mask
    per_dir = []
    for k, dd in enumerate(dirs_):
        h_prev = _h_prev(e, dd)
        act = acts[k][0].lower()
        y = dd.y
        if act == "tanh":
            dact = _tanh_grad(e, y)
        elif act == "sigmoid":
            dact = _sigmoid_grad(e, y)
        else:
            dact = e.op("Cast", e.op("Greater", y, e.const(np.zeros((), dtype), dtype)), to=int(y.dtype))
        g_y = dd.g_y

        def body(be, carry, step, has_gy=g_y is not None, r=dd.r):
            (d_h,), step = carry, list(step)
            gy_t = step.pop(0) if has_gy else None
            dact_t = step[0]
            m = step[1] if len(step) > 1 else None
            dh = d_h if gy_t is None else be.op("Add", d_h, gy_t)
            dpre = be.op("Mul", dh, dact_t)
            dhp = be.op("MatMul", dpre, r)
            if m is not None:
                dpre = be.op("Where", m, dpre, be.op("Sub", dpre, dpre))
                dhp = be.op("Where", m, dhp, d_h)
            return [dhp], [dpre]

        seqs = ([g_y] if g_y is not None else []) + [dact] + ([mask] if mask is not None else [])
        init = [dd.g_h if dd.g_h is not None else common.zeros_nh]
        (dh0,), (dpre,) = _scan(e, "rnn_bptt", init, seqs, body, 1, True, dtype)
        g = {"x": e.op("MatMul", dpre, dd.w), "w": _weight_grad(e, dpre, dd.x),
             "r": _weight_grad(e, dpre, h_prev), "h0": dh0}
        db = _sum_steps(e, dpre)
        g["b"] = e.op("Concat", db, db, axis=0)
        per_dir.append(g)
    return _assemble(e, node, need, common, dirs_, per_dir, has_c=False)


for _fn in (_lstm, _gru, _rnn):
    _fn.multi_output = True  # (Y, Y_h and Y_c all carry gradients)
