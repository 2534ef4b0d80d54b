"""``autodiff.recompute``: a marked sub-module's activations are recomputed in the backward graph
instead of kept. Oracles: torch autograd of the same network with the same weights (every
gradient, marked or not), and the graph itself (no backward node reads a value computed inside
the marked sub-module, except its outputs)."""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.autodiff import _training, cross_entropy, grad, recompute
from onnxparam.core.errors import TraceError

torch = pytest.importorskip("torch")


class Block(op.Module):
    def __init__(self, d, hidden):
        self.fc1 = nn.LinearConfig(d, hidden).init()
        self.fc2 = nn.LinearConfig(hidden, d).init()

    def forward(self, x):
        return x + self.fc2(ops.tanh(self.fc1(x)))


class Net(op.Module):
    def __init__(self):
        self.block0 = Block(6, 16)
        self.block1 = Block(6, 16)
        self.head = nn.LinearConfig(6, 3).init()

    def forward(self, x):
        return self.head(self.block1(self.block0(x)))


def _loss(m, x, y):
    return cross_entropy(m(x), y)


def _torch_grads(module, x, y) -> dict:
    params = {path: torch.tensor(np.asarray(p.base().to_numpy()), requires_grad=True) for path, p in module.named_params()}

    def linear(prefix, h):
        return h @ params[f"{prefix}.weight"] + params[f"{prefix}.bias"]

    h = torch.from_numpy(x)
    for b in ("block0", "block1"):
        h = h + linear(f"{b}.fc2", torch.tanh(linear(f"{b}.fc1", h)))
    loss = torch.nn.functional.cross_entropy(linear("head", h), torch.from_numpy(y))
    loss.backward()
    return {path: t.grad.numpy() for path, t in params.items()}


def test_recomputed_block_gives_torchs_gradients_and_keeps_none_of_its_activations():
    module = Net()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=8).astype(np.int64)
    expected = _torch_grads(module, x, y)
    marked = recompute(module, "block0")
    _training.clear_cache()
    for m in (module, marked):
        _, grads = grad(_loss, m, x, y)
        got = grads.by_path()
        assert sorted(got) == sorted(expected)
        for path, g in expected.items():
            np.testing.assert_allclose(got[path].to_numpy(), g, rtol=1e-5, atol=1e-6, err_msg=path)
    # the graph: block0's inner values (fc1's output, tanh's output) are read by no backward node;
    # the backward reads recomputed copies
    training = _training.training_model(_loss, marked, x, y)
    inner = [n for n in training.graph if n.name.startswith("/block0/") and n.op_type == "Tanh"]
    assert inner
    for node in inner:
        for value in list(node.inputs) + list(node.outputs):
            readers = [u.name for u, _ in value.uses() if u.name.startswith("/grad/")]
            assert all(r.startswith("/grad/recompute") for r in readers), readers
    assert any(n.name.startswith("/grad/recompute/block0/") and n.op_type == "Tanh" for n in training.graph)
    plain = _training.training_model(_loss, module, x, y)
    assert not any(n.name.startswith("/grad/recompute") for n in plain.graph)


def test_marks_are_values_and_unknown_paths_are_refused():
    module = Net()
    marked = recompute(module, "block1")
    assert getattr(module, "_onnxparam_recompute", None) is None  # the receiver is unchanged
    assert recompute(marked, "block0")._onnxparam_recompute == frozenset({"block0", "block1"})
    assert recompute(marked)._onnxparam_recompute == frozenset()
    with pytest.raises(TraceError, match="no sub-module at 'block9'"):
        recompute(module, "block9")
