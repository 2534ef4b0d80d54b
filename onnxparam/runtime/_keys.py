"""Cache keys of the runtime: a module's structure, its params' values, call arguments, frozen
into hashable tuples (no tensor data is read)."""

from __future__ import annotations

import enum

import numpy as np

from ..device import Device
from ..dtype import DType
from ..param import Param
from ..tensor import Tensor
from ._config import CONFIG_ATTR

_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class _Ref:
    """A key part that compares by identity (and keeps its object alive, so ids stay unique)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Ref) and other.obj is self.obj


def _freeze(value):
    """A hashable key for a configuration value (type-tagged, so ``1`` and ``1.0`` differ);
    objects that are not hashable, arrays and tensors compare by identity."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (enum.Enum, Device)):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((_freeze(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, np.ndarray):
        # NOTE: by content, whatever the size: the forward bakes an array attribute's values into
        # the graph, and an in-place write must select another trace (identity would miss it)
        return (np.ndarray, value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return (type(value), value.item())
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_freeze(v) for v in value))
    if isinstance(value, Tensor):
        return _Ref(value)
    try:
        hash(value)
    except TypeError:
        return _Ref(value)
    return value


def _param_signature(param: Param):
    try:
        shape = tuple(param.lazy_shape())
    except ValueError:
        shape = ("cell", id(param))
    adapter = param.adapter()
    lora = None if adapter is None else (adapter.rank, float(adapter.scale), bool(adapter.transposed))
    dtype = param.lazy_dtype()
    if dtype is DType.QFloat:  # NOTE: a quantized param's graph holds its values and scales: key by storage
        return ("param", shape, dtype, lora, _value_token(param.with_adapter(None)))
    return ("param", shape, dtype, lora)


def _structure_key(module) -> tuple:
    """Everything about ``module`` that can change its traced graph: module types,
    configuration attributes, param paths / shapes / dtypes / adapters. Values are not part of it."""
    from ..module import Module

    seen: dict = {}

    def node(value, path, private=False):
        # NOTE: a param under a private attribute is outside the traversal (it has no path, so
        # its value cannot be looked up by path): it keys by identity instead.
        if isinstance(value, Param):
            return _Ref(value) if private else _param_signature(value)
        if isinstance(value, Module):
            if id(value) in seen:
                return ("shared", seen[id(value)])
            seen[id(value)] = path
            items = [type(value)]
            for name, child in vars(value).items():
                if name != CONFIG_ATTR:
                    items.append((name, node(child, f"{path}.{name}", private or name.startswith("_"))))
            return tuple(items)
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(node(v, f"{path}.{i}", private) for i, v in enumerate(value)))
        if isinstance(value, dict):
            return (dict, tuple((_freeze(k), node(v, f"{path}.{k}", private)) for k, v in value.items()))
        return _freeze(value)

    return node(module, "")


def _mutable_state(module) -> tuple:
    """``(module ids, watched)`` of ``module``'s tree: the ids of its modules (whose attribute
    writes bump ``module._MUTATIONS``) and ``(object, snapshot, is_array)`` for every mutable
    value in its configuration (lists, dicts, sets, numpy arrays) that can change in place
    without an attribute write. ``_unchanged(watched)`` tells whether they still match."""
    from ..module import Module

    ids: set = set()
    watched: list = []
    seen: set = set()

    def visit(value):
        if isinstance(value, (Param, Tensor)) or value.__class__ in _PLAIN or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, Module):
            ids.add(id(value))
            for name, child in vars(value).items():
                if name != CONFIG_ATTR:
                    visit(child)
        elif isinstance(value, np.ndarray):
            watched.append((value, value.tobytes(), True))
        elif isinstance(value, (list, dict, set)):
            watched.append((value, value.copy(), False))
            for child in (value.values() if isinstance(value, dict) else value):
                visit(child)
        elif isinstance(value, tuple):
            for child in value:
                visit(child)

    visit(module)
    return ids, tuple(watched)


def _unchanged(watched: tuple) -> bool:
    """True when every value of :func:`_mutable_state`'s ``watched`` still equals its snapshot."""
    try:
        for obj, snapshot, is_array in watched:
            if (obj.tobytes() if is_array else obj) != snapshot:
                return False
    except Exception:  # noqa: BLE001 - e.g. an item replaced by an array (ambiguous truth): changed
        return False
    return True


def _value_token(param: Param):
    """Identity of what a param's initializer is computed from: its stored tensor or lazy cell
    (shared by clones), plus its adapter's. Equal tokens mean equal values."""
    stored = getattr(param, "_value", None)
    if stored is None:
        stored = getattr(param, "_cell", None) or param
    stored = _Ref(stored)
    adapter = param.adapter()
    if adapter is None:
        return stored
    return (stored, _value_token(adapter.a), _value_token(adapter.b), float(adapter.scale), bool(adapter.transposed))
