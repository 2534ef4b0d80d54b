"""Building ``InferenceSession`` s from traced models, running them, and translating errors."""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import numpy as np
import onnx_ir as ir

from ..core import extension
from ..core.device import CPU, Device
from ..core.dtype import DType, dtype_from_onnx_element
from ..core.errors import ExecutionError, OnnxParamError
from ..core.param import Param
from ..core.tensor import Tensor
from ..trace import tracer as _trace
from ._config import SessionConfig
from ._devices import ortvalue_from_numpy, ortvalue_host, ortvalue_to_numpy, providers_for
from ._ort import import_onnxruntime
from ._values import onnx_of_numpy

ort = import_onnxruntime()

__all__ = ["Runner", "build_runner", "execution_error", "failing_node"]

_INJECTED_LOCATION = "onnxparam-injected-initializer"
"""The external-data location written for param initializers of a session's model; ONNX Runtime
never reads it, as every such initializer is replaced by an injected ``OrtValue``."""

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


def failing_node(message: str, graph: ir.Graph):
    """The node of ``graph`` (subgraphs included) that ONNX Runtime's ``message`` names, or the
    one node of an operator it has no kernel for; ``None`` when the message names none."""
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


def execution_error(error: Exception, traced, owner: str, action: str) -> ExecutionError:
    """An :class:`ExecutionError` naming the failing node and the param paths feeding it."""
    message = str(error).strip()
    node = None if traced is None else failing_node(message, traced.graph)
    text = f"ONNX Runtime failed to {action} {owner}"
    if node is not None:
        from ._source_errors import imported_source

        params = [v.name for v in node.inputs if v is not None and v.name in traced.params]
        text += f" at node '{node.name}' ({node.op_type})"
        imported = imported_source(traced.graph, node.name)
        if imported is not None:
            text += f" of the model imported from {imported!r}"
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
            if extension.executor().passes.is_pass_initializer(value):
                continue  # NOTE: quantized values travel with the graph (the trace is keyed by their storage)
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
_FAST_WRAP = set(Tensor.__slots__) == {"_host", "_ort", "_symbol", "_quant", "_shape", "dtype", "device"}


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
    t._shape = array.shape
    t.dtype = dtype
    t.device = CPU
    return t


def _raw(dtype) -> bool:
    """True for a dtype numpy's ONNX Runtime binding cannot carry (bfloat16, float8, int4 ...)."""
    try:
        return dtype is not None and onnx_of_numpy(dtype.to_numpy()) is not None
    except Exception:  # noqa: BLE001 - a dtype without one numpy type (QFloat)
        return False


class Runner:
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
        self._needs_ortvalues = device.is_cuda or any(_raw(d) for d in self.input_dtypes + self.output_dtypes)
        self.fast_keys: list = []
        self.fed: dict = {}  # graph input -> value fed on every run ("inputs" LoRA factors)

    def with_fed_params(self, params: Sequence[tuple]) -> "Runner":
        """A copy of this runner (same session) that feeds ``(graph input, param or array)`` values on
        every run: the LoRA factors of an ``"inputs"``-mode graph. On CUDA they are
        device-resident ``OrtValue`` s bound through IO binding.

        NOTE: ONNX Runtime ignores ``RunOptions.add_active_adapter`` under IO binding; binding
        the factors as inputs is what switches adapters there (and is equally fast on CPU)."""
        import copy

        fed = {}
        for name, param in params:
            if isinstance(param, np.ndarray):  # a value computed by the caller (LoRA: scale * b)
                array = param
            else:
                dtype = DType.from_onnx(int(self.traced.graph.initializers[name].dtype))
                with _trace.untraced():
                    tensor = param.val()
                if self.device.is_cuda and tensor._ort is not None and tensor.dtype is dtype:
                    fed[name] = tensor._ort
                    continue
                array = _trace.param_array(param, dtype)
            if self._needs_ortvalues:
                fed[name] = ortvalue_from_numpy(array, self.device) if self.device.is_cuda else ortvalue_host(array)
            else:
                fed[name] = array
        clone = copy.copy(self)
        clone.fed = fed
        return clone

    def error(self, e: Exception) -> ExecutionError:
        return execution_error(e, self.traced, self.owner, "run")

    def run(self, tensors: Sequence[Tensor], extra: Optional[dict] = None):
        """Run with the graph inputs' tensors, in input order; a Tensor or a tuple. ``extra``:
        more ``{graph input: host array}`` feeds for this run only (LoRA's ``adapter_index``;
        not with :attr:`_needs_ortvalues`: a device runner takes them through
        :meth:`with_fed_params`)."""
        if self._needs_ortvalues:
            return self._run_ortvalues(tensors)
        feed = {}
        for name, t in zip(self.input_names, tensors):
            host = t._host
            feed[name] = host if host is not None else t.to_numpy()
        if self.fed:
            feed.update(self.fed)
        if extra:
            feed.update(extra)
        try:
            outs = self._run(self.output_names, feed, None)
        except Exception as e:
            raise self.error(e) from e
        return self._wrap(outs)

    def run1(self, array: np.ndarray):
        """:meth:`run` for one host array (the hot path of ``module(x)``)."""
        feed = {self.input_name0: array}
        if self.fed:
            feed.update(self.fed)
        try:
            outs = self._run(self.output_names, feed, None)
        except Exception as e:
            raise self.error(e) from e
        if self.single and _FAST_WRAP:  # NOTE: _host_tensor, inlined (this is the hot path)
            out = outs[0]
            out.setflags(write=False)
            t = _new_tensor(Tensor)
            t._host = out
            t._ort = t._symbol = t._quant = None
            t.shape = out.shape
            t.dtype = self.output_dtype0
            t.device = CPU
            return t
        if self.single:
            return _host_tensor(outs[0], self.output_dtype0)
        return tuple(_host_tensor(arr, dtype) for arr, dtype in zip(outs, self.output_dtypes))

    def _wrap(self, outs):
        if self.single:
            return _host_tensor(outs[0], self.output_dtype0)
        return tuple(_host_tensor(arr, dtype) for arr, dtype in zip(outs, self.output_dtypes))

    def _run_ortvalues(self, tensors):
        session, device = self.session, self.device
        keep = []  # NOTE: host OrtValues share numpy memory: alive until the run is over
        try:
            binding = session.io_binding()
            for name, t in zip(self.input_names, tensors):
                if t._ort is not None:
                    binding.bind_ortvalue_input(name, t._ort)
                else:
                    keep.append(ortvalue_host(np.asarray(t.to_numpy())))
                    binding.bind_ortvalue_input(name, keep[-1])
            for name, value in self.fed.items():
                binding.bind_ortvalue_input(name, value)
            for name in self.output_names:
                if device.is_cuda:
                    binding.bind_output(name, "cuda", device.index)
                else:
                    binding.bind_output(name, "cpu")
            session.run_with_iobinding(binding)
            values = binding.get_outputs()
            del keep
        except OnnxParamError:
            raise
        except Exception as e:
            raise self.error(e) from e
        result = []
        for value, dtype in zip(values, self.output_dtypes):
            if device.is_cuda:
                result.append(Tensor(ort=value, shape=tuple(value.shape()), dtype=dtype, device=device))
            else:
                result.append(_host_tensor(ortvalue_to_numpy(value, dtype), dtype))
        return result[0] if self.single else tuple(result)


def build_runner(traced, params: Sequence[Param], device: Device, config: SessionConfig, owner: str,
                 memory_pattern: bool = True) -> Runner:
    """Build the ``InferenceSession`` of ``traced`` with ``params`` (in ``traced.param_paths``
    order) as injected initializers. Lazy params are initialized here. ``memory_pattern=False``
    turns ONNX Runtime's memory pattern off (training sessions: the pattern's one block for every
    planned intermediate came on top of the arena the first run had grown)."""
    providers = providers_for(device, config)
    data = _session_model_bytes(traced)
    options = config.session_options()
    if not memory_pattern:
        options.enable_mem_pattern = False
    names, values, arrays = [], [], []
    for path, param in zip(traced.param_paths, params):
        value = traced.graph.initializers[path]
        if extension.executor().passes.is_pass_initializer(value):
            continue
        # NOTE: in the "keep" / "inputs" LoRA modes an adapted weight's initializer is its raw base
        array = _trace.param_array(extension.executor().passes.held_param(param, traced.mode), dtype_from_onnx_element(int(value.dtype)))
        if tuple(array.shape) != tuple(value.shape.numpy()):
            raise ExecutionError(f"param {path!r} of {owner} has shape {list(array.shape)} but was traced with "
                                 f"{list(value.shape.numpy())}")
        names.append(path)
        values.append(ortvalue_host(array))
        arrays.append(array)
    if names:
        options.add_external_initializers(names, values)
    try:
        session = ort.InferenceSession(data, options, providers=providers, enable_fallback=0)
    except Exception as e:
        raise execution_error(e, traced, owner, "build a session for") from e
    return Runner(session, traced, device, owner, (options, values, arrays))

