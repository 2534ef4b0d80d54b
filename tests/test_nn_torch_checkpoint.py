"""A PyTorch model's ``state_dict`` loaded into the same architecture written with the wider
layer set, through the PyTorch adapter (``load_safetensors(..., adapter="pytorch")``): torch's
outputs are the oracle. Covers the layouts that need nothing (Conv3d, ConvTranspose*: PyTorch
stores Burn's axis order) and the renames (GroupNorm / InstanceNorm / RmsNorm ``weight`` /
``bias`` -> ``gamma`` / ``beta``; PReLU ``weight`` -> ``alpha``).
"""

from __future__ import annotations

import numpy as np
import pytest
from nn_layer_checks import tensor

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.convert import LoadReport, load_safetensors

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(3, 8, 3, stride=2, padding=1, output_padding=1, groups=1)
        self.group = torch.nn.GroupNorm(2, 8)
        self.inst = torch.nn.InstanceNorm2d(8, affine=True)
        self.act = torch.nn.Mish()
        self.prelu = torch.nn.PReLU(8)
        self.down = torch.nn.Conv2d(8, 4, 3, padding=1)
        self.rms = torch.nn.RMSNorm(4, eps=1e-5)  # Burn's default epsilon (torch: finfo.eps)

    def forward(self, x):
        y = self.prelu(self.act(self.inst(self.group(self.up(x)))))
        y = self.down(y).permute(0, 2, 3, 1)
        return self.rms(y)


class Net(op.Module):
    def __init__(self):
        self.up = nn.ConvTranspose2d((3, 8), 3, stride=2, padding=1, padding_out=1)
        self.group = nn.GroupNorm(2, 8)
        self.inst = nn.InstanceNorm(8)
        self.act = nn.Mish()
        self.prelu = nn.PRelu(8)
        self.down = nn.Conv2d((8, 4), 3, padding=1)
        self.rms = nn.RmsNorm(4)

    def forward(self, x):
        y = self.prelu(self.act(self.inst(self.group(self.up(x)))))
        return self.rms(ops.permute(self.down(y), [0, 2, 3, 1]))


def test_a_torch_state_dict_loads_through_the_pytorch_adapter_and_gives_torchs_outputs(tmp_path):
    torch.manual_seed(0)
    ref = TorchNet().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # move the norms' affine params off ones / zeros
    path = tmp_path / "torch.safetensors"
    safetensors_torch.save_file(ref.state_dict(), str(path))
    report = LoadReport()
    module = load_safetensors(Net(), path, adapter="pytorch", report=report)
    assert report.ok and report.missing == [] and report.unused == []
    assert ("group.weight", "group.gamma") in report.renamed and ("rms.weight", "rms.gamma") in report.renamed
    assert ("inst.bias", "inst.beta") in report.renamed and ("prelu.weight", "prelu.alpha") in report.renamed
    assert report.transposed == []
    x = np.random.default_rng(27).normal(size=(2, 3, 5, 4)).astype(np.float32)
    want = ref(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(module(tensor(x)).to_numpy(), want, rtol=1e-4, atol=1e-5)


def test_the_module_saved_in_pytorch_layout_loads_into_torch_strictly(tmp_path):
    from onnxparam.convert import save_safetensors

    module = Net()
    path = tmp_path / "for_torch.safetensors"
    save_safetensors(module, path, adapter="pytorch")
    ref = TorchNet().eval()
    ref.load_state_dict(safetensors_torch.load_file(str(path)), strict=True)
    x = np.random.default_rng(28).normal(size=(1, 3, 4, 4)).astype(np.float32)
    want = ref(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(module(tensor(x)).to_numpy(), want, rtol=1e-4, atol=1e-5)
