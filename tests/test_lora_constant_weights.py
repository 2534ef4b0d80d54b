"""LoRA on weights stored as ``Constant`` nodes (Paddle's exports, e.g. PP-OCRv4's recognizer:
every weight a ``Constant`` output, no initializer): the graph evidence of how a weight is used
(``MatMul`` B, ``Gemm`` ``transB``, ``Transpose -> MatMul``) is read for them exactly as for
initializers, so ``apply_lora``, PEFT loading and the kept / merged exports treat them alike.

Oracles: numpy on the matrices the test writes (``x @ W + scale * x @ a @ b``; PyTorch's
``W_torch + scale * B @ A`` for PEFT factors) and plain ONNX Runtime on the exported files.
"""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file, save_file

import onnxparam as op
from onnxparam import LoraConfig, Param, Tensor, export_onnx, import_onnx, load_peft_adapter

RANK, ALPHA = 2, 3.0
SCALE = ALPHA / RANK
ATOL = 1e-5


def constant(name: str, array: np.ndarray):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def matmul_and_gemm_model(w_mm: np.ndarray, w_t: np.ndarray) -> onnx.ModelProto:
    """``y = x @ w_mm + x @ w_t.T`` with both weights in ``Constant`` nodes: ``fc.weight`` (``w_mm``,
    ``(in, out)``) as ``MatMul`` B, ``gt.weight`` (``w_t``, ``(out, in)``) as ``Gemm`` B with ``transB=1``."""
    d_in, d_out = w_mm.shape
    nodes = [constant("fc.weight", w_mm), constant("gt.weight", w_t),
             helper.make_node("MatMul", ["x", "fc.weight"], ["h"]),
             helper.make_node("Gemm", ["x", "gt.weight"], ["g"], transB=1),
             helper.make_node("Add", ["h", "g"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d_in])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", d_out])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture
def case():
    rng = np.random.default_rng(7)
    w_mm = rng.normal(size=(6, 5)).astype(np.float32)
    w_t = rng.normal(size=(5, 6)).astype(np.float32)
    x = rng.normal(size=(3, 6)).astype(np.float32)
    return w_mm, w_t, x


def test_constant_node_weights_get_their_layout_from_the_node_using_them(case):
    w_mm, w_t, _ = case
    imported = import_onnx(matmul_and_gemm_model(w_mm, w_t))
    assert imported.lora_weight_layouts() == {"fc.weight": "in_out", "gt.weight": "out_in"}
    assert imported.lora_transposed_paths() == ["gt.weight"]


def test_apply_lora_on_constant_weights_equals_numpy_in_calls_and_plain_ort_exports(case, tmp_path):
    w_mm, w_t, x = case
    imported = import_onnx(matmul_and_gemm_model(w_mm, w_t))
    adapted = imported.apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0))
    rng = np.random.default_rng(1)

    def fill(path, param):  # b is zero after apply_lora: give every factor nonzero values
        if path.endswith((".lora.a", ".lora.b")):
            value = rng.normal(0.0, 0.5, size=param.lazy_shape()).astype(np.float32)
            return Param(param.id, value=Tensor.from_numpy(value), require_grad=param.require_grad)
        return param

    adapted = adapted.map(fill)
    params = {p: q.val().to_numpy() for p, q in adapted.named_params()}
    assert sorted(p for p in params if ".lora." in p) == ["fc.weight.lora.a", "fc.weight.lora.b", "gt.weight.lora.a", "gt.weight.lora.b"]
    assert params["fc.weight.lora.a"].shape == (6, RANK) and params["gt.weight.lora.b"].shape == (RANK, 5)
    expected = (x @ w_mm + SCALE * x @ params["fc.weight.lora.a"] @ params["fc.weight.lora.b"]
                + x @ (w_t + SCALE * (params["gt.weight.lora.a"] @ params["gt.weight.lora.b"]).T).T)
    np.testing.assert_allclose(adapted(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL)
    for mode in ("keep", "merge"):
        path = export_onnx(adapted, tmp_path / f"{mode}.onnx", lora=mode)
        np.testing.assert_allclose(session(path).run(None, {"x": x})[0], expected, atol=ATOL, err_msg=mode)


def test_a_peft_adapter_loads_onto_a_constant_matmul_weight(case, tmp_path):
    w_mm, w_t, x = case
    rng = np.random.default_rng(2)
    a = rng.normal(size=(RANK, 6)).astype(np.float32)  # PEFT's lora_A (r, in)
    b = rng.normal(size=(5, RANK)).astype(np.float32)  # PEFT's lora_B (out, r)
    folder = tmp_path / "ad"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA}))
    save_file({"base_model.model.fc.lora_A.weight": a, "base_model.model.fc.lora_B.weight": b},
              str(folder / "adapter_model.safetensors"))
    adapted = load_peft_adapter(import_onnx(matmul_and_gemm_model(w_mm, w_t)), folder)
    expected = x @ (w_mm.T + SCALE * b @ a).T + x @ w_t.T
    np.testing.assert_allclose(adapted(Tensor.from_numpy(x)).to_numpy(), expected, atol=1e-4)
    saved = op.save_peft_adapter(adapted, tmp_path / "back")
    back = load_file(str(saved / "adapter_model.safetensors"))
    np.testing.assert_allclose(back["base_model.model.fc.lora_A.weight"], a)
    np.testing.assert_allclose(back["base_model.model.fc.lora_B.weight"], b)
