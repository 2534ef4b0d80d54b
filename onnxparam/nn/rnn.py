"""Recurrent layers: ``Lstm``, ``BiLstm``, ``Gru`` (Burn's ``burn-nn/src/modules/rnn/``).

Every gate is a :class:`GateController` holding two :class:`~onnxparam.nn.Linear` s,
``input_transform`` ``(d_input, d_hidden)`` and ``hidden_transform`` ``(d_hidden, d_hidden)``
(Burn's ``gate_controller.rs``), so a Burn record loads unchanged::

    Lstm: input_gate, forget_gate, output_gate, cell_gate  .{input_transform,hidden_transform}.{weight,bias}
    Gru:  update_gate, reset_gate, new_gate                .{input_transform,hidden_transform}.{weight,bias}
    BiLstm: forward.<Lstm>, reverse.<Lstm>;   BiGru: forward.<Gru>, reverse.<Gru>

NOTE (forward: an unrolled composition, not ONNX's ``LSTM`` / ``GRU``): the forwards are the
recurrences unrolled over the (static) sequence length with ``MatMul`` / ``Add`` / ``Sigmoid`` /
``Tanh`` / ``Mul`` / ``Split`` / ``Concat``, which is how Burn computes them (a loop over time
steps). Each of these operators already has a gradient rule in :mod:`onnxparam.autodiff`, so
the layers train; ONNX's ``LSTM`` / ``GRU`` have no rule, and packing Burn's per-gate weights
into their ``W`` / ``R`` / ``B`` inputs would add a concatenation per call in the graph without
saving work at the small sizes this targets. The input projections of all time steps are one
``MatMul`` per gate; only the hidden projections run per step. The batch size is never baked
into the graph (the zero initial state is folded away: at step 0 the hidden product is just the
hidden bias); the sequence length is (static shapes).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .. import ops
from ..device import Device
from ..dtype import DType
from ..module import Module
from ..tensor import Tensor
from ._config import check_float_dtype, config, positive
from .initializer import Initializer
from .linear import Linear

__all__ = [
    "GateController", "LstmState", "Lstm", "LstmConfig", "BiLstm", "BiLstmConfig", "Gru", "GruConfig", "BiGru",
    "BiGruConfig",
]

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

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Lstm":
        """A new :class:`Lstm` with lazy params on ``device``."""
        return Lstm(**{f: getattr(self, f) for f in self.__dataclass_fields__}, device=device, dtype=dtype)


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
    ``weight_ih_l0 (4H, d_input)`` etc. (:mod:`onnxparam.convert.torch_layers` maps them).

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
                 cell_activation: str = "tanh", hidden_activation: str = "tanh",
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        d_input = positive(d_input, "d_input")
        d_hidden = positive(d_hidden, "d_hidden")
        dtype = check_float_dtype(dtype, "Lstm")
        if clip is not None and not float(clip) > 0:
            raise ValueError(f"clip must be a positive number or None; got {clip!r}")
        for name, value in (("gate_activation", gate_activation), ("cell_activation", cell_activation),
                            ("hidden_activation", hidden_activation)):
            _activation(value, name)
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

    def extra_repr(self) -> str:
        bias = self.input_gate.input_transform.bias is not None
        return (f"d_input={self.d_input}, d_hidden={self.d_hidden}, bias={bias}"
                f", batch_first={self.batch_first}, reverse={self.reverse}")


@config
class BiLstmConfig:
    """Configuration of a :class:`BiLstm` (Burn's ``BiLstmConfig``); fields as :class:`LstmConfig`
    without ``reverse``."""

    d_input: int
    d_hidden: int
    bias: bool = True
    initializer: Initializer = RNN_INITIALIZER
    batch_first: bool = True
    clip: Optional[float] = None
    input_forget: bool = False
    gate_activation: str = "sigmoid"
    cell_activation: str = "tanh"
    hidden_activation: str = "tanh"

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "BiLstm":
        """A new :class:`BiLstm` with lazy params on ``device``."""
        return BiLstm(**{f: getattr(self, f) for f in self.__dataclass_fields__}, device=device, dtype=dtype)


class BiLstm(Module):
    """Bidirectional LSTM (Graves & Schmidhuber 2005), Burn's ``BiLstm`` (``rnn/lstm.rs``).

    Sub-modules: ``forward`` and ``reverse``, two batch-first :class:`Lstm` s (params
    ``forward.input_gate.input_transform.weight`` ...; the attribute is named ``forward`` as in
    Burn's record, and the ``forward`` *method* is reached through the class).

    ``forward(x, state=None) -> (output, cell, hidden)``:
        x: ``[batch, seq, d_input]`` (seq first when not ``batch_first``).
        state: an :class:`LstmState` with ``cell``, ``hidden`` of ``[2, batch, d_hidden]``
            (index 0 forward, 1 reverse), or ``None`` for zeros.
        output: ``[batch, seq, 2 * d_hidden]``, the forward direction's hidden state then the
            reverse direction's, per step; ``cell``, ``hidden``: ``[2, batch, d_hidden]``.

    ONNX: two unrolled :class:`Lstm` compositions and a ``Concat``.
    """

    def __init__(self, d_input: int, d_hidden: int, bias: bool = True, *,
                 initializer: Initializer = RNN_INITIALIZER, batch_first: bool = True, clip: Optional[float] = None,
                 input_forget: bool = False, gate_activation: str = "sigmoid", cell_activation: str = "tanh",
                 hidden_activation: str = "tanh", device: "Device | str" = "cpu", dtype: DType = DType.F32):
        common = dict(initializer=initializer, batch_first=True, clip=clip, input_forget=input_forget,
                      gate_activation=gate_activation, cell_activation=cell_activation,
                      hidden_activation=hidden_activation, device=device, dtype=dtype)
        # NOTE: Burn's record names the forward direction ``forward``; the sub-module lives in
        # the instance dict under that name (the traversal reads ``vars``) while the class-level
        # data descriptor below keeps ``bilstm.forward(...)`` the forward pass.
        self.__dict__["forward"] = Lstm(d_input, d_hidden, bias, reverse=False, **common)
        self.reverse = Lstm(d_input, d_hidden, bias, reverse=True, **common)
        self.d_hidden = self.reverse.d_hidden
        self.batch_first = bool(batch_first)

    @property
    def forward_lstm(self) -> Lstm:
        """The forward-direction :class:`Lstm` (record prefix ``forward.``)."""
        return self.__dict__["forward"]

    def _forward(self, x: Tensor, state=None):
        if not self.batch_first:
            x = ops.transpose(x, 0, 1)
        fwd_state = rev_state = None
        if state is not None:
            cell, hidden = tuple(state)
            c0, c1 = (ops.squeeze(c, 0) for c in ops.split(cell, [1, 1], 0))
            h0, h1 = (ops.squeeze(h, 0) for h in ops.split(hidden, [1, 1], 0))
            fwd_state, rev_state = LstmState(c0, h0), LstmState(c1, h1)
        out_f, cell_f, hidden_f = self.forward_lstm.forward(x, fwd_state)
        out_r, cell_r, hidden_r = self.reverse.forward(x, rev_state)
        output = ops.concat([out_f, out_r], 2)
        if not self.batch_first:
            output = ops.transpose(output, 0, 1)
        cell = ops.concat([ops.unsqueeze(cell_f, 0), ops.unsqueeze(cell_r, 0)], 0)
        hidden = ops.concat([ops.unsqueeze(hidden_f, 0), ops.unsqueeze(hidden_r, 0)], 0)
        return output, cell, hidden

    def extra_repr(self) -> str:
        return f"d_input={self.reverse.d_input}, d_hidden={self.d_hidden}, batch_first={self.batch_first}"


class _ForwardMethod:
    """A data descriptor: ``obj.forward`` is the bound forward pass, while ``obj.forward = m``
    (the traversal's copies) stores the sub-module in the instance dict."""

    def __get__(self, obj, owner=None):
        return self if obj is None else obj._forward

    def __set__(self, obj, value):
        obj.__dict__["forward"] = value


BiLstm.forward = _ForwardMethod()


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
    """

    d_input: int
    d_hidden: int
    bias: bool = True
    reset_after: bool = True
    initializer: Initializer = RNN_INITIALIZER
    gate_activation: str = "sigmoid"
    hidden_activation: str = "tanh"
    clip: Optional[float] = None

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Gru":
        """A new :class:`Gru` with lazy params on ``device``."""
        return Gru(**{f: getattr(self, f) for f in self.__dataclass_fields__}, device=device, dtype=dtype)


class Gru(Module):
    """Gated recurrent unit (Cho et al. 2014), Burn's ``Gru`` (``burn-nn/src/modules/rnn/gru.rs``)::

        z = σ(x W_iz + b_iz + h W_hz + b_hz)                  (update_gate)
        r = σ(x W_ir + b_ir + h W_hr + b_hr)                  (reset_gate)
        n = tanh(x W_in + b_in + r * (h W_hn + b_hn))         (new_gate, reset_after)
        n = tanh(x W_in + b_in + (r * h) W_hn + b_hn)         (new_gate, not reset_after)
        h' = (1 - z) * n + z * h   (clamped to ±clip if set)

    Params: ``{update,reset,new}_gate.{input_transform,hidden_transform}.{weight,bias}``;
    PyTorch's ``nn.GRU`` packs gates r, z, n (:mod:`onnxparam.convert.torch_layers`).

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
                 hidden_activation: str = "tanh", clip: Optional[float] = None,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        d_input = positive(d_input, "d_input")
        d_hidden = positive(d_hidden, "d_hidden")
        dtype = check_float_dtype(dtype, "Gru")
        if clip is not None and not float(clip) > 0:
            raise ValueError(f"clip must be a positive number or None; got {clip!r}")
        _activation(gate_activation, "gate_activation")
        _activation(hidden_activation, "hidden_activation")
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

    def extra_repr(self) -> str:
        return (f"d_input={self.d_input}, d_hidden={self.d_hidden}, "
                f"bias={self.update_gate.input_transform.bias is not None}, reset_after={self.reset_after}")


@config
class BiGruConfig:
    """Configuration of a :class:`BiGru` (Burn's ``BiGruConfig``); fields as :class:`GruConfig`
    plus ``batch_first``."""

    d_input: int
    d_hidden: int
    bias: bool = True
    reset_after: bool = True
    initializer: Initializer = RNN_INITIALIZER
    batch_first: bool = True
    gate_activation: str = "sigmoid"
    hidden_activation: str = "tanh"
    clip: Optional[float] = None

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "BiGru":
        """A new :class:`BiGru` with lazy params on ``device``."""
        return BiGru(**{f: getattr(self, f) for f in self.__dataclass_fields__}, device=device, dtype=dtype)


class BiGru(Module):
    """Bidirectional GRU, Burn's ``BiGru`` (``rnn/gru.rs``): sub-modules ``forward`` and
    ``reverse`` (two :class:`Gru` s; params ``forward.update_gate.input_transform.weight`` ...).

    ``forward(x, state=None) -> (output, hidden)``:
        x: ``[batch, seq, d_input]`` (seq first when not ``batch_first``).
        state: ``[2, batch, d_hidden]`` (0 forward, 1 reverse) or ``None`` (zeros).
        output: ``[batch, seq, 2 * d_hidden]``, forward then reverse direction per step;
        hidden: the final states ``[2, batch, d_hidden]``.

    PyTorch's bidirectional ``nn.GRU`` maps with :func:`onnxparam.convert.torch_layers.gru_from_torch`.
    """

    def __init__(self, d_input: int, d_hidden: int, bias: bool = True, *, reset_after: bool = True,
                 initializer: Initializer = RNN_INITIALIZER, batch_first: bool = True, gate_activation: str = "sigmoid",
                 hidden_activation: str = "tanh", clip: Optional[float] = None,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        common = dict(reset_after=reset_after, initializer=initializer, gate_activation=gate_activation,
                      hidden_activation=hidden_activation, clip=clip, device=device, dtype=dtype)
        self.__dict__["forward"] = Gru(d_input, d_hidden, bias, **common)  # see BiLstm's NOTE
        self.reverse = Gru(d_input, d_hidden, bias, **common)
        self.d_hidden = self.reverse.d_hidden
        self.batch_first = bool(batch_first)

    @property
    def forward_gru(self) -> Gru:
        """The forward-direction :class:`Gru` (record prefix ``forward.``)."""
        return self.__dict__["forward"]

    def _forward(self, x: Tensor, state: Optional[Tensor] = None):
        if not self.batch_first:
            x = ops.transpose(x, 0, 1)
        h_f = h_r = None
        if state is not None:
            h_f, h_r = (ops.squeeze(h, 0) for h in ops.split(state, [1, 1], 0))
        out_f, last_f = self.forward_gru.run(x, h_f)
        out_r, last_r = self.reverse.run(x, h_r, reverse=True)
        output = ops.concat([out_f, out_r], 2)
        if not self.batch_first:
            output = ops.transpose(output, 0, 1)
        return output, ops.concat([ops.unsqueeze(last_f, 0), ops.unsqueeze(last_r, 0)], 0)

    def extra_repr(self) -> str:
        return f"d_input={self.reverse.d_input}, d_hidden={self.d_hidden}, batch_first={self.batch_first}"


BiGru.forward = _ForwardMethod()
