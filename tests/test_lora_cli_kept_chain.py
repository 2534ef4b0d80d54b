"""The CLI chain a user runs: ``onnxparam lora keep`` on an exported model, the kept file's
factors trained (here: replaced by random values), then ``lora merge`` / ``lora adapter`` on
that kept file read the factors its import finds.

Oracles: the kept file's initializers read with ``onnx.numpy_helper`` and the LoRA formula
``W + alpha / r * a @ b`` (Hu et al. 2021) in numpy; plain ONNX Runtime on the kept file;
ONNX Runtime's own ``LoraAdapter`` loading the written ``.onnx_adapter``.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import onnxparam as op
from onnxparam.cli import main
from onnxparam.nn import Linear

RANK, ALPHA = 4, 8.0


class Mlp(op.Module):
    def __init__(self):
        self.fc1 = Linear(6, 10)
        self.fc2 = Linear(10, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def cli(*args) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def plain(path, x, options=None) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x}, options)[0]


@pytest.fixture
def trained(tmp_path):
    """A kept file written by ``onnxparam lora keep``, its ``b`` factors then set nonzero."""
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    base = op.export_onnx(Mlp(), tmp_path / "base.onnx", x)
    code, _, err = cli("lora", "keep", base, tmp_path / "k.onnx", "--rank", RANK, "--alpha", ALPHA)
    assert code == 0, err
    model = onnx.load(str(tmp_path / "k.onnx"))
    rng = np.random.default_rng(1)
    for init in model.graph.initializer:
        if init.name.endswith(".lora.b"):
            init.CopyFrom(numpy_helper.from_array(rng.normal(size=tuple(init.dims)).astype(np.float32), init.name))
    path = tmp_path / "trained.onnx"
    onnx.save(model, str(path))
    return path, {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}, x


def test_lora_merge_of_a_cli_kept_file_folds_its_factors_as_the_formula_says(trained, tmp_path):
    path, w, x = trained
    code, out, err = cli("lora", "merge", path, tmp_path / "m.onnx", "--alpha", ALPHA)
    assert code == 0, err
    assert f"2 adapted weights, rank {RANK}, alpha {ALPHA:g} (scale {ALPHA / RANK:g}); factors kept in {path}" in out
    scale = ALPHA / RANK

    def merged(name):
        return w[name] + scale * w[f"{name}.lora.a"] @ w[f"{name}.lora.b"]

    want = np.maximum(x @ merged("fc1.weight") + w["fc1.bias"], 0) @ merged("fc2.weight") + w["fc2.bias"]
    got = plain(tmp_path / "m.onnx", x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, plain(path, x), rtol=1e-5, atol=1e-5)
    assert not [i.name for i in onnx.load(str(tmp_path / "m.onnx")).graph.initializer if ".lora." in i.name]


def test_lora_adapter_of_a_cli_kept_file_runs_in_ort_as_the_kept_file(trained, tmp_path):
    path, _, x = trained
    code, _, err = cli("lora", "adapter", path, tmp_path / "k.onnx_adapter", "--alpha", ALPHA)
    assert code == 0, err
    # one inputs export of the base serves the adapter: ORT's LoraAdapter feeds its factors
    inputs = op.export_onnx(op.import_onnx(tmp_path / "base.onnx").apply_lora(op.LoraConfig(RANK, ALPHA)),
                            tmp_path / "i.onnx", lora="inputs")
    adapter = ort.LoraAdapter()
    adapter.Load(str(tmp_path / "k.onnx_adapter"))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    np.testing.assert_allclose(plain(inputs, x, options), plain(path, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plain(inputs, x), plain(tmp_path / "base.onnx", x), rtol=1e-6, atol=1e-6)
