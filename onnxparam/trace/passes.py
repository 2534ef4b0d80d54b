"""The graph-pass interface: what a trace, and the runtime running traced graphs, ask of the
graph passes (LoRA adapters, QDQ quantization) without importing them.

The tracer imports no pass: its callers hand it a :class:`GraphPasses` (the standard one, LoRA
then QDQ, is built in :mod:`onnxparam.quant._passes`; the runtime gets it through the executor
the top layer builds, :class:`onnxparam.core.extension.Executor`). A tracer given no passes holds
every param as its raw value.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["GraphPasses", "LORA_MODES", "TRACE_LORA_MODES", "NO_PASSES"]

LORA_MODES = ("merge", "keep", "inputs")
"""How an adapted weight appears in a traced graph: ``"merge"``: one initializer
``base + scale * (a @ b)`` per adapted weight (no overhead); ``"keep"``: the base and the factors
as initializers, the adapter as graph nodes; ``"inputs"``: as ``"keep"``, with the factors also
overridable graph inputs."""

TRACE_LORA_MODES = LORA_MODES + ("batched",)
"""The modes a trace takes: :data:`LORA_MODES` and ``"batched"`` (every named adapter stacked,
one chosen per batch row by an ``adapter_index`` input; :mod:`onnxparam.lora._batched`). Module
calls run in ``"batched"`` mode only through ``module(x, adapter_index=...)``."""


def _raw_param(param, mode: str):
    return param


def _no_names(model) -> tuple:
    return ()


def _no_factors(model, by_path) -> list:
    return []


def _no_options():
    return None


def _no_context(options):
    return contextlib.nullcontext()


def _never(value) -> bool:
    return False


def _no_structure(module, mode):
    return None


@dataclass(frozen=True)
class GraphPasses:
    """The graph passes a trace runs, given by its caller (the tracer imports none of them).

    Attributes:
        held_param: ``(param, lora_mode) -> Param`` whose value becomes ``param``'s initializer
            (the LoRA pass keeps the raw base unless ``"merge"``).
        quantized_param: ``(tracer, param, path, shape) -> Tensor | DType`` for a ``QFloat``
            param: its dequantized value emitted into the graph, or the float dtype to hold it
            as (the QDQ pass); ``None``: a quantized param is held as its dequantized F32.
        finish: ``(tracer) -> None`` rewrites run in order when the graph is finished, before
            the initializers are registered (LoRA adapters as nodes, then QDQ fusion).
        fed_input_names: ``(onnx_ir.Model) -> iterable of str``: the graph inputs a pass feeds
            from params at run time (LoRA factors in mode ``"inputs"``).
        fed_inputs: ``(onnx_ir.Model, {path: Param}) -> list``: the ``(graph input, array)``
            feeds of those inputs, as the session runner takes them.
        options: ``() -> options | None``: the pass options a caller set around a call
            (``quant.qdq_options``), ``None`` when none is set.
        call_options: ``() -> options``: the options a module call traces with when none is set.
        with_options: ``(options) -> context manager`` that sets them for the calls inside.
        is_pass_initializer: ``(onnx_ir.Value) -> bool``: an initializer a pass wrote (QDQ
            values and scales), not a param's value.
        keyword_calls: ``((keyword, handler), ...)``: a module call given ``keyword`` (that its
            ``forward`` does not take) is ``handler(module, args, kwargs)`` instead (LoRA's
            ``adapter_index``: many adapters, one per batch row).
        untraced_attrs: names of module attributes that no trace reads (LoRA's named-adapter
            set and active adapter name): the runtime leaves them out of its trace keys.
        structure_key: ``(module, lora_mode) -> hashable``: what the passes read of a module
            besides its params, for the runtime's trace key (LoRA's stacked targets in
            ``"batched"`` mode); ``None`` when nothing.
    """

    held_param: Callable = _raw_param
    quantized_param: Optional[Callable] = None
    finish: tuple = ()
    fed_input_names: Callable = _no_names
    fed_inputs: Callable = _no_factors
    options: Callable = _no_options
    call_options: Callable = _no_options
    with_options: Callable = _no_context
    is_pass_initializer: Callable[[Any], bool] = _never
    keyword_calls: tuple = ()
    untraced_attrs: frozenset = frozenset()
    structure_key: Callable = _no_structure


NO_PASSES = GraphPasses()
"""No pass: params held raw, quantized params as their dequantized F32."""
