"""Which params LoRA adapts in an imported graph: the matrices of linear maps, as the graph's
nodes use them, never every rank-2 tensor (a ``(1, d)`` scale or bias is not a linear map)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op


@pytest.fixture
def imported(tmp_path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "w")
    scale = numpy_helper.from_array(rng.normal(size=(1, 3)).astype(np.float32), "scale")
    bias = numpy_helper.from_array(rng.normal(size=(1, 3)).astype(np.float32), "bias")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Mul", ["h", "scale"], ["s"]),
         helper.make_node("Add", ["s", "bias"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w, scale, bias])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return op.import_onnx(path)


def adapted_paths(module):
    return sorted(p[: -len(".lora.a")] for p, _ in module.named_params() if p.endswith(".lora.a"))


def test_default_lora_adapts_only_the_weights_a_matmul_uses_as_its_matrix(imported):
    adapted = imported.apply_lora(op.LoraConfig(rank=1, alpha=2))
    assert adapted_paths(adapted) == ["w"]


def test_a_group_selecting_a_scale_that_is_no_linear_map_is_refused_naming_it(imported):
    with pytest.raises(ValueError, match=r"'scale' \(1, 3\) is not the matrix of a linear map"):
        imported.apply_lora(op.LoraConfig(rank=1, alpha=2, param_group=op.ParamGroup.from_regex("^scale$")))


class ConvHead(op.Module):
    def __init__(self):
        from onnxparam.nn import Conv2dConfig, LinearConfig

        self.conv = Conv2dConfig((2, 3), (3, 3)).init()
        self.fc = LinearConfig(3, 4).init()

    def forward(self, x):
        return self.fc(self.conv(x).mean(axis=(2, 3)))


def test_a_group_matching_convolution_kernels_warns_listing_the_ones_left_without_adapters():
    """The documented limit: apply_lora creates adapters for 2-d weights only; a narrower group
    that also matches a convolution kernel adapts the matrices and warns (LoraWarning) naming the
    kernel and its shape; the default group stays silent (filterwarnings=error would fail it)."""
    group = op.ParamGroup.from_regex(r"conv|weight")
    with pytest.warns(op.LoraWarning, match=r"matches 1 param\(s\) of rank >= 3 .*'conv.weight' \(3, 2, 3, 3\)"):
        adapted = ConvHead().apply_lora(op.LoraConfig(rank=2, param_group=group))
    assert adapted_paths(adapted) == ["fc.weight"]
    assert adapted_paths(ConvHead().apply_lora(op.LoraConfig(rank=2))) == ["fc.weight"]
    with pytest.raises(op.LoraError, match="conv.weight"):  # nothing adaptable: an error, as before
        ConvHead().apply_lora(op.LoraConfig(rank=2, param_group=op.ParamGroup.from_regex(r"conv")))
