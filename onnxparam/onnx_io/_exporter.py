"""Exporting a module to an ONNX file: :func:`export_onnx`.

Any module is traced with :func:`onnxparam.trace.tracer.trace_module` (initializer names = module
paths, lazy params as ``onnx_ir.LazyTensor`` s evaluated one at a time while writing), its
params' ids and trainable flags are written into ONNX metadata
(:mod:`~onnxparam.onnx_io._metadata`), and the model is saved by
:func:`~onnxparam.onnx_io._save.save_model` (external data when needed, atomic).

An imported :class:`~onnxparam.onnx_io.OnnxModule` needs no example inputs and comes back as the
graph it was (:mod:`~onnxparam.onnx_io._graph_model`): the same nodes in the same order, node and
value names, attributes, opset imports, IR version, metadata, value infos, model-local functions
and subgraphs, every weight where the file held it (initializer, subgraph initializer or
``Constant`` node) with the module's current value. Only what the user changed differs: new
weight values, LoRA adapters (merged into the weight, or kept as graph nodes with
``lora="keep"``), trainable flags and param ids (metadata). Example inputs with
``dynamic_axes`` fix the other input dims; ``input_names`` / ``output_names`` rename the graph's.
Weights quantized in the module, LoRA in ``"inputs"`` mode and QLoRA are traced instead (then
the graph is rebuilt by the tracer, as for any module).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import LoraError, OnnxFormatError, OnnxParamError, TraceError
from ..core.module import named_params
from . import _metadata as md
from ._importer import SOURCE_NODE_KEY, OnnxModule
from ._save import DEFAULT_MAX_SHARD_SIZE_BYTES, save_model
from ._source import iter_graphs

__all__ = ["export_onnx", "trace_for_export"]

TORCH_SCOPE_KEYS = ("pkg.torch.onnx.name_scopes", "pkg.torch.onnx.fx_node")
"""Node ``metadata_props`` of torch's dynamo exporter an export keeps on the source's nodes: the
PyTorch module a node belongs to (``onnxparam.lora``'s PEFT writers name a renamed weight or a
tied embedding table by it)."""


def export_onnx(
    module,
    path: "str | os.PathLike",
    *example_inputs,
    input_names: Optional[Sequence[str]] = None,
    output_names: Optional[Sequence[str]] = None,
    dynamic_axes: Optional[Mapping] = None,
    dynamic_batch: "bool | str | None" = None,
    opset: Optional[int] = None,
    lora: str = "merge",
    external_data: Union[None, bool, str] = None,
    max_shard_size_bytes: Optional[int] = DEFAULT_MAX_SHARD_SIZE_BYTES,
    metadata: Optional[Mapping[str, str]] = None,
    kwargs: Optional[Mapping] = None,
) -> Path:
    """Write ``module`` as an ONNX model (see the module docstring).

    Args:
        module: any :class:`~onnxparam.Module`; an imported
            :class:`~onnxparam.onnx_io.OnnxModule` needs no ``example_inputs``.
        path: the ``.onnx`` file (written atomically; external data files beside it). Missing
            folders above it are created (as ``mkdir -p``), as every ONNX writer of the library
            does (:func:`~onnxparam.onnx_io._save.save_model`); a burnpack / safetensors
            ``save_file`` refuses a missing folder instead (``FileMissingError``).
        example_inputs: ``forward``'s positional arguments: tensors / arrays / ``InputSpec`` s
            (only their shapes and dtypes are used) or other values passed as they are.
        input_names: graph input names (default: ``forward``'s parameter names; an imported
            model's own input names).
        output_names: graph output names (default ``output`` / ``output_0`` ...; an imported
            model's own output names).
        dynamic_axes: ``{input_or_output_name_or_input_index: {axis: dim_name} | [axis, ...]}``;
            a declared output dim the forward makes a constant raises ``TraceError`` naming the
            node (the file would break at another size).
        dynamic_batch: ``True`` (or a dim name): dim 0 of every tensor input and output is the
            batch (``"batch"``); ``False``: the example's shapes, as they are. ``None`` (the
            default, when ``dynamic_axes`` is not given): the batch is made dynamic when it
            can be: dim 0 of the example inputs of rank >= 2 that share the first one's dim 0
            becomes ``"batch"`` (outputs follow it); if the forward cannot be traced that way,
            or pins the batch in a constant (an output whose dim 0 becomes the example's batch
            size as a constant), the file keeps the example's shapes and a ``UserWarning`` says
            why (pass ``dynamic_batch=False`` to pin it silently). See "Dynamic shapes" in the
            README. An imported :class:`~onnxparam.onnx_io.OnnxModule` keeps its graph's own
            dims instead (``dynamic_axes`` still apply).
        opset: the ``ai.onnx`` opset (default: the tracer's, or an imported model's own;
            an imported model cannot be re-targeted to another opset).
        lora: the LoRA mode of :func:`onnxparam.trace.tracer.trace_module` (``"merge"``: an adapted
            weight's initializer holds ``base + scale * (a @ b)``; ``"keep"``, ``"inputs"``), or
            ``"batched"`` / a :class:`onnxparam.lora._batched.BatchedLora`: every named adapter
            stacked, an int64 ``adapter_index`` input ``[batch]`` choosing each row's (0: none).
        external_data: ``None`` (automatic above protobuf's 2 GiB), ``True`` (``<file>.data``),
            ``False``, or a data file name.
        max_shard_size_bytes: largest external data shard (``None``: one data file).
        metadata: extra model ``metadata_props`` entries (strings).
        kwargs: keyword arguments of ``forward`` (tensors among them become named inputs).

    Returns:
        the ``pathlib.Path`` of the ``.onnx`` file.

    Raises:
        TraceError: when the forward cannot be traced (see :mod:`onnxparam.trace.tracer`).
        ValueError: for an unsupported opset, or an opset other than an imported model's own.
        LoraError: an unknown ``lora`` mode (a ``ValueError`` too); ``lora="keep"`` of a module whose named
            adapters are all inactive (with ``"merge"`` the file is then the base model).
        CallArgumentError: (a ``TypeError``) for an imported module, example inputs that
            ``module(x)`` would refuse: another count, element type or rank than the graph
            declares, or a static dim that differs (axes named in ``dynamic_axes`` are free).
        OnnxFormatError: when the model cannot be saved (see
            :func:`~onnxparam.onnx_io._save.save_model`).
        FileAccessError: (also the builtin ``OSError`` leaf of its errno) the file cannot be
            written: a folder that is not writable or refuses new files (``/proc``), a file on
            the path where a folder should be, a read-only target; nothing is written.

        For an imported module, each of these names the file it was imported from.
    """
    import contextlib

    from ..runtime._source_errors import naming_source

    with naming_source(module) if isinstance(module, OnnxModule) else contextlib.nullcontext(), \
            _streamed_quantization(module, path):
        model = trace_for_export(module, *example_inputs, input_names=input_names, output_names=output_names,
                                 dynamic_axes=dynamic_axes, opset=opset, lora=lora, kwargs=kwargs,
                                 dynamic_batch=dynamic_batch)
        for key, value in (metadata or {}).items():
            model.metadata_props[str(key)] = str(value)
        if _quantized_export(module):
            # NOTE (issue 27): value infos settled by ONNX shape inference (on the structure only),
            # as onnxruntime.quantization writes them, so ORT's fusions after int8 MatMuls apply
            from ..quant._shapes import settle_value_infos

            settle_value_infos(model)
        if isinstance(module, OnnxModule):
            # NOTE (issue 28): written over its own source file, an imported module keeps the old
            # bytes mapped (the save renames a new file into place) and stays callable
            from ._data_watch import pin_before_overwrite

            source = module._source
            pin_before_overwrite((model, source.loaded.model, source.pristine), path, (source,))
        try:
            return save_model(model, path, external_data=external_data, max_shard_size_bytes=max_shard_size_bytes)
        except ValueError as e:
            # NOTE: onnx_ir refuses, when it reads an external tensor, a data file reached through a
            # symbolic link that leaves the model's folder or one with several hard links (a plain
            # ValueError); import refuses both, but the link can appear after the import
            if isinstance(e, OnnxParamError) or not ("outside the base directory" in str(e) or "hard link" in str(e)):
                raise
            raise OnnxFormatError(f"cannot export to '{path}': a weight's external data file is refused: {e}; "
                                  "copy the data file beside the .onnx file") from e


def trace_for_export(module, *example_inputs, input_names=None, output_names=None, dynamic_axes=None,
                     opset=None, lora: str = "merge", kwargs=None, dynamic_batch=None) -> ir.Model:
    """The ``onnx_ir.Model`` :func:`export_onnx` writes (initializers still lazy); errors raised
    for an imported module name its file."""
    if isinstance(module, OnnxModule):
        from ..runtime._source_errors import naming_source

        with naming_source(module):
            return _trace_for_export(module, *example_inputs, input_names=input_names, output_names=output_names,
                                     dynamic_axes=dynamic_axes, opset=opset, lora=lora, kwargs=kwargs,
                                     dynamic_batch=dynamic_batch)
    return _trace_for_export(module, *example_inputs, input_names=input_names, output_names=output_names,
                             dynamic_axes=dynamic_axes, opset=opset, lora=lora, kwargs=kwargs,
                             dynamic_batch=dynamic_batch)


def _check_active_adapter(module) -> None:
    """``lora="keep"`` of a module owning named adapters none of which is active
    (``set_adapter(None)``, or only ``add_adapter`` calls) would write the base model: refused, as
    it asks for the adapters. (``"merge"``, the default, writes the base model then: the way to
    export it from a serving module.)"""
    from ..core.module import named_params
    from ..lora._adapters import active_adapter, adapter_set

    names = list(adapter_set(module).names)
    if not names or active_adapter(module) is not None or any(p.adapter() is not None
                                                            for _, p in named_params(module)):
        return
    shown = ", ".join(repr(n) for n in names[:6])
    what = (f"{type(module).__name__} owns named adapters ({shown}) but none is active, so the file would hold "
            f"the base model only: set_adapter({names[0]!r}) for one adapter, lora='batched' or 'inputs' for "
            "all of them")
    raise LoraError(f"lora='keep': {what}")


def _trace_for_export(module, *example_inputs, input_names=None, output_names=None, dynamic_axes=None,
                      opset=None, lora: str = "merge", kwargs=None, dynamic_batch=None) -> ir.Model:
    from ..lora._batched import METADATA_KEY, BatchedLora, as_options, batched_options, batched_tracing
    from ..lora._adapters import with_every_named_target
    from ..quant._passes import trace_module  # the tracer's, with the standard LoRA / QDQ passes
    from ..trace.passes import TRACE_LORA_MODES

    if not isinstance(lora, BatchedLora) and lora not in TRACE_LORA_MODES:
        # NOTE: checked before anything else: an imported module without adapters is exported from
        # its own graph and never meets the tracer, which checks the mode too
        raise LoraError(f"unknown LoRA mode {lora!r}: expected one of {', '.join(map(repr, TRACE_LORA_MODES))} "
                        "(or lora=BatchedLora(...))")
    if lora == "keep":
        _check_active_adapter(module)
    if isinstance(lora, BatchedLora) or (lora == "batched" and not batched_tracing()):
        # every named adapter stacked, one per row (lora, issue 29); the graph alone cannot hold
        # the stacks, so an imported module is always traced
        with batched_options(as_options(lora)):
            model = _trace_for_export(module, *example_inputs, input_names=input_names, output_names=output_names,
                                      dynamic_axes=dynamic_axes, opset=opset, lora="batched", kwargs=kwargs,
                                      dynamic_batch=dynamic_batch)
        model.metadata_props[METADATA_KEY] = model.graph.meta[METADATA_KEY]
        return model
    if lora == "inputs":  # factor inputs for every named adapter's targets (lora, issue 16)
        module = with_every_named_target(module)
    if isinstance(module, OnnxModule) and not kwargs:
        from ._importer import check_example_inputs

        # NOTE: an example module(x) would refuse (dtype, rank, a static dim) is refused here too
        check_example_inputs(module, example_inputs, dynamic_axes, input_names)
        # NOTE (quant, issue 17): a quantized import is traced first, so the QDQ pass picks each op's
        # form (dynamic / static int8, float convs, MatMulNBits); the source graph is the fallback
        traced_first = _has_quantized_weights(module)
        model = None
        if traced_first:
            try:
                model, by_name = _trace_imported(module, example_inputs, input_names, output_names, dynamic_axes,
                                                 opset, lora)
            except TraceError:
                model = None
        if model is None:
            direct = None if lora == "batched" else _export_imported(module, example_inputs, input_names,
                                                                      output_names, dynamic_axes, opset, lora)
            if direct is not None:
                return direct
            model, by_name = _trace_imported(module, example_inputs, input_names, output_names, dynamic_axes, opset,
                                             lora)
    else:
        def trace(axes, batch=False):
            return trace_module(module, tuple(example_inputs), kwargs=kwargs, input_names=input_names,
                                output_names=output_names, dynamic_axes=axes, opset=opset, lora=lora,
                                dynamic_batch=batch)

        if dynamic_batch is None and dynamic_axes is None:
            traced = _auto_batch(module, example_inputs, kwargs, trace)
        else:
            traced = trace(dynamic_axes, bool(dynamic_batch) and dynamic_batch)
        model = traced.model
        by_name = {path: (path, param) for path, param in traced.params.items()}
    _write_param_metadata(model, module, by_name)
    from ..quant._qdq_forms import write_report

    write_report(model)  # which form each op with a quantized weight got (onnxparam.quant.ops)
    return model


def _streamed_quantization(module, path):
    """Inside the export of a module whose quantized params (not yet quantized: lazy) hold at
    least :data:`onnxparam.quant._stream.AUTO_STREAM_BYTES` of float data, their codes are
    computed in chunks and spilled to scratch files beside ``path`` (issue 27: a model larger
    than memory is quantized one weight at a time); else nothing changes."""
    import contextlib
    import math

    from ..quant import _stream

    if _stream.streaming_folder() is not None:
        return contextlib.nullcontext()
    total = 0
    for _, param in named_params(module):
        if param.lazy_dtype() is DType.QFloat and not param.is_initialized():
            try:
                shape = param.lazy_shape()
            except ValueError:
                continue
            total += math.prod(int(d) for d in shape) * 4
    if total < _stream.AUTO_STREAM_BYTES:
        return contextlib.nullcontext()
    return _stream.streaming(Path(path).resolve().parent)


def _quantized_export(module) -> bool:
    """Whether ``module`` has a param quantized in it or calibrated activation ranges (its export
    then gets settled value infos: :mod:`onnxparam.quant._shapes`)."""
    from ..quant._qdq_options import ACTIVATION_RANGES_ATTR

    if isinstance(module, OnnxModule):
        return _has_quantized_weights(module)
    return bool(getattr(module, ACTIVATION_RANGES_ATTR, None)) or any(
        param.lazy_dtype() is DType.QFloat for _, param in named_params(module))


def _has_quantized_weights(module) -> bool:
    """Whether ``module`` holds a param quantized in the module (not one imported quantized and
    unchanged: an imported QDQ graph goes out as it came in, issue 14) or calibrated activation
    ranges (quant)."""
    from ..quant._qdq_options import ACTIVATION_RANGES_ATTR
    from ._graph_model import is_source_valued

    if getattr(module, ACTIVATION_RANGES_ATTR, None):
        return True
    return any(param.lazy_dtype() is DType.QFloat and not is_source_valued(module._source, path, param)
               for path, param in named_params(module))


def _auto_batch(module, example_inputs, kwargs, trace):
    """The default of :func:`export_onnx`: a dynamic batch where the forward allows it, else the
    example's shapes with a warning (see ``dynamic_batch``)."""
    import warnings

    from ..core.errors import TraceError
    from ..trace.tracer import _as_spec, _is_input, baking_node

    tensors = [x for x in list(example_inputs) + list((kwargs or {}).values()) if _is_input(x)]
    shapes = [_as_spec(x).shape for x in tensors]
    ranked = [s for s in shapes if len(s) >= 2 and isinstance(s[0], int)]
    if not ranked:
        return trace(None)
    size = ranked[0][0]
    axes = {i: {0: "batch"} for i, s in enumerate(shapes) if len(s) >= 2 and s[0] == size}
    why = None
    try:
        traced = trace(axes)
    except TraceError as e:
        why = f"the forward cannot be traced with dim 0 of its inputs dynamic: {e}"
    else:
        for value in traced.graph.outputs:
            dims = [d if isinstance(d, int) else d.value for d in (value.shape or ())]
            if dims and dims[0] == size and size > 1:
                node = baking_node(value)
                where = f" at node {node.name!r} ({node.op_type})" if node is not None else ""
                why = (f"output {value.name!r} has dim 0 = {size} as a constant{where} (a size taken from the "
                       "example, not from the input?)")
                break
        else:
            return traced
    warnings.warn(f"export_onnx: {type(module).__name__} is exported with the example's batch size {size} "
                  f"pinned, as {why}. Pass dynamic_batch=False to pin it without this warning, or "
                  "dynamic_axes / dynamic_batch=True to require dynamic dims", UserWarning, stacklevel=4)
    return trace(None)


def _adapter_scales(module) -> dict:
    """``<path>.lora.a`` / ``.lora.b`` -> the adapter's scale, for every adapted param."""
    scales = {}
    for path, param in named_params(module):
        adapter = param.adapter()
        if adapter is not None:
            scales[f"{path}.lora.a"] = scales[f"{path}.lora.b"] = float(adapter.scale)
    return scales


def _write_param_metadata(model: ir.Model, module, by_name: Mapping[str, tuple]) -> None:
    """Initializer and model metadata for each param initializer (``name -> (path, param)``)."""
    scales = _adapter_scales(module)
    graph = model.graph
    metas = {}
    for name, (path, param) in by_name.items():
        value = graph.initializers.get(name)
        if value is None or value.const_value is None:
            continue
        meta = md.ParamMetadata(param.id, param.require_grad, scales.get(path))
        value.const_value.metadata_props.update(md.tensor_props(meta))
        metas[name] = meta
    _set_model_props(model, module, metas)


def _set_model_props(model: ir.Model, module, metas: dict) -> None:
    """The model's ``metadata_props``: its own keys (params ``{initializer name: ParamMetadata}``,
    library version, module class) replace any a previous export wrote; others' keys are kept."""
    from ..core.version import __version__

    props = md.strip_own_keys(model.metadata_props)
    props[md.PARAMS_KEY] = md.model_params_prop(metas)
    props[md.VERSION_KEY] = __version__
    cls = type(module)
    props[md.MODULE_KEY] = f"{cls.__module__}.{cls.__qualname__}"
    model.metadata_props.clear()
    model.metadata_props.update(props)


# -- imported modules -------------------------------------------------------------------------


def _new_tracer(module: OnnxModule, lora: str):
    from ..quant._passes import STANDARD_PASSES
    from ..trace import tracer as tr

    return tr.Tracer(opset_imports=module.onnx_opset_imports, mode=lora, root=module, passes=STANDARD_PASSES,
                     name=module.ir_model.graph.name or "main_graph")


def _apply_axes(dims: list, axes, name: str) -> list:
    if isinstance(axes, Mapping):
        items = [(int(a), None if d is None else str(d)) for a, d in axes.items()]
    else:
        items = [(int(a), f"{name}_dim_{int(a)}") for a in axes]
    for axis, dim in items:
        dims[axis] = dim
    return dims


def _keep_source_dims(specs: list, module: OnnxModule) -> list:
    """Example-input specs with the source graph's dynamic dims kept (a re-export of an
    imported model stays as general as the original unless ``dynamic_axes`` says otherwise)."""
    from ..trace.tracer import InputSpec

    try:
        source = module.input_specs()
    except Exception:  # noqa: BLE001 - inputs of unknown rank: the examples decide
        return specs
    kept = []
    for spec, src in zip(specs, source):
        if len(src.shape) != len(spec.shape):
            kept.append(spec)
            continue
        dims = [d if isinstance(s, int) else s for d, s in zip(spec.shape, src.shape)]
        kept.append(InputSpec(tuple(dims), spec.dtype, getattr(spec, "name", None)))
    return kept


def _spec_of(x):
    """An ``InputSpec`` for an example input (a spec, a tensor or an array)."""
    import numpy as np

    from ..core.dtype import DType
    from ..core.tensor import Tensor
    from ..trace.tracer import InputSpec

    if isinstance(x, InputSpec):
        return x
    if isinstance(x, Tensor):
        return InputSpec(x.shape, x.dtype)
    array = np.asarray(x)
    return InputSpec(array.shape, DType.from_numpy(array.dtype))


def _check_opset(module: OnnxModule, opset) -> None:
    declared = module.onnx_opset_imports.get("")
    if opset is not None and declared is not None and int(opset) != declared:
        raise ValueError(
            f"an imported ONNX graph keeps its own opset ({declared}); it cannot be exported at opset {opset} "
            "(convert the file with onnx.version_converter instead)"
        )


def _export_imported(module: OnnxModule, example_inputs, input_names, output_names, dynamic_axes, opset, lora):
    """The source graph itself with the module's weights (:mod:`._graph_model`), or ``None``
    when the module is more than its graph can say (then it is traced)."""
    from ._graph_model import apply_dynamic_axes, apply_example_shapes, export_model

    _check_opset(module, opset)
    if example_inputs and len(example_inputs) != len(module.input_names):
        raise TypeError(f"the ONNX graph takes {len(module.input_names)} input(s) ({', '.join(module.input_names)}); "
                        f"{len(example_inputs)} example input(s) were given")
    built = export_model(module, lora, input_names, output_names)
    if built is None:
        return None
    model, written = built
    if example_inputs and dynamic_axes:
        apply_example_shapes(model, [getattr(x, "shape", None) for x in example_inputs])
    apply_dynamic_axes(model, dynamic_axes)
    metas = {}
    for name, (path, param, tensor, scale) in written.items():
        meta = md.ParamMetadata(param.id, param.require_grad, scale)
        tensor.metadata_props.update(md.tensor_props(meta))
        metas[name] = meta
    _set_model_props(model, module, metas)
    return model


def _trace_imported(module: OnnxModule, example_inputs, input_names, output_names, dynamic_axes, opset, lora):
    source = module.ir_model
    declared = module.onnx_opset_imports.get("")
    if opset is not None and declared is not None and int(opset) != declared:
        raise ValueError(
            f"an imported ONNX graph keeps its own opset ({declared}); it cannot be exported at opset {opset} "
            "(convert the file with onnx.version_converter instead)"
        )
    names = list(input_names) if input_names is not None else list(module.input_names)
    if example_inputs:
        specs = [_spec_of(x) for x in example_inputs]
        if dynamic_axes is None:
            specs = _keep_source_dims(specs, module)
    else:
        specs = module.input_specs()
    if len(specs) != len(module.input_names) or len(names) != len(specs):
        raise TypeError(f"the ONNX graph takes {len(module.input_names)} input(s) ({', '.join(module.input_names)}); "
                        f"{len(specs)} example input(s) and {len(names)} name(s) were given")
    axes_by_name = {}
    for key, axes in (dynamic_axes or {}).items():
        axes_by_name[names[key] if isinstance(key, int) else key] = axes
    tracer = _new_tracer(module, lora)
    with tracer.active():
        symbolic = {}
        for original, name, spec in zip(module.input_names, names, specs):
            dims = _apply_axes(list(spec.shape), axes_by_name.get(name, {}), name)
            symbolic[original] = tracer.input(name, dims, spec.dtype)
        outputs, env = module._run(symbolic, keep_unused=True)
        traced = tracer.finish(outputs[0] if len(outputs) == 1 else list(outputs), None, None, input_names=names)
    model = traced.model
    graph = model.graph
    originals = factor_onnx_names(module.onnx_names, list(traced.params) + [v.name for v in graph.inputs])
    by_name = {}
    for path, param in traced.params.items():
        by_name[originals.get(path, path)] = (path, param)
    out_names = list(output_names) if output_names is not None else list(module.output_names)
    mapping = _restore_names(model, traced, env, originals, out_names, names)
    for value in graph.outputs:  # output dims named in dynamic_axes (by output name)
        axes = axes_by_name.get(value.name)
        if axes is not None and value.shape is not None:
            dims = [d if isinstance(d, int) else d.value for d in value.shape]
            value.shape = ir.Shape(_apply_axes(dims, axes, value.name))
    # initializers that were graph inputs of the source stay overridable inputs, in source order
    given = dict(zip(module.input_names, graph.inputs))
    order = []
    overridable = set(module.override_names)
    for v in source.graph.inputs:
        if v.name in given:
            order.append(given[v.name])
        elif v.name in overridable:
            hit = mapping.get(id(v))
            if hit is not None and hit[1].is_initializer():
                order.append(hit[1])
            elif v.name in graph.initializers:
                order.append(graph.initializers[v.name])
    # lora="inputs" factors, lora="batched" stacks and its adapter_index
    order += [v for v in graph.inputs if v not in order and v not in given.values()]
    graph.inputs.clear()
    graph.inputs.extend(order)
    # the source's model-level facts (other producers' metadata, doc strings)
    for key, value in md.strip_own_keys(source.metadata_props).items():
        model.metadata_props[key] = value
    model.doc_string = source.doc_string
    graph.doc_string = source.graph.doc_string
    model.domain = source.domain
    model.model_version = source.model_version
    return model, by_name


def factor_onnx_names(originals: dict, paths) -> dict:
    """``originals`` (param path -> the ONNX name it had in the source file) plus, for each
    LoRA factor path ``<path>.lora.a`` / ``.lora.b`` among ``paths`` whose base has a source
    name, ``<source name>.lora.a`` / ``.b``: factors are named after the weight as the file
    spells it (``onnx::MatMul_12.lora.a``), not after its escaped module path."""
    from ..lora._graph import FACTOR_SUFFIXES

    names = dict(originals)
    for path in paths:
        for suffix in FACTOR_SUFFIXES:
            if path.endswith(suffix) and path[: -len(suffix)] in originals:
                names.setdefault(path, originals[path[: -len(suffix)]] + suffix)
    return names


def _traced_values(env: dict) -> dict:
    """``id(source value) -> (source value, traced ir.Value)`` from a run's environment."""
    found = {}
    for key, entry in env.items():
        if isinstance(key, tuple):
            continue
        original, tensor = entry
        symbol = getattr(tensor, "_symbol", None)
        if symbol is not None:
            found[key] = (original, symbol.value)
    return found


def _reinstate_initializers(graph: ir.Graph, traced: dict) -> None:
    """Source initializers that are not weights were emitted as ``Constant`` nodes (the tracer
    holds only params and its own constants as initializers); make them initializers again."""
    for key, (original, value) in list(traced.items()):
        if not original.is_initializer():
            continue
        node = value.producer()
        if node is None or node.op_type != "Constant" or node.graph is not graph:
            continue
        tensor = node.attributes["value"].value
        new = ir.Value(name=value.name, type=value.type, shape=value.shape, const_value=tensor)
        value.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.register_initializer(new)
        traced[key] = (original, new)


def _restore_names(model: ir.Model, traced_model, env: dict, originals: dict,
                   output_names: list, input_names: list) -> dict:
    """Give the traced values and nodes the names they had in the source graph; values the
    tracer added (constants, output ``Identity`` s) keep theirs unless they clash. Returns
    ``id(source value) -> (source value, traced value)``."""
    graph = model.graph
    if len(output_names) != len(graph.outputs):
        raise TypeError(f"{len(output_names)} output names given for {len(graph.outputs)} outputs")
    traced = _traced_values(env)
    _reinstate_initializers(graph, traced)
    wanted: dict[int, str] = {}
    claimed: set = set()

    def claim(value: ir.Value, name: str) -> None:
        if id(value) in wanted or not name or name in claimed:
            return
        wanted[id(value)] = name
        claimed.add(name)

    for value, name in zip(graph.inputs, input_names):
        claim(value, name)
    for value, name in zip(graph.outputs, output_names):
        claim(value, name)
    for path in traced_model.param_paths:
        claim(graph.initializers[path], originals.get(path, path))
    for value in graph.inputs:  # lora="inputs" factors: named after their weight's source name
        if value.is_initializer() and value.name in originals:
            claim(value, originals[value.name])
    for original, value in traced.values():
        claim(value, original.name)
    # every value of the model, subgraphs included
    values = []
    seen = set()
    for g in iter_graphs(graph):
        for v in list(g.inputs) + list(g.initializers.values()) + [o for n in g for o in n.outputs]:
            if id(v) not in seen:
                seen.add(id(v))
                values.append(v)
    taken = set(claimed)
    renames = []
    for v in values:
        name = wanted.get(id(v))
        if name is None:
            name = v.name
            if name and name in taken:
                k = 1
                while f"{name}__{k}" in taken:
                    k += 1
                name = f"{name}__{k}"
            if name:
                taken.add(name)
        renames.append((v, name))
    # initializers are keyed by name: take them out while renaming, then register them again
    initializers_by_graph = []
    for g in iter_graphs(graph):
        initializers_by_graph.append((g, list(g.initializers.values())))
        g.initializers.clear()
    for i, (v, _) in enumerate(renames):  # via unique temporary names: no rename meets a later one
        if v.name:
            v.name = f"\x00onnxparam_tmp_{i}"
    for v, name in renames:
        if name:
            v.name = name
            if v.const_value is not None and v.const_value.name is not None:
                v.const_value.name = name
    for g, values_of_g in initializers_by_graph:
        for v in values_of_g:
            g.register_initializer(v)
    # node names of the source
    for key, entry in env.items():
        if not (isinstance(key, tuple) and key[0] == "node"):
            continue
        node, results = entry
        if not node.name or not results:
            continue
        symbol = getattr(results[0], "_symbol", None)
        producer = symbol.value.producer() if symbol is not None else None
        if producer is not None:
            producer.name = node.name
            for key in TORCH_SCOPE_KEYS:  # dynamo's module scope: the PyTorch module names PEFT needs
                if key in node.metadata_props:
                    producer.metadata_props[key] = node.metadata_props[key]
        for t in results:  # (the importer's mark for gradient errors: not written to the file)
            symbol = getattr(t, "_symbol", None)
            made = symbol.value.producer() if symbol is not None else None
            if made is not None:
                made.metadata_props.pop(SOURCE_NODE_KEY, None)
    return traced
