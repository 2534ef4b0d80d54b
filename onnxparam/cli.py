"""The ``onnxparam`` command line (also ``python -m onnxparam``).

Each subcommand is a :class:`Command`: a name, a one-line help, a function that adds its
arguments to its own parser and a function that runs it and returns the exit code. Add a
command by writing those and listing it in :data:`COMMANDS`; :func:`main` does the rest.

Exit codes: 0 success, 1 a failure (one line on stderr: ``onnxparam: error: ...``), 2 a usage
error (one line on stderr naming the bad argument, as ``argparse`` words it).

Commands:

* ``onnxparam export mnist [--out DIR] [--batch-size N] [--device D]``: load Burn's MNIST
  weights into :class:`onnxparam.zoo.mnist.Mnist`, classify the 1,797 packaged digits through
  ONNX Runtime (module calls), print accuracy and latency, write the traced graph as
  ``DIR/mnist.onnx`` and check that a plain ``onnxruntime.InferenceSession`` on that file gives
  the module's logits.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["main", "build_parser", "export_mnist_onnx", "Command", "COMMANDS", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
"""``argparse``'s (and the Unix) convention for a command-line usage error."""

PROG = "onnxparam"
DEFAULT_OUT_DIR = "onnxparam-out"
DEFAULT_BATCH_SIZE = 256
MNIST_ONNX_FILE = "mnist.onnx"


class UsageError(Exception):
    """A bad command line; :func:`main` prints it as one line and returns :data:`EXIT_USAGE`."""


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


def _device(text: str):
    from .device import Device

    try:
        return Device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _out(line: str = "") -> None:
    print(line, flush=True)


# -- export -----------------------------------------------------------------------------------------

EXPORT_MODELS = ("mnist",)
"""Models ``onnxparam export`` knows (the packaged zoo)."""


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", choices=EXPORT_MODELS, help="the packaged model to export")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT_DIR), metavar="DIR",
                        help=f"output folder, created if missing (default: ./{DEFAULT_OUT_DIR})")
    parser.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                        help=f"digits per module call (default: {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--device", type=_device, default="cpu", metavar="DEVICE",
                        help="'cpu', 'cuda' or 'cuda:N' (default: cpu)")


def export_mnist_onnx(model, path: Path) -> Path:
    """Write the MNIST ``model``'s graph to ``path`` with a dynamic batch dim (input ``x``
    ``["batch", 28, 28]`` float32 raw pixels, output ``["batch", 10]`` logits).

    NOTE: uses ``onnxparam.export_onnx`` (graph + param ids / metadata, atomic write) when the
    package provides it, else the tracer and ``onnx_ir.save`` directly.
    """
    import onnxparam

    from .dtype import DType
    from .trace import InputSpec, trace_module
    from .zoo.mnist import IMAGE_SIZE

    spec = InputSpec(("batch", IMAGE_SIZE, IMAGE_SIZE), DType.F32)
    export = getattr(onnxparam, "export_onnx", None)
    if export is None:
        try:
            from .onnx_io import export_onnx as export
        except ImportError:  # pragma: no cover - a build without the ONNX bridge
            export = None
    if export is not None:
        export(model, path, spec)
    else:  # pragma: no cover
        import onnx_ir as ir

        ir.save(trace_module(model, spec).model, path)
    return Path(path)


def _run_export_mnist(args: argparse.Namespace) -> int:
    from . import Device, Tensor
    from ._ort import import_onnxruntime
    from .zoo import mnist

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None

    device = Device(args.device)
    out_dir: Path = args.out
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out {out_dir} exists and is not a folder")

    weights = mnist.weights_path()
    model = mnist.load_pretrained(device)
    images, labels = mnist.load_digits()
    pixels = images.astype(np.float32)
    n, batch = len(images), args.batch_size
    starts = range(0, n, batch)
    _out(f"model:    Burn MNIST example, {model.num_params():,} params, weights {weights}")
    _out(f"digits:   {n} images {list(images.shape[1:])}, batch size {batch} ({len(starts)} calls)")

    logits = np.empty((n, mnist.NUM_CLASSES), dtype=np.float32)
    times = []
    progress = tqdm(total=n, unit="img", desc="classifying", disable=None, leave=False) if tqdm else None
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
    first_ms = times[0] * 1e3
    per_batch_ms = float(np.median(steady_times)) * 1e3
    images_per_s = sum(steady_sizes) / sum(steady_times)
    _out(f"latency:  {per_batch_ms:.2f} ms/batch (median), {images_per_s:,.0f} images/s; "
         f"first call {first_ms:.1f} ms (trace + session)")

    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / MNIST_ONNX_FILE
    export_mnist_onnx(model, onnx_path)
    _out(f"wrote:    {onnx_path} ({onnx_path.stat().st_size:,} bytes)")

    ort = import_onnxruntime()
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    plain = np.concatenate([session.run(None, {input_name: pixels[s:s + batch]})[0] for s in starts])
    diff = float(np.max(np.abs(plain - logits)))
    same_labels = int((plain.argmax(axis=1) == predicted).sum())
    _out(f"check:    plain onnxruntime.InferenceSession on {onnx_path.name}: max |logits - module logits| = "
         f"{diff:.2e}, same label for {same_labels}/{n} digits")
    if same_labels != n:
        raise RuntimeError(f"the exported graph disagrees with the module on {n - same_labels} digits")
    return EXIT_OK


def _run_export(args: argparse.Namespace) -> int:
    runners = {"mnist": _run_export_mnist}
    return runners[args.model](args)


COMMANDS: tuple = (
    Command("export", "run a packaged model through ONNX Runtime and export it as ONNX",
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
    return "; ".join(lines) or type(error).__name__


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
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    except (OnnxParamError, OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILURE
