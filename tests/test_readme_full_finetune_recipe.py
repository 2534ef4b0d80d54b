"""The README's full fine-tuning recipe for an imported model (fresh7 F16):
``m.unfreeze_group(op.ParamGroup.all().excluding(op.ParamGroup.from_paths(m.onnx_tables)))``
unfreezes every weight (also the base under LoRA adapters) but keeps the tables the import froze
(``BatchNormalization``'s running mean / variance: PyTorch's buffers) frozen, where
``ParamGroup.all()`` alone would train them.

Oracle: the ONNX spec's roles of BatchNormalization's inputs (``scale`` / ``B`` are learned,
``input_mean`` / ``input_var`` the running statistics) and of MatMul's B (a weight).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import grad

RNG = np.random.default_rng(3)


def _file(tmp_path):
    inits = {"W": RNG.normal(size=(3, 4)), "gamma": RNG.uniform(0.5, 1.5, 4), "beta": RNG.normal(size=4),
             "mean": RNG.normal(size=4), "var": RNG.uniform(0.5, 2.0, 4)}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]),
         helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    path = tmp_path / "bn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _trainable(m):
    return {path for path, p in m.named_params() if p.require_grad}


def test_unfreezing_all_but_the_onnx_tables_keeps_the_running_statistics_frozen(tmp_path):
    m = op.import_onnx(_file(tmp_path))
    assert set(m.onnx_tables) == {"mean", "var"}
    assert _trainable(m) == {"W", "gamma", "beta"}
    adapted = m.apply_lora(op.LoraConfig(rank=2, alpha=4))
    assert "W" not in _trainable(adapted)  # the first adapter froze the base
    recipe = op.ParamGroup.all().excluding(op.ParamGroup.from_paths(adapted.onnx_tables))
    full = adapted.unfreeze_group(recipe)
    lora = _trainable(adapted)
    assert _trainable(full) == lora | {"W", "gamma", "beta"}
    assert {"mean", "var"}.isdisjoint(_trainable(full))
    assert {"mean", "var"} <= _trainable(adapted.unfreeze_group(op.ParamGroup.all()))  # what the recipe avoids

    x = op.Tensor.from_numpy(RNG.normal(size=(5, 3)).astype(np.float32))
    _, g = grad(lambda mm, a: (mm(a) ** 2).mean(), full, x)
    params = dict(full.named_params())
    assert {p for p in params if params[p].id in g} == _trainable(full)
