"""File-to-file weight conversion: ``.bpk`` <-> ``.safetensors`` <-> ``.onnx`` (and ``.pt`` /
``.pth`` as a source), without a module.

:func:`convert` reads the source lazily (memory-mapped), renames / filters / transposes / casts
tensor by tensor, and streams the target: at most one tensor's data is in memory at a time.
Inline ``.onnx`` files too: a weights-only model is written field by field, a ``graph=``
template and an ``.onnx`` source are read through a map, subgraphs (``If`` branches) included,
and a template's tensors are streamed wherever they sit (:mod:`onnxparam.convert._onnx_files`,
:mod:`onnxparam.formats._onnx_nested`). A tensor whose bytes the conversion leaves unchanged
(no cast, no transpose) is copied from the source file to the target by the kernel
(:mod:`onnxparam.formats._file_range`): no page of it passes through Python. Every target is
written atomically.

What is kept, per direction:

=======================  ==================================================================
names                    the same dotted paths in all three formats (ONNX initializer names
                         via :func:`onnxparam.onnx_io._naming.path_to_onnx_name`); a name that
                         is not a module path (``'a..b'``) is the initializer's name as it is,
                         recorded in its :data:`SOURCE_NAME_KEY` metadata for the way back
data order               burnpack data order = safetensors ``onnxparam.order`` = ONNX
                         initializer order
dtypes                   bit-exact; ``Flex32``, burnpack ``Bool`` stores and ``QFloat`` survive
                         safetensors (``onnxparam.dtypes``); in ONNX ``Flex32`` becomes ``F32``,
                         ``Bool`` is one byte, and ``QFloat`` is refused (it needs QDQ nodes)
param ids                burnpack ``param_id`` = safetensors ``onnxparam.param_ids`` = ONNX
                         initializer / model metadata (:mod:`onnxparam.onnx_io._metadata`)
metadata, scalars        burnpack ``metadata`` = safetensors ``__metadata__`` = ONNX
                         ``onnxparam.core.record.<key>``; scalars ride in ``onnxparam.scalars``
LoRA factors             plain tensors (``<param>.lora.a`` / ``.lora.b``), kept like any other
=======================  ==================================================================

So ``.bpk -> .safetensors -> .bpk`` and ``.bpk -> .onnx -> .bpk`` reproduce a Burn-written file
byte for byte.

ONNX targets:

* ``graph=model.onnx``: the graph's weights (:mod:`onnxparam.onnx_io._weights`) take the source's
  tensors, matched by path; every missing, unexpected, mis-shaped or mis-typed tensor is
  reported before anything is written (:func:`onnxparam.onnx_io._records.write_record_to_onnx`).
* no graph: a *weights-only* model: one initializer per tensor, in data order, each exposed as a
  graph output ``<name>:value`` through an ``Identity`` node, so ONNX Runtime can load and run
  it (it refuses a graph without outputs) and hands the weights back. Read back, every
  initializer of such a model is a tensor (small integer, bool and 0-d ones included, which
  the weight rules of :mod:`onnxparam.onnx_io._weights` leave in ordinary graphs).
* ``zero_copy=True`` (source ``.bpk`` or ``.safetensors``): the initializers are *external data
  slices of the source file* (``location`` = the source's path relative to the model's folder,
  ``offset`` = its data section start + the tensor's offset, ``length`` = its byte count), so
  the ``.onnx`` adds no weight bytes to the disk and ONNX Runtime reads the weights straight from
  the ``.bpk``. ONNX Runtime only accepts external files inside the model's folder, so the source
  must be there (or below). Burnpack tensors start on 256-byte boundaries; ORT reads slices
  that are not page-aligned into memory instead of mapping them, which changes nothing else.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, replace

import numpy as np
from pathlib import Path
from typing import Any, Callable, Optional

from ..core.dtype import DType, dtype_from_numpy
from ..core.errors import RecordError, file_error
from ..core.record import ModuleRecord
from ..core.tensor import TensorData
from ..formats._extensions import FORMATS, WRITABLE, detect_format, format_of
from ..formats._scratch import check_replaceable
from ..formats._names import map_indices_contiguous
from ..formats._safetensors import read_safetensors, write_safetensors
from ._adapters import KeyRemapper, PathFilter, _compile_all, cast_snapshot, cast_spec, transpose_snapshot
from ._onnx_files import (
    OUTPUT_SUFFIX,
    SOURCE_NAME_KEY,
    WEIGHTS_IR_VERSION,
    WEIGHTS_OPSET,
    _external_data_files,
    _read_onnx,
    _write_onnx,
    _write_onnx_zero_copy,
)
from ._pytorch_layout import LAYOUT_KEY, plan_pytorch_layout, read_layout_record
from ._report import ConvertReport
from ._tensors import _Source, _Tensor

__all__ = ["convert", "read_record", "FORMATS", "format_of", "WEIGHTS_OPSET", "WEIGHTS_IR_VERSION", "OUTPUT_SUFFIX",
           "SOURCE_NAME_KEY"]


def _read_burnpack(path: Path) -> _Source:
    from .. import burnpack

    bp = burnpack.read(path)
    where = os.path.abspath(path)
    tensors = [
        _Tensor(e.name, e.dtype, tuple(e.shape), e.param_id, e.to_data, e.scheme, e.bool_store, e.name,
                (bp.data_offset + e.data_offsets[0], e.nbytes), where)
        for e in bp.tensors.values()
    ]
    return _Source(tensors, dict(bp.metadata), dict(bp.scalars), bp)


def _read_safetensors(path: Path) -> _Source:
    st = read_safetensors(path)
    where = os.path.abspath(path)
    tensors = [
        _Tensor(name, t.dtype, tuple(t.shape), t.param_id, t.loader, t.scheme, t.bool_store, name,
                (st.data_start + t.data_offsets[0], t.data_offsets[1] - t.data_offsets[0]), where)
        for name, t in st.tensors.items()
    ]
    return _Source(tensors, dict(st.metadata), dict(st.scalars), st)


def _checkpoint_dtype(np_dtype) -> DType:
    """The ``DType`` of a checkpoint tensor's numpy dtype: Burn's, or an ONNX-only one (float8,
    complex) that ``.safetensors`` / ``.onnx`` targets hold and a ``.bpk`` target refuses, naming
    the tensor.

    Raises:
        DTypeError: for a dtype neither Burn nor ONNX has.
    """
    from ..core.dtype import ONNX_ONLY_ELEMENT_TYPES, _numpy_dtype

    try:
        return dtype_from_numpy(np_dtype)
    except ValueError:
        wanted = np.dtype(np_dtype)
        for dtype in ONNX_ONLY_ELEMENT_TYPES:
            if dtype is DType.String:
                continue
            try:
                if _numpy_dtype(dtype) == wanted:
                    return dtype
            except (ValueError, AttributeError):
                continue
        raise


def _read_pytorch(path: Path, top_level_key: Optional[str] = None) -> _Source:
    from ..formats._pytorch import read_pytorch

    checkpoint = read_pytorch(path, top_level_key=top_level_key)
    tensors, problems = [], []
    where = os.path.abspath(path)
    lazy = checkpoint.tensors
    for name in lazy:
        try:
            dtype = _checkpoint_dtype(lazy.dtype(name))
        except ValueError as exc:
            problems.append(f"'{name}': {exc}")
            continue
        shape = tuple(int(d) for d in lazy.shape(name))

        def load(_name=name, _dtype=dtype, _shape=shape):  # NOTE: a strided tensor is copied only here
            return TensorData(lazy[_name], _dtype, _shape)

        in_file = lazy.file_slice(name)
        tensors.append(_Tensor(name, dtype, shape, None, load, source_name=name, file_slice=in_file,
                               source_path=where if in_file is not None else None))
    if problems:
        raise RecordError(f"'{path}': {len(problems)} tensor(s) of a dtype neither Burn nor ONNX has", problems)
    notes = [f"not a tensor, left out: '{name}'" for name in checkpoint.skipped]
    notes += [f"one tensor in the file, written once per name: {', '.join(group)}" for group in checkpoint.tied]
    return _Source(tensors, {}, {}, notes=notes)


def read_record(path: "str | os.PathLike", *, top_level_key: Optional[str] = None) -> ModuleRecord:
    """The tensors of a ``.bpk``, ``.safetensors``, ``.onnx`` or ``.pt`` / ``.pth`` file as a
    lazy :class:`~onnxparam.ModuleRecord` (names as :func:`convert` reads them; the data stays in
    the mapped file until read). ``top_level_key`` selects a checkpoint dict's entry (``.pt``).

    The format is told by the file's content (:func:`~onnxparam.formats._extensions.detect_format`),
    not its name.

    Raises:
        FileMissingError: a missing file. IsAFolderError: a folder.
        RecordError / OnnxFormatError: a file of no known format (naming what was found), or a
            malformed one.
    """
    path = Path(path)
    fmt = detect_format(path)
    source = _read_pytorch(path, top_level_key) if fmt == "pytorch" else _READERS[fmt](path)
    return ModuleRecord({t.name: t.snapshot() for t in source.tensors}, source.metadata)


def _check_target_is_not_read(src: Path, dst: Path, source: _Source, graph) -> None:
    """Refuse a target that is the source itself or a file the source or ``graph`` reads its
    external data from: replacing it would destroy the only copy of those weights (and leave
    the ``.onnx`` pointing at other bytes).

    Raises:
        RecordError: naming the file and the model that reads it.
    """
    target = os.path.realpath(dst)
    if target == os.path.realpath(src):
        raise RecordError(f"the source and the target are the same file '{src}'; write to another file")
    readers = [(src, source.external_files)]
    if isinstance(graph, (str, os.PathLike)):
        from ._onnx_files import _load_template

        if target == os.path.realpath(graph):
            raise RecordError(f"the target and the graph template are the same file '{graph}'; write to another file")
        readers.append((Path(graph), _external_data_files(_load_template(graph))))
    for model, files in readers:
        if target in files:
            raise RecordError(
                f"the target '{dst}' holds the external data (weights) of '{model}': replacing it would "
                "destroy those weights; write to another file"
            )


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
    no_transpose=None,
    pytorch: bool = False,
    top_level_key: Optional[str] = None,
    contiguous_indices: bool = False,
    metadata: Optional[dict] = None,
    allow_partial: bool = False,
    zero_copy: bool = False,
    lossless: bool = True,
    external_data: "bool | str | None" = None,
    progress: Optional[Callable[[str, int], None]] = None,
) -> ConvertReport:
    """Convert the weights of ``src`` into ``dst``: the source's format is told by its content
    (magic bytes / header: burnpack, safetensors, ONNX, PyTorch zip, legacy stream or legacy tar),
    the target's by its extension.

    Args:
        src: a ``.bpk``, ``.safetensors``, ``.onnx`` or ``.pt`` / ``.pth`` (``torch.save``,
            read without torch by :func:`onnxparam.formats._pytorch.read_pytorch`) file.
        dst: the file to write (``.bpk``, ``.safetensors`` or ``.onnx``); replaced atomically.
        graph: for an ``.onnx`` target: an existing ONNX model whose weights are replaced by the
            source's tensors (matched by path); without it a weights-only model is written.
        remap: key remapping rules for the source names (``[(pattern, replacement)]``,
            ``{pattern: replacement}`` or a :class:`~onnxparam.convert.KeyRemapper`).
        include, exclude: regexes searched in the *source* names; tensors left out are
            reported as ``skipped``.
        cast: float precision change (``"f16"``, ``"bf16"``, ``{"f32": "f16"}`` ...; see
            :func:`~onnxparam.convert._adapters.cast_spec`).
        transpose: regexes (searched in the *target* names) of rank-2 tensors to transpose,
            e.g. ``r"^fc\\d\\.weight$"`` for Linear weights between PyTorch and Burn layouts.
        no_transpose: regexes (target names) of tensors ``pytorch=True`` must not transpose.
        pytorch: PyTorch <-> Burn layouts without a module, from the file's own evidence: a
            rank-2 ``weight``'s layout is the dim its bias follows (its own when not square, else
            its family's or the whole file's): ``nn.Linear``'s ``(out, in)`` is transposed,
            GPT-2 ``Conv1D``'s ``(in, out)`` kept (``report.kept``); norm ``weight``/``bias``
            <-> ``gamma``/``beta``; ``num_batches_tracked`` left out. Every weight the file does
            not settle is left alone and listed in ``report.untouched`` with the reason (see
            :mod:`onnxparam.convert._pytorch_layout`). The direction
            follows the formats: to Burn from a ``.pt`` / ``.safetensors`` source, to PyTorch
            into a ``.safetensors`` target.
        top_level_key: for a ``.pt`` source: the checkpoint dict's entry holding the state dict.
        contiguous_indices: first renumber the integer segments of the source names to 0, 1,
            2 ... per position (``fc.0, fc.2`` -> ``fc.0, fc.1``; Burn's
            ``map_indices_contiguous``, for ``nn.Sequential`` gaps); ``include`` / ``exclude`` /
            ``remap`` then see the renumbered names.
        metadata: entries added to (or replacing) the source's metadata.
        allow_partial: with ``graph``: keep the graph's own data for weights the source lacks,
            and ignore source tensors the graph has no weight for.
        zero_copy: for an ``.onnx`` target from a ``.bpk`` / ``.safetensors`` source in the
            target's folder: reference the source's bytes instead of copying them (module
            docstring). No ``cast`` or ``transpose`` then.
        lossless: for a ``.safetensors`` target: write the ``onnxparam.*`` keys (ids, order,
            Burn dtypes, scalars); ``False`` writes a plain file as PyTorch tools do.
        external_data: for an ``.onnx`` target without ``zero_copy``: as
            :func:`onnxparam.onnx_io._save.save_model` (``None``: only when over 2 GiB).
        progress: called as ``progress(name, nbytes)`` as each tensor's data is produced.

    Returns:
        a :class:`~onnxparam.convert.ConvertReport`.

    Raises:
        RecordError: (a ``ValueError``) for a target extension no writer has, a source of no
            known format, options that do not fit the formats, or a target that is the source
            or a file the source (or ``graph``) reads external data from.
        FileAccessError: a missing source (``FileMissingError``), a source or target that is a
            folder (``IsAFolderError``), a read-only target or folder (``FilePermissionError``):
            all checked before any work.
        RecordError: for tensors that do not fit (name clash after remapping, a graph mismatch,
            a dtype the target cannot hold), each named; nothing is written then.
        OnnxFormatError: for a malformed ONNX source or graph.
        FileNotFoundError: for a missing source.
    """
    src, dst = Path(src), Path(dst)
    dst_fmt = format_of(dst)
    if dst_fmt not in WRITABLE:
        raise RecordError(f"cannot write '{dst}': {dst_fmt} files are read, not written; write a "
                          ".safetensors file for PyTorch (torch loads it with safetensors.torch.load_file)")
    if graph is not None and dst_fmt != "onnx":
        raise RecordError(f"graph= applies to .onnx targets only; the target is '{dst}'")
    src_fmt = detect_format(src)
    to_pytorch = _pytorch_direction(src, dst, src_fmt, dst_fmt) if pytorch else None
    if top_level_key is not None and src_fmt != "pytorch":
        raise RecordError(f"top_level_key applies to PyTorch checkpoints; the source '{src}' is a {src_fmt} file")
    if zero_copy:
        _check_zero_copy_options(src, dst, src_fmt, dst_fmt, cast, transpose)
    check_replaceable(dst)  # a folder, a read-only file or folder: refused before any work
    source = _read_pytorch(src, top_level_key) if src_fmt == "pytorch" else _READERS[src_fmt](src)
    try:
        _check_target_is_not_read(src, dst, source, graph)
        report = ConvertReport(source=str(src), target=str(dst))
        report.notes += source.notes
        if contiguous_indices:
            renumbered = map_indices_contiguous([t.name for t in source.tensors])
            report.renamed += [(old, new) for old, new in renumbered.items() if old != new]
            source.tensors = [replace(t, name=renumbered[t.name]) for t in source.tensors]
        plan = None
        if to_pytorch is not None:
            plan = plan_pytorch_layout([(t.name, t.shape) for t in source.tensors], to_pytorch,
                                       read_layout_record(source.metadata, str(src)))
            user = KeyRemapper.of(remap)
            if not isinstance(user, KeyRemapper):
                raise RecordError("pytorch=True adds renaming rules before remap's: give remap as (pattern, "
                                 "replacement) pairs or a KeyRemapper")
            remap = KeyRemapper(plan.rules + list(user.rules))
        tensors = _transform(source.tensors, report, remap, include, exclude, cast, transpose, no_transpose, plan)
        if progress is not None:
            tensors = [_with_progress(t, progress) for t in tensors]
        meta = dict(source.metadata)
        if plan is not None:
            _record_layouts(plan, report, meta, dst_fmt == "safetensors" and not lossless)
        elif LAYOUT_KEY in meta:  # carried through: follow the renames, drop what was not written
            recorded = read_layout_record(meta, str(src))
            renamed, written = dict(report.renamed), {t.name for t in tensors}
            carried = {renamed.get(k, k): v for k, v in recorded.items() if renamed.get(k, k) in written}
            if carried and not (dst_fmt == "safetensors" and not lossless):
                meta[LAYOUT_KEY] = json.dumps(carried, separators=(",", ":"), ensure_ascii=False)
            else:
                del meta[LAYOUT_KEY]
        meta.update(metadata or {})
        options = _TargetOptions(graph, allow_partial, zero_copy, lossless, external_data, src_fmt == "pytorch")
        _WRITERS[dst_fmt](src, dst, tensors, meta, source.scalars, options, report)
    finally:
        source.close()
    not_written = set(report.unused)
    report.tensors = [t.name for t in tensors if t.name not in not_written]
    report.bytes_written = dst.stat().st_size
    return report


def _pytorch_direction(src: Path, dst: Path, src_fmt: str, dst_fmt: str) -> bool:
    """``True`` (Burn -> PyTorch) for a ``.safetensors`` target from a Burn-layout source,
    ``False`` (PyTorch -> Burn) from a ``.pt`` / ``.safetensors`` source to a Burn-side target."""
    if dst_fmt == "safetensors" and src_fmt in ("burnpack", "onnx"):
        return True
    if src_fmt in ("pytorch", "safetensors") and dst_fmt in ("burnpack", "onnx"):
        return False
    raise RecordError(f"pytorch=True converts between PyTorch's layout (a .pt / .safetensors file) and Burn's "
                     f"(.bpk / .onnx); '{src}' -> '{dst}' has PyTorch's layout on "
                     f"{'both sides' if dst_fmt == 'safetensors' else 'neither side'}")


def _check_zero_copy_options(src: Path, dst: Path, src_fmt: str, dst_fmt: str, cast, transpose) -> None:
    if dst_fmt != "onnx" or src_fmt not in ("burnpack", "safetensors"):
        raise RecordError(
            f"zero_copy makes an .onnx model that reads its weights from a .bpk or .safetensors file; "
            f"got '{src}' -> '{dst}'"
        )
    if cast is not None or transpose is not None:
        raise RecordError("zero_copy references the source's bytes as they are: no cast or transpose")
    rel = os.path.relpath(os.path.abspath(src), os.path.abspath(dst.parent))
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        raise RecordError(
            f"zero_copy needs '{src}' inside the ONNX model's folder '{dst.parent or '.'}': ONNX Runtime refuses "
            "external data outside it; write the .onnx beside the source file"
        )


def _transform(tensors: list, report: ConvertReport, remap, include, exclude, cast, transpose, no_transpose=None,
               plan=None) -> list:
    remapper = KeyRemapper.of(remap)
    path_filter = PathFilter(include, exclude)
    casts = cast_spec(cast)
    transposes = _compile_all(transpose) or ()
    keep_as_is = _compile_all(no_transpose) or ()
    auto = set(plan.transpose) if plan is not None else set()
    decided = (auto | {name for name, _ in plan.kept}) if plan is not None else set()
    dropped = set(plan.dropped) if plan is not None else set()
    if plan is not None:
        for name, why in plan.untouched:
            target = remapper.apply(name)
            if not any(p.search(target) for p in transposes + keep_as_is):
                report.untouched.append((name, why))
        for name, why in plan.kept:
            if not any(p.search(remapper.apply(name)) for p in transposes):
                report.kept.append((name, why))
    out: list[_Tensor] = []
    origin: dict[str, str] = {}
    problems: list[str] = []
    for t in tensors:
        if not path_filter.matches(t.name):
            report.skipped.append(t.name)
            continue
        if t.name in dropped:
            report.ignored.append(t.name)
            continue
        name = remapper.apply(t.name)
        if name in origin:
            problems.append(f"name clash: tensors '{origin[name]}' and '{t.name}' are both renamed to '{name}'")
            continue
        origin[name] = t.name
        if name != t.name:
            report.renamed.append((t.name, name))
            t = replace(t, name=name)
        source_name = origin[name]
        by_user = any(p.search(name) for p in transposes + keep_as_is)
        wanted = (source_name in auto or any(p.search(name) for p in transposes)) and not any(
            p.search(name) for p in keep_as_is)
        if plan is not None and len(t.shape) == 2 and (source_name in decided or by_user):
            plan.layouts[name] = bool(wanted)
            if wanted and source_name in plan.guessed and not by_user:
                plan.guessed_written.append(name)
        if wanted:
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


def _record_layouts(plan, report: ConvertReport, meta: dict, plain: bool) -> None:
    """Record in the target's metadata (``meta``) which written rank-2 tensors PyTorch holds
    transposed (:data:`~onnxparam.convert._pytorch_layout.LAYOUT_KEY`), so converting the file
    back knows GPT-2's ``Conv1D`` from ``nn.Linear``; note the transposes that were guesses."""
    meta.pop(LAYOUT_KEY, None)
    if plan.layouts and not plain:
        meta[LAYOUT_KEY] = json.dumps(plan.layouts, separators=(",", ":"), ensure_ascii=False)
    guessed = plan.guessed_written
    if guessed:
        shown = ", ".join(f"'{n}'" for n in guessed[:3]) + (f" and {len(guessed) - 3} more" if len(guessed) > 3 else "")
        report.notes.append(
            f"{len(guessed)} weight(s) transposed to nn.Linear's (out, in) from their shapes alone ({shown}): the file "
            f"does not record their PyTorch layout ({LAYOUT_KEY!r}). A module that holds (in, out) (GPT-2's Conv1D) "
            "needs them untransposed: add --no-transpose RE (no_transpose=[RE]) for those, or load into the module")


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
                             t.bool_store if t.dtype is DType.Bool else None, t.scheme, t.file_range())
        for t in tensors
    )
    burnpack.write(dst, entries, metadata=metadata, scalars=scalars)


@dataclass(frozen=True)
class _TargetOptions:
    """The options of :func:`convert` that a target format's writer reads (the others apply to
    every pair: renaming, filtering, casts, metadata)."""

    graph: Any
    allow_partial: bool
    zero_copy: bool
    lossless: bool
    external_data: Any
    from_torch: bool = False  # a PyTorch checkpoint source (its tensors are torch's, unfolded)


def _to_burnpack(src, dst, tensors, meta, scalars, options: _TargetOptions, report) -> None:
    _write_burnpack(dst, tensors, meta, scalars)


def _to_safetensors(src, dst, tensors, meta, scalars, options: _TargetOptions, report) -> None:
    write_safetensors(dst, [(t.name, t) for t in tensors], metadata=meta,
                      scalars=scalars if options.lossless else None, lossless=options.lossless)


def _to_onnx(src, dst, tensors, meta, scalars, options: _TargetOptions, report) -> None:
    if options.zero_copy:
        _write_onnx_zero_copy(src, dst, tensors, meta, scalars, options.graph, options.allow_partial, report)
    else:
        _write_onnx(dst, tensors, meta, scalars, options.graph, options.allow_partial, options.external_data, report,
                    from_torch=options.from_torch)


_READERS = {"burnpack": _read_burnpack, "safetensors": _read_safetensors, "onnx": _read_onnx}
"""Format -> ``path -> _Source`` (lazy tensors, metadata, scalars)."""

_WRITERS = {"burnpack": _to_burnpack, "safetensors": _to_safetensors, "onnx": _to_onnx}
"""Format -> the writer of a target of that format (``_TargetOptions`` holds what it reads)."""
