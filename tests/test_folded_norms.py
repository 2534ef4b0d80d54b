"""BatchNorms torch's dynamo exporter folds into a Conv / Gemm weight (fresh8 F4).

onnxscript's rewriter (dynamo's default optimizer) replaces ``BatchNorm(Conv(x; W))`` by
``Conv(x; W * s, ...)`` with ``s = gamma / sqrt(var + eps)`` and keeps the name ``conv.weight``
(a bias-free conv gets a new ``conv.weight_bias``); the node is tagged
``pkg.onnxscript.rewriter.rule_name = FuseBatchNormIntoConv`` (``...Gemm`` for ``Linear`` +
``BatchNorm1d``). PEFT trained its delta on torch's unfolded weight, so it cannot be placed in
the folded one; a torch checkpoint's ``conv.weight`` neither. Oracles: torch and PEFT on the same
model; plain ONNX Runtime on the file; the same model exported with the BatchNorms kept.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")
peft = pytest.importorskip("peft")

import onnxparam as op  # noqa: E402
from onnxparam import LoraConfig, ParamGroup  # noqa: E402
from onnxparam.convert import convert, load_pytorch, load_safetensors, save_safetensors  # noqa: E402
from onnxparam.core.errors import LoraError, RecordError  # noqa: E402

FOLDED = {"conv.weight", "conv.weight_bias", "fc1.weight", "fc1.bias"}


class _Net(torch.nn.Module):
    """Conv2d(bias=False)+BatchNorm2d (ResNet's block) and Linear+BatchNorm1d, then a Linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc1 = torch.nn.Linear(4, 5)
        self.bn1 = torch.nn.BatchNorm1d(5)
        self.fc = torch.nn.Linear(5, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.fc(torch.relu(self.bn1(self.fc1(h))))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("bnfold")
    torch.manual_seed(0)
    net = _Net().eval()
    with torch.no_grad():  # non-trivial statistics: the per-channel scale is far from 1
        for bn in (net.bn, net.bn1):
            bn.running_mean.normal_(0, 0.5)
            bn.running_var.uniform_(0.2, 3)
            bn.weight.normal_(1, 0.5)
            bn.bias.normal_(0, 0.3)
    x = torch.randn(2, 3, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(input_names=["x"], output_names=["y"])
        torch.onnx.export(net, (x,), str(d / "folded.onnx"), dynamo=True, external_data=False, **kw)
        torch.onnx.export(net, (x,), str(d / "kept_dynamo.onnx"), dynamo=True, optimize=False, external_data=False,
                          **kw)
        torch.onnx.export(net, (x,), str(d / "kept_ts.onnx"), dynamo=False, do_constant_folding=False, **kw)
        pm = peft.get_peft_model(copy.deepcopy(net), peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["conv", "fc1", "fc"], init_lora_weights=False)).eval()
        pm.save_pretrained(str(d / "peft_all"))
        pf = peft.get_peft_model(copy.deepcopy(net), peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["fc"], init_lora_weights=False)).eval()
        pf.save_pretrained(str(d / "peft_fc"))
    torch.save(net.state_dict(), str(d / "net.pt"))
    with torch.no_grad():
        return dict(dir=d, x=x.numpy(), base=net(x).numpy(), all=pm(x).numpy(), fc=pf(x).numpy())


def _run(module, x):
    return module(op.Tensor.from_numpy(x)).to_numpy()


def test_import_lists_the_folded_weights_by_the_rewriter_tag(case):
    m = op.import_onnx(case["dir"] / "folded.onnx")
    assert set(m.onnx_folded_norms) == FOLDED
    assert "FuseBatchNormIntoConv" in m.onnx_folded_norms["conv.weight"]
    assert "FuseBatchNormIntoGemm" in m.onnx_folded_norms["fc1.weight"]
    assert "'bn'" in m.onnx_folded_norms["conv.weight"]  # the BatchNorm's name scope
    np.testing.assert_allclose(_run(m, case["x"]), case["base"], atol=1e-5)  # oracle: torch
    for kept in ("kept_dynamo.onnx", "kept_ts.onnx"):
        assert op.import_onnx(case["dir"] / kept).onnx_folded_norms == {}


def test_peft_adapter_on_a_folded_weight_is_refused(case):
    m = op.import_onnx(case["dir"] / "folded.onnx")
    with pytest.raises(LoraError) as info:
        op.load_peft_adapter(m, case["dir"] / "peft_all")
    text = str(info.value)
    assert "'conv.weight'" in text and "'fc1.weight'" in text
    assert "FuseBatchNormIntoConv" in text and "FuseBatchNormIntoGemm" in text
    node_names = {n.name for n in m.ir_model.graph if n.op_type in ("Conv", "Gemm")}
    assert any(f"'{name}'" in text for name in node_names)
    # an adapter on a weight no BatchNorm touched still loads and equals PEFT
    adapted = op.load_peft_adapter(m, case["dir"] / "peft_fc")
    np.testing.assert_allclose(_run(adapted, case["x"]), case["fc"], atol=1e-5)


@pytest.mark.parametrize("kept", ["kept_dynamo.onnx", "kept_ts.onnx"])
def test_with_the_batchnorm_kept_peft_and_torch_weights_load(case, kept):
    m = op.import_onnx(case["dir"] / kept)
    adapted = op.load_peft_adapter(m, case["dir"] / "peft_all")
    np.testing.assert_allclose(_run(adapted, case["x"]), case["all"], atol=1e-5)  # oracle: PEFT
    loaded = load_pytorch(m, case["dir"] / "net.pt", allow_partial=True)  # num_batches_tracked has no param
    np.testing.assert_allclose(_run(loaded, case["x"]), case["base"], atol=1e-5)  # oracle: torch


@pytest.mark.parametrize("allow_partial", [False, True])
def test_load_pytorch_refuses_writing_torch_weights_into_folded_ones(case, allow_partial):
    m = op.import_onnx(case["dir"] / "folded.onnx")
    with pytest.raises(RecordError) as info:
        load_pytorch(m, case["dir"] / "net.pt", allow_partial=allow_partial)
    problems = info.value.problems
    refused = [p for p in problems if "BatchNorm the exporter folded" in p]
    assert {p.split("'")[1] for p in refused} == {"conv.weight", "fc1.weight", "fc1.bias"}
    assert not any("pass allow_partial=True" in p for p in problems)


def test_convert_refuses_a_pytorch_checkpoint_into_a_folded_graph(case, tmp_path):
    d = case["dir"]
    with pytest.raises(RecordError, match="FuseBatchNormIntoConv"):
        convert(d / "net.pt", tmp_path / "out.onnx", graph=d / "folded.onnx", allow_partial=True)
    # the file's own weights go back into it unchanged (.onnx -> .bpk -> .onnx)
    convert(d / "folded.onnx", tmp_path / "w.bpk")
    convert(tmp_path / "w.bpk", tmp_path / "back.onnx", graph=d / "folded.onnx")
    np.testing.assert_array_equal(_run(op.import_onnx(tmp_path / "back.onnx"), case["x"]),
                                  _run(op.import_onnx(d / "folded.onnx"), case["x"]))


def test_apply_lora_on_a_folded_weight_stays_allowed(case):
    m = op.import_onnx(case["dir"] / "folded.onnx")
    adapted = m.apply_lora(LoraConfig(rank=2, param_group=ParamGroup.from_paths(["fc1.weight"])))
    params = dict(adapted.named_params())
    assert params["fc1.weight"].adapter() is not None
    # B starts at zero: the adapted model is the file's (oracle: torch)
    np.testing.assert_allclose(_run(adapted, case["x"]), case["base"], atol=1e-5)


def test_a_torch_safetensors_file_is_told_by_the_folded_batchnorms_statistics(case, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    d = case["dir"]
    state = {k: v.contiguous() for k, v in torch.load(str(d / "net.pt")).items()}
    st.save_file(state, str(tmp_path / "torch.safetensors"))
    m = op.import_onnx(d / "folded.onnx")
    with pytest.raises(RecordError, match="'conv.weight' holds a BatchNorm the exporter folded"):
        load_safetensors(m, tmp_path / "torch.safetensors", allow_partial=True)
    with pytest.raises(RecordError, match="FuseBatchNormIntoGemm"):
        convert(tmp_path / "torch.safetensors", tmp_path / "out.onnx", graph=d / "folded.onnx", allow_partial=True)
    # the import's own weights written by this library load back (no BatchNorm statistics in them)
    save_safetensors(m, tmp_path / "own.safetensors")
    back = load_safetensors(op.import_onnx(d / "folded.onnx"), tmp_path / "own.safetensors")
    np.testing.assert_allclose(_run(back, case["x"]), case["base"], atol=1e-5)  # oracle: torch
