"""ONNX Runtime execution: ``module(x)`` and eager ops, with cached ``InferenceSession`` s.

**Calling a module** (:func:`call_module`, behind ``Module.__call__``):

1. inside a trace, the sub-module's ``forward`` is inlined into the graph being built;
2. otherwise the call is looked up in a small per-module-object table (the *fast path*): if the
   module was called before with the same input signature (shapes, dtypes, devices) and the
   params it used are still the same objects at the same paths, the cached session runs at
   once — no tracing, no hashing of the module tree;
3. else (the *slow path*) the module's structure key is computed (types, configuration
   attributes, param paths / shapes / dtypes / adapters), the forward is traced for this
   signature (traces are cached by structure + signature + LoRA mode), and a session is looked up
   by ``(structure, signature, device, LoRA mode, session config, param values)`` — *param
   values* meaning the identity of each used param's stored tensor or lazy cell, so a module
   loaded with new weights gets a new session while a ``no_grad()`` / ``train()`` copy (same
   tensors) reuses the old one.

**Sessions** are built from the traced model *without copying weights into protobuf*: param
initializers are serialized as external-data stubs and their values handed to ONNX Runtime as
``OrtValue`` s sharing the params' numpy memory (``SessionOptions.add_external_initializers``).
Lazy params are initialized here, once (their init runs at most once across clones anyway).
Sessions live in a bounded LRU cache (:data:`MAX_CACHED_SESSIONS`), holding strong references
to the values they were built from.

**Devices**: the used params' device (else the inputs' device) picks the execution provider:
``cpu`` -> ``CPUExecutionProvider``; ``cuda:N`` -> ``CUDAExecutionProvider`` with ``device_id=N``
(then CPU for the nodes CUDA lacks), run with IO binding so device tensors stay on the device
and outputs are device tensors wrapping ``OrtValue`` s. CUDA without the CUDA provider raises
:class:`~onnxparam.DeviceError` naming the available providers; there is never a silent CPU
fallback (ONNX Runtime's own fallback is disabled).

**Session options** (:class:`SessionConfig`: threads, graph optimization level, execution mode,
providers, config entries) are set globally with ``set_session_config(None, cfg)`` or per
module with ``set_session_config(module, cfg)`` (kept by transformed copies of that module, e.g.
after ``load_record``); :func:`session_for` returns the ``InferenceSession`` a call would use.

**Errors**: ONNX Runtime failures are re-raised as :class:`~onnxparam.ExecutionError` naming the
node (parsed from ONNX Runtime's message) and the param paths feeding it.
"""

from __future__ import annotations

import ctypes
import enum
import keyword
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np
import onnx_ir as ir

from . import trace as _trace
from ._ort import import_onnxruntime
from .device import CPU, Device
from .dtype import DType
from .errors import DeviceError, ExecutionError, OnnxParamError, TraceError
from .param import Param
from .tensor import Tensor

ort = import_onnxruntime()

__all__ = [
    "SessionConfig",
    "RuntimeStats",
    "MAX_CACHED_SESSIONS",
    "call_module",
    "session_for",
    "traced_for",
    "set_session_config",
    "session_config",
    "set_eager_session_config",
    "providers_for",
    "ortvalue_from_numpy",
    "run_eager",
    "stats",
    "sessions_built",
    "clear_caches",
    "set_cache_size",
]

MAX_CACHED_SESSIONS = 32
"""Module sessions kept (LRU); each holds its weights, so this bounds memory."""

MAX_CACHED_TRACES = 64
"""Traced graphs kept (LRU), keyed by module structure + input signature + LoRA mode."""

MAX_FAST_MODULES = 64
"""Module objects remembered by the fast path (oldest forgotten first)."""

MAX_EAGER_SESSIONS = 256
"""One-op sessions of eager ops kept (LRU)."""

_INJECTED_LOCATION = "onnxparam-injected-initializer"
"""The external-data location written for param initializers of a session's model; ONNX Runtime
never reads it, as every such initializer is replaced by an injected ``OrtValue``."""

_CONFIG_ATTR = "_onnxparam_session_config"

_GRAPH_OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_EXECUTION_MODES = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}
_CUDA_PROVIDER = "CUDAExecutionProvider"
_CPU_PROVIDER = "CPUExecutionProvider"


# -- configuration ----------------------------------------------------------------------------


def _freeze_provider(p):
    if isinstance(p, str):
        return p
    name, options = p
    return (str(name), tuple(sorted((str(k), str(v)) for k, v in dict(options).items())))


@dataclass(frozen=True)
class SessionConfig:
    """Options of the ``InferenceSession`` s built for a module (or globally).

    Args:
        intra_op_num_threads: threads inside one operator; ``0`` = ONNX Runtime's default.
        inter_op_num_threads: threads across operators (parallel mode); ``0`` = default.
        graph_optimization_level: ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"``.
        execution_mode: ``"sequential"`` or ``"parallel"``.
        providers: execution providers to use instead of the ones the device picks: names or
            ``(name, {option: value})`` pairs (a CUDA entry without ``device_id`` gets the
            device's). Each must be available.
        config_entries: ``(key, value)`` session config entries
            (``SessionOptions.add_session_config_entry``).
        log_severity_level: ONNX Runtime's log level for the session (4 = fatal only: its errors
            reach the caller as ExecutionError instead of being printed).

    Raises:
        ValueError: for an unknown optimization level or execution mode.
    """

    intra_op_num_threads: int = 0
    inter_op_num_threads: int = 0
    graph_optimization_level: str = "all"
    execution_mode: str = "sequential"
    providers: Optional[tuple] = None
    config_entries: tuple = ()
    log_severity_level: int = 4

    def __post_init__(self):
        if self.graph_optimization_level not in _GRAPH_OPTIMIZATION_LEVELS:
            raise ValueError(f"graph_optimization_level must be one of {', '.join(_GRAPH_OPTIMIZATION_LEVELS)}; "
                             f"got {self.graph_optimization_level!r}")
        if self.execution_mode not in _EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {', '.join(_EXECUTION_MODES)}; got {self.execution_mode!r}")
        if self.providers is not None:
            object.__setattr__(self, "providers", tuple(_freeze_provider(p) for p in self.providers))
        entries = self.config_entries.items() if isinstance(self.config_entries, dict) else self.config_entries
        object.__setattr__(self, "config_entries", tuple((str(k), str(v)) for k, v in entries))

    def with_threads(self, intra_op_num_threads: int, inter_op_num_threads: Optional[int] = None) -> "SessionConfig":
        inter = self.inter_op_num_threads if inter_op_num_threads is None else inter_op_num_threads
        return replace(self, intra_op_num_threads=intra_op_num_threads, inter_op_num_threads=inter)

    def with_graph_optimization_level(self, level: str) -> "SessionConfig":
        return replace(self, graph_optimization_level=level)

    def with_execution_mode(self, mode: str) -> "SessionConfig":
        return replace(self, execution_mode=mode)

    def with_providers(self, providers: Optional[Sequence]) -> "SessionConfig":
        return replace(self, providers=None if providers is None else tuple(providers))

    def with_config_entry(self, key: str, value: str) -> "SessionConfig":
        return replace(self, config_entries=self.config_entries + ((str(key), str(value)),))

    def session_options(self):
        """A fresh ``onnxruntime.SessionOptions`` with these settings."""
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(self.intra_op_num_threads)
        so.inter_op_num_threads = int(self.inter_op_num_threads)
        so.graph_optimization_level = _GRAPH_OPTIMIZATION_LEVELS[self.graph_optimization_level]
        so.execution_mode = _EXECUTION_MODES[self.execution_mode]
        so.log_severity_level = int(self.log_severity_level)
        for key, value in self.config_entries:
            so.add_session_config_entry(key, value)
        return so


_global_config = SessionConfig()
_eager_config = SessionConfig(intra_op_num_threads=1)


def set_session_config(module, config: Optional[SessionConfig]) -> None:
    """Set the session options for ``module`` (a :class:`~onnxparam.Module`), or globally when
    ``module`` is ``None``. ``config=None`` on a module returns it to the global config.

    The module keeps its config in a private attribute, so its transformed copies
    (``load_record``, ``to_device`` ...) keep it too. Sessions built afterwards use it; cached
    sessions built with another config are not reused.
    """
    global _global_config
    with _LOCK:
        if module is None:
            _global_config = config if config is not None else SessionConfig()
            _fast.clear()
            return
        if config is None:
            module.__dict__.pop(_CONFIG_ATTR, None)
        else:
            if not isinstance(config, SessionConfig):
                raise TypeError(f"expected a SessionConfig, got {type(config).__name__}")
            object.__setattr__(module, _CONFIG_ATTR, config)
        _fast.pop(id(module), None)


def session_config(module=None) -> SessionConfig:
    """The config sessions of ``module`` are built with (the global one when it has none)."""
    if module is not None:
        config = module.__dict__.get(_CONFIG_ATTR)
        if config is not None:
            return config
    return _global_config


def set_eager_session_config(config: SessionConfig) -> None:
    """The options of eager op sessions (default: one intra-op thread, as those graphs are one op)."""
    global _eager_config
    with _LOCK:
        _eager_config = config
        _eager.clear()


# -- devices ----------------------------------------------------------------------------------


def _available_providers() -> list:
    return list(ort.get_available_providers())


def _no_cuda(device: Device) -> DeviceError:
    return DeviceError(
        f"device {device} needs ONNX Runtime's {_CUDA_PROVIDER}, which is not available; available "
        f"providers: {', '.join(_available_providers())}. Install onnxruntime-gpu ('onnxparam[gpu]') "
        "with a matching CUDA, or use Device('cpu')"
    )


def providers_for(device: "Device | str", config: Optional[SessionConfig] = None) -> list:
    """The ``providers`` argument of an ``InferenceSession`` for ``device``.

    Raises:
        DeviceError: when the provider the device (or ``config.providers``) needs is not
            available; the message lists the available ones.
    """
    device = Device(device)
    available = _available_providers()
    if config is not None and config.providers is not None:
        providers = []
        for p in config.providers:
            name, options = (p, {}) if isinstance(p, str) else (p[0], dict(p[1]))
            if name not in available:
                raise DeviceError(f"execution provider {name} is not available; available providers: "
                                  f"{', '.join(available)}")
            if name == _CUDA_PROVIDER and "device_id" not in options:
                options["device_id"] = str(device.index)
            providers.append((name, options) if options else name)
        return providers
    if device.is_cuda:
        if _CUDA_PROVIDER not in available:
            raise _no_cuda(device)
        return [(_CUDA_PROVIDER, {"device_id": str(device.index)}), _CPU_PROVIDER]
    return [_CPU_PROVIDER]


def _ortvalue_host(array: np.ndarray):
    """A CPU ``OrtValue`` sharing ``array``'s memory (bfloat16 through its raw uint16 bits)."""
    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), DType.BF16.to_onnx())
    return ort.OrtValue.ortvalue_from_numpy(array)


def ortvalue_from_numpy(array, device: "Device | str"):
    """An ``onnxruntime.OrtValue`` holding ``array`` on ``device`` (a copy on CUDA).

    Raises:
        DeviceError: when ``device`` is CUDA and the CUDA execution provider is unavailable.
    """
    device = Device(device)
    providers_for(device)
    array = np.ascontiguousarray(np.asarray(array))
    if not device.is_cuda:
        return _ortvalue_host(array)
    if array.dtype == ml_dtypes.bfloat16:
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), np.uint16, "cuda", device.index)
        value.update_inplace(array.view(np.uint16))
        return value
    return ort.OrtValue.ortvalue_from_numpy(array, "cuda", device.index)


def _ortvalue_to_numpy(value, dtype: DType) -> np.ndarray:
    """A host array of a (CPU) ``OrtValue``; bfloat16 is copied through its raw bits, which
    ONNX Runtime's ``numpy()`` cannot return."""
    if dtype is not DType.BF16:
        return value.numpy()
    shape = tuple(value.shape())
    n = math.prod(shape)
    if n == 0:
        return np.zeros(shape, dtype=ml_dtypes.bfloat16)
    raw = (ctypes.c_uint16 * n).from_address(value.data_ptr())
    return np.frombuffer(raw, dtype=np.uint16).copy().view(ml_dtypes.bfloat16).reshape(shape)


def _pick_device(owner: str, params: Sequence[tuple], tensors: Sequence[Tensor]) -> Device:
    """The device a call runs on: the used params' device, else the inputs' CUDA device, else cpu.

    Raises:
        DeviceError: for params on several devices, or a CUDA input on another device than
            the params.
    """
    by_device: dict = {}
    for path, param in params:
        by_device.setdefault(param.lazy_device(), []).append(path)
    if len(by_device) > 1:
        where = "; ".join(f"{d}: {', '.join(repr(p) for p in paths[:4])}" for d, paths in by_device.items())
        raise DeviceError(f"{owner} has params on several devices ({where}); move it with module.to_device(...)")
    input_devices = {t.device for t in tensors if t.device.is_cuda}
    if by_device:
        device = next(iter(by_device))
        stray = [d for d in input_devices if d != device]
        if stray:
            raise DeviceError(f"{owner} lives on {device} but an input is on {stray[0]}; move the input with "
                              f"tensor.to_device({str(device)!r})")
        return device
    if len(input_devices) > 1:
        raise DeviceError(f"{owner}: inputs on several devices ({', '.join(sorted(map(str, input_devices)))})")
    return next(iter(input_devices)) if input_devices else CPU


# -- errors -----------------------------------------------------------------------------------

_NODE_PATTERNS = (
    re.compile(r"Name:\s*'([^']*)'"),
    re.compile(r"[Nn]ode \(([^)]*)\)"),
    re.compile(r"[Nn]ode '([^']*)'"),
    re.compile(r"[Nn]ode:\s*([^\s,]+)"),
)


_UNKNOWN_OP = re.compile(r"([\w.]*):(\w+)\(-?\d+\) is not a registered")
"""ONNX Runtime's message for an operator it has no kernel for (it names no node)."""


def _find_node(graph: ir.Graph, name: str):
    for node in graph.all_nodes():
        if node.name == name:
            return node
    return None


def _failing_node(message: str, graph: ir.Graph):
    for pattern in _NODE_PATTERNS:
        match = pattern.search(message)
        if match:
            node = _find_node(graph, match.group(1))
            if node is not None:
                return node
    match = _UNKNOWN_OP.search(message)
    if match:
        domain, op_type = match.groups()
        for node in graph.all_nodes():
            if node.op_type == op_type and (node.domain or "") == ("" if domain == "ai.onnx" else domain):
                return node
    return None


def _execution_error(error: Exception, traced, owner: str, action: str) -> ExecutionError:
    """An :class:`ExecutionError` naming the failing node and the param paths feeding it."""
    message = str(error).strip()
    node = None if traced is None else _failing_node(message, traced.graph)
    text = f"ONNX Runtime failed to {action} {owner}"
    if node is not None:
        params = [v.name for v in node.inputs if v is not None and v.name in traced.params]
        text += f" at node '{node.name}' ({node.op_type})"
        text += f", fed by params {', '.join(repr(p) for p in params)}" if params else " (no param feeds it)"
    return ExecutionError(f"{text}: {message}")


# -- sessions ---------------------------------------------------------------------------------


def _session_model_bytes(traced) -> bytes:
    """The serialized model a session is built from: param initializers as external-data stubs
    (their values are injected as ``OrtValue`` s), constants with their data. Cached on
    ``traced``; call under ``_LOCK`` (it swaps initializer values for a moment)."""
    cached = traced._cache.get("session_bytes")
    if cached is not None:
        return cached
    graph = traced.graph
    saved = []
    try:
        for path in traced.param_paths:
            value = graph.initializers[path]
            saved.append((value, value.const_value))
            nbytes = math.prod(value.shape.numpy()) * value.dtype.itemsize
            value.const_value = ir.ExternalTensor(_INJECTED_LOCATION, 0, int(nbytes), value.dtype,
                                                  shape=value.shape, name=path)
        data = ir.to_proto(traced.model).SerializeToString()
    finally:
        for value, const in saved:
            value.const_value = const
    traced._cache["session_bytes"] = data
    return data


_new_tensor = Tensor.__new__
_FAST_WRAP = set(Tensor.__slots__) == {"_host", "_ort", "_symbol", "_quant", "shape", "dtype", "device"}


def _host_tensor(array: np.ndarray, dtype: DType) -> Tensor:
    """A host Tensor owning ``array`` (an ONNX Runtime output nobody else holds), made read-only.

    NOTE: fills the slots directly (5x faster than ``Tensor.__init__`` on the hot path); the
    slot set is checked at import and the constructor is used if it ever changes.
    """
    array.setflags(write=False)
    if not _FAST_WRAP:  # pragma: no cover - guards a change of Tensor's storage
        return Tensor(host=array, shape=array.shape, dtype=dtype)
    t = _new_tensor(Tensor)
    t._host = array
    t._ort = None
    t._symbol = None
    t._quant = None
    t.shape = array.shape
    t.dtype = dtype
    t.device = CPU
    return t


class _Runner:
    """A built session and everything needed to run it with little Python around it."""

    def __init__(self, session, traced, device: Device, owner: str, keepalive):
        self.session = session
        self.traced = traced
        self.device = device
        self.owner = owner
        self.input_names = list(traced.input_names)
        self.output_names = list(traced.output_names)
        in_types = traced.input_types()
        self.input_dtypes = [dtype for _, dtype, _ in in_types]
        self.output_dtypes = [dtype for _, dtype, _ in traced.output_types()]
        self.single = traced.single_output
        self.input_name0 = self.input_names[0] if self.input_names else None
        self.output_dtype0 = self.output_dtypes[0] if self.output_dtypes else None
        self.shape1 = self.dtype1 = None  # set by the fast path for a one-host-tensor signature
        self._keepalive = keepalive
        self._run = session._sess.run  # NOTE: InferenceSession.run re-validates names per call
        self._needs_ortvalues = device.is_cuda or DType.BF16 in self.input_dtypes or DType.BF16 in self.output_dtypes
        self.fast_keys: list = []

    def error(self, e: Exception) -> ExecutionError:
        return _execution_error(e, self.traced, self.owner, "run")

    def run(self, tensors: Sequence[Tensor]):
        """Run with the graph inputs' tensors, in input order; a Tensor or a tuple."""
        if self._needs_ortvalues:
            return self._run_ortvalues(tensors)
        feed = {}
        for name, t in zip(self.input_names, tensors):
            host = t._host
            feed[name] = host if host is not None else t.to_numpy()
        try:
            outs = self._run(self.output_names, feed, None)
        except Exception as e:
            raise self.error(e) from e
        return self._wrap(outs)

    def run1(self, array: np.ndarray):
        """:meth:`run` for one host array (the hot path of ``module(x)``)."""
        try:
            outs = self._run(self.output_names, {self.input_name0: array}, None)
        except Exception as e:
            raise self.error(e) from e
        if self.single:
            return _host_tensor(outs[0], self.output_dtype0)
        return tuple(_host_tensor(arr, dtype) for arr, dtype in zip(outs, self.output_dtypes))

    def _wrap(self, outs):
        if self.single:
            return _host_tensor(outs[0], self.output_dtype0)
        return tuple(_host_tensor(arr, dtype) for arr, dtype in zip(outs, self.output_dtypes))

    def _run_ortvalues(self, tensors):
        session, device = self.session, self.device
        try:
            binding = session.io_binding()
            for name, t, dtype in zip(self.input_names, tensors, self.input_dtypes):
                if t._ort is not None:
                    binding.bind_ortvalue_input(name, t._ort)
                else:
                    binding.bind_ortvalue_input(name, _ortvalue_host(np.asarray(t.to_numpy())))
            for name in self.output_names:
                if device.is_cuda:
                    binding.bind_output(name, "cuda", device.index)
                else:
                    binding.bind_output(name, "cpu")
            session.run_with_iobinding(binding)
            values = binding.get_outputs()
        except OnnxParamError:
            raise
        except Exception as e:
            raise self.error(e) from e
        result = []
        for value, dtype in zip(values, self.output_dtypes):
            if device.is_cuda:
                result.append(Tensor(ort=value, shape=tuple(value.shape()), dtype=dtype, device=device))
            else:
                result.append(_host_tensor(_ortvalue_to_numpy(value, dtype), dtype))
        return result[0] if self.single else tuple(result)


def _build_runner(traced, params: Sequence[Param], device: Device, config: SessionConfig, owner: str) -> _Runner:
    """Build the ``InferenceSession`` of ``traced`` with ``params`` (in ``traced.param_paths``
    order) as injected initializers. Lazy params are initialized here."""
    providers = providers_for(device, config)
    data = _session_model_bytes(traced)
    options = config.session_options()
    names, values, arrays = [], [], []
    for path, param in zip(traced.param_paths, params):
        value = traced.graph.initializers[path]
        array = _trace.param_array(param, DType.from_onnx(int(value.dtype)))
        if tuple(array.shape) != tuple(value.shape.numpy()):
            raise ExecutionError(f"param {path!r} of {owner} has shape {list(array.shape)} but was traced with "
                                 f"{list(value.shape.numpy())}")
        names.append(path)
        values.append(_ortvalue_host(array))
        arrays.append(array)
    if names:
        options.add_external_initializers(names, values)
    try:
        session = ort.InferenceSession(data, options, providers=providers, enable_fallback=0)
    except Exception as e:
        raise _execution_error(e, traced, owner, "build a session for") from e
    return _Runner(session, traced, device, owner, (options, values, arrays))


# -- caches -----------------------------------------------------------------------------------


@dataclass
class RuntimeStats:
    """Counters since import (or :func:`clear_caches`).

    Attributes:
        sessions_built: module sessions built (each a new ``InferenceSession``).
        eager_sessions_built: one-op sessions built for eager ops.
        traces: forwards traced by module calls.
    """

    sessions_built: int = 0
    eager_sessions_built: int = 0
    traces: int = 0


_STATS = RuntimeStats()
_LOCK = threading.RLock()
_sessions: "OrderedDict[Any, _Runner]" = OrderedDict()
_traces: "OrderedDict[Any, Any]" = OrderedDict()
_eager: "OrderedDict[Any, _Runner]" = OrderedDict()
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
        _eager.clear()
        _fast.clear()


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


def _trim(cache: OrderedDict, limit: int, on_evict=None) -> None:
    while len(cache) > limit:
        _, evicted = cache.popitem(last=False)
        if on_evict is not None:
            on_evict(evicted)


def _forget_runner(runner: _Runner) -> None:
    for module_id, sig in runner.fast_keys:
        entry = _fast.get(module_id)
        if entry is not None:
            entry.by_sig.pop(sig, None)
            if entry.last1 is runner:
                entry.last1 = None


# -- structure keys ---------------------------------------------------------------------------

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
    if isinstance(value, np.ndarray) and value.size <= 64:
        return (np.ndarray, value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return (type(value), value.item())
    if isinstance(value, (np.ndarray, Tensor)):
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
    return ("param", shape, param.lazy_dtype(), lora)


def _structure_key(module) -> tuple:
    """Everything about ``module`` that can change its traced graph: module types,
    configuration attributes, param paths / shapes / dtypes / adapters. Values are not part of it."""
    from .module import Module

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
                if name != _CONFIG_ATTR:
                    items.append((name, node(child, f"{path}.{name}", private or name.startswith("_"))))
            return tuple(items)
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(node(v, f"{path}.{i}", private) for i, v in enumerate(value)))
        if isinstance(value, dict):
            return (dict, tuple((_freeze(k), node(v, f"{path}.{k}", private)) for k, v in value.items()))
        return _freeze(value)

    return node(module, "")


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
    """``module -> tuple of objects`` at the given step lists, as one generated function.

    NOTE: generated source (as ``dataclasses`` / ``namedtuple`` do) makes the per-call
    re-check a handful of bytecodes; only identifiers and int / str keys are ever written into
    it. Other keys fall back to a loop.
    """
    exprs = []
    for steps in all_steps:
        expr = "m"
        for is_item, key in steps:
            if is_item and type(key) in (int, str):
                expr += f"[{key!r}]"
            elif not is_item and key.isidentifier() and not keyword.iskeyword(key):
                expr += f".{key}"
            else:
                expr = None
                break
        if expr is None:
            def loop(m, _all=tuple(tuple(s) for s in all_steps)):
                out = []
                for steps in _all:
                    o = m
                    for is_item, key in steps:
                        o = o[key] if is_item else getattr(o, key)
                    out.append(o)
                return tuple(out)

            return loop
        exprs.append(expr)
    return eval(f"lambda m: ({', '.join(exprs)},)", {})  # noqa: S307 - see NOTE


class _FastEntry:
    """What the fast path remembers about one module object: its runners by signature and how
    to check, cheaply, that the params a runner was built from are still in place."""

    __slots__ = ("module", "by_sig", "last1", "getter", "expected")

    def __init__(self, module, traced, params_by_path: dict):
        self.module = module  # NOTE: a strong reference, so id(module) cannot be reused
        self.by_sig: dict = {}
        self.last1: Optional[_Runner] = None  # the runner of the last one-host-tensor call
        all_steps, expected = [], []
        for path in traced.param_paths:
            param = params_by_path.get(path)
            steps = None if param is None else _path_steps(module, path)
            if steps is not None:
                all_steps.append(steps)
                expected.append(param)
        self.getter = _compile_getter(all_steps) if all_steps else None
        self.expected = tuple(expected)

    def params_current(self, module) -> bool:
        """True when every used param is still the same object at the same path."""
        getter = self.getter
        if getter is None:
            return True
        try:
            return getter(module) == self.expected  # tuple ==: identity first, Param has no __eq__
        except Exception:  # a path that no longer resolves: let the slow path look again
            return False


_current_tracer = _trace._CURRENT.get
_fast_get = _fast.get


def _fast_signature(args, kwargs):
    """A hashable signature of a call whose arguments are all tensors (``None`` otherwise)."""
    sig = []
    for a in args:
        if a.__class__ is not Tensor or a._symbol is not None:
            return None
        sig.append((a.shape, a.dtype, None if a._host is not None else a.device))
    for k, a in kwargs.items():
        if a.__class__ is not Tensor or a._symbol is not None:
            return None
        sig.append((k, a.shape, a.dtype, None if a._host is not None else a.device))
    return tuple(sig)


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
    entry = _fast_get(id(module))
    if entry is not None:
        if len(args) == 1 and not kwargs:
            runner = entry.last1
            if runner is not None:
                a = args[0]
                if a.__class__ is Tensor and a._host is not None and a.shape == runner.shape1 and \
                        a.dtype is runner.dtype1 and entry.params_current(module):
                    return runner.run1(a._host)
        sig = _fast_signature(args, kwargs)
        if sig is not None:
            runner = entry.by_sig.get(sig)
            if runner is not None and entry.params_current(module):
                return runner.run(list(args) + list(kwargs.values()))
    runner, tensors = _resolve(module, args, kwargs, remember=True)
    return runner.run(tensors)


def _split_call(args, kwargs):
    """The call's tensors (graph inputs, in input order) with arrays wrapped as tensors."""
    args = [Tensor.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    kwargs = {k: Tensor.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor) and value._symbol is not None:
            raise TraceError(f"{value!r} is symbolic: it belongs to a trace that has ended")
    tensors = [a for a in args if isinstance(a, Tensor)] + [v for v in kwargs.values() if isinstance(v, Tensor)]
    return args, kwargs, tensors


def _traced(module, args, kwargs):
    """The trace key and :class:`~onnxparam.trace.TracedModel` of a call (traced if needed)."""
    call_sig = (tuple(("T", a.shape, a.dtype) if isinstance(a, Tensor) else ("S", _freeze(a)) for a in args),
                tuple((k, ("T", v.shape, v.dtype) if isinstance(v, Tensor) else ("S", _freeze(v)))
                      for k, v in kwargs.items()))
    mode = "merge"
    with _LOCK:
        trace_key = (_structure_key(module), call_sig, mode)
        traced = _traces.get(trace_key)
        if traced is None:
            traced = _trace.trace_module(module, tuple(args), kwargs=kwargs, lora=mode)
            _STATS.traces += 1
            _traces[trace_key] = traced
            _trim(_traces, _limits["traces"])
        else:
            _traces.move_to_end(trace_key)
    return trace_key, traced


def _resolve(module, args, kwargs, remember: bool = False):
    """The runner for this call (tracing and building as needed) and the input tensors."""
    from .module import named_params

    owner = type(module).__name__
    args, kwargs, tensors = _split_call(args, kwargs)
    config = session_config(module)
    with _LOCK:
        trace_key, traced = _traced(module, args, kwargs)
        by_path = dict(named_params(module))
        used = [(p, by_path[p] if p in by_path else traced.params[p]) for p in traced.param_paths]
        device = _pick_device(owner, used, tensors)
        session_key = (trace_key, device, config, tuple(_value_token(p) for _, p in used))
        runner = _sessions.get(session_key)
        if runner is None:
            runner = _build_runner(traced, [p for _, p in used], device, config, owner)
            _STATS.sessions_built += 1
            _sessions[session_key] = runner
            _trim(_sessions, _limits["sessions"], _forget_runner)
        else:
            _sessions.move_to_end(session_key)
        if remember:
            _remember(module, args, kwargs, runner, traced, by_path)
    return runner, tensors


def _remember(module, args, kwargs, runner: _Runner, traced, by_path: dict) -> None:
    sig = _fast_signature(args, kwargs)
    if sig is None:  # static (non-tensor) arguments: always the slow path
        return
    entry = _fast.get(id(module))
    if entry is None or entry.module is not module:
        entry = _FastEntry(module, traced, by_path)
        _fast[id(module)] = entry
        while len(_fast) > MAX_FAST_MODULES:
            _fast.pop(next(iter(_fast)))
    if not entry.params_current(module):
        entry = _FastEntry(module, traced, by_path)
        _fast[id(module)] = entry
    entry.by_sig[sig] = runner
    if len(args) == 1 and not kwargs and args[0]._host is not None and not runner._needs_ortvalues:
        runner.shape1, runner.dtype1 = args[0].shape, args[0].dtype
        entry.last1 = runner
    runner.fast_keys.append((id(module), sig))


def session_for(module, *args, **kwargs):
    """The ``onnxruntime.InferenceSession`` that ``module(*args, **kwargs)`` runs (built now if
    needed). Arguments may be tensors, arrays or :class:`~onnxparam.trace.InputSpec` -free
    concrete values, exactly as in a call."""
    runner, _ = _resolve(module, args, kwargs)
    return runner.session


def traced_for(module, *args, **kwargs):
    """The :class:`~onnxparam.trace.TracedModel` of ``module(*args, **kwargs)``: traced now, so
    its lazy initializers are this module's params (a cached trace may come from another module
    object of the same structure). No session is built, no param initialized."""
    args, kwargs, _ = _split_call(args, kwargs)
    return _trace.trace_module(module, tuple(args), kwargs=kwargs)


# -- eager ops --------------------------------------------------------------------------------


def _eager_key(value, leaves: list):
    if isinstance(value, Tensor):
        if value._symbol is not None:
            raise TraceError(f"{value!r} is symbolic: it belongs to a trace that has ended, so ops on it cannot run")
        leaves.append(value)
        return ("T", value.shape, value.dtype, value.device)
    if isinstance(value, np.ndarray):
        return _eager_key(Tensor.from_numpy(value), leaves)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_eager_key(v, leaves) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _eager_key(v, leaves)) for k, v in value.items()))
    return _freeze(value)


def _with_leaves(value, inputs):
    if isinstance(value, (Tensor, np.ndarray)):
        return next(inputs)
    if isinstance(value, (list, tuple)):
        items = [_with_leaves(v, inputs) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _with_leaves(v, inputs) for k, v in value.items()}
    return value


def run_eager(fn, args: tuple, kwargs: dict):
    """Run the op ``fn`` on concrete tensors: trace it into a small graph whose inputs are the
    tensor arguments, build (or reuse) its session, run it.

    Raises:
        TypeError: when no argument is a tensor.
        DeviceError / ExecutionError: as for module calls.
    """
    leaves: list = []
    key = (fn, _eager_key(args, leaves), _eager_key(kwargs, leaves))
    if not leaves:
        raise TypeError(f"{fn.__name__}: at least one argument must be a Tensor")
    device = _pick_device(f"ops.{fn.__name__}", (), leaves)
    config = _eager_config
    full_key = (key, device, config)
    with _LOCK:
        runner = _eager.get(full_key)
        if runner is None:
            tracer = _trace.Tracer(name=fn.__name__)
            with tracer.active():
                inputs = iter([tracer.input(f"input_{i}", t.shape, t.dtype) for i, t in enumerate(leaves)])
                out = fn(*_with_leaves(args, inputs), **_with_leaves(kwargs, inputs))
                traced = tracer.finish(out)
            runner = _build_runner(traced, (), device, config, f"ops.{fn.__name__}")
            _STATS.eager_sessions_built += 1
            _eager[full_key] = runner
            _trim(_eager, _limits["eager"])
        else:
            _eager.move_to_end(full_key)
    return runner.run(leaves)
