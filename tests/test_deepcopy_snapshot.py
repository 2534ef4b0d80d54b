"""``copy.deepcopy`` of a module as a training snapshot (fresh7 F10: after any call an imported
module's deepcopy raised "cannot pickle 'mmap.mmap' object"): it works after calls, ``grad``
and optimizer steps, and the copy is independent: ``in_place=True`` steps on the original do
not change it (its writable arrays are copied; the file-mapped source is shared, read-only).

Oracles: the snapshot's values recorded (copied) when it was taken; plain ONNX Runtime running
the original file with those values as initializers; the numpy formula of the graph.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import grad
from onnxparam.nn import Linear
from onnxparam.optim import SGD, Adam

RNG = np.random.default_rng(7)
X = RNG.normal(size=(2, 3)).astype(np.float32)
T = RNG.normal(size=(2, 4)).astype(np.float32)


def _file(tmp_path):
    w, b = RNG.normal(size=(3, 4)).astype(np.float32), RNG.normal(size=4).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    path = tmp_path / "lin.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _ort(path, values):
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": X})[0]


def _values(m):
    return {path: np.array(p.val().to_numpy(), copy=True) for path, p in m.named_params()}


def _loss(m, x, t):
    return ((m(x) - t) ** 2).mean()


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("make", [lambda: SGD(lr=0.1, momentum=0.9), lambda: Adam(lr=0.05)])
def test_a_deepcopy_taken_during_in_place_training_keeps_its_values(tmp_path, make, lora):
    path = _file(tmp_path)
    m = op.import_onnx(path)
    if lora:  # the factors live in the weight's adapter: they are snapshotted too
        m = m.apply_lora(op.LoraConfig(rank=2, alpha=4))
    m(op.Tensor.from_numpy(X))  # a call maps the file: the deepcopy must not copy the mapping
    first = copy.deepcopy(m)
    np.testing.assert_allclose(first(op.Tensor.from_numpy(X)).to_numpy(), _ort(path, _values(m)), rtol=1e-6)
    opt, snaps = make(), []
    for step in range(4):
        _, g = grad(_loss, m, op.Tensor.from_numpy(X), op.Tensor.from_numpy(T))
        m = opt.step(m, g, in_place=True)  # from the second step on, written into the first step's arrays
        snaps.append((copy.deepcopy(m), _values(m)))
    final = _values(m)
    for snap, recorded in snaps:
        got = _values(snap)
        for name in recorded:
            np.testing.assert_array_equal(got[name], recorded[name])
        y = snap(op.Tensor.from_numpy(X)).to_numpy()
        # (with LoRA, W's value is the merged base + scale * a @ b, what the graph computes with)
        np.testing.assert_allclose(y, _ort(path, recorded), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y, X.astype(np.float64) @ recorded["W"] + recorded["b"], rtol=1e-5, atol=1e-5)
    moved = "W.lora.b" if lora else "W"
    assert not np.array_equal(snaps[1][1][moved], final[moved])  # the original did move on
    # the snapshot trains on its own: a step on it leaves the original alone
    _, g = grad(_loss, snaps[0][0], op.Tensor.from_numpy(X), op.Tensor.from_numpy(T))
    make().step(snaps[0][0], g, in_place=True)
    for name, v in _values(m).items():
        np.testing.assert_array_equal(v, final[name])


def test_a_deepcopy_of_a_native_module_after_in_place_steps_is_independent():
    lin = Linear(3, 4)
    opt = SGD(lr=0.1)
    for _ in range(2):
        _, g = grad(_loss, lin, op.Tensor.from_numpy(X), op.Tensor.from_numpy(T))
        lin = opt.step(lin, g, in_place=True)
    best, recorded = copy.deepcopy(lin), _values(lin)
    for _ in range(2):
        _, g = grad(_loss, lin, op.Tensor.from_numpy(X), op.Tensor.from_numpy(T))
        lin = opt.step(lin, g, in_place=True)
    got = _values(best)
    for name in recorded:
        np.testing.assert_array_equal(got[name], recorded[name])
        assert not np.array_equal(_values(lin)[name], recorded[name])
    want = X.astype(np.float64) @ recorded["weight"] + recorded["bias"]
    np.testing.assert_allclose(best(op.Tensor.from_numpy(X)).to_numpy(), want, rtol=1e-5, atol=1e-5)
