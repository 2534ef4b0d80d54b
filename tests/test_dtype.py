"""DType tables, checked entry by entry against Burn's dtype list, numpy/ml_dtypes and ONNX."""

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxparam import DType, Tensor
from onnxparam.dtype import DTYPE_FROM_ONNX, NUMPY_DTYPES, ONNX_ELEMENT_TYPES

# Burn's DType variants (burn-std/src/tensor/dtype.rs), in declaration order.
BURN_DTYPES = ["F64", "F32", "Flex32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "Bool", "QFloat"]


def test_dtype_names_are_burns():
    assert [d.value for d in DType] == BURN_DTYPES


@pytest.mark.parametrize("dtype,np_dtype,onnx_type", [
    (DType.F64, np.float64, TensorProto.DOUBLE), (DType.F32, np.float32, TensorProto.FLOAT),
    (DType.Flex32, np.float32, TensorProto.FLOAT), (DType.F16, np.float16, TensorProto.FLOAT16),
    (DType.BF16, ml_dtypes.bfloat16, TensorProto.BFLOAT16), (DType.I64, np.int64, TensorProto.INT64),
    (DType.I32, np.int32, TensorProto.INT32), (DType.I16, np.int16, TensorProto.INT16),
    (DType.I8, np.int8, TensorProto.INT8), (DType.U64, np.uint64, TensorProto.UINT64),
    (DType.U32, np.uint32, TensorProto.UINT32), (DType.U16, np.uint16, TensorProto.UINT16),
    (DType.U8, np.uint8, TensorProto.UINT8), (DType.Bool, np.bool_, TensorProto.BOOL),
])
def test_each_dtype_maps_to_numpy_and_onnx(dtype, np_dtype, onnx_type):
    assert NUMPY_DTYPES[dtype] == np.dtype(np_dtype)
    assert ONNX_ELEMENT_TYPES[dtype] == onnx_type
    # ONNX's own table agrees on the numpy type of each element type
    assert helper.tensor_dtype_to_np_dtype(onnx_type) == np.dtype(np_dtype)
    if dtype is not DType.Flex32:
        assert DTYPE_FROM_ONNX[onnx_type] is dtype
        assert DType.from_numpy(np_dtype) is dtype


def test_bf16_values_survive_a_tensor_bit_exactly():
    bits = np.array([0x3F80, 0x7F7F, 0xFF80, 0x0001, 0x7FC1], dtype=np.uint16)
    values = bits.view(ml_dtypes.bfloat16)
    t = Tensor.from_numpy(values)
    assert t.dtype is DType.BF16
    np.testing.assert_array_equal(t.to_numpy().view(np.uint16), bits)


def test_types_burn_lacks_raise_clear_errors():
    with pytest.raises(ValueError, match="numpy dtype complex64 has no Burn dtype"):
        DType.from_numpy(np.complex64)
    with pytest.raises(ValueError, match="ONNX element type STRING has no Burn dtype"):
        DType.from_onnx(onnx.TensorProto.STRING)
    with pytest.raises(ValueError, match="QFloat has no single ONNX element type"):
        DType.QFloat.to_onnx()
