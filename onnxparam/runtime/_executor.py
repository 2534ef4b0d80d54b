"""The executor the runtime gives the core (:class:`onnxparam.core.extension.Executor`)."""

from __future__ import annotations

from ._calls import call_module, clear_caches
from ._devices import ortvalue_from_numpy
from ._eager import run_eager

__all__ = ["RuntimeExecutor"]


class RuntimeExecutor:
    """Module calls, eager ops, device values and cache clearing through ONNX Runtime, tracing
    with ``passes`` (an :class:`onnxparam.trace.passes.GraphPasses`: the top layer gives the
    standard LoRA / QDQ passes)."""

    def __init__(self, passes):
        self.passes = passes

    @staticmethod
    def call_module(module, args: tuple, kwargs: dict):
        return call_module(module, args, kwargs)

    @staticmethod
    def run_eager(fn, args: tuple, kwargs: dict):
        return run_eager(fn, args, kwargs)

    @staticmethod
    def ortvalue_from_numpy(array, device):
        return ortvalue_from_numpy(array, device)

    @staticmethod
    def clear_caches() -> None:
        clear_caches()
