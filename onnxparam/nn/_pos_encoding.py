"""Positional encodings: sinusoidal ``PositionalEncoding`` and ``RotaryEncoding`` (RoPE)
(Burn's ``burn-nn/src/modules/pos_encoding.rs`` and ``rope_encoding.rs``).

Neither has params: their tables are computed from the config (float64, then cast) and enter
the graph as constants, as Burn keeps them as non-param tensors. The sequence length is static
(the table is sliced at trace time); the batch size is never baked in.
"""

from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config, positive

__all__ = [
    "PositionalEncoding", "PositionalEncodingConfig", "RotaryEncoding", "RotaryEncodingConfig", "generate_sinusoids",
]


def generate_sinusoids(length: int, d_model: int, max_timescale: int = 10_000) -> np.ndarray:
    """The sinusoid table ``[length, d_model]`` float64 of Vaswani et al. 2017 (Burn's
    ``generate_sinusoids``): for even ``k``, ``pe[i, k] = sin(i * w_k)``, ``pe[i, k + 1] =
    cos(i * w_k)``, ``w_k = exp(-k * ln(max_timescale) / d_model)``.

    Raises:
        ValueError: for an odd ``d_model`` or ``max_timescale < length`` (Burn's checks).
    """
    length, d_model = int(length), positive(d_model, "d_model")
    if d_model % 2:
        raise ValueError(f"d_model must be even for sinusoids; got {d_model}")
    if max_timescale < length:
        raise ValueError(f"max_timescale ({max_timescale}) must be >= the sequence length ({length})")
    k = np.arange(0, d_model, 2, dtype=np.float64)
    w = np.exp(k * (-math.log(max_timescale) / d_model))
    angles = np.arange(length, dtype=np.float64)[:, None] * w[None, :]
    table = np.empty((length, d_model))
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return table


@config
class PositionalEncodingConfig:
    """Configuration of a :class:`PositionalEncoding` (Burn's ``PositionalEncodingConfig``;
    Burn's field order puts ``max_sequence_size`` first with a default, so here ``d_model``
    comes first)."""

    d_model: int
    max_sequence_size: int = 5_000
    max_timescale: int = 10_000

    def init(self, device=None) -> "PositionalEncoding":
        """A new :class:`PositionalEncoding` (no params; ``device`` is accepted for symmetry)."""
        return PositionalEncoding(self.d_model, self.max_sequence_size, self.max_timescale)


class PositionalEncoding(Module):
    """Adds the sinusoid table to ``x [batch, seq, d_model]`` (Burn's ``PositionalEncoding``).

    No params: the table (Burn's ``sinusoids``) is a graph constant of ``x``'s dtype.
    ONNX: ``Add`` with a ``[1, seq, d_model]`` constant.

    Raises:
        ValueError: at construction as :func:`generate_sinusoids`; in forward, for an input that
            is not ``[batch, seq, d_model]`` or longer than ``max_sequence_size``.
    """

    def __init__(self, d_model: int, max_sequence_size: int = 5_000, max_timescale: int = 10_000):
        self.max_sequence_size = positive(max_sequence_size, "max_sequence_size")
        self.max_timescale = positive(max_timescale, "max_timescale")
        self._sinusoids = generate_sinusoids(self.max_sequence_size, d_model, self.max_timescale)
        self.d_model = int(d_model)

    def forward(self, x: Tensor) -> Tensor:
        if x.rank != 3 or x.shape[2] != self.d_model:
            raise ValueError(f"PositionalEncoding expects [batch, seq, {self.d_model}]; got shape {list(x.shape)}")
        seq = x.shape[1]
        if not isinstance(seq, int):
            raise ValueError(f"PositionalEncoding needs a static sequence length; got {seq!r}")
        if seq > self.max_sequence_size:
            raise ValueError(f"sequence length {seq} exceeds max_sequence_size={self.max_sequence_size}")
        table = self._sinusoids[None, :seq].astype(x.dtype.to_numpy())
        return ops.add(x, table)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_sequence_size={self.max_sequence_size}, max_timescale={self.max_timescale}"


@config
class RotaryEncodingConfig:
    """Configuration of a :class:`RotaryEncoding` (Burn's ``RotaryEncodingConfig``).

    Args:
        max_sequence_length: the longest sequence (positions ``0..max_sequence_length``).
        d_model: the rotated width (even).
        theta: the frequency base (default ``10000``).
    """

    max_sequence_length: int
    d_model: int
    theta: float = 10000.0

    def init(self, device=None) -> "RotaryEncoding":
        """A new :class:`RotaryEncoding` (no params)."""
        return RotaryEncoding(self.max_sequence_length, self.d_model, self.theta)


class RotaryEncoding(Module):
    """Rotary position embedding (Su et al. 2021, RoFormer), Burn's ``RotaryEncoding``.

    Adjacent pairs ``(x[2i], x[2i+1])`` at position ``p`` are rotated by ``p * w_i``,
    ``w_i = theta ** (-2i / d_model)``::

        y[2i]   = x[2i] cos(p w_i) - x[2i+1] sin(p w_i)
        y[2i+1] = x[2i] sin(p w_i) + x[2i+1] cos(p w_i)

    ``forward(x, start=0)``: ``x [..., seq, d_model]`` (rank >= 2, e.g. ``[batch, heads, seq,
    d_head]``), positions ``start .. start + seq``; same shape out. No params; the cos / sin
    tables are graph constants. ONNX: ``Reshape``, ``Split``, ``Neg``, ``Concat``, ``Mul``, ``Add``.

    Raises:
        ValueError: for an odd ``d_model``, ``theta <= 0``, or positions past
            ``max_sequence_length``.
    """

    def __init__(self, max_sequence_length: int, d_model: int, theta: float = 10000.0):
        self.max_sequence_length = positive(max_sequence_length, "max_sequence_length")
        self.d_model = positive(d_model, "d_model")
        if self.d_model % 2:
            raise ValueError(f"RotaryEncoding needs an even d_model; got {d_model}")
        if not float(theta) > 0:
            raise ValueError(f"theta must be positive; got {theta!r}")
        self.theta = float(theta)
        w = np.exp(-(np.arange(0, self.d_model, 2, dtype=np.float64) / self.d_model) * math.log(self.theta))
        angles = np.arange(self.max_sequence_length, dtype=np.float64)[:, None] * w[None, :]
        self._cos = np.repeat(np.cos(angles), 2, axis=1)        # [max_seq, d_model]
        self._sin = np.repeat(np.sin(angles), 2, axis=1)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        if x.rank < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"RotaryEncoding expects [..., seq, {self.d_model}]; got shape {list(x.shape)}")
        seq, start = x.shape[-2], int(start)
        if not isinstance(seq, int):
            raise ValueError(f"RotaryEncoding needs a static sequence length; got {seq!r}")
        if start < 0 or start + seq > self.max_sequence_length:
            raise ValueError(f"positions {start}..{start + seq} exceed max_sequence_length={self.max_sequence_length}")
        dtype = x.dtype.to_numpy()
        cos = self._cos[start:start + seq].astype(dtype)
        sin = self._sin[start:start + seq].astype(dtype)
        keep = [0] * (x.rank - 1)
        pairs = ops.reshape(x, keep + [self.d_model // 2, 2])
        even, odd = ops.split(pairs, [1, 1], -1)
        rotated = ops.reshape(ops.concat([ops.neg(odd), even], -1), keep + [self.d_model])  # (-x1, x0)
        return ops.add(ops.mul(x, cos), ops.mul(rotated, sin))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_sequence_length={self.max_sequence_length}, theta={self.theta:g}"
