"""``onnxparam quantize``: quantize a model's weights (QDQ ONNX or QFloat burnpack)."""

import argparse
import contextlib
import warnings
from pathlib import Path
from typing import Optional

from ._common import EXIT_OK, PROG, UsageError, _file_format, _out
from ._models import _add_model_arguments, _count_dtypes, _load_model
from .inspect import _scheme_text

QUANT_SCHEMES = {"q8s": "Q8S", "q8f": "Q8F", "q4s": "Q4S", "q4f": "Q4F"}
"""``--scheme`` -> :class:`onnxparam.quant.QuantValue` name (Burn's: ``S`` symmetric range, ``F`` full)."""


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
        required=True,
        choices=QUANT_SCHEMES,
        help="quantized values: 8 or 4 bits, symmetric (s) or full (f) range",
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


def _quantizer(scheme_name: str, block_size: Optional[tuple]):
    from .. import quant

    scheme = quant.QuantScheme(quant.QuantValue[QUANT_SCHEMES[scheme_name]], block_size=block_size)
    return quant.Quantizer(scheme), scheme


def _block_text(block_size: tuple) -> str:
    return ",".join(map(str, block_size))


def _run_quantize(args: argparse.Namespace) -> int:
    dst_fmt = _file_format(args.dst, "output file", ("onnx", "burnpack"))
    if args.reblock and dst_fmt != "onnx":
        raise UsageError(f"{PROG} quantize: error: --reblock applies to an .onnx output; the output is '{args.dst}'")
    quantizer, scheme = _quantizer(args.scheme, args.block_size)
    model = _load_model(args, args.src)
    before = _count_dtypes(model.module)
    # NOTE: the "left float" warning is held back until we know some param was quantized: when
    # none was, the one error line below says why instead.
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        model.module = model.module.quantize_weights(quantizer)
    after = _count_dtypes(model.module)
    quantized = after.get("QFloat", 0) - before.get("QFloat", 0)
    if quantized == 0:
        raise ValueError(_nothing_quantized(model.module, quantizer, args.block_size))
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if dst_fmt == "onnx":
        options = contextlib.nullcontext()
        if args.reblock:
            from ..quant import qdq_options

            options = qdq_options(reblock=True)
        with options:
            model.export(args.dst)
    else:
        model.module.save_file(args.dst)
    _out(
        f"quantized: {quantized} of {sum(before.values())} params to "
        f"{_scheme_text(scheme)}; dtypes {before} -> {after}"
    )
    _out(f"wrote:     {args.dst} ({args.dst.stat().st_size:,} bytes; input {args.src.stat().st_size:,} bytes)")
    return EXIT_OK


def _nothing_quantized(module, quantizer, block_size: Optional[tuple]) -> str:
    """Why :meth:`quantize_weights` quantized no param of ``module`` (one line)."""
    from ..quant.module import is_weight

    candidates = []
    for path, param in module.named_params():
        try:
            if is_weight(path, param, quantizer):
                candidates.append(f"{path} {list(param.lazy_shape())}")
        except (TypeError, ValueError):  # pragma: no cover - a param without a known shape
            continue
    if block_size is not None and candidates:
        shown = ", ".join(candidates[:4]) + (f" and {len(candidates) - 4} more" if len(candidates) > 4 else "")
        dims = "last dim is" if len(block_size) == 1 else f"last {len(block_size)} dims are"
        return (
            f"no param could be quantized with --block-size {_block_text(block_size)}: no weight's {dims} "
            f"divisible by {_block_text(block_size)} ({shown}); choose a block size that divides them, or "
            "leave out --block-size; nothing was written"
        )
    return "the model has no float weight (rank >= 2) to quantize; nothing was written"
