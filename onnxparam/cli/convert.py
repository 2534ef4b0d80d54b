"""``onnxparam convert``: file-to-file weight conversion (wraps :func:`onnxparam.convert.convert`)."""

import argparse
import dataclasses
import time
from pathlib import Path

from ._common import (
    EXIT_OK,
    PROG,
    UsageError,
    _existing,
    _check_output,
    _file_format,
    _out,
    _progress,
    _regex,
    _remap_rule,
    json_result,
)
from .inspect import _READERS, inspect_file

CAST_CHOICES = ("f16", "bf16", "f32")


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, metavar="IN",
                        help="the source: .bpk, .safetensors, .onnx, or .pt/.pth (torch.save; read without torch, "
                        "nothing in it runs)")
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
        "--no-transpose",
        type=_regex,
        action="append",
        metavar="RE",
        help="with --pytorch: do not transpose the tensors whose target name matches RE (repeatable)",
    )
    parser.add_argument(
        "--contiguous-indices",
        action="store_true",
        help="renumber gappy integer name segments to 0, 1, 2 ... first (nn.Sequential's fc.0, fc.2 -> fc.0, fc.1)",
    )
    parser.add_argument(
        "--top-level-key",
        metavar="KEY",
        help="for a .pt/.pth source: the checkpoint dict's entry holding the state dict (e.g. state_dict, model)",
    )
    parser.add_argument(
        "--cast", choices=CAST_CHOICES, help="store every float tensor in this precision (round to nearest even)"
    )
    parser.add_argument(
        "--pytorch",
        action="store_true",
        help="PyTorch <-> Burn layouts (from a .pt/.safetensors to .bpk/.onnx, or to a .safetensors): "
        "without a module, from the file's own evidence: a rank-2 'P.weight' whose 'P.bias' follows dim 0 "
        "(nn.Linear's (out, in)) is transposed, one whose bias follows dim 1 (GPT-2's Conv1D, already "
        "(in, out)) is kept; a square one follows its family (h.*.attn.c_proj) or the whole file; norm "
        "'weight'/'bias' <-> 'gamma'/'beta'; 'num_batches_tracked' left out. A weight the file does not "
        "settle (no bias: a bias-free Linear or an Embedding; a square one without evidence) is NOT "
        "transposed and is listed as untouched with the reason: decide with --transpose RE / --no-transpose RE, or load into a module "
        "(onnxparam.convert.load_pytorch / load_safetensors(adapter='pytorch'), which decide by layer type)",
    )
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="with --graph: keep the graph's data for weights IN lacks, ignore the tensors it has no weight for; "
        "the report lists both (NOT replaced / NOT written; --json: 'missing' / 'unused') and never counts them as "
        "written. Without it either is an error naming them",
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


def _source_tensors(path: Path, fmt: str) -> list:
    """``(name, shape, nbytes)`` of a source's tensors from its header (no tensor data read)."""
    if fmt in ("onnx", "pytorch"):
        doc = inspect_file(path, count_nonfinite=False)
        return [(t["name"], tuple(t["shape"]), t["bytes"]) for t in doc["tensors"]]
    inspected = _READERS[fmt](path)
    return [(t.name, t.shape, t.nbytes) for t in inspected.tensors]


def _run_convert(args: argparse.Namespace) -> int:
    from ..convert import PathFilter, convert

    src_fmt = _file_format(args.src, "input file", ("burnpack", "onnx", "safetensors", "pytorch"))
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
    _check_output(args.dst, args.src, args.graph)

    if args.top_level_key is not None and src_fmt != "pytorch":
        raise UsageError(f"{PROG} convert: error: --top-level-key applies to a .pt/.pth input; the input is '{args.src}'")
    if args.no_transpose and not args.pytorch:
        raise UsageError(f"{PROG} convert: error: --no-transpose takes tensors out of --pytorch's transposes; add --pytorch")
    remap, transpose = list(args.remap or []), list(args.transpose or [])

    total = None
    keep = PathFilter(args.include, args.exclude)
    if src_fmt not in ("onnx", "pytorch") or args.include or args.exclude:
        source = _source_tensors(args.src, src_fmt)
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
            no_transpose=args.no_transpose,
            pytorch=args.pytorch,
            top_level_key=args.top_level_key,
            contiguous_indices=args.contiguous_indices,
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
    json_result("report", dataclasses.asdict(report))
    _out(str(report))
    data = total if total is not None else report.bytes_written
    _out(
        f"done in {seconds:.2f} s"
        + (f" ({data / seconds / 1e9:.2f} GB/s of tensor data)" if seconds > 0 and data else "")
    )
    return EXIT_OK
