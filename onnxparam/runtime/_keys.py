"""Cache keys of the runtime: a module's structure, its params' values, call arguments, frozen
into hashable tuples (no tensor data is read).

:func:`call_signature` is the one input signature of a call: module calls (the trace key and
the fast path) and eager ops all key their caches by it."""

from __future__ import annotations

import enum
from typing import Optional

import numpy as np

from ..core.device import Device
from ..core.dtype import DType
from ..core.errors import TraceError
from ..core.param import Param
from ..core.tensor import Tensor
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


def call_signature(args, kwargs, leaves: Optional[list] = None, *, nested: bool = False, cheap: bool = False,
                   placed: bool = True):
    """The input signature of a call ``f(*args, **kwargs)``: the part of a cache key its
    arguments give (hashable; no tensor data is read).

    One entry per positional argument, then ``(name, entry)`` per keyword argument. A tensor's
    entry is ``("T", shape, dtype, placement)``: ``placement`` is ``None`` for a tensor held in
    host memory (a session on any device takes it) and its device for a device-resident one; a
    numpy array counts as a host tensor. Any other value is :func:`_freeze` d (a plain Python
    value is ``(type, value)``, so ``1`` and ``1.0`` differ): the traced graph bakes it in.

    Args:
        args: the positional arguments.
        kwargs: the keyword arguments (their order is part of the signature).
        leaves: when given, the tensors that become graph inputs are appended to it, in input
            order (arrays wrapped as tensors): what the session is run on.
        nested: tensors inside lists, tuples and dicts are graph inputs too (eager ops); without
            it they are frozen by identity (a module's ``forward`` bakes them in as constants).
        cheap: return ``None`` at the first argument that is neither a tensor, an array nor a
            plain Python value (the fast path compares cheap signatures only and keeps no
            reference to argument objects).
        placed: include each tensor's placement; ``False`` for trace keys (a traced graph is
            the same on every device; the session key adds the device).

    Returns:
        a tuple, or ``None`` (only with ``cheap``).

    Raises:
        TraceError: for a symbolic tensor (it belongs to a trace that has ended).
    """
    sig = []
    for value in args:
        entry = _entry(value, leaves, nested, cheap, placed)
        if entry is None:
            return None
        sig.append(entry)
    for name, value in kwargs.items():
        entry = _entry(value, leaves, nested, cheap, placed)
        if entry is None:
            return None
        sig.append((name, entry))
    return tuple(sig)


def _entry(value, leaves, nested, cheap, placed):
    """One argument's part of :func:`call_signature` (``None``: not cheap)."""
    cls = value.__class__
    if cls is np.ndarray:
        value, cls = Tensor.from_numpy(value), Tensor
    if cls is Tensor or isinstance(value, Tensor):
        if value._symbol is not None:
            raise TraceError(f"{value!r} is symbolic: it belongs to a trace that has ended, so ops on it cannot run")
        if leaves is not None:
            leaves.append(value)
        return ("T", value.shape, value.dtype, (None if value._host is not None else value.device) if placed else None)
    if cls in _PLAIN:
        return (cls, value)
    if cheap:
        return None
    if nested and isinstance(value, (list, tuple)):
        return (type(value), tuple(_entry(v, leaves, nested, cheap, placed) for v in value))
    if nested and isinstance(value, dict):
        return (dict, tuple((k, _entry(v, leaves, nested, cheap, placed)) for k, v in value.items()))
    return _freeze(value)


FED_LORA_MODES = ("inputs", "batched")
"""LoRA modes whose traced graph takes the adapters' factors as inputs fed on every call (a
symbolic rank, the scale folded into the fed ``b``): an adapter's rank and scale do not change
the graph, only whether a param has one and its layout."""


def _param_signature(param: Param, mode: Optional[str] = None):
    try:
        shape = tuple(param.lazy_shape())
    except ValueError:
        shape = ("cell", id(param))
    adapter = param.adapter()
    if adapter is None:
        lora = None
    elif mode in FED_LORA_MODES:
        lora = ("fed", bool(adapter.transposed))
    else:
        lora = (adapter.rank, float(adapter.scale), bool(adapter.transposed))
    dtype = param.lazy_dtype()
    if dtype is DType.QFloat:  # NOTE: a quantized param's graph holds its values and scales: key by storage
        return ("param", shape, dtype, lora, _value_token(param.with_adapter(None)))
    return ("param", shape, dtype, lora)


def _structure_key(module, mode: Optional[str] = None, skip: frozenset = frozenset()) -> tuple:
    """Everything about ``module`` that can change its traced graph: module types,
    configuration attributes, param paths / shapes / dtypes / adapters. Values are not part of it.

    ``mode``: the LoRA mode of the trace (in :data:`FED_LORA_MODES` an adapter's rank and scale
    are left out); ``skip``: attribute names that no trace reads (the graph passes'
    ``untraced_attrs``: LoRA's named-adapter set and active name), left out at every module."""
    from ..core.module import Module

    seen: dict = {}

    def node(value, path, private=False):
        # NOTE: a param under a private attribute is outside the traversal (it has no path, so
        # its value cannot be looked up by path): it keys by identity instead.
        if isinstance(value, Param):
            return _Ref(value) if private else _param_signature(value, mode)
        if isinstance(value, Module):
            if id(value) in seen:
                return ("shared", seen[id(value)])
            seen[id(value)] = path
            items = [type(value)]
            for name, child in vars(value).items():
                if name != CONFIG_ATTR and name not in skip:
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
    from ..core.module import Module

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


def _stored(param: Param):
    """What a param's value is stored as: its tensor, or its lazy cell (a re-flagged cell's source)."""
    stored = getattr(param, "_value", None)
    if stored is None:
        stored = getattr(param, "_cell", None) or param
        stored = getattr(stored, "source", None) or stored  # a re-flagged lazy cell: its source's value
    return stored


def _value_token(param: Param):
    """Identity of what a param's initializer is computed from: its stored tensor or lazy cell
    (shared by clones), plus its adapter's. Equal tokens mean equal values."""
    stored = _Ref(_stored(param))
    adapter = param.adapter()
    if adapter is None:
        return stored
    return (stored, _value_token(adapter.a), _value_token(adapter.b), float(adapter.scale), bool(adapter.transposed))


def _memory_owner(array: np.ndarray) -> np.ndarray:
    """The array owning ``array``'s memory (following ``base`` through views; ``array`` itself
    when it owns its memory or views a non-array buffer, e.g. a memory map)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _mentions(token, ids) -> bool:
    """True when a value token (:func:`_value_token`, or a tuple holding such tokens) refers to
    an object whose ``id`` is in ``ids``, or to a host tensor whose memory belongs to an array
    whose ``id`` is in ``ids`` (:func:`_memory_owner`)."""
    cls = token.__class__
    if cls is _Ref:
        obj = token.obj
        if id(obj) in ids:
            return True
        host = getattr(obj, "_host", None) if isinstance(obj, Tensor) else None
        return host is not None and id(_memory_owner(host)) in ids
    if cls is tuple:
        for part in token:
            if _mentions(part, ids):
                return True
    return False
