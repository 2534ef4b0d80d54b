"""Writing over the file a module came from keeps that module usable (issue 28): it keeps its old
mapping (a save renames a new file into place; the old bytes stay mapped), for ``.bpk``,
``.safetensors``, inline ONNX and ONNX external data alike.

Oracles: plain ONNX Runtime on the original file (run before it is overwritten) and the numpy
formula ``x @ W + b`` of the weights as written.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxparam as op
from onnxparam import nn
from onnxparam.convert import load_safetensors, save_safetensors
from onnxparam.onnx_io import export_onnx, import_onnx

X = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)


class Net(op.Module):
    def __init__(self):
        self.fc = nn.Linear(16, 4096)  # 256 KiB: large enough to be mapped, not copied

    def forward(self, x):
        return self.fc(x)


def _formula(module) -> np.ndarray:
    return X @ module.fc.weight.val().to_numpy() + module.fc.bias.val().to_numpy()


def _ort(path) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


@pytest.mark.parametrize("touch_first", [False, True])
def test_a_module_loaded_from_a_bpk_survives_a_save_over_that_bpk(tmp_path, touch_first):
    net = Net()
    expected = _formula(net)
    net.save_file(tmp_path / "m.bpk")
    module = Net().load_file(tmp_path / "m.bpk")
    if touch_first:
        module(X)
    module.save_file(tmp_path / "m.bpk")
    np.testing.assert_allclose(module(X).to_numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Net().load_file(tmp_path / "m.bpk")(X).to_numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("touch_first", [False, True])
def test_a_module_loaded_from_safetensors_survives_a_save_over_that_file(tmp_path, touch_first):
    net = Net()
    expected = _formula(net)
    save_safetensors(net, tmp_path / "m.safetensors")
    module = load_safetensors(Net(), tmp_path / "m.safetensors")
    if touch_first:
        module(X)
    save_safetensors(module, tmp_path / "m.safetensors")
    np.testing.assert_allclose(module(X).to_numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(load_safetensors(Net(), tmp_path / "m.safetensors")(X).to_numpy(), expected,
                               rtol=1e-5, atol=1e-5)


def _third_party_external(tmp_path):
    """m.onnx with every tensor in m.onnx.data, written by the onnx package itself."""
    export_onnx(Net(), tmp_path / "inline.onnx", X)
    model = onnx.load(str(tmp_path / "inline.onnx"))
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    return tmp_path / "m.onnx"


@pytest.mark.parametrize("layout", ["inline", "external-ours", "external-onnx"])
@pytest.mark.parametrize("rewrite_external", [False, True])
@pytest.mark.parametrize("touch_first", [False, True])
def test_a_module_imported_from_an_onnx_file_survives_an_export_over_it(tmp_path, layout, rewrite_external,
                                                                       touch_first):
    if layout == "external-onnx":
        path = _third_party_external(tmp_path)
    else:
        path = export_onnx(Net(), tmp_path / "m.onnx", X, external_data=layout == "external-ours")
    expected = _ort(path)  # plain ORT on the original file, before anything is overwritten
    module = import_onnx(path)
    if touch_first:
        module(X)
    export_onnx(module, path, external_data=rewrite_external)
    np.testing.assert_allclose(module(X).to_numpy(), expected, rtol=1e-5, atol=1e-5)
    for _, param in module.named_params():
        param.val().to_numpy()
    np.testing.assert_allclose(_ort(path), expected, rtol=1e-5, atol=1e-5)  # the new file holds the same model
    np.testing.assert_allclose(import_onnx(path)(X).to_numpy(), expected, rtol=1e-5, atol=1e-5)
