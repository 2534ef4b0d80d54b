"""``onnxparam lora merge|keep|adapter`` on an ONNX file that already holds kept LoRA factors
(a ``lora="keep"`` export): the factors are used as they are, and ``--alpha`` must give the
scale the file records.

Oracles: the file's own initializers read with ``onnx.numpy_helper`` (the weight ``W``, the
factors ``a`` / ``b``) and the LoRA formula ``x @ (W + alpha / r * a @ b)``, run by plain
ONNX Runtime; the ``.onnx_adapter`` file as ONNX Runtime reads it back (``a`` and
``alpha / r * b``).
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxparam import LoraConfig, Module, Param, Tensor, export_onnx
from onnxparam.cli import main
from onnxparam.nn import Linear

RANK, ALPHA = 2, 3.0


class Net(Module):
    def __init__(self):
        self.fc = Linear(4, 5)

    def forward(self, x):
        return self.fc(x)


def run(*args) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def kept(tmp_path):
    rng = np.random.default_rng(3)
    net = Net().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0)).map(
        lambda path, p: Param(p.id, value=Tensor.from_numpy(rng.normal(size=p.lazy_shape()).astype(np.float32)),
                              require_grad=True) if ".lora." in path else p)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    path = export_onnx(net, tmp_path / "kept.onnx", x, lora="keep")
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    return path, inits, x


def test_merge_of_a_kept_onnx_file_uses_its_factors(kept, tmp_path):
    path, inits, x = kept
    code, out, err = run("lora", "merge", path, tmp_path / "merged.onnx", "--alpha", ALPHA)
    assert code == 0, err
    assert f"factors kept in {path}" in out
    got = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    w = inits["fc.weight"] + ALPHA / RANK * inits["fc.weight.lora.a"] @ inits["fc.weight.lora.b"]
    np.testing.assert_allclose(got, x @ w + inits["fc.bias"], rtol=1e-5, atol=1e-5)


def test_adapter_of_a_kept_onnx_file_holds_a_and_the_scaled_b(kept, tmp_path):
    path, inits, _ = kept
    code, _, err = run("lora", "adapter", path, tmp_path / "a.onnx_adapter", "--alpha", ALPHA)
    assert code == 0, err
    params = {k: v.numpy() for k, v in ort.AdapterFormat.read_adapter(str(tmp_path / "a.onnx_adapter"))
              .get_parameters().items()}
    np.testing.assert_array_equal(params["fc.weight.lora.a"], inits["fc.weight.lora.a"])
    np.testing.assert_allclose(params["fc.weight.lora.b"], ALPHA / RANK * inits["fc.weight.lora.b"], rtol=1e-6)


def test_an_alpha_that_disagrees_with_the_kept_scale_is_refused(kept, tmp_path):
    path, _, _ = kept
    code, _, err = run("lora", "adapter", path, tmp_path / "a.onnx_adapter", "--alpha", 5)
    assert code != 0
    assert f"--alpha 5 gives scale 2.5 at rank 2, but '{path}' records scale 1.5 for 'fc.weight' (alpha 3)" in err
    assert not (tmp_path / "a.onnx_adapter").exists()
    code, _, err = run("lora", "keep", path, tmp_path / "k.onnx", "--alpha", ALPHA, "--rank", 4)
    assert code != 0 and "--rank 4 does not match the LoRA factors" in err
