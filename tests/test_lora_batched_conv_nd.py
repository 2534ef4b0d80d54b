"""``lora="batched"`` on ``Conv1d`` and ``Conv3d`` weights (PEFT's conv LoRA, plain, grouped and
depthwise) and their biases (``lora_bias``), against PEFT's mixed-batch forward.

Oracle: ``peft.PeftModel`` in torch holding three adapters (ranks 4 / 8 / 4 with a per-module
rank through ``rank_pattern``, alphas != ranks, one rsLoRA, ``lora_bias=True`` on two) and
``model(x, adapter_names=[...])``, each row run with its own adapter (``"__base__"``: none). The
nets (a strided ``Conv1d`` then a grouped one, groups=2; a strided ``Conv3d`` then a depthwise
one, groups=4; then a ``Linear``) are written by torch's TorchScript exporter (dynamo: ``slow``)
and imported; the adapters are PEFT's saved folders loaded with ``load_peft_adapter``. The
batched ONNX file in plain ONNX Runtime and ``module(x, adapter_index=...)`` must give each row
PEFT's output within 1e-5, at a batch size other than the export's; base rows equal the torch
model's; the export's stacks written by ``write_batched_peft`` load in PEFT and give its rows
again. The setup is ``tests/test_lora_batched_conv.py``'s (``build``).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_lora_batched_conv import ATOL, build, check_written_peft_folders, run_batched  # noqa: E402
from torch_peft import randomize  # noqa: E402

from onnxparam import Tensor, check_batched_adapters, export_onnx  # noqa: E402
from onnxparam.lora._batched import batched_metadata  # noqa: E402

# name: (r, alpha, use_rslora, lora_bias); PEFT needs each grouped conv's rank divisible by its groups
ADAPTERS = {"one": (4, 5, False, True), "two": (8, 2, True, False), "three": (4, 6, False, True)}
RANKS = {"one": {"conv": 2}, "two": {}, "three": {"conv": 6}}
ROWS = ["three", "__base__", "one", "two", "one", "__base__", "three", "two"]
TARGETS = ("conv", "grouped", "fc")


class Net1d(torch.nn.Module):
    """``Conv1d(3, 4, 3, stride=2, padding=1)`` -> relu -> ``Conv1d(4, 6, 3, padding=1, groups=2)``
    -> relu -> flatten -> ``Linear(24, 5)`` on ``[N, 3, 8]``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 4, 3, stride=2, padding=1)
        self.grouped = torch.nn.Conv1d(4, 6, 3, padding=1, groups=2)
        self.fc = torch.nn.Linear(6 * 4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.grouped(torch.relu(self.conv(x)))).flatten(1))


class Net3d(torch.nn.Module):
    """``Conv3d(2, 4, 3, stride=2, padding=1)`` -> relu -> depthwise ``Conv3d(4, 4, (1, 3, 3),
    padding=(0, 1, 1), groups=4)`` -> relu -> flatten -> ``Linear(32, 5)`` on ``[N, 2, 4, 4, 4]``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(2, 4, 3, stride=2, padding=1)
        self.grouped = torch.nn.Conv3d(4, 4, (1, 3, 3), padding=(0, 1, 1), groups=4)
        self.fc = torch.nn.Linear(4 * 2 * 2 * 2, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.grouped(torch.relu(self.conv(x)))).flatten(1))


NETS = {"1d": (Net1d, (3, 8), 2), "3d": (Net3d, (2, 4, 4, 4), 4)}  # class, input shape, the grouped conv's groups


@pytest.fixture(scope="module", params=[pytest.param((d, e), id=f"{d}-{e}", marks=[pytest.mark.slow] if e == "dynamo"
                                                      else []) for d in NETS for e in ("torchscript", "dynamo")])
def built(request, tmp_path_factory):
    dims, exporter = request.param
    cls, in_shape, groups = NETS[dims]
    folder = tmp_path_factory.mktemp(f"conv{dims}-{exporter}")
    model = randomize(cls().eval(), seed=13)
    return (*build(folder, exporter, model, ADAPTERS, ROWS, in_shape, TARGETS, RANKS), groups, len(in_shape) - 1)


def test_conv_nd_rows_equal_pefts_mixed_batch_in_onnx_runtime(built, tmp_path):
    module, x, expected, plain, *_, groups, spatial = built
    path = export_onnx(module, tmp_path / "batched.onnx", x[:2], lora="batched")
    targets = {t["path"]: t for t in batched_metadata(path)["targets"]}
    assert {targets[p]["kind"] for p in ("conv.weight", "grouped.weight")} == {"conv"}
    assert targets["conv.bias"]["kind"] == targets["fc.bias"]["kind"] == "bias"
    assert len(targets["grouped.weight"]["shape"]) == 2 + spatial
    # every input channel (PEFT's lora_A): groups times the weight's in / groups
    assert targets["grouped.weight"]["d_in"] == int(np.prod(targets["grouped.weight"]["shape"][1:])) * groups
    assert targets["conv.weight"]["ranks"] == {"one": 2, "two": 8, "three": 6}
    got, index = run_batched(path, x, ROWS, ADAPTERS)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    base_rows = index == 0
    np.testing.assert_allclose(got[base_rows], plain[base_rows], atol=ATOL, rtol=0)
    assert np.abs(expected[~base_rows] - plain[~base_rows]).max(axis=1).min() > 0.1  # every adapter matters
    assert check_batched_adapters(path, module)


def test_conv_nd_rows_equal_pefts_mixed_batch_through_module_call(built):
    module, x, expected, *_ = built
    got = module(Tensor.from_numpy(x), adapter_index=[None if n == "__base__" else n for n in ROWS]).to_numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    one = module(Tensor.from_numpy(x[:3]), adapter_index="two").to_numpy()  # one entry: every row
    with torch.no_grad():
        reference = built[5](torch.from_numpy(x[:3]), adapter_names=["two"] * 3).numpy()
    np.testing.assert_allclose(one, reference, atol=ATOL, rtol=0)


def test_conv_nd_stacks_written_as_peft_folders_give_each_rows_adapter_in_peft(built, tmp_path):
    """``write_batched_peft`` of the export's stacks: PEFT loads the 1-d / 3-d conv folders
    (``lora_A`` ``(r, in, *kernel)``, ``lora_B`` ``(out, r / groups, 1, ...)``) and its mixed batch
    equals PEFT's on the source adapters; read back, they give the same stacks."""
    check_written_peft_folders(built[:7], list(ADAPTERS), ROWS, tmp_path)
