"""``convert(src, dst, graph=..., allow_partial=True)`` / ``onnxparam convert --graph --allow-partial``
report every source tensor the template did not take and every template weight that kept its
old values, and never count them as written.

Oracle: a torch ``Conv -> BatchNorm -> ReLU -> Flatten -> Linear`` exported by torch's own ONNX
exporter in eval mode, which folds the BatchNorm into the Conv (new initializers, not named after
the state dict). The expected lists come from ``state_dict()`` names and the initializers that the
``onnx`` package reads from the exported file; written values are read back with ``onnx``.
"""

import contextlib
import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")

from onnxparam.cli import main  # noqa: E402
from onnxparam.convert import convert  # noqa: E402
from onnxparam.core.errors import RecordError  # noqa: E402


class _Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5))

    def forward(self, x):
        return self.body(x)


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    """``(state dict .pt, exported .onnx, state dict, the .onnx's initializers)``; the
    checkpoint's weights differ from the exported model's (a second random init)."""
    folder = tmp_path_factory.mktemp("folded")
    torch.manual_seed(0)
    exported = _Cnn().eval()
    with torch.no_grad():
        exported.body[1].running_mean.uniform_(-1, 1)
        exported.body[1].running_var.uniform_(0.5, 2)
    onnx_path = folder / "cnn.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(None):
        warnings.simplefilter("ignore")
        torch.onnx.export(exported, (torch.rand(1, 3, 6, 6),), str(onnx_path), dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.EVAL, do_constant_folding=True)
    torch.manual_seed(1)
    state = {k: v.clone() for k, v in _Cnn().state_dict().items()}
    pt = folder / "cnn.pt"
    torch.save(state, pt)
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(onnx_path)).graph.initializer}
    return pt, onnx_path, state, inits


def test_folded_batchnorm_is_listed_as_not_written_and_the_folded_conv_as_kept(folded, tmp_path):
    pt, onnx_path, state, inits = folded
    taken = [k for k in state if k in inits]
    not_taken = [k for k in state if k not in inits]
    kept_old = [k for k in inits if k not in state]
    assert taken and not_taken and kept_old  # the exporter folded the BatchNorm into new initializers

    report = convert(pt, tmp_path / "w.onnx", graph=onnx_path, allow_partial=True)
    assert report.tensors == taken
    assert report.unused == not_taken
    assert [onnx_name for _, onnx_name in report.missing] == kept_old
    written = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "w.onnx")).graph.initializer}
    for name in taken:
        np.testing.assert_array_equal(written[name], state[name].numpy())
    for name in kept_old:  # the graph's own (folded) values, unchanged
        np.testing.assert_array_equal(written[name], inits[name])
    text = str(report)
    assert f"{len(taken)} tensors written" in text
    assert all(name in text for name in not_taken)


def test_without_allow_partial_the_mismatch_is_an_error_naming_both_sides(folded, tmp_path):
    pt, onnx_path, state, inits = folded
    with pytest.raises(RecordError) as info:
        convert(pt, tmp_path / "w.onnx", graph=onnx_path)
    message = str(info.value)
    for name in (k for k in state if k not in inits):
        assert f"'{name}'" in message
    for name in (k for k in inits if k not in state):
        assert repr(name) in message
    assert not (tmp_path / "w.onnx").exists()


def test_cli_json_lists_unused_and_missing_and_counts_only_written(folded, tmp_path, capsys):
    pt, onnx_path, state, inits = folded
    code = main(["convert", str(pt), str(tmp_path / "w.onnx"), "--graph", str(onnx_path), "--allow-partial", "-q",
                 "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    report = doc["results"]["report"]
    assert report["tensors"] == [k for k in state if k in inits]
    assert report["unused"] == [k for k in state if k not in inits]
    assert [onnx_name for _, onnx_name in report["missing"]] == [k for k in inits if k not in state]


def test_zero_copy_into_the_template_reports_the_same(folded, tmp_path):
    pt, onnx_path, state, inits = folded
    from safetensors.numpy import save_file

    save_file({k: v.numpy() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    report = convert(tmp_path / "w.safetensors", tmp_path / "w.onnx", graph=onnx_path, allow_partial=True,
                     zero_copy=True)
    # the safetensors package writes tensors sorted by name: compare as sets
    assert sorted(report.tensors) == sorted(k for k in state if k in inits)
    assert sorted(report.unused) == sorted(k for k in state if k not in inits)
    assert sorted(n for _, n in report.missing) == sorted(k for k in inits if k not in state)
