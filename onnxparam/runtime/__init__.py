"""ONNX Runtime execution: ``module(x)`` and eager ops, with cached ``InferenceSession`` s.

Modules of this package: :mod:`._config` (:class:`SessionConfig`), :mod:`._devices` (execution
providers, ``OrtValue`` s), :mod:`._sessions` (building and running sessions, errors),
:mod:`._calls` (module calls, caches, eager ops). Import from ``onnxparam.runtime``.

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
4. input shapes follow :attr:`SessionConfig.dynamic_shapes` (default ``"auto"``, PyTorch's
   "automatic dynamic"): the first call is traced with its concrete shapes; the first call
   whose shapes differ retraces once with the changed dims symbolic, and that trace and its one
   session serve every later size (``"static"``: a trace and a session per shape).
   :func:`stats` counts traces (``dynamic_traces`` among them) and sessions.

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

from ._calls import (
    MAX_CACHED_SESSIONS,
    MAX_CACHED_TRACES,
    MAX_EAGER_SESSIONS,
    MAX_FAST_MODULES,
    RuntimeStats,
    call_module,
    clear_caches,
    forget_values,
    session_for,
    sessions_built,
    set_cache_size,
    set_eager_session_config,
    set_session_config,
    stats,
    traced_for,
)
from ._config import SessionConfig, session_config
from ._devices import ortvalue_from_numpy, providers_for
from ._eager import run_eager

__all__ = [
    "SessionConfig",
    "RuntimeStats",
    "MAX_CACHED_SESSIONS",
    "MAX_CACHED_TRACES",
    "MAX_EAGER_SESSIONS",
    "MAX_FAST_MODULES",
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
    "forget_values",
]
