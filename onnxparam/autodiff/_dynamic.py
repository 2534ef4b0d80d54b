"""Automatic dynamic shapes for training graphs: one training graph (and one session) for every
batch size and sequence length, as :attr:`onnxparam.runtime.SessionConfig.dynamic_shapes`
``"auto"`` does for ``module(x)``.

The first call of a ``(loss_fn, module structure, argument layout, trainable paths)`` family
traces with concrete shapes. When a later call differs in some input dims, ``loss_fn`` is traced
once more with those dims symbolic (dims of equal sizes share a symbol) and its backward graph is
built with shape arithmetic (the rules of :mod:`._rules` need no static dim); that training graph
serves every later size. When the module declares dynamic dims (an imported model whose graph
inputs have symbolic dims, see :func:`declared_dynamic`), the first call already builds the
symbolic graph, with those dims (and the other arguments' dims of the same sizes) symbolic, so
one training graph and one session serve every batch size from the start (if that build fails,
the family goes on as above). Symbolic dims stand for sizes >= 1, else (a loss that needs
``x.shape[0] == 1`` decided) sizes >= 2 with sizes 0 and 1 traced concretely; a loss or a rule
that needs concrete sizes falls back to one training graph per shape. Which dims are symbolic
and how they share symbols is the module calls' rule, :class:`onnxparam.runtime._shape_family.ShapeFamily`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

from ..core.tensor import Tensor
from ..runtime._shape_family import ShapeFamily

__all__ = ["dynamic_entry", "declared_dynamic", "clear"]

MAX_FAMILIES = 64

_families: "OrderedDict[Any, ShapeFamily]" = OrderedDict()


def clear() -> None:
    _families.clear()


def _shapes(args, kwargs) -> tuple:
    values = list(args) + list(kwargs.values())
    return tuple(tuple(v.shape) if isinstance(v, Tensor) else None for v in values)


def declared_dynamic(module, args, kwargs) -> frozenset:
    """``(argument index, axis)`` of the dims to make symbolic on a family's first call: the dims
    ``module`` declares dynamic (``module.input_specs()``: an imported model's graph inputs with
    symbolic dims), found on the tensor arguments that match one declared input (by keyword
    name, else by being the only input of their rank and dtype), and every other tensor
    argument's dims of the same sizes (the labels' batch dim). Sizes 0 and 1 are left concrete.
    Empty when the module declares nothing (its first call is traced concretely)."""
    specs_of = getattr(module, "input_specs", None)
    if not callable(specs_of):
        return frozenset()
    try:
        specs = list(specs_of())
    except Exception:  # noqa: BLE001 - an input of unknown rank or type: nothing declared to use
        return frozenset()
    values = list(args) + list(kwargs.values())
    names = [None] * len(args) + list(kwargs)
    chosen, matched = set(), set()
    for i, v in enumerate(values):
        if not isinstance(v, Tensor):
            continue
        found = [s for s in specs if names[i] is not None and s.name == names[i]] or \
            [s for s in specs if len(s.shape) == len(v.shape) and s.dtype == v.dtype]
        if len(found) == 1 and len(found[0].shape) == len(v.shape):
            matched.add(i)
            chosen.update((i, a) for a, d in enumerate(found[0].shape) if not isinstance(d, int) and v.shape[a] >= 2)
    sizes = {values[i].shape[a] for i, a in chosen}
    for i, v in enumerate(values):
        if isinstance(v, Tensor) and i not in matched:  # (a matched input's static dims stay static)
            chosen.update((i, a) for a, d in enumerate(v.shape) if d in sizes)
    return frozenset(chosen)


def dynamic_entry(family_key, args, kwargs, lookup: Callable, build: Callable,
                  declared: Callable[[], frozenset] = frozenset) -> Optional[tuple]:
    """The generalized ``(key, entry)`` for this call, or ``None`` for a concrete one.

    Args:
        family_key: the call's family (everything of its cache key but the input shapes).
        args, kwargs: the call's arguments (tensors and plain values).
        lookup: ``lookup(key)`` the cached entry of a generalized key, or ``None``.
        build: ``build(key, symbolic_shapes, least)`` traces and builds the training graph
            with those shapes (a shape per tensor argument, ``str`` for symbolic dims; ``None``
            for the other arguments), caches it under ``key`` and returns it; raises
            :class:`~onnxparam.core.errors.TraceError` when the loss or a rule needs concrete sizes.
        declared: called on a family's first call: the ``(argument, axis)`` dims to make
            symbolic at once (:func:`declared_dynamic`); empty: a concrete first call.
    """
    shapes = _shapes(args, kwargs)
    family = _families.get(family_key)

    def entry_for(least, symbolic, groups):
        name = {m: f"dyn{k}" for k, g in enumerate(groups) for m in g}
        sym_shapes = tuple(None if s is None else tuple(name.get((i, a), d) for a, d in enumerate(s))
                           for i, s in enumerate(shapes))
        key = ("dynamic", family_key, least, sym_shapes)
        entry = lookup(key)
        if entry is None:
            try:
                entry = build(key, sym_shapes, least)
            except Exception:  # noqa: BLE001 - the loss (its own error) or a rule needs concrete sizes
                return None
        return key, entry

    if family is None or not family.same_layout(shapes):
        family = _families[family_key] = ShapeFamily(shapes)
        while len(_families) > MAX_FAMILIES:
            _families.popitem(last=False)
        eager = declared()
        if not eager:
            return None
        found = family.generalized(shapes, eager, entry_for)
        if found is None:  # the loss or a rule needs concrete sizes: a concrete first call, as without
            _families[family_key] = ShapeFamily(shapes)
        return found
    _families.move_to_end(family_key)
    return family.generalized(shapes, family.changed(shapes), entry_for)
