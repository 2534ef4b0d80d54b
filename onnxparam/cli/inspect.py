"""``onnxparam inspect``: the tensors and metadata of a .bpk, .onnx, .safetensors, .pt / .pth or
.onnx_adapter file."""

import argparse
import json
import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ._common import COUNT_CHUNK_BYTES, EXIT_OK, _existing, _file_format, _out

if TYPE_CHECKING:
    import numpy as np

FLOAT_BITS = {
    # Burn dtype name -> (unsigned view, exponent mask, mantissa mask) of the IEEE-754 layout.
    "F64": ("uint64", 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
    "F32": ("uint32", 0x7F80_0000, 0x007F_FFFF),
    "Flex32": ("uint32", 0x7F80_0000, 0x007F_FFFF),
    "F16": ("uint16", 0x7C00, 0x03FF),
    "BF16": ("uint16", 0x7F80, 0x007F),
}
"""How NaN / Inf are found in a float tensor's bytes: all exponent bits set means non-finite,
and then a zero mantissa means Inf, any other NaN. Working on the bits treats every float width
alike (bfloat16 has no numpy type of its own) and never converts a value. NOTE: numpy is
imported where a tensor is scanned, not with the module (``onnxparam --help`` stays fast)."""


@dataclass
class _TensorInfo:
    """One row of ``inspect``: what the file says about a tensor, and where its bytes are."""

    name: str
    dtype: Any
    shape: tuple
    nbytes: int
    param_id: Optional[int]
    scheme: Any = None
    file_slice: Optional[tuple] = None
    """``(absolute offset, byte count)`` in the file, for memory-mapped scans."""
    loader: Optional[Callable] = None
    """Returns the tensor's data when it is not a plain slice of the file (ONNX)."""
    nan: Optional[int] = None
    inf: Optional[int] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype.name,
            "shape": list(self.shape),
            "bytes": self.nbytes,
            "param_id": self.param_id,
            "scheme": _scheme_text(self.scheme),
            "nan": self.nan,
            "inf": self.inf,
        }


@dataclass
class _Inspected:
    path: Path
    format: str
    file_bytes: int
    info: dict
    metadata: dict
    scalars: dict
    tensors: list = field(default_factory=list)


QUANT_OPS_KEY = "onnxparam.quant.ops"
"""The export's per-op report (:data:`onnxparam.quant._qdq_forms.REPORT_KEY`)."""
QUANT_ACCURACY_KEY = "onnxparam.quant.accuracy"
"""``onnxparam quantize``'s accuracy report (:data:`onnxparam.quant._accuracy.ACCURACY_KEY`; named
here so ``inspect`` imports no quant module for it)."""


def _scheme_text(scheme) -> Optional[str]:
    """``Q8S per-tensor`` / ``Q4S block [32] (F32 scales)``: a QFloat tensor's scheme in words."""
    if scheme is None:
        return None
    try:
        words = [scheme.value.name]
        if scheme.block is not None:
            words.append(f"block {list(scheme.block.size.dims)} ({scheme.block.dtype.name} scales)")
        else:
            words.append("per-tensor")
        store = getattr(scheme.store, "kind", None)
        if store and store != "Native":
            words.append(f"store {scheme.store!r}")
        return " ".join(words)
    except AttributeError:  # pragma: no cover - a scheme object of another shape
        return repr(scheme)


def _nbytes(dtype, shape, scheme) -> int:
    from ..core.dtype import DType

    if dtype is DType.QFloat:
        from ..quant import quantized_nbytes

        return int(quantized_nbytes(tuple(shape), scheme))
    return math.prod(shape) * dtype.itemsize


def _scalar_json(scalar) -> dict:
    return {"kind": scalar.kind, "value": scalar.value}


def _read_burnpack_info(path: Path) -> _Inspected:
    from .. import burnpack

    with burnpack.read(path) as f:
        tensors = [
            _TensorInfo(
                e.name,
                e.dtype,
                tuple(e.shape),
                e.nbytes,
                e.param_id,
                e.scheme,
                (f.data_offset + e.data_offsets[0], e.nbytes),
            )
            for e in f.tensors.values()
        ]
        info = {"version": f.version, "data_offset": f.data_offset}
        return _Inspected(
            path,
            "burnpack",
            path.stat().st_size,
            info,
            dict(f.metadata),
            {k: _scalar_json(v) for k, v in f.scalars.items()},
            tensors,
        )


SAFETENSORS_LENGTH_BYTES = 8
"""A safetensors file starts with its JSON header's length, a little-endian u64."""


def _read_safetensors_info(path: Path) -> _Inspected:
    from ..convert import read_safetensors

    with read_safetensors(path) as st:
        tensors = [
            _TensorInfo(
                name,
                t.dtype,
                tuple(t.shape),
                t.data_offsets[1] - t.data_offsets[0],
                None if t.param_id is None else int(t.param_id),
                t.scheme,
                (st.data_start + t.data_offsets[0], t.data_offsets[1] - t.data_offsets[0]),
            )
            for name, t in st.tensors.items()
        ]
        metadata, scalars = dict(st.metadata), {k: _scalar_json(v) for k, v in st.scalars.items()}
        data_start = st.data_start
    # The raw __metadata__ (with this library's onnxparam.* keys), which the reader has validated.
    with open(path, "rb") as handle:
        handle.seek(SAFETENSORS_LENGTH_BYTES)
        header = json.loads(handle.read(data_start - SAFETENSORS_LENGTH_BYTES))
    info = {"data_offset": data_start, "header_metadata": header.get("__metadata__", {})}
    return _Inspected(path, "safetensors", path.stat().st_size, info, metadata, scalars, tensors)


def _read_onnx_info(path: Path) -> _Inspected:
    import onnx_ir as ir

    from ..convert._onnx_files import _is_weights_only, _load_mapped, _read_weights_only
    from ..formats._safetensors import SCALARS_KEY, _decode_scalars
    from ..onnx_io._records import read_onnx_record

    # NOTE: the converter's own readers (private helpers of onnxparam.convert._converter), so
    # `inspect` lists exactly the tensors `convert` would carry: every initializer of a
    # weights-only model, the weights (onnxparam.onnx_io._weights) of any other graph.
    # Inline weights are read as views of the mapped file (never the whole protobuf at once).
    model = _load_mapped(path)
    weights_only = _is_weights_only(model)
    record = _read_weights_only(model, str(path)) if weights_only else read_onnx_record(model)
    metadata = dict(record.metadata)
    scalars = {}
    raw_scalars = metadata.pop(SCALARS_KEY, None)
    if raw_scalars is not None:
        scalars = {k: _scalar_json(v) for k, v in _decode_scalars(path, json.loads(raw_scalars)).items()}
    tensors = [
        _TensorInfo(
            name,
            s.dtype,
            tuple(s.shape),
            _nbytes(s.dtype, s.shape, s.scheme),
            None if s.param_id is None else int(s.param_id),
            s.scheme,
            loader=s.to_data,
        )
        for name, s in record.items()
    ]

    def value_json(v) -> dict:
        dtype = v.dtype.name if v.dtype is not None else None
        if v.type is not None and not isinstance(v.type, ir.TensorType):
            dtype = repr(v.type)  # a sequence, optional or map: its whole type (e.g. Sequence(Map(INT64, ...)))
        dims = None if v.shape is None else [d if isinstance(d, int) else str(d) for d in v.shape]
        return {"name": v.name, "dtype": dtype, "shape": dims}

    externals = sorted(
        {
            t.const_value.location
            for t in model.graph.initializers.values()
            if isinstance(t.const_value, ir.ExternalTensor) and t.const_value.location != path.name
        }
    )
    # NOTE: the weight rules (onnxparam.onnx_io._weights) leave small integer / bool and 0-d
    # initializers (shapes, axes, indices) in the graph: they are counted here, not listed.
    from ..onnx_io._naming import onnx_name_to_path

    non_weights = 0 if weights_only else sum(
        1 for name in model.graph.initializers if onnx_name_to_path(name) not in record
    )
    info = {
        "ir_version": model.ir_version,
        "opset_imports": dict(model.opset_imports),
        "producer_name": model.producer_name,
        "producer_version": model.producer_version,
        "domain": model.domain,
        "model_version": model.model_version,
        "metadata_props": dict(model.metadata_props),
        "inputs": [value_json(v) for v in model.graph.inputs],
        "outputs": [value_json(v) for v in model.graph.outputs],
        "nodes": len(model.graph),
        "initializers": len(model.graph.initializers),
        "non_weight_initializers": non_weights,
        "external_data": externals,
        "weights_only": weights_only,
    }
    return _Inspected(path, "onnx", path.stat().st_size, info, metadata, scalars, tensors)


def _count_bits(words: "np.ndarray", exp_mask: int, mant_mask: int) -> tuple[int, int]:
    import numpy as np

    exp = words.dtype.type(exp_mask)
    nonfinite = (words & exp) == exp
    if not nonfinite.any():
        return 0, 0
    inf = int(np.count_nonzero(nonfinite & ((words & words.dtype.type(mant_mask)) == 0)))
    return int(np.count_nonzero(nonfinite)) - inf, inf


def _count_nonfinite(inspected: _Inspected) -> None:
    """Fill ``nan`` / ``inf`` of every plain float tensor, streaming :data:`COUNT_CHUNK_BYTES` at a time."""
    import numpy as np

    rows = [t for t in inspected.tensors if t.dtype.name in FLOAT_BITS]
    if not rows:
        return
    page = mmap.PAGESIZE
    mapping = None
    try:
        if any(t.file_slice is not None for t in rows) and inspected.file_bytes:
            with open(inspected.path, "rb") as handle:
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        for t in rows:
            view, exp_mask, mant_mask = FLOAT_BITS[t.dtype.name]
            itemsize = np.dtype(view).itemsize
            nan = inf = 0
            if t.file_slice is not None and mapping is not None:
                offset, nbytes = t.file_slice
                step = COUNT_CHUNK_BYTES - COUNT_CHUNK_BYTES % itemsize
                for start in range(offset, offset + nbytes, step):
                    count = min(step, offset + nbytes - start) // itemsize
                    words = np.frombuffer(mapping, dtype=view, count=count, offset=start)
                    n, i = _count_bits(words, exp_mask, mant_mask)
                    del words
                    nan, inf = nan + n, inf + i
                    # NOTE: drop the scanned pages from this process (they stay in the page
                    # cache), so scanning a file larger than memory keeps the RSS flat.
                    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                        lo = start - start % page
                        mapping.madvise(mmap.MADV_DONTNEED, lo, min(start + count * itemsize, len(mapping)) - lo)
            elif t.loader is not None:
                array = np.ascontiguousarray(t.loader().to_numpy()).reshape(-1)
                words = array.view(view)
                step = COUNT_CHUNK_BYTES // itemsize
                for start in range(0, words.size, step):
                    n, i = _count_bits(words[start : start + step], exp_mask, mant_mask)
                    nan, inf = nan + n, inf + i
                del array, words
            t.nan, t.inf = nan, inf
    finally:
        if mapping is not None:
            mapping.close()


def _read_pytorch_info(path: Path) -> _Inspected:
    """A ``torch.save`` checkpoint, read without torch (restricted unpickler, nothing runs)."""
    from ..core.dtype import dtype_from_numpy
    from ..core.tensor import TensorData
    from ..formats._pytorch import read_pytorch

    checkpoint = read_pytorch(path)
    tensors = []
    lazy = checkpoint.tensors  # NOTE: strided tensors are copied only when their values are read
    for name in lazy:
        dtype = dtype_from_numpy(lazy.dtype(name))
        shape = tuple(int(d) for d in lazy.shape(name))
        tensors.append(_TensorInfo(name, dtype, shape, math.prod(shape) * lazy.dtype(name).itemsize, None,
                                   loader=lambda _n=name, _d=dtype, _s=shape: TensorData(lazy[_n], _d, _s)))
    info = {"byteorder": checkpoint.byteorder, "skipped": list(checkpoint.skipped),
            "tied": [list(g) for g in checkpoint.tied], "shared": [list(g) for g in checkpoint.shared]}
    return _Inspected(path, "pytorch", path.stat().st_size, info, {}, {}, tensors)


def _read_onnx_adapter_info(path: Path) -> _Inspected:
    """An ONNX Runtime ``.onnx_adapter`` file (read by ONNX Runtime): its LoRA factors as tensors,
    its versions and, for each ``<W>.lora.a`` / ``<W>.lora.b`` pair, the rank."""
    from ..core.dtype import dtype_from_numpy
    from ..core.tensor import TensorData
    from ..lora._adapter_file import read_onnx_adapter

    content = read_onnx_adapter(path)
    tensors = []
    for name, array in content["parameters"].items():
        dtype = dtype_from_numpy(array.dtype)
        shape = tuple(int(d) for d in array.shape)
        tensors.append(_TensorInfo(name, dtype, shape, int(array.nbytes), None,
                                   loader=lambda _a=array, _d=dtype, _s=shape: TensorData(_a, _d, _s)))
    params = content["parameters"]
    ranks = {}
    for name, array in params.items():
        if name.endswith(".lora.a") and array.ndim == 2:
            b = params.get(name[:-1] + "b")
            if b is not None and b.ndim == 2 and b.shape[0] == array.shape[1]:
                ranks[name[: -len(".lora.a")]] = int(array.shape[1])
    info = {key: content[key] for key in ("format_version", "adapter_version", "model_version")}
    info["ranks"] = ranks
    return _Inspected(path, "onnx_adapter", path.stat().st_size, info, {}, {}, tensors)


_READERS = {"burnpack": _read_burnpack_info, "safetensors": _read_safetensors_info, "onnx": _read_onnx_info,
            "pytorch": _read_pytorch_info, "onnx_adapter": _read_onnx_adapter_info}


def inspect_file(path: "str | os.PathLike", count_nonfinite: bool = True) -> dict:
    """What ``onnxparam inspect FILE --json`` prints, as a dict.

    Keys: ``path``, ``format`` (``burnpack`` / ``safetensors`` / ``onnx`` / ``pytorch`` /
    ``onnx_adapter``), ``file_bytes``, ``info`` (format facts: burnpack ``version``;
    ``.onnx_adapter`` ``format_version``, ``adapter_version``, ``model_version`` and ``ranks``
    (``{W: r}`` for each ``W.lora.a`` / ``W.lora.b`` pair); ``.pt`` ``byteorder``,
    ``skipped`` (non-tensor entries), ``tied`` / ``shared`` name groups; safetensors ``header_metadata`` = the raw
    ``__metadata__``; ONNX ``ir_version``, ``opset_imports``, ``producer_*``,
    ``metadata_props``, ``inputs``, ``outputs``, ``initializers`` and
    ``non_weight_initializers``: those left out of ``tensors``...), ``metadata`` (the record's text metadata:
    burnpack ``metadata``, safetensors ``__metadata__`` without ``onnxparam.*`` keys, ONNX
    ``onnxparam.core.record.*``), ``scalars`` (``{name: {"kind", "value"}}``), ``tensors`` (data
    order; each ``name``, ``dtype`` (Burn's name), ``shape``, ``bytes``, ``param_id``,
    ``scheme`` (QFloat only), ``nan`` / ``inf`` (plain float tensors when counted, else
    ``null``)) and ``totals``.

    Raises:
        ValueError: for an unknown extension. FileNotFoundError: for a missing file.
        FileAccessError: for a writer's scratch file or folder, or a file inside one
            (``.NAME.<pid>-<hex>.tmp``: an unfinished save, never a finished file).
        BurnpackFormatError / OnnxFormatError / RecordError: for a malformed file.
    """
    from ..formats._extensions import content_format

    path = Path(path)
    _refuse_scratch(path)
    if not (path.exists() or path.is_symlink()):
        _existing(path, "input file")  # NOTE: before the format: a missing file's extension may be any
    if path.is_file() and content_format(path) == "onnx_adapter":
        fmt = "onnx_adapter"  # NOTE: detect_format refuses it (no weights file), inspect lists it
    else:
        fmt = _file_format(path, "input file", tuple(_READERS))
    _existing(path, "input file")
    inspected = _READERS[fmt](path)
    if count_nonfinite:
        _count_nonfinite(inspected)
    rows = inspected.tensors
    counted = [t for t in rows if t.nan is not None]
    totals = {
        "tensors": len(rows),
        "elements": sum(t.numel for t in rows),
        "bytes": sum(t.nbytes for t in rows),
        "largest_tensor_bytes": max((t.nbytes for t in rows), default=0),
        "nan": sum(t.nan for t in counted) if count_nonfinite else None,
        "inf": sum(t.inf for t in counted) if count_nonfinite else None,
    }
    return {
        "path": str(path),
        "format": fmt,
        "file_bytes": inspected.file_bytes,
        "info": inspected.info,
        "metadata": inspected.metadata,
        "scalars": inspected.scalars,
        "tensors": [t.to_json() for t in rows],
        "totals": totals,
    }


def _refuse_scratch(path: Path) -> None:
    """Refuse ``path`` when it, or a folder above it, is an atomic writer's scratch entry
    (:func:`onnxparam.formats._scratch.scratch_name`): its content is an unfinished save."""
    from ..core.errors import FileAccessError
    from ..formats._scratch import is_scratch_name

    for entry in (path, *path.parents):
        if not is_scratch_name(entry.name):
            continue
        target, _, owner = entry.name[1:-len(".tmp")].rpartition(".")
        kind = "folder" if entry.is_dir() else "file"
        where = "is the" if entry == path else "is inside the"
        raise FileAccessError(
            f"'{path}' {where} scratch {kind} of an unfinished save of '{entry.parent / target}' (by process "
            f"{owner.split('-')[0]}), not a finished file; inspect '{entry.parent / target}' instead (the next save "
            "into that folder removes a stale scratch entry)"
        )


def _add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE",
                        help="a .bpk, .onnx, .safetensors, .pt/.pth (torch.save, read without torch) or "
                             ".onnx_adapter file")
    parser.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
    parser.add_argument(
        "--no-count", action="store_true", help="do not scan float tensors for NaN / Inf (reads no tensor data)"
    )


def _print_quant_accuracy(doc: dict) -> None:
    """The accuracy report ``onnxparam quantize`` stored in the file (an ``.onnx`` output's
    ``metadata_props``, a ``.bpk`` output's metadata), as a table; nothing when there is none
    or it is not a JSON object."""
    props = doc["info"].get("metadata_props") if doc["format"] == "onnx" else doc["metadata"]
    text = (props or {}).get(QUANT_ACCURACY_KEY)
    if text is None:
        return
    from ._quant_table import print_accuracy
    try:
        report = json.loads(text)
        if isinstance(report, dict):
            print_accuracy(report)
    except (ValueError, TypeError, KeyError):  # NOTE: a foreign or damaged entry: shown above, raw
        return


MAX_LISTED_VALUES = 4
"""Graph inputs / outputs printed by ``inspect`` before "... and N more" (``--json`` lists all)."""


def _print_inspect(doc: dict) -> None:
    info = doc["info"]
    head = f"file:      {doc['path']} ({doc['format']}, {doc['file_bytes']:,} bytes)"
    if doc["format"] == "burnpack":
        head += f", format version {info['version']}"
    _out(head)
    if doc["format"] == "onnx":
        opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in info["opset_imports"].items())
        _out(
            f"onnx:      IR version {info['ir_version']}, opsets {opsets}; producer "
            f"{info['producer_name'] or '-'} {info['producer_version'] or ''}".rstrip()
        )
        _out(
            f"graph:     {info['nodes']} nodes, {info['initializers']} initializers"
            + (
                f": {info['initializers'] - info['non_weight_initializers']} weights (listed below) and "
                f"{info['non_weight_initializers']} small integer / bool / 0-d constants (shapes, axes, scalars; not "
                "weights, not listed)"
                if info["non_weight_initializers"]
                else ""
            )
            + (", weights-only" if info["weights_only"] else "")
            + (f", external data {', '.join(info['external_data'])}" if info["external_data"] else "")
        )
        for kind in ("inputs", "outputs"):
            values = [f"{v['name']} {v['dtype']} {v['shape']}" for v in info[kind]]
            more = f", ... and {len(values) - MAX_LISTED_VALUES} more" if len(values) > MAX_LISTED_VALUES else ""
            _out(f"{kind + ':':<10} {', '.join(values[:MAX_LISTED_VALUES]) or '-'}{more}")
        for key, value in info["metadata_props"].items():
            _out(f"  metadata_props {key} = {_clip(value)}")
        if QUANT_OPS_KEY in info["metadata_props"]:  # what each op with a quantized weight became
            from ._quant_table import print_quantized_ops

            print_quantized_ops(json.loads(info["metadata_props"][QUANT_OPS_KEY]))
    if doc["format"] == "pytorch":
        _out(f"pytorch:   {info['byteorder']}-endian, {len(info['skipped'])} non-tensor entries"
             + (f" ({_clip(', '.join(info['skipped']))})" if info["skipped"] else "")
             + "".join(f"; tied: {', '.join(g)}" for g in info["tied"]))
    if doc["format"] == "onnx_adapter":
        ranks = sorted(set(info["ranks"].values()))
        _out(f"adapter:   ONNX Runtime LoRA adapter (format version {info['format_version']}), adapter version "
             f"{info['adapter_version']}, model version {info['model_version']}; {len(info['ranks'])} adapted "
             f"weight(s)" + (f", rank {', '.join(map(str, ranks))}" if ranks else "")
             + "; feed it to a lora='inputs' export (onnxparam.check_onnx_adapter(adapter, model) checks the fit)")
    if doc["format"] == "safetensors":
        own = [k for k in info["header_metadata"] if k.startswith("onnxparam.")]
        if own:
            _out(f"__metadata__: {len(own)} onnxparam.* keys ({', '.join(own)})")
    _out(f"metadata:  {len(doc['metadata'])} entries" + (":" if doc["metadata"] else ""))
    for key, value in doc["metadata"].items():
        _out(f"  {key} = {_clip(value)}")
    _print_quant_accuracy(doc)
    if doc["scalars"]:
        _out(f"scalars:   {len(doc['scalars'])}:")
        for key, s in doc["scalars"].items():
            _out(f"  {key} = {s['value']!r} ({s['kind']})")
    rows = doc["tensors"]
    quantized = any(t["scheme"] for t in rows)
    counted = doc["totals"]["nan"] is not None
    header = ["name", "dtype", "shape", "bytes", "param id"] + (["nan", "inf"] if counted else [])
    header += ["scheme"] if quantized else []
    table = [header]
    for t in rows:
        line = [
            t["name"],
            t["dtype"],
            "[" + ", ".join(map(str, t["shape"])) + "]",
            f"{t['bytes']:,}",
            "-" if t["param_id"] is None else str(t["param_id"]),
        ]
        if counted:
            line += ["-" if t["nan"] is None else str(t["nan"]), "-" if t["inf"] is None else str(t["inf"])]
        if quantized:
            line.append(t["scheme"] or "-")
        table.append(line)
    _out()
    _print_table(table, right={3, 4, 5, 6})
    totals = doc["totals"]
    line = (
        f"total:     {totals['tensors']} tensors, {totals['elements']:,} elements, {totals['bytes']:,} bytes "
        f"of tensor data, largest tensor {totals['largest_tensor_bytes']:,} bytes"
    )
    if counted:
        line += f"; {totals['nan']} NaN, {totals['inf']} Inf"
    _out(line)


def _clip(text: str, limit: int = 120) -> str:
    text = str(text).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _print_table(rows: list, right: set = frozenset()) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        _out("  ".join(cells).rstrip())


def _run_inspect(args: argparse.Namespace) -> int:
    doc = inspect_file(args.file, count_nonfinite=not args.no_count)
    if args.json:
        _out(json.dumps({"command": "inspect", **doc}, indent=2, ensure_ascii=False))
    else:
        _print_inspect(doc)
    return EXIT_OK
