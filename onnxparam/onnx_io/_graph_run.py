"""Running an imported model's own graph in ONNX Runtime (``module(x)`` outside a trace).

The session is built from :func:`~onnxparam.onnx_io._graph_model.session_parts` (the source graph
verbatim, the params' values injected) and cached by the source graph, the params' value
identities, the device and the session config: the input shapes are not part of the key, so
calling with new shapes reuses the session wherever the graph's own dims allow them (ONNX Runtime
checks them).

Values pass through as ONNX Runtime takes and gives them: tensors of onnxparam's dtypes as
:class:`~onnxparam.Tensor` (numpy arrays and Python scalars accepted), other tensors (strings,
float8, int4 ...) as numpy arrays, sequences as lists, maps as dicts (a sequence of maps, as
ZipMap gives, as a list of dicts), absent optionals as ``None``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from ..core.dtype import DType
from ..core.errors import ExecutionError
from ..core.module import named_params
from ..core.tensor import Tensor

__all__ = ["run_graph", "MAX_GRAPH_SESSIONS"]

MAX_GRAPH_SESSIONS = 32
"""Sessions of imported graphs kept (LRU); each holds its weights."""

_LOCK = threading.RLock()
_sessions: "OrderedDict" = OrderedDict()
_NO_SESSION = object()


def _to_feed(x, declared):
    """A graph input value as ONNX Runtime takes it."""
    if isinstance(x, Tensor):
        return np.asarray(x.to_numpy())
    if x is None or isinstance(x, (list, dict, np.ndarray)):
        return x  # a dict: an ONNX map value (ONNX-ML DictVectorizer, CastMap ...)
    if isinstance(x, tuple):
        return list(x)
    array = np.asarray(x)
    dtype = getattr(declared, "dtype", None)
    if dtype is not None and array.dtype.kind in "biuf":
        try:
            array = array.astype(dtype.numpy())
        except (TypeError, ValueError):
            pass
    return array


def _run_session(session, names: list, feed: dict) -> list:
    """``session.run`` with every element type (see :mod:`onnxparam.runtime._values`): inputs of
    types numpy's binding cannot carry go as ``OrtValue`` s of their raw bits; when an output is
    of such a type the run returns ``OrtValue`` s, read back as ``ml_dtypes`` arrays."""
    from ..runtime._sessions import ort
    from ..runtime._values import host_ortvalue, needs_raw, onnx_type_of_ort_string, ortvalue_array

    raw_out = session.__dict__.get("_onnxparam_raw_outputs")
    if raw_out is None:
        raw_out = any(onnx_type_of_ort_string(o.type) is not None for o in session.get_outputs())
        session.__dict__["_onnxparam_raw_outputs"] = raw_out
    if not raw_out and not any(needs_raw(v) for v in feed.values()):
        return session.run(names, feed)
    tensors_only = all(isinstance(v, np.ndarray) and v.dtype.kind not in "OUS" for v in feed.values())
    values = {k: host_ortvalue(v, ort) if (raw_out and tensors_only) or needs_raw(v) else v for k, v in feed.items()}
    if not (raw_out and tensors_only):
        return session.run(names, values)  # NOTE: the arrays in feed stay alive until the run ends
    outs = session.run_with_ort_values(names, values)
    return [ortvalue_array(o) if o.is_tensor() else o.numpy() for o in outs]


def _from_ort(value):
    if isinstance(value, np.ndarray):
        try:
            dtype = DType.from_numpy(value.dtype)
        except (TypeError, ValueError):
            return value
        if dtype is DType.QFloat or value.dtype.kind not in "biuf":
            return value
        value.setflags(write=False)
        return Tensor(host=value, shape=value.shape, dtype=dtype)
    if isinstance(value, list):
        return [_from_ort(v) for v in value]
    return value


def _error(module, error: Exception, action: str) -> ExecutionError:
    """An :class:`ExecutionError` naming the imported file and the failing node (when ONNX
    Runtime's message names one of the source graph's nodes)."""
    from ..runtime._sessions import failing_node
    from ..runtime._source_errors import source_label

    source = module._source
    message = str(error).strip()
    node = failing_node(message, source.pristine.graph)
    where = f" at node {node.name!r} ({node.op_type})" if node is not None else ""
    label = source_label(module)
    what = f"the model imported from {label!r}" if source.loaded.path is not None else f"the imported model {label}"
    return ExecutionError(f"ONNX Runtime failed to {action} {what}{where}: {message}")


def _session(module):
    """The cached ``(session, keepalive)`` for ``module``'s current params, or ``None`` when its
    graph alone cannot express it."""
    from ..runtime import _calls as calls
    from ..runtime._config import session_config
    from ..runtime._devices import ortvalue_host, pick_device, providers_for
    from ..runtime._keys import _value_token
    from ..runtime._sessions import ort
    from ._graph_model import session_parts

    source = module._source
    config = session_config(module)
    params = list(named_params(module))
    if config.lora_mode != "merge" and any(p.adapter() is not None for _, p in params):
        return None
    if any(p.adapter() is not None and not p.adapter().merges_into(p.lazy_shape()) for _, p in params):
        return None  # an adapter no weight can hold (a grouped conv's): traced, in "keep" (runtime._calls)
    device = pick_device(type(module).__name__, params, [])
    key = (id(source), device, config, tuple(_value_token(p) for _, p in params))
    with _LOCK:
        hit = _sessions.get(key)
        if hit is not None:
            _sessions.move_to_end(key)
            return None if hit is _NO_SESSION else hit[0]
        parts = session_parts(module)
        if parts is None:
            _sessions[key] = _NO_SESSION
            return None
        data, names, arrays = parts
        options = config.session_options()
        values = [ortvalue_host(a) for a in arrays]
        if names:
            options.add_external_initializers(names, values)
        try:
            session = ort.InferenceSession(data, options, providers=providers_for(device, config))
        except Exception as e:
            raise _error(module, e, "build a session for") from e
        calls._STATS.sessions_built += 1
        _sessions[key] = (session, (source, options, values, arrays))
        while len(_sessions) > MAX_GRAPH_SESSIONS:
            _sessions.popitem(last=False)
        return session


def _forget_values(ids: set) -> int:
    """Drop the sessions built from a param value stored as one of ``ids`` (written in place:
    :func:`onnxparam.runtime.forget_values`; ONNX Runtime may have pre-packed the old values)."""
    from ..runtime._keys import _mentions

    with _LOCK:
        stale = [key for key in _sessions if _mentions(key[3], ids)]
        for key in stale:
            del _sessions[key]
    return len(stale)


def _register() -> None:
    from ..runtime._calls import register_value_cache

    register_value_cache(_forget_values)


_register()


def clear() -> None:
    """Forget every cached session of imported graphs."""
    with _LOCK:
        _sessions.clear()


def run_graph(module, bound: dict) -> Optional[object]:
    """Run ``module``'s source graph with ``bound`` (graph input name -> value); its outputs (one
    value, or a tuple), or ``_NO_SESSION`` when the graph alone cannot express the module."""
    from ._data_watch import check_source

    source = module._source
    check_source(source)  # a data file changed in place since import: the session's weights are stale
    session = _session(module)
    if session is None:
        return _NO_SESSION
    declared = {v.name: v for v in list(source.pristine.graph.inputs)}
    feed = {name: _to_feed(x, declared.get(name)) for name, x in bound.items()}
    names = [v.name for v in source.pristine.graph.outputs]
    try:
        outs = _run_session(session, names, feed)
    except Exception as e:
        raise _error(module, e, "run") from e
    outs = [_from_ort(o) for o in outs]
    return outs[0] if len(outs) == 1 else tuple(outs)

