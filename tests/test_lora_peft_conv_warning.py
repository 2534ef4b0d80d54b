"""The PEFT writers warn for a ``groups=1`` convolution adapter on a conv PEFT's unmerged forward
runs differently (fresh7 F3; ``onnxparam/lora/_peft_conv_warn.py``).

Oracle: PEFT in torch on the same model: the library's output with the adapter is PEFT's merged
model's (``merge_and_unload``); the folder the library writes, loaded back by PEFT, gives the
merged numbers only after merging, and its unmerged forward differs (``padding_mode="reflect"``:
PEFT's ``lora_A`` zero-pads the unpadded input). ``save_peft_adapter`` and ``write_batched_peft``
say so with a ``LoraWarning`` naming the weight; a plain conv writes without one (the suite runs
with warnings as errors).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from torch_peft import export, peft_lora, quiet, randomize  # noqa: E402

from onnxparam import LoraWarning, Tensor, export_onnx, import_onnx, load_peft_adapter, save_peft_adapter  # noqa: E402
from onnxparam import write_batched_peft  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, **conv):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, **conv)

    def forward(self, x):
        return self.conv(x)


def _built(tmp_path, **conv):
    model = randomize(Net(**conv).eval(), seed=5)
    x = torch.randn(2, 2, 6, 6)
    path = export(model, (x,), tmp_path / "net.onnx", "torchscript", dynamic={0: "batch"}, input_names=["x"],
                  output_names=["y"])
    reference = peft_lora(model, ["conv"], 2, 4, seed=9, folder=tmp_path / "adapter")
    imported = import_onnx(path)
    module = imported.add_adapter("one", load_peft_adapter(imported, tmp_path / "adapter"))
    return module, reference, x


def _peft_loaded(model_folder, base):
    with quiet():
        return peft.PeftModel.from_pretrained(copy.deepcopy(base), str(model_folder)).eval()


@pytest.mark.parametrize("conv", [{"padding": 1, "padding_mode": "reflect"}, {"padding": 2, "dilation": 2},
                                  {"padding": 1, "padding_mode": "circular"}], ids=["reflect", "dilated", "circular"])
def test_writing_a_peft_folder_for_a_conv_peft_runs_unmerged_otherwise_warns(tmp_path, conv):
    module, reference, x = _built(tmp_path, **conv)
    with torch.no_grad():
        merged = copy.deepcopy(reference).merge_and_unload()(x).numpy()
    ours = module.set_adapter("one")(Tensor.from_numpy(x.numpy())).to_numpy()
    np.testing.assert_allclose(ours, merged, atol=1e-5, rtol=0)  # the library applies the merged delta
    with pytest.warns(LoraWarning, match=r"save_peft_adapter: convolution adapters on 'conv\.weight'.*unmerged"):
        save_peft_adapter(module.set_adapter("one"), tmp_path / "written")
    exported = export_onnx(module, tmp_path / "batched.onnx", x.numpy(), lora="batched")
    with pytest.warns(LoraWarning, match=r"write_batched_peft: convolution adapters on 'conv\.weight'"):
        write_batched_peft(module, tmp_path / "batched_peft", model=exported)
    if "dilation" in conv:
        return  # PEFT's unmerged forward of a dilated conv fails outright (another output size)
    base = randomize(Net(**conv).eval(), seed=5)
    loaded = _peft_loaded(tmp_path / "written", base)
    with torch.no_grad():
        unmerged = loaded(x).numpy()
        np.testing.assert_allclose(loaded.merge_and_unload()(x).numpy(), merged, atol=1e-5, rtol=0)
    assert np.abs(unmerged - merged).max() > 1e-3  # what the warning says


def test_a_plain_conv_writes_without_a_warning(tmp_path):
    module, reference, x = _built(tmp_path, padding=1)
    save_peft_adapter(module.set_adapter("one"), tmp_path / "written")
    base = randomize(Net(padding=1).eval(), seed=5)
    with torch.no_grad():
        np.testing.assert_allclose(_peft_loaded(tmp_path / "written", base)(x).numpy(), reference(x).numpy(),
                                   atol=1e-5, rtol=0)
