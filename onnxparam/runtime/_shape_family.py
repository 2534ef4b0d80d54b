"""Automatic dynamic shapes: which dims of a call become symbolic, and how they share symbols.

One piece serves both automatic-dynamic caches: a module call's traces
(:func:`onnxparam.runtime._calls._dynamic_trace`, :attr:`SessionConfig.dynamic_shapes` ``"auto"``)
and a training step's graphs (:mod:`onnxparam.autodiff._dynamic`). A *family* is the calls that
differ only in their tensor arguments' sizes (same structure, argument layout, ranks, dtypes);
:class:`ShapeFamily` remembers the first call's shapes, the dims seen to change, and how those
dims were grouped into symbols, and :meth:`ShapeFamily.generalized` finds or builds the entry
(a trace, a training graph) with them symbolic:

* a dim that changed becomes symbolic for sizes >= 1 (0 is specialized: traced concretely); when
  the build needs concrete sizes (``x.shape[0] == 1`` decided, ``squeeze()``), sizes 0 and 1
  are specialized and symbolic dims stand for sizes >= 2; when that fails too, the family is
  static only (every shape its own entry), as in PyTorch;
* dims of equal sizes (in this call and in the first) share a symbol, until a call where sizes
  once equal differ: from then on each dim has its own symbol.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["ShapeFamily"]


class ShapeFamily:
    """What automatic dynamic remembers about one family of calls.

    ``first``: the first call's shapes (a tuple of int tuples, ``None`` for a non-tensor
    argument); ``dynamic``: the ``(argument index, axis)`` dims made symbolic so far; ``groups``:
    ``{(least, symbolic dims): groups}`` (a group: dims sharing one symbol); ``duck``: dims of
    equal sizes share a symbol; ``least``: the least size a symbolic dim stands for (1, or 2 once
    a build needed sizes 0 and 1 decided); ``static_only``: every shape gets a concrete entry."""

    __slots__ = ("first", "dynamic", "groups", "duck", "least", "static_only")

    def __init__(self, shapes: tuple):
        self.first = shapes
        self.dynamic: frozenset = frozenset()
        self.groups: dict = {}
        self.duck = True
        self.least = 1
        self.static_only = False

    def same_layout(self, shapes: tuple) -> bool:
        """Whether ``shapes`` has the first call's arguments: tensors at the same places, of the
        same ranks."""
        return len(self.first) == len(shapes) and all(
            (a is None) == (b is None) and (a is None or len(a) == len(b)) for a, b in zip(self.first, shapes))

    def changed(self, shapes: tuple) -> set:
        """The ``(argument index, axis)`` dims whose sizes differ from the first call's."""
        return {(i, a) for i, s in enumerate(shapes) if s is not None
                for a, (d, f) in enumerate(zip(s, self.first[i])) if d != f}

    def generalized(self, shapes: tuple, changed, entry_for: Callable) -> Optional[tuple]:
        """The entry serving a call of ``shapes`` with the family's dynamic dims and ``changed``
        symbolic, or ``None`` when the call takes a concrete entry (no dim is symbolic at the
        family's least size, or the family is static only).

        ``entry_for(least, symbolic, groups)`` returns the ``(key, entry)`` with the dims of
        ``symbolic`` symbolic, one symbol per group of ``groups`` (dims as ``(argument index,
        axis)``, standing for sizes >= ``least``), finding it in its cache or building it, or
        ``None`` when the build needs concrete sizes at that bound."""
        if self.static_only:
            return None
        dynamic = self.dynamic | frozenset(changed)
        while True:
            least = self.least
            symbolic = frozenset((i, a) for i, a in dynamic if shapes[i][a] >= least)
            if not symbolic:
                return None  # the first shape again, or only specialized sizes: a concrete entry
            groups = self.groups.get((least, symbolic))
            if groups and not all(len({shapes[i][a] for i, a in group}) == 1 for group in groups):
                self.duck, groups = False, None  # sizes once equal now differ: one symbol per dim
            if not groups:
                by_size: dict = {}
                for i, a in sorted(symbolic):
                    by_size.setdefault((shapes[i][a], self.first[i][a]) if self.duck else (i, a), []).append((i, a))
                groups = tuple(tuple(g) for g in by_size.values())
            found = entry_for(least, symbolic, groups)
            if found is None:  # the build needs concrete sizes at this bound
                if least == 1:
                    self.least = 2
                    continue
                self.static_only = True
                return None
            self.dynamic = dynamic
            self.groups[(least, symbolic)] = groups
            return found
