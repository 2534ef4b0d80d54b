"""Arrays of element types Burn has no dtype for are refused with the library's DTypeError.

Oracle: numpy's own dtype kinds (``U`` unicode, ``S`` bytes, ``O`` object, ``c`` complex), which
Burn's dtype list (docs/burnpack.md, the dtype table) does not contain.
"""

import numpy as np
import pytest

import onnxparam as op


@pytest.mark.parametrize("array", [np.array(["a", "b"]), np.array([b"a"]), np.array([object()], dtype=object),
                                   np.array([1 + 2j], np.complex64)])
def test_tensor_from_numpy_of_a_dtype_burn_lacks_raises_dtype_error_naming_it(array):
    with pytest.raises(op.DTypeError, match=f"numpy dtype {array.dtype} has no Burn dtype") as info:
        op.Tensor.from_numpy(array)
    assert isinstance(info.value, ValueError) and isinstance(info.value, op.OnnxParamError)


def test_strings_are_pointed_to_imported_modules():
    with pytest.raises(op.DTypeError, match="imported ONNX module"):
        op.Tensor.from_numpy(np.array(["text"]))
