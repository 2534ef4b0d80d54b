"""``.pt`` tensors of ONNX-only dtypes (float8, complex) move to the targets that hold them and
are refused, naming the tensor, only where the target cannot (issue 28); ``load_pytorch`` takes
an in-memory state dict.

Oracles: the ``safetensors`` package's torch reader and the ``onnx`` package's ``numpy_helper``
give back torch's bits; torch's own ``nn.Linear`` for the loaded layer.
"""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxparam as op
from onnxparam import nn
from onnxparam.convert import convert, load_pytorch

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _bits(t):
    return t.view(torch.uint8).numpy() if t.element_size() == 1 else t.numpy()


@pytest.fixture
def float8_pt(tmp_path):
    torch.manual_seed(0)
    state = {"w8": torch.randn(3, 4).to(torch.float8_e4m3fn), "e5": torch.randn(5).to(torch.float8_e5m2),
             "e8": torch.rand(4).to(torch.float8_e8m0fnu), "x": torch.randn(2)}
    torch.save(state, tmp_path / "f8.pt")
    return state, tmp_path / "f8.pt"


def test_float8_tensors_of_a_pt_move_to_safetensors_bit_exact(float8_pt, tmp_path):
    state, path = float8_pt
    convert(path, tmp_path / "f8.safetensors")
    back = safetensors_torch.load_file(str(tmp_path / "f8.safetensors"))
    for name, t in state.items():
        assert back[name].dtype == t.dtype, name
        np.testing.assert_array_equal(_bits(back[name]), _bits(t), err_msg=name)


def test_float8_and_complex_tensors_of_a_pt_move_to_onnx_bit_exact(float8_pt, tmp_path):
    state, _ = float8_pt
    state = dict(state, fnuz=torch.randn(3).to(torch.float8_e4m3fnuz), c=torch.randn(2, dtype=torch.complex64))
    torch.save(state, tmp_path / "all.pt")
    convert(tmp_path / "all.pt", tmp_path / "all.onnx")
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "all.onnx")).graph.initializer}
    for name, t in state.items():
        a = got[name]
        np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a, _bits(t), err_msg=name)


def test_burnpack_and_unnamed_safetensors_types_are_refused_naming_the_tensor(float8_pt, tmp_path):
    _, path = float8_pt
    with pytest.raises(op.RecordError, match=r"tensor 'w8': dtype F8E4M3FN is an ONNX-only element type"):
        convert(path, tmp_path / "f8.bpk")
    torch.save({"fnuz": torch.randn(3).to(torch.float8_e4m3fnuz)}, tmp_path / "fnuz.pt")
    with pytest.raises(op.RecordError, match=r"tensor 'fnuz' has dtype F8E4M3FNUZ, which safetensors cannot hold"):
        convert(tmp_path / "fnuz.pt", tmp_path / "fnuz.safetensors")
    assert not (tmp_path / "f8.bpk").exists() and not (tmp_path / "fnuz.safetensors").exists()


def test_load_pytorch_takes_an_in_memory_state_dict():
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 3)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        expected = lin(torch.from_numpy(x)).numpy()
    for state in (lin.state_dict(), {"model": lin.state_dict()}):
        layer = load_pytorch(nn.Linear(4, 3), state, top_level_key="model" if "model" in state else None)
        np.testing.assert_allclose(layer(op.Tensor.from_numpy(x)).to_numpy(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(op.RecordError, match="top_level_key 'nope'"):
        load_pytorch(nn.Linear(4, 3), lin.state_dict(), top_level_key="nope")
    with pytest.raises(op.RecordError, match="not int"):
        load_pytorch(nn.Linear(4, 3), 42)
