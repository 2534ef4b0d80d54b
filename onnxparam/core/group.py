"""``ParamGroup``: a selection of params by path, predicate, regex or id (Burn's ``ParamGroup``).

A group answers :meth:`ParamGroup.matches` for a ``(ParamId, path)`` pair, where the path is the
param's dotted module path (``conv1.conv.weight``, ``layers.0.bias``, ``fc.weight.lora.a``).
Groups drive ``freeze_group``, ``unfreeze_group``, ``quantize_weights_group`` and LoRA's
``param_group``.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from .param import ParamId

__all__ = ["ParamGroup"]

Predicate = Callable[[str], bool]


class ParamGroup:
    """A set of params. Build with the ``from_*`` constructors, :meth:`all` or
    :meth:`ids_from_module`; combine with :meth:`excluding`."""

    __slots__ = ("_test", "_description")

    def __init__(self, test: Callable[[ParamId, str], bool], description: str):
        self._test = test
        self._description = description

    def matches(self, id: ParamId, path: str) -> bool:
        """True when the param with this id at this path belongs to the group."""
        return bool(self._test(id, path))

    def __call__(self, id: ParamId, path: str) -> bool:
        return self.matches(id, path)

    def __repr__(self) -> str:
        return f"ParamGroup({self._description})"

    # -- constructors -------------------------------------------------------------------------

    @staticmethod
    def all() -> "ParamGroup":
        """Every param."""
        return ParamGroup(lambda id, path: True, "all")

    @staticmethod
    def from_path(path: str) -> "ParamGroup":
        """The param at ``path`` and every param below it (``"fc1"`` matches ``fc1.weight``
        and ``fc1.bias``, not ``fc10.weight``)."""
        prefix = path + "."
        return ParamGroup(lambda id, p: p == path or p.startswith(prefix), f"path={path!r}")

    @staticmethod
    def from_paths(paths: Iterable[str]) -> "ParamGroup":
        """The union of :meth:`from_path` over ``paths``."""
        paths = tuple(paths)
        groups = [ParamGroup.from_path(p) for p in paths]
        return ParamGroup(lambda id, p: any(g.matches(id, p) for g in groups), f"paths={list(paths)!r}")

    @staticmethod
    def from_predicate(predicate: Predicate) -> "ParamGroup":
        """Params whose path satisfies ``predicate(path)``."""
        return ParamGroup(lambda id, p: predicate(p), f"predicate={getattr(predicate, '__name__', predicate)}")

    @staticmethod
    def from_predicates(predicates: Iterable[Predicate]) -> "ParamGroup":
        """Params whose path satisfies *every* predicate (AND)."""
        preds = tuple(predicates)
        return ParamGroup(lambda id, p: all(f(p) for f in preds), f"all of {len(preds)} predicates")

    @staticmethod
    def from_any_predicates(predicates: Iterable[Predicate]) -> "ParamGroup":
        """Params whose path satisfies *any* predicate (OR)."""
        preds = tuple(predicates)
        return ParamGroup(lambda id, p: any(f(p) for f in preds), f"any of {len(preds)} predicates")

    @staticmethod
    def from_regex(pattern: str) -> "ParamGroup":
        """Params whose path the regex matches anywhere (``re.search``, as Rust's
        ``Regex::is_match``; anchor with ``^``/``$`` for whole paths).

        Raises:
            re.error: for an invalid pattern.
        """
        compiled = re.compile(pattern)
        return ParamGroup(lambda id, p: compiled.search(p) is not None, f"regex={pattern!r}")

    @staticmethod
    def from_regexes(patterns: Iterable[str]) -> "ParamGroup":
        """Params whose path *every* regex matches (AND)."""
        patterns = tuple(patterns)
        compiled = [re.compile(p) for p in patterns]
        return ParamGroup(lambda id, p: all(c.search(p) is not None for c in compiled), f"regexes={list(patterns)!r}")

    @staticmethod
    def from_ids(ids: Iterable[ParamId]) -> "ParamGroup":
        """Params whose id is in ``ids``."""
        ids = frozenset(ParamId(i) for i in ids)
        return ParamGroup(lambda id, p: id in ids, f"{len(ids)} ids")

    @staticmethod
    def ids_from_module(module) -> "ParamGroup":
        """The params of ``module`` (by id, so the group still matches after renames)."""
        return ParamGroup.from_ids(param.id for _, param in module.named_params())

    def excluding(self, other: "ParamGroup") -> "ParamGroup":
        """This group minus ``other``."""
        return ParamGroup(lambda id, p: self.matches(id, p) and not other.matches(id, p),
                          f"{self._description} excluding {other._description}")
