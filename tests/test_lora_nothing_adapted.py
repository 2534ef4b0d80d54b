"""``apply_lora`` never adds zero adapters silently: when no param of a module can take one, it
raises :class:`~onnxparam.LoraError` naming the module and why each candidate was skipped (or,
with ``allow_empty=True``, warns so); ``write_onnx_adapter`` with nothing to write raises a
library error too.

Oracles: the graph built here (which node reads which initializer: a rank-2 weight read only by
``Slice`` is no linear map's matrix, ONNX operator spec: Slice-13), plain ONNX Runtime on the
file for the values of the un-adapted module.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.cli import main
from onnxparam.nn import Linear


@pytest.fixture
def sliced(tmp_path):
    """``y = x @ Slice(w, rows 0:4) + bias``: the rank-2 ``w`` (8, 4) is only sliced (as an
    unrolled LSTM's gate weights are), the ``MatMul`` reads the slice, not an initializer."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array([0], np.int64), "starts"),
             numpy_helper.from_array(np.array([4], np.int64), "ends"),
             numpy_helper.from_array(np.array([0], np.int64), "axes")]
    graph = helper.make_graph(
        [helper.make_node("Slice", ["w", "starts", "ends", "axes"], ["w0"]),
         helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("Add", ["h", "bias"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    path = tmp_path / "sliced.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_apply_lora_on_a_graph_whose_only_matrix_feeds_slice_raises_naming_the_module_and_why(sliced):
    with pytest.raises(op.LoraError) as info:
        op.import_onnx(sliced).apply_lora(op.LoraConfig(rank=2, alpha=4))
    assert isinstance(info.value, op.OnnxParamError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(f"apply_lora (rank 2): no param of OnnxModule ('{sliced}') got a LoRA adapter: ")
    assert ("1 rank-2 float param(s) are not the matrix of a linear map in the graph (no MatMul / Gemm / Gather "
            "uses them as one), so LoRA cannot adapt them: 'w' (8, 4): no use says which axis is the input "
            "(used by Slice input 0)") in message
    assert "1 float param(s) are not rank-2 (LoRA adapts matrices only): 'bias' (4,)" in message
    assert message.endswith("pass allow_empty=True to accept a module without adapters")


def test_allow_empty_warns_and_returns_the_frozen_module_computing_as_the_file(sliced):
    imported = op.import_onnx(sliced)
    with pytest.warns(UserWarning, match=r"no param of OnnxModule .* got a LoRA adapter: .*'w' \(8, 4\)"):
        adapted = imported.apply_lora(op.LoraConfig(rank=2, alpha=4), allow_empty=True)
    assert [p for p, q in adapted.named_params() if q.adapter() is not None] == []
    assert all(not q.require_grad for _, q in adapted.named_params())
    x = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
    want = ort.InferenceSession(str(sliced), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(adapted(x).to_numpy(), want, rtol=1e-6, atol=1e-6)


class Net(op.Module):
    def __init__(self):
        self.fc = Linear(4, 5)

    def forward(self, x):
        return self.fc(x)


def test_a_param_group_matching_no_weight_raises_naming_the_group_and_the_matrices_it_missed():
    group = op.ParamGroup.from_path("nothing")
    with pytest.raises(op.LoraError, match=r"no param of Net got a LoRA adapter: 1 rank-2 float param\(s\) do not "
                       r"match the param_group ParamGroup\(path='nothing'\): 'fc.weight' \(4, 5\); 1 float param\(s\) "
                       r"are not rank-2 \(LoRA adapts matrices only\): 'fc.bias' \(5,\)"):
        Net().apply_lora(op.LoraConfig(rank=2, alpha=4, param_group=group))


class Empty(op.Module):
    def forward(self, x):
        return x


def test_a_module_without_float_params_raises_saying_there_is_none_to_adapt():
    with pytest.raises(op.LoraError, match=r"no param of Empty got a LoRA adapter: it has no float param to adapt"):
        Empty().apply_lora(op.LoraConfig(rank=2, alpha=4))


def test_writing_an_adapter_with_nothing_in_it_raises_a_library_error_and_writes_no_file(sliced, tmp_path):
    with pytest.warns(UserWarning):
        adapted = op.import_onnx(sliced).apply_lora(op.LoraConfig(rank=2, alpha=4), allow_empty=True)
    target = tmp_path / "none.onnx_adapter"
    with pytest.raises(op.LoraError, match=r"no LoRA adapter to write to '.*none.onnx_adapter': OnnxModule has no "
                       r"LoRA adapters \(apply_lora or load_peft_adapter first\)"):
        op.write_onnx_adapter(adapted, target)
    with pytest.raises(op.LoraError, match=r"no LoRA adapter to write to '.*none.onnx_adapter': the mapping is empty"):
        op.write_onnx_adapter({}, target)
    assert not target.exists()


def test_the_cli_refuses_a_model_with_nothing_to_adapt_saying_why(sliced, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["lora", "keep", str(sliced), str(tmp_path / "k.onnx"), "--rank", "2", "--alpha", "4"])
    assert code == 1
    assert f"no rank-2 float weight of '{sliced}' matches the LoRA targets; nothing to adapt" in err.getvalue()
    assert "'w' (8, 4): no use says which axis is the input (used by Slice input 0)" in err.getvalue()
    assert not (tmp_path / "k.onnx").exists()
