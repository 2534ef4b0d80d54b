"""What the LoRA passes read of a module besides its params, for the runtime's trace keys
(:class:`onnxparam.trace.passes.GraphPasses`: ``untraced_attrs``, ``structure_key``).

A module's named adapters (:func:`onnxparam.lora.add_adapter`) live in two private attributes of
the module that owns them; ``set_adapter`` / ``add_adapter`` return copies holding a new set. No
trace of the ``"merge"`` / ``"keep"`` / ``"inputs"`` modes reads them (those read the adapters the
params carry), so they are left out of the runtime's keys: switching adapters in ``"inputs"`` mode
finds the same trace and session. A ``"batched"`` trace stacks every named adapter per target:
its key is the set's targets (path, ``d_in``, ``d_out``, layout), read from the set alone; the
runtime's structure key beside it holds the rest (each param's shape, dtype and whether it
carries an adapter now, i.e. the active adapter's targets). The values, ranks and names are fed
or looked up on every call.
"""

from __future__ import annotations

import weakref
from typing import Optional

from ._adapters import _ACTIVE_ATTR, _SET_ATTR
from ._batched import BATCHED_MODE

__all__ = ["UNTRACED_ATTRS", "structure_key"]

UNTRACED_ATTRS = frozenset({_SET_ATTR, _ACTIVE_ATTR})
"""The module attributes of the named-adapter set and the active adapter's name."""

# set -> its key (a set is immutable: add / delete / switching make new sets)
_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _set_key(sets) -> tuple:
    hit = _KEYS.get(sets)
    if hit is None:
        found = set()
        for name in sets.names:
            for path, adapter in sets._sets[name].items():
                found.add((path, int(adapter.a.lazy_shape()[0]), int(adapter.b.lazy_shape()[1]),
                           bool(adapter.transposed)))
        hit = _KEYS[sets] = tuple(sorted(found, key=repr))
    return hit


def structure_key(module, mode: Optional[str]):
    """``None`` outside ``"batched"`` mode; in it, the targets of the named adapters ``module``
    owns (module docstring): ``((path, d_in, d_out, transposed), ...)`` (the ranks are symbolic
    in the graph, the stacks are fed at the base's dtype), ``()`` without a set."""
    if mode != BATCHED_MODE:
        return None
    sets = getattr(module, _SET_ATTR, None)
    return () if sets is None else _set_key(sets)
