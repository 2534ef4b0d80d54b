"""Importing an ONNX model as a module: :func:`import_onnx` -> :class:`OnnxModule`.

Every weight of the model (:mod:`~onnxparam.onnx_io._weights`: initializers of every graph,
initializers that are also graph inputs, weights held in ``Constant`` nodes) becomes a lazy
:class:`~onnxparam.Param` at the module path of its name (:mod:`~onnxparam.onnx_io._naming`).
Paths build the module tree: ``conv2d_0.w_0`` is the param ``w_0`` of the sub-module
``conv2d_0`` (an :class:`OnnxScope`). A path that is both a param and the prefix of another
(``a`` and ``a.b``) keeps the longer one as a dotted attribute (``getattr(scope, "a.b")``) at
the level of the conflict, so every param keeps its exact path.

Nothing is read at import: params are ``Param.uninitialized`` with a loader that returns a
zero-copy view of the tensor (memory-mapped from the external data file for external tensors).
Param ids and trainable flags recorded by onnxparam (:mod:`~onnxparam.onnx_io._metadata`) are
taken; other params get a fresh random id, and float params require grad.

The graph is the model: the module keeps its source graph verbatim, and ``module(x)`` outside a
trace runs that graph in ONNX Runtime with the params bound to its weights
(:mod:`~onnxparam.onnx_io._graph_run`): no operator needs a schema, no value a known rank or a
Burn dtype (strings, float8, sequences, optionals, maps pass through), and one session serves
every input shape the graph's dims allow. :func:`~onnxparam.onnx_io.export_onnx` writes the same
graph back (:mod:`~onnxparam.onnx_io._graph_model`).

Inside a trace (an imported module used by another module's ``forward``),
:meth:`OnnxModule.forward` re-emits the graph's nodes through :func:`onnxparam.ops._custom` at
the model's opset versions (:attr:`OnnxModule.onnx_opset_imports`), control flow bodies cloned
with their outer-scope references and weights rewired to the traced values
(:mod:`~onnxparam.onnx_io._bodies`). Output ranks come from ONNX shape inference, else the file
or a probe run (:mod:`~onnxparam.onnx_io._probe`), else stay unknown (see
:class:`~onnxparam.Tensor`); nodes whose outputs are sequences, optionals or maps are copied
as they are (:mod:`~onnxparam.onnx_io._opaque`); the inputs of a graph with control flow are
given the file's declared types (:mod:`~onnxparam.onnx_io._boundary`). For this path only,
model-local functions are inlined and ``DequantizeLinear`` weights folded into ``QFloat``
params in a working copy of the graph (the source stays as it came in).

Sibling subgraphs may hold weights of the same name (the later one's path gets a ``__1``
suffix, see :func:`~onnxparam.onnx_io._weights.find_weights`); sparse initializers import as
dense weights of the same name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import onnx_ir as ir

from ..core.device import CPU
from ..core.errors import CallArgumentError, OnnxFormatError, TraceError
from ..core.module import Module, named_params
from ..core.param import Param, ParamId
from ..core.tensor import Tensor
from ..quant import _qdq_import
from . import _metadata as md
from ._bodies import wired_subgraph
from ._graph_model import copy_model
from ._naming import onnx_name_to_path
from ._node_rules import (
    _constant_array,
    _has_schema,
    _infer_source_types,
    _rank_rule,
    _since,
    _used_outputs,
)
from ._op_registry import model_opsets
from ._opaque import emit_opaque, opaque_node
from ._probe import probed_types
from ._records import site_metadata
from ._source import LoadedModel, base_dir_of, iter_graphs, load_model, topological_nodes
from ._sparse import load_densified
from ._weights import CONSTANT, WeightSite, burn_dtype, feeds_quantized_weight, find_weights, tensor_data

__all__ = ["OnnxModule", "OnnxScope", "import_onnx"]

_CUSTOM_KEYWORDS = frozenset({"op_type", "domain", "num_outputs", "output_dtypes", "output_shapes"})
"""Keyword names of :func:`onnxparam.ops._custom`; a node attribute with one of these names is
emitted through the tracer directly."""


class OnnxScope(Module):
    """A scope of an imported model's names (``conv2d_0`` in ``conv2d_0.w_0``): holds the next
    path segments as sub-scopes and params. It has no forward of its own; run the root
    :class:`OnnxModule`."""

    def forward(self, *args, **kwargs):
        raise TraceError("an OnnxScope only groups params of an imported ONNX model; call the OnnxModule itself")


def _lazy_param(site: WeightSite, meta: md.ParamMetadata, table: bool = False) -> Param:
    quantized = _qdq_import.imported_param(site, meta)
    if quantized is not None:
        return quantized
    pid = meta.param_id if meta.param_id is not None else ParamId()
    require_grad = (meta.require_grad if meta.require_grad is not None
                    else site.dtype.is_float and not site.dtype.is_onnx_only and not table
                    and not feeds_quantized_weight(site.value))  # a quantized weight's scale is not trained

    def init(device, require_grad, _tensor=site.tensor, _dtype=site.dtype):
        return Tensor.from_data(tensor_data(_tensor, _dtype), None if device == CPU else device)

    return Param.uninitialized(pid, init, CPU, require_grad, site.shape, site.dtype)


def _build_tree(root: Module, entries: list[tuple[str, Param]]) -> None:
    """Place each ``(path, param)`` under ``root`` as nested :class:`OnnxScope` s (module docstring)."""
    param_paths = {path for path, _ in entries}
    for path, param in entries:
        segments = path.split(".")
        node = root
        i = 0
        while i < len(segments) - 1:
            prefix = ".".join(segments[:i + 1])
            if prefix in param_paths:
                break  # a param sits at this prefix: keep the rest as one dotted key here
            child = vars(node).get(segments[i])
            if child is None:
                child = OnnxScope()
                object.__setattr__(node, segments[i], child)
            node = child
            i += 1
        object.__setattr__(node, ".".join(segments[i:]), param)


def _dims(value: ir.Value) -> Optional[tuple]:
    """The declared dims (ints, ``str`` for named dynamic dims, ``None`` for unnamed ones; some
    exporters write ``-1`` for a dynamic dim, read as ``None``)."""
    if value.shape is None:
        return None
    return tuple((d if d >= 0 else None) if isinstance(d, int) else (d.value or None) for d in value.shape)


def _shape_text(shape) -> list:
    """A traced tensor's shape for a message: a symbolic dim as its name (``'batch'``), not its
    repr; ``'?'`` for an unnamed one."""
    return [int(d) if isinstance(d, (int, np.integer)) else d if isinstance(d, str) else
            (getattr(d, "name", None) or "?") for d in shape]


def check_input_value(value: ir.Value, x, free_axes=()) -> None:
    """The check ``module(x)`` makes of a value given for graph input ``value``: a
    :class:`~onnxparam.Tensor`, a numpy array or an ``InputSpec`` (an export's example) has the
    element type and rank the graph declares, and every static dim (except the axes in
    ``free_axes``: an export's ``dynamic_axes``); other values are left to the run.

    Raises:
        CallArgumentError: naming the graph input, what it takes and what was given.
    """
    from ..core.dtype import DType

    if isinstance(x, np.ndarray):
        if not isinstance(value.type, ir.TensorType):
            return
        _check_array_dtype(value, x)
        shape, given = x.shape, None
    elif isinstance(x, Tensor):
        shape, given = (x.shape if x.rank_known else None), x.dtype
    elif isinstance(getattr(x, "dtype", None), DType) and isinstance(getattr(x, "shape", None), tuple):
        shape, given = x.shape, x.dtype  # an InputSpec
    else:
        return
    if value.dtype is None:
        return
    want = burn_dtype(value.dtype)
    if given is not None and want is not None and given is not want:
        raise CallArgumentError(f"graph input {value.name!r} takes {want.name} values, got {given.name}")
    dims = _dims(value)
    if dims is not None and shape is not None and (len(dims) != len(shape) or any(
            isinstance(d, int) and isinstance(g, (int, np.integer)) and d != g and axis not in free_axes
            for axis, (d, g) in enumerate(zip(dims, shape)))):
        raise CallArgumentError(f"graph input {value.name!r} takes shape {list(dims)}, got {_shape_text(shape)}")


def check_example_inputs(module, examples, dynamic_axes=None, input_names=None) -> None:
    """An export's example inputs of an imported module get the check ``module(x)`` makes of
    its inputs (:func:`check_input_value`): their count, element types, ranks and static dims
    (the axes ``dynamic_axes`` names for an input are free).

    Raises:
        CallArgumentError: naming the example's position, the graph input and the mismatch.
    """
    required = list(module._source.inputs)
    if not examples:
        return
    if len(examples) != len(required):
        raise CallArgumentError(f"the ONNX graph takes {len(required)} input(s) "
                                f"({', '.join(v.name for v in required)}); {len(examples)} example input(s) were given")
    names = list(input_names) if input_names is not None else [v.name for v in required]
    for i, (value, x) in enumerate(zip(required, examples)):
        axes = {}
        for key in (i, names[i] if i < len(names) else value.name, value.name):
            if isinstance(dynamic_axes, dict) and key in dynamic_axes:
                axes = dynamic_axes[key]
                break
        free = {int(a) for a in axes}
        try:
            check_input_value(value, x, free)
        except CallArgumentError as e:
            raise CallArgumentError(f"example input {i} of the export: {e} (module(x) refuses it too)") from None


def _check_array_dtype(value: ir.Value, array) -> None:
    """A numpy array given for graph input ``value`` has the element type the graph declares
    (else ONNX Runtime's "Unexpected input data type" would name no input)."""
    try:
        want = np.dtype(value.type.dtype.numpy())
        got = np.dtype(array.dtype)
    except (TypeError, ValueError, AttributeError):
        return  # a type numpy does not name (strings, float8 ...): left to ONNX Runtime
    if got != want and got.kind in "biufc" and want.kind in "biufc":
        raise CallArgumentError(f"graph input {value.name!r} takes {value.type.dtype.name} (numpy {want.name}) values, "
                                f"got a numpy array of {got.name}; cast it first: x.astype(np.{want.name})")


def _find_tables(model: ir.Model, sites) -> dict:
    """``path -> reason`` for the float weights that are tables (frozen at import; see
    :mod:`onnxparam.autodiff._tables`)."""
    from ..autodiff._tables import find_scalar_constants, find_tables, is_marked_parameter

    # 0-d float initializers (every graph): an exporter's constants are frozen, parameters not
    scalars = [s for s in sites if s.dtype.is_float and not s.dtype.is_onnx_only and s.shape == ()
               and s.kind != CONSTANT]
    constants = find_scalar_constants(model, [(s.name, s.value) for s in scalars])
    tables = {s.path: constants[s.name] for s in scalars if s.name in constants}
    # NOTE: the graph walks of find_tables only for what is still undecided (a dynamo or
    # TorchScript file may hold hundreds of scalars); a marked parameter (any rank) is never a
    # table, a marked buffer always is (find_tables, rule 0)
    floats = [s for s in sites if s.dtype.is_float and not s.dtype.is_onnx_only and s.graph is model.graph
              and s.path not in tables and not is_marked_parameter(s.value)]
    found = find_tables(model, [(s.name, s.value, s.tensor, s.kind == CONSTANT) for s in floats])
    tables.update({s.path: found[s.name] for s in floats if s.name in found})
    return tables


class _SourceGraph:
    """What an :class:`OnnxModule` knows about its source model (immutable once built, shared
    by every copy of the module; compared by identity)."""

    def __init__(self, loaded: LoadedModel, pristine: ir.Model):
        model = loaded.model
        self.pristine = pristine  # the model as it came in: what runs and what an export writes
        graph = model.graph
        self.loaded = loaded
        self.sites: tuple = tuple(find_weights(model, loaded.source))
        self.const_nodes = frozenset(id(site.node) for site in self.sites if site.kind == CONSTANT)
        self.order = tuple(topological_nodes(graph))
        self.inputs = tuple(v for v in graph.inputs if not v.is_initializer())
        # NOTE: IR < 4 made every initializer a graph input; ONNX Runtime treats those as
        # constants (not overridable), and so does this module.
        self.overrides = tuple(v for v in graph.inputs if v.is_initializer()) if model.ir_version >= 4 else ()
        self.opsets = model_opsets(model)  # as ONNX Runtime runs it (see _op_registry)
        self.names = {site.path: site.name for site in self.sites}
        self.tables = _find_tables(model, self.sites)
        self.cache: dict = {}  # facts derived lazily from the source (shape inference)
        self.cells: dict = {}  # path -> the lazy cell each param was imported with

    def __deepcopy__(self, memo) -> "_SourceGraph":
        # NOTE: shared, never copied (immutable once built; compared by identity, so a deep copy
        # of a module keeps its cached sessions' structure key); its model may hold a file
        # mapping, which cannot be copied, and is never written (in-place steps write only
        # optimizer-owned arrays)
        return self

    def __copy__(self) -> "_SourceGraph":
        return self


class OnnxModule(Module):
    """An ONNX model as a module; see the module docstring. Build with :func:`import_onnx`.

    Call it with the graph inputs positionally in graph order or by name as keywords
    (``module(x)``, ``module(**{"gpu_0/data_0": x})``); initializers that are also graph inputs
    may be passed by name too, overriding their param. One graph output returns a
    :class:`~onnxparam.Tensor`, several a tuple.
    """

    def __init__(self, loaded: LoadedModel, pristine: Optional[ir.Model] = None):
        if pristine is None:
            pristine = loaded.model
            if _qdq_import.has_foldable_nodes(pristine):
                loaded = LoadedModel(copy_model(pristine), loaded.source, loaded.path)
        # DequantizeLinear(int initializer) -> one QFloat weight (in the working copy only)
        _qdq_import.fold_dequantize_weights(loaded.model)
        source = _SourceGraph(loaded, pristine)
        metas = site_metadata(loaded.model, list(source.sites), loaded.source)
        entries = [(site.path, _lazy_param(site, metas.get(site.name, md.ParamMetadata()), site.path in source.tables))
                   for site in source.sites]
        _build_tree(self, entries)
        source.cells = {path: param._cell for path, param in entries}
        # NOTE: one private attribute holding everything derived from the source: copies made
        # by transforms share it, and the runtime's structure key sees one identity-hashed
        # object instead of walking tables.
        self._source = source

    # -- what the model is ----------------------------------------------------------------------

    @property
    def onnx_opset_imports(self) -> dict:
        """The model's opset imports (``{"": 15, "ai.onnx.ml": 2}``); the tracer emits the graph
        at these versions."""
        return dict(self._source.opsets)

    @property
    def input_names(self) -> tuple:
        """The graph inputs a call must give, in graph order (original ONNX names)."""
        return tuple(v.name for v in self._source.inputs)

    @property
    def override_names(self) -> tuple:
        """Initializers that are also graph inputs: optional keyword arguments of a call."""
        return tuple(v.name for v in self._source.overrides)

    @property
    def output_names(self) -> tuple:
        """The graph outputs (original ONNX names)."""
        return tuple(v.name for v in self._source.loaded.model.graph.outputs)

    @property
    def onnx_tables(self) -> dict:
        """Module path -> why, for the float weights recognized as tables rather than weights
        (rotary / position frequency tables, masks, one-element graph constants: what PyTorch
        held as buffers or constants; :mod:`onnxparam.autodiff._tables`). They are imported
        with ``require_grad=False``, so :func:`~onnxparam.autodiff.grad` leaves them alone;
        ``module.unfreeze_group(ParamGroup.from_paths(module.onnx_tables))`` trains them too."""
        return dict(self._source.tables)

    @property
    def onnx_ties(self) -> dict:
        """Module path of an output projection -> ``(module path of the embedding table, transposed)``,
        for each pair the file itself ties: a main-graph ``MatMul`` / ``Gemm`` weight whose values
        equal, bit for bit, those of a table only ``Gather`` s read, transposed for a ``MatMul`` B
        (``onnxparam.lora._tables.tied_output_pairs``). PyTorch's exporters write a tied
        ``lm_head`` / ``wte`` (GPT-2's) so: the table (``m.lm_head.weight``, ``(vocab, dim)``) and
        its transposed copy (dynamo's ``val_N``, TorchScript's ``onnx::MatMul_N``, ``(dim, vocab)``).

        Both stay params (each keeps its path: LoRA, checkpoint loading and export address
        them as before), and they train as torch's one tied weight:
        :func:`~onnxparam.autodiff.grad` gives both the summed gradient (the table's
        ``g_table + g_projection^T``, the projection its transpose) while both require grad and
        still hold the same values, so the elementwise optimizers of :mod:`onnxparam.optim`
        keep them bit-equal and an export writes a tied model again. A pair whose values
        differ (a checkpoint loaded into one side) or with one side frozen trains as two params.
        As the file holds both, ``num_params`` and records count and store both (torch counts
        its tied weight once).
        """
        ties = self._source.cache.get("ties")
        if ties is None:
            from ..lora._tables import tied_output_pairs

            graph = self._source.loaded.model.graph
            by_name = {site.name: site.path for site in self._source.sites
                       if site.graph is graph and site.dtype.is_float and not site.dtype.is_onnx_only}
            ties = {by_name[head]: (by_name[table], bool(transposed))
                    for head, (table, transposed) in tied_output_pairs(self._source.loaded.model).items()
                    if head in by_name and table in by_name}
            self._source.cache["ties"] = ties
        return dict(ties)

    @property
    def onnx_folded_norms(self) -> dict:
        """Module path -> evidence, for the weights and biases that hold a BatchNorm the exporter
        folded into them: the ``Conv`` / ``ConvTranspose`` / ``Gemm`` nodes onnxscript's rewriter
        (torch's dynamo exporter) tagged ``pkg.onnxscript.rewriter.rule_name`` =
        ``FuseBatchNormIntoConv`` / ``...ConvTranspose`` / ``...Gemm``
        (:mod:`onnxparam.lora._folded_norms`; the tag only, never values or shapes). Such a
        ``conv.weight`` is torch's weight times the BatchNorm's per-channel scale, which the file
        does not hold: ``load_peft_adapter`` refuses a PEFT adapter on it and the PyTorch /
        safetensors loaders refuse torch's tensor for it; ``apply_lora`` adapts it as any weight."""
        folded = self._source.cache.get("folded_norms")
        if folded is None:
            from ..lora._folded_norms import folded_norm_weights

            found = folded_norm_weights(self._source.loaded.model)
            folded = {path: found[name] for path, name in self._source.names.items() if name in found}
            self._source.cache["folded_norms"] = folded
        return dict(folded)

    @property
    def onnx_names(self) -> dict:
        """Module path -> original ONNX name, for every param (the inverse of
        :func:`~onnxparam.onnx_io._naming.onnx_name_to_path` on these names)."""
        return dict(self._source.names)

    @property
    def ir_model(self) -> ir.Model:
        """The source ``onnx_ir.Model`` (shared by every copy of this module; do not modify)."""
        return self._source.loaded.model

    @property
    def source_path(self) -> Optional[Path]:
        """The file imported, or ``None`` for an in-memory model."""
        return self._source.loaded.path

    def path_of(self, name: str) -> str:
        """The module path of the weight named ``name`` in the ONNX model.

        Raises:
            KeyError: when the model has no weight of that name.
        """
        path = onnx_name_to_path(name)
        if path not in self._source.names:
            raise KeyError(f"the ONNX model has no weight named {name!r}")
        return path

    def param_of(self, name: str) -> Param:
        """The param holding the ONNX weight ``name`` (this module's current one)."""
        path = self.path_of(name)
        return dict(named_params(self))[path]

    def lora_weight_layouts(self) -> dict:
        """``path -> "in_out" | "out_in"`` (or why the graph does not decide) for each 2-d
        weight, from the nodes that consume it (``onnxparam.lora._layouts.weight_layouts``)."""
        from ..lora._layouts import weight_layouts

        layouts = weight_layouts(self._source.loaded.model)
        return {path: layouts[name] for path, name in self._source.names.items() if name in layouts}

    def lora_default_skips(self) -> dict:
        """``path -> reason`` of the 2-d weights the default (every-param) ``LoraConfig`` leaves
        without an adapter although they have a layout, as PEFT's defaults target linear layers
        only: tables ``Gather`` reads (position tables and embeddings of the inputs) and output
        projections tied to an embedding table (``onnxparam.lora._tables.default_lora_skips``)."""
        from ..lora._tables import default_lora_skips

        tables = default_lora_skips(self._source.loaded.model)
        return {path: tables[name] for path, name in self._source.names.items() if name in tables}

    def lora_transposed_paths(self) -> list:
        """Paths of the weights stored ``(d_out, d_in)``: used as ``Gemm`` B with ``transB=1``
        (and never as ``MatMul`` B); ``apply_lora`` gives them transposed adapters."""
        from ..lora._layouts import transposed_weight_names

        names = transposed_weight_names(self._source.loaded.model)
        return [path for path, name in self._source.names.items() if name in names]

    def input_specs(self) -> list:
        """:class:`~onnxparam.trace.tracer.InputSpec` s of the graph inputs (symbolic dims as in the file,
        unnamed dynamic dims as ``None``), for tracing without example inputs.

        Raises:
            TraceError: for an input of unknown rank, or of a type onnxparam tensors cannot hold.
        """
        from ..trace.tracer import InputSpec

        specs = []
        for v in self._source.inputs:
            dims = _dims(v)
            dtype = burn_dtype(v.dtype) if v.dtype is not None else None
            if dims is None or dtype is None:
                raise TraceError(
                    f"graph input {v.name!r} has "
                    + ("no declared shape" if dims is None else f"element type {v.dtype}")
                    + "; pass example inputs to export_onnx"
                )
            specs.append(InputSpec(tuple(None if d is None or d == "" else d for d in dims), dtype, v.name))
        return specs

    def extra_repr(self) -> str:
        src = self._source.loaded.path.name if self._source.loaded.path is not None else self._source.loaded.source
        opsets = ", ".join(f"{d or 'ai.onnx'}:{v}" for d, v in self._source.opsets.items())
        return f"{src}, opset {opsets}, {len(self._source.order)} nodes"

    # -- running ----------------------------------------------------------------------------

    def __call__(self, *inputs, **named):
        """``module(x)``: outside a trace, the source graph itself runs in ONNX Runtime
        (:mod:`~onnxparam.onnx_io._graph_run`); inside a trace (this module used by another's
        ``forward``), :meth:`forward` inlines the graph into the trace.

        Raises:
            CallArgumentError (a TypeError): for missing, unknown or duplicate inputs, or a wrong
                dtype / rank (named); an empty batch that would reach an ``LSTM`` / ``GRU`` node
                (ONNX Runtime ends the process on it: :mod:`~onnxparam.onnx_io._empty_batch`).
            ExecutionError: when ONNX Runtime cannot build or run the graph.

        Every error raised names the imported file (or the in-memory source) and, for a
        run-time failure, the node (:mod:`~onnxparam.runtime._source_errors`).
        """
        from ..runtime._source_errors import naming_source
        from ..trace import tracer as tr

        with naming_source(self):
            if named and "adapter_index" in named and tr.current_tracer() is None and \
                    all(v.name != "adapter_index" for v in self._source.inputs):
                from ..lora._batched_run import call_batched  # many LoRA adapters, one per row (issue 29)

                return call_batched(self, inputs, named)
            if tr.current_tracer() is None:
                from ._graph_run import _NO_SESSION, run_graph

                result = run_graph(self, self._bind(inputs, named))
                if result is not _NO_SESSION:
                    return result
            return Module.__call__(self, *inputs, **named)

    def _bind(self, inputs: tuple, named: dict) -> dict:
        """Graph input name -> given value; checks count, names, dtype and rank, and an empty
        batch for an ``LSTM`` / ``GRU`` (:mod:`~onnxparam.onnx_io._empty_batch`). A numpy array in
        the other byte order (``x.astype(">f4")``) is bound as a native-order copy."""
        required = self._source.inputs
        if len(inputs) > len(required):
            raise CallArgumentError(f"the ONNX graph takes {len(required)} input(s) ({', '.join(self.input_names)}); "
                                    f"{len(inputs)} were given")
        bound = {v.name: x for v, x in zip(required, inputs)}
        allowed = {v.name for v in required} | {v.name for v in self._source.overrides}
        for name, x in named.items():
            if name == "adapter_index" and name not in allowed:  # NOTE: only a traced call gets here
                raise CallArgumentError(
                    "adapter_index (an adapter per batch row) is for inference only: a call inside a trace "
                    "(grad, export_onnx, a forward traced by another module) cannot take it, and mixed-adapter "
                    "batches do not train, as in PEFT; train one adapter at a time (set_adapter(name)), or "
                    "export every adapter with export_onnx(..., lora='batched')")
            if name not in allowed:
                raise CallArgumentError(f"the ONNX graph has no input {name!r}; its inputs are "
                                        f"{', '.join(map(repr, self.input_names))}"
                                        + (f" and the overridable initializers {', '.join(map(repr, self.override_names))}"
                                           if self._source.overrides else ""))
            if name in bound:
                raise CallArgumentError(f"graph input {name!r} was given twice (positionally and by name)")
            bound[name] = x
        missing = [v.name for v in required if v.name not in bound]
        if missing:
            raise CallArgumentError(f"missing graph input(s) {', '.join(map(repr, missing))}; the graph takes "
                                    f"{', '.join(map(repr, self.input_names))} in this order")
        for v in list(required) + list(self._source.overrides):
            x = bound.get(v.name)
            if isinstance(x, np.ndarray) and isinstance(v.type, ir.TensorType) and not x.dtype.isnative:
                # NOTE: a big-endian array (x.astype(">f4")) holds the same values; ONNX
                # Runtime reads raw bytes in native order, so it gets a native copy
                x = bound[v.name] = x.astype(x.dtype.newbyteorder("="))
            check_input_value(v, x)
        # NOTE: an empty batch into an LSTM / GRU ends the process inside ONNX Runtime (fresh6 F5)
        from ._empty_batch import check_empty_recurrent

        check_empty_recurrent(self._source, bound)
        return bound

    def forward(self, *inputs, **named):
        """Run the graph: emits each node through :func:`onnxparam.ops._custom` (module docstring).

        Raises:
            CallArgumentError (a TypeError): for missing, unknown or duplicate inputs, or a wrong
                dtype / rank (named).
            TraceError: when a node cannot be traced (an element type onnxparam tensors cannot
                hold, such as strings; an operator without schema whose output types the file
                does not declare; an opset the enclosing trace cannot host).
        """
        from ._boundary import declared_inputs
        from ._opaque import check_outputs

        outputs, _ = self._run(declared_inputs(self._source, self._bind(inputs, named)))
        check_outputs(self._source, outputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _run(self, bound: dict, keep_unused: bool = False) -> tuple[list, dict]:
        """Emit the graph into the current trace; ``(outputs, env)`` where ``env`` maps
        ``id(original value)`` to ``(original value, traced Tensor)``. Main-graph weights no node
        uses become initializers only with ``keep_unused`` (export keeps every weight; a run
        needs only what it computes with)."""
        from ..trace import tracer as tr

        tracer = tr.current_tracer()
        if tracer is None:
            raise TraceError("OnnxModule.forward emits graph nodes: call the module (module(x)) to run it")
        self._check_opsets(tracer)
        from ..runtime._source_errors import record_scope

        record_scope(tracer, self)
        params = dict(named_params(self))
        env: dict = {}
        graph = self._source.loaded.model.graph
        for v in graph.inputs:
            if v.name in bound:
                env[id(v)] = (v, bound[v.name])
        for site in self._source.sites:
            if site.graph is not graph or id(site.value) in env:
                continue
            if not keep_unused and not site.value.uses() and not site.value.is_graph_output():
                continue
            param = params.get(site.path)
            if param is None:
                raise TraceError(f"the imported module has no param at {site.path!r} (ONNX {site.name!r}); "
                                 "an OnnxModule's params can be replaced, not removed")
            env[id(site.value)] = (site.value, param.val())
        for node in self._source.order:
            if id(node) in self._source.const_nodes:
                continue
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.outputs) == 1:
                array = _constant_array(node)
                if array is not None:
                    # NOTE: as a traced constant (an initializer holding data) rather than a
                    # Constant node, so node-level shape inference sees its values (Slice
                    # starts, Reshape shapes ...).
                    env[id(node.outputs[0])] = (node.outputs[0], tracer.constant(array))
                    env[("node", id(node))] = (node, [])
                    continue
            self._emit(node, env, params, tracer)
        outputs = [self._lookup(v, env, tracer) for v in graph.outputs]
        return outputs, env

    def _check_opsets(self, tracer) -> None:
        """The enclosing trace must interpret every operator of this graph as the model does."""
        for domain, version in self._source.opsets.items():
            have = tracer.opset_imports.get(domain)
            if have is None:
                tracer.require_domain(domain, version)
                continue
            if have == version:
                continue
            changed = sorted({node.op_type for g in iter_graphs(self._source.loaded.model.graph) for node in g
                              if (node.domain or "") in (domain, "ai.onnx" if domain == "" else domain)
                              and _since(node.op_type, domain, version) != _since(node.op_type, domain, have)})
            if changed:
                raise TraceError(
                    f"this imported ONNX graph uses domain {domain or 'ai.onnx'!r} at version {version}, the "
                    f"enclosing trace at {have}, and these operators differ between the two: "
                    f"{', '.join(changed)}; trace the enclosing module at opset {version} (give its class "
                    f"onnx_opset_imports = {{'{domain}': {version}}}, or pass opset={version} to export_onnx)"
                )

    def _lookup(self, value: ir.Value, env: dict, tracer) -> Tensor:
        hit = env.get(id(value))
        if hit is not None:
            return hit[1]
        # An initializer that is not a weight (a shape, axes ...): a Constant node of the trace
        # (export turns it back into an initializer of the same name).
        const = value.const_value
        if const is not None:
            from .. import ops

            if isinstance(const, ir.ExternalTensor) and burn_dtype(const.dtype) is not None:
                const = ir.Tensor(const.numpy(), dtype=const.dtype, name=value.name)  # no file reference
            tensor = ops.custom("Constant", value=ir.AttrTensor("value", const))
            env[id(value)] = (value, tensor)
            return tensor
        raise TraceError(f"value {value.name!r} is used before it is produced")

    def _emit(self, node: ir.Node, env: dict, params: dict, tracer) -> None:
        inputs = [None if v is None else self._lookup(v, env, tracer) for v in node.inputs]
        attributes: dict[str, Any] = {}
        for name, attr in node.attributes.items():
            if not attr.is_ref() and attr.type == ir.AttributeType.GRAPH:
                attr = ir.AttrGraph(name, wired_subgraph(self, attr.value, env, params, tracer))
            elif not attr.is_ref() and attr.type == ir.AttributeType.GRAPHS:
                attr = ir.AttrGraphs(name, [wired_subgraph(self, g, env, params, tracer) for g in attr.value])
            attributes[name] = attr
        count = _used_outputs(node, self._source.opsets)
        domain = "" if node.domain == "ai.onnx" else node.domain
        where = f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"
        if opaque_node(self._source, node, count):  # sequences, strings ... (see _opaque)
            result = emit_opaque(self._source, tracer, node, inputs, attributes, count)
        elif not _has_schema(node.op_type, domain, tracer.opset_imports.get(domain, 1)):
            # NOTE: an operator only ONNX Runtime registers (contrib ops, LayerNormalization below
            # opset 17): the file's declared types, else the types ONNX Runtime computes
            types = (self._declared_types(node, count) or _rank_rule(node, domain, inputs, count)
                     or probed_types(self._source, node, count, env))
            if types is None:
                raise TraceError(
                    f"{where} ({domain + '.' if domain else ''}{node.op_type}) of the imported ONNX graph: ONNX has no "
                    "schema for this operator, the file does not declare the types and shapes of its outputs and "
                    "ONNX Runtime could not be asked (symbolic input sizes); add value_info for them to the model"
                )
            result = self._custom(tracer, node, domain, inputs, attributes, count, types, where)
        else:
            try:
                result = self._custom(tracer, node, domain, inputs, attributes, count, None, where)
                error = None
            except TraceError as e:
                result, error = None, e
            if result is None or not all(t.rank_known for t in _as_list(result)):
                # Node-level inference sees only this node; the whole-graph inference of the
                # source (data propagated through Shape/Concat ...) may know more (an Expand
                # whose shape is computed has no rank otherwise).
                types = (self._declared_types(node, count) or _rank_rule(node, domain, inputs, count)
                         or probed_types(self._source, node, count, env))
                if types is None and error is not None:
                    raise TraceError(f"{where} of the imported ONNX graph: {error}") from error
                if types is not None:
                    if result is not None:  # emitted with an unknown rank: again, typed
                        made = _as_list(result)[0]._symbol.value.producer()
                        made.graph.remove(made, safe=True)
                    result = self._custom(tracer, node, domain, inputs, attributes, count, types, where)
        results = _as_list(result)
        if node.name:
            _tag_source(results, node.name)
        for v, t in zip(node.outputs, results):
            if v.name:
                env[id(v)] = (v, t)
        env[("node", id(node))] = (node, results)

    @staticmethod
    def _custom(tracer, node: ir.Node, domain: str, inputs: list, attributes: dict, count: int, types, where: str):
        from .. import ops

        try:
            if _CUSTOM_KEYWORDS & attributes.keys() or any(isinstance(x, ir.Value) for x in inputs):
                return tracer.emit(node.op_type, inputs, attributes, domain=domain, num_outputs=count,
                                   output_types=types, name=node.op_type)
            if types is not None:
                return ops.custom(node.op_type, *inputs, domain=domain, num_outputs=count,
                                  output_dtypes=[t[0] for t in types], output_shapes=[t[1] for t in types],
                                  **attributes)
            return ops.custom(node.op_type, *inputs, domain=domain, num_outputs=count, **attributes)
        except TraceError as e:
            if types is None:
                raise
            raise TraceError(f"{where} of the imported ONNX graph: {e}") from e

    def _declared_types(self, node: ir.Node, count: int) -> Optional[list]:
        """``[(DType, dims)]`` of the node's first ``count`` outputs as the source declares them
        (its value_info, completed by ONNX's whole-graph shape inference with data
        propagation, computed once per imported model), or ``None`` when one is unknown."""
        declared = self._source.cache.get("declared")
        if declared is None:
            declared = _infer_source_types(self._source.loaded.model)
            self._source.cache["declared"] = declared
        types = []
        for v in node.outputs[:count]:
            dtype, dims = declared.get(v.name, (None, None))
            if dtype is None and v.dtype is not None:
                dtype = burn_dtype(v.dtype)
            if dims is None:
                dims = _dims(v)
            if dtype is None or dims is None:
                return None
            types.append((dtype, tuple(None if d == "" else d for d in dims)))
        return types


def _as_list(result) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def import_onnx(path_or_model) -> OnnxModule:
    """Import an ONNX model as an :class:`OnnxModule` (see the module docstring).

    Args:
        path_or_model: a path to an ``.onnx`` file (its external data files beside it), an
            ``onnx.ModelProto``, an ``onnx_ir.Model`` (used as is, not copied: do not modify it
            afterwards) or the bytes of a model.

    Returns:
        the module; no tensor data has been read.

    Raises:
        OnnxFormatError: the input is not an ONNX model, its protobuf is truncated, an external
            data file is missing or short, a name is used that nothing produces, or two weights
            share a name. Each message names the file and the problem.
        IsAFolderError (a FileAccessError and IsADirectoryError): the path is a folder.
    """
    from . import _function_ops, _lora_import, _rnn_layout

    try:
        loaded = load_model(path_or_model)
    except OnnxFormatError:
        loaded = load_densified(path_or_model)
        if loaded is None:
            raise
    # LoRA kept by an onnxparam export ("keep" / "inputs"): its nodes out, adapters on the params
    loaded, adapters = _lora_import.strip_imported(loaded)
    if _rnn_layout.has_batch_first(loaded.model):  # ONNX Runtime runs layout=0 recurrent nodes only
        loaded = LoadedModel(_rnn_layout.rewrite_batch_first(copy_model(loaded.model)), loaded.source, loaded.path)
    pristine = loaded.model
    if loaded.model.functions:
        loaded = _inline_functions(loaded)  # a copy: the tracer replays graph nodes only
    elif _qdq_import.has_foldable_nodes(pristine):
        loaded = LoadedModel(copy_model(pristine), loaded.source, loaded.path)
    if _function_ops.has_expanded_ops(loaded.model):  # (ORT runs them through their function body too)
        loaded = _expand_function_ops(loaded)
    return _lora_import.attach_imported(OnnxModule(loaded, pristine), adapters)


def _expand_function_ops(loaded: LoadedModel) -> LoadedModel:
    """The operators ONNX Runtime runs through their ONNX function body, expanded in a copy
    (:mod:`._function_ops`)."""
    from . import _function_ops
    from ._data_watch import carry_stamps

    base = base_dir_of(loaded.model)
    model = _function_ops.expand_function_ops(loaded.model, str(loaded.source))
    if base:
        ir.external_data.set_base_dir(model.graph, base)
    carry_stamps(loaded.model, model)
    return LoadedModel(model, loaded.source, loaded.path)


SOURCE_NODE_KEY = "onnxparam.source_node"
"""Node ``metadata_props`` key naming the imported file's node a traced node comes from (read by
``onnxparam.autodiff._check.source_name``, so gradient errors name ``p2o.Conv.35``, not ``/Conv_35``)."""


def _tag_source(results, name: str) -> None:
    """Mark the traced node(s) producing ``results`` with the imported node's ``name``."""
    for t in results:
        symbol = getattr(t, "_symbol", None)
        value = getattr(symbol, "value", None)
        producer = value.producer() if value is not None else None
        if producer is not None and SOURCE_NODE_KEY not in producer.metadata_props:
            producer.metadata_props[SOURCE_NODE_KEY] = name


def _inline_functions(loaded: LoadedModel) -> LoadedModel:
    """Model-local functions are inlined: the tracer emits graph nodes only.

    The model is copied first (``onnx_ir``'s serializer keeps external tensors as references)
    so a caller's ``onnx_ir.Model`` is never changed."""
    from onnx_ir.passes.common import InlinePass

    base = base_dir_of(loaded.model)
    model = ir.serde.deserialize_model(ir.serde.serialize_model(loaded.model))
    if base:
        ir.external_data.set_base_dir(model.graph, base)
    from ._data_watch import carry_stamps

    carry_stamps(loaded.model, model)
    try:
        model = InlinePass()(model).model
    except Exception as e:
        raise OnnxFormatError(f"{loaded.source}: its model-local functions cannot be inlined: {e}") from e
    return LoadedModel(model, loaded.source, loaded.path)
