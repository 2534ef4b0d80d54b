"""Running statistics of training-mode ``BatchNorm``: :func:`update_running_stats`.

Burn's ``BatchNorm::forward_train`` normalizes with the batch's statistics and, in the same
call, writes ``running = (1 - momentum) * running + momentum * batch`` into its
``RunningState`` (interior mutability). Here a forward is traced into an ONNX graph, whose
initializers ONNX Runtime never writes, and modules are values (every transform returns a new
module), so the update is a transform of its own:

    loss, grads = grad(loss_fn, model, x, targets)   # BatchNorm in training mode: batch statistics
    model = nn.update_running_stats(model, x)        # the running statistics Burn's forward would write
    model = optimizer.step(model, grads)

NOTE: the design choice. The alternatives were extra graph outputs that the runtime and
``grad`` write back into the params after each run (a state channel through the tracer, the
session runner and the backward builder, and in-place mutation of params that clones share) or
a separate call. The separate call keeps tracing, sessions and autodiff unchanged and the
module a value; it costs one more forward run per step (one cached ONNX Runtime session whose
outputs are every training-mode BatchNorm's batch mean and variance). The batch statistics
are those of the module's forward on ``inputs`` in training mode; with dropout before a
BatchNorm they come from another random mask than the gradient step's.
"""

from __future__ import annotations

import numpy as np

from ..core.module import Module
from ..core.param import Param
from ..core.tensor import Tensor
from ._norm import _COLLECTOR, BatchNorm

__all__ = ["update_running_stats"]

def _batch_norms(module: Module) -> list:
    """Every distinct ``BatchNorm`` of ``module``, in traversal order."""
    seen, out = set(), []
    for _, m in module.named_modules():
        if isinstance(m, BatchNorm) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


class _RunningStatsProbe(Module):
    """Traces ``inner``'s forward (in training mode) and outputs the updated
    ``(running_mean, running_var)`` of every ``BatchNorm`` of ``inner`` in traversal order.

    NOTE: the updates are computed in the graph (chained when a layer runs twice) so that the
    outputs depend only on the module's structure, which keys the cached trace: nothing is
    read from a trace-time side effect on a later, cached call.
    """

    def __init__(self, inner: Module):
        self.inner = inner

    def forward(self, *args, **kwargs):
        from .. import ops

        token = _COLLECTOR.set([])
        try:
            self.inner(*args, **kwargs)
            entries = _COLLECTOR.get()
        finally:
            _COLLECTOR.reset(token)
        state: dict = {}
        for layer, mean, var in entries:
            old_mean, old_var = state.get(id(layer)) or (layer.running_mean.val(), layer.running_var.val())
            m = float(layer.momentum)
            state[id(layer)] = (ops.add(ops.mul(old_mean, 1.0 - m), ops.mul(mean, m)),
                                ops.add(ops.mul(old_var, 1.0 - m), ops.mul(var, m)))
        outputs = []
        for layer in _batch_norms(self.inner):
            outputs.extend(state.get(id(layer)) or (layer.running_mean.val(), layer.running_var.val()))
        return tuple(outputs)


def update_running_stats(module: Module, *inputs, **kwargs) -> Module:
    """``module`` with the running statistics of every ``BatchNorm`` updated from a forward on
    ``inputs`` in training mode: ``running_mean = (1 - momentum) * running_mean + momentum *
    mean`` and the same for ``running_var`` with the *biased* batch variance (Burn's
    ``BatchNorm::forward_train``, ``burn-nn/src/modules/norm/batch.rs``; PyTorch updates with the
    unbiased variance). A BatchNorm called twice is updated twice, in call order. The updated
    params keep their ids; every other param is the same object.

    Args:
        module: any module (its own mode does not matter: the statistics are computed with a
            training-mode copy).
        *inputs, **kwargs: the arguments of ``module``'s forward (tensors or arrays).

    Returns:
        The new module (``module`` itself when it has no ``BatchNorm``).

    Raises:
        TraceError / ExecutionError: as for ``module(*inputs)``.
    """
    layers = _batch_norms(module)
    if not layers:
        return module
    inputs = tuple(Tensor.from_numpy(a) if isinstance(a, np.ndarray) else a for a in inputs)
    outputs = _RunningStatsProbe(module.train())(*inputs, **kwargs)
    paths = {p.id: path for path, p in module.named_params()}
    values = {}
    for i, layer in enumerate(layers):
        values[paths[layer.running_mean.id]] = outputs[2 * i]
        values[paths[layer.running_var.id]] = outputs[2 * i + 1]

    def updated(path: str, param: Param) -> Param:
        if path not in values:
            return param
        return Param.initialized(param.id, values[path], require_grad=False)

    return module.map(updated)
