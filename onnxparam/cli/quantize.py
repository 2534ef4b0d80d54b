"""``onnxparam quantize``: quantize a model's weights (QDQ ONNX or QFloat burnpack)."""

import argparse
from pathlib import Path
from typing import Optional

from ._common import EXIT_OK, Unavailable, _file_format, _out, _positive_int
from ._models import _add_model_arguments, _count_dtypes, _load_model
from .inspect import _scheme_text

QUANT_SCHEMES = {"q8s": "Q8S", "q8f": "Q8F", "q4s": "Q4S", "q4f": "Q4F"}
"""``--scheme`` -> :class:`onnxparam.quant.QuantValue` name (Burn's: ``S`` symmetric range, ``F`` full)."""


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
        type=_positive_int,
        metavar="N",
        help="one scale per N values of the last axis (default: one scale per tensor)",
    )
    _add_model_arguments(parser)


def _quantizer(scheme_name: str, block_size: Optional[int]):
    from .. import quant

    Quantizer = getattr(quant, "Quantizer", None)
    if Quantizer is None:
        raise Unavailable(
            "quantizing a model needs onnxparam.quant.Quantizer, which this build of onnxparam does not have yet"
        )
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
    _out(
        f"quantized: {after.get('QFloat', 0) - before.get('QFloat', 0)} of {sum(before.values())} params to "
        f"{_scheme_text(scheme)}; dtypes {before} -> {after}"
    )
    _out(f"wrote:     {args.dst} ({args.dst.stat().st_size:,} bytes; IN {args.src.stat().st_size:,} bytes)")
    return EXIT_OK
