"""Recurrent layers: ``Lstm``, ``BiLstm``, ``Gru`` (Burn's ``burn-nn/src/modules/rnn/``).

Every gate is a :class:`GateController` holding two :class:`~onnxparam.nn.Linear` s,
``input_transform`` ``(d_input, d_hidden)`` and ``hidden_transform`` ``(d_hidden, d_hidden)``
(Burn's ``gate_controller.rs``), so a Burn record loads unchanged::

    Lstm: input_gate, forget_gate, output_gate, cell_gate  .{input_transform,hidden_transform}.{weight,bias}
    Gru:  update_gate, reset_gate, new_gate                .{input_transform,hidden_transform}.{weight,bias}

(the bidirectional ``BiLstm`` / ``BiGru`` are in :mod:`._rnn_bidirectional`).

NOTE (forward: an unrolled composition, not ONNX's ``LSTM`` / ``GRU``): the forwards are the
recurrences unrolled over the (static) sequence length with ``MatMul`` / ``Add`` / ``Sigmoid`` /
``Tanh`` / ``Mul`` / ``Split`` / ``Concat``, which is how Burn computes them (a loop over time
steps). Each of these operators already has a gradient rule in :mod:`onnxparam.autodiff`, so
the layers train; packing Burn's per-gate weights into the ``W`` / ``R`` / ``B`` inputs of
ONNX's ``LSTM`` / ``GRU`` would add a concatenation per call in the graph without saving work
at the small sizes this targets. The input projections of all time steps are one
``MatMul`` per gate; only the hidden projections run per step. The batch size is never baked
into the graph (the zero initial state is folded away: at step 0 the hidden product is just the
hidden bias); the sequence length is (static shapes).

``onnx_op=True`` (an onnxparam option, not a Burn field; it changes no record) emits ONNX's own
``LSTM`` / ``GRU`` node instead (ONNX spec: LSTM-14 / GRU-14, gates packed in ONNX's order i, o,
f, c / z, r, h inside the graph), which ONNX Runtime runs as one fused kernel; these train too
(:mod:`onnxparam.autodiff._rules_rnn`: backpropagation through time as ONNX ``Scan`` s).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import check_float_dtype, config, layer_from_config, positive
from ._initializer import Initializer
from ._linear import Linear

__all__ = ["GateController", "LstmState", "Lstm", "LstmConfig", "Gru", "GruConfig", "RNN_INITIALIZER"]

RNN_INITIALIZER = Initializer.XavierNormal(gain=1.0)
"""Burn's default initializer of ``LstmConfig`` / ``GruConfig``: ``XavierNormal { gain: 1.0 }``,
``N(0, sqrt(2 / (fan_in + fan_out)))`` with the fans of each ``Linear`` (weights *and* biases)."""

_ACTIVATIONS = {"sigmoid": ops.sigmoid, "tanh": ops.tanh, "relu": ops.relu}


def _activation(name: str, field: str):
    try:
        return _ACTIVATIONS[str(name).lower()]
    except KeyError:
        raise ValueError(f"{field} must be one of {sorted(_ACTIVATIONS)}; got {name!r}") from None


class LstmState(NamedTuple):
    """The state of an :class:`Lstm` (Burn's ``LstmState``): ``cell`` and ``hidden``, each
    ``[batch, d_hidden]`` (``[2, batch, d_hidden]`` for :class:`BiLstm`)."""

    cell: Tensor
    hidden: Tensor


class GateController(Module):
    """One gate: ``x @ input_transform.weight + b_i + h @ hidden_transform.weight + b_h``
    (Burn's ``GateController``, ``burn-nn/src/modules/rnn/gate_controller.rs``).

    Params: ``input_transform.{weight (d_input, d_output), bias (d_output,)}``,
    ``hidden_transform.{weight (d_output, d_output), bias (d_output,)}``; Burn's row layout.
    """

    def __init__(self, d_input: int, d_output: int, bias: bool, initializer: Initializer,
                 device: "Device | str", dtype: DType):
        self.input_transform = Linear(d_input, d_output, bias, initializer=initializer, device=device, dtype=dtype)
        self.hidden_transform = Linear(d_output, d_output, bias, initializer=initializer, device=device, dtype=dtype)

    def forward(self, x: Tensor, hidden: Tensor) -> Tensor:
        return ops.add(self.input_transform(x), self.hidden_transform(hidden))

    def hidden_part(self, hidden: Optional[Tensor]) -> Optional[Tensor]:
        """``hidden @ W_h + b_h``; for a zero state (``None``) just ``b_h`` (``None`` without bias)."""
        if hidden is not None:
            return self.hidden_transform(hidden)
        return None if self.hidden_transform.bias is None else self.hidden_transform.bias.val()


def _plus(a: Tensor, b: Optional[Tensor]) -> Tensor:
    return a if b is None else ops.add(a, b)


def _steps(x: Tensor, what: str) -> list:
    """The ``[batch, d]`` slices of a ``[batch, seq, d]`` tensor, one per time step."""
    if x.rank != 3:
        raise ValueError(f"{what} expects a rank-3 input [batch, seq, d_input]; got shape {list(x.shape)}")
    seq = x.shape[1]
    if not isinstance(seq, int):
        raise ValueError(f"{what} needs a static sequence length; got a dynamic dim {seq!r}")
    if seq == 1:
        return [ops.squeeze(x, 1)]
    return [ops.squeeze(s, 1) for s in ops.split(x, [1] * seq, 1)]


def _stack(hiddens: list) -> Tensor:
    """``[batch, d]`` per step -> ``[batch, seq, d]``."""
    items = [ops.unsqueeze(h, 1) for h in hiddens]
    return items[0] if len(items) == 1 else ops.concat(items, 1)


def _pack(transforms: list) -> tuple:
    """ONNX's ``W`` / ``R`` ``[1, G*H, d]`` (each block the transpose of a Burn ``(d, H)``
    weight) and the concatenated biases ``[G*H]`` (``None`` without bias), in ``transforms``' order."""
    w = ops.unsqueeze(ops.concat([ops.transpose(t.weight.val(), 0, 1) for t in transforms], 0), [0])
    if any(t.bias is None for t in transforms):
        return w, None
    return w, ops.concat([t.bias.val() for t in transforms], 0)


def _packed_bias(wb: Optional[Tensor], rb: Optional[Tensor]) -> Optional[Tensor]:
    return None if wb is None else ops.unsqueeze(ops.concat([wb, rb], 0), [0])


def _check_recurrent(what: str, d_input, d_hidden, dtype, onnx_op, clip, activations: dict) -> tuple:
    """The arguments :class:`Lstm` and :class:`Gru` share, checked: ``(d_input, d_hidden, dtype,
    onnx_op)`` as ``int, int, DType, bool``; ``activations`` maps field names to names.

    Raises:
        ValueError: for non-positive sizes, a non-float dtype, ``clip`` with ``onnx_op``, a
            ``clip`` that is not positive, or an unknown activation.
    """
    d_input, d_hidden = positive(d_input, "d_input"), positive(d_hidden, "d_hidden")
    dtype = check_float_dtype(dtype, what)
    if onnx_op and clip is not None:
        raise ValueError(f"{what}(onnx_op=True) cannot clip: ONNX's clip bounds the gates' pre-activations, "
                         "Burn's clamps the state; use onnx_op=False (the unrolled form) with clip")
    if clip is not None and not float(clip) > 0:
        raise ValueError(f"clip must be a positive number or None; got {clip!r}")
    for field, name in activations.items():
        _activation(name, field)
    return d_input, d_hidden, dtype, bool(onnx_op)


def _check_input(x: Tensor, d_input: int, what: str) -> None:
    if x.rank == 3 and isinstance(x.shape[2], int) and x.shape[2] != d_input:
        raise ValueError(f"{what} expects d_input={d_input} features in the last dim; got shape {list(x.shape)}")


@config
class LstmConfig:
    """Configuration of an :class:`Lstm` (Burn's ``LstmConfig``).

    Args:
        d_input: input features.
        d_hidden: hidden (and cell) state size.
        bias: whether the gates' ``Linear`` s add biases.
        initializer: Burn's default ``XavierNormal(gain=1.0)``.
        batch_first: input ``[batch, seq, d_input]`` (``True``, Burn's default) or
            ``[seq, batch, d_input]``.
        reverse: process the sequence from the last step to the first.
        clip: clamp the cell state to ``[-clip, clip]`` after each step (``None``: no clamp).
        input_forget: couple the gates, ``f_t = 1 - i_t`` (``forget_gate`` is then unused but
            kept as a param, as in Burn).
        gate_activation, cell_activation, hidden_activation: ``"sigmoid"``, ``"tanh"`` (the
            defaults, as Burn's) or ``"relu"``.
        onnx_op: emit ONNX's ``LSTM`` operator (see the module docstring) instead of the
            unrolled composition. Not a Burn field.
    """

    d_input: int
    d_hidden: int
    bias: bool = True
    initializer: Initializer = RNN_INITIALIZER
    batch_first: bool = True
    reverse: bool = False
    clip: Optional[float] = None
    input_forget: bool = False
    gate_activation: str = "sigmoid"
    cell_activation: str = "tanh"
    hidden_activation: str = "tanh"
    onnx_op: bool = False

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Lstm":
        """A new :class:`Lstm` with lazy params on ``device``."""
        return layer_from_config(self, Lstm, device=device, dtype=dtype)


class Lstm(Module):
    """Long short-term memory (Hochreiter & Schmidhuber 1997), Burn's ``Lstm``
    (``burn-nn/src/modules/rnn/lstm.rs``)::

        i = σ(x W_ii + b_ii + h W_hi + b_hi)      (input_gate)
        f = σ(x W_if + b_if + h W_hf + b_hf)      (forget_gate; 1 - i with input_forget)
        o = σ(x W_io + b_io + h W_ho + b_ho)      (output_gate)
        g = tanh(x W_ic + b_ic + h W_hc + b_hc)   (cell_gate)
        c' = f * c + i * g   (clamped to ±clip if set);   h' = o * tanh(c')

    Params: ``{input,forget,output,cell}_gate.{input_transform,hidden_transform}.{weight,bias}``
    (see :class:`GateController`); PyTorch's ``nn.LSTM`` packs them in gate order i, f, g, o as
    ``weight_ih_l0 (4H, d_input)`` etc. (:mod:`onnxparam.convert._torch_layers` maps them).

    ``forward(x, state=None) -> (output, cell, hidden)``:
        x: ``[batch, seq, d_input]`` (``[seq, batch, d_input]`` when not ``batch_first``), float.
        state: an :class:`LstmState` (or a ``(cell, hidden)`` pair), each ``[batch, d_hidden]``;
            ``None`` is zeros.
        output: every step's hidden state, ``[batch, seq, d_hidden]`` (seq first when not
            ``batch_first``); ``cell``, ``hidden``: the final state, ``[batch, d_hidden]``.
        Burn returns ``(output, LstmState)``; a traced graph's outputs are a flat tuple, so the
        state comes back flattened (``LstmState(*result[1:])`` rebuilds it).

    ONNX: an unrolled composition (see the module docstring); static sequence length.

    Raises:
        ValueError: for non-positive sizes, an unknown activation, a non-float dtype, or an input
            that is not rank 3 with ``d_input`` features and a static sequence length.
    """

    def __init__(self, d_input: int, d_hidden: int, bias: bool = True, *,
                 initializer: Initializer = RNN_INITIALIZER, batch_first: bool = True, reverse: bool = False,
                 clip: Optional[float] = None, input_forget: bool = False, gate_activation: str = "sigmoid",
                 cell_activation: str = "tanh", hidden_activation: str = "tanh", onnx_op: bool = False,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        d_input, d_hidden, dtype, self.onnx_op = _check_recurrent(
            "Lstm", d_input, d_hidden, dtype, onnx_op, clip,
            {"gate_activation": gate_activation, "cell_activation": cell_activation,
             "hidden_activation": hidden_activation})
        gate = lambda: GateController(d_input, d_hidden, bias, initializer, device, dtype)  # noqa: E731
        self.input_gate = gate()
        self.forget_gate = gate()
        self.output_gate = gate()
        self.cell_gate = gate()
        self.d_input, self.d_hidden = d_input, d_hidden
        self.batch_first, self.reverse = bool(batch_first), bool(reverse)
        self.clip = None if clip is None else float(clip)
        self.input_forget = bool(input_forget)
        self.gate_activation, self.cell_activation = str(gate_activation), str(cell_activation)
        self.hidden_activation = str(hidden_activation)

    def forward(self, x: Tensor, state=None):
        _check_input(x, self.d_input, "Lstm")
        if not self.batch_first:
            x = ops.transpose(x, 0, 1)
        steps = _steps(x, "Lstm")
        cell, hidden = (None, None) if state is None else tuple(state)
        if self.onnx_op:
            output, cell, hidden = self._forward_onnx(x, cell, hidden)
            return (output if self.batch_first else ops.transpose(output, 0, 1)), cell, hidden
        sigma = _activation(self.gate_activation, "gate_activation")
        act_c = _activation(self.cell_activation, "cell_activation")
        act_h = _activation(self.hidden_activation, "hidden_activation")
        gates = [self.input_gate, self.output_gate, self.cell_gate]
        if not self.input_forget:
            gates.append(self.forget_gate)
        # One MatMul per gate over the whole sequence; per step only the hidden projections.
        projected = {id(g): _steps(g.input_transform(x), "Lstm") for g in gates}
        order = range(len(steps) - 1, -1, -1) if self.reverse else range(len(steps))
        outputs = [None] * len(steps)
        for t in order:
            def gate_sum(g):
                return _plus(projected[id(g)][t], g.hidden_part(hidden))

            i = sigma(gate_sum(self.input_gate))
            f = ops.sub(1.0, i) if self.input_forget else sigma(gate_sum(self.forget_gate))
            o = sigma(gate_sum(self.output_gate))
            g = act_c(gate_sum(self.cell_gate))
            new_cell = ops.mul(i, g)
            cell = new_cell if cell is None else ops.add(ops.mul(f, cell), new_cell)
            if self.clip is not None:
                cell = ops.clamp(cell, -self.clip, self.clip)
            hidden = ops.mul(o, act_h(cell))
            outputs[t] = hidden
        output = _stack(outputs)
        if not self.batch_first:
            output = ops.transpose(output, 0, 1)
        return output, cell, hidden

    def _forward_onnx(self, x: Tensor, cell, hidden) -> tuple:
        order = (self.input_gate, self.output_gate, self.forget_gate, self.cell_gate)  # ONNX's i, o, f, c
        w, wb = _pack([g.input_transform for g in order])
        r, rb = _pack([g.hidden_transform for g in order])
        y, y_h, y_c = ops.lstm(
            ops.transpose(x, 0, 1), w, r, _packed_bias(wb, rb),
            None if hidden is None else ops.unsqueeze(hidden, [0]), None if cell is None else ops.unsqueeze(cell, [0]),
            direction="reverse" if self.reverse else "forward", input_forget=self.input_forget,
            activations=(self.gate_activation, self.cell_activation, self.hidden_activation))
        return ops.transpose(ops.squeeze(y, [1]), 0, 1), ops.squeeze(y_c, [0]), ops.squeeze(y_h, [0])

    def extra_repr(self) -> str:
        bias = self.input_gate.input_transform.bias is not None
        return (f"d_input={self.d_input}, d_hidden={self.d_hidden}, bias={bias}"
                f", batch_first={self.batch_first}, reverse={self.reverse}")


@config
class GruConfig:
    """Configuration of a :class:`Gru` (Burn's ``GruConfig``).

    Args:
        d_input: input features.
        d_hidden: hidden state size.
        bias: whether the gates' ``Linear`` s add biases.
        reset_after: apply the reset gate after the hidden projection (``True``, Burn's default
            and PyTorch's / cuDNN's form) or to the hidden state before it (Cho et al. v3).
        initializer: Burn's default ``XavierNormal(gain=1.0)``.
        gate_activation, hidden_activation: ``"sigmoid"`` / ``"tanh"`` (defaults) or ``"relu"``.
        clip: clamp the hidden state to ``[-clip, clip]`` after each step.
        onnx_op: emit ONNX's ``GRU`` operator (see the module docstring). Not a Burn field.
    """

    d_input: int
    d_hidden: int
    bias: bool = True
    reset_after: bool = True
    initializer: Initializer = RNN_INITIALIZER
    gate_activation: str = "sigmoid"
    hidden_activation: str = "tanh"
    clip: Optional[float] = None
    onnx_op: bool = False

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Gru":
        """A new :class:`Gru` with lazy params on ``device``."""
        return layer_from_config(self, Gru, device=device, dtype=dtype)


class Gru(Module):
    """Gated recurrent unit (Cho et al. 2014), Burn's ``Gru`` (``burn-nn/src/modules/rnn/gru.rs``)::

        z = σ(x W_iz + b_iz + h W_hz + b_hz)                  (update_gate)
        r = σ(x W_ir + b_ir + h W_hr + b_hr)                  (reset_gate)
        n = tanh(x W_in + b_in + r * (h W_hn + b_hn))         (new_gate, reset_after)
        n = tanh(x W_in + b_in + (r * h) W_hn + b_hn)         (new_gate, not reset_after)
        h' = (1 - z) * n + z * h   (clamped to ±clip if set)

    Params: ``{update,reset,new}_gate.{input_transform,hidden_transform}.{weight,bias}``;
    PyTorch's ``nn.GRU`` packs gates r, z, n (:mod:`onnxparam.convert._torch_layers`).

    ``forward(x, state=None) -> output``:
        x: ``[batch, seq, d_input]`` float (Burn's Gru is batch first).
        state: ``[batch, d_hidden]`` or ``None`` (zeros).
        output: every step's hidden state, ``[batch, seq, d_hidden]`` (the last step is the final
            state).

    ONNX: an unrolled composition (see the module docstring); static sequence length.

    Raises:
        ValueError: as :class:`Lstm`.
    """

    def __init__(self, d_input: int, d_hidden: int, bias: bool = True, *, reset_after: bool = True,
                 initializer: Initializer = RNN_INITIALIZER, gate_activation: str = "sigmoid",
                 hidden_activation: str = "tanh", clip: Optional[float] = None, onnx_op: bool = False,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        d_input, d_hidden, dtype, self.onnx_op = _check_recurrent(
            "Gru", d_input, d_hidden, dtype, onnx_op, clip,
            {"gate_activation": gate_activation, "hidden_activation": hidden_activation})
        gate = lambda: GateController(d_input, d_hidden, bias, initializer, device, dtype)  # noqa: E731
        self.update_gate = gate()
        self.reset_gate = gate()
        self.new_gate = gate()
        self.d_input, self.d_hidden = d_input, d_hidden
        self.reset_after = bool(reset_after)
        self.gate_activation, self.hidden_activation = str(gate_activation), str(hidden_activation)
        self.clip = None if clip is None else float(clip)

    def forward(self, x: Tensor, state: Optional[Tensor] = None) -> Tensor:
        return self.run(x, state)[0]

    def run(self, x: Tensor, state: Optional[Tensor] = None, reverse: bool = False) -> tuple:
        """``(output [batch, seq, d_hidden], final hidden [batch, d_hidden])``, the sequence
        processed from the last step to the first when ``reverse`` (Burn's ``forward_iter``,
        used by :class:`BiGru`); ``output[:, t]`` is the state after step ``t`` either way."""
        _check_input(x, self.d_input, "Gru")
        steps = _steps(x, "Gru")
        if self.onnx_op:
            return self._run_onnx(x, state, reverse)
        sigma = _activation(self.gate_activation, "gate_activation")
        act = _activation(self.hidden_activation, "hidden_activation")
        gates = (self.update_gate, self.reset_gate, self.new_gate)
        projected = {id(g): _steps(g.input_transform(x), "Gru") for g in gates}
        hidden = state
        outputs = [None] * len(steps)
        for t in (range(len(steps) - 1, -1, -1) if reverse else range(len(steps))):
            z = sigma(_plus(projected[id(self.update_gate)][t], self.update_gate.hidden_part(hidden)))
            r = sigma(_plus(projected[id(self.reset_gate)][t], self.reset_gate.hidden_part(hidden)))
            if self.reset_after:
                part = self.new_gate.hidden_part(hidden)
                recurrent = None if part is None else ops.mul(r, part)
            else:
                part = None if hidden is None else ops.mul(hidden, r)
                recurrent = self.new_gate.hidden_part(part)
            n = act(_plus(projected[id(self.new_gate)][t], recurrent))
            new = ops.mul(ops.sub(1.0, z), n)
            hidden = new if hidden is None else ops.add(new, ops.mul(z, hidden))
            if self.clip is not None:
                hidden = ops.clamp(hidden, -self.clip, self.clip)
            outputs[t] = hidden
        return _stack(outputs), hidden

    def _run_onnx(self, x: Tensor, state, reverse: bool) -> tuple:
        order = (self.update_gate, self.reset_gate, self.new_gate)  # ONNX's z, r, h
        w, wb = _pack([g.input_transform for g in order])
        r, rb = _pack([g.hidden_transform for g in order])
        y, y_h = ops.gru(ops.transpose(x, 0, 1), w, r, _packed_bias(wb, rb),
                         None if state is None else ops.unsqueeze(state, [0]),
                         direction="reverse" if reverse else "forward", linear_before_reset=self.reset_after,
                         activations=(self.gate_activation, self.hidden_activation))
        return ops.transpose(ops.squeeze(y, [1]), 0, 1), ops.squeeze(y_h, [0])

    def extra_repr(self) -> str:
        return (f"d_input={self.d_input}, d_hidden={self.d_hidden}, "
                f"bias={self.update_gate.input_transform.bias is not None}, reset_after={self.reset_after}")

