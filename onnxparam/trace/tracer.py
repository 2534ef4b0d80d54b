"""Tracing a module's ``forward`` into an ONNX graph (built with onnx-ir).

A :class:`Tracer` owns one ``onnx_ir.Graph`` under construction. While it is *active*
(:meth:`Tracer.active`), three things hold:

* every op of :mod:`onnxparam.ops` appends ONNX nodes to the graph instead of computing, and
  returns *symbolic* :class:`~onnxparam.Tensor` s (shape + dtype, no data; ``tensor._symbol``
  is a :class:`Symbol`: the ``onnx_ir.Value``, its tracer, and the param it stands for);
* ``Param.val()`` returns the param's graph *initializer* (through the tensor operator table,
  :meth:`onnxparam.core.extension.TensorOps.param_value`), named by the param's path in the root module's one
  traversal (``fc1.weight``). The initializer's value is an ``onnx_ir.LazyTensor``: tracing never
  runs a lazy param's init; the runtime materializes values once, when it builds a session;
* calling a sub-module (``self.fc1(x)``) inlines its ``forward`` under the node-name scope
  ``/fc1`` (node names read ``/fc1/MatMul``; value names ``/fc1/MatMul_output_0``).

:func:`trace_module` traces a module for given inputs (concrete tensors or arrays, or
:class:`InputSpec` s with symbolic dims such as ``"batch"``) and returns a :class:`TracedModel`:
an ``onnx_ir.Model`` plus its input / output names and the param paths it uses. Serialize it
with ``onnx_ir.save(traced.model, path)`` or :meth:`TracedModel.to_proto`.

Output types of each node are computed by ONNX's own node-level shape inference
(``onnx.shape_inference.infer_node_outputs``, the operator schemas' inference functions), so
dynamic dims stay symbolic (``"batch"``) or unknown (``None``); ops whose result is obvious
(elementwise unary, flatten ...) pass their output types directly.

LoRA modes (``lora=``): ``"merge"`` (the initializer holds ``base + scale * (a @ b)``), ``"keep"``
(the raw base and the factors as initializers; ``x@W + scale*((x@a)@b)`` emitted after each
``MatMul`` / ``Gemm`` using an adapted weight, the merged weight as nodes for any other use) and
``"inputs"`` (as ``"keep"``, the factors also overridable graph inputs for ONNX Runtime's
multi-LoRA API). Each param's symbolic tensor carries its :class:`~onnxparam.Param`
(``tensor._symbol.param``); :func:`onnxparam.lora._graph.expand_adapters` rewrites the finished
graph, so ops and callers need no change. Quantized params go through the QDQ pass
(``GraphPasses.quantized_param``). Closing a trace lives in :mod:`onnxparam.trace.model`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from ..core.device import CPU
from ..core.dtype import DType
from ..core.errors import LoraError, OnnxParamError, TraceError, TraceTypeError, TraceValueError
from ..core.param import Param
from ..core.tensor import Tensor
from .model import TracedModel, baking_node, check_batch_outputs, finish_trace  # noqa: F401  (re-exported)
from .passes import LORA_MODES, NO_PASSES, TRACE_LORA_MODES, GraphPasses  # noqa: F401  (GraphPasses re-exported)
from .symint import SymInt
from .values import (  # noqa: F401  (re-exported: onnxparam.trace.tracer is their public home)
    _CURRENT,
    INFERENCE_DATA_MAX_ELEMENTS,
    InputSpec,
    Symbol,
    _as_spec,
    _axes_items,
    _describe,
    _dims_of,
    _dims_of_value,
    _dtype_from_onnx,
    _forward_arg_names,
    _ir_dtype,
    _is_input,
    _is_input_value,
    _lazy_initializer,
    _outer_values,
    _to_attr,
    _type_proto,
    current_tracer,
    infer_node_types,
    param_array,
    untraced,
)

__all__ = [
    "DEFAULT_OPSET", "MIN_OPSET", "LORA_MODES", "InputSpec", "Symbol", "Tracer", "TracedModel",
    "current_tracer", "trace_module", "subgraph", "untraced", "param_array",
]

DEFAULT_OPSET = 21
"""The default ONNX opset (``ai.onnx``) of traced graphs: supported by ONNX Runtime >= 1.20."""

MIN_OPSET = 1
"""The oldest ``ai.onnx`` opset a graph can be traced at: any (imported models keep their own;
ONNX Runtime runs opset 6 models with a warning). The ops target 13+ and emit older attribute
forms below it; an operator ONNX lacks at the graph's opset raises ``TraceError`` when emitted
(see :mod:`onnxparam.ops`)."""

DEFAULT_DOMAIN_VERSIONS = {"ai.onnx.ml": 3, "com.microsoft": 1}
"""Opset versions given to custom domains first used by a node, when not configured."""

CONSTANT_DEDUP_MAX_ELEMENTS = 64
"""Constants up to this many elements are shared when equal (scalars, shape vectors)."""


class Tracer:
    """An ONNX graph under construction; see the module docstring.

    Args:
        opset: the ``ai.onnx`` opset (default :data:`DEFAULT_OPSET`, at least :data:`MIN_OPSET`).
        opset_imports: versions of other domains (``{"ai.onnx.ml": 3}``); a ``""`` entry is
            used when ``opset`` is ``None``.
        mode: the LoRA mode, one of :data:`LORA_MODES`.
        root: the module whose traversal names the initializers (``None`` for eager op graphs).
        name: the graph name.
        passes: the :class:`~onnxparam.trace.passes.GraphPasses` to run (default: none, params held raw;
            the standard LoRA / QDQ passes: :data:`onnxparam.quant._passes.STANDARD_PASSES`).

    Raises:
        ValueError: for an opset below :data:`MIN_OPSET`.
        LoraError: an unknown LoRA mode (a ``ValueError`` too).
    """

    def __init__(self, *, opset: Optional[int] = None, opset_imports: Optional[Mapping[str, int]] = None,
                 mode: str = "merge", root=None, name: str = "main_graph", passes: Optional[GraphPasses] = None):
        imports = {str(k): int(v) for k, v in (opset_imports or {}).items()}
        if opset is None:
            opset = imports.get("", DEFAULT_OPSET)
        opset = int(opset)
        if opset < MIN_OPSET:
            raise ValueError(f"opset {opset} is not supported: onnxparam emits opset {MIN_OPSET} or newer")
        if mode not in TRACE_LORA_MODES:
            raise LoraError(f"unknown LoRA mode {mode!r}: expected one of {', '.join(map(repr, TRACE_LORA_MODES))} "
                            "(or lora=BatchedLora(...))")
        imports[""] = opset
        self.opset = opset
        self.opset_imports: dict[str, int] = imports
        self.mode = mode
        self.passes = NO_PASSES if passes is None else passes
        self.device = CPU
        self.graph = ir.Graph([], [], nodes=[], name=name)
        self._sinks: list[ir.Graph] = [self.graph]
        self._names: set[str] = set()
        self._scopes: list[str] = [""]
        self._param_paths: dict[int, str] = {}
        self._param_order: dict[str, int] = {}
        self._module_paths: dict[int, str] = {}
        self._param_tensors: dict[int, Tensor] = {}
        self._params: dict[str, Param] = {}
        self._param_values: dict[str, ir.Value] = {}
        self._constants: list[ir.Value] = []
        self._const_cache: dict = {}
        self._dims: dict[str, SymInt] = {}
        self.min_dynamic_size = 0  # dynamic input dims are at least this (2 under automatic dynamic)
        self._keepalive: list = []
        self._baked: list = []  # concrete tensors made constants (guards.uncovered_tensors)
        self.lift = None  # lift(tracer, tensor) -> a graph input standing for it, or None (bake it)
        self._finished = False
        self._root = root
        if root is not None:
            self._register_tree(root, "", root=True)

    # -- context ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def active(self):
        """Make this tracer current: ops emit nodes into it, params become its initializers."""
        tracer_token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(tracer_token)

    # -- names and scopes ---------------------------------------------------------------------

    def unique_name(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2`` ... : a name no other value or node has."""
        name = base
        k = 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def _register_tree(self, module, prefix: str, root: bool = False) -> None:
        from ..core.module import named_modules, named_params

        offset = len(self._param_order)
        for i, (path, param) in enumerate(named_params(module, prefix)):
            if id(param) in self._param_paths:
                continue
            if not root:
                path = self.unique_name(path) if path in self._names else path
            self._param_paths[id(param)] = path
            self._param_order[path] = offset + i
            self._names.add(path)
            self._keepalive.append(param)
        for path, sub in named_modules(module, prefix):
            self._module_paths.setdefault(id(sub), path)
            self._keepalive.append(sub)

    def module_scope(self, module) -> str:
        """The node-name scope of a sub-module (``/conv1/conv``); modules outside the root's
        tree are named by type (``/Linear``, ``/Linear_1``) and their params registered."""
        path = self._module_paths.get(id(module))
        if path is None:
            path = self.unique_name(type(module).__name__)
            self._register_tree(module, path)
        return "/" + path.replace(".", "/") if path else ""

    @contextlib.contextmanager
    def scope(self, module):
        """Name the nodes emitted inside after ``module``'s path."""
        self._scopes.append(self.module_scope(module))
        try:
            yield
        finally:
            self._scopes.pop()

    def call_module(self, module, args, kwargs):
        """Inline ``module.forward(*args, **kwargs)`` into this graph (``Module.__call__``
        inside a trace)."""
        with self.scope(module):
            return module.forward(*args, **kwargs)

    # -- values -------------------------------------------------------------------------------

    def _symbolic(self, value: ir.Value, dtype: DType, shape, param: Optional[Param] = None) -> Tensor:
        if shape is None:  # an unknown rank (see Tensor.shape)
            return Tensor(symbol=Symbol(value, self, param), shape=None, dtype=dtype, device=self.device)
        dims = tuple(d if isinstance(d, (int, SymInt)) else self.dim_symbol(d, value, i) for i, d in enumerate(shape))
        for d in dims:
            if isinstance(d, SymInt) and d.name is not None and d.tracer is self:
                self._dims.setdefault(d.name, d)
        return Tensor(symbol=Symbol(value, self, param), shape=dims, dtype=dtype, device=self.device)

    def dim_symbol(self, name: Optional[str], value: ir.Value, axis: int) -> SymInt:
        """The :class:`~onnxparam.trace.symint.SymInt` of the dynamic dim ``name`` (one per name in a
        trace; first seen as dim ``axis`` of ``value``, which lowers it), or a new unnamed one
        for dim ``axis`` of ``value`` when ``name`` is ``None``."""
        if name is not None:
            name = str(name)
            hit = self._dims.get(name)
            if hit is not None:
                return hit
        lo = 0
        if _is_input_value(value, self._sinks):
            origin = f"dim {axis} of input {value.name!r}"
            lo = self.min_dynamic_size
        else:
            producer = value.producer()
            origin = f"dim {axis} of {value.name!r}" + (f" ({producer.op_type})" if producer is not None else "")
        sym = SymInt.leaf(self, name, value, axis, origin, lo)
        if name is not None:
            self._dims[name] = sym
        return sym

    @staticmethod
    def _annotate(value: ir.Value, dtype: DType, shape) -> None:
        value.type = ir.TensorType(_ir_dtype(dtype))
        value.shape = None if shape is None else ir.Shape(_dims_of(shape))

    def input(self, name: str, shape, dtype: DType, *, unique: bool = False) -> Tensor:
        """A new input of the graph being built (the main graph, or the current subgraph).

        Raises:
            TraceError: when ``name`` is taken (by a param path or another value) and ``unique``
                is false; with ``unique`` a suffix is added instead.
        """
        name = str(name)
        if unique:
            name = self.unique_name(name)
        elif name in self._names:
            raise TraceError(f"graph input name {name!r} is already used (by a param path or another input)")
        else:
            self._names.add(name)
        value = ir.Value(name=name)
        self._annotate(value, dtype, shape)
        self._sinks[-1].inputs.append(value)
        return self._symbolic(value, dtype, shape)

    def constant(self, array, name: Optional[str] = None) -> Tensor:
        """A constant (an initializer holding ``array``'s values) as a symbolic tensor."""
        arr = np.asarray(array)
        arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(arr.shape)
        dtype = DType.from_numpy(arr.dtype)
        key = None
        if arr.size <= CONSTANT_DEDUP_MAX_ELEMENTS:
            key = (arr.dtype.str, arr.shape, arr.tobytes())
            hit = self._const_cache.get(key)
            if hit is not None:
                return hit
        value = ir.Value(name=self.unique_name(name or "const"), const_value=ir.tensor(arr))
        self._annotate(value, dtype, arr.shape)
        self._constants.append(value)
        tensor = self._symbolic(value, dtype, arr.shape)
        if key is not None:
            self._const_cache[key] = tensor
        return tensor

    def tensor_of(self, x) -> Tensor:
        """``x`` as a symbolic tensor of this graph: symbolic tensors as they are, concrete
        tensors and arrays as constants.

        Raises:
            TraceError: for a symbolic tensor of another trace.
            TypeError: for anything else.
        """
        if isinstance(x, Tensor):
            symbol = x._symbol
            if symbol is not None:
                if symbol.tracer is not self:
                    raise TraceError(
                        f"{x!r} belongs to another trace (a tensor kept from an earlier forward?): "
                        "pass values into forward as arguments instead"
                    )
                return x
            hit = self._const_cache.get(("tensor", id(x)))
            if hit is None and self.lift is not None and len(self._sinks) == 1:
                hit = self.lift(self, x)
                if hit is not None:
                    self._const_cache[("tensor", id(x))] = hit
                    self._keepalive.append(x)
            if hit is None:
                hit = self.constant(x.to_numpy())
                self._const_cache[("tensor", id(x))] = hit
                self._keepalive.append(x)
                self._baked.append(x)
            return hit
        if isinstance(x, np.ndarray):
            return self.constant(x)
        if isinstance(x, SymInt):
            return x.scalar()
        raise TypeError(f"expected a Tensor or a numpy array, got {type(x).__name__}")

    def value_of(self, x) -> ir.Value:
        """The ``onnx_ir.Value`` of ``x`` in this graph (see :meth:`tensor_of`)."""
        if isinstance(x, ir.Value):
            return x
        return self.tensor_of(x)._symbol.value

    def param_value(self, param: Param) -> Tensor:
        """The value hook: ``param``'s initializer as a symbolic tensor (one per param)."""
        hit = self._param_tensors.get(id(param))
        if hit is not None:
            return hit
        path = self._param_paths.get(id(param))
        if path is None:
            scope = self._scopes[-1].strip("/").replace("/", ".")
            path = self.unique_name(f"{scope}.param" if scope else "param")
            self._param_paths[id(param)] = path
        dtype = param.lazy_dtype()
        if dtype is DType.QFloat:
            # the QDQ pass: integer initializer + scale -> DequantizeLinear, or the float dtype
            # holding the dequantized values (a scheme ONNX cannot express; the pass warns)
            emitted = (self.passes.quantized_param(self, param, path, tuple(param.lazy_shape()))
                       if self.passes.quantized_param is not None else DType.F32)
            if isinstance(emitted, Tensor):
                self._param_tensors[id(param)] = emitted
                return emitted
            dtype = emitted
        try:
            shape = tuple(param.lazy_shape())
        except ValueError:  # a lazy param declared without a shape: its value is the only source
            shape = tuple(param_array(param, dtype).shape)
        held = self.passes.held_param(param, self.mode)  # LoRA: the raw base unless "merge"
        lazy = ir.LazyTensor(functools.partial(_lazy_initializer, held, dtype), _ir_dtype(dtype),
                             ir.Shape(list(shape)), name=path)
        value = ir.Value(name=path, const_value=lazy)
        self._annotate(value, dtype, shape)
        self._names.add(path)
        self._params[path] = held
        self._param_values[path] = value
        tensor = self._symbolic(value, dtype, shape, param)
        self._param_tensors[id(param)] = tensor
        return tensor

    # -- nodes --------------------------------------------------------------------------------

    def require_domain(self, domain: str, version: Optional[int] = None) -> int:
        """Import ``domain`` (at ``version``, or the default) and return its version."""
        domain = domain or ""
        have = self.opset_imports.get(domain)
        if have is None:
            have = int(version) if version is not None else DEFAULT_DOMAIN_VERSIONS.get(domain, 1)
            self.opset_imports[domain] = have
        elif version is not None and int(version) != have:
            raise TraceError(f"domain {domain!r} is imported at version {have}; a node asks for {version}")
        return have

    def emit(self, op_type: str, inputs: Sequence, attributes: Optional[Mapping[str, Any]] = None, *,
             domain: str = "", num_outputs: int = 1, output_types: Optional[Sequence] = None,
             output_hints: Optional[Sequence] = None, name: Optional[str] = None) -> list[Tensor]:
        """Append one node and return its outputs as symbolic tensors.

        Args:
            op_type: the ONNX operator (``"MatMul"``).
            inputs: tensors / arrays (constants), ``onnx_ir.Value`` s, or ``None`` for a missing
                optional input.
            attributes: name -> value (see :func:`_to_attr`); ``None`` values are left out.
            domain: the operator set domain (``""`` = ``ai.onnx``).
            num_outputs: how many outputs the node has.
            output_types: ``[(DType, shape), ...]`` to skip shape inference.
            output_hints: ``[(DType or None, shape or None), ...]``: the given parts override
                (and, where inference cannot tell, complete) what shape inference finds.
            name: the node name's base (default ``op_type``), prefixed with the module scope.

        Raises:
            TraceError: when ONNX shape inference rejects the node (its message is included) or
                cannot type an output.
        """
        values = [None if x is None else self.value_of(x) for x in inputs]
        attrs = [_to_attr(k, v) for k, v in (attributes or {}).items() if v is not None]
        version = self.require_domain(domain)
        if output_types is not None and not domain and not onnx.defs.has(op_type, version):
            raise TraceError(f"ONNX has no operator {op_type!r} at opset {version} (this graph's opset)")
        node_name = self.unique_name(f"{self._scopes[-1]}/{name or op_type}")
        node = ir.Node(domain, op_type, values, attrs, num_outputs=num_outputs, name=node_name)
        for i, out in enumerate(node.outputs):
            out.name = self.unique_name(f"{node_name}_output_{i}")
        if output_types is None and output_hints is not None:
            if len(output_hints) != num_outputs:
                raise TraceError(f"{node_name}: {len(output_hints)} output hints given for {num_outputs} outputs")
            if all(d is not None and s is not None for d, s in output_hints):
                output_types = output_hints
        if output_types is None:
            output_types = infer_node_types(node, values, self.opset_imports, output_hints)
        elif len(output_types) != num_outputs:
            raise TraceError(f"{node_name}: {len(output_types)} output types given for {num_outputs} outputs")
        outputs = []
        for out, (dtype, shape) in zip(node.outputs, output_types):
            dtype = DType(dtype) if not isinstance(dtype, int) else _dtype_from_onnx(dtype, node_name)
            self._annotate(out, dtype, shape)
            outputs.append(self._symbolic(out, dtype, shape))
        self._sinks[-1].append(node)
        return outputs

    # -- subgraphs ------------------------------------------------------------------------------

    def subgraph(self, fn: Callable, inputs: Sequence = (), *, name: Optional[str] = None) -> ir.Graph:
        """Trace ``fn(*input_tensors)`` into a new ``onnx_ir.Graph`` for a graph attribute
        (``If``'s branches, ``Loop``'s / ``Scan``'s body).

        Tensors of the enclosing graphs (and params) used inside ``fn`` become outer-scope
        references, as ONNX allows. ``inputs`` are :class:`InputSpec` s (or tensors whose shape
        and dtype are taken); ``fn`` returns a tensor or a sequence of tensors.
        """
        graph = ir.Graph([], [], nodes=[], name=self.unique_name(name or "subgraph"))
        self._sinks.append(graph)
        try:
            args = []
            for i, spec in enumerate(inputs):
                spec = _as_spec(spec)
                base = spec.name or f"{graph.name}_input_{i}"
                args.append(self.input(base, spec.shape, spec.dtype, unique=True))
            result = fn(*args)
            outs = list(result) if isinstance(result, (tuple, list)) else [result]
            for out in outs:
                graph.outputs.append(self._local_output(out, graph))
        finally:
            self._sinks.pop()
        return graph

    def _local_output(self, x, graph: ir.Graph) -> ir.Value:
        """A value produced inside ``graph`` for ``x`` (an ``Identity`` when ``x`` comes from
        outside, is an input or is already an output)."""
        if not isinstance(x, (Tensor, np.ndarray)):
            raise TraceError(f"a traced graph can only return tensors; got {type(x).__name__}")
        t = self.tensor_of(x)
        value = t._symbol.value
        producer = value.producer()
        if producer is None or producer.graph is not graph or value in graph.outputs:
            t = self.emit("Identity", [t], output_types=[(t.dtype, t._shape)])[0]
            value = t._symbol.value
        return value

    # -- finishing ----------------------------------------------------------------------------

    def finish(self, outputs, output_names: Optional[Sequence[str]] = None,
               dynamic_axes: Optional[Mapping] = None, input_names: Sequence[str] = ()) -> "TracedModel":
        """Close the graph: ``outputs`` (a tensor or a sequence of tensors) become its outputs,
        named ``output_names`` (default ``output`` / ``output_0``, ``output_1`` ...), the
        initializers are registered (params in traversal order, then constants).

        Raises:
            TraceError: for outputs that are not tensors, or clashing output names.
        """
        return finish_trace(self, outputs, output_names, dynamic_axes, input_names)


def trace_module(module, inputs=(), *, kwargs: Optional[Mapping[str, Any]] = None,
                 input_names: Optional[Sequence[str]] = None, output_names: Optional[Sequence[str]] = None,
                 dynamic_axes: Optional[Mapping] = None, opset: Optional[int] = None,
                 opset_imports: Optional[Mapping[str, int]] = None, lora: str = "merge",
                 passes: Optional[GraphPasses] = None, min_dynamic_size: int = 0,
                 dynamic_batch: "bool | str" = False, guard: bool = False) -> TracedModel:
    """Trace ``module.forward`` into an ONNX model.

    Args:
        module: the root :class:`~onnxparam.Module`; its traversal names the initializers.
        inputs: the positional arguments: one, or a tuple / list of them. Tensors, arrays and
            :class:`InputSpec` s become graph inputs (only shapes and dtypes are used); anything
            else (ints, flags ...) is passed to ``forward`` unchanged and baked into the graph.
        kwargs: keyword arguments of ``forward``; tensors among them become inputs named by key.
        input_names: names of the graph inputs (default: ``forward``'s parameter names, or an
            :class:`InputSpec`'s ``name``).
        output_names: names of the graph outputs (default ``output``, or ``output_0`` ...).
        dynamic_axes: ``{input_or_output_name_or_input_index: {axis: dim_name} | [axis, ...]}``
            (as in ``torch.onnx.export``): those dims become symbolic
            (:class:`~onnxparam.trace.symint.SymInt` s inside ``forward``). A declared output dim that
            the forward makes a constant raises ``TraceError`` naming the node.
        dynamic_batch: the shorthand "dim 0 of every tensor input and output is the batch":
            ``True`` (named ``"batch"``) or the dim's name. Each output's dim 0 must be that
            size (else ``TraceError`` naming the output and, for a constant, the node).
        opset: the ``ai.onnx`` opset; default: the module's ``onnx_opset_imports[""]`` if it
            declares one (an imported ONNX model keeps its opsets), else :data:`DEFAULT_OPSET`.
        opset_imports: versions of other domains (default: the module's
            ``onnx_opset_imports``).
        lora: the LoRA mode, one of :data:`LORA_MODES`.
        passes: the :class:`~onnxparam.trace.passes.GraphPasses` to run (default: none, params held raw;
            the standard LoRA / QDQ passes: :data:`onnxparam.quant._passes.STANDARD_PASSES`).
        min_dynamic_size: the size every dynamic input dim is known to be at least (its
            :class:`~onnxparam.trace.symint.SymInt`'s lower bound: with 2, ``x.shape[0] == 1`` is
            decided ``False``; the runtime's automatic dynamic uses 2 and runs sizes 0 and 1 on
            concrete traces).
        guard: record in ``traced._cache["guards"]`` the :mod:`onnxparam.trace.guards` of the
            globals / closure values the forward reads (the runtime's caches check them), and
            warn (``CaptureWarning``) for a baked outside tensor no guard watches.

    Returns:
        a :class:`TracedModel`.

    Raises:
        TraceError: when ``forward`` does something that cannot be recorded (data-dependent
            Python control flow, reading values, a node ONNX rejects).
        ValueError: for an unsupported opset or LoRA mode.
    """
    args = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    kwargs = dict(kwargs or {})
    arguments = args + list(kwargs.values())
    declared = dict(getattr(module, "onnx_opset_imports", None) or {})
    declared.update(opset_imports or {})
    tracer = Tracer(opset=opset, opset_imports=declared, mode=lora, root=module, passes=passes)
    tracer.min_dynamic_size = int(min_dynamic_size)
    positions = [i for i, a in enumerate(args) if _is_input(a)]
    keys = [k for k, v in kwargs.items() if _is_input(v)]
    default_names = _forward_arg_names(module, len(args))
    names = []
    for i in positions:
        spec_name = args[i].name if isinstance(args[i], InputSpec) else None
        names.append(spec_name or default_names[i])
    names += keys
    if input_names is not None:
        input_names = [str(n) for n in input_names]
        if len(input_names) != len(names):
            raise TraceError(f"{len(input_names)} input names given for {len(names)} tensor inputs")
        names = input_names
    else:  # a default name clashing with a param path gets a suffix: x -> x_input
        taken = set(tracer._names)
        names = [n if n not in taken else f"{n}_input" for n in names]
    axes_by_input: dict = {}
    batch = None if dynamic_batch is False or dynamic_batch is None else \
        "batch" if dynamic_batch is True else str(dynamic_batch)
    if batch is not None:
        for name, x in zip(names, [args[i] for i in positions] + [kwargs[k] for k in keys]):
            if len(_as_spec(x).shape) >= 1:
                axes_by_input[name] = {0: batch}
    for key, axes in (dynamic_axes or {}).items():
        if isinstance(key, int):
            key = names[key]
        axes_by_input[key] = axes
    with tracer.active():
        symbolic = []
        for name, x in zip(names, [args[i] for i in positions] + [kwargs[k] for k in keys]):
            spec = _as_spec(x)
            dims = list(spec.shape)
            for axis, dim in _axes_items(axes_by_input.get(name, {}), name):
                dims[axis] = dim
            symbolic.append(tracer.input(name, dims, spec.dtype))
        for i, t in zip(positions, symbolic):
            args[i] = t
        for k, t in zip(keys, symbolic[len(positions):]):
            kwargs[k] = t
        try:
            outputs = module.forward(*args, **kwargs)
        except OnnxParamError:
            raise
        except (TypeError, ValueError) as e:
            # NOTE: ops check their operands with the builtin errors; a user calling a module
            # gets one of the library's errors (still a TypeError / ValueError), naming the module.
            kind = TraceTypeError if isinstance(e, TypeError) else TraceValueError
            raise kind(f"tracing {type(module).__name__}.forward: {e}") from e
        traced = tracer.finish(outputs, output_names, dynamic_axes, input_names=names)
    if guard:
        from .guards import trace_guards

        traced._cache["guards"] = trace_guards(tracer, (), f"{type(module).__name__}.forward",
                                               arguments)
    if batch is not None:
        check_batch_outputs(traced, batch)
    return traced


def subgraph(fn: Callable, inputs: Sequence = (), *, name: Optional[str] = None) -> ir.Graph:
    """Trace ``fn`` into a subgraph of the current trace (for ``If``/``Loop``/``Scan``
    attributes of :func:`onnxparam.ops._custom`); see :meth:`Tracer.subgraph`.

    Raises:
        TraceError: outside a trace.
    """
    tracer = current_tracer()
    if tracer is None:
        raise TraceError("subgraph() builds part of a traced graph: call it inside a forward being traced")
    return tracer.subgraph(fn, inputs, name=name)
