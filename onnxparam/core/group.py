"""``ParamGroup``: a selection of params by path, predicate, regex or id (Burn's ``ParamGroup``).

A group answers :meth:`ParamGroup.matches` for a ``(ParamId, path)`` pair, where the path is the
param's dotted module path (``conv1.conv.weight``, ``layers.0.bias``, ``fc.weight.lora.a``).
Groups drive ``freeze_group``, ``unfreeze_group``, ``quantize_weights_group`` and LoRA's
``param_group``.
"""

from __future__ import annotations

import re
import difflib
from typing import Callable, Iterable

from .errors import ParamGroupError
from .param import ParamId

__all__ = ["ParamGroup", "resolve_group"]

Predicate = Callable[[str], bool]


class ParamGroup:
    """A set of params. Build with the ``from_*`` constructors, :meth:`all` or
    :meth:`ids_from_module`; combine with :meth:`excluding`."""

    __slots__ = ("_test", "_description", "_paths")

    def __init__(self, test: Callable[[ParamId, str], bool], description: str):
        self._test = test
        self._description = description
        self._paths = None  # the paths of a from_path / from_paths group (each must name a param)

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
        group = ParamGroup(lambda id, p: p == path or p.startswith(prefix), f"path={path!r}")
        group._paths = (path,)
        return group

    @staticmethod
    def from_paths(paths: Iterable[str]) -> "ParamGroup":
        """The union of :meth:`from_path` over ``paths`` (none: the empty group).

        ``freeze_group`` / ``unfreeze_group`` check each path against the module: one that names
        no param is a :class:`~onnxparam.ParamGroupError`, except an imported weight's ONNX
        name (``"onnx::MatMul_12"``), which stands for that weight's path
        (``onnx_x3a__x3a_MatMul_12``) when exactly one param of the module has it."""
        paths = tuple(paths)
        groups = [ParamGroup.from_path(p) for p in paths]
        group = ParamGroup(lambda id, p: any(g.matches(id, p) for g in groups), f"paths={list(paths)!r}")
        group._paths = paths
        return group

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


def _under(path: str, params: Iterable[str]) -> bool:
    prefix = path + "."
    return any(p == path or p.startswith(prefix) for p in params)


def _closest(text: str, params: list, onnx_names: dict) -> str:
    """`` (closest: 'a', 'b')`` for a name that matched nothing, or ``""``."""
    candidates = list(params) + sorted({p.rsplit(".", 1)[0] for p in params if "." in p})
    near = difflib.get_close_matches(text, candidates, n=3, cutoff=0.5)
    near += [path for name, paths in onnx_names.items() if text in name and len(paths) == 1 for path in paths]
    near = list(dict.fromkeys(near))[:4]
    return f" (closest: {', '.join(repr(p) for p in near)})" if near else ""


def resolve_group(group: ParamGroup, params: list, onnx_names: dict, verb: str) -> ParamGroup:
    """``group`` checked against a module's params before ``verb`` applies it.

    Args:
        group: the group given to the verb.
        params: ``[(path, ParamId)]`` of the module's params.
        onnx_names: ``{ONNX name: [path, ...]}`` of the module's imported weights (ONNX names
            that are not module paths: ``onnx::MatMul_12`` -> ``onnx_x3a__x3a_MatMul_12``).
        verb: how the message names the caller (``"freeze_group"``).

    Returns:
        ``group``, or, for a :meth:`ParamGroup.from_paths` group naming an imported weight by
        its ONNX name (one param has it), the same group over the module paths.

    Raises:
        ParamGroupError: a path of a ``from_path(s)`` group that names no param (nor exactly
            one imported weight by its ONNX name), or any other group that matches no param
            of a module that has params; the message names the group and the closest paths
            (with the path of an ONNX name the group matches: groups match module paths).
    """
    paths = [p for p, _ in params]
    if group._paths is not None:
        resolved, problems = [], []
        for path in group._paths:
            if _under(path, paths):
                resolved.append(path)
            elif len(onnx_names.get(path, ())) == 1:
                resolved.append(onnx_names[path][0])
            elif len(onnx_names.get(path, ())) > 1:
                problems.append(f"{path!r} is the ONNX name of {len(onnx_names[path])} weights "
                                f"({', '.join(repr(p) for p in onnx_names[path])}): give the module path")
            else:
                problems.append(f"{path!r} names no param{_closest(path, paths, onnx_names)}")
        if problems:
            raise ParamGroupError(f"{verb}({group!r}) would change nothing for a path: " + "; ".join(problems))
        if list(resolved) == list(group._paths):
            return group
        return ParamGroup.from_paths(resolved)
    if not params or any(group.matches(pid, path) for path, pid in params):
        return group
    ids = dict(params)
    by_onnx = [p for name, ps in onnx_names.items() for p in ps if group.matches(ids[p], name)]
    hint = (f"; it matches the ONNX names of {', '.join(repr(p) for p in by_onnx[:4])}: groups match module "
            "paths (ParamGroup.from_paths takes ONNX names too)" if by_onnx else "")
    raise ParamGroupError(f"{verb}({group!r}) matches no param of the module ({len(params)} params, e.g. "
                          f"{', '.join(repr(p) for p in paths[:3])}){hint}")
