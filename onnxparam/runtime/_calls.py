"""Calling modules (the fast and slow paths), the caches and their keys, and eager ops."""

from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from ..core import extension
from ..core.errors import ExecutionError
from ..core.module import _MUTATIONS, _WATCHED
from ..core.param import Param
from ..core.tensor import Tensor
from ..trace import guards as _trace_guards
from ..trace import tracer as _trace
from ._config import CONFIG_ATTR, DEFAULTS, SessionConfig, session_config
from ._devices import pick_device
from ._keys import (  # noqa: F401
    _memory_owner, _mentions, _mutable_state, _param_signature, _Ref, _stored, _structure_key, _unchanged, _value_token,
    call_signature,
)
from ._sessions import Runner, build_runner
from ._shape_family import ShapeFamily

__all__ = [
    "MAX_CACHED_SESSIONS", "MAX_CACHED_TRACES", "MAX_FAST_MODULES", "MAX_EAGER_SESSIONS", "RuntimeStats",
    "call_module", "session_for", "traced_for", "set_session_config", "set_eager_session_config",
    "stats", "sessions_built", "clear_caches", "set_cache_size", "forget_values", "register_value_cache",
]

MAX_CACHED_SESSIONS = 32
"""Module sessions kept (LRU); each holds its weights, so this bounds memory."""

MAX_CACHED_TRACES = 64
"""Traced graphs kept (LRU), keyed by module structure + input signature + LoRA mode; each holds
the params it was traced with (not their values: a lazy param stays lazy)."""

MAX_FAST_MODULES = 64
"""Module objects remembered by the fast path (oldest forgotten first)."""

MAX_EAGER_SESSIONS = 256
"""One-op sessions of eager ops kept (LRU)."""

# -- caches -----------------------------------------------------------------------------------


@dataclass
class RuntimeStats:
    """Counters since the runtime was imported (:func:`clear_caches` does not reset them).

    Attributes:
        sessions_built: module sessions built (each a new ``InferenceSession``), those of
            module calls and the training sessions of :func:`onnxparam.autodiff.grad`.
        eager_sessions_built: one-op sessions built for eager ops.
        traces: forwards traced by module calls, and losses traced by
            :func:`~onnxparam.autodiff.grad` / :func:`~onnxparam.autodiff.check_gradients`
            (a cached training graph is not traced again).
        dynamic_traces: of those, traces with symbolic dims (automatic dynamic, see
            :class:`SessionConfig`).
        training_traces: of ``traces``, the losses traced for training graphs.
        training_sessions_built: of ``sessions_built``, the training sessions.
    """

    sessions_built: int = 0
    eager_sessions_built: int = 0
    traces: int = 0
    dynamic_traces: int = 0
    training_traces: int = 0
    training_sessions_built: int = 0


_STATS = RuntimeStats()
_LOCK = threading.RLock()
_sessions: "OrderedDict[Any, Runner]" = OrderedDict()
_traces: "OrderedDict[Any, Any]" = OrderedDict()
_eager: "OrderedDict[Any, Runner]" = OrderedDict()
_fast: dict = {}
_limits = {"sessions": MAX_CACHED_SESSIONS, "traces": MAX_CACHED_TRACES, "eager": MAX_EAGER_SESSIONS}


def stats() -> RuntimeStats:
    """A copy of the counters."""
    return replace(_STATS)


def sessions_built() -> int:
    """How many module sessions were built so far (eager op sessions not counted)."""
    return _STATS.sessions_built


def clear_caches() -> None:
    """Forget every cached trace and session (and the references they hold)."""
    with _LOCK:
        _sessions.clear()
        _traces.clear()
        _families.clear()
        _eager.clear()
        _fast.clear()


_VALUE_CACHES: list = []
"""``forget(ids) -> int`` of the caches of higher layers keyed by params' value tokens
(:func:`register_value_cache`)."""


def register_value_cache(forget) -> None:
    """Register a cache of a higher layer whose keys hold params' value tokens
    (:func:`~._keys._value_token`: the training sessions, imported graphs' sessions, LoRA stacks),
    so :func:`forget_values` reaches it: ``forget(ids)`` drops every entry whose key refers to an
    object whose ``id`` is in ``ids`` (a set of ints) and returns how many it dropped."""
    with _LOCK:
        if forget not in _VALUE_CACHES:
            _VALUE_CACHES.append(forget)


def forget_values(values) -> int:
    """Forget everything cached from the given stored values, after their memory was written in
    place (``Optimizer.step(..., in_place=True)`` does this itself).

    A session holds its weights as ``OrtValue`` s sharing the params' numpy memory, but ONNX
    Runtime may have copied or pre-packed some of them when it was built (MatMul, Conv), and the
    caches find a session by the identity of each param's stored tensor: a session built before
    an in-place write would still be found for a module holding those tensors, and compute with
    the old values. This drops every cached module session, training session, imported-graph
    session and LoRA stack built from any of ``values``, and the fast-path entries of modules
    using them; their next call builds afresh from the current memory.

    Args:
        values: :class:`~onnxparam.Tensor` s (a param's stored tensor, ``param.base()`` of an
            initialized param), :class:`~onnxparam.Param` s (their stored tensor, or lazy cell)
            or numpy arrays (every host tensor whose memory belongs to the array that owns
            theirs: all tensors over that memory, whichever module holds them).

    Returns:
        how many cached entries were dropped (fast-path entries not counted).
    """
    ids = {id(_stored(v)) if isinstance(v, Param) else id(_memory_owner(v)) if isinstance(v, np.ndarray) else id(v)
           for v in values}
    if not ids:
        return 0
    with _LOCK:
        stale = [key for key in _sessions if _mentions(key[3], ids)]
        for key in stale:
            _forget_runner(_sessions.pop(key))
        for module_id, entry in list(_fast.items()):
            if any(_mentions(_value_token(p), ids) for p in entry.expected):
                del _fast[module_id]
        hooks = list(_VALUE_CACHES)
    dropped = len(stale)
    for forget in hooks:  # NOTE: outside this lock: each takes its cache's own
        dropped += forget(ids)
    return dropped


def set_cache_size(sessions: Optional[int] = None, traces: Optional[int] = None, eager: Optional[int] = None) -> None:
    """Change the LRU bounds (module sessions, traces, eager sessions); extra entries are evicted."""
    with _LOCK:
        for key, value in (("sessions", sessions), ("traces", traces), ("eager", eager)):
            if value is not None:
                if int(value) < 1:
                    raise ValueError(f"cache size must be at least 1, got {value}")
                _limits[key] = int(value)
        _trim(_sessions, _limits["sessions"], _forget_runner)
        _trim(_traces, _limits["traces"])
        _trim(_eager, _limits["eager"])


def set_session_config(module, config: Optional[SessionConfig]) -> None:
    """Set the session options for ``module`` (a :class:`~onnxparam.Module`), or globally when
    ``module`` is ``None``. ``config=None`` on a module returns it to the global config; on
    ``None`` it restores the default global config.

    The module keeps its config in a private attribute, so its transformed copies
    (``load_record``, ``to_device`` ...) keep it too. Sessions built afterwards use it; cached
    sessions built with another config are not reused.

    Raises:
        TypeError: when ``config`` is not a :class:`SessionConfig`.
    """
    if config is not None and not isinstance(config, SessionConfig):
        raise TypeError(f"expected a SessionConfig, got {type(config).__name__}")
    with _LOCK:
        if module is None:
            DEFAULTS.module = config if config is not None else SessionConfig()
            _fast.clear()
            return
        if config is None:
            module.__dict__.pop(CONFIG_ATTR, None)
        else:
            object.__setattr__(module, CONFIG_ATTR, config)
        _fast.pop(id(module), None)


def set_eager_session_config(config: SessionConfig) -> None:
    """The options of eager op sessions (default: one intra-op thread, as those graphs are one op)."""
    if not isinstance(config, SessionConfig):
        raise TypeError(f"expected a SessionConfig, got {type(config).__name__}")
    with _LOCK:
        DEFAULTS.eager = config
        _eager.clear()


def _trim(cache: OrderedDict, limit: int, on_evict=None) -> None:
    while len(cache) > limit:
        _, evicted = cache.popitem(last=False)
        if on_evict is not None:
            on_evict(evicted)


def _forget_runner(runner: Runner) -> None:
    for module_id, sig in runner.fast_keys:
        entry = _fast.get(module_id)
        if entry is not None:
            entry.by_sig.pop(sig, None)
            if entry.last1 is not None and entry.last1.session is runner.session:  # or a fed copy
                entry.last1 = None


# -- module calls -----------------------------------------------------------------------------


def _path_steps(module, path: str):
    """The attribute / item steps leading from ``module`` to the param at ``path``, or
    ``None`` when ``path`` does not lead to a param (e.g. a param reached outside the tree)."""
    obj = module
    steps = []
    for part in path.split("."):
        if isinstance(obj, (list, tuple)):
            try:
                key = int(part)
                obj = obj[key]
            except (ValueError, IndexError):
                return None
            steps.append((True, key))
        elif isinstance(obj, dict):
            key = part if part in obj else next((k for k in obj if str(k) == part), None)
            if key is None:
                return None
            obj = obj[key]
            steps.append((True, key))
        else:
            if part not in getattr(obj, "__dict__", {}):
                return None
            obj = getattr(obj, part)
            steps.append((False, part))
    return steps if isinstance(obj, Param) else None


def _compile_getter(all_steps: list):
    """``module -> tuple of objects`` at the given step lists.

    Paths of attributes only (the usual case) become one ``operator.attrgetter`` (dotted names,
    resolved in C); a path with an item step (a list or dict of modules) falls back to a loop.
    """
    if all(not is_item for steps in all_steps for is_item, _ in steps):
        get = operator.attrgetter(*(".".join(key for _, key in steps) for steps in all_steps))
        if len(all_steps) == 1:
            return lambda m: (get(m),)
        return get

    def loop(m, _all=tuple(tuple(s) for s in all_steps)):
        out = []
        for steps in _all:
            o = m
            for is_item, key in steps:
                o = o[key] if is_item else getattr(o, key)
            out.append(o)
        return tuple(out)

    return loop


class _FastEntry:
    """What the fast path remembers about one module object: its runners by signature and how
    to check, cheaply, that the params a runner was built from are still in place."""

    __slots__ = ("module", "by_sig", "last1", "getter", "expected", "version", "watched")

    def __init__(self, module, traced, params_by_path: dict):
        # NOTE: a weak reference (the cache keeps no module's weights alive); when the module
        # dies its entry is dropped (_forget_module) before its id can be reused
        self.module = weakref.ref(module)
        self.by_sig: dict = {}
        self.last1: Optional[Runner] = None  # the runner of the last one-host-tensor call
        all_steps, expected = [], []
        for path in traced.param_paths:
            param = params_by_path.get(path)
            steps = None if param is None else _path_steps(module, path)
            if steps is not None:
                all_steps.append(steps)
                expected.append(param)
        self.getter = _compile_getter(all_steps) if all_steps else None
        self.expected = tuple(expected)
        # NOTE: the configuration the graph was traced with: no module attribute written since
        # (version) and no list / dict / set / array attribute changed in place (watched)
        ids, watched = _mutable_state(module)
        _WATCHED.update(ids)
        self.version = _MUTATIONS[0]
        self.watched = watched or None

    def params_current(self, module) -> bool:
        """True when every used param is still the same object at the same path and the
        module's configuration is unchanged (so the remembered graphs still hold)."""
        if self.version != _MUTATIONS[0] or (self.watched is not None and not _unchanged(self.watched)):
            return False
        getter = self.getter
        if getter is None:
            return True
        try:
            return getter(module) == self.expected  # tuple ==: identity first, Param has no __eq__
        except Exception:  # a path that no longer resolves: let the slow path look again
            return False


_current_tracer = _trace._CURRENT.get
_fast_get = _fast.get


def _guards_hold(traced) -> bool:
    """Whether the globals / closure values ``traced``'s forward read still hold what the trace
    saw (:mod:`onnxparam.trace.guards`; a trace without guards always holds)."""
    guards = traced._cache.get("guards")
    return not guards or _trace_guards.guards_hold(guards)


def _drop_stale(trace_key) -> None:
    """Forget the sessions built from the trace under ``trace_key`` (its guards failed: it is
    traced again, and its sessions would never be found again)."""
    for key in [k for k in _sessions if k[0] == trace_key]:
        _forget_runner(_sessions.pop(key))


def _passes():
    """The graph passes module calls trace with (LoRA, QDQ): the executor's, which the top layer
    builds (:mod:`onnxparam.core.extension`); the runtime imports no pass."""
    return extension.executor().passes


def call_module(module, args: tuple, kwargs: dict):
    """Run ``module.forward(*args, **kwargs)``: inlined inside a trace, else through ONNX
    Runtime (see the module docstring). Returns a Tensor, or a tuple for several outputs.

    Raises:
        TraceError: when the forward cannot be traced.
        DeviceError: for unavailable or mixed devices.
        ExecutionError: when ONNX Runtime fails (the node and its params are named).
    """
    tracer = _current_tracer()
    if tracer is not None:
        return tracer.call_module(module, args, kwargs)
    if kwargs:  # a keyword a pass answers (LoRA's adapter_index: many adapters, one per row)
        for keyword, handler in _passes().keyword_calls:
            if keyword in kwargs and not _takes_keyword(module, keyword):
                return handler(module, args, kwargs)
    # NOTE: inside quant.qdq_options the graph differs: no fast path, nothing remembered
    entry = _fast_get(id(module)) if _passes().options() is None else None
    if entry is not None:
        if len(args) == 1 and not kwargs:
            runner = entry.last1
            if runner is not None:
                a = args[0]
                if a.__class__ is Tensor and a._host is not None and a.shape == runner.shape1 and \
                        a.dtype is runner.dtype1 and entry.version == _MUTATIONS[0] and \
                        (entry.watched is None or _unchanged(entry.watched)):
                    getter = entry.getter  # NOTE: params_current, inlined (this is the hot path)
                    try:
                        current = getter is None or getter(module) == entry.expected
                    except Exception:
                        current = False
                    if current:
                        return runner.run1(a._host)
        leaves: list = []
        sig = call_signature(args, kwargs, leaves, cheap=True)
        if sig is not None:
            runner = entry.by_sig.get(sig)
            if runner is not None and entry.params_current(module):
                return runner.run(leaves)
    runner, tensors = _resolve(module, args, kwargs, remember=True)
    try:
        return runner.run(tensors)
    except ExecutionError:
        if not runner.traced._cache.get("dynamic"):
            raise
        _forget_fast(module, runner)  # NOTE: the next call of this signature must not reuse it
    # NOTE: a symbolic dim the forward pins (a feature dim checked against a weight only when it
    # is an int) fails in ONNX Runtime: a concrete trace of this shape gives the forward's own
    # error, or runs (and is remembered for this shape instead)
    runner, tensors = _resolve(module, args, kwargs, remember=True, policy="static")
    return runner.run(tensors)


_TAKES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _takes_keyword(module, name: str) -> bool:
    """Whether ``module.forward`` accepts keyword ``name`` (by its signature; cached per class)."""
    cls = type(module)
    hit = _TAKES.get(cls)
    if hit is None:
        import inspect

        try:
            params = inspect.signature(module.forward).parameters
            hit = _TAKES[cls] = frozenset(p.name for p in params.values()
                                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) | (
                frozenset(["**"]) if any(p.kind is p.VAR_KEYWORD for p in params.values()) else frozenset())
        except (TypeError, ValueError):
            hit = _TAKES[cls] = frozenset(["**"])
    return name in hit or "**" in hit


def _split_call(args, kwargs):
    """The call with arrays wrapped as tensors, its tensors (graph inputs, in input order) and
    its :func:`~._keys.call_signature` without placements (part of the trace key)."""
    args = [Tensor.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    kwargs = {k: Tensor.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    tensors: list = []
    call_sig = call_signature(args, kwargs, tensors, placed=False)
    return args, kwargs, tensors, call_sig


def _traced(module, args, kwargs, call_sig: tuple, mode: str = "merge", policy: str = "static"):
    """The trace key and :class:`~onnxparam.trace.tracer.TracedModel` of a call (traced if needed),
    in LoRA ``mode``, under the shape ``policy`` (:attr:`SessionConfig.dynamic_shapes`);
    ``call_sig`` is the call's signature from :func:`_split_call`."""
    passes = _passes()
    with _LOCK:
        options = passes.call_options()
        # NOTE: what the passes read of the module besides its params (LoRA's stacked targets in
        # "batched" mode); the attributes no trace reads (LoRA's named-adapter set, which every
        # set_adapter copies) are left out, so switching adapters finds the same trace
        structure = (_structure_key(module, mode, passes.untraced_attrs), passes.structure_key(module, mode))
        trace_key = (structure, call_sig, mode, options)
        traced = _traces.get(trace_key)
        if traced is not None:
            if _guards_hold(traced):
                _traces.move_to_end(trace_key)
                return trace_key, traced
            _drop_stale(trace_key)
            _trace_guards.note_retrace(trace_key, traced._cache["guards"], f"{type(module).__name__}.forward")
        if policy == "auto":
            hit = _dynamic_trace(module, args, kwargs, call_sig, (structure, mode, options))
            if hit is not None:
                return hit
        with passes.with_options(options):
            traced = _trace.trace_module(module, tuple(args), kwargs=kwargs, lora=mode, passes=passes, guard=True)
        _STATS.traces += 1
        _traces[trace_key] = traced
        _trim(_traces, _limits["traces"])
    return trace_key, traced


_families: "OrderedDict[Any, ShapeFamily]" = OrderedDict()


def _dynamic_trace(module, args, kwargs, call_sig: tuple, where: tuple):
    """Automatic dynamic (see :class:`SessionConfig`): the trace key and trace serving this call
    with symbolic dims, or ``None`` when it takes a concrete trace (the family's first call; the
    rules: :mod:`._shape_family`).

    A changed dim becomes symbolic for sizes >= 1 (size 0 is specialized). When the forward
    cannot be traced so (it asks ``x.shape[0] == 1``, ``squeeze()`` ...), sizes 0 and 1 are
    specialized as in PyTorch (a trace where those dims are concrete and the others symbolic)
    and symbolic dims stand for sizes >= 2; if that fails too, every shape gets its own trace.
    """
    values = list(args) + list(kwargs.values())
    shapes = tuple(v.shape if isinstance(v, Tensor) else None for v in values)
    layout = _with_shapes(call_sig, len(args), lambda i: len(shapes[i]) if shapes[i] is not None else None)
    family_key = (where, layout)
    family = _families.get(family_key)
    if family is None:
        _families[family_key] = ShapeFamily(shapes)
        _trim(_families, _limits["traces"])
        return None
    _families.move_to_end(family_key)

    def entry_for(least, symbolic, groups):
        gen_sig = _with_shapes(call_sig, len(args), lambda i: None if shapes[i] is None else tuple(
            "?" if (i, a) in symbolic else d for a, d in enumerate(shapes[i])))
        gen_key = (where[0], ("dynamic", least, gen_sig, groups), where[1], where[2])
        traced = _traces.get(gen_key)
        if traced is not None and not _guards_hold(traced):
            _drop_stale(gen_key)
            _trace_guards.note_retrace(gen_key, traced._cache["guards"], f"{type(module).__name__}.forward")
            traced = None
        if traced is not None:
            _traces.move_to_end(gen_key)
            return gen_key, traced
        traced = _trace_symbolic(module, args, kwargs, values, groups, where, least)
        if traced is None:  # the forward needs concrete sizes at this bound
            return None
        _STATS.traces += 1
        _STATS.dynamic_traces += 1
        traced._cache["dynamic"] = True
        _traces[gen_key] = traced
        _trim(_traces, _limits["traces"])
        return gen_key, traced

    return family.generalized(shapes, family.changed(shapes), entry_for)


def _with_shapes(call_sig: tuple, n_args: int, shape_of) -> tuple:
    """``call_sig`` with the shape of the tensor entry of argument ``i`` (positional first, then
    keyword) replaced by ``shape_of(i)`` (a rank, or a shape with ``"?"`` for symbolic dims)."""
    def entry(i, e):
        new = shape_of(i)
        return e if new is None else (e[0], new) + e[2:]

    return tuple(entry(i, e) if i < n_args else (e[0], entry(i, e[1])) for i, e in enumerate(call_sig))


def _trace_symbolic(module, args, kwargs, values, groups, where, least):
    """The trace with the dims of ``groups`` symbolic (one name per group), or ``None``."""
    names = _trace._forward_arg_names(module, len(args)) + list(kwargs)
    dim_name = {}
    for group in groups:
        i, axis = group[0]
        for member in group:
            dim_name[member] = f"{names[i]}_dim{axis}"
    specs = [_trace.InputSpec(tuple(dim_name.get((i, a), d) for a, d in enumerate(v.shape)), v.dtype)
             if isinstance(v, Tensor) else v for i, v in enumerate(values)]
    passes = _passes()
    try:
        with passes.with_options(where[2]):
            return _trace.trace_module(module, tuple(specs[:len(args)]), kwargs=dict(zip(kwargs, specs[len(args):])),
                                       lora=where[1], min_dynamic_size=least, passes=passes, guard=True)
    except Exception:  # noqa: BLE001 - the forward needs concrete sizes (a TraceError, or its own error)
        return None


def _lora_mode(mode: str, by_path: dict) -> str:
    """``mode``, but ``"keep"`` for ``"merge"`` when an adapter cannot be merged (a grouped
    convolution's PEFT adapter: ``LoraAdapter.merges_into``; it runs as a branch)."""
    if mode == "merge":
        for p in by_path.values():
            adapter = p.adapter()
            if adapter is not None and not adapter.merges_into(p.lazy_shape()):
                return "keep"
    return mode


def _resolve(module, args, kwargs, remember: bool = False, policy: Optional[str] = None, mode: Optional[str] = None):
    """The runner for this call (tracing and building as needed) and the input tensors
    (``policy`` overrides the config's ``dynamic_shapes``, ``mode`` its ``lora_mode``)."""
    from ..core.module import named_params

    owner = type(module).__name__
    args, kwargs, tensors, call_sig = _split_call(args, kwargs)
    config = session_config(module)
    passes = _passes()
    with _LOCK:
        by_path = dict(named_params(module))
        trace_key, traced = _traced(module, args, kwargs, call_sig, _lora_mode(mode or config.lora_mode, by_path),
                                    policy or config.dynamic_shapes)
        used = [(p, by_path[p] if p in by_path else traced.params[p]) for p in traced.param_paths]
        device = pick_device(owner, used, tensors)
        # NOTE: in "inputs" mode the factors are fed on every call, so their values are not part
        # of the key: one session serves every adapter (switching builds nothing).
        fed = set(traced._cache.setdefault("fed_factors", tuple(passes.fed_input_names(traced.model))))
        session_key = (trace_key, device, config, tuple(_value_token(passes.held_param(p, traced.mode))
                                                         for name, p in used if name not in fed))
        if traced._cache.get("guards"):  # NOTE: a retrace after a failed guard has the same trace key
            session_key += (_Ref(traced),)
        runner = _sessions.get(session_key)
        if runner is None:
            runner = build_runner(traced, [p for _, p in used], device, config, owner)
            _STATS.sessions_built += 1
            _sessions[session_key] = runner
            _trim(_sessions, _limits["sessions"], _forget_runner)
        else:
            _sessions.move_to_end(session_key)
        if fed:
            runner = runner.with_fed_params(passes.fed_inputs(traced.model, by_path))
        if remember and passes.options() is None:
            _remember(module, args, kwargs, runner, traced, by_path)
    return runner, tensors


def _forget_fast(module, runner: Runner) -> None:
    """Drop what the fast path remembers of ``runner`` for ``module`` (its run failed)."""
    entry = _fast.get(id(module))
    if entry is None:
        return
    for sig in [sig for sig, kept in entry.by_sig.items() if kept is runner]:
        del entry.by_sig[sig]
    if entry.last1 is runner:
        entry.last1 = None


def _forget_module(key: int) -> None:
    """Drop the fast-path entry of a module that was garbage collected (its id may be reused)."""
    entry = _fast.get(key)
    if entry is not None and entry.module() is None:
        del _fast[key]


_MAX_WATCHED = 100_000


def _remember(module, args, kwargs, runner: Runner, traced, by_path: dict) -> None:
    sig = call_signature(args, kwargs, cheap=True)
    if sig is None:  # arguments the fast path cannot compare cheaply: always the slow path
        return
    if len(_WATCHED) > _MAX_WATCHED:  # ids of dead modules pile up: keep those of remembered ones
        _WATCHED.clear()
        for kept in list(_fast.values()):
            alive = kept.module()
            if alive is not None:
                _WATCHED.update(_mutable_state(alive)[0])
    entry = _fast.get(id(module))
    if entry is None or entry.module() is not module:
        entry = _FastEntry(module, traced, by_path)
        _fast[id(module)] = entry
        weakref.finalize(module, _forget_module, id(module))
        while len(_fast) > MAX_FAST_MODULES:
            _fast.pop(next(iter(_fast)))
    if not entry.params_current(module):
        entry = _FastEntry(module, traced, by_path)
        _fast[id(module)] = entry
    guards = traced._cache.get("guards")
    if guards:  # NOTE: checked with the watched values (Guard != True evaluates it): only such entries pay
        have = entry.watched or ()
        entry.watched = have + tuple((g, True, False) for g in guards if not any(g is w[0] for w in have))
    entry.by_sig[sig] = runner
    if len(args) == 1 and not kwargs and args[0].__class__ is Tensor and args[0]._host is not None \
            and not runner._needs_ortvalues:
        runner.shape1, runner.dtype1 = args[0].shape, args[0].dtype
        entry.last1 = runner
    runner.fast_keys.append((id(module), sig))


def session_for(module, *args, **kwargs):
    """The ``onnxruntime.InferenceSession`` that ``module(*args, **kwargs)`` runs (built now if
    needed). Arguments may be tensors, arrays or :class:`~onnxparam.trace.tracer.InputSpec` -free
    concrete values, exactly as in a call."""
    runner, _ = _resolve(module, args, kwargs)
    return runner.session


def traced_for(module, *args, **kwargs):
    """The :class:`~onnxparam.trace.tracer.TracedModel` of ``module(*args, **kwargs)``: traced now, so
    its lazy initializers are this module's params (a cached trace may come from another module
    object of the same structure). No session is built, no param initialized."""
    from ..core.module import named_params

    args, kwargs, _, _ = _split_call(args, kwargs)
    passes = _passes()
    mode = _lora_mode(session_config(module).lora_mode, dict(named_params(module)))
    with passes.with_options(passes.call_options()):
        return _trace.trace_module(module, tuple(args), kwargs=kwargs, lora=mode, passes=passes)
