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

    # NOTE: the runtime's own functions, not wrappers: Module.__call__ binds call_module once
    # and calls it directly (no extra frame per call)
    call_module = staticmethod(call_module)
    run_eager = staticmethod(run_eager)
    ortvalue_from_numpy = staticmethod(ortvalue_from_numpy)
    clear_caches = staticmethod(clear_caches)
