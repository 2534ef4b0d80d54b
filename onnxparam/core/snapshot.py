"""A tensor's description and a lazy way to get its data: the entry of a record.

Model layer: a file format (:mod:`onnxparam.formats`) hands these out, a record
(:mod:`onnxparam.core.record`) maps paths to them. Re-exported as ``onnxparam.TensorSnapshot``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .device import Device
from .dtype import DType
from .param import Param, ParamId
from .tensor import Tensor, TensorData

__all__ = ["TensorSnapshot"]


@dataclass(frozen=True)
class TensorSnapshot:
    """A tensor's description and a lazy way to get its data.

    Attributes:
        dtype: the stored dtype (``QFloat`` for quantized data).
        shape: the logical shape.
        param_id: the param id, or ``None`` when the source had none.
        loader: ``() -> TensorData``; called only by :meth:`to_data` / :meth:`to_tensor`.
        scheme: the quantization scheme of ``QFloat`` data, else ``None``.
    """

    dtype: DType
    shape: tuple
    param_id: Optional[ParamId]
    loader: Callable[[], TensorData] = field(repr=False, compare=False)
    scheme: Any = None

    def to_data(self) -> TensorData:
        return self.loader()

    def to_tensor(self, device: "Device | str | None" = None) -> Tensor:
        return Tensor.from_data(self.to_data(), device)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @staticmethod
    def of_param(param: Param) -> "TensorSnapshot":
        """The snapshot a param saves as: its raw base through the save mapper (lazy)."""

        def load(_param=param):
            return _param.transform_for_save().base().into_data()

        dtype = param.lazy_dtype()
        # NOTE: a quantized param's scheme is part of its dtype: the value is read to know it
        scheme = param.transform_for_save().base()._quant.scheme if dtype is DType.QFloat else None
        return TensorSnapshot(dtype, tuple(param.lazy_shape()), param.id, load, scheme)
