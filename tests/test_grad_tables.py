"""Float initializers that are tables, not weights, are found from the graph at import and
frozen (``OnnxModule.onnx_tables``), so the first ``grad`` trains what PyTorch would: a
rotary frequency table applied to positions through Cos/Sin, an additive ``-inf`` mask, a 0 / 1
fill ``Constant``. Counter-cases stay trainable: a frequency that multiplies the data before
``Sin`` (learned Fourier features), a 0.5 ``Constant`` scale, ordinary weights. Unfreezing
with ``unfreeze_group`` gives them gradients again. The gradients of what stays trainable are
checked against central differences on plain ONNX Runtime (tests/grad_check.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from grad_check import check_model_grads
from onnxparam.autodiff import grad
from onnxparam.autodiff._tables import CONSTANT_SCALAR, MASK, PERIODIC

RNG = np.random.default_rng(0)
D = TensorProto.DOUBLE


def _rotary_model() -> onnx.ModelProto:
    """``ids [N, S] -> emb = E[ids]``; ``ang = positions(S) x inv_freq``; ``y = emb * cos(ang) +
    emb * sin(ang) + scores_mask`` with an additive mask (0 / -1e4 rows), a
    ``Where(ids > 0, y, 0)`` fill, and a learned Fourier branch ``sin(x * freq)``."""
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["emb"]),
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "seq", "one"], ["pos"]),
        helper.make_node("Cast", ["pos"], ["posf"], to=D),
        helper.make_node("Unsqueeze", ["posf", "axes1"], ["pos2"]),
        helper.make_node("Mul", ["pos2", "inv_freq"], ["ang"]),
        helper.make_node("Cos", ["ang"], ["cos"]),
        helper.make_node("Sin", ["ang"], ["sin"]),
        helper.make_node("Mul", ["emb", "cos"], ["a"]),
        helper.make_node("Mul", ["emb", "sin"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["ab"]),
        helper.make_node("Slice", ["mask", "zero1", "seq1", "zero1"], ["m"]),
        helper.make_node("Add", ["ab", "m"], ["abm"]),
        helper.make_node("Greater", ["ids", "zero"], ["keep"]),
        helper.make_node("Unsqueeze", ["keep", "axes2"], ["keep3"]),
        helper.make_node("Constant", [], ["fill"], value=numpy_helper.from_array(np.array([0.0]), "fill")),
        helper.make_node("Where", ["keep3", "abm", "fill"], ["w"]),
        helper.make_node("Mul", ["x", "freq"], ["xf"]),
        helper.make_node("Sin", ["xf"], ["fourier"]),
        helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.array([0.5]), "half")),
        helper.make_node("Mul", ["fourier", "half"], ["f2"]),
        helper.make_node("Add", ["w", "f2"], ["y"]),
        helper.make_node("Reshape", ["seq", "one1"], ["seq1"]),
    ]
    nodes.insert(12, nodes.pop())  # seq1 before its use
    mask = np.zeros((16, 4))
    mask[::3] = -1e4
    inits = {"E": RNG.normal(size=(10, 4)), "inv_freq": np.array([1.0, 0.5, 0.25, 0.125]), "mask": mask,
             "freq": RNG.normal(size=4), "zero": np.array(0, np.int64), "one": np.array(1, np.int64),
             "axes1": np.array([1], np.int64), "axes2": np.array([2], np.int64), "zero1": np.array([0], np.int64),
             "one1": np.array([1], np.int64)}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "S"]),
                                           helper.make_tensor_value_info("x", D, ["N", "S", 4])],
                              [helper.make_tensor_value_info("y", D, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_tables_are_frozen_at_import_and_the_weights_train():
    model = _rotary_model()
    module = op.import_onnx(model)
    tables = module.onnx_tables
    assert tables[module.path_of("inv_freq")] == PERIODIC
    assert tables[module.path_of("mask")] == MASK
    assert tables[module.path_of("fill")] == CONSTANT_SCALAR
    assert set(tables) == {module.path_of(n) for n in ("inv_freq", "mask", "fill")}
    trainable = {p for p, v in module.named_params() if v.require_grad}
    assert trainable == {module.path_of(n) for n in ("E", "freq", "half")}
    ids = RNG.integers(0, 10, size=(2, 5)).astype(np.int64)
    x = RNG.normal(size=(2, 5, 4))
    _, grads = grad(lambda m, i, xx: m(ids=i, x=xx).sum(), module, op.Tensor.from_numpy(ids), op.Tensor.from_numpy(x))
    assert set(grads.by_path()) == trainable


def test_what_stays_trainable_matches_finite_differences_and_unfreezing_trains_the_tables():
    model = _rotary_model()
    feeds = [{"ids": RNG.integers(0, 10, size=s).astype(np.int64), "x": RNG.normal(size=s + (4,))}
             for s in [(2, 5), (3, 7)]]
    module = op.import_onnx(model)
    unfrozen = module.unfreeze_group(op.ParamGroup.from_paths(module.onnx_tables))
    # every float initializer, tables included, against central differences (check_model_grads
    # asserts a gradient for each)
    check_model_grads(model, feeds, module=unfrozen)


@pytest.mark.parametrize("weights_in_initializers", [True, False])
def test_zero_or_one_filled_constants_are_fills_where_weights_are_initializers(weights_in_initializers):
    """A ``Constant`` of any size filled with 0 (or 1) is an exporter's fill in a file whose
    weights are initializers (PyTorch's exporters); a file holding every weight in ``Constant``
    nodes (Paddle) may hold a zero-initialised weight that way: it stays trainable."""
    import onnxparam as op
    from onnxparam.autodiff._tables import CONSTANT_FILL

    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    zeros = numpy_helper.from_array(np.zeros(3, np.float32), "zeros")
    nodes = [helper.make_node("Constant", [], ["z"], value=zeros),
             helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "z"], ["y"])]
    inits = [w]
    if not weights_in_initializers:
        nodes.insert(0, helper.make_node("Constant", [], ["w"], value=w))
        inits = []
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    module = op.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    tables = module.onnx_tables
    if weights_in_initializers:
        assert tables == {module.path_of("z"): CONSTANT_FILL}
    else:
        assert tables == {}
