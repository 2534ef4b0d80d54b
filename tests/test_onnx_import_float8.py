"""Float8 weights of an imported model: params of ONNX-only dtypes that safetensors stores (its
``F8_E4M3`` / ``F8_E5M2`` names) and burnpack refuses, naming the tensor.

Oracles: plain ONNX Runtime on the original file, the ``safetensors`` package's own reader (its
PyTorch backend: its numpy backend has no float8), the bytes the test wrote, numpy formulas.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.convert import load_safetensors, save_safetensors
from onnxparam.core.errors import RecordError

ort = pytest.importorskip("onnxruntime")

FLOAT8 = [(TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, op.DType.F8E4M3FN, "F8_E4M3"),
          (TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2, op.DType.F8E5M2, "F8_E5M2")]


def _model(elem_type: int, weight: np.ndarray) -> onnx.ModelProto:
    """y = x @ float(w): a float8 initializer cast to float at use."""
    w = helper.make_tensor("dense.w", elem_type, list(weight.shape), weight.view(np.uint8).tobytes(), raw=True)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["dense.w"], ["wf"], to=TensorProto.FLOAT), helper.make_node("MatMul", ["x", "wf"], ["y"])],
        "float8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _plain(model, feeds):
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _weights(np_type, seed):
    return np.random.default_rng(seed).normal(size=(4, 3)).astype(np_type)


@pytest.mark.parametrize("elem_type,np_type,dtype,st_name", FLOAT8, ids=[f[3] for f in FLOAT8])
def test_a_float8_weight_round_trips_through_safetensors_byte_for_byte(elem_type, np_type, dtype, st_name, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    w = _weights(np_type, 0)
    model = _model(elem_type, w)
    module = op.import_onnx(model)
    assert module.param_of("dense.w").dtype is dtype
    x = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_array_equal(module(x).to_numpy(), _plain(model, {"x": x}))

    path = tmp_path / "w.safetensors"
    save_safetensors(module, path)
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["dense.w"]["dtype"] == st_name and header["dense.w"]["shape"] == [4, 3]
    with safe_open(str(path), framework="pt") as f:  # the safetensors package's own reader
        got = f.get_tensor("dense.w")
    assert got.dtype == {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[st_name]
    assert got.view(torch.uint8).numpy().tobytes() == w.view(np.uint8).tobytes()

    # other weights of the same type, written by this library, read back into a fresh import
    w2 = _weights(np_type, 2)
    path2 = tmp_path / "w2.safetensors"
    save_safetensors(op.import_onnx(_model(elem_type, w2)), path2)
    loaded = load_safetensors(op.import_onnx(model), path2)
    value = loaded.param_of("dense.w").val().to_numpy()
    assert value.dtype == np.dtype(np_type) and value.tobytes() == w2.tobytes()
    np.testing.assert_allclose(loaded(x).to_numpy(), x @ w2.astype(np.float32), rtol=1e-6)
    exported = op.export_onnx(loaded, tmp_path / "loaded.onnx")
    written = next(t for t in onnx.load(str(exported)).graph.initializer if t.name == "dense.w")
    assert written.data_type == elem_type
    assert numpy_helper.to_array(written).view(np.uint8).tobytes() == w2.view(np.uint8).tobytes()
    np.testing.assert_array_equal(_plain(exported, {"x": x}), _plain(_model(elem_type, w2), {"x": x}))


def test_saving_a_float8_param_to_burnpack_is_refused_naming_the_tensor(tmp_path):
    module = op.import_onnx(_model(TensorProto.FLOAT8E4M3FN, _weights(ml_dtypes.float8_e4m3fn, 0)))
    with pytest.raises(RecordError, match=r"tensor 'dense.w': dtype F8E4M3FN is an ONNX-only element type that "
                                          r"Burn's DType has no variant for, so burnpack cannot store it"):
        module.save_file(tmp_path / "w")
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_float8_type_safetensors_has_no_name_for_is_refused_naming_the_tensor(tmp_path):
    w = np.random.default_rng(0).normal(size=(4, 3)).astype(ml_dtypes.float8_e4m3fnuz)
    module = op.import_onnx(_model(TensorProto.FLOAT8E4M3FNUZ, w))
    with pytest.raises(RecordError, match=r"tensor 'dense.w' has dtype F8E4M3FNUZ, which safetensors cannot hold"):
        save_safetensors(module, tmp_path / "w.safetensors")


def test_an_imported_float8_weight_inside_a_traced_forward_computes_as_plain_onnx_runtime(tmp_path):
    model = _model(TensorProto.FLOAT8E5M2, _weights(ml_dtypes.float8_e5m2, 3))

    class Shifted(op.Module):
        onnx_opset_imports = {"": 21}  # the imported graph's opset

        def __init__(self, inner):
            self.inner = inner

        def forward(self, x):
            return self.inner(x) - 1.0

    module = Shifted(op.import_onnx(model))
    x = np.random.default_rng(4).normal(size=(2, 4)).astype(np.float32)
    want = _plain(model, {"x": x}) - np.float32(1.0)
    np.testing.assert_array_equal(module(op.Tensor.from_numpy(x)).to_numpy(), want)
    exported = op.export_onnx(module, tmp_path / "shifted.onnx", op.Tensor.from_numpy(x))
    name = onnx.load(str(exported)).graph.input[0].name
    np.testing.assert_array_equal(_plain(exported, {name: x}), want)
