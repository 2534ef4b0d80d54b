"""Standard layers with Burn's field names, layouts and initializers (``import onnxparam.nn as nn``).

Every layer is an :class:`onnxparam.Module`; its params have Burn's record names (``weight``,
``bias``, ``gamma``, ``beta``, ``running_mean``, ``running_var``), so a Burn-written record loads
unchanged, and they are created **lazy**: building a layer draws nothing, and loading weights
into it never runs its random init.

**One builder convention, two spellings.** The primary description of a layer is its frozen
config dataclass, as in Burn (``LinearConfig(d_input, d_output).with_bias(False).init(device)``);
every config field has a ``with_<field>`` copy. The layer's constructor takes exactly the
config's fields plus ``device`` and ``dtype`` (``Linear(d_input, d_output, bias=False,
device="cpu", dtype=DType.F32)``) and builds the same module. Parameter-free layers' configs
have ``init()`` without a device.

Non-param state (stride, epsilon, ...) is plain attributes, shown by ``extra_repr()`` in the
module display. Each layer's docstring gives shapes, dtypes, layouts, the ONNX operator emitted
and the Burn source file it follows; the forwards are :mod:`onnxparam.ops` calls.

**Training mode.** ``module.train()`` switches ``Dropout`` to dropping, ``RRelu`` to random
slopes and ``BatchNorm`` to batch statistics; :func:`update_running_stats` returns the module
with the running statistics Burn's training forward writes (:mod:`._running_stats` says why it is
a separate call). ``valid()`` switches back. :func:`seed` makes the random masks and slopes
reproducible. Losses with Burn's names and reductions: :mod:`onnxparam.nn.loss`.
"""

from ._activation import Gelu, Relu, Sigmoid, Softmax, Tanh
from ._activation_ext import (
    Celu,
    CeluConfig,
    Elu,
    EluConfig,
    Glu,
    HardShrink,
    HardShrinkConfig,
    HardSigmoid,
    HardSigmoidConfig,
    HardSwish,
    Hardtanh,
    HardtanhConfig,
    LeakyRelu,
    LeakyReluConfig,
    LogSigmoid,
    Mish,
    PRelu,
    PReluConfig,
    Relu6,
    Selu,
    Silu,
    Softplus,
    SoftplusConfig,
    SoftShrink,
    SoftShrinkConfig,
    Softsign,
    SwiGlu,
    SwiGluConfig,
    Tanhshrink,
    Threshold,
    ThresholdConfig,
    ThresholdedRelu,
    ThresholdedReluConfig,
)
from ._attention import (
    CrossAttention,
    CrossAttentionConfig,
    MhaInput,
    MhaOutput,
    MultiHeadAttention,
    MultiHeadAttentionConfig,
    generate_autoregressive_mask,
    generate_padding_mask,
)
from ._conv import Conv1d, Conv1dConfig, Conv2d, Conv2dConfig
from ._conv_transpose import ConvTranspose1d, ConvTranspose1dConfig, ConvTranspose2d, ConvTranspose2dConfig
from ._deform_conv import DeformConv2d, DeformConv2dConfig
from ._dropout import Dropout, DropoutConfig
from ._embedding import Embedding, EmbeddingConfig
from ._fold import AdaptiveAvgPool3d, AdaptiveAvgPool3dConfig, Fold4d, Fold4dConfig
from ._initializer import Initializer, seed
from ._interpolate import Interpolate1d, Interpolate1dConfig, Interpolate2d, Interpolate2dConfig, InterpolateMode
from ._linear import Linear, LinearConfig
from ._norm import BatchNorm, BatchNormConfig, LayerNorm, LayerNormConfig
from ._norm_extra import GroupNorm, GroupNormConfig, InstanceNorm, InstanceNormConfig, RmsNorm, RmsNormConfig
from ._pool import (
    AdaptiveAvgPool2d,
    AdaptiveAvgPool2dConfig,
    AvgPool2d,
    AvgPool2dConfig,
    MaxPool2d,
    MaxPool2dConfig,
)
from ._pos_encoding import (
    PositionalEncoding,
    PositionalEncodingConfig,
    RotaryEncoding,
    RotaryEncodingConfig,
    generate_sinusoids,
)
from ._rnn import GateController, Gru, GruConfig, Lstm, LstmConfig, LstmState
from ._rnn_bidirectional import BiGru, BiGruConfig, BiLstm, BiLstmConfig
from ._rrelu import RRelu, RReluConfig
from ._running_stats import update_running_stats
from ._spatial import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool1dConfig,
    AvgPool1d,
    AvgPool1dConfig,
    Conv3d,
    Conv3dConfig,
    ConvTranspose3d,
    ConvTranspose3dConfig,
    LocalResponseNorm,
    LocalResponseNormConfig,
    MaxPool1d,
    MaxPool1dConfig,
    PixelShuffle,
    PixelShuffleConfig,
    Unfold4d,
    Unfold4dConfig,
)
from ._transformer import (
    PositionWiseFeedForward,
    PositionWiseFeedForwardConfig,
    TransformerDecoder,
    TransformerDecoderConfig,
    TransformerDecoderInput,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderConfig,
    TransformerEncoderInput,
    TransformerEncoderLayer,
)

__all__ = [
    "Initializer",
    "seed",
    "update_running_stats",
    "Linear",
    "LinearConfig",
    "Conv1d",
    "Conv1dConfig",
    "Conv2d",
    "Conv2dConfig",
    "ConvTranspose1d",
    "ConvTranspose1dConfig",
    "ConvTranspose2d",
    "ConvTranspose2dConfig",
    "Conv3d",
    "Conv3dConfig",
    "ConvTranspose3d",
    "ConvTranspose3dConfig",
    "DeformConv2d",
    "DeformConv2dConfig",
    "BatchNorm",
    "BatchNormConfig",
    "LayerNorm",
    "LayerNormConfig",
    "GroupNorm",
    "GroupNormConfig",
    "InstanceNorm",
    "InstanceNormConfig",
    "RmsNorm",
    "RmsNormConfig",
    "LocalResponseNorm",
    "LocalResponseNormConfig",
    "Embedding",
    "EmbeddingConfig",
    "MaxPool2d",
    "MaxPool2dConfig",
    "AvgPool2d",
    "AvgPool2dConfig",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool2dConfig",
    "MaxPool1d",
    "MaxPool1dConfig",
    "AvgPool1d",
    "AvgPool1dConfig",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool1dConfig",
    "AdaptiveAvgPool3d",
    "AdaptiveAvgPool3dConfig",
    "PixelShuffle",
    "PixelShuffleConfig",
    "Unfold4d",
    "Unfold4dConfig",
    "Fold4d",
    "Fold4dConfig",
    "InterpolateMode",
    "Interpolate1d",
    "Interpolate1dConfig",
    "Interpolate2d",
    "Interpolate2dConfig",
    "Dropout",
    "DropoutConfig",
    "Relu",
    "Gelu",
    "Sigmoid",
    "Tanh",
    "Softmax",
    "GateController",
    "Lstm",
    "LstmConfig",
    "LstmState",
    "BiLstm",
    "BiLstmConfig",
    "Gru",
    "GruConfig",
    "BiGru",
    "BiGruConfig",
    "MultiHeadAttention",
    "MultiHeadAttentionConfig",
    "MhaInput",
    "MhaOutput",
    "CrossAttention",
    "CrossAttentionConfig",
    "generate_autoregressive_mask",
    "generate_padding_mask",
    "PositionWiseFeedForward",
    "PositionWiseFeedForwardConfig",
    "TransformerEncoder",
    "TransformerEncoderConfig",
    "TransformerEncoderInput",
    "TransformerEncoderLayer",
    "TransformerDecoder",
    "TransformerDecoderConfig",
    "TransformerDecoderInput",
    "TransformerDecoderLayer",
    "PositionalEncoding",
    "PositionalEncodingConfig",
    "RotaryEncoding",
    "RotaryEncodingConfig",
    "generate_sinusoids",
    "PRelu",
    "PReluConfig",
    "LeakyRelu",
    "LeakyReluConfig",
    "RRelu",
    "RReluConfig",
    "Silu",
    "Mish",
    "HardSwish",
    "HardSigmoid",
    "HardSigmoidConfig",
    "Elu",
    "EluConfig",
    "Selu",
    "Celu",
    "CeluConfig",
    "Softplus",
    "SoftplusConfig",
    "Softsign",
    "Glu",
    "SwiGlu",
    "SwiGluConfig",
    "Relu6",
    "Hardtanh",
    "HardtanhConfig",
    "LogSigmoid",
    "Tanhshrink",
    "HardShrink",
    "HardShrinkConfig",
    "SoftShrink",
    "SoftShrinkConfig",
    "ThresholdedRelu",
    "ThresholdedReluConfig",
    "Threshold",
    "ThresholdConfig",
]
