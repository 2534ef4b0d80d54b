"""Guards on the outside values a trace reads by name (as ``torch.compile`` guards its sources).

A traced ``loss_fn`` or a custom module's ``forward`` may read tensors and Python values from
its globals or its closure (``bx``, ``scale``, ``state["t"]``); the trace bakes them into the
graph as constants. A cache that reuses that graph later must know whether those names still
hold what the trace saw. :func:`collect_guards` records, for every name the traced code reads
(``co_names`` found in ``__globals__``, the closure cells of ``co_freevars``; recursively for
nested functions / lambdas defined in it, user functions it reads, and the methods of the
traced modules' user classes), a :class:`Guard`: the namespace or cell, the name, the object's
identity; for Python numbers / bools / strings its value; for list / dict / tuple containers a
shallow snapshot of their items (identities, scalar values); for small numpy arrays their bytes.
:func:`guards_hold` tells whether all still hold (a cache entry whose guards fail is traced
again). :func:`lifting` lets a trace make the float tensors such names hold graph inputs
instead (``grad`` feeds them from the names; their guards check shape and dtype only, so a
loss_fn must not read such a tensor's values in Python, e.g. ``x.to_numpy() > 0``: that
result would be baked unguarded).

Not guarded: modules, classes, library functions (``onnxparam``, ``numpy`` ...), builtins;
values reached through another object's attribute (``cfg.batch``: the trace warns with
:class:`~onnxparam.core.errors.CaptureWarning` when such a value is a baked tensor,
:func:`uncovered_tensors`); a large array mutated in place (identity only above
:data:`ARRAY_BYTES`).
"""

from __future__ import annotations

import types
from typing import Iterable, Optional

import numpy as np

__all__ = ["Guard", "collect_guards", "guards_hold", "note_retrace", "RETRACE_WARN_AFTER", "guarded_objects", "uncovered_tensors", "ARRAY_BYTES",
           "MAX_ITEMS"]

ARRAY_BYTES = 1 << 16
"""numpy arrays up to this many bytes are guarded by value too (in-place writes seen)."""

MAX_ITEMS = 256
"""Containers up to this many items are snapshot item by item; larger ones by identity and length."""

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_SKIP_MODULES = ("onnxparam", "numpy", "onnx", "onnx_ir", "onnxruntime", "torch", "builtins", "math",
                 "functools", "typing", "collections")
_MISSING = object()


def _library(obj) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod.split(".", 1)[0] in _SKIP_MODULES


class _Same:
    """A snapshot part that compares by identity; it holds its object, so a replaced item's id
    cannot be reused by a new object that would then compare equal."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return other.__class__ is _Same and other.obj is self.obj

    __hash__ = object.__hash__


def _token(value):
    """What a guard compares: a scalar by type and value, anything else by identity."""
    if value.__class__ in _SCALARS or isinstance(value, np.generic):
        return (1, value.__class__, value)
    return (0, _Same(value))


def _snapshot(value):
    """``(token, items)``: the value's token and, for a container / small array, its contents."""
    cls = value.__class__
    if cls in (list, tuple):
        if len(value) > MAX_ITEMS:
            return len(value)
        return tuple(_token(v) for v in value)
    if cls is dict:
        if len(value) > MAX_ITEMS:
            return len(value)
        return tuple((k, _token(v)) for k, v in value.items())
    if isinstance(value, np.ndarray):
        return value.tobytes() if value.nbytes <= ARRAY_BYTES else None
    return None


class Guard:
    """One guarded name: ``holds()`` is true while ``name`` in ``space`` (a globals dict or a
    closure cell) is the same object (scalars: the same type and value) with the same shallow
    contents as when the trace ran. Comparing ``guard != True`` evaluates it (so a guard can sit
    in the runtime's watched-value tuples, whose check is ``obj != snapshot``)."""

    __slots__ = ("space", "name", "obj", "token", "items", "label", "lifted")

    def __init__(self, space, name: Optional[str], value, label: Optional[str] = None):
        self.space = space
        self.name = name
        self.label = label or name or "<closure>"
        self.lifted = None  # (shape, dtype) of a tensor fed as a graph input: any such tensor holds
        # NOTE: the object is kept (not only its id) so the id cannot be reused while guarded
        self.obj = value
        self.token = _token(value)
        self.items = _snapshot(value)

    def current(self):
        """The value the guarded name holds now (a lifted tensor's feed)."""
        return self._current()

    def _current(self):
        if self.name is None:  # a closure cell
            try:
                return self.space.cell_contents
            except ValueError:
                return _MISSING
        return self.space.get(self.name, _MISSING)

    def holds(self) -> bool:
        value = self._current()
        if value is _MISSING:
            return False
        if self.lifted is not None:
            return _lifted_token(value) == self.lifted
        if self.token[0]:
            was = self.token[2]
            if value.__class__ is not self.token[1] or not (value == was or (value != value and was != was)):
                return False  # NOTE: a NaN equals a NaN here (else a NaN global would retrace every call)
        elif value is not self.obj:
            return False
        if self.items is not None:
            try:  # NOTE: tuple == compares items by ==: _Same by identity, scalars (type, value)
                return _snapshot(value) == self.items
            except Exception:  # noqa: BLE001 - an item whose comparison is ambiguous: changed
                return False
        return True

    def __ne__(self, other) -> bool:
        return not self.holds()

    def __eq__(self, other) -> bool:
        return self.holds()

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Guard({self.label}={type(self.obj).__name__})"


def _lifted_token(value):
    from ..core.tensor import Tensor

    if value.__class__ is Tensor and value._symbol is None and value._quant is None:
        return (value.shape, value.dtype)
    return None


def lifting(functions: Iterable):
    """``(lift, lifted)`` for a trace of ``functions`` (a ``loss_fn``): ``lift(tracer, tensor)``,
    the tracer's hook, makes a concrete float tensor (of more than one element) that a global or
    closure variable of theirs holds a graph input (``captured_<name>``), and ``lifted`` lists ``(guard, input name)`` in input
    order: the caller feeds ``guard.current()`` on every run, and the guard holds for any tensor
    of the same shape and dtype (one graph serves every value)."""
    by_id: dict = {}
    for g in collect_guards(functions):
        # NOTE: float tensors only: an integer tensor may be read as a shape / index / bound that
        # must stay a constant (it is baked and guarded by identity instead)
        # (and not one-element tensors: those are the ones read back as Python numbers)
        if _lifted_token(g.obj) is not None and g.items is None and g.obj.dtype.is_float \
                and int(np.prod(g.obj.shape)) > 1:
            by_id.setdefault(id(g.obj), g)
    lifted: list = []

    def lift(tracer, x):
        g = by_id.get(id(x))
        if g is None or g.obj is not x:
            return None
        g.lifted = _lifted_token(x)
        t = tracer.input(f"captured_{g.label}", x.shape, x.dtype, unique=True)
        lifted.append((g, t._symbol.value.name))
        return t

    return lift, lifted


def _guardable(value) -> bool:
    if isinstance(value, (types.ModuleType, type, types.BuiltinFunctionType, types.MethodType)):
        return False
    if isinstance(value, types.FunctionType):
        return not _library(value)
    return True


def _codes(code) -> Iterable:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def collect_guards(functions: Iterable, modules: Iterable = ()) -> tuple:
    """The :class:`Guard` s of the names ``functions`` (and, recursively, the user functions they
    read, the nested functions they define, and the methods of the user classes of ``modules``)
    read from their globals and closures; ``()`` when there are none."""
    guards: dict = {}
    seen: set = set()
    todo = [f for f in functions if isinstance(f, (types.FunctionType, types.MethodType))]
    for m in modules:
        for cls in type(m).__mro__:
            if cls is object or _library(cls) or id(cls) in seen:
                continue
            seen.add(id(cls))
            todo.extend(v for v in vars(cls).values() if isinstance(v, (types.FunctionType, staticmethod, classmethod)))
    while todo:
        f = todo.pop()
        if isinstance(f, (staticmethod, classmethod, types.MethodType)):
            f = f.__func__
        if not isinstance(f, types.FunctionType) or id(f) in seen or _library(f):
            continue
        seen.add(id(f))
        space = f.__globals__
        for code in _codes(f.__code__):
            for name in code.co_names:
                value = space.get(name, _MISSING)
                if value is _MISSING or not _guardable(value):
                    continue
                key = (id(space), name)
                if key not in guards:
                    guards[key] = Guard(space, name, value)
                    if isinstance(value, types.FunctionType):
                        todo.append(value)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if not _guardable(value):
                continue
            key = (id(cell), None)
            if key not in guards:
                guards[key] = Guard(cell, None, value, name)
                if isinstance(value, types.FunctionType):
                    todo.append(value)
    return tuple(guards.values())


def guards_hold(guards: tuple) -> bool:
    """True when every guard of :func:`collect_guards` still holds."""
    for g in guards:
        if not g.holds():
            return False
    return True


RETRACE_WARN_AFTER = 8
"""A cache entry traced again this many times because its guards failed warns once
(:class:`~onnxparam.core.errors.CaptureWarning`: a value changing every step costs a trace and a
session every step; pass it as an argument)."""

_retraces: "dict" = {}


def note_retrace(key, guards: tuple, what: str) -> None:
    """Count a retrace of the cache entry ``key`` whose ``guards`` failed; warn once at
    :data:`RETRACE_WARN_AFTER` naming the changing names."""
    count = _retraces.pop(key, 0) + 1
    _retraces[key] = count  # NOTE: re-inserted last: the oldest keys are dropped first
    while len(_retraces) > 1024:
        del _retraces[next(iter(_retraces))]
    if count == RETRACE_WARN_AFTER:
        import warnings

        from ..core.errors import CaptureWarning

        names = ", ".join(sorted({g.label for g in guards if not g.holds()})) or "?"
        warnings.warn(f"{what} was traced again {count} times because the outside values it reads changed "
                      f"({names}): every change builds a new graph and session; pass such values as arguments "
                      "(tensors become graph inputs and one graph serves every value)", CaptureWarning, stacklevel=4)


def guarded_objects(guards: tuple) -> set:
    """The ids of the guarded objects and of the items of guarded containers (one level)."""
    ids = set()
    for g in guards:
        ids.add(id(g.obj))
        obj = g.obj
        if obj.__class__ in (list, tuple) and len(obj) <= MAX_ITEMS:
            ids.update(id(v) for v in obj)
        elif obj.__class__ is dict and len(obj) <= MAX_ITEMS:
            ids.update(id(v) for v in obj.values())
    return ids


def _module_values(modules: Iterable, values: Iterable = ()) -> set:
    """Ids of every value held by the attributes of ``modules`` and of ``values`` (through lists /
    tuples / dicts)."""
    ids: set = set()

    def visit(value, depth):
        if id(value) in ids or depth > 4:
            return
        ids.add(id(value))
        if isinstance(value, (list, tuple)):
            for v in value:
                visit(v, depth + 1)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v, depth + 1)

    for m in modules:
        for v in vars(m).values():
            visit(v, 0)
    for v in values:
        visit(v, 0)
    return ids


def uncovered_tensors(baked: list, guards: tuple, modules: Iterable, internal: Iterable = (),
                      covered: Iterable = ()) -> list:
    """The concrete tensors a trace baked (``baked``) that came from outside yet no guard watches:
    not a guarded object or item, not held by a module attribute (those are guarded by the
    runtime's structure keys), and not created inside the trace (a tensor nothing but the
    tracer's own lists (``internal``) refers to)."""
    if not baked:
        return []
    covered = guarded_objects(guards) | _module_values(modules, covered)
    left = [t for t in baked if id(t) not in covered]
    if not left:
        return []
    import gc

    # NOTE: one heap scan for all of them (gc.get_referrers walks every tracked object)
    skip = {id(x) for x in internal} | {id(baked), id(left)}
    wanted = {id(t) for t in left}
    held: set = set()
    for r in gc.get_referrers(*left):
        if id(r) in skip or isinstance(r, types.FrameType):
            continue
        held.update(id(x) for x in gc.get_referents(r) if id(x) in wanted)
    return [t for t in left if id(t) in held]


def trace_guards(tracer, functions: Iterable = (), what: str = "forward", arguments: Iterable = (),
                 lifted: Iterable = ()) -> tuple:
    """The guards of a finished trace: of ``functions`` (a ``loss_fn``) and of the methods of the
    user classes of every module the trace called; ``arguments``: the call's arguments (tensors
    inside a list argument are baked, and keyed by the call signature: not outside); warns (:class:`CaptureWarning`) for each baked
    outside tensor no guard or module attribute watches (``what`` names the traced code)."""
    import functools

    from ..core.module import Module

    functions, bound = list(functions), list(arguments)
    for i, f in enumerate(functions):
        while isinstance(f, functools.partial):  # NOTE: its arguments cannot be rebound: not stale
            bound += list(f.args) + list(f.keywords.values())
            f = f.func
        functions[i] = f
    modules = [tracer._root] if tracer._root is not None else []
    modules += [m for m in tracer._keepalive if isinstance(m, Module) and m is not tracer._root]
    guards = collect_guards(functions, modules)
    lifted = [g for g in lifted]
    if lifted:  # NOTE: a lifted name's guard checks shape and dtype only (its value is fed)
        keys = {(id(g.space), g.name) for g in lifted}
        guards = tuple(lifted) + tuple(g for g in guards if (id(g.space), g.name) not in keys)
    left = uncovered_tensors(tracer._baked, guards, modules, internal=(tracer._keepalive,), covered=bound)
    if left:
        import warnings

        from ..core.errors import CaptureWarning

        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in left)
        warnings.warn(
            f"{what} read {len(left)} tensor(s) from outside ({shapes}) that are neither arguments, params, "
            "module attributes nor held by a global or closure variable it names (reached through an object's "
            "attribute?): their values are frozen into the cached graph and later changes are not seen; "
            "pass them as inputs instead", CaptureWarning, stacklevel=4)
    return guards
