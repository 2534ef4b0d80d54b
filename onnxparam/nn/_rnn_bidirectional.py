"""Bidirectional recurrent layers: ``BiLstm`` and ``BiGru`` (Burn's ``rnn/lstm.rs`` and
``rnn/gru.rs``): a ``forward`` and a ``reverse`` direction, concatenated per step.

Burn's records name the forward direction ``forward`` (``forward.input_gate.input_transform.weight``
...). NOTE: in Python that name is also the module's forward pass, so the sub-module lives in
the instance dict under ``forward`` (the traversal reads ``vars``: records, ids, ONNX initializer
names are Burn's) while a class-level data descriptor keeps ``layer.forward(...)`` the forward
pass; ``forward_lstm`` / ``forward_gru`` return the sub-module.
"""

from __future__ import annotations

from typing import Optional

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import derived_config, layer_from_config
from ._initializer import Initializer
from ._rnn import RNN_INITIALIZER, Gru, GruConfig, Lstm, LstmConfig, LstmState

__all__ = ["BiLstm", "BiLstmConfig", "BiGru", "BiGruConfig"]


class _ForwardMethod:
    """A data descriptor: ``obj.forward`` is the bound forward pass, while ``obj.forward = m``
    (the traversal's copies) stores the sub-module in the instance dict."""

    def __get__(self, obj, owner=None):
        return self if obj is None else obj._forward

    def __set__(self, obj, value):
        obj.__dict__["forward"] = value


def _init_bilstm(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "BiLstm":
    """A new :class:`BiLstm` with lazy params on ``device``."""
    return layer_from_config(self, BiLstm, device=device, dtype=dtype)


BiLstmConfig = derived_config("BiLstmConfig", LstmConfig, __name__, """Configuration of a :class:`BiLstm` (Burn's ``BiLstmConfig``): the fields of
    :class:`~onnxparam.nn.LstmConfig`, in its order and with its defaults, without ``reverse``
    (``d_input``, ``d_hidden``, ``bias``, ``initializer``, ``batch_first``, ``clip``,
    ``input_forget``, ``gate_activation``, ``cell_activation``, ``hidden_activation``,
    ``onnx_op``).""", drop=("reverse",), methods={"init": _init_bilstm})


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
                 hidden_activation: str = "tanh", onnx_op: bool = False,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        common = dict(initializer=initializer, batch_first=True, clip=clip, input_forget=input_forget,
                      gate_activation=gate_activation, cell_activation=cell_activation,
                      hidden_activation=hidden_activation, onnx_op=onnx_op, device=device, dtype=dtype)
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


BiLstm.forward = _ForwardMethod()


def _init_bigru(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "BiGru":
    """A new :class:`BiGru` with lazy params on ``device``."""
    return layer_from_config(self, BiGru, device=device, dtype=dtype)


BiGruConfig = derived_config("BiGruConfig", GruConfig, __name__, """Configuration of a :class:`BiGru` (Burn's ``BiGruConfig``): the fields of
    :class:`~onnxparam.nn.GruConfig`, in its order and with its defaults, plus ``batch_first``
    (``True``) after ``initializer`` (``d_input``, ``d_hidden``, ``bias``, ``reset_after``,
    ``initializer``, ``batch_first``, ``gate_activation``, ``hidden_activation``, ``clip``,
    ``onnx_op``).""", insert_after={"initializer": [("batch_first", "bool", True)]}, methods={"init": _init_bigru})


class BiGru(Module):
    """Bidirectional GRU, Burn's ``BiGru`` (``rnn/gru.rs``): sub-modules ``forward`` and
    ``reverse`` (two :class:`Gru` s; params ``forward.update_gate.input_transform.weight`` ...).

    ``forward(x, state=None) -> (output, hidden)``:
        x: ``[batch, seq, d_input]`` (seq first when not ``batch_first``).
        state: ``[2, batch, d_hidden]`` (0 forward, 1 reverse) or ``None`` (zeros).
        output: ``[batch, seq, 2 * d_hidden]``, forward then reverse direction per step;
        hidden: the final states ``[2, batch, d_hidden]``.

    PyTorch's bidirectional ``nn.GRU`` maps with :func:`onnxparam.convert._torch_layers.gru_from_torch`.
    """

    def __init__(self, d_input: int, d_hidden: int, bias: bool = True, *, reset_after: bool = True,
                 initializer: Initializer = RNN_INITIALIZER, batch_first: bool = True, gate_activation: str = "sigmoid",
                 hidden_activation: str = "tanh", clip: Optional[float] = None, onnx_op: bool = False,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        common = dict(reset_after=reset_after, initializer=initializer, gate_activation=gate_activation,
                      hidden_activation=hidden_activation, clip=clip, onnx_op=onnx_op, device=device, dtype=dtype)
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
