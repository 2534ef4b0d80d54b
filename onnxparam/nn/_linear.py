"""``Linear``: ``y = x @ weight + bias`` (Burn's ``burn-nn/src/modules/linear.rs``)."""

from __future__ import annotations

from typing import Optional

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.param import Param
from ..core.tensor import Tensor
from ._config import check_float_dtype, config, positive
from ._initializer import DEFAULT_INITIALIZER, Initializer

__all__ = ["Linear", "LinearConfig"]


@config
class LinearConfig:
    """Configuration of a :class:`Linear` layer (Burn's ``LinearConfig``).

    Args:
        d_input: input features.
        d_output: output features.
        bias: whether the layer adds a bias.
        initializer: for the weight and the bias; Burn's default
            ``KaimingUniform(gain=1/sqrt(3))`` with ``fan_in = d_input``, i.e.
            ``U(-1/sqrt(d_input), 1/sqrt(d_input))``.
    """

    d_input: int
    d_output: int
    bias: bool = True
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Linear":
        """A new :class:`Linear` with lazy params on ``device`` (nothing is drawn yet)."""
        return Linear(self.d_input, self.d_output, self.bias, initializer=self.initializer,
                      device=device, dtype=dtype)


class Linear(Module):
    """Applies ``y = x @ weight + bias`` over the last dim.

    ``Linear(d_input, d_output, bias, ...)`` takes exactly the fields of :class:`LinearConfig`
    (the primary, Burn-style description; ``LinearConfig(...).init(device)`` builds the same
    module) plus ``device`` and ``dtype``.

    Params (lazy until first read; Burn's field names, so Burn records load unchanged):
        weight: ``(d_input, d_output)``, float, row-major — Burn's ``LinearLayout::Row`` and the
            ONNX ``MatMul`` right operand; PyTorch stores ``(d_output, d_input)``.
        bias: ``(d_output,)`` or ``None``.

    Shapes: input ``[..., d_input]`` -> output ``[..., d_output]``, the params' dtype.

    ONNX: ``MatMul`` (+ ``Add`` with a bias), through :func:`onnxparam.ops.linear`.

    Raises:
        ValueError: for non-positive sizes or a non-float dtype.
    """

    def __init__(self, d_input: int, d_output: int, bias: bool = True, *,
                 initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        d_input = positive(d_input, "d_input")
        d_output = positive(d_output, "d_output")
        dtype = check_float_dtype(dtype, "Linear")
        self.weight: Param = initializer.init_with((d_input, d_output), d_input, d_output, device, dtype)
        self.bias: Optional[Param] = (
            initializer.init_with((d_output,), d_input, d_output, device, dtype) if bias else None
        )

    @property
    def d_input(self) -> int:
        return self.weight.lazy_shape()[0]

    @property
    def d_output(self) -> int:
        return self.weight.lazy_shape()[1]

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight.val(), None if self.bias is None else self.bias.val())

    def extra_repr(self) -> str:
        return f"d_input={self.d_input}, d_output={self.d_output}, bias={self.bias is not None}"
