"""Float64 numpy implementations of ONNX's LSTM, GRU and RNN (the ONNX operator specification,
LSTM-14 / GRU-14 / RNN-14, default activations; ``sequence_lens``, initial states, peepholes,
directions and layouts), the oracle of tests/test_grad_rnn.py."""

from __future__ import annotations

import numpy as np


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _run(op, x, w, r, b, lens, h0, c0, p, direction, layout, linear_before_reset=0, activation="Tanh"):
    if layout:
        x = x.transpose(1, 0, 2)
        h0 = None if h0 is None else h0.transpose(1, 0, 2)
        c0 = None if c0 is None else c0.transpose(1, 0, 2)
    t_len, n, _ = x.shape
    d_count, hidden = w.shape[0], r.shape[-1]
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    b = np.zeros((d_count, 2 * gates * hidden)) if b is None else b
    lens = np.full(n, t_len) if lens is None else lens
    h0 = np.zeros((d_count, n, hidden)) if h0 is None else h0
    c0 = np.zeros((d_count, n, hidden)) if c0 is None else c0
    p = np.zeros((d_count, 3 * hidden)) if p is None else p
    y = np.zeros((t_len, d_count, n, hidden))
    y_h = np.zeros((d_count, n, hidden))
    y_c = np.zeros((d_count, n, hidden))
    act = {"Tanh": np.tanh, "Relu": lambda v: np.maximum(v, 0.0), "Sigmoid": _sigmoid}[activation]
    H = hidden
    for d in range(d_count):
        reverse = direction == "reverse" or (direction == "bidirectional" and d == 1)
        wd, rd, wb, rb = w[d], r[d], b[d][:gates * H], b[d][gates * H:]
        for k in range(n):
            h, c = h0[d, k].copy(), c0[d, k].copy()
            steps = range(int(lens[k]))
            for t in (reversed(steps) if reverse else steps):
                xt = x[t, k]
                if op == "LSTM":
                    g = xt @ wd.T + h @ rd.T + wb + rb
                    i = _sigmoid(g[:H] + p[d, :H] * c)
                    f = _sigmoid(g[2 * H:3 * H] + p[d, 2 * H:] * c)
                    cc = np.tanh(g[3 * H:])
                    c = f * c + i * cc
                    o = _sigmoid(g[H:2 * H] + p[d, H:2 * H] * c)
                    h = o * np.tanh(c)
                elif op == "GRU":
                    gx = xt @ wd.T + wb
                    z = _sigmoid(gx[:H] + h @ rd[:H].T + rb[:H])
                    rr = _sigmoid(gx[H:2 * H] + h @ rd[H:2 * H].T + rb[H:2 * H])
                    if linear_before_reset:
                        hh = np.tanh(gx[2 * H:] + rr * (h @ rd[2 * H:].T + rb[2 * H:]))
                    else:
                        hh = np.tanh(gx[2 * H:] + (rr * h) @ rd[2 * H:].T + rb[2 * H:])
                    h = (1 - z) * hh + z * h
                else:
                    h = act(xt @ wd.T + h @ rd.T + wb + rb)
                y[t, d, k] = h
            y_h[d, k], y_c[d, k] = h, c
    if layout:
        y, y_h, y_c = y.transpose(2, 0, 1, 3), y_h.transpose(1, 0, 2), y_c.transpose(1, 0, 2)
    return (y, y_h, y_c) if op == "LSTM" else (y, y_h)


def run(op, inputs: dict, attrs: dict):
    """The outputs of ``op`` for ``inputs`` (ONNX input names: X W R B sequence_lens initial_h
    initial_c P; absent ones left out) and ``attrs`` (direction, layout, linear_before_reset,
    activations)."""
    acts = attrs.get("activations")
    return _run(op, inputs["X"], inputs["W"], inputs["R"], inputs.get("B"), inputs.get("sequence_lens"),
                inputs.get("initial_h"), inputs.get("initial_c"), inputs.get("P"),
                attrs.get("direction", "forward"), attrs.get("layout", 0),
                attrs.get("linear_before_reset", 0), acts[0] if acts else "Tanh")
