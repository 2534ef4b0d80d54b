"""DType tables, checked entry by entry against Burn's dtype list, numpy/ml_dtypes and ONNX."""

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxparam import DType, Tensor
from onnxparam.core.dtype import DTYPE_FROM_ONNX, NUMPY_DTYPES, ONNX_ELEMENT_TYPES, dtype_from_onnx_element

# Burn's DType variants (burn-std/src/tensor/dtype.rs), in declaration order.
BURN_DTYPES = ["F64", "F32", "Flex32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "Bool", "QFloat"]


def test_dtype_names_are_burns():
    assert [d.value for d in DType if not d.is_onnx_only] == BURN_DTYPES
    assert all(d.burnpack_storable for d in DType if not d.is_onnx_only)


# ONNX's element types Burn has no dtype for (onnx.proto, TensorProto.DataType) and the ml_dtypes /
# numpy type of one element
ONNX_ONLY = [
    (DType.String, TensorProto.STRING, np.object_), (DType.C64, TensorProto.COMPLEX64, np.complex64),
    (DType.C128, TensorProto.COMPLEX128, np.complex128),
    (DType.F8E4M3FN, TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
    (DType.F8E4M3FNUZ, TensorProto.FLOAT8E4M3FNUZ, ml_dtypes.float8_e4m3fnuz),
    (DType.F8E5M2, TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2),
    (DType.F8E5M2FNUZ, TensorProto.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz),
    (DType.F8E8M0FNU, TensorProto.FLOAT8E8M0, ml_dtypes.float8_e8m0fnu),
    (DType.F6E2M3FN, TensorProto.FLOAT6E2M3, ml_dtypes.float6_e2m3fn),
    (DType.F6E3M2FN, TensorProto.FLOAT6E3M2, ml_dtypes.float6_e3m2fn),
    (DType.F4E2M1FN, TensorProto.FLOAT4E2M1, ml_dtypes.float4_e2m1fn),
    (DType.I4, TensorProto.INT4, ml_dtypes.int4), (DType.U4, TensorProto.UINT4, ml_dtypes.uint4),
    (DType.I2, TensorProto.INT2, ml_dtypes.int2), (DType.U2, TensorProto.UINT2, ml_dtypes.uint2),
]


@pytest.mark.parametrize("dtype,onnx_type,np_dtype", ONNX_ONLY, ids=[d.name for d, _, _ in ONNX_ONLY])
def test_each_onnx_only_dtype_maps_to_its_onnx_element_type_and_is_not_storable_in_burnpack(dtype, onnx_type, np_dtype):
    assert dtype.is_onnx_only and not dtype.burnpack_storable
    assert dtype.to_onnx() == onnx_type
    assert dtype_from_onnx_element(onnx_type) is dtype
    assert dtype.to_numpy() == np.dtype(np_dtype)
    if onnx_type != TensorProto.STRING:
        # ONNX's own table agrees on the numpy type of each element type
        assert helper.tensor_dtype_to_np_dtype(onnx_type) == np.dtype(np_dtype)
    with pytest.raises(ValueError, match="has no Burn dtype"):
        DType.from_onnx(onnx_type)  # DType.from_onnx answers for Burn's dtypes only


def test_every_onnx_element_type_has_a_dtype():
    defined = {v for k, v in TensorProto.DataType.items() if k != "UNDEFINED"}
    assert {dtype_from_onnx_element(t).to_onnx() for t in defined} == defined


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
