"""``onnxparam lora adapter`` writing burnpack and safetensors adapter files, and the fresh
adapters' refusals, run in this process (so coverage sees the CLI).

Oracles: Burn's MNIST ``model.bpk`` (its weights' shapes, decoded with ``cbor2`` / read with
the safetensors library), the LoRA paper's init (Hu et al. 2021: ``B = 0``, so a fresh adapter
changes nothing) and the two files agreeing tensor by tensor.
"""

from __future__ import annotations

import contextlib
import io
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file as st_load

import onnxparam.burnpack
from onnxparam.cli import main
from onnxparam.zoo import mnist

RANK = 4
FC_SHAPES = {"fc1.weight": (1600, 128), "fc2.weight": (128, 128), "fc3.weight": (128, 10)}
"""Burn's MNIST linear weights, ``(d_input, d_output)`` (Burn's ``Linear`` layout)."""


def run(*args, cwd) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def work(tmp_path):
    shutil.copyfile(mnist.weights_path(), tmp_path / "model.bpk")
    return tmp_path


def test_fresh_adapters_written_as_burnpack_and_safetensors_hold_only_the_factors_of_the_targets(work):
    for name in ("lora.bpk", "lora.safetensors"):
        code, out, err = run("lora", "adapter", "model.bpk", name, "--zoo", "mnist", "--rank", RANK, "--alpha", 8,
                             "--targets", r"fc\d\.weight", cwd=work)
        assert code == 0, err
        assert f"lora:      3 adapted weights, rank {RANK}, alpha 8 (scale 2); fresh adapters (seed 0)" in out
    from_st = st_load(str(work / "lora.safetensors"))
    with onnxparam.burnpack.read(work / "lora.bpk") as bpk:
        from_bpk = {entry.name: entry.to_numpy().copy() for entry in bpk}
    expected = {}
    for path, (d_in, d_out) in FC_SHAPES.items():
        expected[f"{path}.lora.a"] = (d_in, RANK)
        expected[f"{path}.lora.b"] = (RANK, d_out)
    assert {k: v.shape for k, v in from_st.items()} == expected
    assert {k: v.shape for k, v in from_bpk.items()} == expected
    for name, array in from_st.items():
        np.testing.assert_array_equal(from_bpk[name], array)  # the same factors in both files
        if name.endswith(".lora.b"):
            assert not array.any()  # B = 0: a fresh adapter starts as the base model
        else:
            assert array.std() > 0


def test_targets_that_match_no_weight_are_refused_naming_the_model(work):
    code, _, err = run("lora", "adapter", "model.bpk", "lora.bpk", "--zoo", "mnist", "--rank", 2, "--alpha", 4,
                       "--targets", "nothing_here", cwd=work)
    assert code == 1
    assert "no rank-2 float weight of 'model.bpk' matches the LoRA targets; nothing to adapt" in err
    assert not (work / "lora.bpk").exists()


def test_an_adapter_written_to_an_onnx_file_is_refused_naming_the_file(work):
    code, _, err = run("lora", "adapter", "model.bpk", "lora.onnx", "--zoo", "mnist", "--rank", 2, "--alpha", 4,
                       cwd=work)
    assert code == 1
    assert "output file 'lora.onnx': cannot tell the format from the extension '.onnx'" in err
    assert not (work / "lora.onnx").exists()
