"""``grad(loss_fn, module, *inputs)``: the loss and the gradients of every trainable param,
computed by one cached ONNX Runtime session; and :class:`Gradients`, keyed by ``ParamId``.

**What is traced.** ``loss_fn(module, *inputs, **kwargs)`` runs inside a trace (as a module's
``forward`` does): every op it calls, including the module's own forward, becomes ONNX nodes.
It must return a one-element float tensor (use :func:`onnxparam.autodiff.cross_entropy`,
:func:`onnxparam.autodiff.mse`, or ``ops.mean`` of something). LoRA adapters are traced in the ``"keep"``
form (``x @ W + scale * ((x @ a) @ b)``), so the factors are params of the graph and get their
own gradients while the frozen base stays a constant. A quantized base (QLoRA) is traced as
``DequantizeLinear`` of its stored integers (``QdqOptions(matmul="dequantize")``, what
``module(x)`` computes), whatever :func:`~onnxparam.quant._qdq.qdq_options` encloses the call.

**Which params get a gradient.** Exactly the float params with ``require_grad`` that the loss
depends on (``module.no_grad()``, ``freeze_group``, ``apply_lora`` clear the flag; a frozen
param gets no gradient and its part of the backward graph is pruned). An imported model's tied
embedding table and output projection (``OnnxModule.onnx_ties``) both get the sum of their
gradients, as torch's one tied weight does (:mod:`._ties`).

**Caching.** The training graph is cached by ``(loss_fn object, module structure, input
signature, trainable paths)``: pass the *same* ``loss_fn`` object every step (a new lambda per
step re-traces). A float tensor the ``loss_fn`` reads from a global or closure variable is a
graph input fed from that variable on every call (``captured_<name>``; a loop reassigning a
global batch keeps one graph). Other tensors and Python values read so are baked into the
graph and guarded (:mod:`onnxparam.trace.guards`): when one of those names holds another object
(or another number, or a list / dict with other items), the entry is traced again (a new graph
and session; pass such values as arguments). Trainable params are graph inputs fed on every run, so a training loop that
changes them reuses one session; the session is keyed like inference sessions by the identity
of the frozen params' values (a module loaded with new frozen weights gets a new session).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Mapping, Optional

from ..core.errors import TraceError
from ..core.param import Param, ParamId
from ..core.tensor import Tensor
from ..lora import _graph as lora_graph
from ..nn._initializer import seed_generation
from ..quant import _qdq as qdq
from ..quant._passes import STANDARD_PASSES
from ..runtime import _calls
from ..runtime._config import session_config
from ..runtime._devices import pick_device
from ..runtime._sessions import build_runner
from ..trace import guards as _guards
from ..trace import tracer as _trace
from . import _dynamic
from ._backward import build_training_model
from ._recompute import recomputed_paths
from ._ties import module_ties, tie_gradients

__all__ = ["Gradients", "grad", "check_gradients", "training_model", "trainable_paths", "clear_cache", "MAX_CACHED_TRAINING"]

LOSS_OUTPUT = "loss"
"""The training graph's first output (``output`` when a param path is already ``loss``)."""

TRAINING_LORA_MODE = "keep"
"""The LoRA mode of training graphs: adapters as graph nodes, so their factors get gradients."""

MAX_CACHED_TRAINING = 16
"""Training graphs (and, separately, training sessions) kept, least recently used dropped first."""

_graphs: "OrderedDict[Any, tuple]" = OrderedDict()
_sessions: "OrderedDict[Any, Any]" = OrderedDict()


_SEEN_SEED = [seed_generation()]
"""The :func:`onnxparam.nn.seed` generation the cached graphs were built under."""


def _forget_if_reseeded() -> None:
    """After :func:`onnxparam.nn.seed`, forget the cached graphs and sessions: the next calls
    trace and build afresh, so seeded dropout masks restart (caller holds the runtime's lock)."""
    generation = seed_generation()
    if generation != _SEEN_SEED[0]:
        _graphs.clear()
        _sessions.clear()
        _SEEN_SEED[0] = generation


def _forget_values(ids: set) -> int:
    """Drop the training sessions built with a frozen param stored as one of ``ids`` (written in
    place: :func:`onnxparam.runtime.forget_values`); trainable params are fed on every run."""
    with _calls._LOCK:
        stale = [key for key in _sessions if _calls._mentions(key[3], ids)]
        for key in stale:
            del _sessions[key]
    return len(stale)


_calls.register_value_cache(_forget_values)


def clear_cache() -> None:
    """Forget every cached training graph and session."""
    with _calls._LOCK:
        _graphs.clear()
        _sessions.clear()
        _dynamic.clear()


class Gradients(Mapping):
    """The gradients of one loss: ``ParamId -> Tensor`` (Burn's ``GradientsParams``).

    Each gradient has its param's shape and dtype (the raw base's for a LoRA base that is
    trainable). Index by ``ParamId`` or by the :class:`~onnxparam.Param` itself; only params
    that require grad and that the loss depends on are present.
    """

    def __init__(self, grads: Mapping[ParamId, Tensor], paths: Optional[Mapping[ParamId, str]] = None):
        self._grads = dict(grads)
        self._paths = dict(paths or {})

    def __getitem__(self, key) -> Tensor:
        if isinstance(key, Param):
            key = key.id
        return self._grads[key]

    def __contains__(self, key) -> bool:
        if isinstance(key, Param):
            key = key.id
        return key in self._grads

    def __iter__(self) -> Iterator[ParamId]:
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)

    def path(self, key) -> Optional[str]:
        """The module path the gradient was computed at (``fc1.weight.lora.a``)."""
        return self._paths.get(key.id if isinstance(key, Param) else key)

    def by_path(self) -> dict:
        """``path -> Tensor``."""
        return {self._paths.get(pid, str(pid)): t for pid, t in self._grads.items()}

    def __repr__(self) -> str:
        items = ", ".join(f"{self._paths.get(pid, pid)}: {list(t.shape)}" for pid, t in self._grads.items())
        return f"Gradients({items})"


def trainable_paths(module) -> tuple:
    """Paths of the float params of ``module`` that require grad, in traversal order."""
    from ..core.module import named_params

    return tuple(path for path, p in named_params(module) if p.require_grad and p.lazy_dtype().is_float)


def _trace_loss(loss_fn, module, args: list, kwargs: dict, shapes: Optional[tuple] = None,
                least: int = 0) -> _trace.TracedModel:
    """``loss_fn(module, *args, **kwargs)`` traced; ``shapes`` (one per argument, positional then
    keyword; ``None`` for non-tensors) replaces the tensors' shapes (``str`` dims symbolic, for
    sizes >= ``least``)."""
    _calls._STATS.traces += 1
    _calls._STATS.training_traces += 1
    if shapes is not None and any(isinstance(d, str) for s in shapes if s is not None for d in s):
        _calls._STATS.dynamic_traces += 1
    declared = dict(getattr(module, "onnx_opset_imports", None) or {})
    tracer = _trace.Tracer(opset_imports=declared, mode=TRAINING_LORA_MODE, root=module, name="training_graph",
                           passes=STANDARD_PASSES)
    tracer.min_dynamic_size = int(least)
    shape_of = (lambda i, t: t.shape) if shapes is None else (lambda i, t: shapes[i])
    # NOTE: a quantized (QLoRA) base is traced in the weight-only DequantizeLinear form, as
    # module(x) does (qdq.RUNTIME_DEFAULT_OPTIONS): the export default rewrites 8-bit MatMuls into
    # DynamicQuantizeLinear -> MatMulInteger, which quantizes the activation (no gradient rule,
    # and not what module(x) computes). Fixed here, so it is not part of the cache key.
    arguments = list(args) + list(kwargs.values())
    # NOTE: tensors the loss_fn reads from its globals / closure become graph inputs fed on every
    # run (a training loop reassigning a global batch keeps one graph and one session)
    tracer.lift, lifted = _guards.lifting([loss_fn])
    with qdq.qdq_options(qdq.RUNTIME_DEFAULT_OPTIONS), tracer.active():
        args = list(args)
        kwargs = dict(kwargs)
        names = []
        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                args[i] = tracer.input(f"input_{i}", shape_of(i, a), a.dtype, unique=True)
                names.append(args[i]._symbol.value.name)
        for j, (k, v) in enumerate(kwargs.items()):
            if isinstance(v, Tensor):
                kwargs[k] = tracer.input(str(k), shape_of(len(args) + j, v), v.dtype, unique=True)
                names.append(kwargs[k]._symbol.value.name)
        loss = loss_fn(module, *args, **kwargs)
        if not isinstance(loss, Tensor):
            raise TraceError(f"loss_fn must return a Tensor (the loss); got {type(loss).__name__}")
        # NOTE: the output is called "loss" unless a param or input already has that name
        output = [LOSS_OUTPUT] if LOSS_OUTPUT not in tracer._names else None
        tracer.lift = None
        forward = tracer.finish(loss, output_names=output, input_names=names + [name for _, name in lifted])
    forward._cache["guards"] = _guards.trace_guards(tracer, [loss_fn], f"loss_fn {getattr(loss_fn, '__name__', '')!s}",
                                                    arguments, [g for g, _ in lifted])
    forward._cache["lifted"] = tuple(g for g, _ in lifted)
    return forward


def _built(forward, wrt, marked) -> tuple:
    """``build_training_model``'s ``(training, grad paths)``, the training model carrying the
    forward's guards (:mod:`onnxparam.trace.guards`)."""
    training, grad_paths = build_training_model(forward, wrt, marked)
    guards = forward._cache.get("guards")
    if guards:
        training._cache["guards"] = guards
    training._cache["lifted"] = forward._cache.get("lifted", ())
    return training, grad_paths


def _drop_stale(key) -> None:
    """Forget the training sessions of the graph under ``key`` (its guards failed: it is traced
    again, and its sessions would never be found again)."""
    for k in [k for k in _sessions if k[0] == key]:
        del _sessions[k]


def _holds(hit) -> bool:
    """Whether a cached ``(training, grad paths)`` entry's guards still hold (the globals and
    closure values its ``loss_fn`` read are what the trace saw)."""
    guards = hit[0]._cache.get("guards")
    return not guards or _guards.guards_hold(guards)


def _training_entry(loss_fn, module, args, kwargs, call_sig: tuple):
    """``(key, training TracedModel, grad paths)`` for this call (``call_sig``: its signature
    from the runtime's ``_split_call``), traced and built if needed."""
    _forget_if_reseeded()
    wrt_all = trainable_paths(module)
    marked = recomputed_paths(module)
    key = (_calls._Ref(loss_fn), _calls._structure_key(module), call_sig, wrt_all, marked)
    hit = _graphs.get(key)
    if hit is not None:
        if _holds(hit):
            _graphs.move_to_end(key)
            return (key,) + hit
        _drop_stale(key)
        _guards.note_retrace(key, hit[0]._cache["guards"], f"loss_fn {getattr(loss_fn, '__name__', '')!s}")
    if session_config(module).dynamic_shapes == "auto":
        family_key = (key[0], key[1], tuple(_rank_only(e, i < len(args)) for i, e in enumerate(call_sig)), wrt_all)

        def lookup(gen_key):
            hit = _graphs.get(gen_key)
            if hit is not None and not _holds(hit):
                _drop_stale(gen_key)
                _guards.note_retrace(gen_key, hit[0]._cache["guards"], f"loss_fn {getattr(loss_fn, '__name__', '')!s}")
                return None
            if hit is None:
                return None
            _graphs.move_to_end(gen_key)
            return hit

        def build(gen_key, shapes, least):
            forward = _trace_loss(loss_fn, module, args, kwargs, shapes, least)
            entry = _built(forward, [p for p in wrt_all if p in forward.params], marked)
            _graphs[gen_key] = entry
            _calls._trim(_graphs, MAX_CACHED_TRAINING)
            return entry

        found = _dynamic.dynamic_entry(family_key, args, kwargs, lookup, build,
                                       lambda: _dynamic.declared_dynamic(module, args, kwargs))
        if found is not None:
            return (found[0],) + tuple(found[1])
    forward = _trace_loss(loss_fn, module, args, kwargs)
    wrt = [p for p in wrt_all if p in forward.params]
    training, grad_paths = _built(forward, wrt, marked)
    _graphs[key] = (training, grad_paths)
    _calls._trim(_graphs, MAX_CACHED_TRAINING)
    return key, training, grad_paths


def _rank_only(entry, positional: bool):
    """A call-signature entry with a tensor's shape replaced by its rank."""
    if not positional:
        return (entry[0], _rank_only(entry[1], True))
    if isinstance(entry, tuple) and len(entry) == 4 and entry[0] == "T":
        return ("T", len(entry[1])) + entry[2:]
    return entry


def training_model(loss_fn, module, *inputs, **kwargs) -> _trace.TracedModel:
    """The training :class:`~onnxparam.trace.tracer.TracedModel` that :func:`grad` runs (inputs: the
    tensor arguments, the ``captured_<name>`` float tensors the loss_fn reads from globals /
    closure variables, then the trainable params; outputs: the loss then ``<path>.grad`` s)."""
    args, kwargs, _, call_sig = _calls._split_call(inputs, kwargs)
    with _calls._LOCK:
        return _training_entry(loss_fn, module, args, kwargs, call_sig)[1]


def grad(loss_fn, module, *inputs, **kwargs) -> tuple:
    """The loss and its gradients with respect to ``module``'s trainable params.

    Args:
        loss_fn: ``loss_fn(module, *inputs, **kwargs) -> Tensor``, a one-element float loss;
            traced (see the module docstring), so it must use :mod:`onnxparam.ops` (and
            modules) only. Pass the same function object on every step.
        module: the :class:`~onnxparam.Module`; its float params with ``require_grad`` are
            differentiated.
        *inputs, **kwargs: tensors or arrays (graph inputs: their shapes and dtypes key the
            cache) and plain Python values (baked into the graph). Float tensors ``loss_fn``
            reads from globals / closure variables are fed as inputs; other values read so
            are baked and guarded (a change retraces).

    Returns:
        ``(loss, grads)``: ``loss`` a host :class:`~onnxparam.Tensor` of the loss's shape
        (``float(loss.to_numpy())``), ``grads`` the :class:`Gradients`.

    Warns:
        CaptureWarning: ``loss_fn`` baked a tensor from outside that no guard watches (reached
            through an object's attribute): pass it as an input.

    Raises:
        TraceError: when ``loss_fn`` cannot be traced, does not return a one-element float
            tensor, or uses an operator without a gradient rule on a trainable path.
        DeviceError / ExecutionError: as for module calls.
    """
    from ..core.module import named_params

    owner = f"grad({getattr(loss_fn, '__name__', 'loss_fn')}, {type(module).__name__})"
    args, kwargs, tensors, call_sig = _calls._split_call(inputs, kwargs)
    config = session_config(module)
    with _calls._LOCK:
        key, training, grad_paths = _training_entry(loss_fn, module, args, kwargs, call_sig)
        # the tensors the loss_fn reads from its globals / closure, fed as graph inputs
        tensors = list(tensors) + [g.current() for g in training._cache.get("lifted", ())]
        by_path = dict(named_params(module))
        frozen = [(p, lora_graph.initializer_param(by_path.get(p, training.params[p]), TRAINING_LORA_MODE))
                  for p in training.param_paths]
        trainable = training.input_names[len(tensors):]
        fed_params = [lora_graph.initializer_param(by_path[p], TRAINING_LORA_MODE) for p in trainable]
        device = pick_device(owner, frozen + list(zip(trainable, fed_params)), tensors)
        session_key = (key, device, config, tuple(_calls._value_token(p) for _, p in frozen))
        if training._cache.get("guards"):  # NOTE: a retrace after a failed guard has the same key
            session_key += (_calls._Ref(training),)
        runner = _sessions.get(session_key)
        if runner is None:
            # NOTE: no memory pattern: with it, the second run allocated one block for all the
            # intermediates beside the arena the first run grew (+39 MiB on BERT-tiny, 8 x 128)
            runner = build_runner(training, [p for _, p in frozen], device, config, owner, memory_pattern=False)
            _calls._STATS.sessions_built += 1
            _calls._STATS.training_sessions_built += 1
            _sessions[session_key] = runner
            _calls._trim(_sessions, MAX_CACHED_TRAINING)
        else:
            _sessions.move_to_end(session_key)
    feeds = list(tensors)
    for path, param in zip(trainable, fed_params):
        dtype = _input_dtype(training, path)
        feeds.append(Tensor.from_numpy(_trace.param_array(param, dtype)))
    outputs = runner.run(feeds)
    loss, values = outputs[0], outputs[1:]
    grads = {by_path[p].id: t for p, t in zip(grad_paths, values)}
    paths = {by_path[p].id: p for p in grad_paths}
    ties = module_ties(module)
    if ties:  # an imported model's tied embedding / output projection: one weight, as torch's (._ties)
        grads = tie_gradients(grads, by_path, ties)
        paths.update({by_path[p].id: p for pair in ties for p in pair[:2]
                      if p in by_path and by_path[p].id in grads and by_path[p].id not in paths})
    return loss, Gradients(grads, paths)


def _input_dtype(training, name: str):
    cache = training._cache.setdefault("input_dtypes", {n: d for n, d, _ in training.input_types()})
    return cache[name]


def check_gradients(loss_fn, module, *inputs, **kwargs) -> list:
    """Every node on a path from ``module``'s trainable params to the loss whose gradient
    :func:`grad` cannot build: nodes without a gradient rule, and nodes whose rule fails for a
    reason known from the graph (a form a rule does not cover, e.g. ``ConvTranspose`` with ``output_shape``).
    It traces ``loss_fn(module, *inputs, **kwargs)`` and builds the training graph exactly as
    :func:`grad` does (the same decisions; the graph is cached for :func:`grad`), but runs nothing.

    Args:
        loss_fn, module, *inputs, **kwargs: as for :func:`grad`.

    Returns:
        a list of :class:`~onnxparam.autodiff._check.MissingRule` (``node`` — the traced name —,
        ``op`` — the operator key, ``"<domain>:<op>"`` outside ``ai.onnx`` —, ``params`` — the
        trainable params feeding it directly —, ``reason`` and ``source`` — the node's name in
        the imported ONNX file, ``""`` for other nodes); empty exactly when :func:`grad` builds
        its training graph for these arguments. :func:`grad` raises a
        :class:`~onnxparam.core.errors.TraceError` listing the same nodes.

    Raises:
        TraceError: when ``loss_fn`` cannot be traced, or the loss is not a one-element float.
    """
    args, kwargs, _, call_sig = _calls._split_call(inputs, kwargs)
    with _calls._LOCK:
        try:
            _training_entry(loss_fn, module, args, kwargs, call_sig)
        except TraceError as err:
            missing = getattr(err, "missing", None)
            if missing is None:
                raise
            return list(missing)
    return []
