"""ONNX sources and targets of :func:`onnxparam.convert.convert` (private; the formats are
described in :mod:`onnxparam.convert._converter`).

Inline ``.onnx`` files are streamed both ways, so peak anonymous memory stays near one tensor:

* writing a weights-only model goes through
  :func:`onnxparam.formats._onnx_stream.write_onnx_streamed` (lengths first, then each tensor's
  bytes straight from its source);
* reading maps the file and turns every ``raw_data`` initializer into an external-data
  reference *into the file itself* (:func:`_mapped_model`), so ``onnx_ir`` reads each tensor as
  a view of the map when it is needed, instead of parsing the whole protobuf into memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.dtype import DType
from ..core.errors import RecordError
from ..core.param import ParamId
from ..core.record import ModuleRecord, TensorSnapshot
from ..formats._safetensors import SCALARS_KEY, _decode_scalars, _encode_scalars
from ..formats._scratch import atomic_output
from ._report import ConvertReport
from ._tensors import _Source, _Tensor

__all__ = ["WEIGHTS_OPSET", "WEIGHTS_IR_VERSION", "OUTPUT_SUFFIX", "SOURCE_NAME_KEY"]


WEIGHTS_OPSET = 21
"""Opset of weights-only ONNX models (``Identity`` takes every dtype, bfloat16 included, since 14)."""
WEIGHTS_IR_VERSION = 10
"""IR version 10 (ONNX 1.16) is the first with initializer ``metadata_props``, where param ids go."""
OUTPUT_SUFFIX = ":value"
"""Graph output name of a weight in a weights-only model: ``<initializer name>:value``."""
SOURCE_NAME_KEY = "onnxparam.name"
"""Initializer ``metadata_props`` key of a weights-only model: the tensor's name when it is not
a module path (``'a..b'``, ``'ünï/cödé:0'``, which burnpack and safetensors files may hold).

NOTE: such an initializer is named as the source names it (ONNX names are free-form), and this
key makes reading it back give that name rather than :func:`~onnxparam.onnx_io._naming.onnx_name_to_path`
of it, so ``.bpk -> .onnx -> .bpk`` stays lossless for every name."""



def _load_mapped(path: Path):
    """``path`` as an ``onnx_ir.Model`` whose inline weights are external-data views of the file
    itself (:func:`onnxparam.formats.read_onnx_mapped`), validated as
    :func:`onnxparam.onnx_io._source.load_model` validates any model."""
    import onnx_ir as ir

    from ..core.errors import OnnxFormatError
    from ..formats._onnx_nested import read_onnx_mapped
    from ..onnx_io._source import load_model

    from ..onnx_io._source import _check_onnx_path

    _check_onnx_path(path)
    proto = read_onnx_mapped(path)
    from ..onnx_io._validate import check_structure

    check_structure(proto, str(path))  # what load_model checks of a file's protobuf
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # NOTE: onnx_ir raises several types for malformed protos
        raise OnnxFormatError(f"'{path}': the ONNX model is malformed: {e}") from e
    ir.external_data.set_base_dir(model.graph, str(path.parent))
    return load_model(model).model


def _read_onnx(path: Path) -> _Source:
    from ..onnx_io._records import read_onnx_record

    model = _load_mapped(path)
    slices: dict = {}
    if _is_weights_only(model):
        record = _read_weights_only(model, str(path), slices)
    else:
        record = read_onnx_record(model)
        slices = _graph_slices(model, record, str(path))
    metadata = dict(record.metadata)
    raw_scalars = metadata.pop(SCALARS_KEY, None)
    scalars = {}
    if raw_scalars is not None:
        try:
            scalars = _decode_scalars(path, json.loads(raw_scalars))
        except ValueError as exc:
            raise RecordError(f"'{path}': the recorded scalars are not valid JSON ({exc})") from None
    where = os.path.abspath(path)
    tensors = [_Tensor(name, s.dtype, tuple(s.shape), s.param_id, s.loader, s.scheme, None, name, slices.get(name),
                       where if name in slices else None)
               for name, s in record.items()]
    itself = frozenset({os.path.realpath(path)})
    return _Source(tensors, metadata, scalars, external_files=_external_data_files(model) - itself)


def _external_data_files(model) -> frozenset:
    """Real paths of the files ``model``'s (an ``ir.Model``) external tensors read: initializers
    and ``Constant`` / tensor attributes, subgraphs included (locations resolved against the
    model's folder, as ONNX Runtime does)."""
    import onnx_ir as ir

    from ..onnx_io._source import iter_graphs

    tensors = []
    for g in iter_graphs(model.graph):
        tensors += [value.const_value for value in g.initializers.values()]
        for node in g:
            tensors += [a.value for a in node.attributes.values()
                        if not a.is_ref() and a.type == ir.AttributeType.TENSOR]
    return frozenset(os.path.realpath(t.path) for t in tensors if isinstance(t, ir.ExternalTensor))


def _is_weights_only(model) -> bool:
    """True for a model :func:`_weights_only_model` wrote: no inputs, and every node an
    ``Identity`` from an initializer ``<name>`` to the output ``<name>:value``."""
    graph = model.graph
    if len(graph.inputs) or not len(graph.initializers):
        return False
    fed = set()
    for node in graph:
        if (node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1
                or len(node.outputs) != 1 or node.inputs[0] is None
                or node.outputs[0].name != node.inputs[0].name + OUTPUT_SUFFIX):
            return False
        fed.add(node.inputs[0].name)
    return fed == set(graph.initializers)


def _read_weights_only(model, source: str, slices: "dict | None" = None) -> ModuleRecord:
    """Every initializer of a weights-only model, in order. (The ONNX bridge's weight rules
    leave small integer / bool and 0-d initializers in a *graph*; here each one is a tensor.)

    ``slices``, when given, receives ``name -> (offset, byte count)`` for each tensor whose
    bytes lie in the file ``source`` itself as every target stores them (``raw_data`` mapped
    by :func:`_load_mapped`, the element type Burn's dtype writes back)."""
    from ..onnx_io import _metadata as md
    from ..onnx_io._naming import onnx_name_to_path
    from ..onnx_io._weights import burn_dtype, tensor_data

    values = list(model.graph.initializers.values())
    metas = md.read_params(model.metadata_props,
                           {v.name: dict(v.const_value.metadata_props) for v in values if v.const_value is not None},
                           source)
    items = {}
    for value in values:
        tensor = value.const_value
        dtype = burn_dtype(tensor.dtype)
        if dtype is None:
            raise RecordError(f"{source}: initializer {value.name!r} has element type {tensor.dtype.name}, "
                              "which Burn has no dtype for")
        meta = metas.get(value.name, md.ParamMetadata())
        name = tensor.metadata_props.get(SOURCE_NAME_KEY) or onnx_name_to_path(value.name)
        if name in items:
            raise RecordError(f"{source}: two initializers are read as the tensor {name!r} (one is {value.name!r}); "
                              f"remove or fix the {SOURCE_NAME_KEY!r} metadata of one")
        shape = tuple(int(d) for d in tensor.shape.numpy())
        items[name] = TensorSnapshot(dtype, shape, meta.param_id, lambda _t=tensor, _d=dtype: tensor_data(_t, _d))
        if slices is not None:
            where = _slice_in_file(tensor, dtype, shape, source)
            if where is not None:
                slices[name] = where
    props = model.metadata_props
    record_meta = {k[len(md.RECORD_PREFIX):]: v for k, v in props.items() if k.startswith(md.RECORD_PREFIX)}
    return ModuleRecord(items, record_meta)


def _graph_slices(model, record, source: str) -> dict:
    """``path -> (offset, byte count)`` of a graph model's initializer weights whose bytes lie in
    ``source`` itself as the record reads them (see :func:`_slice_in_file`); quantized entries
    (folded from QDQ nodes) and ``Constant`` values are computed instead."""
    from ..onnx_io._weights import INITIALIZER, find_weights

    slices = {}
    for site in find_weights(model, source):
        snap = record.get(site.path)
        if site.kind != INITIALIZER or snap is None or snap.dtype is not site.dtype or snap.dtype is DType.QFloat:
            continue
        where = _slice_in_file(site.tensor, snap.dtype, tuple(snap.shape), source)
        if where is not None:
            slices[site.path] = where
    return slices


def _slice_in_file(tensor, dtype: DType, shape: tuple, source: str):
    """``(offset, length)`` of an external tensor's bytes in ``source`` itself, when they are
    the bytes the tensor's Burn dtype stores (same element type, little-endian, exact length)."""
    import onnx_ir as ir

    if (not isinstance(tensor, ir.ExternalTensor) or dtype in (DType.Bool, DType.QFloat) or tensor.offset is None
            or tuple(int(d) for d in tensor.shape.numpy()) != shape):
        return None
    if dtype.to_onnx() != int(tensor.dtype.value) or os.path.realpath(tensor.path) != os.path.realpath(source):
        return None
    n = 1
    for d in shape:
        n *= d
    length = n * dtype.itemsize
    if tensor.length is not None and tensor.length != length:
        return None
    return int(tensor.offset), length


# -- ONNX targets -------------------------------------------------------------------------------


def _record_metadata(metadata: dict, scalars: dict) -> dict:
    meta = dict(metadata)
    if scalars:
        meta[SCALARS_KEY] = json.dumps(_encode_scalars(scalars), separators=(",", ":"), ensure_ascii=False)
    return meta


def _onnx_problems(tensors: list) -> list:
    problems = []
    for t in tensors:
        if t.dtype is DType.QFloat:
            problems.append(f"tensor '{t.name}' is quantized (QFloat): ONNX holds quantized weights as "
                            "DequantizeLinear (QDQ) initializers, written by the ONNX exporter; dequantize or export it, "
                            "or give the quantized ONNX file it came from as the template (--graph)")
    return problems


def _write_onnx(dst: Path, tensors: list, metadata: dict, scalars: dict, graph, allow_partial: bool,
                external_data, report: "ConvertReport | None" = None, from_torch: bool = False) -> None:
    # NOTE: into a template (graph), a QFloat tensor fills the template's quantized initializers
    # (onnx_io/_quant_write.py), which weights_into_graph checks
    problems = _onnx_problems(tensors) if graph is None else []
    if problems:
        raise RecordError(f"cannot write '{dst}': {len(problems)} problem(s)", problems)
    record = ModuleRecord({t.name: t.snapshot() for t in tensors}, _record_metadata(metadata, scalars))
    if graph is not None:
        _write_into_graph(dst, tensors, record.metadata, graph, allow_partial, external_data, report, from_torch)
        return
    if not external_data and (external_data is not None or _total_bytes(tensors) < _STREAM_LIMIT):
        _write_weights_only_streamed(dst, tensors, record.metadata)
        return
    from ..onnx_io._save import save_model

    model = _weights_only_model(tensors, record.metadata, lambda t, onnx_name, props: _lazy_tensor(t, onnx_name, props))
    save_model(model, dst, external_data=external_data)


def _note_unmatched(report: "ConvertReport | None", unmatched: dict) -> None:
    """Put what an ``allow_partial`` write into a template did not match into ``report``:
    ``unused`` (tensors the graph has no weight for: not written) and ``missing`` (the graph's
    weights no tensor replaced: they keep the graph's own values)."""
    if report is not None:
        report.unused += unmatched.get("unused", [])
        report.missing += unmatched.get("missing", [])


def _load_template(graph):
    """A ``graph=`` template: a path is read through a map (:func:`_load_mapped`: its inline
    weights, subgraphs' too, stay in the file until read); a model is taken as it is."""
    return _load_mapped(Path(graph)) if isinstance(graph, (str, os.PathLike)) else graph


def _write_into_graph(dst: Path, tensors: list, record_meta: dict, graph, allow_partial: bool,
                      external_data, report: "ConvertReport | None" = None, from_torch: bool = False) -> None:
    """``graph`` (a template path or model) with its weights replaced by ``tensors``, written as
    :func:`onnxparam.onnx_io.save_model` writes (inline: streamed, subgraphs included). A tensor
    whose bytes lie unchanged in its source file becomes an external reference to them for the
    time of the write, so the inline writer copies them file to file; the others are computed
    one at a time."""
    import onnx_ir as ir

    from ..onnx_io._records import _lazy_tensor, weights_into_graph
    from ..onnx_io._save import DEFAULT_ALIGNMENT_BYTES, save_model
    from ..onnx_io._weights import INITIALIZER

    def make_tensor(t: _Tensor, site, props: dict):
        in_file = t.file_range() if site.kind == INITIALIZER else None
        if in_file is not None and int(site.tensor.dtype) == t.dtype.to_onnx() and in_file.nbytes == _nbytes(t):
            return ir.ExternalTensor(in_file.path, in_file.offset, in_file.nbytes, site.tensor.dtype,
                                     shape=ir.Shape(site.shape), name=site.name, metadata_props=props)
        return _lazy_tensor(t.snapshot(), site, props)

    source = os.fspath(graph) if isinstance(graph, (str, os.PathLike)) else None
    unmatched: dict = {}
    model = weights_into_graph({t.name: t for t in tensors}, _load_template(graph), allow_partial=allow_partial,
                               make_tensor=make_tensor, metadata=record_meta, source=source, unmatched=unmatched,
                               from_torch=from_torch)
    _note_unmatched(report, unmatched)
    save_model(model, dst, external_data=external_data, alignment_bytes=DEFAULT_ALIGNMENT_BYTES)


_STREAM_LIMIT = (1 << 31) - (64 << 20)
"""Tensor bytes up to which an inline model is written (``external_data=None``): protobuf's
2 GiB message limit less room for the structure; above it the weights go to external data."""


def _nbytes(t: _Tensor) -> int:
    import numpy as np

    n = 1
    for d in t.shape:
        n *= int(d)
    return n * np.dtype(t.dtype.to_numpy()).itemsize


def _total_bytes(tensors: list) -> int:
    return sum(_nbytes(t) for t in tensors)


def _write_weights_only_streamed(dst: Path, tensors: list, record_meta: dict) -> None:
    """A weights-only model with inline weights, written field by field
    (:func:`~onnxparam.formats._onnx_stream.write_onnx_streamed`): the structure is serialized
    with placeholder initializers, which are then taken out and streamed in the same order with
    their ``metadata_props``, so only one tensor's bytes are in memory at a time."""
    import onnx_ir as ir

    from ..formats._file_range import file_range_of
    from ..formats._onnx_stream import StreamedTensor, write_onnx_streamed

    def placeholder(t: _Tensor, onnx_name: str, props: dict):
        return ir.ExternalTensor("placeholder", 0, _nbytes(t), ir.DataType(t.dtype.to_onnx()), shape=ir.Shape(t.shape),
                                 name=onnx_name, metadata_props=props)

    proto = ir.serde.serialize_model(_weights_only_model(tensors, record_meta, placeholder))
    initializers = list(proto.graph.initializer)
    del proto.graph.initializer[:]
    streamed = [
        StreamedTensor(init.name, init.data_type, tuple(init.dims),
                       file_range_of(t) or (lambda _t=t: _t.to_data().to_numpy()), _nbytes(t),
                       tuple((p.key, p.value) for p in init.metadata_props))
        for init, t in zip(initializers, tensors)
    ]
    write_onnx_streamed(dst, proto, streamed)


def _lazy_tensor(t: _Tensor, onnx_name: str, props: dict):
    import onnx_ir as ir

    dtype = ir.DataType(t.dtype.to_onnx())

    def materialize(_t=t, _name=onnx_name, _dtype=dtype):
        return ir.Tensor(_t.to_data().to_numpy(), dtype=_dtype, name=_name)

    return ir.LazyTensor(materialize, dtype=dtype, shape=ir.Shape(t.shape), name=onnx_name, metadata_props=props)


def _weights_only_model(tensors: list, record_meta: dict, make_tensor):
    """A model whose graph holds ``tensors`` as initializers, each returned by an ``Identity``."""
    import onnx_ir as ir

    from ..core.version import __version__
    from ..onnx_io import _metadata as md
    from ..onnx_io._naming import onnx_name_to_path, path_to_onnx_name

    initializers, outputs, nodes = [], [], []
    metas = {}
    names: dict[str, str] = {}
    problems = []
    for t in tensors:
        try:
            onnx_name = path_to_onnx_name(t.name)
        except ValueError:  # not a module path: ONNX names are free-form, keep it (SOURCE_NAME_KEY)
            onnx_name = t.name
        if onnx_name in names:
            problems.append(f"tensors {names[onnx_name]!r} and {t.name!r} both become the ONNX initializer "
                            f"{onnx_name!r}; rename one (--remap / remap=)")
            continue
        names[onnx_name] = t.name
        pid = None if t.param_id is None else ParamId(int(t.param_id))
        meta = md.ParamMetadata(pid)
        if not meta.is_empty():
            metas[onnx_name] = meta
        props = md.tensor_props(meta)
        if onnx_name_to_path(onnx_name) != t.name:
            props[SOURCE_NAME_KEY] = t.name
        dtype = ir.DataType(t.dtype.to_onnx())
        tensor = make_tensor(t, onnx_name, props)
        value = ir.Value(name=onnx_name, shape=ir.Shape(t.shape), type=ir.TensorType(dtype), const_value=tensor)
        initializers.append(value)
        out = ir.Value(name=onnx_name + OUTPUT_SUFFIX, shape=ir.Shape(t.shape), type=ir.TensorType(dtype))
        nodes.append(ir.Node("", "Identity", [value], outputs=[out], name=onnx_name + OUTPUT_SUFFIX))
        outputs.append(out)
    if problems:
        raise RecordError(f"cannot make a weights-only model: {len(problems)} problem(s)", problems)
    clash = sorted(n + OUTPUT_SUFFIX for n in names if n + OUTPUT_SUFFIX in names)
    if clash:
        raise RecordError(f"cannot make a weights-only model: output names {clash} are also weight names")
    graph = ir.Graph(inputs=[], outputs=outputs, nodes=nodes, initializers=initializers,
                     opset_imports={"": WEIGHTS_OPSET}, name="weights")
    model = ir.Model(graph, ir_version=WEIGHTS_IR_VERSION, producer_name="onnxparam", producer_version=__version__)
    props = {md.VERSION_KEY: __version__}
    if metas:
        props[md.PARAMS_KEY] = md.model_params_prop(metas)
    for key, value in record_meta.items():
        props[md.RECORD_PREFIX + key] = str(value)
    model.metadata_props.update(props)
    return model


def _write_onnx_zero_copy(src: Path, dst: Path, tensors: list, metadata: dict, scalars: dict, graph,
                          allow_partial: bool, report: ConvertReport) -> None:
    import onnx_ir as ir

    location = Path(os.path.relpath(os.path.abspath(src), os.path.abspath(dst.parent))).as_posix()
    base_dir = os.path.abspath(dst.parent)
    problems = _onnx_problems(tensors)
    for t in tensors:
        if t.dtype is DType.Bool and t.bool_store == "U32":
            problems.append(f"tensor '{t.name}' is a Bool stored as U32: ONNX bool is one byte, so its bytes "
                            "cannot be referenced; convert without zero_copy")
        if t.file_slice is None:  # pragma: no cover - excluded by _check_zero_copy_options
            problems.append(f"tensor '{t.name}' was transformed; zero_copy references source bytes only")
    if problems:
        raise RecordError(f"cannot write '{dst}' with zero_copy: {len(problems)} problem(s)", problems)

    def external(t: _Tensor, onnx_name: str, props: dict):
        offset, length = t.file_slice
        return ir.ExternalTensor(location, offset, length, ir.DataType(t.dtype.to_onnx()), shape=ir.Shape(t.shape),
                                 name=onnx_name, metadata_props=props, base_dir=base_dir)

    record_meta = _record_metadata(metadata, scalars)
    if graph is None:
        model = _weights_only_model(tensors, record_meta, external)
    else:
        model = _graph_with_external_weights(tensors, record_meta, graph, allow_partial, external, report)
    from ..onnx_io import _metadata as md

    header_bytes = min((t.file_slice[0] for t in tensors), default=os.path.getsize(src))
    model.metadata_props[md.ZERO_COPY_KEY] = md.zero_copy_fingerprint(src, location, header_bytes)
    proto = ir.serde.serialize_model(model)
    with atomic_output(dst) as out:
        out.write(proto.SerializeToString())
    report.notes.append(f"zero-copy: the weights stay in '{src}' (ONNX external data location '{location}')")


def _graph_with_external_weights(tensors: list, record_meta: dict, graph, allow_partial: bool, external,
                                 report: ConvertReport):
    """``graph`` (a copy) whose weights are external slices of the source (``external``)."""
    import onnx_ir as ir

    from ..onnx_io._records import weights_into_graph
    from ..onnx_io._source import iter_graphs
    from ..onnx_io._weights import INITIALIZER

    ours = set()

    def make_tensor(t, site, props):
        if site.kind == INITIALIZER:
            tensor = external(t, site.name, props)
            ours.add(id(tensor))
            return tensor
        # NOTE: a Constant node's value cannot point at external data in ONNX Runtime, so
        # Constant-held weights are copied into the model.
        report.notes.append(f"'{site.path}' is held by a Constant node: its data is copied into the model")
        return ir.Tensor(t.to_data().to_numpy(), dtype=site.tensor.dtype, name=site.name)

    source = os.fspath(graph) if isinstance(graph, (str, os.PathLike)) else None
    unmatched: dict = {}
    model = weights_into_graph({t.name: t for t in tensors}, _load_template(graph), allow_partial=allow_partial,
                               make_tensor=make_tensor, metadata=record_meta, source=source, unmatched=unmatched)
    _note_unmatched(report, unmatched)
    # Other external tensors of the graph point at files beside the *old* model: bring them in.
    for g in iter_graphs(model.graph):
        for value in g.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and id(tensor) not in ours:
                value.const_value = ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name)
    return model
