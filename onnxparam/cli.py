"""The ``onnxparam`` command line (also ``python -m onnxparam``).

Each subcommand is a :class:`Command`: a name, a one-line help, a function that adds its
arguments to its own parser and a function that runs it and returns the exit code. Add a
command by writing those and listing it in :data:`COMMANDS`; :func:`main` does the rest.

Exit codes: 0 success, 1 a failure (one line on stderr: ``onnxparam: error: ...``), 2 a usage
error (one line on stderr naming the bad argument, as ``argparse`` words it). No tracebacks.
Progress bars (``tqdm``) go to stderr, only on a terminal, never with ``--quiet``.

Commands:

* ``onnxparam inspect FILE [--json] [--no-count]``: the tensors of a ``.bpk``, ``.onnx`` or
  ``.safetensors`` file (name, dtype, shape, bytes, param id, quantization scheme, NaN / Inf
  counts of float tensors), the file's metadata and totals. Tensor data is read lazily
  (memory-mapped) in :data:`COUNT_CHUNK_BYTES` chunks, so a file larger than memory is fine (an
  ``.onnx`` whose weights sit inside the protobuf is parsed whole: protobuf has no lazy reads).
  ``--json`` prints one JSON document (:func:`inspect_file` builds it).
* ``onnxparam convert IN OUT [--graph G.onnx] [--zero-copy] [--remap PATTERN=REPL ...]
  [--include RE ...] [--exclude RE ...] [--transpose RE ...] [--cast f16|bf16|f32]
  [--pytorch] [--allow-partial] [--external-data] [--plain] [--quiet]``: wraps
  :func:`onnxparam.convert.convert` (formats from the extensions) and prints its report.
* ``onnxparam quantize IN OUT --scheme q8s|q8f|q4s|q4f [--block-size N]``: quantize the
  weights of a model (an ``.onnx`` file, or a ``.bpk`` / ``.safetensors`` with ``--graph`` or
  ``--zoo``) with :class:`onnxparam.quant.Quantizer`; ``OUT.onnx`` is a QDQ model,
  ``OUT.bpk`` holds ``QFloat`` tensors.
* ``onnxparam lora merge|keep|adapter MODEL OUT --alpha A [--rank R] [--adapter FILE]
  [--targets RE ...]``: LoRA adapters on a model's rank-2 weights (factors from ``MODEL`` or
  ``--adapter``, else fresh ones of ``--rank``): ``merge`` folds them into the weights,
  ``keep`` keeps them as separate factors (ONNX ``lora="keep"``; a ``.bpk`` with
  ``<param>.lora.a`` / ``.lora.b``), ``adapter`` writes the factors alone.
* ``onnxparam export mnist [--out DIR] [--batch-size N] [--device D] [--only PART ...]``: the
  tour of the packaged MNIST model: classify the 1,797 packaged digits through ONNX Runtime,
  export float32, int8-QDQ and LoRA (merged and kept) ONNX files, round-trip the weights
  through a burnpack file, and print accuracy, file size and latency for each (parts whose
  APIs are missing from this build are skipped with a note).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = [
    "main",
    "build_parser",
    "inspect_file",
    "export_mnist_onnx",
    "Command",
    "COMMANDS",
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_USAGE",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
"""``argparse``'s (and the Unix) convention for a command-line usage error."""

PROG = "onnxparam"
DEFAULT_OUT_DIR = "onnxparam-out"
DEFAULT_BATCH_SIZE = 256
MNIST_ONNX_FILE = "mnist.onnx"

COUNT_CHUNK_BYTES = 16 * 1024 * 1024
"""Bytes of one tensor scanned at a time when counting NaN / Inf: bounds the temporaries of a
scan (a few booleans per element) whatever the tensor's size."""

PROGRESS_MIN_BYTES = 64 * 1024 * 1024
"""Work smaller than this shows no progress bar (it would only flicker)."""


class UsageError(Exception):
    """A bad command line; :func:`main` prints it as one line and returns :data:`EXIT_USAGE`."""


class Unavailable(RuntimeError):
    """A feature whose library API is missing from this build (exit 1, one line)."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage dump) and never exit."""

    def error(self, message: str):  # noqa: D401 - argparse's API
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


@dataclass(frozen=True)
class Command:
    """A subcommand: ``add_arguments(parser)`` declares its arguments; ``run(args) -> int``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"invalid regular expression {text!r}: {e}") from None
    return text


def _remap_rule(text: str) -> tuple:
    """``PATTERN=REPLACEMENT`` (split at the first ``=``) -> ``(pattern, replacement)``."""
    pattern, sep, replacement = text.partition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(f"expected PATTERN=REPLACEMENT, got {text!r}")
    _regex(pattern)
    return pattern, replacement


def _device(text: str):
    from .device import Device

    try:
        return Device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _out(line: str = "") -> None:
    print(line, flush=True)


def _note(line: str) -> None:
    """A remark on stderr (stdout stays the command's result)."""
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def _progress(total: Optional[int], desc: str, quiet: bool, unit: str = "B"):
    """A tqdm bar on stderr, or ``None`` (``--quiet``, not a terminal, small work, no tqdm)."""
    if quiet or (total is not None and unit == "B" and total < PROGRESS_MIN_BYTES):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    # NOTE: disable=None is tqdm's "only on a terminal": pipes and logs get no bar.
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                disable=None, leave=False, file=sys.stderr)


def _file_format(path: Path, role: str, allowed: Sequence[str] = ("burnpack", "onnx", "safetensors")) -> str:
    """The format of ``path`` from its extension, or a one-line ``ValueError`` naming ``role``."""
    from .convert import FORMATS

    fmt = FORMATS.get(path.suffix.lower())
    if fmt not in allowed:
        known = ", ".join(ext for ext, f in FORMATS.items() if f in allowed)
        raise ValueError(f"{role} '{path}': cannot tell the format from the extension '{path.suffix}'; "
                         f"use one of {known}")
    return fmt


def _existing(path: Path, role: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{role} '{path}' does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"{role} '{path}' is a folder, not a file")
    return path


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


# -- inspect ----------------------------------------------------------------------------------------

FLOAT_BITS = {
    # Burn dtype name -> (unsigned view, exponent mask, mantissa mask) of the IEEE-754 layout.
    "F64": (np.uint64, 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
    "F32": (np.uint32, 0x7F80_0000, 0x007F_FFFF),
    "Flex32": (np.uint32, 0x7F80_0000, 0x007F_FFFF),
    "F16": (np.uint16, 0x7C00, 0x03FF),
    "BF16": (np.uint16, 0x7F80, 0x007F),
}
"""How NaN / Inf are found in a float tensor's bytes: all exponent bits set means non-finite,
and then a zero mantissa means Inf, any other NaN. Working on the bits treats every float width
alike (bfloat16 has no numpy type of its own) and never converts a value."""


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
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape), "bytes": self.nbytes,
                "param_id": self.param_id, "scheme": _scheme_text(self.scheme), "nan": self.nan, "inf": self.inf}


@dataclass
class _Inspected:
    path: Path
    format: str
    file_bytes: int
    info: dict
    metadata: dict
    scalars: dict
    tensors: list = field(default_factory=list)


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
    from .dtype import DType

    if dtype is DType.QFloat:
        from .quant import quantized_nbytes

        return int(quantized_nbytes(tuple(shape), scheme))
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize


def _scalar_json(scalar) -> dict:
    return {"kind": scalar.kind, "value": scalar.value}


def _read_burnpack_info(path: Path) -> _Inspected:
    from . import burnpack

    with burnpack.read(path) as f:
        tensors = [_TensorInfo(e.name, e.dtype, tuple(e.shape), e.nbytes, e.param_id, e.scheme,
                               (f.data_offset + e.data_offsets[0], e.nbytes)) for e in f.tensors.values()]
        info = {"version": f.version, "data_offset": f.data_offset}
        return _Inspected(path, "burnpack", path.stat().st_size, info, dict(f.metadata),
                          {k: _scalar_json(v) for k, v in f.scalars.items()}, tensors)


SAFETENSORS_LENGTH_BYTES = 8
"""A safetensors file starts with its JSON header's length, a little-endian u64."""


def _read_safetensors_info(path: Path) -> _Inspected:
    from .convert import read_safetensors

    with read_safetensors(path) as st:
        tensors = [
            _TensorInfo(name, t.dtype, tuple(t.shape), t.data_offsets[1] - t.data_offsets[0],
                        None if t.param_id is None else int(t.param_id), t.scheme,
                        (st.data_start + t.data_offsets[0], t.data_offsets[1] - t.data_offsets[0]))
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

    from .convert.converter import _is_weights_only, _read_weights_only
    from .convert.safetensors_io import SCALARS_KEY, _decode_scalars
    from .onnx_io.records import read_onnx_record
    from .onnx_io.source import load_model

    # NOTE: the converter's own readers (private helpers of onnxparam.convert.converter), so
    # `inspect` lists exactly the tensors `convert` would carry: every initializer of a
    # weights-only model, the weights (onnxparam.onnx_io.weights) of any other graph.
    model = load_model(path).model
    weights_only = _is_weights_only(model)
    record = _read_weights_only(model, str(path)) if weights_only else read_onnx_record(model)
    metadata = dict(record.metadata)
    scalars = {}
    raw_scalars = metadata.pop(SCALARS_KEY, None)
    if raw_scalars is not None:
        scalars = {k: _scalar_json(v) for k, v in _decode_scalars(path, json.loads(raw_scalars)).items()}
    tensors = [
        _TensorInfo(name, s.dtype, tuple(s.shape), _nbytes(s.dtype, s.shape, s.scheme),
                    None if s.param_id is None else int(s.param_id), s.scheme, loader=s.to_data)
        for name, s in record.items()
    ]

    def value_json(v) -> dict:
        dtype = v.dtype.name if v.dtype is not None else None
        dims = None if v.shape is None else [d if isinstance(d, int) else str(d) for d in v.shape]
        return {"name": v.name, "dtype": dtype, "shape": dims}

    externals = sorted({t.const_value.location for t in model.graph.initializers.values()
                        if isinstance(t.const_value, ir.ExternalTensor)})
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
        "external_data": externals,
        "weights_only": weights_only,
    }
    return _Inspected(path, "onnx", path.stat().st_size, info, metadata, scalars, tensors)


def _count_bits(words: np.ndarray, exp_mask: int, mant_mask: int) -> tuple[int, int]:
    exp = words.dtype.type(exp_mask)
    nonfinite = (words & exp) == exp
    if not nonfinite.any():
        return 0, 0
    inf = int(np.count_nonzero(nonfinite & ((words & words.dtype.type(mant_mask)) == 0)))
    return int(np.count_nonzero(nonfinite)) - inf, inf


def _count_nonfinite(inspected: _Inspected) -> None:
    """Fill ``nan`` / ``inf`` of every plain float tensor, streaming :data:`COUNT_CHUNK_BYTES` at a time."""
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
                    n, i = _count_bits(words[start:start + step], exp_mask, mant_mask)
                    nan, inf = nan + n, inf + i
                del array, words
            t.nan, t.inf = nan, inf
    finally:
        if mapping is not None:
            mapping.close()


_READERS = {"burnpack": _read_burnpack_info, "safetensors": _read_safetensors_info, "onnx": _read_onnx_info}


def inspect_file(path: "str | os.PathLike", count_nonfinite: bool = True) -> dict:
    """What ``onnxparam inspect FILE --json`` prints, as a dict.

    Keys: ``path``, ``format`` (``burnpack`` / ``safetensors`` / ``onnx``), ``file_bytes``,
    ``info`` (format facts: burnpack ``version``; safetensors ``header_metadata`` = the raw
    ``__metadata__``; ONNX ``ir_version``, ``opset_imports``, ``producer_*``,
    ``metadata_props``, ``inputs``, ``outputs``...), ``metadata`` (the record's text metadata:
    burnpack ``metadata``, safetensors ``__metadata__`` without ``onnxparam.*`` keys, ONNX
    ``onnxparam.record.*``), ``scalars`` (``{name: {"kind", "value"}}``), ``tensors`` (data
    order; each ``name``, ``dtype`` (Burn's name), ``shape``, ``bytes``, ``param_id``,
    ``scheme`` (QFloat only), ``nan`` / ``inf`` (plain float tensors when counted, else
    ``null``)) and ``totals``.

    Raises:
        ValueError: for an unknown extension. FileNotFoundError: for a missing file.
        BurnpackFormatError / OnnxFormatError / RecordError: for a malformed file.
    """
    path = Path(path)
    fmt = _file_format(path, "FILE")
    _existing(path, "FILE")
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
    return {"path": str(path), "format": fmt, "file_bytes": inspected.file_bytes, "info": inspected.info,
            "metadata": inspected.metadata, "scalars": inspected.scalars,
            "tensors": [t.to_json() for t in rows], "totals": totals}


def _add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="a .bpk, .onnx or .safetensors file")
    parser.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
    parser.add_argument("--no-count", action="store_true",
                        help="do not scan float tensors for NaN / Inf (reads no tensor data)")


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
        _out(f"onnx:      IR version {info['ir_version']}, opsets {opsets}; producer "
             f"{info['producer_name'] or '-'} {info['producer_version'] or ''}".rstrip())
        _out(f"graph:     {info['nodes']} nodes, {info['initializers']} initializers"
             + (", weights-only" if info["weights_only"] else "")
             + (f", external data {', '.join(info['external_data'])}" if info["external_data"] else ""))
        for kind in ("inputs", "outputs"):
            values = [f"{v['name']} {v['dtype']} {v['shape']}" for v in info[kind]]
            more = f", ... and {len(values) - MAX_LISTED_VALUES} more" if len(values) > MAX_LISTED_VALUES else ""
            _out(f"{kind + ':':<10} {', '.join(values[:MAX_LISTED_VALUES]) or '-'}{more}")
        for key, value in info["metadata_props"].items():
            _out(f"  metadata_props {key} = {_clip(value)}")
    if doc["format"] == "safetensors":
        own = [k for k in info["header_metadata"] if k.startswith("onnxparam.")]
        if own:
            _out(f"__metadata__: {len(own)} onnxparam.* keys ({', '.join(own)})")
    _out(f"metadata:  {len(doc['metadata'])} entries" + (":" if doc["metadata"] else ""))
    for key, value in doc["metadata"].items():
        _out(f"  {key} = {_clip(value)}")
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
        line = [t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", f"{t['bytes']:,}",
                "-" if t["param_id"] is None else str(t["param_id"])]
        if counted:
            line += ["-" if t["nan"] is None else str(t["nan"]), "-" if t["inf"] is None else str(t["inf"])]
        if quantized:
            line.append(t["scheme"] or "-")
        table.append(line)
    _out()
    _print_table(table, right={3, 4, 5, 6})
    totals = doc["totals"]
    line = (f"total:     {totals['tensors']} tensors, {totals['elements']:,} elements, {totals['bytes']:,} bytes "
            f"of tensor data, largest tensor {totals['largest_tensor_bytes']:,} bytes")
    if counted:
        line += f"; {totals['nan']} NaN, {totals['inf']} Inf"
    _out(line)


def _clip(text: str, limit: int = 120) -> str:
    text = str(text).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _print_table(rows: list, right: set = frozenset()) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        _out("  ".join(cells).rstrip())


def _run_inspect(args: argparse.Namespace) -> int:
    doc = inspect_file(args.file, count_nonfinite=not args.no_count)
    if args.json:
        _out(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        _print_inspect(doc)
    return EXIT_OK


# -- convert ----------------------------------------------------------------------------------------

CAST_CHOICES = ("f16", "bf16", "f32")


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, metavar="IN", help="the source: .bpk, .safetensors or .onnx")
    parser.add_argument("dst", type=Path, metavar="OUT",
                        help="the target: .bpk, .safetensors or .onnx (replaced atomically)")
    parser.add_argument("--graph", type=Path, metavar="MODEL.onnx",
                        help="for an .onnx target: write IN's weights into this graph (names matched, shapes "
                             "and dtypes checked) instead of a weights-only model")
    parser.add_argument("--zero-copy", action="store_true",
                        help="for an .onnx target from a .bpk/.safetensors in its folder: reference IN's bytes "
                             "as ONNX external data instead of copying them")
    parser.add_argument("--remap", type=_remap_rule, action="append", metavar="PATTERN=REPL",
                        help="rename tensors: regex PATTERN -> REPL (\\1 or $1 groups); repeat for more rules, "
                             "applied in order")
    parser.add_argument("--include", type=_regex, action="append", metavar="RE",
                        help="keep only tensors whose source name matches RE (repeatable)")
    parser.add_argument("--exclude", type=_regex, action="append", metavar="RE",
                        help="leave out tensors whose source name matches RE (repeatable)")
    parser.add_argument("--transpose", type=_regex, action="append", metavar="RE",
                        help="transpose the rank-2 tensors whose target name matches RE (repeatable)")
    parser.add_argument("--cast", choices=CAST_CHOICES,
                        help="store every float tensor in this precision (round to nearest even)")
    parser.add_argument("--pytorch", action="store_true",
                        help="PyTorch <-> Burn layouts, for a .safetensors on one side: transpose rank-2 "
                             "'*.weight' tensors (Linear) and rename rank-1 norm 'weight'/'bias' <-> "
                             "'gamma'/'beta' (see the README)")
    parser.add_argument("--allow-partial", action="store_true",
                        help="with --graph: keep the graph's data for weights IN lacks, ignore the tensors it "
                             "has no weight for")
    parser.add_argument("--external-data", action="store_true",
                        help="for an .onnx target: weights in OUT.data beside it (streams; default only over 2 GiB)")
    parser.add_argument("--plain", action="store_true",
                        help="for a .safetensors target: no onnxparam.* keys (ids, order, Burn dtypes), as "
                             "PyTorch tools write")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


PYTORCH_NORM_TO_BURN = {"weight": "gamma", "bias": "beta"}
"""A norm layer's PyTorch param names -> Burn's (``burn-store``'s ``PyTorchToBurnAdapter``)."""


def _pytorch_rules(names_shapes: list, to_pytorch: bool, remap: list, include, exclude) -> tuple[list, list]:
    """``--pytorch`` without a module: the remap rules and transpose regexes it adds.

    NOTE: Burn's adapters decide by the *module type* holding a param; a file alone has no
    types, so this is the shape rule that fits Linear and norm layers: a rank-2 ``X.weight`` is a
    Linear weight (transposed), a rank-1 ``X.weight`` is a norm scale (``X.weight``/``X.bias``
    renamed to ``X.gamma``/``X.beta``, or back). An ``Embedding`` table (rank-2, not transposed
    between PyTorch and Burn) would be transposed too: leave it out with ``--transpose`` rules
    of your own instead, or load into a module (``onnxparam.convert.load_safetensors``).
    """
    from .convert import KeyRemapper, PathFilter

    rules = []
    rank = dict(names_shapes)
    if to_pytorch:
        for name, shape in names_shapes:
            prefix, _, leaf = name.rpartition(".")
            if leaf == "gamma" and len(shape) == 1:
                rules.append((f"^{re.escape(name)}$", f"{prefix}.weight" if prefix else "weight"))
                beta = f"{prefix}.beta" if prefix else "beta"
                if beta in rank:
                    rules.append((f"^{re.escape(beta)}$", f"{prefix}.bias" if prefix else "bias"))
    else:
        for name, shape in names_shapes:
            prefix, _, leaf = name.rpartition(".")
            if leaf == "weight" and len(shape) == 1:
                rules.append((f"^{re.escape(name)}$", f"{prefix}.gamma" if prefix else "gamma"))
                bias = f"{prefix}.bias" if prefix else "bias"
                if bias in rank and len(rank[bias]) == 1:
                    rules.append((f"^{re.escape(bias)}$", f"{prefix}.beta" if prefix else "beta"))
    rules += list(remap or [])
    remapper, keep = KeyRemapper.of(rules), PathFilter(include, exclude)
    transposes = [f"^{re.escape(remapper.apply(name))}$" for name, shape in names_shapes
                  if keep.matches(name) and len(shape) == 2 and name.rpartition(".")[2] == "weight"]
    return rules, transposes


def _source_tensors(path: Path, fmt: str) -> list:
    """``(name, shape, nbytes)`` of a source's tensors from its header (no tensor data read)."""
    if fmt == "onnx":
        doc = inspect_file(path, count_nonfinite=False)
        return [(t["name"], tuple(t["shape"]), t["bytes"]) for t in doc["tensors"]]
    inspected = _READERS[fmt](path)
    return [(t.name, t.shape, t.nbytes) for t in inspected.tensors]


def _run_convert(args: argparse.Namespace) -> int:
    from .convert import PathFilter, convert

    src_fmt = _file_format(args.src, "IN")
    dst_fmt = _file_format(args.dst, "OUT")
    _existing(args.src, "IN")
    if args.graph is not None:
        if dst_fmt != "onnx":
            raise UsageError(f"{PROG} convert: error: --graph applies to an .onnx OUT; OUT is '{args.dst}'")
        _file_format(args.graph, "--graph", ("onnx",))
        _existing(args.graph, "--graph")
    if args.src.resolve() == args.dst.resolve():
        raise UsageError(f"{PROG} convert: error: IN and OUT are the same file '{args.src}'")
    if args.dst.is_dir():
        raise IsADirectoryError(f"OUT '{args.dst}' is a folder, not a file")

    source = None
    remap, transpose = list(args.remap or []), list(args.transpose or [])
    if args.pytorch:
        if (src_fmt == "safetensors") == (dst_fmt == "safetensors"):
            raise UsageError(f"{PROG} convert: error: --pytorch needs a .safetensors file (PyTorch's layout) on "
                             "exactly one side of the conversion")
        source = _source_tensors(args.src, src_fmt)
        remap, extra = _pytorch_rules([(n, s) for n, s, _ in source], dst_fmt == "safetensors", remap,
                                      args.include, args.exclude)
        transpose += extra

    total = None
    if src_fmt != "onnx" or source is not None:
        source = source or _source_tensors(args.src, src_fmt)
        keep = PathFilter(args.include, args.exclude)
        total = sum(nbytes for name, _, nbytes in source if keep.matches(name))
    bar = _progress(total, f"{args.src.name} -> {args.dst.name}", args.quiet)

    def progress(name: str, nbytes: int) -> None:
        bar.update(nbytes)

    t0 = time.perf_counter()
    try:
        report = convert(args.src, args.dst, graph=args.graph, remap=remap or None, include=args.include,
                         exclude=args.exclude, cast=args.cast, transpose=transpose or None,
                         allow_partial=args.allow_partial, zero_copy=args.zero_copy,
                         lossless=not args.plain, external_data=True if args.external_data else None,
                         progress=progress if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    _out(str(report))
    data = total if total is not None else report.bytes_written
    _out(f"done in {seconds:.2f} s" + (f" ({data / seconds / 1e9:.2f} GB/s of tensor data)" if seconds > 0 and data else ""))
    return EXIT_OK


# -- models for quantize / lora -------------------------------------------------------------------

ZOO_MODELS = ("mnist",)
"""Architectures of the packaged zoo, for weights files without a graph (``--zoo``)."""

LORA_FACTOR_RE = r"\.lora\.[ab]$"
"""Record paths of LoRA factors: ``<param>.lora.a`` (d_in, rank) and ``<param>.lora.b`` (rank, d_out)."""


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    arch = parser.add_mutually_exclusive_group()
    arch.add_argument("--graph", type=Path, metavar="MODEL.onnx",
                      help="the architecture for a .bpk/.safetensors MODEL: its weights are loaded into this "
                           "ONNX graph (imported as a module)")
    arch.add_argument("--zoo", choices=ZOO_MODELS,
                      help="the architecture for a .bpk/.safetensors MODEL: a packaged model")


@dataclass
class _Model:
    """A module to transform, and how to export it (an imported graph needs no inputs)."""

    module: Any
    zoo: Optional[str] = None

    def export(self, path: Path, lora: str = "merge") -> Path:
        if self.zoo == "mnist":
            return export_mnist_onnx(self.module, path, lora=lora)
        from .onnx_io import export_onnx

        return export_onnx(self.module, path, lora=lora)


def _architecture(args, src: Path, src_fmt: str) -> _Model:
    """The bare module ``src``'s weights go into: ``src`` itself (``.onnx``), ``--graph`` or ``--zoo``."""
    if src_fmt == "onnx":
        if args.graph is not None or args.zoo is not None:
            raise UsageError(f"{PROG} {args.command}: error: --graph/--zoo apply to a .bpk/.safetensors MODEL; "
                             f"'{src}' is a graph itself")
        from .onnx_io import import_onnx

        return _Model(import_onnx(src))
    if args.zoo == "mnist":
        from .zoo.mnist import Mnist

        return _Model(Mnist(), zoo="mnist")
    if args.graph is None:
        raise UsageError(f"{PROG} {args.command}: error: a {src.suffix} file holds weights, not a graph: give "
                         "its architecture with --graph MODEL.onnx or --zoo mnist")
    _file_format(args.graph, "--graph", ("onnx",))
    _existing(args.graph, "--graph")
    from .onnx_io import import_onnx

    return _Model(import_onnx(args.graph))


def _load_weights(module, path: Path, fmt: str, allow_partial: bool = False):
    """``module`` holding the tensors of a ``.bpk`` / ``.safetensors`` file (every one required
    unless ``allow_partial``)."""
    if fmt == "burnpack":
        return module.try_load_file(path, allow_partial=allow_partial)
    from .convert import load_safetensors

    loaded, _ = load_safetensors(module, path, allow_partial=allow_partial)
    return loaded


def _load_model(args, src: Path) -> _Model:
    src_fmt = _file_format(src, "MODEL")
    _existing(src, "MODEL")
    model = _architecture(args, src, src_fmt)
    if src_fmt != "onnx":
        model.module = _load_weights(model.module, src, src_fmt)
    return model


def _count_dtypes(module) -> dict:
    counts: dict = {}
    for _, param in module.named_params():
        name = param.lazy_dtype().name
        counts[name] = counts.get(name, 0) + 1
    return counts


# -- quantize ---------------------------------------------------------------------------------------

QUANT_SCHEMES = {"q8s": "Q8S", "q8f": "Q8F", "q4s": "Q4S", "q4f": "Q4F"}
"""``--scheme`` -> :class:`onnxparam.quant.QuantValue` name (Burn's: ``S`` symmetric range, ``F`` full)."""


def _add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, metavar="IN", help="the model: .onnx, or .bpk/.safetensors with --graph/--zoo")
    parser.add_argument("dst", type=Path, metavar="OUT", help=".onnx (QuantizeLinear/DequantizeLinear) or .bpk (QFloat)")
    parser.add_argument("--scheme", required=True, choices=QUANT_SCHEMES,
                        help="quantized values: 8 or 4 bits, symmetric (s) or full (f) range")
    parser.add_argument("--block-size", type=_positive_int, metavar="N",
                        help="one scale per N values of the last axis (default: one scale per tensor)")
    _add_model_arguments(parser)


def _quantizer(scheme_name: str, block_size: Optional[int]):
    from . import quant

    Quantizer = getattr(quant, "Quantizer", None)
    if Quantizer is None:
        raise Unavailable("quantizing a model needs onnxparam.quant.Quantizer, which this build of onnxparam "
                          "does not have yet")
    scheme = quant.QuantScheme(quant.QuantValue[QUANT_SCHEMES[scheme_name]], block_size=block_size)
    return Quantizer(scheme), scheme


def _run_quantize(args: argparse.Namespace) -> int:
    dst_fmt = _file_format(args.dst, "OUT", ("onnx", "burnpack"))
    quantizer, scheme = _quantizer(args.scheme, args.block_size)
    model = _load_model(args, args.src)
    if not hasattr(model.module, "quantize_weights"):  # pragma: no cover - a module of another kind
        raise Unavailable("this module has no quantize_weights")
    before = _count_dtypes(model.module)
    model.module = model.module.quantize_weights(quantizer)
    after = _count_dtypes(model.module)
    if dst_fmt == "onnx":
        model.export(args.dst)
    else:
        model.module.save_file(args.dst)
    _out(f"quantized: {after.get('QFloat', 0) - before.get('QFloat', 0)} of {sum(before.values())} params to "
         f"{_scheme_text(scheme)}; dtypes {before} -> {after}")
    _out(f"wrote:     {args.dst} ({args.dst.stat().st_size:,} bytes; IN {args.src.stat().st_size:,} bytes)")
    return EXIT_OK


# -- lora -------------------------------------------------------------------------------------------

LORA_ACTIONS = ("merge", "keep", "adapter")


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=LORA_ACTIONS,
                        help="merge: fold the adapters into the weights; keep: keep the factors (ONNX nodes "
                             "x@W + scale*((x@a)@b), or <param>.lora.a/.b tensors in a .bpk); adapter: write the "
                             "factors alone")
    parser.add_argument("src", type=Path, metavar="MODEL",
                        help="the model: .onnx, or .bpk/.safetensors (base weights, optionally with "
                             "<param>.lora.a/.b factors) with --graph/--zoo")
    parser.add_argument("dst", type=Path, metavar="OUT",
                        help="merge/keep: .onnx, .bpk or .safetensors; adapter: .onnx_adapter (ONNX Runtime), "
                             ".bpk or .safetensors")
    parser.add_argument("--alpha", type=_finite_float, required=True, metavar="A",
                        help="LoRA alpha: scale = alpha / rank (files do not record it, as in Burn)")
    parser.add_argument("--rank", type=_positive_int, metavar="R",
                        help="adapter rank; read from the factors when there are some, required when not "
                             "(fresh adapters: a ~ N(0, 1/R), b = 0)")
    parser.add_argument("--adapter", type=Path, metavar="FILE",
                        help="a .bpk/.safetensors holding the factors (<param>.lora.a/.b), if not in MODEL")
    parser.add_argument("--targets", type=_regex, action="append", metavar="RE",
                        help="fresh adapters only on rank-2 weights whose path matches RE (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh factors' init (default: 0)")
    _add_model_arguments(parser)


def _factor_shapes(path: Path, fmt: str) -> dict:
    """``param path -> rank`` for every ``<param>.lora.a`` in a weights file's header."""
    tensors = _source_tensors(path, fmt)
    ranks = {}
    for name, shape, _ in tensors:
        if name.endswith(".lora.a"):
            if len(shape) != 2:
                raise ValueError(f"'{path}': LoRA factor '{name}' has shape {list(shape)}; expected (d_in, rank)")
            ranks[name[: -len(".lora.a")]] = int(shape[1])
    return ranks


def _run_lora(args: argparse.Namespace) -> int:
    from .group import ParamGroup
    from .lora import LoraConfig

    src_fmt = _file_format(args.src, "MODEL")
    _existing(args.src, "MODEL")
    if args.action == "adapter":
        suffix = args.dst.suffix.lower()
        if suffix != ".onnx_adapter":
            _file_format(args.dst, "OUT", ("burnpack", "safetensors"))
    else:
        _file_format(args.dst, "OUT")
    factors_file, factors_fmt = None, None
    if args.adapter is not None:
        factors_fmt = _file_format(args.adapter, "--adapter", ("burnpack", "safetensors"))
        factors_file = _existing(args.adapter, "--adapter")
    elif src_fmt != "onnx":
        factors_file, factors_fmt = args.src, src_fmt

    model = _architecture(args, args.src, src_fmt)
    ranks = _factor_shapes(factors_file, factors_fmt) if factors_file is not None else {}
    if ranks:
        found = sorted(set(ranks.values()))
        if len(found) > 1:
            raise ValueError(f"'{factors_file}': the LoRA factors have ranks {found}; one rank per file is supported")
        if args.rank is not None and args.rank != found[0]:
            raise ValueError(f"--rank {args.rank} does not match the factors in '{factors_file}' (rank {found[0]})")
        if args.targets:
            raise UsageError(f"{PROG} lora: error: --targets chooses where fresh adapters go; '{factors_file}' "
                             "already has factors")
        rank, group, origin = found[0], ParamGroup.from_paths(sorted(ranks)), f"factors from {factors_file}"
    else:
        if args.rank is None:
            where = factors_file or args.src
            raise UsageError(f"{PROG} lora: error: '{where}' has no LoRA factors (<param>.lora.a/.b); give --rank "
                             "for fresh adapters, or --adapter FILE")
        rank = args.rank
        group = ParamGroup.from_regexes(args.targets) if args.targets else ParamGroup.all()
        origin = f"fresh adapters (seed {args.seed})"
    module = model.module
    if src_fmt != "onnx" and factors_file != args.src:
        module = _load_weights(module, args.src, src_fmt)
    adapted = module.apply_lora(LoraConfig(rank, args.alpha, param_group=group, seed=args.seed))
    if ranks:
        if factors_file == args.src:
            adapted = _load_weights(adapted, args.src, src_fmt)  # base and factors together
        else:
            adapted = _load_weights(adapted, factors_file, factors_fmt, allow_partial=True)
    model.module = adapted
    names = [path for path, p in adapted.named_params() if p.adapter() is not None]
    if ranks and set(names) != set(ranks):
        strays = sorted(set(ranks) - set(names))
        raise ValueError(f"'{factors_file}' has LoRA factors for {len(strays)} weight(s) the model lacks or cannot "
                         f"adapt (rank-2 float): {', '.join(strays[:5])}{' ...' if len(strays) > 5 else ''}")
    if not names:
        raise ValueError(f"no rank-2 float weight of '{args.src}' matches the LoRA targets; nothing to adapt")
    _out(f"lora:      {len(names)} adapted weights, rank {rank}, alpha {args.alpha:g} (scale "
         f"{args.alpha / rank:g}); {origin}")

    dst_fmt = args.dst.suffix.lower()
    if args.action == "adapter":
        _write_lora_adapter(adapted, args.dst)
    elif dst_fmt == ".onnx":
        model.export(args.dst, lora=args.action)
    elif args.action == "merge":
        _save_module(adapted.merge_lora(), args.dst)
    else:
        _save_module(adapted, args.dst)
    _out(f"wrote:     {args.dst} ({args.dst.stat().st_size:,} bytes)")
    return EXIT_OK


def _save_module(module, path: Path) -> None:
    if path.suffix.lower() == ".bpk":
        module.save_file(path)
    else:
        from .convert import save_safetensors

        save_safetensors(module, path)


def _write_lora_adapter(module, path: Path) -> None:
    if path.suffix.lower() == ".onnx_adapter":
        try:
            from .lora_graph import write_onnx_adapter
        except ImportError:
            raise Unavailable("writing .onnx_adapter files needs onnxparam.lora_graph.write_onnx_adapter, which "
                              "this build does not have") from None
        write_onnx_adapter(module, path)
        return
    from .convert import collect_record, save_safetensors

    if path.suffix.lower() == ".safetensors":
        save_safetensors(module, path, include=LORA_FACTOR_RE)
        return
    from . import burnpack

    record, _ = collect_record(module, include=LORA_FACTOR_RE)
    entries = (burnpack.TensorEntry(name, s.dtype, tuple(s.shape), lambda _s=s: _s.to_data().array,
                                    None if s.param_id is None else int(s.param_id))
               for name, s in record.items())
    burnpack.write(path, entries, metadata=dict(record.metadata))


# -- export -----------------------------------------------------------------------------------------

EXPORT_MODELS = ("mnist",)
"""Models ``onnxparam export`` knows (the packaged zoo)."""

TOUR_PARTS = ("float32", "burnpack", "int8", "lora")
"""The parts of ``export mnist`` (``--only`` picks some): the float32 module and its ONNX file,
the burnpack round trip, the int8-QDQ ONNX file, the LoRA ONNX files (merged and kept)."""

TOUR_FILES = {
    "float32": MNIST_ONNX_FILE,
    "burnpack": "mnist.bpk",
    "int8": "mnist-int8-qdq.onnx",
    "lora-merge": "mnist-lora-merged.onnx",
    "lora-keep": "mnist-lora-kept.onnx",
}

TOUR_LORA_RANK = 4
TOUR_LORA_ALPHA = 8.0
TOUR_LORA_TARGETS = r"^fc\d\.weight$"
"""The tour's LoRA: rank 4, alpha 8 (scale 2) on the three Linear weights."""
TOUR_LORA_B_STD = 0.01
"""Std of the tour's ``b`` factors: a fresh ``b`` is zero (the adapter a no-op), so the tour
draws small values to make merged and kept graphs compute something to compare."""


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", choices=EXPORT_MODELS, help="the packaged model to export")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT_DIR), metavar="DIR",
                        help=f"output folder, created if missing (default: ./{DEFAULT_OUT_DIR})")
    parser.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                        help=f"digits per module call (default: {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--device", type=_device, default="cpu", metavar="DEVICE",
                        help="'cpu', 'cuda' or 'cuda:N' (default: cpu)")
    parser.add_argument("--only", choices=TOUR_PARTS, action="append", metavar="PART",
                        help=f"run only these parts of the tour (repeatable; {', '.join(TOUR_PARTS)}; default: all)")


def export_mnist_onnx(model, path: Path, lora: str = "merge") -> Path:
    """Write the MNIST ``model``'s graph to ``path`` with a dynamic batch dim (input ``x``
    ``["batch", 28, 28]`` float32 raw pixels, output ``["batch", 10]`` logits).

    ``lora``: the LoRA mode of :func:`onnxparam.export_onnx` (``"merge"``, ``"keep"``, ``"inputs"``).
    """
    from .dtype import DType
    from .onnx_io import export_onnx
    from .trace import InputSpec
    from .zoo.mnist import IMAGE_SIZE

    spec = InputSpec(("batch", IMAGE_SIZE, IMAGE_SIZE), DType.F32)
    export_onnx(model, path, spec, lora=lora)
    return Path(path)


@dataclass
class _TourRow:
    variant: str
    file: Optional[Path] = None
    accuracy: Optional[float] = None
    ms_per_batch: Optional[float] = None
    images_per_s: Optional[float] = None
    note: str = ""


def _session_pass(path: Path, pixels: np.ndarray, batch: int, providers: list):
    """Logits of a plain ``onnxruntime.InferenceSession`` on ``path`` over all ``pixels``, and the
    median seconds per batch (every call but the first, when there are several)."""
    from ._ort import import_onnxruntime

    ort = import_onnxruntime()
    session = ort.InferenceSession(str(path), providers=providers)
    name = session.get_inputs()[0].name
    outputs, times = [], []
    for start in range(0, len(pixels), batch):
        x = pixels[start:start + batch]
        t0 = time.perf_counter()
        outputs.append(session.run(None, {name: x})[0])
        times.append((time.perf_counter() - t0, len(x)))
    steady = times[1:] if len(times) > 1 else times
    seconds = [t for t, _ in steady]
    return np.concatenate(outputs), float(np.median(seconds)), sum(n for _, n in steady) / sum(seconds)


def _skipped(part: str, error: BaseException) -> str:
    return f"skipped ({type(error).__name__}: {_one_line(error)})"


def _run_export_mnist(args: argparse.Namespace) -> int:
    from . import Device, Tensor
    from .zoo import mnist

    parts = set(args.only or TOUR_PARTS)
    device = Device(args.device)
    out_dir: Path = args.out
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out {out_dir} exists and is not a folder")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.is_cuda else ["CPUExecutionProvider"]

    weights = mnist.weights_path()
    model = mnist.load_pretrained(device)
    images, labels = mnist.load_digits()
    pixels = images.astype(np.float32)
    n, batch = len(images), args.batch_size
    starts = range(0, n, batch)
    _out(f"model:    Burn MNIST example, {model.num_params():,} params, weights {weights}")
    _out(f"digits:   {n} images {list(images.shape[1:])}, batch size {batch} ({len(starts)} calls)")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[_TourRow] = []

    def accuracy(logits: np.ndarray) -> float:
        return float((logits.argmax(axis=1) == labels).mean())

    # 1. float32: the module through ONNX Runtime, then its exported graph in a plain session.
    logits = np.empty((n, mnist.NUM_CLASSES), dtype=np.float32)
    times = []
    progress = _progress(n, "classifying", quiet=False, unit="img")
    for start in starts:
        x = Tensor.from_numpy(pixels[start:start + batch], device)
        t0 = time.perf_counter()
        y = model(x).to_numpy()
        times.append(time.perf_counter() - t0)
        logits[start:start + batch] = y
        if progress is not None:
            progress.update(len(y))
    if progress is not None:
        progress.close()
    predicted = logits.argmax(axis=1)
    correct = int((predicted == labels).sum())
    _out(f"accuracy: {correct / n:.4f} ({correct}/{n}) through ONNX Runtime, device {device}")
    # NOTE: the first call traces the forward and builds the ORT session; latency is the
    # steady state after it (all calls when there is only one).
    sizes = [min(batch, n - s) for s in starts]
    steady_times, steady_sizes = (times[1:], sizes[1:]) if len(times) > 1 else (times, sizes)
    per_batch_ms = float(np.median(steady_times)) * 1e3
    images_per_s = sum(steady_sizes) / sum(steady_times)
    _out(f"latency:  {per_batch_ms:.2f} ms/batch (median), {images_per_s:,.0f} images/s; "
         f"first call {times[0] * 1e3:.1f} ms (trace + session)")
    rows.append(_TourRow("float32 module", None, correct / n, per_batch_ms, images_per_s, "module calls"))

    if "float32" in parts:
        onnx_path = out_dir / TOUR_FILES["float32"]
        export_mnist_onnx(model, onnx_path)
        _out(f"wrote:    {onnx_path} ({onnx_path.stat().st_size:,} bytes)")
        plain, ms, ips = _session_pass(onnx_path, pixels, batch, providers)
        diff = float(np.max(np.abs(plain - logits)))
        same_labels = int((plain.argmax(axis=1) == predicted).sum())
        _out(f"check:    plain onnxruntime.InferenceSession on {onnx_path.name}: max |logits - module logits| = "
             f"{diff:.2e}, same label for {same_labels}/{n} digits")
        if same_labels != n:
            raise RuntimeError(f"the exported graph disagrees with the module on {n - same_labels} digits")
        rows.append(_TourRow("float32 ONNX", onnx_path, accuracy(plain), ms * 1e3, ips, "plain ORT session"))

    if "burnpack" in parts:
        rows.append(_tour_burnpack(model, out_dir / TOUR_FILES["burnpack"], weights, pixels, labels, batch, device))

    if "int8" in parts:
        rows.append(_tour_int8(model, out_dir / TOUR_FILES["int8"], pixels, batch, providers, accuracy))

    if "lora" in parts:
        rows += _tour_lora(model, out_dir, pixels, batch, providers, accuracy)

    _out()
    table = [["variant", "file", "bytes", "accuracy", "ms/batch", "images/s", "note"]]
    for r in rows:
        table.append([r.variant, r.file.name if r.file else "-", f"{r.file.stat().st_size:,}" if r.file else "-",
                      "-" if r.accuracy is None else f"{r.accuracy:.4f}",
                      "-" if r.ms_per_batch is None else f"{r.ms_per_batch:.2f}",
                      "-" if r.images_per_s is None else f"{r.images_per_s:,.0f}", r.note])
    _print_table(table, right={2, 3, 4, 5})
    return EXIT_OK


def _tour_burnpack(model, path: Path, weights: Path, pixels, labels, batch, device) -> _TourRow:
    """``module.save_file`` then every tensor compared, byte for byte, with Burn's file; then the
    file loaded into a fresh module, which classifies the digits."""
    from . import burnpack
    from .tensor import Tensor
    from .zoo.mnist import Mnist

    model.save_file(path)
    problems = []
    with burnpack.read(weights) as burn, burnpack.read(path) as ours:
        for name, theirs in burn.tensors.items():
            mine = ours.tensors.get(name)
            if mine is None:
                problems.append(f"'{name}' missing")
            elif (mine.dtype, mine.shape, mine.param_id) != (theirs.dtype, theirs.shape, theirs.param_id):
                problems.append(f"'{name}': {mine.dtype.name} {list(mine.shape)} id {mine.param_id} != "
                                f"{theirs.dtype.name} {list(theirs.shape)} id {theirs.param_id}")
            elif bytes(mine.raw_bytes()) != bytes(theirs.raw_bytes()):
                problems.append(f"'{name}': data differs")
        extra = sorted(set(ours.tensors) - set(burn.tensors))
        problems += [f"'{name}' not in Burn's file" for name in extra]
        count = len(burn.tensors)
    if problems:
        raise RuntimeError(f"burnpack round trip: {path} differs from {weights}: " + "; ".join(problems))
    same_file = path.read_bytes() == weights.read_bytes()
    _out(f"burnpack: wrote {path} ({path.stat().st_size:,} bytes); {count}/{count} tensors byte-identical to "
         f"{weights.name} (dtype, shape, param id, data); whole file {'identical' if same_file else 'differs (metadata)'}")
    reloaded = Mnist(device).load_file(path)
    logits, times = [], []
    for start in range(0, len(pixels), batch):
        x = Tensor.from_numpy(pixels[start:start + batch], device)
        t0 = time.perf_counter()
        logits.append(reloaded(x).to_numpy())
        times.append((time.perf_counter() - t0, len(x)))
    steady = times[1:] if len(times) > 1 else times
    ms = float(np.median([t for t, _ in steady])) * 1e3
    ips = sum(k for _, k in steady) / sum(t for t, _ in steady)
    acc = float((np.concatenate(logits).argmax(axis=1) == labels).mean())
    return _TourRow("burnpack", path, acc, ms, ips, f"module loaded from it; {count}/{count} tensors = Burn's")


def _tour_int8(model, path: Path, pixels, batch, providers, accuracy) -> _TourRow:
    try:
        quantizer, scheme = _quantizer("q8s", None)
        quantized = model.quantize_weights(quantizer)
        export_mnist_onnx(quantized, path)
    except (Unavailable, ImportError, AttributeError, NotImplementedError) as e:
        _out(f"int8:     {_skipped('int8', e)}")
        return _TourRow("int8 QDQ ONNX", None, note="skipped: quantization API missing")
    logits, ms, ips = _session_pass(path, pixels, batch, providers)
    _out(f"int8:     wrote {path} ({path.stat().st_size:,} bytes), weights {_scheme_text(scheme)}")
    return _TourRow("int8 QDQ ONNX", path, accuracy(logits), ms * 1e3, ips, "plain ORT session")


def _tour_lora(model, out_dir: Path, pixels, batch, providers, accuracy) -> list:
    from .dtype import DType
    from .group import ParamGroup
    from .lora import LoraConfig
    from .record import ModuleRecord, TensorSnapshot
    from .tensor import TensorData

    adapted = model.apply_lora(LoraConfig(TOUR_LORA_RANK, TOUR_LORA_ALPHA, seed=0,
                                          param_group=ParamGroup.from_regex(TOUR_LORA_TARGETS)))
    rng = np.random.default_rng(0)
    factors = {}
    for path, param in adapted.named_params():
        if path.endswith(".lora.b"):
            values = rng.normal(0.0, TOUR_LORA_B_STD, size=tuple(param.lazy_shape())).astype(np.float32)
            factors[path] = TensorSnapshot(DType.F32, values.shape, param.id,
                                           lambda _v=values: TensorData.from_numpy(_v))
    adapted = adapted.try_load_record(ModuleRecord(factors), allow_partial=True)
    rows, results = [], {}
    for mode, label in (("merge", "LoRA merged ONNX"), ("keep", "LoRA kept ONNX")):
        path = out_dir / TOUR_FILES[f"lora-{mode}"]
        try:
            export_mnist_onnx(adapted, path, lora=mode)
        except (ValueError, NotImplementedError, ImportError) as e:
            _out(f"lora:     {mode}: {_skipped(mode, e)}")
            rows.append(_TourRow(label, None, note=f"skipped: lora={mode!r} not available"))
            continue
        logits, ms, ips = _session_pass(path, pixels, batch, providers)
        results[mode] = logits
        _out(f"lora:     wrote {path} ({path.stat().st_size:,} bytes): rank {TOUR_LORA_RANK}, alpha "
             f"{TOUR_LORA_ALPHA:g} on {TOUR_LORA_TARGETS}, lora={mode!r}")
        rows.append(_TourRow(label, path, accuracy(logits), ms * 1e3, ips, "plain ORT session"))
    if len(results) == 2:
        diff = float(np.max(np.abs(results["merge"] - results["keep"])))
        _out(f"check:    LoRA merged vs kept: max |logits difference| = {diff:.2e}")
        if diff > 1e-3:
            raise RuntimeError(f"the merged and kept LoRA graphs disagree (max |difference| {diff:.2e})")
    return rows


def _run_export(args: argparse.Namespace) -> int:
    runners = {"mnist": _run_export_mnist}
    return runners[args.model](args)


COMMANDS: tuple = (
    Command("inspect", "list the tensors and metadata of a .bpk, .onnx or .safetensors file",
            _add_inspect_arguments, _run_inspect),
    Command("convert", "convert weights between .bpk, .safetensors and .onnx",
            _add_convert_arguments, _run_convert),
    Command("quantize", "quantize a model's weights (QDQ .onnx or QFloat .bpk)",
            _add_quantize_arguments, _run_quantize),
    Command("lora", "LoRA adapters: merge them, keep them as factors, or write them alone",
            _add_lora_arguments, _run_lora),
    Command("export", "the tour of a packaged model: ONNX files (float32, int8, LoRA), burnpack, a table",
            _add_export_arguments, _run_export),
)
"""The subcommands, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    """The ``onnxparam`` argument parser, one subparser per :data:`COMMANDS` entry."""
    from . import __version__

    parser = _Parser(prog=PROG, description="Burn's Param/Module model for ONNX models.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(_run=command.run)
    return parser


def _one_line(error: BaseException) -> str:
    # RecordError lists its problems as "  - ..." lines; keep them, on one line.
    lines = [re.sub(r"^-\s+", "", line.strip()) for line in str(error).splitlines() if line.strip()]
    problems = getattr(error, "problems", None)
    text = "; ".join(lines) or type(error).__name__
    if problems and not any(str(p) in text for p in problems):
        text += ": " + "; ".join(str(p) for p in problems)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version
        return int(e.code or 0)
    from .errors import OnnxParamError

    try:
        return int(args._run(args))
    except UsageError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:  # `onnxparam inspect big.bpk | head`: the reader left; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except (OnnxParamError, OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:  # noqa: BLE001 - the CLI promises one line, never a traceback
        print(f"{PROG}: error: unexpected {type(e).__name__}: {_one_line(e)} (please report this)", file=sys.stderr)
        return EXIT_FAILURE
