"""PEFT adapters on imported ONNX weights: the weight's layout comes from the node that consumes
it (``MatMul`` B, ``Transpose -> MatMul``, ``Gemm`` ``transB`` 0 / 1, ``Gather``), never from its
shape; square and non-square weights; convolution LoRA on a ``Conv`` weight; a shape that does
not fit, uses that disagree and a use that says nothing are refused, naming the param.

Oracle: numpy in PyTorch's convention on the matrices the test writes: the effective PyTorch
weight ``W_torch + scale * B @ A`` (``(out, in)``; PEFT's ``A`` ``(r, in)``, ``B`` ``(out, r)``),
and for an embedding ``(table + scale * (B @ A).T)[ids]``.
"""

import json

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from safetensors.numpy import save_file

from onnxparam import RecordError, ShapeMismatchError, Tensor, import_onnx, load_peft_adapter
from onnxparam.runtime import SessionConfig, set_session_config

R, ALPHA = 2, 3.0
SCALE = ALPHA / R
F = onnx.TensorProto.FLOAT


def write_peft(folder, tensors: dict, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA,
                                                            **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def model(nodes, inputs, weights: dict, out_dims):
    inits = [onnx.numpy_helper.from_array(v, k) for k, v in weights.items()]
    graph = oh.make_graph(nodes, "g", inputs, [oh.make_tensor_value_info("y", F, out_dims)], inits)
    m = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def linear_model(pattern: str, w_torch: np.ndarray):
    """``y = x @ W_torch.T`` written as ``pattern``; the stored weight ``w`` in that pattern's layout."""
    d_out, d_in = w_torch.shape
    x = oh.make_tensor_value_info("x", F, ["N", d_in])
    if pattern == "matmul":
        return model([oh.make_node("MatMul", ["x", "w"], ["y"])], [x], {"w": w_torch.T.copy()}, ["N", d_out])
    if pattern == "transpose_matmul":
        nodes = [oh.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), oh.make_node("MatMul", ["x", "wt"], ["y"])]
        return model(nodes, [x], {"w": w_torch.copy()}, ["N", d_out])
    if pattern == "gemm_t0":
        return model([oh.make_node("Gemm", ["x", "w"], ["y"], transB=0)], [x], {"w": w_torch.T.copy()}, ["N", d_out])
    if pattern == "gemm_t1":
        return model([oh.make_node("Gemm", ["x", "w"], ["y"], transB=1)], [x], {"w": w_torch.copy()}, ["N", d_out])
    raise AssertionError(pattern)


PATTERNS = ["matmul", "transpose_matmul", "gemm_t0", "gemm_t1"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("d_in, d_out", [(4, 4), (5, 3)], ids=["square", "non-square"])
def test_a_peft_adapter_follows_the_layout_the_consumer_of_the_weight_says(tmp_path, pattern, d_in, d_out):
    rng = np.random.default_rng(d_in * 10 + PATTERNS.index(pattern))
    w_torch = rng.normal(size=(d_out, d_in)).astype(np.float32)
    a = rng.normal(size=(R, d_in)).astype(np.float32)
    b = rng.normal(size=(d_out, R)).astype(np.float32)
    x = rng.normal(size=(3, d_in)).astype(np.float32)
    expected = x @ (w_torch + SCALE * b @ a).T
    folder = write_peft(tmp_path / "ad", {"base_model.model.w.lora_A.weight": a, "base_model.model.w.lora_B.weight": b})
    adapted = load_peft_adapter(import_onnx(linear_model(pattern, w_torch)), folder)
    for mode in ("merge", "keep"):
        module = adapted.map(lambda p, q: q)
        set_session_config(module, SessionConfig(lora_mode=mode))
        np.testing.assert_allclose(module(Tensor.from_numpy(x)).to_numpy(), expected, atol=1e-4, err_msg=mode)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_an_adapter_for_the_reverse_direction_is_refused_naming_the_param_and_both_shapes(tmp_path, pattern):
    w_torch = np.ones((3, 5), np.float32)  # a 5 -> 3 layer
    folder = write_peft(tmp_path / "ad", {"base_model.model.w.lora_A.weight": np.ones((R, 3), np.float32),
                                          "base_model.model.w.lora_B.weight": np.ones((5, R), np.float32)})
    stored = [3, 5] if pattern in ("transpose_matmul", "gemm_t1") else [5, 3]
    message = (r"'w': the factors make a \(5, 3\) PyTorch weight \(in 3 -> out 5\), the param is "
               + r"\[%d, %d\]" % tuple(stored))
    with pytest.raises(ShapeMismatchError, match=message):
        load_peft_adapter(import_onnx(linear_model(pattern, w_torch)), folder)


def test_an_embedding_adapter_attaches_to_a_gathered_table(tmp_path):
    rng = np.random.default_rng(5)
    table = rng.normal(size=(7, 4)).astype(np.float32)
    a = rng.normal(size=(R, 7)).astype(np.float32)  # lora_embedding_A (r, num_embeddings)
    b = rng.normal(size=(4, R)).astype(np.float32)  # lora_embedding_B (dim, r)
    ids = np.array([[0, 3, 6], [2, 2, 5]], np.int64)
    m = model([oh.make_node("Gather", ["emb.weight", "ids"], ["y"], axis=0)],
              [oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 3])], {"emb.weight": table}, [2, 3, 4])
    folder = write_peft(tmp_path / "ad", {"base_model.model.emb.lora_embedding_A": a,
                                          "base_model.model.emb.lora_embedding_B": b})
    adapted = load_peft_adapter(import_onnx(m), folder)
    expected = (table + SCALE * (b @ a).T)[ids]
    np.testing.assert_allclose(adapted(Tensor.from_numpy(ids)).to_numpy(), expected, atol=1e-5)


def test_a_weight_whose_uses_disagree_or_say_nothing_is_refused(tmp_path):
    w = np.ones((4, 4), np.float32)
    x = oh.make_tensor_value_info("x", F, [2, 4])
    nodes = [oh.make_node("MatMul", ["x", "w"], ["p"]), oh.make_node("Gemm", ["x", "w"], ["q"], transB=1),
             oh.make_node("Add", ["p", "q"], ["s"]), oh.make_node("Mul", ["s", "v"], ["y"])]
    m = model(nodes, [x], {"w": w, "v": w.copy() * 2}, [2, 4])
    tensors = {f"base_model.model.{n}.lora_{k}.weight": np.ones((R, 4) if k == "A" else (4, R), np.float32)
               for n in ("w", "v") for k in "AB"}
    with pytest.raises(RecordError) as info:
        load_peft_adapter(import_onnx(m), write_peft(tmp_path / "ad", tensors))
    text = str(info.value)
    assert "'w' [4, 4] is not known: its uses disagree on its layout (in_out:MatMul, out_in:Gemm)" in text
    assert "'v' [4, 4] is not known: no use says which axis is the input (used by Mul input 1)" in text


def conv_model(weight):
    return model([oh.make_node("Conv", ["x", "conv.weight"], ["y"], pads=[1, 1, 1, 1])],
                 [oh.make_tensor_value_info("x", F, [1, 2, 5, 5])], {"conv.weight": weight}, [1, 3, 5, 5])


def test_a_convolution_adapter_reshapes_its_delta_to_the_conv_weight(tmp_path):
    rng = np.random.default_rng(11)
    w = rng.normal(size=(3, 2, 3, 3)).astype(np.float32)
    a = rng.normal(size=(R, 2, 3, 3)).astype(np.float32)  # PEFT lora_A: a conv (r, in, kh, kw)
    b = rng.normal(size=(3, R, 1, 1)).astype(np.float32)  # PEFT lora_B: a 1x1 conv (out, r, 1, 1)
    x = rng.normal(size=(1, 2, 5, 5)).astype(np.float32)
    # the oracle: plain ONNX Runtime on the same graph holding PEFT's merged weight
    merged = w + SCALE * (b.reshape(3, R) @ a.reshape(R, -1)).reshape(w.shape)
    expected = ort.InferenceSession(conv_model(merged).SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    folder = write_peft(tmp_path / "ad", {"base_model.model.conv.lora_A.weight": a,
                                          "base_model.model.conv.lora_B.weight": b})
    adapted = load_peft_adapter(import_onnx(conv_model(w)), folder)
    for mode in ("merge", "keep", "inputs"):
        module = adapted.map(lambda p, q: q)
        set_session_config(module, SessionConfig(lora_mode=mode))
        np.testing.assert_allclose(module(Tensor.from_numpy(x)).to_numpy(), expected, atol=1e-4, err_msg=mode)


def test_convolution_factors_that_do_not_fit_are_refused_naming_both_shapes(tmp_path):
    folder = write_peft(tmp_path / "ad", {"base_model.model.conv.lora_A.weight": np.ones((R, 4, 3, 3), np.float32),
                                          "base_model.model.conv.lora_B.weight": np.ones((3, R, 1, 1), np.float32)})
    with pytest.raises(RecordError, match=r"'conv.weight': the factors make a \[3, 4, 3, 3\] convolution weight, "
                                          r"the param is \[3, 2, 3, 3\]"):
        load_peft_adapter(import_onnx(conv_model(np.ones((3, 2, 3, 3), np.float32))), folder)


def test_grouped_convolution_factors_that_do_not_fit_are_refused_naming_the_groups(tmp_path):
    """PEFT's grouped-conv layout (lora_B a 1x1 conv of r / groups input channels: groups = 2
    here) on a group-1 weight: the factors describe another weight."""
    folder = write_peft(tmp_path / "ad", {"base_model.model.conv.lora_A.weight": np.ones((R, 2, 3, 3), np.float32),
                                          "base_model.model.conv.lora_B.weight": np.ones((3, 1, 1, 1), np.float32)})
    with pytest.raises(RecordError, match=r"'conv.weight': the factors make a \[3, 1, 3, 3\] convolution weight "
                                          r"\(groups=2\), the param is \[3, 2, 3, 3\]"):
        load_peft_adapter(import_onnx(conv_model(np.ones((3, 2, 3, 3), np.float32))), folder)


def test_key_map_takes_onnx_names_and_zero_matches_is_an_error_even_with_allow_partial(tmp_path):
    rng = np.random.default_rng(9)
    w_torch = rng.normal(size=(3, 5)).astype(np.float32)
    m = linear_model("gemm_t1", w_torch)
    m.graph.initializer[0].name = "onnx::Gemm_12"
    m.graph.node[0].input[1] = "onnx::Gemm_12"
    a, b = rng.normal(size=(R, 5)).astype(np.float32), rng.normal(size=(3, R)).astype(np.float32)
    folder = write_peft(tmp_path / "ad", {"base_model.model.proj.lora_A.weight": a,
                                          "base_model.model.proj.lora_B.weight": b})
    imported = import_onnx(m)
    adapted, report = load_peft_adapter(imported, folder, key_map=[(r"^proj$", "onnx::Gemm_12")], return_report=True)
    assert report.matched == {"base_model.model.proj": imported.path_of("onnx::Gemm_12")} and not report.unmatched
    x = rng.normal(size=(2, 5)).astype(np.float32)
    np.testing.assert_allclose(adapted(Tensor.from_numpy(x)).to_numpy(), x @ (w_torch + SCALE * b @ a).T, atol=1e-5)
    with pytest.raises(RecordError, match=r"no PEFT module of the checkpoint matched") as info:
        load_peft_adapter(imported, folder, allow_partial=True)
    assert info.value.report.unmatched == ["base_model.model.proj"] and not info.value.report.matched
