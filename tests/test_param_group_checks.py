"""A group given to freeze_group / unfreeze_group that matches no param is an error (fresh8 F11).

Before, ``freeze_group(ParamGroup.from_paths(["onnx::MatMul_12"]))`` on an imported model froze
nothing (paths are escaped: ``onnx_x3a__x3a_MatMul_12``), and the weight trained. Now a
``from_paths`` path naming no param raises :class:`~onnxparam.ParamGroupError` (closest paths
named), except an imported weight's ONNX name, which stands for its path; any other group
matching nothing raises too. Oracle: a numpy gradient of the one-layer model.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam import ParamGroup, ParamGroupError
from onnxparam.autodiff import grad
from onnxparam.optim import SGD

WEIGHT = "onnx::MatMul_12"  # TorchScript's name of a Linear weight it transposed
PATH = "onnx_x3a__x3a_MatMul_12"


@pytest.fixture()
def imported(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", WEIGHT], ["h"]), helper.make_node("Add", ["h", "fc1.bias"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        [numpy_helper.from_array(w, WEIGHT), numpy_helper.from_array(b, "fc1.bias")])
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return op.import_onnx(path), w, b, rng.standard_normal((4, 3)).astype(np.float32)


def _values(module) -> dict:
    return {k: p.val().to_numpy().copy() for k, p in module.named_params()}


def test_from_paths_takes_an_imported_weights_onnx_name(imported):
    m, w, b, x = imported
    frozen = m.freeze_group(ParamGroup.from_paths([WEIGHT]))
    assert {k for k, p in frozen.named_params() if not p.require_grad} == {PATH}
    _, grads = grad(lambda mod, t: (mod(t) ** 2).mean(), frozen, op.Tensor.from_numpy(x))
    stepped = _values(SGD(lr=0.1).step(frozen, grads))
    # numpy oracle: loss = mean((x w + b)^2), d/db = 2 (x w + b).sum(0) / size
    y = x @ w + b
    np.testing.assert_array_equal(stepped[PATH], w)
    np.testing.assert_allclose(stepped["fc1.bias"], b - 0.1 * 2 * y.sum(0) / y.size, rtol=1e-5, atol=1e-6)
    # and back: unfreeze by the ONNX name too
    assert all(p.require_grad for _, p in frozen.unfreeze_group(ParamGroup.from_path(WEIGHT)).named_params())


def test_a_path_that_names_no_param_is_refused_with_the_closest(imported):
    m = imported[0]
    with pytest.raises(ParamGroupError, match=r"'fc1\.weight' names no param \(closest: .*'fc1\.bias'"):
        m.freeze_group(ParamGroup.from_paths(["fc1.weight"]))
    with pytest.raises(ParamGroupError, match="'fc1.weight' names no param"):
        m.unfreeze_group(ParamGroup.from_paths(["fc1.bias", "fc1.weight"]))  # one good path is not enough


def test_a_group_matching_nothing_is_refused_naming_the_escaped_path(imported):
    m = imported[0]
    with pytest.raises(ParamGroupError, match=f"matches no param.*ONNX names of '{PATH}'"):
        m.freeze_group(ParamGroup.from_regex(r"^onnx::MatMul_12$"))
    with pytest.raises(ParamGroupError, match="matches no param"):
        m.unfreeze_group(ParamGroup.from_regex("nothing"))


def test_empty_and_matching_groups_keep_working(imported):
    m, w, b, _ = imported
    assert m.onnx_tables == {}
    same = m.unfreeze_group(ParamGroup.from_paths(m.onnx_tables))  # the README's recipe, no tables: no-op
    assert [(k, p.require_grad) for k, p in same.named_params()] == [(k, p.require_grad) for k, p in m.named_params()]
    frozen = m.freeze_group(ParamGroup.all().excluding(ParamGroup.from_path("fc1")))
    assert {k for k, p in frozen.named_params() if not p.require_grad} == {PATH}
    frozen = m.freeze_group(ParamGroup.from_regex(r"MatMul_12$"))
    assert {k for k, p in frozen.named_params() if not p.require_grad} == {PATH}
