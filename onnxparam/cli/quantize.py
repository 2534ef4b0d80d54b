"""``onnxparam quantize``: quantize a model's weights (QDQ ONNX or QFloat burnpack).

``onnxparam quantize MODEL OUT [--scheme q8s] [--calibrate inputs.npz] [--per-channel]
[--include RE] [--exclude RE] [--block-size N] [--prefer speed|size]``: for an ``.onnx`` OUT each
op with a quantized weight gets the fastest form ONNX Runtime runs (``--prefer speed``, the
default; :mod:`onnxparam.quant._qdq_forms`), static int8 where ``--calibrate`` gives activation
ranges, and a table says what each op became. A weight some op gets in float (no faster form
without calibration, no 4-bit form at the model's opset) keeps its original float values, and a
warning says when nothing (or little) got smaller or faster, and what would
(:func:`onnxparam.cli._quant_table.little_gained`)."""

import argparse
import warnings
from pathlib import Path
from typing import Optional

from ._common import (
    EXIT_OK,
    PROG,
    UsageError,
    _existing,
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
        help="representative inputs (one array per graph input, by input name or in order; batch first): "
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
                        help="quantize only params whose path matches RE (repeatable)")
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
    _add_model_arguments(parser)


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
    """The arrays of ``--calibrate``: by graph input name when the file names them all, else in
    the file's order."""
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
    if names and all(n in arrays for n in names):
        chosen = {n: arrays[n] for n in names}
    elif names and len(arrays) != len(names):
        raise ValueError(f"the --calibrate file '{path}' holds {len(arrays)} arrays ({', '.join(arrays)}); the model "
                         f"takes {len(names)} inputs ({', '.join(names)}): name them so")
    else:
        chosen = arrays
    from ..quant._activations import check_calibration_input

    for key, array in chosen.items():
        check_calibration_input(array, f"the --calibrate file '{path}': array '{key}'")
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


def _block_text(block_size: tuple) -> str:
    return ",".join(map(str, block_size))


def _run_quantize(args: argparse.Namespace) -> int:
    dst_fmt = _file_format(args.dst, "output file", ("onnx", "burnpack"))
    for flag, given in (("--reblock", args.reblock), ("--calibrate", args.calibrate is not None)):
        if given and dst_fmt != "onnx":
            raise UsageError(f"{PROG} quantize: error: {flag} applies to an .onnx output; the output is '{args.dst}'")
    if args.calibrate_batch is not None and args.calibrate is None:
        raise UsageError(f"{PROG} quantize: error: --calibrate-batch sets the batch size of --calibrate; give "
                         "--calibrate INPUTS.npz too, or leave it out")
    if args.per_channel and args.block_size is not None:
        raise UsageError(f"{PROG} quantize: error: --per-channel sets the scale grid itself; leave out --block-size")
    quantizer, scheme = _quantizer(args.scheme, args.block_size, args.per_channel)
    model = _load_model(args, args.src)
    # NOTE: the calibration file is read and checked before any weight is quantized: a bad file fails fast
    arrays = _calibration_arrays(args.calibrate, model) if args.calibrate is not None else None
    if dst_fmt == "burnpack":
        _refuse_onnx_only(model.module, quantizer, _group(args.include, args.exclude), args.dst)
    in_bytes = _input_bytes(args.src, model.module)
    before = _count_dtypes(model.module)
    float_module = model.module  # the original values of weights the export leaves float
    # NOTE: the "left float" warning is held back until we know some param was quantized: when
    # none was, the one error line below says why instead.
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        group = _group(args.include, args.exclude)
        if group is None:
            model.module = model.module.quantize_weights(quantizer)
        else:
            model.module = model.module.quantize_weights_group(quantizer, group)
    after = _count_dtypes(model.module)
    quantized = after.get("QFloat", 0) - before.get("QFloat", 0)
    if quantized == 0:
        raise ValueError(_nothing_quantized(model.module, quantizer, args.block_size, group is not None))
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    json_result("quantized", {"params": quantized, "of": sum(before.values()), "scheme": _scheme_text(scheme),
                              "per_channel": bool(args.per_channel), "dtypes_before": before, "dtypes_after": after})
    _out(
        f"quantized: {quantized} of {sum(before.values())} params to "
        f"{_scheme_text(scheme)}{', per output channel' if args.per_channel else ''}; dtypes {before} -> {after}"
    )
    if dst_fmt == "onnx":
        from ..quant import qdq_options

        if args.calibrate is not None:
            model.module = _calibrate(args, model, arrays)
        with qdq_options(reblock=args.reblock, prefer=args.prefer, float_module=float_module):
            model.export(args.dst)
        from ..quant import quantized_ops
        from ._quant_table import little_gained, print_quantized_ops

        rows = quantized_ops(args.dst)
        json_result("ops", rows)
        print_quantized_ops(rows)
        gain = little_gained(rows, _written_bytes(args.dst), in_bytes, args.calibrate is not None, args.prefer)
        if gain is not None:
            from ..core.errors import QuantizationWarning

            warnings.warn(gain, QuantizationWarning, stacklevel=1)
    else:
        model.module.save_file(args.dst)
    out_bytes = _written_bytes(args.dst) if dst_fmt == "onnx" else args.dst.stat().st_size
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


def _nothing_quantized(module, quantizer, block_size: Optional[tuple], filtered: bool = False) -> str:
    """Why :meth:`quantize_weights` quantized no param of ``module`` (one line); ``filtered``:
    whether ``--include`` / ``--exclude`` chose the params."""
    from ..quant._module import is_weight

    candidates = []
    for path, param in module.named_params():
        try:
            if is_weight(path, param, quantizer):
                candidates.append(f"{path} {list(param.lazy_shape())}")
        except (TypeError, ValueError):  # pragma: no cover - a param without a known shape
            continue
    shown = ", ".join(candidates[:4]) + (f" and {len(candidates) - 4} more" if len(candidates) > 4 else "")
    if filtered and candidates:
        return (f"--include / --exclude left no weight to quantize: the model's {len(candidates)} float weights "
                f"(rank >= 2) are {shown}; match their paths (see 'onnxparam inspect MODEL'); nothing was written")
    if block_size is not None and candidates:
        dims = "last dim is" if len(block_size) == 1 else f"last {len(block_size)} dims are"
        return (
            f"no param could be quantized with --block-size {_block_text(block_size)}: no weight's {dims} "
            f"divisible by {_block_text(block_size)} ({shown}); choose a block size that divides them, or "
            "leave out --block-size; nothing was written"
        )
    return "the model has no float weight (rank >= 2) to quantize; nothing was written"
