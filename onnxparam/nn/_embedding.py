"""``Embedding``: a lookup table (Burn's ``burn-nn/src/modules/embedding.rs``)."""

from __future__ import annotations

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.param import Param
from ..core.tensor import Tensor
from ._config import check_float_dtype, config, positive
from ._initializer import Initializer

__all__ = ["Embedding", "EmbeddingConfig", "DEFAULT_EMBEDDING_INITIALIZER"]

DEFAULT_EMBEDDING_INITIALIZER = Initializer.Normal(mean=0.0, std=1.0)
"""Burn's default ``Embedding`` initializer: ``N(0, 1)``."""


@config
class EmbeddingConfig:
    """Configuration of an :class:`Embedding` layer (Burn's ``EmbeddingConfig``).

    Args:
        n_embedding: the number of rows (vocabulary size).
        d_model: the size of each row.
        initializer: Burn's default ``Normal(mean=0, std=1)``.
    """

    n_embedding: int
    d_model: int
    initializer: Initializer = DEFAULT_EMBEDDING_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Embedding":
        """A new :class:`Embedding` with a lazy weight on ``device``."""
        return Embedding(self.n_embedding, self.d_model, initializer=self.initializer, device=device, dtype=dtype)


class Embedding(Module):
    """Looks up rows of ``weight``: ``y[..., :] = weight[indices[...], :]``.

    ``Embedding(n_embedding, d_model, ...)`` takes exactly the fields of :class:`EmbeddingConfig`
    plus ``device`` and ``dtype``.

    Params (lazy until first read):
        weight: ``(n_embedding, d_model)``, float, row-major (Burn's and PyTorch's layout).

    Shapes: indices ``[...]`` of an int dtype (I64 or I32), values in ``[0, n_embedding)`` ->
    output ``[..., d_model]`` of the weight's dtype.

    ONNX: ``Gather`` (``axis=0``), through :func:`onnxparam.ops.embedding`.

    Raises:
        ValueError: for non-positive sizes or a non-float dtype.
    """

    def __init__(self, n_embedding: int, d_model: int, *, initializer: Initializer = DEFAULT_EMBEDDING_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        n = positive(n_embedding, "n_embedding")
        d = positive(d_model, "d_model")
        dtype = check_float_dtype(dtype, "Embedding")
        self.weight: Param = initializer.init_with((n, d), n, d, device, dtype)

    def forward(self, indices: Tensor) -> Tensor:
        return ops.embedding(self.weight.val(), indices)

    def extra_repr(self) -> str:
        n, d = self.weight.lazy_shape()
        return f"n_embedding={n}, d_model={d}"
