"""What the LoRA passes read of a module besides its params, for the runtime's trace keys
(:class:`onnxparam.trace.passes.GraphPasses`: ``untraced_attrs``, ``structure_key``).

A module's named adapters (:func:`onnxparam.lora.add_adapter`) live in two private attributes of
the module that owns them; ``set_adapter`` / ``add_adapter`` return copies holding a new set. No
trace of the ``"merge"`` / ``"keep"`` / ``"inputs"`` modes reads them (those read the adapters the
params carry), so they are left out of the runtime's keys: switching adapters in ``"inputs"`` mode
finds the same trace and session. A ``"batched"`` trace reads the set: its targets (paths, dims,
layout, dtype) are its key; the values, ranks and names are fed or looked up on every call.
"""

from __future__ import annotations

from typing import Optional

from ..core.errors import LoraError
from ._adapters import _ACTIVE_ATTR, _SET_ATTR
from ._batched import BATCHED_MODE, stack_adapters

__all__ = ["UNTRACED_ATTRS", "structure_key"]

UNTRACED_ATTRS = frozenset({_SET_ATTR, _ACTIVE_ATTR})
"""The module attributes of the named-adapter set and the active adapter's name."""


def structure_key(module, mode: Optional[str]):
    """``None`` outside ``"batched"`` mode; in it, the stacked targets of ``module``'s named
    adapters: ``((path, kind, shape, d_in, d_out, transposed, dtype), ...)``."""
    if mode != BATCHED_MODE:
        return None
    try:
        stacks = stack_adapters(module, values=False)
    except LoraError:
        return None  # the trace raises it, naming the problem
    return tuple(sorted((path, t.kind, tuple(t.shape), t.d_in, t.d_out, t.transposed, t.dtype)
                        for path, t in stacks.targets.items()))
