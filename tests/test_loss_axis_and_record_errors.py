"""Paths users reach that no test ran: ``cross_entropy`` with the class axis in the middle
(segmentation-style ``(N, C, L)`` logits) and its target-shape errors; ``SaveReport``'s text;
saving two params under one name (a ``remap`` clash); loading a Burn-layout file with the
PyTorch adapter (the hint says the adapter transposed it); a missing tensor whose leaf name an
unused one shares (the hint names it).

Oracles: numpy's formula for the loss (float64 log-softmax), the ``safetensors`` package's
reading of the written file, and the layouts the test writes.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam.autodiff import cross_entropy
from onnxparam.convert import load_safetensors, save_safetensors
from onnxparam.nn import Linear

RNG = np.random.default_rng(0)


def test_cross_entropy_over_a_middle_class_axis_equals_numpy():
    logits = RNG.normal(size=(2, 5, 3)).astype(np.float32)  # (N, C, L)
    targets = RNG.integers(0, 5, size=(2, 3)).astype(np.int64)  # (N, L)
    x = logits.astype(np.float64)
    logp = x - np.log(np.exp(x).sum(1, keepdims=True))
    picked = np.take_along_axis(logp, targets[:, None, :], 1)
    got = cross_entropy(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(targets), dim=1)
    np.testing.assert_allclose(float(got.to_numpy()), -picked.mean(), rtol=1e-6)


def test_cross_entropy_names_a_target_shape_that_fits_neither_form():
    logits = op.Tensor.from_numpy(RNG.normal(size=(4, 3)).astype(np.float32))
    with pytest.raises(ValueError, match=r"class-index targets must have shape \[4\] for logits \[4, 3\]; got \[4, 3\]"):
        cross_entropy(logits, op.Tensor.from_numpy(np.zeros((4, 3), np.int64)))
    with pytest.raises(ValueError, match=r"probability targets must have the logits' shape \[4, 3\]; got \[4\]"):
        cross_entropy(logits, op.Tensor.from_numpy(np.zeros(4, np.float32)))


class Two(op.Module):
    def __init__(self):
        self.fc1 = Linear(3, 4)
        self.fc2 = Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def test_save_report_text_lists_the_transposed_weights_as_the_file_holds_them(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "t.safetensors"
    report = save_safetensors(Two(), path, adapter="pytorch")
    with safe_open(str(path), "np") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    text = str(report)
    assert text.startswith(f"SaveReport to '{path}': 4 saved") and "2 transposed" in text
    assert shapes["fc1.weight"] == [4, 3] and shapes["fc2.weight"] == [2, 4]  # PyTorch's (out, in)
    lines = text.splitlines()
    for name in ("fc1.weight", "fc2.weight"):
        module_shape = shapes[name][::-1]
        assert f"    {name} {module_shape} -> {shapes[name]}" in lines
    saved = lines[lines.index("  saved (4):") + 1:]
    assert sorted(line.strip() for line in saved) == sorted(shapes)  # the file's tensors (safetensors sorts its keys)


def test_saving_two_params_under_one_name_names_both(tmp_path):
    with pytest.raises(op.RecordError, match=r"name clash: params 'fc1.weight' and 'fc2.weight' are both saved as "
                                             r"'fc.weight'"):
        save_safetensors(Two(), tmp_path / "c.safetensors", remap=[(r"^fc\d", "fc")])
    assert not (tmp_path / "c.safetensors").exists()


class BiasFree(op.Module):
    def __init__(self):
        self.fc = Linear(3, 4, bias=False)  # no bias: nothing in the file tells its layout

    def forward(self, x):
        return self.fc(x)


def test_a_burn_layout_file_loaded_with_the_pytorch_adapter_says_the_adapter_transposed_it(tmp_path):
    path = tmp_path / "burn.safetensors"
    save_safetensors(BiasFree(), path)  # Burn's (in, out)
    with pytest.raises(op.RecordError, match=r"shape mismatch for 'fc.weight'.*the adapter transposed it: the file "
                                             r"already stores it as the module does"):
        load_safetensors(BiasFree(), path, adapter="pytorch")


def test_a_missing_tensor_names_an_unused_one_with_the_same_leaf(tmp_path):
    path = tmp_path / "renamed.safetensors"
    save_safetensors(Two(), path, remap=[(r"^fc1\.", "layer1.")])
    with pytest.raises(op.RecordError, match=r"missing tensor 'fc1.weight'.*unused tensors with the same leaf name "
                                             r"\('layer1.weight'"):
        load_safetensors(Two(), path)
