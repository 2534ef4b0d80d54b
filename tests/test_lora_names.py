"""LoRA factors of an imported model are named after its weights as the file spells them
(``onnx::MatMul_7.lora.a``), in every export mode and in ``.onnx_adapter`` files, so
``onnxparam inspect`` escapes them once, as it does their weights.

Oracles: the source file's initializer names, the numpy formula of the adapted layer
(``x @ (W + scale * a @ b)``) run by plain ONNX Runtime, and the name escaping of the weight's
own row in ``inspect``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxparam import LoraConfig, Param, Quantizer, QuantScheme, Tensor, export_onnx, import_onnx, write_onnx_adapter
from onnxparam.cli import inspect_file
from onnxparam.onnx_io import onnx_name_to_path

WEIGHT = "onnx::MatMul_7"  # how torch's TorchScript exporter names a folded nn.Linear weight
RANK, ALPHA = 2, 3.0


@pytest.fixture
def imported(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 5)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", WEIGHT], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
                              initializer=[numpy_helper.from_array(w, WEIGHT)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "src.onnx"))
    adapted = import_onnx(tmp_path / "src.onnx").apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0)).map(
        lambda path, p: Param(p.id, value=Tensor.from_numpy(rng.normal(size=p.lazy_shape()).astype(np.float32)),
                              require_grad=True) if ".lora." in path else p)
    return adapted, w, rng.normal(size=(3, 4)).astype(np.float32)


def factors(module):
    params = dict(module.named_params())
    path = next(p for p in params if p.endswith(".lora.a"))[: -len(".lora.a")]
    return path, params[path + ".lora.a"].val().to_numpy(), params[path + ".lora.b"].val().to_numpy()


def test_inputs_export_and_adapter_file_name_factors_after_the_files_weight_name(imported, tmp_path):
    adapted, w, x = imported
    path = export_onnx(adapted, tmp_path / "inputs.onnx", x, lora="inputs")
    assert [v.name for v in onnx.load(str(path)).graph.input] == ["x", f"{WEIGHT}.lora.a", f"{WEIGHT}.lora.b"]
    file = write_onnx_adapter(adapted, tmp_path / "a.onnx_adapter")
    assert set(ort.AdapterFormat.read_adapter(str(file)).get_parameters()) == {f"{WEIGHT}.lora.a", f"{WEIGHT}.lora.b"}
    lora = ort.LoraAdapter()
    lora.Load(str(file))
    options = ort.RunOptions()
    options.add_active_adapter(lora)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x}, options)[0]
    _, a, b = factors(adapted)
    np.testing.assert_allclose(got, x @ (w + ALPHA / RANK * a @ b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("quantized", [False, True], ids=["keep", "qlora-keep"])
def test_inspect_shows_kept_factor_names_escaped_once_like_their_weight(imported, tmp_path, quantized):
    """A QLoRA base is traced (not the source graph rewritten): both paths name the factors
    after the file's weight name, and ``inspect`` escapes them as it escapes the weight."""
    adapted, w, x = imported
    if quantized:
        base = import_onnx(tmp_path / "src.onnx")
        adapted = base.apply_qlora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0), Quantizer(QuantScheme()))
    path = export_onnx(adapted, tmp_path / "kept.onnx", x, lora="keep")
    names = {i.name for i in onnx.load(str(path)).graph.initializer}
    assert {f"{WEIGHT}.lora.a", f"{WEIGHT}.lora.b"} <= names
    listed = [t["name"] for t in inspect_file(path)["tensors"]]
    escaped = onnx_name_to_path(WEIGHT)  # how inspect lists the weight (escaped once)
    assert escaped == "onnx_x3a__x3a_MatMul_7"
    if not quantized:  # (an int8 base is no float tensor row)
        assert escaped in listed
    assert sorted(n for n in listed if ".lora." in n) == [f"{escaped}.lora.a", f"{escaped}.lora.b"]
    assert "_x5f_" not in " ".join(listed)  # an escaped name escaped again


def test_a_kept_export_imported_and_kept_again_has_no_leftover_initializers(imported, tmp_path):
    adapted, w, x = imported
    first = export_onnx(adapted, tmp_path / "kept.onnx", x, lora="keep")
    again = import_onnx(first)
    second = export_onnx(again, tmp_path / "kept-again.onnx", x, lora="keep")
    model = onnx.load(str(second))
    used = {name for node in model.graph.node for name in node.input}
    assert sorted(i.name for i in model.graph.initializer if i.name not in used) == []
    assert sorted(i.name for i in model.graph.initializer) == sorted(
        [WEIGHT] + [f"{WEIGHT}.lora.{s}" for s in ("a", "b", "scale")])
    _, a, b = factors(adapted)
    got = ort.InferenceSession(str(second), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x @ (w + ALPHA / RANK * a @ b), rtol=1e-4, atol=1e-5)
