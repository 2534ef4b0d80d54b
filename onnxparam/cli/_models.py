"""Loading a model (architecture + weights) for ``quantize`` and ``lora``."""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ._common import PROG, UsageError, _existing, _file_format

ZOO_MODELS = ("mnist",)
"""Architectures of the packaged zoo, for weights files without a graph (``--zoo``)."""

LORA_FACTOR_RE = r"\.lora\.[ab]$"
"""Record paths of LoRA factors: ``<param>.lora.a`` (d_in, rank) and ``<param>.lora.b`` (rank, d_out)."""


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    arch = parser.add_mutually_exclusive_group()
    arch.add_argument(
        "--graph",
        type=Path,
        metavar="MODEL.onnx",
        help="the architecture for a .bpk/.safetensors MODEL: its weights are loaded into this "
        "ONNX graph (imported as a module)",
    )
    arch.add_argument(
        "--zoo", choices=ZOO_MODELS, help="the architecture for a .bpk/.safetensors MODEL: a packaged model"
    )


@dataclass
class _Model:
    """A module to transform, and how to export it (an imported graph needs no inputs)."""

    module: Any
    zoo: Optional[str] = None

    def export(self, path: Path, lora: str = "merge") -> Path:
        if self.zoo == "mnist":
            return export_mnist_onnx(self.module, path, lora=lora)
        from ..onnx_io import export_onnx

        return export_onnx(self.module, path, lora=lora)


def _architecture(args, src: Path, src_fmt: str) -> _Model:
    """The bare module ``src``'s weights go into: ``src`` itself (``.onnx``), ``--graph`` or ``--zoo``."""
    if src_fmt == "onnx":
        if args.graph is not None or args.zoo is not None:
            raise UsageError(
                f"{PROG} {args.command}: error: --graph/--zoo apply to a .bpk/.safetensors model file; "
                f"'{src}' is a graph itself"
            )
        from ..onnx_io import import_onnx

        return _Model(import_onnx(src))
    if args.zoo == "mnist":
        from ..zoo.mnist import Mnist

        return _Model(Mnist(), zoo="mnist")
    if args.graph is None:
        raise UsageError(
            f"{PROG} {args.command}: error: a {src.suffix} file holds weights, not a graph: give "
            "its architecture with --graph MODEL.onnx or --zoo mnist"
        )
    _file_format(args.graph, "the --graph file", ("onnx",))
    _existing(args.graph, "the --graph file")
    from ..onnx_io import import_onnx

    return _Model(import_onnx(args.graph))


def _load_weights(module, path: Path, fmt: str, allow_partial: bool = False):
    """``module`` holding the tensors of a ``.bpk`` / ``.safetensors`` file (every one required
    unless ``allow_partial``)."""
    if fmt == "burnpack":
        return module.try_load_file(path, allow_partial=allow_partial)
    from ..convert import load_safetensors

    return load_safetensors(module, path, allow_partial=allow_partial)


def _load_model(args, src: Path) -> _Model:
    src_fmt = _file_format(src, "model file")
    _existing(src, "model file")
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


def export_mnist_onnx(model, path: Path, lora: str = "merge") -> Path:
    """Write the MNIST ``model``'s graph to ``path`` with a dynamic batch dim (input ``x``
    ``["batch", 28, 28]`` float32 raw pixels, output ``["batch", 10]`` logits).

    ``lora``: the LoRA mode of :func:`onnxparam.export_onnx` (``"merge"``, ``"keep"``, ``"inputs"``).
    """
    from ..core.dtype import DType
    from ..onnx_io import export_onnx
    from ..trace.tracer import InputSpec
    from ..zoo.mnist import IMAGE_SIZE

    spec = InputSpec(("batch", IMAGE_SIZE, IMAGE_SIZE), DType.F32)
    export_onnx(model, path, spec, lora=lora)
    return Path(path)
