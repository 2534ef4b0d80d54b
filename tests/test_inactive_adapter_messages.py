"""Messages for a module whose named adapters are all inactive, a missing ``.onnx_adapter`` for
``inspect``, and ``adapter_index`` inside ``grad`` (fresh8 F9). Oracles: the file written is the
base model in plain ONNX Runtime; the message texts the README promises."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam import LoraConfig, LoraError, RecordError
from onnxparam.autodiff import grad

ort = pytest.importorskip("onnxruntime")


@pytest.fixture()
def named(tmp_path):
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "fc.weight"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "fc.weight")])
    path = tmp_path / "base.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    base = op.import_onnx(path)
    m = base
    for name in ("sql", "chat"):
        m = m.add_adapter(name, base.apply_lora(LoraConfig(rank=2)))
    return path, m, rng.standard_normal((2, 3)).astype(np.float32)


def test_writers_say_no_adapter_is_active(named, tmp_path):
    _, m, _ = named
    with pytest.raises(LoraError, match=r"named adapters \('sql', 'chat'\) but none is active: set_adapter"):
        op.write_onnx_adapter(m, tmp_path / "a.onnx_adapter")
    with pytest.raises(RecordError, match=r"named adapters \('sql', 'chat'\) but none is active"):
        op.save_peft_adapter(m, tmp_path / "peft")


def test_export_of_inactive_adapters_keep_refused_merge_is_the_base(named, tmp_path):
    path, m, x = named
    with pytest.raises(LoraError, match="lora='keep'.*none is active, so the file would hold the base model"):
        op.export_onnx(m, tmp_path / "k.onnx", op.Tensor.from_numpy(x), lora="keep")
    op.export_onnx(m, tmp_path / "m.onnx", op.Tensor.from_numpy(x))  # merge: the way to export the base

    def run(f):
        return ort.InferenceSession(str(f), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    np.testing.assert_array_equal(run(tmp_path / "m.onnx"), run(path))  # oracle: the base file


def test_adapter_index_inside_grad_says_inference_only(named):
    _, m, x = named
    with pytest.raises(op.CallArgumentError, match="adapter_index .* is for inference only"):
        grad(lambda mod, t: (mod(t, adapter_index=["sql", "chat"]) ** 2).sum(), m, op.Tensor.from_numpy(x))


def test_inspect_of_a_missing_onnx_adapter_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "missing.onnx_adapter"
    done = subprocess.run([sys.executable, "-m", "onnxparam", "inspect", str(missing)], capture_output=True,
                          text=True)
    assert done.returncode != 0
    assert f"input file '{missing}' does not exist" in done.stderr


def test_cli_lora_names_a_peft_adapter_file_given_as_adapter(named, tmp_path):
    path, m, _ = named
    folder = tmp_path / "peft"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    from safetensors.numpy import save_file

    save_file({"base_model.model.fc.lora_A.weight": np.zeros((2, 3), np.float32)},
              str(folder / "adapter_model.safetensors"))
    done = subprocess.run([sys.executable, "-m", "onnxparam", "lora", "merge", str(path), str(tmp_path / "o.onnx"),
                           "--alpha", "4", "--adapter", str(folder / "adapter_model.safetensors")],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "it is a PEFT adapter (adapter_config.json beside it): load its folder with onnxparam.load_peft_adapter" \
        in done.stderr
