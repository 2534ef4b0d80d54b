"""Optimizers that update a module's params by ``ParamId`` from
:class:`~onnxparam.autodiff.Gradients` (Burn's ``burn-optim``): :class:`SGD` (momentum,
weight decay) and :class:`Adam` (weight decay), with their state saved and loaded as burnpack
records so training resumes exactly after a reload.

Layer: a *bridge* (model <-> burnpack format); it knows nothing of ONNX.

Typical loop::

    from onnxparam.autodiff import grad, cross_entropy
    from onnxparam.optim import Adam

    def loss_fn(m, x, y):
        return cross_entropy(m(x), y)

    optim = Adam(lr=1e-3)
    for x, y in batches:
        loss, grads = grad(loss_fn, model, x, y)
        model = optim.step(model, grads)
    optim.save_file("optim.bpk"); model.save_file("model.bpk")

``optim.step(model, grads, in_place=True)`` writes each new value into the array the optimizer
made at the step before (one copy of the weights in memory instead of two during the step);
every module sharing those arrays then sees the new values (see :meth:`Optimizer.step`).
"""

from ._adam import Adam
from ._base import OPTIMIZER_METADATA_KEY, STEP_SCALAR, Optimizer, OptimizerRecord
from ._sgd import SGD

__all__ = ["Optimizer", "OptimizerRecord", "SGD", "Adam", "STEP_SCALAR", "OPTIMIZER_METADATA_KEY"]
