"""``onnxparam quantize``: quantize a model's weights (QDQ ONNX or QFloat burnpack).

``onnxparam quantize MODEL OUT [--scheme q8s] [--calibrate inputs.npz] [--per-channel]
[--include RE] [--exclude RE] [--block-size N] [--prefer speed|size]``: for an ``.onnx`` OUT each
op with a quantized weight gets the fastest form ONNX Runtime runs (``--prefer speed``, the
default; :mod:`onnxparam.quant._qdq_forms`), static int8 where ``--calibrate`` gives activation
ranges, and a table says what each op became. A weight some op gets in float (no faster form
without calibration, no 4-bit form at the model's opset) keeps its original float values, and a
warning says when nothing (or little) got smaller or faster, and what would
(:func:`onnxparam.cli._quant_table.little_gained`).

Issue 27: only weights are quantized unless ``--include`` names more (``quantize_weights(...,
weights_only=True)``: :mod:`onnxparam.quant._roles`); a weight whose quantized form (with its
nodes, for an ``.onnx`` OUT) is not smaller stays float; every param left float gets a row with
its reason (``kept_float``); an output not smaller than its input is a warning. An accuracy
report follows every ``.onnx`` output (:mod:`onnxparam.quant._accuracy`): per-output cosine and
max abs error against the float model in plain ONNX Runtime, in the table, ``--json`` and the
model's metadata; below ``--min-cosine`` a warning names the weights that move the outputs most
and the cosine with all the weights dequantized at once (activations float), or ``--strict``
refuses and removes the output. ``--no-accuracy`` skips the report, and so does a
model whose two runs would not fit in the memory available (a warning; the reason is the report).

A model larger than memory is quantized one weight at a time (:mod:`onnxparam.quant._stream`): the
export streams by itself; a ``.bpk`` output is written inside :func:`onnxparam.quant._stream.streaming`,
a large inline ``.onnx`` output gets its metadata by a streamed rewrite
(:func:`onnxparam.onnx_io._save.rewrite_metadata`)."""

import argparse
import contextlib
import warnings
from pathlib import Path
from typing import Optional

from ._common import (
    EXIT_OK,
    PROG,
    UsageError,
    _existing,
    _check_output,
    _file_format,
    _out,
    _positive_int,
    _progress,
    _regex,
    json_result,
)
from ._models import _add_model_arguments, _count_dtypes, _load_model
from .inspect import _scheme_text

QUANT_SCHEMES = {"q8s": "Q8S", "q8f": "Q8F", "q4s": "Q4S", "q4f": "Q4F"}
"""``--scheme`` -> :class:`onnxparam.quant.QuantValue` name (Burn's: ``S`` symmetric range, ``F`` full)."""


CALIBRATE_BATCH = 32
"""``--calibrate-batch`` when not given."""


def _block_size(text: str) -> tuple:
    """``N`` (blocks of N along the last axis) or ``N,M,...`` (one extent per trailing axis)."""
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,M (positive integers), got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected N or N,M (positive integers), got {text!r}")
    return dims


def _add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src", type=Path, metavar="IN", help="the model: .onnx, or .bpk/.safetensors with --graph/--zoo"
    )
    parser.add_argument(
        "dst", type=Path, metavar="OUT", help=".onnx (QuantizeLinear/DequantizeLinear) or .bpk (QFloat)"
    )
    parser.add_argument(
        "--scheme",
        default="q8s",
        choices=QUANT_SCHEMES,
        help="quantized values: 8 or 4 bits, symmetric (s) or full (f) range (default q8s)",
    )
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="INPUTS.npz",
        help="representative inputs (one array per graph input, by input name, or unnamed arr_0, arr_1, ... "
        "in input order; batch first): "
        "activation ranges for static int8 (QLinearConv / QLinearMatMul); .onnx OUT only",
    )
    parser.add_argument("--calibrate-batch", type=_positive_int, metavar="N",
                        help=f"calibration batch size, with --calibrate (default {CALIBRATE_BATCH})")
    parser.add_argument(
        "--per-channel",
        action="store_true",
        help="one scale per output channel (Conv axis 0, ConvTranspose axis 1, MatMul / Linear columns); "
        "stored as Burn blocks when extents fit in 255, else ONNX per-axis (.onnx OUT only)",
    )
    parser.add_argument("--include", type=_regex, action="append", metavar="RE",
                        help="quantize only params whose path matches RE, weights or not, 1-D biases too (one scale "
                        "per tensor) (repeatable); without it "
                        "only the weights of ops with an integer kernel are (MatMul / Gemm B, Conv W, embeddings), "
                        "never constants feeding arithmetic, biases, norm scales, position embeddings")
    parser.add_argument("--exclude", type=_regex, action="append", metavar="RE",
                        help="leave params whose path matches RE float (repeatable)")
    parser.add_argument(
        "--prefer",
        choices=("speed", "size"),
        default="speed",
        help="speed (default): ops ORT runs slower with a weight-only DequantizeLinear than in float "
        "(uncalibrated Conv, ConvTranspose, Gemm) keep float weights; size: every weight stays integer",
    )
    parser.add_argument(
        "--block-size",
        type=_block_size,
        metavar="N[,M]",
        help="one scale per block: N values of the last axis, or N,1 for N rows of axis 0 (blocks "
        "along K of a (d_in, d_out) Linear weight, which ONNX Runtime fuses into MatMulNBits); "
        "weights whose dims are not whole blocks stay float (default: one scale per tensor)",
    )
    parser.add_argument(
        "--reblock",
        action="store_true",
        help="for an .onnx OUT: re-quantize MatMul weights blocked along N with blocks along K so "
        "ONNX Runtime fuses MatMulNBits (lossy; the largest error is reported)",
    )
    parser.add_argument(
        "--min-cosine",
        type=_cosine,
        metavar="C",
        help="accuracy threshold: each output's cosine similarity to the float model's on the sample "
        "inputs (the --calibrate data, else inputs drawn from the declared shapes); below it a warning names "
        "the weights that move the outputs most (default 0.999 for 8 bits, 0.99 for 4)",
    )
    parser.add_argument("--no-accuracy", action="store_true",
                        help="skip the accuracy report (it runs the float and quantized models in ONNX Runtime; a "
                        "model whose two runs would not fit in the memory available is skipped anyway, with a warning)")
    parser.add_argument("--strict", action="store_true",
                        help="refuse (exit 1, nothing written) when an output's cosine is below --min-cosine")
    _add_model_arguments(parser)


def _cosine(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _quantizer(scheme_name: str, block_size: Optional[tuple], per_channel: bool = False):
    from .. import quant

    scheme = quant.QuantScheme(quant.QuantValue[QUANT_SCHEMES[scheme_name]], block_size=block_size)
    return quant.Quantizer(scheme, per_channel=per_channel), scheme


def _group(include: Optional[list], exclude: Optional[list]):
    """The ``ParamGroup`` of ``--include`` / ``--exclude``, or ``None`` for every weight."""
    if not include and not exclude:
        return None
    from ..core.group import ParamGroup

    group = ParamGroup.from_regexes(include) if include else ParamGroup.all()
    return group.excluding(ParamGroup.from_regexes(exclude)) if exclude else group


def _calibration_arrays(path: Path, model) -> list:
    """The arrays of ``--calibrate``, in graph input order: by graph input name when the file
    names them all, in the file's order when it holds them unnamed (``arr_0``, ``arr_1``, ...:
    ``np.savez(f, *arrays)``). Raises ``ValueError`` naming the file's arrays and the model's
    inputs otherwise (a count that differs, or names that do not match)."""
    import numpy as np

    _existing(path, "the --calibrate file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"the --calibrate file '{path}' is not a readable .npz of arrays: {e}") from e
    if not arrays:
        raise ValueError(f"the --calibrate file '{path}' holds no arrays")
    source = getattr(model.module, "_source", None)
    names = [v.name for v in source.inputs] if source is not None and hasattr(source, "inputs") else []
    unnamed = [f"arr_{i}" for i in range(len(arrays))]
    if names and all(n in arrays for n in names):
        chosen = {n: arrays[n] for n in names}
    elif names and len(arrays) != len(names):
        raise ValueError(f"the --calibrate file '{path}' holds {len(arrays)} arrays ({', '.join(arrays)}); the model "
                         f"takes {len(names)} inputs ({', '.join(names)}): name them so")
    elif names and sorted(arrays) != sorted(unnamed):
        # NOTE: order is used only for arrays saved unnamed (np.savez(f, a, b): arr_0, arr_1, ...);
        # named arrays that do not match the inputs are most likely another model's data
        missing = [n for n in names if n not in arrays]
        raise ValueError(f"the --calibrate file '{path}' holds arrays named {', '.join(arrays)}; the model's inputs are "
                         f"{', '.join(names)} (no array named {', '.join(missing)}): save one array per input under "
                         "its name (np.savez(f, **{name: array})), or unnamed in input order (np.savez(f, *arrays))")
    elif names:
        chosen = {k: arrays[k] for k in unnamed}
    else:
        chosen = arrays
    from ..quant._activations import check_calibration_input

    for key, array in chosen.items():
        check_calibration_input(array, f"the --calibrate file '{path}': array '{key}'")
    from ._calibrate_check import check_calibration_arrays  # NOTE: dtype / shape, named (fresh5 7c)

    check_calibration_arrays(path, model, chosen)
    return list(chosen.values())


def _calibrate(args, model, arrays: list):
    from ..core.errors import QuantizationError
    from ..quant import quantize_activations

    batch = CALIBRATE_BATCH if args.calibrate_batch is None else args.calibrate_batch
    total = len(arrays[0])
    bar = _progress(total, "calibrating", getattr(args, "quiet", False), unit="sample")

    def progress(done, n):
        if bar is not None:
            bar.update(done - bar.n)

    try:
        module = quantize_activations(model.module, arrays, batch_size=batch, progress=progress)
    except QuantizationError as e:
        if not str(e).startswith("no MatMul / Conv"):
            raise
        hint = "; static int8 needs 8-bit weights (--scheme q8s or q8f)" if args.scheme.startswith("q4") else ""
        raise QuantizationError(f"--calibrate: {e}{hint}; leave out --calibrate to write the model without "
                                "static int8; nothing was written") from None
    finally:
        if bar is not None:
            bar.close()
    ranges = getattr(module, "_onnxparam_activation_ranges", ())
    _out(f"calibrated: {total} samples in batches of {batch}: {len(ranges)} activation ranges")
    json_result("calibrated", {"samples": total, "batch_size": batch, "activation_ranges": len(ranges)})
    return module


def _per_channel_text(scheme) -> str:
    """``Q8S per output channel``: ``--per-channel``'s scheme in words (one scale per output
    channel, not per tensor)."""
    return f"{scheme.value.name} per output channel"


def _block_text(block_size: tuple) -> str:
    return ",".join(map(str, block_size))


def _run_quantize(args: argparse.Namespace) -> int:
    dst_fmt = _file_format(args.dst, "output file", ("onnx", "burnpack"))
    _check_output(args.dst, args.src)  # a folder, the source, a read-only place: before any work
    for flag, given in (("--reblock", args.reblock), ("--calibrate", args.calibrate is not None)):
        if given and dst_fmt != "onnx":
            raise UsageError(f"{PROG} quantize: error: {flag} applies to an .onnx output; the output is '{args.dst}'")
    if args.calibrate_batch is not None and args.calibrate is None:
        raise UsageError(f"{PROG} quantize: error: --calibrate-batch sets the batch size of --calibrate; give "
                         "--calibrate INPUTS.npz too, or leave it out")
    if args.per_channel and args.block_size is not None:
        raise UsageError(f"{PROG} quantize: error: --per-channel sets the scale grid itself; leave out --block-size")
    quantizer, scheme = _quantizer(args.scheme, args.block_size, args.per_channel)
    if args.include:
        # NOTE: --include names the params to quantize whatever their rank: a 1-D bias it names is
        # quantized too (one scale per tensor, also with --per-channel: Quantizer.quantize)
        quantizer = quantizer.with_min_rank(1)
    model = _load_model(args, args.src)
    opset = (getattr(model.module, "onnx_opset_imports", None) or {}).get("")
    if args.per_channel and dst_fmt == "onnx" and opset is not None and opset < 13:
        raise ValueError(f"--per-channel: the model '{args.src}' has opset {opset}; DequantizeLinear takes one scale "
                         "per output channel (its axis attribute) from opset 13, and ONNX Runtime refuses it below; "
                         "leave out --per-channel (one scale per tensor), or convert the model to opset 13 or later; "
                         "nothing was written")
    # NOTE: the calibration file is read and checked before any weight is quantized: a bad file fails fast
    arrays = _calibration_arrays(args.calibrate, model) if args.calibrate is not None else None
    if dst_fmt == "burnpack":
        _refuse_onnx_only(model.module, quantizer, _group(args.include, args.exclude), args.dst)
    in_bytes = _input_bytes(args.src, model.module)
    gain = None
    before = _count_dtypes(model.module)
    float_module = model.module  # the original values of weights the export leaves float
    # NOTE: the "left float" warning is held back until we know some param was quantized: when
    # none was, the one error line below says why instead.
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        group = _group(args.include, args.exclude)
        from ..quant._module import kept_float, quantize_weights

        # NOTE: --include names the params to quantize, whatever their role; without it only the
        # weights of ops with an integer kernel are (onnxparam.quant._roles)
        model.module = quantize_weights(model.module, quantizer, group, weights_only=not args.include,
                                        form_overhead=dst_fmt == "onnx")
    kept = kept_float(model.module)
    after = _count_dtypes(model.module)
    quantized = after.get("QFloat", 0) - before.get("QFloat", 0)
    if quantized == 0:
        raise ValueError(_nothing_quantized(model.module, quantizer, args.block_size, group is not None, kept))
    if dst_fmt == "onnx" and opset is not None and not args.per_channel:
        written_float = _blocks_written_float(model.module, float_module, scheme, opset)
        if written_float and len(written_float) == quantized:
            raise ValueError(_all_written_float(args, written_float, opset))
        for path, reason in written_float.items():  # NOTE: the export warns about each one too
            kept[path] = f"written as a float32 initializer: {reason}"
        quantized -= len(written_float)
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    scheme_text = _per_channel_text(scheme) if args.per_channel else _scheme_text(scheme)
    json_result("quantized", {"params": quantized, "of": sum(before.values()), "scheme": scheme_text,
                              "per_channel": bool(args.per_channel), "dtypes_before": before, "dtypes_after": after})
    _out(
        f"quantized: {quantized} of {sum(before.values())} params to "
        f"{scheme_text}; dtypes {before} -> {after}"
    )
    if dst_fmt == "onnx":
        from ..quant import qdq_options

        if args.calibrate is not None:
            model.module = _calibrate(args, model, arrays)
        with qdq_options(reblock=args.reblock, prefer=args.prefer, float_module=float_module):
            model.export(args.dst)
        from ..quant import quantized_ops
        from ._quant_table import little_gained, print_kept_float, print_quantized_ops

        from ..quant._accuracy import read_structure

        rows = quantized_ops(read_structure(args.dst))  # NOTE: the structure only, not the weights
        json_result("ops", rows)
        print_quantized_ops(rows)
        kept_rows = [{"weight": path, "reason": reason} for path, reason in kept.items()]
        json_result("kept_float", kept_rows)
        print_kept_float(kept_rows)
        accuracy = _accuracy_report(args, model, float_module, arrays, scheme, in_bytes + _written_bytes(args.dst))
        from ..quant._accuracy import ACCURACY_KEY, KEPT_FLOAT_KEY, STREAMED_REWRITE_BYTES, write_metadata

        props = {KEPT_FLOAT_KEY: kept_rows}
        if accuracy is not None:
            props[ACCURACY_KEY] = accuracy
        if args.dst.stat().st_size > STREAMED_REWRITE_BYTES:
            # NOTE (issue 27): a large inline output is rewritten one tensor at a time (its value
            # infos were settled by the export)
            import json

            from ..onnx_io._save import rewrite_metadata

            rewrite_metadata(args.dst, {k: json.dumps(v, separators=(",", ":")) for k, v in props.items()})
        else:
            write_metadata(args.dst, props)
        gain = little_gained(rows, _written_bytes(args.dst), in_bytes, args.calibrate is not None, args.prefer)
        if gain is not None:
            from ..core.errors import QuantizationWarning

            warnings.warn(gain, QuantizationWarning, stacklevel=1)
    else:
        kept_rows = [{"weight": path, "reason": reason} for path, reason in kept.items()]
        json_result("kept_float", kept_rows)
        from ._quant_table import print_kept_float

        print_kept_float(kept_rows)
        # NOTE: measured before writing (a temporary .onnx computing exactly param.val()), so
        # --strict below the threshold writes nothing
        accuracy = _accuracy_report(args, model, float_module, arrays, scheme, in_bytes + in_bytes // 4)
        import json

        from ..quant._accuracy import ACCURACY_KEY, KEPT_FLOAT_KEY

        # NOTE (issue 27): the report goes into the burnpack metadata (text -> text: JSON, the same
        # keys and values as an .onnx output's metadata_props); Burn ignores these entries
        meta = {KEPT_FLOAT_KEY: json.dumps(kept_rows, separators=(",", ":"))}
        if accuracy is not None:
            meta[ACCURACY_KEY] = json.dumps(accuracy, separators=(",", ":"))
        from ..quant import _stream

        # NOTE (issue 27): a large model's codes are computed one weight at a time while written,
        # spilled beside the output (the .onnx export streams by itself: export_onnx)
        large = in_bytes >= _stream.AUTO_STREAM_BYTES and _stream.streaming_folder() is None
        with _stream.streaming(args.dst.resolve().parent) if large else contextlib.nullcontext():
            model.module.save_file(args.dst, metadata=meta)
    out_bytes = _written_bytes(args.dst) if dst_fmt == "onnx" else args.dst.stat().st_size
    if out_bytes >= in_bytes and gain is None:  # NOTE: little_gained's warning already says why
        from ..core.errors import QuantizationWarning
        from ._quant_table import not_smaller

        warnings.warn(not_smaller(out_bytes, in_bytes, kept, quantized, dst_fmt), QuantizationWarning, stacklevel=1)
    json_result("written", {"path": str(args.dst), "bytes": out_bytes, "format": dst_fmt, "input_bytes": in_bytes})
    _out(f"wrote:     {args.dst} ({out_bytes:,} bytes; input {in_bytes:,} bytes)")
    return EXIT_OK


def _input_bytes(src: Path, module) -> int:
    """The input's size in bytes: the file, plus the external data files an imported ``.onnx``
    reads its tensors from (each counted once)."""
    loaded = getattr(getattr(module, "_source", None), "loaded", None)
    if loaded is None:
        return src.stat().st_size
    import os

    from ..convert._onnx_files import _external_data_files

    files = _external_data_files(loaded.model) - {os.path.realpath(src)}
    return src.stat().st_size + sum(os.stat(f).st_size for f in files)


def _written_bytes(dst: Path) -> int:
    """The written ``.onnx`` output's size in bytes, with any external data files it references."""
    import os

    import onnx_ir as ir

    from ..convert._onnx_files import _external_data_files

    size = dst.stat().st_size
    # NOTE: the export writes external data only above protobuf's 2 GiB, leaving a small .onnx;
    # parsing a large inline file just to find no external tensor would cost its whole size
    if size > _STUB_BYTES:
        return size
    files = _external_data_files(ir.load(dst)) - {os.path.realpath(dst)}
    return size + sum(os.stat(f).st_size for f in files)


_STUB_BYTES = 64 << 20
"""An ``.onnx`` output larger than this holds its tensors inline (see :func:`_written_bytes`)."""


def _refuse_onnx_only(module, quantizer, group, dst: Path) -> None:
    """Before quantizing anything: refuse a ``--per-channel`` burnpack output whose weights Burn
    could not read (a per-channel block with an extent over 255), naming each and why."""
    from ..quant._module import onnx_only_weights

    wide = onnx_only_weights(module, quantizer, group)
    if not wide:
        return
    shown = "; ".join(f"{path} {list(shape)}: one scale per index of axis {axis} needs blocks of "
                      f"{list(extents)}" for path, shape, axis, extents in wide[:4])
    more = f" and {len(wide) - 4} more" if len(wide) > 4 else ""
    names = "|".join(path.replace(".", r"\.") for path, *_ in wide[:4])
    raise ValueError(
        f"--per-channel cannot be stored in the burnpack file '{dst}': {shown}{more}. Burn's block "
        f"extents are at most 255, so Burn could not read these weights. Write an .onnx output (ONNX "
        f"per-axis scales have no such limit), use --block-size instead, or leave them float with "
        f"--exclude '^({names})$'; nothing was quantized or written")


def _blocks_written_float(module, float_module, scheme, opset: int) -> dict:
    """``{path: reason}`` of the params this run quantized whose block layout has no
    ``DequantizeLinear`` form at ``opset`` (:func:`onnxparam.quant._qdq_layout.unwritable_blocks`):
    the ``.onnx`` export writes them as float32 initializers, so they are not counted as quantized."""
    from ..core.dtype import DType
    from ..quant._qdq_layout import unwritable_blocks

    if scheme.block is None:
        return {}
    already = {path for path, p in float_module.named_params() if p.lazy_dtype() is DType.QFloat}
    found = {}
    for path, param in module.named_params():
        if param.lazy_dtype() is not DType.QFloat or path in already:
            continue
        reason = unwritable_blocks(tuple(param.lazy_shape()), scheme, opset)
        if reason is not None:
            found[path] = reason
    return found


def _all_written_float(args, written_float: dict, opset: int) -> str:
    """The error when every weight this run quantized would be written float32 (blocks ONNX cannot
    express at the model's opset): one line naming them, the reason and the ways out."""
    shown = ", ".join(list(written_float)[:4]) + (f" and {len(written_float) - 4} more" if len(written_float) > 4
                                                  else "")
    reasons = "; ".join(sorted(set(written_float.values())))
    return (f"--block-size {_block_text(args.block_size)}: every weight it quantized ({shown}) would be written as a "
            f"float32 initializer in '{args.dst}' ({reasons}): nothing would get smaller. "
            + ("Convert the model to opset 21 or later (onnx.version_converter), " if opset < 21 else "")
            + "leave out --block-size (one scale per tensor) or use --per-channel, or write a .bpk output (Burn "
            "reads blocks); nothing was written")


def _nothing_quantized(module, quantizer, block_size: Optional[tuple], filtered: bool = False,
                       kept: Optional[dict] = None) -> str:
    """Why :meth:`quantize_weights` quantized no param of ``module`` (one line); ``filtered``:
    whether ``--include`` / ``--exclude`` chose the params; ``kept``: ``{path: reason}`` of the
    params left float by role or size (:func:`onnxparam.quant._module.kept_float`)."""
    from ..quant._module import is_weight

    candidates = []
    for path, param in module.named_params():
        try:
            if is_weight(path, param, quantizer):
                candidates.append(f"{path} {list(param.lazy_shape())}")
        except (TypeError, ValueError):  # pragma: no cover - a param without a known shape
            continue
    shown = ", ".join(candidates[:4]) + (f" and {len(candidates) - 4} more" if len(candidates) > 4 else "")
    # NOTE: with --block-size, the weights not kept float by role or size were left float by their
    # blocks (not a whole number of them): that is the cause to name, not the few kept ones
    undivided = [c for c in candidates if c.rsplit(" [", 1)[0] not in (kept or {})]
    if block_size is not None and undivided:
        dims = "last dim is" if len(block_size) == 1 else f"last {len(block_size)} dims are"
        listed = ", ".join(undivided[:4]) + (f" and {len(undivided) - 4} more" if len(undivided) > 4 else "")
        others = ("; the others stayed float: " + "; ".join(f"{path}: {reason}" for path, reason in
                                                            list(kept.items())[:4])) if kept else ""
        return (f"no param could be quantized with --block-size {_block_text(block_size)}: no weight's {dims} "
                f"divisible by {_block_text(block_size)} ({listed}){others}; choose a block size that divides "
                "them, or leave out --block-size; nothing was written")
    if kept:
        reasons = "; ".join(f"{path}: {reason}" for path, reason in list(kept.items())[:4])
        more = f"; and {len(kept) - 4} more" if len(kept) > 4 else ""
        return (f"every candidate stayed float ({reasons}{more}); the output would be the float model, no smaller "
                "and no faster; nothing was written")
    if filtered and candidates:
        return (f"--include / --exclude left no weight to quantize: the model's {len(candidates)} float weights "
                f"(rank >= {quantizer.min_rank}) are {shown}; match their paths (see 'onnxparam inspect MODEL'); nothing was written")
    return f"the model has no float weight (rank >= {quantizer.min_rank}) to quantize; nothing was written"


def _accuracy_report(args, model, float_module, arrays: Optional[list], scheme,
                     model_bytes: int = 0) -> Optional[dict]:
    """Run the float model and the written quantized one in plain ONNX Runtime on sample inputs
    (:mod:`onnxparam.quant._accuracy`), print per-output cosine / max abs error, warn (naming the
    weights that move the outputs most) or, with ``--strict``, refuse below ``--min-cosine``.
    Returns the report (``None`` when it could not be measured: a warning says why), or
    ``{"skipped": reason}`` when it was not run: ``--no-accuracy``, or the two models
    (``model_bytes`` of weights together) would not fit in the memory available (a warning says
    so; ``--strict`` refuses then, as it does when the accuracy cannot be measured)."""
    import tempfile

    from ..core.errors import QuantizationError, QuantizationWarning
    from ..quant import _accuracy as acc

    bits = 4 if scheme.value.name.startswith("Q4") else 8
    threshold = args.min_cosine if args.min_cosine is not None else acc.MIN_COSINE[bits]
    skipped = "--no-accuracy" if getattr(args, "no_accuracy", False) else None
    if skipped is None:
        fits, why = acc.fits_in_memory(model_bytes)
        if not fits:
            skipped = why
            if args.strict:
                if _file_format(args.dst, "output file") == "onnx":
                    _remove_output(args.dst)
                raise QuantizationError(f"--strict: the accuracy could not be measured ({why}); nothing was written")
            warnings.warn(f"accuracy not measured: {why}; the quantized file is written without it (pass "
                          "--no-accuracy to skip it on purpose)", QuantizationWarning, stacklevel=2)
    if skipped is not None:
        report = {"skipped": skipped}
        json_result("accuracy", report)
        _out(f"accuracy:  not measured: {skipped}")
        return report
    with tempfile.TemporaryDirectory(prefix="onnxparam-accuracy-") as tmp:
        float_path = args.src
        names = _initializer_names(model.module)
        if _file_format(args.src, "model file") != "onnx":
            from ._models import _Model

            float_path = _Model(float_module, zoo=model.zoo).export(Path(tmp) / "float.onnx")
            names = {path: path for path in names}
        quant_path = args.dst
        try:
            if _file_format(args.dst, "output file") != "onnx":
                from ..quant import qdq_options
                from ._models import _Model

                with qdq_options(matmul="dequantize", prefer="size"):
                    quant_path = _Model(model.module, zoo=model.zoo).export(Path(tmp) / "quantized.onnx")
            feeds, described = acc.sample_inputs(float_path, arrays)
            try:
                acc.run(float_path, feeds)
            except Exception as first:  # noqa: BLE001 - a model that takes one sample at a time: retry with one
                # NOTE: only the inputs drawn with a symbolic leading dim are cut (a declared static
                # batch stays); when that fails too, the first error is the one that says why
                one = acc.first_sample_only(float_path, feeds)
                if one is None:
                    raise
                try:
                    acc.run(float_path, one)
                except Exception:  # noqa: BLE001
                    raise first from None
                feeds = one
                described = f"{described}, of which the first only (the model takes one sample at a time)"
        except Exception as e:  # noqa: BLE001 - ORT's own errors: the report is skipped, not the output
            # NOTE: the float model could not run on these inputs; the written file must still load
            if quant_path == args.dst:
                _check_loads(args.dst)
            if args.strict:
                if quant_path == args.dst:
                    _remove_output(args.dst)
                raise QuantizationError(f"--strict: the accuracy could not be measured ({e}); nothing was "
                                        "written") from None
            warnings.warn(f"accuracy not measured: the float model could not be run on sample inputs: {e}", QuantizationWarning, stacklevel=2)
            return None
        try:
            # NOTE: the float model ran on these feeds above: a failure here is the quantized model's
            # NOTE: a .bpk output's rendering runs without ORT's QDQ fusions: Burn computes with the
            # dequantized weights, not ORT's integer kernels
            outputs = acc.compare(float_path, quant_path, feeds, exact_dequantize=quant_path != args.dst)
        except Exception as e:  # noqa: BLE001 - the float model ran on these inputs, the quantized one did not
            if quant_path == args.dst:
                _quantized_failed(args.dst, e)
            # NOTE: a burnpack output: only its temporary .onnx rendering failed; Burn reads the file
            warnings.warn(f"accuracy not measured: the quantized model's ONNX rendering failed in ONNX Runtime: {e}",
                          QuantizationWarning, stacklevel=2)
            return None
        report = {"inputs": described, "min_cosine": threshold, "outputs": outputs}
        json_result("accuracy", report)
        width = max(len(r["output"]) for r in outputs)
        _out(f"accuracy:  vs the float model on {described}")
        for r in outputs:
            _out(f"  {r['output'].ljust(width)}  cosine {r['cosine']:.6f}  max abs error {r['max_abs_error']:.6g}")
        low = [r for r in outputs if not r["cosine"] >= threshold]
        if not low:
            return report
        fits, why = acc.fits_in_memory(acc.SENSITIVITY_MEMORY_FACTOR * model_bytes // acc.RUN_MEMORY_FACTOR)
        # NOTE: one-at-a-time sensitivity holds the float model in memory and runs it once per weight
        worst, together = _worst_weights(model.module, float_path, names, feeds) if fits else ([], None)
        if not fits:
            report["sensitivity_skipped"] = why
        report["sensitivity"] = [{"weight": w, "cosine": c} for w, c in worst]
        if together is not None:
            report["weights_together"] = together
        shown = ", ".join(f"{w} (alone: cosine {c:.6f})" for w, c in worst)
        excl = "|".join(_escape(w) for w, _ in worst[:3])
        if not fits:
            most = "not searched: " + why
        elif together is None:
            most = ("not searched: the float model's file holds none of the quantized weights by name (as an "
                    "initializer or a Constant node)")
        else:
            most = shown or "none found"
        text = (f"{', '.join(r['output'] for r in low)}: cosine {min(r['cosine'] for r in low):.6f} below "
                f"--min-cosine {threshold}; the quantized weights that move the outputs most: {most}"
                + (f"; --exclude '^({excl})$' leaves them float" if worst else ""))
        if together is not None:
            text += f"; all the quantized weights' rounding together (activations float): cosine {together:.6f}"
        observed = min(r["cosine"] for r in low)
        if together is not None and 1.0 - together < (1.0 - observed) / 4:
            # NOTE: the weights' rounding, all of it at once, moves the outputs far less than the file
            # does: the error comes from the integer kernels (activations quantized at run time; ORT's
            # u8 x s8 kernels saturate pair sums on x86 CPUs without VNNI)
            text += _unexplained_cause(quant_path)
        if args.strict:
            if quant_path == args.dst:
                _remove_output(args.dst)
            raise QuantizationError(f"--strict: {text}; nothing was written")
        warnings.warn(text, QuantizationWarning, stacklevel=2)
        return report


_INTEGER_OPS = ("MatMulInteger", "ConvInteger", "DynamicQuantizeLinear", "QuantizeLinear", "QLinearMatMul",
                "QLinearConv", "MatMulNBits", "DynamicQuantizeMatMul", "QGemm")
"""Ops of a written file that compute with integers or quantize activations at run time."""


def _unexplained_cause(quant_path: Path) -> str:
    """The cause text when no weight's rounding alone explains a low cosine: the integer ops
    the written graph holds, or, when it holds none (weight-only ``DequantizeLinear`` s), that
    ONNX Runtime's graph optimizations are the suspect."""
    import onnx

    try:
        graph = onnx.load(str(quant_path), load_external_data=False).graph
        found = sorted({n.op_type for n in graph.node if n.op_type in _INTEGER_OPS})
    except Exception:  # noqa: BLE001 - the file ran in ORT above; an unreadable graph just gets no detail
        found = None
    if found == []:
        return ("; the weights' rounding alone does not explain it, and the file holds no integer kernel (its weights "
                "are DequantizeLinear only): suspect ONNX Runtime's graph optimizations on this file (compare a "
                "session with graph_optimization_level=ORT_DISABLE_ALL)")
    ops = f" ({', '.join(found)})" if found else ""
    return (f"; the weights' rounding alone does not explain it: the integer kernels{ops} do (activations "
            "quantized at run time, or ONNX Runtime's u8 x s8 kernels saturating pair sums on x86 CPUs without VNNI)")


def _check_loads(dst: Path) -> None:
    """Refuse (removing it) a written quantized ``.onnx`` that plain ONNX Runtime cannot load
    (:func:`_quantized_failed`)."""
    from ..quant._accuracy import _session

    try:
        _session(dst)
    except Exception as e:  # noqa: BLE001 - ORT's own errors
        _quantized_failed(dst, e)


def _quantized_failed(dst: Path, error: Exception) -> None:
    """Raise ``QuantizationError``: ONNX Runtime cannot load or run the written quantized model
    ``dst`` (while the float model ran on the same inputs, or could not be run itself); ``dst``
    and its external data are removed, so no file ORT refuses is left behind."""
    from ..core.errors import QuantizationError

    _remove_output(dst)
    raise QuantizationError(f"the quantized model '{dst}' does not load or run in ONNX Runtime: {error}; this is a "
                            "defect of onnxparam's export (please report it with the model); --exclude the weights "
                            "of the node it names to leave them float; nothing was written") from None


def _escape(path: str) -> str:
    import re

    return re.escape(path)


def _initializer_names(module) -> dict:
    """``{param path: initializer name in the source file}`` of an imported module's params."""
    source = getattr(module, "_source", None)
    names = dict(getattr(source, "names", None) or {}) if source is not None else {}
    return names or {path: path for path, _ in module.named_params()}


def _worst_weights(module, float_path, names: dict, feeds: dict) -> tuple:
    """``(worst, together)``: the quantized params that, dequantized alone in the float model,
    lower its outputs' cosine most (``[(param path, cosine)]``;
    :func:`onnxparam.quant._accuracy.sensitivity`), and the smallest output cosine with all of
    them dequantized at once (:func:`onnxparam.quant._accuracy.weights_together`; ``None`` when
    the float file holds none of them)."""
    from ..core.dtype import DType
    from ..quant._accuracy import sensitivity, weights_together

    dequantized, by_name = {}, {}
    for path, param in module.named_params():
        if param.lazy_dtype() is DType.QFloat and path in names:
            quant = param.base()._quant
            if quant is not None:
                dequantized[names[path]] = quant.dequantize()
                by_name[names[path]] = path
    worst = [(by_name[name], cos) for name, cos in sensitivity(float_path, dequantized, feeds)]
    return worst, weights_together(float_path, dequantized, feeds)


def _remove_output(dst: Path) -> None:
    """Delete a written ``.onnx`` output and the external data files it references (``--strict``)."""
    import os

    try:
        import onnx_ir as ir

        from ..convert._onnx_files import _external_data_files

        files = _external_data_files(ir.load(dst)) - {os.path.realpath(dst)}
    except Exception:  # noqa: BLE001 - an unreadable output: remove the file itself
        files = set()
    for f in [dst, *files]:
        try:
            os.remove(f)
        except OSError:
            pass
