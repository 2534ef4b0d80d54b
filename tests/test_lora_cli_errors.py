"""``onnxparam lora``: the ``check`` of a ``lora="inputs"`` export, the errors users meet (a
missing ``--alpha``, ``check`` given the wrong kinds of file, a factors file whose ranks differ
or that names weights the model lacks, ``--targets`` with existing factors) and a kept file
written back as ``.bpk`` (merged) or ``.safetensors`` (kept).

Oracles: ONNX Runtime's own reading of the ``.onnx_adapter`` files (``AdapterFormat``), the
``safetensors`` package's reader, the file's initializers (``onnx.numpy_helper``) and the LoRA
formula ``W + alpha / r * a @ b`` in numpy.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from cli_run import run_cli as run
from onnx import numpy_helper

from onnxparam import LoraConfig, Module, Param, Tensor, export_onnx, write_onnx_adapter
from onnxparam.nn import Linear

ort = pytest.importorskip("onnxruntime")
RANK, ALPHA = 2, 3.0


class Net(Module):
    def __init__(self):
        self.fc = Linear(4, 5)

    def forward(self, x):
        return self.fc(x)


def _random_factors(net, seed=3):
    rng = np.random.default_rng(seed)
    return net.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(rng.normal(size=p.lazy_shape()).astype(
        np.float32)), require_grad=True) if ".lora." in path else p)


X = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)


@pytest.fixture
def inputs_export(tmp_path):
    net = _random_factors(Net().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0)))
    model = export_onnx(net, tmp_path / "inputs.onnx", X, lora="inputs")
    adapter = write_onnx_adapter(net, tmp_path / "a.onnx_adapter")
    return model, adapter


def test_check_of_an_inputs_export_lists_the_factors_ort_reads(inputs_export):
    model, adapter = inputs_export
    code, out, err = run("lora", "check", model, adapter, "--json")
    assert code == 0, err
    doc = json.loads(out)
    result = doc["results"]["check"]
    truth = {k: list(v.numpy().shape) for k, v in ort.AdapterFormat.read_adapter(str(adapter)).get_parameters().items()}
    assert result["kind"] == "inputs" and result["fits"] is True and result["inputs"] == truth
    code, out, _ = run("lora", "check", model, adapter)
    assert code == 0 and f"fits '{model}': 2 factors" in out


def test_check_refuses_an_adapter_whose_ranks_disagree_naming_it(inputs_export, tmp_path):
    model, _ = inputs_export
    bad = tmp_path / "bad.onnx_adapter"
    fmt = ort.AdapterFormat()
    fmt.set_parameters({"fc.weight.lora.a": ort.OrtValue.ortvalue_from_numpy(np.zeros((4, 2), np.float32)),
                        "fc.weight.lora.b": ort.OrtValue.ortvalue_from_numpy(np.zeros((3, 5), np.float32))})
    fmt.export_adapter(str(bad))
    code, _, err = run("lora", "check", model, bad)
    assert code == 1 and "bad.onnx_adapter" in err and "rank 2" in err and "rank 3" in err


@pytest.mark.parametrize("args, words", [
    (("--alpha", "2"), "--alpha does not apply"),
    ((), "check needs an .onnx model"),
])
def test_check_usage_errors_name_what_is_wrong(inputs_export, tmp_path, args, words):
    model, adapter = inputs_export
    src = model if args else tmp_path / "w.bpk"
    if not args:
        Net().save_file(tmp_path / "w")
    code, _, err = run("lora", "check", src, adapter, *args)
    assert code == 2 and words in err


def test_check_needs_an_onnx_adapter_file(inputs_export, tmp_path):
    model, _ = inputs_export
    code, _, err = run("lora", "check", model, tmp_path / "a.bpk")
    assert code == 2 and "check needs an .onnx_adapter file" in err


def test_merge_without_alpha_is_a_usage_error(inputs_export, tmp_path):
    model, _ = inputs_export
    code, _, err = run("lora", "merge", model, tmp_path / "m.onnx")
    assert code == 2 and "required: --alpha" in err and not (tmp_path / "m.onnx").exists()


@pytest.fixture
def plain_model(tmp_path):
    return export_onnx(Net(), tmp_path / "plain.onnx", X)


def _factors_file(path, **factors):
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in factors.items()}, str(path))
    return path


def test_a_factors_file_with_two_ranks_is_refused(plain_model, tmp_path):
    factors = _factors_file(tmp_path / "f.safetensors", **{"fc.weight.lora.a": np.zeros((4, 2)),
                                                           "fc.weight.lora.b": np.zeros((2, 5)),
                                                           "fc.bias.lora.a": np.zeros((1, 3)),
                                                           "fc.bias.lora.b": np.zeros((3, 5))})
    code, _, err = run("lora", "merge", plain_model, tmp_path / "m.onnx", "--alpha", 2, "--adapter", factors)
    assert code == 1 and "ranks [2, 3]" in err and "one rank per file" in err


def test_factors_for_a_weight_the_model_lacks_are_named(plain_model, tmp_path):
    factors = _factors_file(tmp_path / "f.safetensors", **{"fc.weight.lora.a": np.zeros((4, 2)),
                                                           "fc.weight.lora.b": np.zeros((2, 5)),
                                                           "head.weight.lora.a": np.zeros((5, 2)),
                                                           "head.weight.lora.b": np.zeros((2, 3))})
    code, _, err = run("lora", "merge", plain_model, tmp_path / "m.onnx", "--alpha", 2, "--adapter", factors)
    assert code == 1 and "lacks or cannot adapt" in err and "head.weight" in err
    assert not (tmp_path / "m.onnx").exists()


def test_targets_with_existing_factors_is_a_usage_error(plain_model, tmp_path):
    factors = _factors_file(tmp_path / "f.safetensors", **{"fc.weight.lora.a": np.zeros((4, 2)),
                                                           "fc.weight.lora.b": np.zeros((2, 5))})
    code, _, err = run("lora", "merge", plain_model, tmp_path / "m.onnx", "--alpha", 2, "--adapter", factors,
                       "--targets", "fc")
    assert code == 2 and "--targets chooses where fresh adapters go" in err


@pytest.fixture
def kept(tmp_path):
    net = _random_factors(Net().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0)))
    path = export_onnx(net, tmp_path / "kept.onnx", X, lora="keep")
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    return path, inits


def test_a_kept_file_refuses_targets(kept, tmp_path):
    path, _ = kept
    code, _, err = run("lora", "merge", path, tmp_path / "m.onnx", "--alpha", ALPHA, "--targets", "fc")
    assert code == 2 and "already has LoRA factors" in err


def test_a_kept_file_merged_into_a_burnpack_holds_the_formulas_weight(kept, tmp_path):
    from onnxparam import burnpack

    path, inits = kept
    code, _, err = run("lora", "merge", path, tmp_path / "m.bpk", "--alpha", ALPHA)
    assert code == 0, err
    with burnpack.read(tmp_path / "m.bpk") as f:
        tensors = {e.name: np.array(e.to_numpy()) for e in f}
    assert set(tensors) == {"fc.weight", "fc.bias"}  # merged: no factors left
    expected = inits["fc.weight"] + ALPHA / RANK * inits["fc.weight.lora.a"] @ inits["fc.weight.lora.b"]
    np.testing.assert_allclose(tensors["fc.weight"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(tensors["fc.bias"], inits["fc.bias"])


def test_a_kept_file_kept_into_safetensors_holds_the_files_factors(kept, tmp_path):
    from safetensors.numpy import load_file

    path, inits = kept
    code, _, err = run("lora", "keep", path, tmp_path / "k.safetensors", "--alpha", ALPHA)
    assert code == 0, err
    written = load_file(str(tmp_path / "k.safetensors"))
    for name in ("fc.weight", "fc.bias", "fc.weight.lora.a", "fc.weight.lora.b"):
        np.testing.assert_array_equal(written[name], inits[name])
