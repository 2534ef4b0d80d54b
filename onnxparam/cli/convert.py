"""``onnxparam convert``: file-to-file weight conversion (wraps :func:`onnxparam.convert.convert`)."""

import argparse
import re
import time
from pathlib import Path

from ._common import (
    EXIT_OK,
    PROG,
    UsageError,
    _existing,
    _file_format,
    _out,
    _progress,
    _regex,
    _remap_rule,
)
from .inspect import _READERS, inspect_file

CAST_CHOICES = ("f16", "bf16", "f32")


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, metavar="IN", help="the source: .bpk, .safetensors or .onnx")
    parser.add_argument(
        "dst", type=Path, metavar="OUT", help="the target: .bpk, .safetensors or .onnx (replaced atomically)"
    )
    parser.add_argument(
        "--graph",
        type=Path,
        metavar="MODEL.onnx",
        help="for an .onnx target: write IN's weights into this graph (names matched, shapes "
        "and dtypes checked) instead of a weights-only model",
    )
    parser.add_argument(
        "--zero-copy",
        action="store_true",
        help="for an .onnx target from a .bpk/.safetensors in its folder: reference IN's bytes "
        "as ONNX external data instead of copying them",
    )
    parser.add_argument(
        "--remap",
        type=_remap_rule,
        action="append",
        metavar="PATTERN=REPL",
        help="rename tensors: regex PATTERN -> REPL (\\1 or $1 groups); repeat for more rules, applied in order",
    )
    parser.add_argument(
        "--include",
        type=_regex,
        action="append",
        metavar="RE",
        help="keep only tensors whose source name matches RE (repeatable)",
    )
    parser.add_argument(
        "--exclude",
        type=_regex,
        action="append",
        metavar="RE",
        help="leave out tensors whose source name matches RE (repeatable)",
    )
    parser.add_argument(
        "--transpose",
        type=_regex,
        action="append",
        metavar="RE",
        help="transpose the rank-2 tensors whose target name matches RE (repeatable)",
    )
    parser.add_argument(
        "--cast", choices=CAST_CHOICES, help="store every float tensor in this precision (round to nearest even)"
    )
    parser.add_argument(
        "--pytorch",
        action="store_true",
        help="PyTorch <-> Burn layouts, for a .safetensors on one side: transpose rank-2 "
        "'*.weight' tensors (Linear) and rename rank-1 norm 'weight'/'bias' <-> "
        "'gamma'/'beta' (see the README)",
    )
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="with --graph: keep the graph's data for weights IN lacks, ignore the tensors it has no weight for",
    )
    parser.add_argument(
        "--external-data",
        action="store_true",
        help="for an .onnx target: weights in OUT.data beside it (streams; default only over 2 GiB)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="for a .safetensors target: no onnxparam.* keys (ids, order, Burn dtypes), as PyTorch tools write",
    )
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
    from ..convert import KeyRemapper, PathFilter

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
    transposes = [
        f"^{re.escape(remapper.apply(name))}$"
        for name, shape in names_shapes
        if keep.matches(name) and len(shape) == 2 and name.rpartition(".")[2] == "weight"
    ]
    return rules, transposes


def _source_tensors(path: Path, fmt: str) -> list:
    """``(name, shape, nbytes)`` of a source's tensors from its header (no tensor data read)."""
    if fmt == "onnx":
        doc = inspect_file(path, count_nonfinite=False)
        return [(t["name"], tuple(t["shape"]), t["bytes"]) for t in doc["tensors"]]
    inspected = _READERS[fmt](path)
    return [(t.name, t.shape, t.nbytes) for t in inspected.tensors]


def _run_convert(args: argparse.Namespace) -> int:
    from ..convert import PathFilter, convert

    src_fmt = _file_format(args.src, "input file")
    dst_fmt = _file_format(args.dst, "output file")
    _existing(args.src, "input file")
    if args.graph is not None:
        if dst_fmt != "onnx":
            raise UsageError(f"{PROG} convert: error: --graph applies to an .onnx output; the output is '{args.dst}'")
        _file_format(args.graph, "the --graph file", ("onnx",))
        _existing(args.graph, "the --graph file")
    if args.src.resolve() == args.dst.resolve():
        raise UsageError(
            f"{PROG} convert: error: the input and output are the same file '{args.src}'; write to another file"
        )
    if args.dst.is_dir():
        raise IsADirectoryError(f"output file '{args.dst}' is a folder, not a file")

    source = None
    remap, transpose = list(args.remap or []), list(args.transpose or [])
    if args.pytorch:
        if (src_fmt == "safetensors") == (dst_fmt == "safetensors"):
            raise UsageError(
                f"{PROG} convert: error: --pytorch needs a .safetensors file (PyTorch's layout) on "
                "exactly one side of the conversion"
            )
        source = _source_tensors(args.src, src_fmt)
        remap, extra = _pytorch_rules(
            [(n, s) for n, s, _ in source], dst_fmt == "safetensors", remap, args.include, args.exclude
        )
        transpose += extra

    total = None
    keep = PathFilter(args.include, args.exclude)
    if src_fmt != "onnx" or source is not None or args.include or args.exclude:
        source = source or _source_tensors(args.src, src_fmt)
        kept = [nbytes for name, _, nbytes in source if keep.matches(name)]
        if source and not kept:
            names = ", ".join(repr(name) for name, _, _ in source[:3]) + (" ..." if len(source) > 3 else "")
            raise ValueError(
                f"no tensor of '{args.src}' matched --include/--exclude (its {len(source)} tensors: {names}); "
                "nothing was written"
            )
        total = sum(kept)
    bar = _progress(total, f"{args.src.name} -> {args.dst.name}", args.quiet)

    def progress(name: str, nbytes: int) -> None:
        bar.update(nbytes)

    t0 = time.perf_counter()
    try:
        report = convert(
            args.src,
            args.dst,
            graph=args.graph,
            remap=remap or None,
            include=args.include,
            exclude=args.exclude,
            cast=args.cast,
            transpose=transpose or None,
            allow_partial=args.allow_partial,
            zero_copy=args.zero_copy,
            lossless=not args.plain,
            external_data=True if args.external_data else None,
            progress=progress if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    _out(str(report))
    data = total if total is not None else report.bytes_written
    _out(
        f"done in {seconds:.2f} s"
        + (f" ({data / seconds / 1e9:.2f} GB/s of tensor data)" if seconds > 0 and data else "")
    )
    return EXIT_OK
