"""ONNX <-> :class:`~onnxparam.ModuleRecord`: an ONNX file's weights as a record, and a record's
tensors written into an existing graph.

These are the bridges the converters use (``onnxparam convert model.onnx out.bpk``,
``onnxparam convert in.bpk out.onnx --graph model.onnx``). The record's keys are module paths
(:func:`~onnxparam.onnx_io._naming.onnx_name_to_path` of the ONNX names), the same paths an
imported :class:`~onnxparam.onnx_io.OnnxModule` has, so a record read from a file loads into the
imported module and the other way round. Which tensors count as weights:
:mod:`onnxparam.onnx_io._weights`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import onnx
import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import RecordError
from ..core.param import ParamId
from ..core.record import ModuleRecord, TensorSnapshot
from ..lora._folded_norms import folded_norm_weights, folded_reason, holds_folded_norms
from . import _metadata as md
from ._naming import tree_order
from ._save import DEFAULT_ALIGNMENT_BYTES, DEFAULT_MAX_SHARD_SIZE_BYTES, save_model
from ._source import base_dir_of, load_model
from ._weights import CONSTANT, INITIALIZER, WeightSite, find_weights, tensor_data

__all__ = ["read_onnx_record", "write_record_to_onnx", "weights_into_graph", "site_metadata"]


def site_metadata(model: ir.Model, sites: list[WeightSite], source: str) -> dict[str, md.ParamMetadata]:
    """The recorded param facts (:mod:`~onnxparam.onnx_io._metadata`) per weight name."""
    props = {site.name: dict(site.tensor.metadata_props) for site in sites if site.tensor.metadata_props}
    return md.read_params(model.metadata_props, props, source)


def read_onnx_record(path_or_model) -> ModuleRecord:
    """The weights of an ONNX model as a lazy :class:`~onnxparam.ModuleRecord`.

    Keys are module paths in the order an imported module visits them
    (:func:`~onnxparam.onnx_io._naming.tree_order`, the order of ``import_onnx(...).into_record()``);
    each snapshot has the Burn dtype, the shape, the param id recorded in the file's metadata
    (``None`` when there is none) and a loader that reads the data only when asked (a zero-copy
    view of the memory-mapped external data file, or of the protobuf bytes). The record's
    ``metadata`` holds the file's ``onnxparam.core.record.*`` entries, without that prefix.

    Quantized weights (an integer initializer read by ``DequantizeLinear``, the exporter's
    ``MatMulInteger -> Cast -> Mul(scale)`` form, ``com.microsoft.MatMulNBits``) are ``QFloat``
    entries holding their codes and scales, named as the integer initializer: the params
    :func:`~onnxparam.onnx_io.import_onnx` makes of them (folded on a copy of the model; a
    form Burn cannot hold stays the integer tensor and its scale, each an entry of its own).

    Args:
        path_or_model: a path, ``onnx.ModelProto``, ``onnx_ir.Model`` or bytes.

    Raises:
        OnnxFormatError: for anything :func:`~onnxparam.onnx_io._source.load_model` rejects.
    """
    from ..quant import _qdq_import

    loaded = load_model(path_or_model)
    model = loaded.model
    if _qdq_import.has_foldable_nodes(model):
        # quantized weights (DequantizeLinear / MatMulInteger / MatMulNBits of an integer
        # initializer) are QFloat entries, as import_onnx makes them params (a copy is folded)
        from ._graph_model import copy_model

        model = copy_model(model)
        _qdq_import.fold_dequantize_weights(model)
    sites = find_weights(model, loaded.source)
    metas = site_metadata(model, sites, loaded.source)
    items = {}
    by_path = {site.path: site for site in sites}
    for site in (by_path[p] for p in tree_order(by_path)):
        meta = metas.get(site.name, md.ParamMetadata())
        quantized = _qdq_import.imported_quantized(site)
        if quantized is not None:
            items[site.path] = TensorSnapshot(DType.QFloat, tuple(quantized.shape), meta.param_id,
                                              lambda _q=quantized: _q.to_tensor().into_data(), quantized.scheme)
            continue

        def load(_t=site.tensor, _d=site.dtype):
            return tensor_data(_t, _d)

        items[site.path] = TensorSnapshot(site.dtype, site.shape, meta.param_id, load)
    record_meta = {k[len(md.RECORD_PREFIX):]: v for k, v in loaded.model.metadata_props.items()
                   if k.startswith(md.RECORD_PREFIX)}
    return ModuleRecord(items, record_meta)


def _fits(expected: DType, found: DType) -> bool:
    return expected == found or {expected, found} <= {DType.F32, DType.Flex32}


def write_record_to_onnx(
    record: Mapping[str, TensorSnapshot],
    graph: "str | os.PathLike | onnx.ModelProto | ir.Model",
    path: "str | os.PathLike",
    *,
    allow_partial: bool = False,
    external_data: Union[None, bool, str] = None,
    max_shard_size_bytes: Optional[int] = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> Path:
    """Write ``graph`` to ``path`` with its weights replaced by ``record``'s tensors.

    Each weight of the graph (:mod:`~onnxparam.onnx_io._weights`) whose module path is a key of
    ``record`` takes that tensor: an initializer gets the new data (streamed through
    ``onnx_ir.LazyTensor``; a large record goes to external data as in
    :func:`~onnxparam.onnx_io._save.save_model`), a ``Constant``-held weight gets a new ``value``.
    Param ids go into the initializer and model metadata (:mod:`~onnxparam.onnx_io._metadata`);
    record ``metadata`` entries become ``onnxparam.core.record.<key>`` model metadata. Everything else
    of the graph (nodes, opsets, other metadata) is kept. ``graph`` is never modified.

    Args:
        record: path -> snapshot (a :class:`~onnxparam.ModuleRecord`, e.g. from a burnpack file).
        graph: the ONNX model whose graph is kept.
        path: the ``.onnx`` file to write (atomically).
        allow_partial: keep the graph's own data for weights the record lacks, and ignore record
            tensors the graph has no weight for.
        external_data: as :func:`~onnxparam.onnx_io._save.save_model`.
        max_shard_size_bytes: as :func:`~onnxparam.onnx_io._save.save_model`.

    Returns:
        the ``pathlib.Path`` written.

    Raises:
        RecordError: listing every missing, unexpected, mis-shaped and mis-typed tensor by path
            (with the ONNX name), before anything is written.
        OnnxFormatError: for a malformed ``graph``.
    """
    model = weights_into_graph(record, graph, allow_partial=allow_partial, make_tensor=_lazy_tensor,
                               metadata=getattr(record, "metadata", {}))
    return save_model(model, path, external_data=external_data, max_shard_size_bytes=max_shard_size_bytes,
                      alignment_bytes=DEFAULT_ALIGNMENT_BYTES)


def weights_into_graph(
    tensors: Mapping,
    graph: "str | os.PathLike | onnx.ModelProto | ir.Model",
    *,
    allow_partial: bool,
    make_tensor: Callable[[Any, WeightSite, dict], ir.TensorProtocol],
    metadata: Optional[Mapping[str, str]] = None,
    source: Optional[str] = None,
    unmatched: Optional[dict] = None,
    from_torch: bool = False,
) -> ir.Model:
    """A copy of ``graph`` whose weights are ``tensors``, checked first; the one place that
    matches tensors to a graph's weights (used by :func:`write_record_to_onnx` and by the
    zero-copy converter).

    Args:
        tensors: module path -> an object with ``shape``, ``dtype`` and ``param_id`` (a
            :class:`~onnxparam.TensorSnapshot`, a burnpack entry ...).
        graph: the ONNX model whose graph is kept (never modified).
        allow_partial: see :func:`write_record_to_onnx`.
        make_tensor: ``(tensor, site, metadata_props) -> onnx_ir tensor`` for each weight placed;
            the result becomes the initializer, or the ``value`` of a ``Constant``-held weight.
        metadata: ``onnxparam.core.record.<key>`` model metadata entries.
        source: how messages name ``graph`` (default: its path, or the kind of object).
        unmatched: when given, receives ``"unused"``: the keys of ``tensors`` the graph has no
            weight for (not written), and ``"missing"``: ``(path, ONNX name)`` of the graph's
            weights ``tensors`` has no entry for (they keep the graph's own data); both empty unless
            ``allow_partial``, which otherwise makes them errors.
        from_torch: ``tensors`` come from a PyTorch checkpoint (the converter's ``.pt`` source):
            a weight holding a BatchNorm the exporter folded into it cannot take one. Also
            assumed when ``tensors`` hold such a BatchNorm's ``running_mean`` / ``running_var``
            (its module path from the graph's ``name_scopes``).

    Raises:
        RecordError: listing every missing, unexpected, mis-shaped and mis-typed tensor by path,
            and, with ``from_torch``, every tensor for a weight holding a BatchNorm the exporter
            folded into it (:mod:`onnxparam.lora._folded_norms`).
    """
    if isinstance(graph, ir.Model):
        base_dir = base_dir_of(graph)
        copy = ir.serde.deserialize_model(ir.serde.serialize_model(graph))  # never change the caller's model
        if base_dir:  # NOTE: before the checks, which look for the external files
            ir.external_data.set_base_dir(copy.graph, base_dir)
        loaded = load_model(copy)
    else:
        loaded = load_model(graph)
    model = loaded.model
    sites, origins = _template_sites(model, source or loaded.source)
    by_path = {site.path: site for site in sites}
    problems: list[str] = []
    writes = {}
    own = exporter_scalars(model, sites)
    # NOTE: tensors holding a folded BatchNorm's running statistics are torch's state dict too
    from_torch = from_torch or holds_folded_norms(model, list(tensors))
    folded = folded_norm_weights(model) if from_torch else {}
    for site in sites:
        entry = tensors.get(site.path)
        if entry is not None and from_torch and site.name in folded:  # NOTE: torch's tensor is the unfolded one
            problems.append(f"cannot write '{site.path}' from a PyTorch checkpoint: "
                            + folded_reason(site.path, site.name, folded[site.name]))
            continue
        if entry is not None and site.name in origins:
            _check_quantized(entry, site, origins, model, problems, writes)
            continue
        if entry is None:
            if site.name in own:
                continue  # an exporter's own scalar constant: part of the graph, kept as it is
            if not allow_partial:
                problems.append(f"missing tensor '{site.path}' (ONNX {site.name!r}): the graph expects "
                                f"{site.dtype.name} {list(site.shape)}, the record has none")
            continue
        if tuple(entry.shape) != tuple(site.shape):
            problems.append(f"shape mismatch for '{site.path}' (ONNX {site.name!r}): the graph expects "
                            f"{list(site.shape)}, the record has {list(entry.shape)}")
        if not _fits(site.dtype, entry.dtype):
            hint = ("; a QFloat tensor goes into a template holding that weight as DequantizeLinear or "
                    "MatMulInteger codes and scale (not MatMulNBits), or is written by the quantization exporter"
                    if entry.dtype is DType.QFloat else "; cast the record first")
            problems.append(f"dtype mismatch for '{site.path}' (ONNX {site.name!r}): the graph expects "
                            f"{site.dtype.name}, the record has {entry.dtype.name}{hint}")
    if not allow_partial:
        for key in tensors:
            if key not in by_path:
                problems.append(f"unexpected tensor '{key}': the graph has no weight at this path")
    if unmatched is not None:
        unmatched["unused"] = [key for key in tensors if key not in by_path]
        unmatched["missing"] = [(site.path, site.name) for site in sites if site.path not in tensors]
    if problems:
        raise RecordError(f"cannot write the record into {source or loaded.source}: {len(problems)} problem(s)",
                          problems)

    metas = site_metadata(model, sites, source or loaded.source)
    for site in sites:
        entry = tensors.get(site.path)
        if entry is None:
            continue
        old = metas.get(site.name, md.ParamMetadata())
        pid = ParamId(int(entry.param_id)) if entry.param_id is not None else old.param_id
        meta = md.ParamMetadata(pid, old.require_grad, old.lora_scale)
        metas[site.name] = meta
        props = {k: v for k, v in site.tensor.metadata_props.items() if not k.startswith(md.PREFIX)}
        props.update(md.tensor_props(meta))
        if site.name in writes:
            _write_quantized(model.graph, writes[site.name], site, md.tensor_props(meta))
            continue
        tensor = make_tensor(entry, site, props)
        if site.kind == INITIALIZER:
            site.value.const_value = tensor
        else:
            assert site.kind == CONSTANT
            site.node.attributes["value"] = ir.AttrTensor("value", tensor)
    props = md.strip_own_keys(model.metadata_props)
    props[md.PARAMS_KEY] = md.model_params_prop(metas)
    from ..core.version import __version__

    props[md.VERSION_KEY] = __version__
    for key, value in (metadata or {}).items():
        props[md.RECORD_PREFIX + key] = str(value)
    model.metadata_props.clear()
    model.metadata_props.update(props)
    return model


def exporter_scalars(model: ir.Model, sites) -> dict:
    """``{ONNX name: reason}`` for the 0-d float initializer weights among ``sites`` that are an
    exporter's own constants, not PyTorch parameters
    (:func:`onnxparam.autodiff._tables.find_scalar_constants`): no record holds them, so a
    record written into the graph need not either."""
    from ..autodiff._tables import find_scalar_constants

    scalars = [(s.name, s.value) for s in sites
               if s.shape == () and s.kind == INITIALIZER and s.dtype.is_float and not s.dtype.is_onnx_only]
    return find_scalar_constants(model, scalars) if scalars else {}


def _template_sites(model: ir.Model, source: str):
    """The weight sites of a template and, by name, the ``QuantOrigin`` of each quantized one.

    A quantized weight (:func:`~onnxparam.quant._qdq_import.fold_dequantize_weights`, on a copy)
    is one site, named and shaped as its codes, as :func:`read_onnx_record` reads it; the
    template's own codes, scale and zero point initializers are then not sites of their own."""
    from ..quant import _qdq_import

    sites = find_weights(model, source)
    if not _qdq_import.has_foldable_nodes(model):
        return sites, {}
    from ._graph_model import copy_model

    folded = copy_model(model)
    _qdq_import.fold_dequantize_weights(folded)
    quantized = [(site, _qdq_import.quant_origin(site)) for site in find_weights(folded, source)]
    origins = {site.name: origin for site, origin in quantized if origin is not None}
    if not origins:
        return sites, {}
    taken = {name for o in origins.values() for name in (o.codes, o.scale, o.zero_point) if name}
    kept = [site for site in sites if site.name not in taken]
    return [site for site, origin in quantized if origin is not None] + kept, origins


def _check_quantized(entry, site: WeightSite, origins: dict, model: ir.Model, problems: list, writes: dict) -> None:
    """Check a record entry for a quantized template weight; a fitting one's arrays go to ``writes``.

    A scale initializer the template shares (between weights, or with other nodes) takes new
    values only when every weight reading it gives the same ones."""
    import numpy as np

    from ..core.errors import QuantizationError
    from ..core.tensor import QuantizedTensor
    from ._quant_write import plan_quant_write

    origin = origins[site.name]
    if tuple(entry.shape) != tuple(site.shape):
        problems.append(f"shape mismatch for '{site.path}' (ONNX {site.name!r}): the graph expects "
                        f"{list(site.shape)}, the record has {list(entry.shape)}")
        return
    if entry.dtype is not DType.QFloat:
        problems.append(f"dtype mismatch for '{site.path}' (ONNX {site.name!r}): the graph holds it quantized "
                        f"({origin.form}), the record has {entry.dtype.name}; quantize it first")
        return
    try:
        qt = QuantizedTensor.from_data(entry.to_data())
    except QuantizationError as err:
        problems.append(f"'{site.path}' (ONNX {site.name!r}): {err}")
        return
    plan = plan_quant_write(qt, origin, model.graph, site.path)
    if isinstance(plan, str):
        problems.append(plan)
        return
    where = f"'{site.path}' (ONNX {site.name!r})"
    for other_name, (other, _) in writes.items():
        if other.scale_name == plan.scale_name and other.scales.tobytes() != plan.scales.tobytes():
            problems.append(f"{where} and {other_name!r} share the template's scale initializer "
                            f"{plan.scale_name!r}, but the record gives them different scales")
            return
    scale_value = model.graph.initializers[plan.scale_name]
    readers = sum(1 for o in origins.values() if o.scale == plan.scale_name)
    if len(scale_value.uses()) > readers and np.asarray(scale_value.const_value.numpy()).tobytes() \
            != plan.scales.tobytes():
        problems.append(f"{where}: the template's scale initializer {plan.scale_name!r} is also read by other "
                        "nodes, and the record changes its value")
        return
    writes[site.name] = (plan, qt)


def _write_quantized(graph: ir.Graph, planned, site: WeightSite, own_props: dict) -> None:
    """Put a planned write's codes and scales into the template's initializers (their dtypes);
    the codes initializer keeps its properties, the recorded scheme only when it is unchanged."""
    from ..quant import _qdq_import
    from ..quant._qdq_options import GLOBAL_SCALE_KEY, SCHEME_KEY

    plan, qt = planned
    codes_value, scale_value = graph.initializers[plan.codes_name], graph.initializers[plan.scale_name]
    props = {k: v for k, v in codes_value.const_value.metadata_props.items() if not k.startswith(md.PREFIX)}
    template_qt = _qdq_import.imported_quantized(site)
    if template_qt is None or template_qt.scheme != qt.scheme:
        props.pop(SCHEME_KEY, None)
        props.pop(GLOBAL_SCALE_KEY, None)
    props.update(own_props)
    codes_value.const_value = ir.Tensor(plan.codes, dtype=codes_value.const_value.dtype, name=plan.codes_name,
                                        metadata_props=props)
    scale_value.const_value = ir.Tensor(plan.scales, dtype=scale_value.const_value.dtype, name=plan.scale_name,
                                        metadata_props=dict(scale_value.const_value.metadata_props))


def _lazy_tensor(snap: TensorSnapshot, site: WeightSite, props: dict) -> ir.LazyTensor:
    def materialize(_snap=snap, _name=site.name, _dtype=site.tensor.dtype):
        array = _snap.to_data().to_numpy()
        return ir.Tensor(array, dtype=_dtype, name=_name)

    return ir.LazyTensor(materialize, dtype=site.tensor.dtype, shape=ir.Shape(site.shape), name=site.name,
                         metadata_props=props)
