"""File-to-file weight conversion: ``.bpk`` <-> ``.safetensors`` <-> ``.onnx``, without a module.

:func:`convert` reads the source lazily, renames / filters / transposes / casts tensor by tensor,
and streams the target: at most one tensor's data is in memory at a time (for ``.onnx`` targets
whose weights stay inside the protobuf, the protobuf itself holds them all: pass
``external_data=True`` to stream there too). Every target is written atomically.

What is kept, per direction:

=======================  ==================================================================
names                    the same dotted paths in all three formats (ONNX initializer names
                         via :func:`onnxparam.onnx_io.naming.path_to_onnx_name`); a name that
                         is not a module path (``'a..b'``) is the initializer's name as it is,
                         recorded in its :data:`SOURCE_NAME_KEY` metadata for the way back
data order               burnpack data order = safetensors ``onnxparam.order`` = ONNX
                         initializer order
dtypes                   bit-exact; ``Flex32``, burnpack ``Bool`` stores and ``QFloat`` survive
                         safetensors (``onnxparam.dtypes``); in ONNX ``Flex32`` becomes ``F32``,
                         ``Bool`` is one byte, and ``QFloat`` is refused (it needs QDQ nodes)
param ids                burnpack ``param_id`` = safetensors ``onnxparam.param_ids`` = ONNX
                         initializer / model metadata (:mod:`onnxparam.onnx_io.metadata`)
metadata, scalars        burnpack ``metadata`` = safetensors ``__metadata__`` = ONNX
                         ``onnxparam.record.<key>``; scalars ride in ``onnxparam.scalars``
LoRA factors             plain tensors (``<param>.lora.a`` / ``.lora.b``), kept like any other
=======================  ==================================================================

So ``.bpk -> .safetensors -> .bpk`` and ``.bpk -> .onnx -> .bpk`` reproduce a Burn-written file
byte for byte.

ONNX targets:

* ``graph=model.onnx``: the graph's weights (:mod:`onnxparam.onnx_io.weights`) take the source's
  tensors, matched by path; every missing, unexpected, mis-shaped or mis-typed tensor is
  reported before anything is written (:func:`onnxparam.onnx_io.records.write_record_to_onnx`).
* no graph: a *weights-only* model: one initializer per tensor, in data order, each exposed as a
  graph output ``<name>:value`` through an ``Identity`` node, so ONNX Runtime can load and run
  it (it refuses a graph without outputs) and hands the weights back. Read back, every
  initializer of such a model is a tensor (small integer, bool and 0-d ones included, which
  the weight rules of :mod:`onnxparam.onnx_io.weights` leave in ordinary graphs).
* ``zero_copy=True`` (source ``.bpk`` or ``.safetensors``): the initializers are *external data
  slices of the source file* (``location`` = the source's path relative to the model's folder,
  ``offset`` = its data section start + the tensor's offset, ``length`` = its byte count), so
  the ``.onnx`` adds no weight bytes to the disk and ONNX Runtime reads the weights straight from
  the ``.bpk``. ONNX Runtime only accepts external files inside the model's folder, so the source
  must be there (or below). Burnpack tensors start on 256-byte boundaries; ORT reads slices
  that are not page-aligned into memory instead of mapping them, which changes nothing else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from .._scratch import atomic_output
from ..dtype import DType
from ..errors import RecordError
from ..formats._extensions import FORMATS, format_of
from ..formats.safetensors import SCALARS_KEY, _decode_scalars, _encode_scalars, read_safetensors, write_safetensors
from ..param import ParamId
from ..record import ModuleRecord, TensorSnapshot
from ..tensor import TensorData
from .adapters import KeyRemapper, PathFilter, _compile_all, cast_snapshot, cast_spec, transpose_snapshot
from .report import ConvertReport

__all__ = ["convert", "FORMATS", "format_of", "WEIGHTS_OPSET", "WEIGHTS_IR_VERSION", "OUTPUT_SUFFIX", "SOURCE_NAME_KEY"]


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
key makes reading it back give that name rather than :func:`~onnxparam.onnx_io.naming.onnx_name_to_path`
of it, so ``.bpk -> .onnx -> .bpk`` stays lossless for every name."""



@dataclass(frozen=True)
class _Tensor:
    """A tensor on its way through :func:`convert` (anything the three writers take)."""

    name: str
    dtype: DType
    shape: tuple
    param_id: Any
    loader: Callable[[], TensorData]
    scheme: Any = None
    bool_store: Optional[str] = None
    source_name: str = ""
    file_slice: Optional[tuple] = None
    """``(absolute offset, byte count)`` in the source file; ``None`` once the data is transformed."""

    def to_data(self) -> TensorData:
        return self.loader()

    def snapshot(self) -> TensorSnapshot:
        pid = None if self.param_id is None else ParamId(int(self.param_id))
        return TensorSnapshot(self.dtype, self.shape, pid, self.loader, self.scheme)


@dataclass
class _Source:
    tensors: list
    metadata: dict
    scalars: dict
    handle: Any = None
    external_files: frozenset = frozenset()
    """Real paths of the files an ``.onnx`` source's external tensors read (empty otherwise)."""

    def close(self) -> None:
        close = getattr(self.handle, "close", None)
        if close is not None:
            close()


def _read_burnpack(path: Path) -> _Source:
    from .. import burnpack

    bp = burnpack.read(path)
    tensors = [
        _Tensor(e.name, e.dtype, tuple(e.shape), e.param_id, e.to_data, e.scheme, e.bool_store, e.name,
                (bp.data_offset + e.data_offsets[0], e.nbytes))
        for e in bp.tensors.values()
    ]
    return _Source(tensors, dict(bp.metadata), dict(bp.scalars), bp)


def _read_safetensors(path: Path) -> _Source:
    st = read_safetensors(path)
    tensors = [
        _Tensor(name, t.dtype, tuple(t.shape), t.param_id, t.loader, t.scheme, t.bool_store, name,
                (st.data_start + t.data_offsets[0], t.data_offsets[1] - t.data_offsets[0]))
        for name, t in st.tensors.items()
    ]
    return _Source(tensors, dict(st.metadata), dict(st.scalars), st)


def _read_onnx(path: Path) -> _Source:
    from ..onnx_io.records import read_onnx_record
    from ..onnx_io.source import load_model

    model = load_model(path).model
    record = _read_weights_only(model, str(path)) if _is_weights_only(model) else read_onnx_record(model)
    metadata = dict(record.metadata)
    raw_scalars = metadata.pop(SCALARS_KEY, None)
    scalars = {}
    if raw_scalars is not None:
        try:
            scalars = _decode_scalars(path, json.loads(raw_scalars))
        except ValueError as exc:
            raise RecordError(f"'{path}': the recorded scalars are not valid JSON ({exc})") from None
    tensors = [_Tensor(name, s.dtype, tuple(s.shape), s.param_id, s.loader, s.scheme, None, name)
               for name, s in record.items()]
    return _Source(tensors, metadata, scalars, external_files=_external_data_files(model))


def _external_data_files(model) -> frozenset:
    """Real paths of the files ``model``'s (an ``ir.Model``) external tensors read: initializers
    and ``Constant`` / tensor attributes, subgraphs included (locations resolved against the
    model's folder, as ONNX Runtime does)."""
    import onnx_ir as ir

    from ..onnx_io.source import iter_graphs

    tensors = []
    for g in iter_graphs(model.graph):
        tensors += [value.const_value for value in g.initializers.values()]
        for node in g:
            tensors += [a.value for a in node.attributes.values()
                        if not a.is_ref() and a.type == ir.AttributeType.TENSOR]
    return frozenset(os.path.realpath(t.path) for t in tensors if isinstance(t, ir.ExternalTensor))


def _check_target_is_not_read(src: Path, dst: Path, source: _Source, graph) -> None:
    """Refuse a target that is the source itself or a file the source or ``graph`` reads its
    external data from: replacing it would destroy the only copy of those weights (and leave
    the ``.onnx`` pointing at other bytes).

    Raises:
        ValueError: naming the file and the model that reads it.
    """
    target = os.path.realpath(dst)
    if target == os.path.realpath(src):
        raise ValueError(f"the source and the target are the same file '{src}'; write to another file")
    readers = [(src, source.external_files)]
    if isinstance(graph, (str, os.PathLike)):
        from ..onnx_io.source import load_model

        readers.append((Path(graph), _external_data_files(load_model(graph).model)))
    for model, files in readers:
        if target in files:
            raise ValueError(
                f"the target '{dst}' holds the external data (weights) of '{model}': replacing it would "
                "destroy those weights; write to another file"
            )


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


def _read_weights_only(model, source: str) -> ModuleRecord:
    """Every initializer of a weights-only model, in order. (The ONNX bridge's weight rules
    leave small integer / bool and 0-d initializers in a *graph*; here each one is a tensor.)"""
    from ..onnx_io import metadata as md
    from ..onnx_io.naming import onnx_name_to_path
    from ..onnx_io.weights import burn_dtype, tensor_data

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
        items[name] = TensorSnapshot(
            dtype, tuple(int(d) for d in tensor.shape.numpy()), meta.param_id,
            lambda _t=tensor, _d=dtype: tensor_data(_t, _d))
    props = model.metadata_props
    record_meta = {k[len(md.RECORD_PREFIX):]: v for k, v in props.items() if k.startswith(md.RECORD_PREFIX)}
    return ModuleRecord(items, record_meta)


def convert(
    src: "str | os.PathLike",
    dst: "str | os.PathLike",
    *,
    graph: "str | os.PathLike | None" = None,
    remap=None,
    include=None,
    exclude=None,
    cast=None,
    transpose=None,
    metadata: Optional[dict] = None,
    allow_partial: bool = False,
    zero_copy: bool = False,
    lossless: bool = True,
    external_data: "bool | str | None" = None,
    progress: Optional[Callable[[str, int], None]] = None,
) -> ConvertReport:
    """Convert the weights of ``src`` into ``dst``; formats from the extensions.

    Args:
        src: a ``.bpk``, ``.safetensors`` or ``.onnx`` file.
        dst: the file to write (``.bpk``, ``.safetensors`` or ``.onnx``); replaced atomically.
        graph: for an ``.onnx`` target: an existing ONNX model whose weights are replaced by the
            source's tensors (matched by path); without it a weights-only model is written.
        remap: key remapping rules for the source names (``[(pattern, replacement)]``,
            ``{pattern: replacement}`` or a :class:`~onnxparam.convert.KeyRemapper`).
        include, exclude: regexes searched in the *source* names; tensors left out are
            reported as ``skipped``.
        cast: float precision change (``"f16"``, ``"bf16"``, ``{"f32": "f16"}`` ...; see
            :func:`~onnxparam.convert.adapters.cast_spec`).
        transpose: regexes (searched in the *target* names) of rank-2 tensors to transpose,
            e.g. ``r"^fc\\d\\.weight$"`` for Linear weights between PyTorch and Burn layouts.
        metadata: entries added to (or replacing) the source's metadata.
        allow_partial: with ``graph``: keep the graph's own data for weights the source lacks,
            and ignore source tensors the graph has no weight for.
        zero_copy: for an ``.onnx`` target from a ``.bpk`` / ``.safetensors`` source in the
            target's folder: reference the source's bytes instead of copying them (module
            docstring). No ``cast`` or ``transpose`` then.
        lossless: for a ``.safetensors`` target: write the ``onnxparam.*`` keys (ids, order,
            Burn dtypes, scalars); ``False`` writes a plain file as PyTorch tools do.
        external_data: for an ``.onnx`` target without ``zero_copy``: as
            :func:`onnxparam.onnx_io.save.save_model` (``None``: only when over 2 GiB).
        progress: called as ``progress(name, nbytes)`` as each tensor's data is produced.

    Returns:
        a :class:`~onnxparam.convert.ConvertReport`.

    Raises:
        ValueError: for an unknown extension, options that do not fit the formats, or a target
            that is the source or a file the source (or ``graph``) reads external data from.
        RecordError: for tensors that do not fit (name clash after remapping, a graph mismatch,
            a dtype the target cannot hold), each named; nothing is written then.
        OnnxFormatError: for a malformed ONNX source or graph.
        FileNotFoundError: for a missing source.
    """
    src, dst = Path(src), Path(dst)
    src_fmt, dst_fmt = format_of(src), format_of(dst)
    if graph is not None and dst_fmt != "onnx":
        raise ValueError(f"graph= applies to .onnx targets only; the target is '{dst}'")
    if zero_copy:
        _check_zero_copy_options(src, dst, src_fmt, dst_fmt, cast, transpose)
    if not src.exists():
        raise FileNotFoundError(f"no such file: '{src}'")
    source = _READERS[src_fmt](src)
    try:
        _check_target_is_not_read(src, dst, source, graph)
        report = ConvertReport(source=str(src), target=str(dst))
        tensors = _transform(source.tensors, report, remap, include, exclude, cast, transpose)
        if progress is not None:
            tensors = [_with_progress(t, progress) for t in tensors]
        meta = dict(source.metadata)
        meta.update(metadata or {})
        options = _TargetOptions(graph, allow_partial, zero_copy, lossless, external_data)
        _WRITERS[dst_fmt](src, dst, tensors, meta, source.scalars, options, report)
    finally:
        source.close()
    report.tensors = [t.name for t in tensors]
    report.bytes_written = dst.stat().st_size
    return report


def _check_zero_copy_options(src: Path, dst: Path, src_fmt: str, dst_fmt: str, cast, transpose) -> None:
    if dst_fmt != "onnx" or src_fmt not in ("burnpack", "safetensors"):
        raise ValueError(
            f"zero_copy makes an .onnx model that reads its weights from a .bpk or .safetensors file; "
            f"got '{src}' -> '{dst}'"
        )
    if cast is not None or transpose is not None:
        raise ValueError("zero_copy references the source's bytes as they are: no cast or transpose")
    rel = os.path.relpath(os.path.abspath(src), os.path.abspath(dst.parent))
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        raise ValueError(
            f"zero_copy needs '{src}' inside the ONNX model's folder '{dst.parent or '.'}': ONNX Runtime refuses "
            "external data outside it; write the .onnx beside the source file"
        )


def _transform(tensors: list, report: ConvertReport, remap, include, exclude, cast, transpose) -> list:
    remapper = KeyRemapper.of(remap)
    path_filter = PathFilter(include, exclude)
    casts = cast_spec(cast)
    transposes = _compile_all(transpose) or ()
    out: list[_Tensor] = []
    origin: dict[str, str] = {}
    problems: list[str] = []
    for t in tensors:
        if not path_filter.matches(t.name):
            report.skipped.append(t.name)
            continue
        name = remapper.apply(t.name)
        if name in origin:
            problems.append(f"name clash: tensors '{origin[name]}' and '{t.name}' are both renamed to '{name}'")
            continue
        origin[name] = t.name
        if name != t.name:
            report.renamed.append((t.name, name))
            t = replace(t, name=name)
        if transposes and any(p.search(name) for p in transposes):
            if len(t.shape) != 2 or t.dtype is DType.QFloat:
                problems.append(f"cannot transpose '{name}': only plain rank-2 tensors are transposed, it is "
                                f"{t.dtype.name} {list(t.shape)}")
                continue
            snap = transpose_snapshot(t.snapshot())
            report.transposed.append((name, list(t.shape), list(snap.shape)))
            t = replace(t, shape=tuple(snap.shape), loader=snap.loader, file_slice=None)
        if casts is not None and t.dtype in casts and casts[t.dtype] != t.dtype:
            snap = cast_snapshot(t.snapshot(), casts[t.dtype], name=name)
            report.cast.append((name, t.dtype, snap.dtype))
            t = replace(t, dtype=snap.dtype, loader=snap.loader, file_slice=None)
        out.append(t)
    if problems:
        raise RecordError(f"cannot convert: {len(problems)} problem(s)", problems)
    return out


def _with_progress(t: _Tensor, progress: Callable[[str, int], None]) -> _Tensor:
    def load(_t=t, _progress=progress):
        data = _t.loader()
        _progress(_t.name, int(getattr(data, "nbytes", 0)))
        return data

    return replace(t, loader=load)


def _write_burnpack(dst: Path, tensors: list, metadata: dict, scalars: dict) -> None:
    from .. import burnpack

    entries = (
        burnpack.TensorEntry(t.name, t.dtype, t.shape, t.loader, None if t.param_id is None else int(t.param_id),
                             t.bool_store if t.dtype is DType.Bool else None, t.scheme)
        for t in tensors
    )
    burnpack.write(dst, entries, metadata=metadata, scalars=scalars)


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
                            "DequantizeLinear (QDQ) initializers, written by the ONNX exporter; dequantize or export it")
    return problems


def _write_onnx(dst: Path, tensors: list, metadata: dict, scalars: dict, graph, allow_partial: bool,
                external_data) -> None:
    problems = _onnx_problems(tensors)
    if problems:
        raise RecordError(f"cannot write '{dst}': {len(problems)} problem(s)", problems)
    record = ModuleRecord({t.name: t.snapshot() for t in tensors}, _record_metadata(metadata, scalars))
    if graph is not None:
        from ..onnx_io.records import write_record_to_onnx

        write_record_to_onnx(record, graph, dst, allow_partial=allow_partial, external_data=external_data)
        return
    from ..onnx_io.save import save_model

    model = _weights_only_model(tensors, record.metadata, lambda t, onnx_name, props: _lazy_tensor(t, onnx_name, props))
    save_model(model, dst, external_data=external_data)


def _lazy_tensor(t: _Tensor, onnx_name: str, props: dict):
    import onnx_ir as ir

    dtype = ir.DataType(t.dtype.to_onnx())

    def materialize(_t=t, _name=onnx_name, _dtype=dtype):
        return ir.Tensor(_t.to_data().to_numpy(), dtype=_dtype, name=_name)

    return ir.LazyTensor(materialize, dtype=dtype, shape=ir.Shape(t.shape), name=onnx_name, metadata_props=props)


def _weights_only_model(tensors: list, record_meta: dict, make_tensor):
    """A model whose graph holds ``tensors`` as initializers, each returned by an ``Identity``."""
    import onnx_ir as ir

    from .._version import __version__
    from ..onnx_io import metadata as md
    from ..onnx_io.naming import onnx_name_to_path, path_to_onnx_name

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
    from ..onnx_io import metadata as md

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

    from ..onnx_io.records import weights_into_graph
    from ..onnx_io.source import iter_graphs
    from ..onnx_io.weights import INITIALIZER

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

    model = weights_into_graph({t.name: t for t in tensors}, graph, allow_partial=allow_partial,
                               make_tensor=make_tensor, metadata=record_meta)
    # Other external tensors of the graph point at files beside the *old* model: bring them in.
    for g in iter_graphs(model.graph):
        for value in g.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and id(tensor) not in ours:
                value.const_value = ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name)
    return model


@dataclass(frozen=True)
class _TargetOptions:
    """The options of :func:`convert` that a target format's writer reads (the others apply to
    every pair: renaming, filtering, casts, metadata)."""

    graph: Any
    allow_partial: bool
    zero_copy: bool
    lossless: bool
    external_data: Any


def _to_burnpack(src, dst, tensors, meta, scalars, options: _TargetOptions, report) -> None:
    _write_burnpack(dst, tensors, meta, scalars)


def _to_safetensors(src, dst, tensors, meta, scalars, options: _TargetOptions, report) -> None:
    write_safetensors(dst, [(t.name, t) for t in tensors], metadata=meta,
                      scalars=scalars if options.lossless else None, lossless=options.lossless)


def _to_onnx(src, dst, tensors, meta, scalars, options: _TargetOptions, report) -> None:
    if options.zero_copy:
        _write_onnx_zero_copy(src, dst, tensors, meta, scalars, options.graph, options.allow_partial, report)
    else:
        _write_onnx(dst, tensors, meta, scalars, options.graph, options.allow_partial, options.external_data)


_READERS = {"burnpack": _read_burnpack, "safetensors": _read_safetensors, "onnx": _read_onnx}
"""Format -> ``path -> _Source`` (lazy tensors, metadata, scalars)."""

_WRITERS = {"burnpack": _to_burnpack, "safetensors": _to_safetensors, "onnx": _to_onnx}
"""Format -> the writer of a target of that format (``_TargetOptions`` holds what it reads)."""
