"""Tensor-name rewriting shared by every reader and loader: regex key remapping and contiguous
index re-numbering (Burn's ``burn-store`` ``KeyRemapper`` and ``map_indices_contiguous``).

Formats layer: names only, no tensors. :func:`onnxparam.formats._pytorch.read_pytorch` applies
them while reading a checkpoint; :func:`onnxparam.convert.apply_record` and
:func:`onnxparam.convert.convert` apply them to any record. This is the one implementation
(``onnxparam.convert`` re-exports both names).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["KeyRemapper", "map_indices_contiguous"]

_RUST_GROUP = re.compile(r"\$(?:\$|\{(\w+)\}|(\w+))")


def _python_replacement(replacement: str) -> str:
    """Accept Burn's (Rust ``regex``) ``$1`` / ``${name}`` / ``$$`` next to Python's ``\\1``."""

    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return r"\g<" + (match.group(1) or match.group(2)) + ">"

    return _RUST_GROUP.sub(sub, replacement)


class KeyRemapper:
    """Renames tensors by an ordered list of regex rules (Burn's ``KeyRemapper``).

    Each rule is ``re.sub(pattern, replacement, name)`` on the result of the rules before it,
    replacing every match. Replacements take Python's ``\\1`` / ``\\g<name>`` and Burn's ``$1``
    / ``${name}`` (``$$`` is a literal ``$``)::

        KeyRemapper([(r"^model\\.", ""), (r"\\.ln_(\\d)\\.", r".norm$1.")])

    Args:
        rules: ``(pattern, replacement)`` pairs, in order.

    Raises:
        re.error: for an invalid pattern (at construction) or replacement (when applied).
    """

    def __init__(self, rules: Iterable[tuple[str, str]] = ()):
        self._rules = tuple((re.compile(p), r, _python_replacement(r)) for p, r in rules)

    @staticmethod
    def of(remap) -> "KeyRemapper":
        """A remapper from a remapper, ``None``, a list of pairs, a ``{pattern: replacement}``
        dict, or any object with an ``apply(name) -> name`` method (returned as it is)."""
        if isinstance(remap, KeyRemapper):
            return remap
        if remap is None:
            return KeyRemapper()
        if isinstance(remap, Mapping):
            return KeyRemapper(remap.items())
        if callable(getattr(remap, "apply", None)):
            return remap
        return KeyRemapper(remap)

    def add(self, pattern: str, replacement: str) -> "KeyRemapper":
        """A new remapper with one more rule at the end (Burn's ``add_pattern``)."""
        return KeyRemapper([(p.pattern, r) for p, r, _ in self._rules] + [(pattern, replacement)])

    @property
    def rules(self) -> tuple:
        return tuple((p.pattern, r) for p, r, _ in self._rules)

    def __bool__(self) -> bool:
        return bool(self._rules)

    def apply(self, name: str) -> str:
        """``name`` after every rule."""
        for pattern, _, replacement in self._rules:
            name = pattern.sub(replacement, name)
        return name

    __call__ = apply

    def __repr__(self) -> str:
        return f"KeyRemapper({list(self.rules)!r})"


def map_indices_contiguous(names: Iterable[str]) -> dict:
    """``{old: new}`` renumbering the integer segments of dotted names to ``0, 1, 2 ...``.

    Every position (the dotted prefix before an integer segment) is renumbered on its own,
    keeping ascending order: ``fc.0, fc.2, fc.4`` become ``fc.0, fc.1, fc.2``, and nested
    indices are renumbered per parent (``a.1.x.5, a.3.x.7`` become ``a.0.x.0, a.1.x.0``).
    Burn's ``map_indices_contiguous``; for PyTorch ``nn.Sequential`` checkpoints whose
    parameter-free layers (ReLU, Dropout) leave gaps in the numbering.
    """
    names = list(names)
    positions: dict[str, set] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                positions.setdefault(".".join(parts[:i]), set()).add(int(part))
    renumber = {prefix: {old: new for new, old in enumerate(sorted(seen))} for prefix, seen in positions.items()}
    out = {}
    for name in names:
        parts = name.split(".")
        new_parts = [
            str(renumber[".".join(parts[:i])][int(part)]) if part.isdigit() else part
            for i, part in enumerate(parts)
        ]
        out[name] = ".".join(new_parts)
    return out
