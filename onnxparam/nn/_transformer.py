"""Transformer blocks: ``PositionWiseFeedForward``, ``TransformerEncoder`` and
``TransformerDecoder`` with their layers (Burn's ``burn-nn/src/modules/transformer/``;
Vaswani et al. 2017).

Record names are Burn's: ``layers.<i>.mha.*``, ``layers.<i>.pwff.linear_inner.*``,
``layers.<i>.pwff.linear_outer.*``, ``layers.<i>.norm_1.{gamma,beta}``, ``layers.<i>.norm_2.*``
(and ``self_attn`` / ``cross_attn`` / ``norm_3`` in decoder layers). Note Burn's norm naming:
in a post-norm (``norm_first=False``) encoder layer ``norm_1`` follows attention and ``norm_2``
the feed-forward; in a pre-norm layer ``norm_2`` precedes attention and ``norm_1`` the
feed-forward (``encoder.rs``).

Dropouts are the identity at inference (as :class:`~onnxparam.nn.Dropout`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._attention import MhaInput, MultiHeadAttention
from ._config import config, layer_from_config, positive
from ._dropout import Dropout
from ._initializer import DEFAULT_INITIALIZER, Initializer
from ._linear import Linear
from ._norm import LayerNorm

__all__ = [
    "PositionWiseFeedForward", "PositionWiseFeedForwardConfig",
    "TransformerEncoder", "TransformerEncoderConfig", "TransformerEncoderLayer", "TransformerEncoderInput",
    "TransformerDecoder", "TransformerDecoderConfig", "TransformerDecoderLayer", "TransformerDecoderInput",
]

LAYER_NORM_EPS = 1e-5
"""Burn's default ``layer_norm_eps`` of the transformer configs."""

_ACTIVATIONS = {"gelu": ops.gelu, "relu": ops.relu}


def _activation(name: str):
    try:
        return _ACTIVATIONS[str(name).lower()]
    except KeyError:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}; got {name!r}") from None


@config
class PositionWiseFeedForwardConfig:
    """Configuration of a :class:`PositionWiseFeedForward` (Burn's ``PositionWiseFeedForwardConfig``).

    Args:
        d_model: input and output width.
        d_ff: inner width.
        dropout: after the activation (identity at inference).
        initializer: Burn's default ``KaimingUniform(gain=1/sqrt(3))``.
        activation: ``"gelu"`` (Burn's default, the exact erf form) or ``"relu"``.
    """

    d_model: int
    d_ff: int
    dropout: float = 0.1
    initializer: Initializer = DEFAULT_INITIALIZER
    activation: str = "gelu"

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "PositionWiseFeedForward":
        """A new :class:`PositionWiseFeedForward` with lazy params on ``device``."""
        return layer_from_config(self, PositionWiseFeedForward, device=device, dtype=dtype)


class PositionWiseFeedForward(Module):
    """``linear_outer(dropout(act(linear_inner(x))))`` (Burn's ``PositionWiseFeedForward``, ``pwff.rs``).

    Params: ``linear_inner (d_model, d_ff)``, ``linear_outer (d_ff, d_model)`` (+ biases); the
    activation has no record (Burn skips it). Shapes: ``[..., d_model] -> [..., d_model]``.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1,
                 initializer: Initializer = DEFAULT_INITIALIZER, activation: str = "gelu", *,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        _activation(activation)
        self.linear_inner = Linear(d_model, d_ff, initializer=initializer, device=device, dtype=dtype)
        self.linear_outer = Linear(d_ff, d_model, initializer=initializer, device=device, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.activation = str(activation).lower()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_outer(self.dropout(_activation(self.activation)(self.linear_inner(x))))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class TransformerEncoderInput(NamedTuple):
    """Burn's ``TransformerEncoderInput``: ``tensor [batch, seq, d_model]``, optional
    ``mask_pad [batch, seq]`` and ``mask_attn [batch, seq, seq]`` (bool, true: masked)."""

    tensor: Tensor
    mask_pad: Optional[Tensor] = None
    mask_attn: Optional[Tensor] = None


@config
class TransformerEncoderConfig:
    """Configuration of a :class:`TransformerEncoder` (Burn's ``TransformerEncoderConfig``).

    Args:
        d_model, d_ff, n_heads, n_layers: sizes.
        dropout: the shared dropout rate; ``attention_dropout``, ``ffn_dropout`` and
            ``residual_dropout`` override it per stage when not ``None``.
        norm_first: pre-norm layers (``True``) or post-norm (Burn's default ``False``).
        quiet_softmax: in the attention.
        initializer: for every Linear.
        activation: of the feed-forward, ``"gelu"`` (default) or ``"relu"``.
        layer_norm_eps: epsilon of every LayerNorm (default ``1e-5``).
    """

    d_model: int
    d_ff: int
    n_heads: int
    n_layers: int
    dropout: float = 0.1
    attention_dropout: Optional[float] = None
    ffn_dropout: Optional[float] = None
    residual_dropout: Optional[float] = None
    norm_first: bool = False
    quiet_softmax: bool = False
    initializer: Initializer = DEFAULT_INITIALIZER
    activation: str = "gelu"
    layer_norm_eps: float = LAYER_NORM_EPS

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "TransformerEncoder":
        """A new :class:`TransformerEncoder` with lazy params on ``device``."""
        return layer_from_config(self, TransformerEncoder, device=device, dtype=dtype)


def _or(value: Optional[float], default: float) -> float:
    return default if value is None else value


class TransformerEncoderLayer(Module):
    """One encoder layer (Burn's ``TransformerEncoderLayer``); built by :class:`TransformerEncoder`.

    Post-norm: ``x = norm_1(x + mha(x)); x = norm_2(x + pwff(x))``.
    Pre-norm: ``x = x + mha(norm_2(x)); x = x + pwff(norm_1(x))``.

    Params: ``mha.*`` (:class:`~onnxparam.nn.MultiHeadAttention`), ``pwff.*``, ``norm_1``,
    ``norm_2`` (:class:`~onnxparam.nn.LayerNorm`).
    """

    def __init__(self, cfg: TransformerEncoderConfig, device, dtype):
        self.mha = MultiHeadAttention(cfg.d_model, cfg.n_heads, _or(cfg.attention_dropout, cfg.dropout),
                                      quiet_softmax=cfg.quiet_softmax, initializer=cfg.initializer,
                                      device=device, dtype=dtype)
        self.pwff = PositionWiseFeedForward(cfg.d_model, cfg.d_ff, _or(cfg.ffn_dropout, cfg.dropout),
                                            cfg.initializer, cfg.activation, device=device, dtype=dtype)
        self.norm_1 = LayerNorm(cfg.d_model, epsilon=cfg.layer_norm_eps, device=device, dtype=dtype)
        self.norm_2 = LayerNorm(cfg.d_model, epsilon=cfg.layer_norm_eps, device=device, dtype=dtype)
        self.dropout = Dropout(_or(cfg.residual_dropout, cfg.dropout))
        self.norm_first = bool(cfg.norm_first)

    def forward(self, x: Tensor, mask_pad: Optional[Tensor] = None, mask_attn: Optional[Tensor] = None) -> Tensor:
        residual = self.norm_2(x) if self.norm_first else x
        attended = self.mha(MhaInput(residual, residual, residual, mask_pad, mask_attn)).context
        x = ops.add(x, self.dropout(attended))
        if self.norm_first:
            residual = self.norm_1(x)
        else:
            x = residual = self.norm_1(x)
        x = ops.add(x, self.dropout(self.pwff(residual)))
        return x if self.norm_first else self.norm_2(x)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"


class TransformerEncoder(Module):
    """A stack of :class:`TransformerEncoderLayer` s (Burn's ``TransformerEncoder``, ``encoder.rs``).

    Params: ``layers.<i>.*``. ``forward(x, mask_pad=None, mask_attn=None)``: ``x``
    ``[batch, seq, d_model]`` float (or a :class:`TransformerEncoderInput`), masks bool as in
    :class:`~onnxparam.nn.MhaInput`; returns ``[batch, seq, d_model]``.

    Raises:
        ValueError: for non-positive sizes, ``n_heads`` not dividing ``d_model``, an unknown
            activation or a non-float dtype.
    """

    def __init__(self, d_model: int, d_ff: int, n_heads: int, n_layers: int, dropout: float = 0.1,
                 attention_dropout: Optional[float] = None, ffn_dropout: Optional[float] = None,
                 residual_dropout: Optional[float] = None, norm_first: bool = False, quiet_softmax: bool = False,
                 initializer: Initializer = DEFAULT_INITIALIZER, activation: str = "gelu",
                 layer_norm_eps: float = LAYER_NORM_EPS, *, device: "Device | str" = "cpu", dtype: DType = DType.F32):
        cfg = TransformerEncoderConfig(d_model, d_ff, n_heads, positive(n_layers, "n_layers"), dropout,
                                       attention_dropout, ffn_dropout, residual_dropout, norm_first, quiet_softmax,
                                       initializer, activation, layer_norm_eps)
        self.layers = [TransformerEncoderLayer(cfg, device, dtype) for _ in range(cfg.n_layers)]
        self.d_model, self.d_ff, self.n_heads, self.n_layers = d_model, d_ff, n_heads, cfg.n_layers
        self.norm_first, self.quiet_softmax = bool(norm_first), bool(quiet_softmax)

    def forward(self, x, mask_pad=None, mask_attn=None) -> Tensor:
        if isinstance(x, TransformerEncoderInput):
            x, mask_pad, mask_attn = x
        for layer in self.layers:
            x = layer(x, mask_pad, mask_attn)
        return x

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, n_heads={self.n_heads}, n_layers={self.n_layers}, "
                f"norm_first={self.norm_first}, quiet_softmax={self.quiet_softmax}")


class TransformerDecoderInput(NamedTuple):
    """Burn's ``TransformerDecoderInput``: ``target [batch, seq_t, d_model]``, ``memory
    [batch, seq_m, d_model]`` and optional bool masks for each (true: masked)."""

    target: Tensor
    memory: Tensor
    target_mask_pad: Optional[Tensor] = None
    target_mask_attn: Optional[Tensor] = None
    memory_mask_pad: Optional[Tensor] = None
    memory_mask_attn: Optional[Tensor] = None


@config
class TransformerDecoderConfig:
    """Configuration of a :class:`TransformerDecoder` (Burn's ``TransformerDecoderConfig``);
    fields as :class:`TransformerEncoderConfig` without the per-stage dropouts."""

    d_model: int
    d_ff: int
    n_heads: int
    n_layers: int
    dropout: float = 0.1
    norm_first: bool = False
    quiet_softmax: bool = False
    initializer: Initializer = DEFAULT_INITIALIZER
    activation: str = "gelu"
    layer_norm_eps: float = LAYER_NORM_EPS

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "TransformerDecoder":
        """A new :class:`TransformerDecoder` with lazy params on ``device``."""
        return layer_from_config(self, TransformerDecoder, device=device, dtype=dtype)


class TransformerDecoderLayer(Module):
    """One decoder layer (Burn's ``TransformerDecoderLayer``, ``decoder.rs``).

    Post-norm: ``x = norm_1(x + self_attn(x)); x = norm_2(x + cross_attn(x, memory));
    x = norm_3(x + pwff(x))``. Pre-norm: ``x += self_attn(norm_3(x)); x += cross_attn(norm_1(x),
    memory); x += pwff(norm_2(x))``.

    Params (Burn's field order): ``cross_attn.*``, ``self_attn.*``, ``pwff.*``, ``norm_1``,
    ``norm_2``, ``norm_3``.
    """

    def __init__(self, cfg: TransformerDecoderConfig, device, dtype):
        def mha():
            return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout, quiet_softmax=cfg.quiet_softmax,
                                      initializer=cfg.initializer, device=device, dtype=dtype)

        self.cross_attn = mha()
        self.self_attn = mha()
        self.pwff = PositionWiseFeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.initializer, cfg.activation,
                                            device=device, dtype=dtype)
        self.norm_1, self.norm_2, self.norm_3 = (
            LayerNorm(cfg.d_model, epsilon=cfg.layer_norm_eps, device=device, dtype=dtype) for _ in range(3))
        self.dropout = Dropout(cfg.dropout)
        self.norm_first = bool(cfg.norm_first)

    def forward(self, inp: TransformerDecoderInput) -> Tensor:
        x = inp.target
        residual = self.norm_3(x) if self.norm_first else x
        attended = self.self_attn(MhaInput(residual, residual, residual, inp.target_mask_pad,
                                           inp.target_mask_attn)).context
        x = ops.add(x, self.dropout(attended))
        if self.norm_first:
            residual = self.norm_1(x)
        else:
            x = residual = self.norm_1(x)
        attended = self.cross_attn(MhaInput(residual, inp.memory, inp.memory, inp.memory_mask_pad,
                                            inp.memory_mask_attn)).context
        x = ops.add(x, self.dropout(attended))
        if self.norm_first:
            residual = self.norm_2(x)
        else:
            x = residual = self.norm_2(x)
        x = ops.add(x, self.dropout(self.pwff(residual)))
        return x if self.norm_first else self.norm_3(x)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"


class TransformerDecoder(Module):
    """A stack of :class:`TransformerDecoderLayer` s (Burn's ``TransformerDecoder``).

    ``forward(target, memory, target_mask_pad=None, target_mask_attn=None, memory_mask_pad=None,
    memory_mask_attn=None)`` (or one :class:`TransformerDecoderInput`): ``target``
    ``[batch, seq_t, d_model]``, ``memory`` ``[batch, seq_m, d_model]``; returns
    ``[batch, seq_t, d_model]``. Causal decoding uses ``target_mask_attn =
    generate_autoregressive_mask(...)``.
    """

    def __init__(self, d_model: int, d_ff: int, n_heads: int, n_layers: int, dropout: float = 0.1,
                 norm_first: bool = False, quiet_softmax: bool = False, initializer: Initializer = DEFAULT_INITIALIZER,
                 activation: str = "gelu", layer_norm_eps: float = LAYER_NORM_EPS, *,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        cfg = TransformerDecoderConfig(d_model, d_ff, n_heads, positive(n_layers, "n_layers"), dropout, norm_first,
                                       quiet_softmax, initializer, activation, layer_norm_eps)
        self.layers = [TransformerDecoderLayer(cfg, device, dtype) for _ in range(cfg.n_layers)]
        self.d_model, self.d_ff, self.n_heads, self.n_layers = d_model, d_ff, n_heads, cfg.n_layers
        self.norm_first, self.quiet_softmax = bool(norm_first), bool(quiet_softmax)

    def forward(self, target, memory=None, target_mask_pad=None, target_mask_attn=None, memory_mask_pad=None,
                memory_mask_attn=None) -> Tensor:
        inp = target if isinstance(target, TransformerDecoderInput) else TransformerDecoderInput(
            target, memory, target_mask_pad, target_mask_attn, memory_mask_pad, memory_mask_attn)
        for layer in self.layers:
            inp = inp._replace(target=layer(inp))
        return inp.target

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, n_heads={self.n_heads}, n_layers={self.n_layers}, "
                f"norm_first={self.norm_first}, quiet_softmax={self.quiet_softmax}")
