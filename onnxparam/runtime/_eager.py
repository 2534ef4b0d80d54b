"""Eager ops: an op called outside a trace is traced into a one-op graph, run by ONNX Runtime,
and the session cached by signature (see :mod:`onnxparam.ops`)."""

from __future__ import annotations

import numpy as np

from ..core.tensor import Tensor
from ..trace import tracer as _trace
from ._calls import _LOCK, _STATS, _eager, _limits, _trim
from ._config import DEFAULTS
from ._devices import pick_device
from ._keys import call_signature
from ._sessions import build_runner

__all__ = ["run_eager"]


def _with_leaves(value, inputs):
    if isinstance(value, (Tensor, np.ndarray)):
        return next(inputs)
    if isinstance(value, (list, tuple)):
        items = [_with_leaves(v, inputs) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _with_leaves(v, inputs) for k, v in value.items()}
    return value


def run_eager(fn, args: tuple, kwargs: dict):
    """Run the op ``fn`` on concrete tensors: trace it into a small graph whose inputs are the
    tensor arguments, build (or reuse) its session, run it.

    Raises:
        TypeError: when no argument is a tensor.
        DeviceError / ExecutionError: as for module calls.
    """
    leaves: list = []
    key = (fn, call_signature(args, kwargs, leaves, nested=True))
    if not leaves:
        raise TypeError(f"{fn.__name__}: at least one argument must be a Tensor")
    device = pick_device(f"ops.{fn.__name__}", (), leaves)
    config = DEFAULTS.eager
    full_key = (key, device, config)
    with _LOCK:
        runner = _eager.get(full_key)
        if runner is None:
            tracer = _trace.Tracer(name=fn.__name__)
            with tracer.active():
                inputs = iter([tracer.input(f"input_{i}", t.shape, t.dtype) for i, t in enumerate(leaves)])
                out = fn(*_with_leaves(args, inputs), **_with_leaves(kwargs, inputs))
                traced = tracer.finish(out)
            runner = build_runner(traced, (), device, config, f"ops.{fn.__name__}")
            _STATS.eager_sessions_built += 1
            _eager[full_key] = runner
            _trim(_eager, _limits["eager"])
        else:
            _eager.move_to_end(full_key)
    return runner.run(leaves)
