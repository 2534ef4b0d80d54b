"""A binary op between a param and input data of another dtype says to cast the input to the
layer's dtype, and following that advice works. Oracle: the layer's formula in numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest

import onnxparam as op
from onnxparam import nn
from onnxparam.core.dtype import DType
from onnxparam.core.errors import OnnxParamError


@pytest.mark.parametrize("np_dtype", [np.int64, np.float64])
def test_linear_fed_int64_or_float64_data_says_to_cast_the_input_to_the_weight_dtype(np_dtype):
    layer = nn.Linear(4, 3)
    data = np.arange(8).reshape(2, 4).astype(np_dtype)
    x = op.Tensor.from_numpy(data)
    with pytest.raises(OnnxParamError) as info:
        layer(x)
    message = str(info.value)
    assert "'weight'" in message and "cast the input" in message
    advised = re.findall(r"x\.cast\(DType\.(\w+)\)", message)
    assert advised == ["F32"]  # the weight's dtype, never the input's
    y = layer(x.cast(DType[advised[0]])).to_numpy()
    w, b = layer.weight.val().to_numpy(), layer.bias.val().to_numpy()
    np.testing.assert_allclose(y, data.astype(np.float32) @ w + b, rtol=1e-5, atol=1e-5)


def test_two_inputs_of_different_dtypes_name_both_casts():
    with pytest.raises(TypeError, match=r"\.cast\(DType\.I64\) or \.cast\(DType\.F32\)"):
        op.Tensor.from_numpy(np.ones(3, np.int64)) + op.Tensor.from_numpy(np.ones(3, np.float32))
