"""Memory of a training loop: an optimizer step frees the previous module's param values as soon
as nothing refers to them (no reference cycle waits for the garbage collector), and Adam's
in-place moments do not leak into a record taken before the step. Oracles: CPython reference
counting (weak references with the collector off) and the record's own copy."""

from __future__ import annotations

import gc
import weakref

import numpy as np

import onnxparam as op
from onnxparam import Tensor, nn, ops
from onnxparam.autodiff import Gradients
from onnxparam.optim import SGD, Adam


class Mlp(op.Module):
    def __init__(self):
        self.fc1 = nn.LinearConfig(6, 8).init()
        self.fc2 = nn.LinearConfig(8, 3).init()

    def forward(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


def _grads(module, scale=0.5) -> Gradients:
    return Gradients({p.id: Tensor.from_numpy(np.full(p.shape, scale, np.float32)) for _, p in module.named_params()})


def _array_refs(module) -> list:
    out = []
    for _, p in module.named_params():
        host = p.base()._host
        out.append(weakref.ref(host.base if host.base is not None else host))
    return out


def test_an_optimizer_step_leaves_no_cycle_holding_the_new_params():
    """With the collector off, the values made by step k die once step k+1 replaces the module,
    and the gradients a step took die with the caller's reference (``rebuild``'s helpers closed
    over its memo and the update function: a cycle held every new param and the step's gradients
    until a full GC)."""
    for optim in (Adam(lr=1e-2), SGD(lr=1e-2, momentum=0.9)):
        m = Mlp()
        g = _grads(m)
        gc.disable()  # NOTE: no collection first: what is checked is made after this line
        try:
            m = optim.step(m, g)
            made = _array_refs(m)
            g2 = _grads(m, scale=0.25)
            given = [weakref.ref(t._host.base if t._host.base is not None else t._host) for t in g2.values()]
            m = optim.step(m, g2)
            del g2
            assert [r() is None for r in made] == [True] * len(made)  # the values of step 1
            assert [r() is None for r in given] == [True] * len(given)  # the gradients step 2 took
        finally:
            gc.enable()


def test_a_record_taken_before_a_step_keeps_its_values():
    """Adam updates its moments in place; a record is a copy, so it still holds the state of
    the step it was taken at (and an optimizer loaded from it continues from there)."""
    m = Mlp()
    g = _grads(m)
    optim = Adam(lr=1e-2)
    m = optim.step(m, g)
    record = optim.to_record()
    saved = {k: v.copy() for k, v in record.tensors.items()}
    m2 = optim.step(m, _grads(m, scale=-2.0))
    for name, value in record.tensors.items():
        np.testing.assert_array_equal(value, saved[name])
    resumed = Adam(lr=1e-2).load_record(record)
    resumed.step_count = 1
    again = resumed.step(m, _grads(m, scale=-2.0))
    for (path, a), (_, b) in zip(m2.named_params(), again.named_params()):
        np.testing.assert_array_equal(a.base().to_numpy(), b.base().to_numpy(), err_msg=path)
