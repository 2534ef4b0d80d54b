"""``load_pytorch`` into an imported model maps the weights torch's exporter renamed
(``onnx::MatMul_N``: a bias-free ``nn.Linear``'s folded transpose, a tied ``lm_head``) to their
checkpoint tensors by evidence only (the node naming the module, shapes, equal values), and
reports, without guessing, what the evidence does not decide (a square weight whose checkpoint
values differ from the file's; two checkpoint tensors with the same values).

Oracles: torch itself (the exported module's forward on the checkpoint loaded, the module's own
tie), and numpy on the matrices the test writes for the hand-made graphs.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.convert import LoadReport, load_pytorch

VOCAB, DIM, HID, SEQ = 11, 4, 6, 5


def _torch():
    return pytest.importorskip("torch")


def _tiny_lm(square: bool = False):
    torch = _torch()

    class TinyLm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(VOCAB, DIM)
            self.up = torch.nn.Linear(DIM, DIM if square else HID, bias=False)   # folded, renamed
            self.down = torch.nn.Linear(DIM if square else HID, DIM)            # with a bias: MatMul + Add on 3-d
            self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight                               # tied, as GPT-2's

        def forward(self, ids):
            return self.lm_head(self.down(torch.relu(self.up(self.wte(ids)))))

    torch.manual_seed(0)
    return TinyLm().eval()


def _export(model, path):
    torch = _torch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, SEQ, dtype=torch.int64),), str(path), input_names=["ids"],
                          output_names=["logits"], opset_version=17, dynamo=False)
    return op.import_onnx(path)


def _perturbed(model):
    torch = _torch()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # a fine-tuned checkpoint: no value equals the file's
    return model


def _runs_as_torch(loaded, model) -> None:
    """``loaded`` (the imported graph with a checkpoint loaded) computes ``model``'s forward."""
    torch = _torch()
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(1, SEQ)).astype(np.int64)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(loaded(op.Tensor.from_numpy(ids)).to_numpy(), expected, rtol=1e-5, atol=1e-5)


def test_a_fine_tuned_checkpoint_loads_into_the_renamed_weights_and_runs_as_torch(tmp_path):
    torch = _torch()
    model = _tiny_lm()
    imported = _export(model, tmp_path / "lm.onnx")
    renamed = sorted(n for n in imported.onnx_names.values() if n.startswith("onnx::"))
    assert len(renamed) >= 2, imported.onnx_names  # precondition: the exporter renamed the folded weights
    tuned = _perturbed(model)
    torch.save(tuned.state_dict(), tmp_path / "tuned.pt")
    report = LoadReport()
    loaded = load_pytorch(imported, tmp_path / "tuned.pt", report=report)
    _runs_as_torch(loaded, tuned)
    sources = dict(report.renamed)
    assert {"up.weight", "lm_head.weight"} <= set(sources)
    assert {imported.onnx_names[sources[s]] for s in ("up.weight", "lm_head.weight")} <= set(renamed)
    assert {p for p, _, _ in report.transposed} >= {sources["up.weight"], sources["lm_head.weight"]}
    assert not report.undecided and not report.missing


def test_the_exported_checkpoint_decides_a_square_weight_by_its_values_a_fine_tuned_one_is_reported(tmp_path):
    model = _tiny_lm(square=True)
    imported = _export(model, tmp_path / "sq.onnx")
    report = LoadReport()
    loaded = load_pytorch(imported, dict(model.state_dict()), report=report)  # the very weights exported
    assert not report.undecided and not report.missing
    _runs_as_torch(loaded, model)

    tuned = dict(_perturbed(model).state_dict())
    report = LoadReport()
    with pytest.raises(op.RecordError, match=r"square \(4x4\).*neither as stored nor transposed") as info:
        load_pytorch(imported, tuned, report=report)
    undecided = dict(report.undecided)  # up (bias-free) and down (bias added after a MatMul): both square
    named = {next(s for s in ("up.weight", "down.weight") if f"'{s}'" in why): path for path, why in undecided.items()}
    assert set(named) == {"up.weight", "down.weight"}
    for source, path in named.items():
        assert imported.onnx_names[path].startswith("onnx::")
        assert path in str(info.value) and path in report.missing
        assert source in report.unused  # never loaded into it by a guess


def _two_renamed(first, second):
    """``y = x @ onnx::MatMul_1 @ onnx::MatMul_2``: unnamed nodes, so only values can tell."""
    inits = [numpy_helper.from_array(first, "onnx::MatMul_1"), numpy_helper.from_array(second, "onnx::MatMul_2")]
    nodes = [helper.make_node("MatMul", ["x", "onnx::MatMul_1"], ["h"]),
             helper.make_node("MatMul", ["h", "onnx::MatMul_2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    return op.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_without_node_names_equal_values_decide_and_equal_twins_are_reported():
    rng = np.random.default_rng(0)
    w1, w2 = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    imported = _two_renamed(w1, w2)
    state = {"a.weight": np.ascontiguousarray(w1.T), "b.weight": np.ascontiguousarray(w2.T)}  # torch (out, in)
    report = LoadReport()
    loaded = load_pytorch(imported, state, report=report)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    np.testing.assert_allclose(loaded(op.Tensor.from_numpy(x)).to_numpy(), x @ w1 @ w2, rtol=1e-5)
    assert {imported.onnx_names[p]: s for s, p in report.renamed} == {"onnx::MatMul_1": "a.weight",
                                                                      "onnx::MatMul_2": "b.weight"}

    twin = dict(state, c_weight_copy=state["a.weight"].copy())  # two tensors with the first one's values
    report = LoadReport()
    loaded = load_pytorch(imported, twin, report=report, allow_partial=True)
    undecided = dict(report.undecided)
    first = imported.path_of("onnx::MatMul_1")
    assert "several checkpoint tensors" in undecided[first] and "'a.weight'" in undecided[first]
    assert first in report.missing and {"a.weight", "c_weight_copy"} <= set(report.unused)
    np.testing.assert_array_equal(loaded.param_of("onnx::MatMul_1").val().to_numpy(), w1)  # kept as it was


def test_a_checkpoint_with_nothing_of_the_renamed_weights_shape_leaves_it_missing_without_a_reason():
    rng = np.random.default_rng(0)
    imported = _two_renamed(rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32))
    report = LoadReport()
    load_pytorch(imported, {"other.weight": np.zeros((7, 7), np.float32)}, report=report, allow_partial=True)
    assert len(report.missing) == 2 and not report.undecided and report.unused == ["other.weight"]


def test_a_checkpoint_storing_a_tied_head_once_fills_it_from_the_table_the_file_ties_it_to(tmp_path):
    """``safetensors.torch.save_model`` (as Hugging Face's ``model.safetensors``) keeps one tensor
    of a tied pair: the other side comes from it, transposed, because the ONNX file ties them
    (its head's values are the table's transposed)."""
    _torch()
    from safetensors.torch import save_model

    from onnxparam.convert import load_safetensors

    model = _tiny_lm()
    imported = _export(model, tmp_path / "lm.onnx")
    tuned = _perturbed(model)
    save_model(tuned, str(tmp_path / "model.safetensors"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        stored = set(f.keys())
    assert len(stored & {"wte.weight", "lm_head.weight"}) == 1  # precondition: the tied pair stored once
    report = LoadReport()
    loaded = load_safetensors(imported, tmp_path / "model.safetensors", report=report)
    _runs_as_torch(loaded, tuned)
    assert not report.undecided and not report.missing
    (kept,) = stored & {"wte.weight", "lm_head.weight"}
    filled = {path for source, path in report.renamed if source == kept}
    assert imported.path_of("wte.weight") in filled or kept == "wte.weight"
    assert any(imported.onnx_names[p].startswith("onnx::") for p in filled)  # the folded head
