"""Attention: ``MultiHeadAttention`` and ``CrossAttention`` (Burn's
``burn-nn/src/modules/attention/{mha,cross_attention,mask}.rs``; Vaswani et al. 2017).

The forwards are compositions of ``MatMul`` / ``Reshape`` / ``Transpose`` / ``Softmax`` (or
:func:`onnxparam.ops.quiet_softmax`) / ``Where``, all with gradient rules, so the layers train.
NOTE: ONNX's ``Attention`` operator (opset 23) is not used: the tracer emits opset 21 by
default, and Burn's masking (``mask_fill`` with ``min_float`` rather than ``-inf``) and its
dropout on the scores would not map onto it exactly. Reshapes use ``0`` (copy the dim), so the
batch size and the sequence lengths are never baked into the graph by these layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import check_float_dtype, config, layer_from_config, positive
from ._dropout import Dropout
from ._initializer import DEFAULT_INITIALIZER, Initializer
from ._linear import Linear

__all__ = [
    "MhaInput", "MhaOutput", "MultiHeadAttention", "MultiHeadAttentionConfig", "CrossAttention",
    "CrossAttentionConfig", "generate_autoregressive_mask", "generate_padding_mask", "DEFAULT_MIN_FLOAT",
]

DEFAULT_MIN_FLOAT = -1.0e4
"""Burn's default ``min_float``: the score written where a mask is true. Finite (not ``-inf``)
so that a fully masked row stays finite, and representable in f16 / bf16."""


class MhaInput(NamedTuple):
    """The input of :class:`MultiHeadAttention` (Burn's ``MhaInput``).

    Fields:
        query: ``[batch, seq_1, d_model]``.
        key, value: ``[batch, seq_2, d_model]``.
        mask_pad: ``[batch, seq_2]`` bool, true at padded key positions, or ``None``.
        mask_attn: ``[batch, seq_1, seq_2]`` bool (a batch of 1 broadcasts), true where a
            query may not attend, or ``None``.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    mask_pad: Optional[Tensor] = None
    mask_attn: Optional[Tensor] = None

    @classmethod
    def self_attn(cls, x: Tensor) -> "MhaInput":
        """Query, key and value all ``x``."""
        return cls(x, x, x)

    def with_mask_pad(self, mask_pad: Tensor) -> "MhaInput":
        return self._replace(mask_pad=mask_pad)

    def with_mask_attn(self, mask_attn: Tensor) -> "MhaInput":
        return self._replace(mask_attn=mask_attn)


class MhaOutput(NamedTuple):
    """The output of :class:`MultiHeadAttention` (Burn's ``MhaOutput``): ``context``
    ``[batch, seq_1, d_model]`` and the attention ``weights`` ``[batch, n_heads, seq_1, seq_2]``.
    A module call returns it as a plain ``(context, weights)`` tuple."""

    context: Tensor
    weights: Tensor


def generate_autoregressive_mask(batch_size: int, seq_length: int) -> Tensor:
    """A causal mask ``[batch_size, seq_length, seq_length]`` bool, true above the diagonal
    (position ``i`` may attend to ``j <= i``), as Burn's ``generate_autoregressive_mask``."""
    mask = np.triu(np.ones((seq_length, seq_length), dtype=bool), k=1)
    return Tensor.from_numpy(np.ascontiguousarray(np.broadcast_to(mask, (int(batch_size), seq_length, seq_length))))


def generate_padding_mask(lengths, seq_length: int) -> Tensor:
    """A padding mask ``[len(lengths), seq_length]`` bool, true at positions ``>= lengths[b]``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return Tensor.from_numpy(np.arange(int(seq_length))[None, :] >= lengths[:, None])


def _heads(x: Tensor, n_heads: int, d_head: int) -> Tensor:
    """``[batch, seq, n_heads * d_head]`` -> ``[batch, n_heads, seq, d_head]``."""
    return ops.transpose(ops.reshape(x, [0, 0, n_heads, d_head]), 1, 2)


def _merge_heads(x: Tensor, width: int) -> Tensor:
    """``[batch, n_heads, seq, d_head]`` -> ``[batch, seq, n_heads * d_head]``."""
    return ops.reshape(ops.transpose(x, 1, 2), [0, 0, width])


def _softmax(scores: Tensor, quiet: bool) -> Tensor:
    return ops.quiet_softmax(scores, -1) if quiet else ops.softmax(scores, -1)


def _check_rank3(x: Tensor, name: str, what: str, d: int) -> None:
    if x.rank != 3:
        raise ValueError(f"{what} expects {name} of rank 3 [batch, seq, {d}]; got shape {list(x.shape)}")
    if isinstance(x.shape[2], int) and x.shape[2] != d:
        raise ValueError(f"{what} expects {name} with {d} features in the last dim; got shape {list(x.shape)}")


@config
class MultiHeadAttentionConfig:
    """Configuration of a :class:`MultiHeadAttention` (Burn's ``MultiHeadAttentionConfig``).

    Args:
        d_model: model width (every Linear is ``d_model -> d_model``).
        n_heads: heads; must divide ``d_model`` (``d_k = d_model / n_heads``).
        dropout: dropout probability on the attention scores (Burn's placement: before the
            softmax); the identity at inference.
        min_float: the score written at masked positions (Burn's default ``-1e4``).
        quiet_softmax: use :func:`onnxparam.ops.quiet_softmax` instead of softmax.
        initializer: for the Linears; Burn's default ``KaimingUniform(gain=1/sqrt(3))``.
        enable_query_bias, enable_key_bias, enable_value_bias, enable_output_bias: Linear biases.
    """

    d_model: int
    n_heads: int
    dropout: float = 0.1
    min_float: float = DEFAULT_MIN_FLOAT
    quiet_softmax: bool = False
    initializer: Initializer = DEFAULT_INITIALIZER
    enable_key_bias: bool = True
    enable_value_bias: bool = True
    enable_query_bias: bool = True
    enable_output_bias: bool = True

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "MultiHeadAttention":
        """A new :class:`MultiHeadAttention` with lazy params on ``device``."""
        return layer_from_config(self, MultiHeadAttention, device=device, dtype=dtype)


class MultiHeadAttention(Module):
    """Multi-head attention (Vaswani et al. 2017), Burn's ``MultiHeadAttention``::

        Q, K, V = split_heads(query W_q + b_q), split_heads(key W_k + b_k), split_heads(value W_v + b_v)
        S = dropout(Q K^T / sqrt(d_k));  S[mask] = min_float   (mask_pad, then mask_attn)
        weights = softmax(S) (or quiet_softmax);  context = merge_heads(weights V) W_o + b_o

    Params (Burn's names): ``query``, ``key``, ``value``, ``output``, each a
    :class:`~onnxparam.nn.Linear` ``(d_model, d_model)`` (in, out); PyTorch's
    ``nn.MultiheadAttention`` packs the first three as ``in_proj_weight (3E, E)``
    (:mod:`onnxparam.convert._torch_layers`).

    ``forward(query, key=None, value=None, mask_pad=None, mask_attn=None) -> (context, weights)``:
        query ``[batch, seq_1, d_model]``; key / value ``[batch, seq_2, d_model]`` (default: the
        query, i.e. self-attention); masks as in :class:`MhaInput`. An :class:`MhaInput` as the
        first argument is accepted too (inside a traced forward). Returns :class:`MhaOutput`
        (a plain tuple from a module call).

    Raises:
        ValueError: when ``n_heads`` does not divide ``d_model``, for a non-float dtype, or for
            inputs that are not ``[batch, seq, d_model]``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, min_float: float = DEFAULT_MIN_FLOAT,
                 quiet_softmax: bool = False, initializer: Initializer = DEFAULT_INITIALIZER,
                 enable_key_bias: bool = True, enable_value_bias: bool = True, enable_query_bias: bool = True,
                 enable_output_bias: bool = True, *, device: "Device | str" = "cpu", dtype: DType = DType.F32):
        d_model = positive(d_model, "d_model")
        n_heads = positive(n_heads, "n_heads")
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        check_float_dtype(dtype, "MultiHeadAttention")

        def linear(bias):
            return Linear(d_model, d_model, bias, initializer=initializer, device=device, dtype=dtype)

        self.query = linear(enable_query_bias)
        self.key = linear(enable_key_bias)
        self.value = linear(enable_value_bias)
        self.output = linear(enable_output_bias)
        self.dropout = Dropout(dropout)
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.min_float = float(min_float)
        self.quiet_softmax = bool(quiet_softmax)

    def forward(self, query, key=None, value=None, mask_pad=None, mask_attn=None):
        if isinstance(query, MhaInput):
            query, key, value, mask_pad, mask_attn = query
        key = query if key is None else key
        value = key if value is None else value
        for name, t in (("query", query), ("key", key), ("value", value)):
            _check_rank3(t, name, "MultiHeadAttention", self.d_model)
        q = _heads(self.query(query), self.n_heads, self.d_k)
        k = _heads(self.key(key), self.n_heads, self.d_k)
        v = _heads(self.value(value), self.n_heads, self.d_k)
        scores = ops.div(ops.matmul(q, ops.transpose(k, 2, 3)), math.sqrt(self.d_k))
        scores = self.dropout(scores)
        if mask_pad is not None:  # [batch, seq_2] -> [batch, 1, 1, seq_2]
            scores = ops.mask_fill(scores, ops.unsqueeze(mask_pad, [1, 2]), self.min_float)
        if mask_attn is not None:  # [batch, seq_1, seq_2] -> [batch, 1, seq_1, seq_2]
            scores = ops.mask_fill(scores, ops.unsqueeze(mask_attn, [1]), self.min_float)
        weights = _softmax(scores, self.quiet_softmax)
        context = self.output(_merge_heads(ops.matmul(weights, v), self.d_model))
        return MhaOutput(context, weights)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, d_k={self.d_k}, dropout={self.dropout.prob:g}, "
                f"min_float={self.min_float:g}, quiet_softmax={self.quiet_softmax}")


@config
class CrossAttentionConfig:
    """Configuration of a :class:`CrossAttention` (Burn's ``CrossAttentionConfig``).

    Args:
        d_model: query width (and output width).
        d_context: context (key / value source) width.
        n_heads: query heads.
        n_heads_kv: key / value heads; must divide ``n_heads`` (1: multi-query attention,
            ``n_heads``: plain multi-head; else grouped-query attention).
        d_head: width of one head.
        dropout: dropout probability on the attention weights (Burn's placement here: after
            the softmax); the identity at inference.
        min_float: the score at masked positions.
        quiet_softmax: use :func:`onnxparam.ops.quiet_softmax`.
    """

    d_model: int
    d_context: int
    n_heads: int
    n_heads_kv: int
    d_head: int
    dropout: float = 0.1
    min_float: float = DEFAULT_MIN_FLOAT
    quiet_softmax: bool = False

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "CrossAttention":
        """A new :class:`CrossAttention` with lazy params on ``device``."""
        return layer_from_config(self, CrossAttention, device=device, dtype=dtype)


class CrossAttention(Module):
    """Cross-attention with grouped-query heads, Burn's ``CrossAttention``
    (``attention/cross_attention.rs``): the query attends over a context of another width.

    Params (Burn's names): ``query (d_model, n_heads * d_head)``, ``key`` and ``value``
    ``(d_context, n_heads_kv * d_head)``, ``output (n_heads * d_head, d_model)``, each with a
    bias; initializer ``KaimingUniform(gain=1/sqrt(d_head))`` as Burn's.

    ``forward(query, context, mask=None) -> [batch, seq_q, d_model]``: query
    ``[batch, seq_q, d_model]``, context ``[batch, seq_k, d_context]``, mask ``[batch, seq_k]``
    bool (true: masked). Each key / value head serves ``n_heads / n_heads_kv`` query heads
    (repeated with ``Concat``).

    Raises:
        ValueError: when ``n_heads_kv`` does not divide ``n_heads``, or for mis-shaped inputs.
    """

    def __init__(self, d_model: int, d_context: int, n_heads: int, n_heads_kv: int, d_head: int,
                 dropout: float = 0.1, min_float: float = DEFAULT_MIN_FLOAT, quiet_softmax: bool = False, *,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        d_model, d_context = positive(d_model, "d_model"), positive(d_context, "d_context")
        n_heads, n_heads_kv = positive(n_heads, "n_heads"), positive(n_heads_kv, "n_heads_kv")
        d_head = positive(d_head, "d_head")
        if n_heads % n_heads_kv:
            raise ValueError(f"n_heads_kv={n_heads_kv} must divide n_heads={n_heads} (query heads per key/value head)")
        check_float_dtype(dtype, "CrossAttention")
        init = Initializer.KaimingUniform(gain=1.0 / math.sqrt(d_head), fan_out_only=False)

        def linear(d_in, d_out):
            return Linear(d_in, d_out, True, initializer=init, device=device, dtype=dtype)

        self.query = linear(d_model, n_heads * d_head)
        self.key = linear(d_context, n_heads_kv * d_head)
        self.value = linear(d_context, n_heads_kv * d_head)
        self.output = linear(n_heads * d_head, d_model)
        self.dropout = Dropout(dropout)
        self.d_model, self.d_context = d_model, d_context
        self.n_heads, self.n_heads_kv, self.d_head = n_heads, n_heads_kv, d_head
        self.min_float = float(min_float)
        self.quiet_softmax = bool(quiet_softmax)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """``[b, h_kv, l, d]`` -> ``[b, h_kv * n_rep, l, d]``, each head repeated in place."""
        n_rep = self.n_heads // self.n_heads_kv
        if n_rep == 1:
            return x
        x = ops.unsqueeze(x, 2)  # [b, h_kv, 1, l, d]
        x = ops.concat([x] * n_rep, 2)
        return ops.reshape(x, [0, self.n_heads, -1, self.d_head])

    def forward(self, query: Tensor, context: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        _check_rank3(query, "query", "CrossAttention", self.d_model)
        _check_rank3(context, "context", "CrossAttention", self.d_context)
        q = _heads(self.query(query), self.n_heads, self.d_head)
        k = self._repeat_kv(_heads(self.key(context), self.n_heads_kv, self.d_head))
        v = self._repeat_kv(_heads(self.value(context), self.n_heads_kv, self.d_head))
        scores = ops.mul(ops.matmul(q, ops.transpose(k, 2, 3)), 1.0 / math.sqrt(self.d_head))
        if mask is not None:
            scores = ops.mask_fill(scores, ops.unsqueeze(mask, [1, 2]), self.min_float)
        weights = self.dropout(_softmax(scores, self.quiet_softmax))
        return self.output(_merge_heads(ops.matmul(weights, v), self.n_heads * self.d_head))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_context={self.d_context}, n_heads={self.n_heads}, "
                f"n_heads_kv={self.n_heads_kv}, d_head={self.d_head}")
