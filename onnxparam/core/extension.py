"""The core's two extension points: the code of a higher layer that the core runs.

The core (``Tensor``, ``Param``, ``Module``) imports nothing above it. Two things it does need
code from above for, each through one typed table here:

* :class:`TensorOps`, the tensor operator table, provided by :mod:`onnxparam.ops`: every
  ``Tensor`` operator (``+``, ``@``, ``reshape``, ``relu`` ...) delegates to it, and
  ``Param.val()`` asks it for the param's value inside an active trace (the traced graph's
  initializer, :meth:`TensorOps.param_value`).
* :class:`Executor`, provided by :mod:`onnxparam.runtime`: ``Module.__call__`` runs through it, an
  op outside a trace runs eagerly through it, ``Tensor.to_device`` makes its device values with
  it, ``nn.seed`` clears its caches, and it holds the graph passes (LoRA, QDQ) the runtime traces
  with.

Each is loaded on first use by a loader that the top layer (:mod:`onnxparam._assembly`)
installs with :func:`install`: a function doing a plain import of the providing package, so
``import onnxparam`` loads neither. ``tests/test_layers.py`` counts each point as an edge from the
core to its provider's layer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

__all__ = ["TensorOps", "Executor", "install", "tensor_ops", "executor", "loaded_executor"]


class TensorOps(Protocol):
    """The tensor operator table (:mod:`onnxparam.ops` is one): each operator takes and returns
    ``Tensor`` s as documented in :mod:`onnxparam.ops`."""

    def param_value(self, param) -> Optional[Any]:
        """The value of ``param`` inside the active trace (its graph initializer, a symbolic
        ``Tensor``), or ``None`` outside a trace."""

    def abs(self, *args): ...
    def add(self, *args): ...
    def argmax(self, *args): ...
    def cast(self, *args): ...
    def clamp(self, *args): ...
    def div(self, *args): ...
    def equal(self, *args): ...
    def erf(self, *args): ...
    def exp(self, *args): ...
    def expand(self, *args): ...
    def flatten(self, *args): ...
    def gelu(self, *args): ...
    def getitem(self, *args): ...
    def greater(self, *args): ...
    def greater_equal(self, *args): ...
    def less(self, *args): ...
    def less_equal(self, *args): ...
    def log(self, *args): ...
    def log_softmax(self, *args): ...
    def logical_not(self, *args): ...
    def matmul(self, *args): ...
    def max(self, *args): ...
    def mean(self, *args): ...
    def min(self, *args): ...
    def mul(self, *args): ...
    def neg(self, *args): ...
    def permute(self, *args): ...
    def pow(self, *args): ...
    def relu(self, *args): ...
    def reshape(self, *args): ...
    def sigmoid(self, *args): ...
    def softmax(self, *args): ...
    def sqrt(self, *args): ...
    def squeeze(self, *args): ...
    def sub(self, *args): ...
    def sum(self, *args): ...
    def tanh(self, *args): ...
    def transpose(self, *args): ...
    def unsqueeze(self, *args): ...


class Executor(Protocol):
    """What the runtime (:mod:`onnxparam.runtime`) does for the core."""

    passes: Any
    """The graph passes (``onnxparam.trace.passes.GraphPasses``) module calls trace with."""

    def call_module(self, module, args: tuple, kwargs: dict):
        """``module(*args, **kwargs)``: inlined inside a trace, else run by ONNX Runtime."""

    def run_eager(self, fn, args: tuple, kwargs: dict):
        """The op ``fn`` on concrete tensors, outside a trace."""

    def ortvalue_from_numpy(self, array, device):
        """An ONNX Runtime value holding ``array`` on ``device``."""

    def clear_caches(self) -> None:
        """Forget every cached trace and session (``nn.seed``: seeded dropout restarts)."""


_TENSOR_OPS: Optional[TensorOps] = None
_EXECUTOR: Optional[Executor] = None
_LOADERS: dict = {"tensor_ops": None, "executor": None}


def install(*, tensor_ops: Callable[[], TensorOps], executor: Callable[[], Executor]) -> None:
    """Set the loaders of the two points (the top layer does, once, at ``import onnxparam``);
    each is called on the first use of its point."""
    global _TENSOR_OPS, _EXECUTOR
    _LOADERS["tensor_ops"], _LOADERS["executor"] = tensor_ops, executor
    _TENSOR_OPS = _EXECUTOR = None


def _load(point: str):
    loader = _LOADERS[point]
    if loader is None:
        raise RuntimeError(f"onnxparam's {point} extension point has no provider: import onnxparam first")
    return loader()


def tensor_ops() -> TensorOps:
    """The tensor operator table (loaded on first use)."""
    global _TENSOR_OPS
    table = _TENSOR_OPS
    if table is None:
        table = _TENSOR_OPS = _load("tensor_ops")
    return table


def executor() -> Executor:
    """The executor (loaded on first use)."""
    global _EXECUTOR
    value = _EXECUTOR
    if value is None:
        value = _EXECUTOR = _load("executor")
    return value


def loaded_executor() -> Optional[Executor]:
    """The executor if it has been loaded, else ``None`` (nothing has run, nothing is cached)."""
    return _EXECUTOR
