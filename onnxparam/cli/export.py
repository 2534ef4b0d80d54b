"""``onnxparam export mnist``: the tour of the packaged MNIST model."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ._common import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_OUT_DIR,
    EXIT_OK,
    MNIST_ONNX_FILE,
    _device,
    _out,
    _positive_int,
    _progress,
    json_result,
)
from ._models import export_mnist_onnx
from .inspect import _print_table, _scheme_text
from .quantize import _quantizer

if TYPE_CHECKING:
    import numpy as np  # NOTE: imported where used, so `onnxparam --help` / `--version` skip it

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


INT8_NOTE = (
    "the int8 file is ~0.37x the size: the fc weights are int8 and run ONNX Runtime's dynamic-quantization "
    "integer kernels; the small convs stay float32, because without calibration data a weight-only int8 conv "
    "is dequantized at every run (the default never picks a form slower than float32: onnxparam quantize "
    "--calibrate or onnxparam.quant.quantize_activations turns the convs into QLinearConv); at MNIST's size "
    "the timings of the rows are within this machine's noise"
)
LORA_NOTE = (
    f"the LoRA rows use rank-{TOUR_LORA_RANK} adapters (alpha {TOUR_LORA_ALPHA:g}) whose b factors are small random "
    f"values (std {TOUR_LORA_B_STD:g}), not the zeros of fresh adapters, so that comparing the kept and merged "
    "graphs checks a real delta; that untrained delta is why their accuracy differs from float32"
)


def _make_out_dir(out_dir: Path) -> None:
    """Create ``--out`` (parents too) or raise the library's :class:`FileAccessError` leaf of
    the ``errno`` (``FileMissingError``, ``FilePermissionError``, ``NotAFolderError`` ...) on
    one line naming the folder and why."""
    import errno

    from ..core.errors import file_error

    if out_dir.exists() and not out_dir.is_dir():
        raise file_error(errno.ENOTDIR, f"--out {out_dir} exists and is not a folder", str(out_dir))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        code = e.errno or errno.EIO
        raise file_error(code, f"cannot create the --out folder '{out_dir}': {e.strerror or e}; "
                               "give a folder that can be created or written", str(out_dir)) from None


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", choices=EXPORT_MODELS, help="the packaged model to export")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT_DIR),
        metavar="DIR",
        help=f"output folder, created if missing (default: ./{DEFAULT_OUT_DIR})",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"digits per module call (default: {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--device", type=_device, default="cpu", metavar="DEVICE", help="'cpu', 'cuda' or 'cuda:N' (default: cpu)"
    )
    parser.add_argument(
        "--only",
        choices=TOUR_PARTS,
        action="append",
        metavar="PART",
        help=f"run only these parts of the tour (repeatable; {', '.join(TOUR_PARTS)}; default: all)",
    )


@dataclass
class _TourRow:
    variant: str
    file: Optional[Path] = None
    accuracy: Optional[float] = None
    ms_per_batch: Optional[float] = None
    images_per_s: Optional[float] = None
    note: str = ""


def _latency(times: list, batch: int) -> tuple:
    """``(ms per batch, images per second)`` from ``[(seconds, images)]`` of successive calls,
    both on one basis: the median seconds of the full ``batch``-sized calls after the first (the
    first builds sessions; a short last batch would skew the median), and ``batch`` / that median.
    With fewer calls, whichever there are."""
    import numpy as np

    steady = times[1:] if len(times) > 1 else times
    full = [(t, k) for t, k in steady if k == batch] or steady
    seconds = float(np.median([t for t, _ in full]))
    images = float(np.median([k for _, k in full]))
    return seconds * 1e3, images / seconds if seconds > 0 else float("inf")


LATENCY_NOTE = (
    "ms/batch is the median time of one full batch after the first call (which builds the session); "
    "images/s = batch size / that median"
)


def _session_pass(path: Path, pixels: np.ndarray, batch: int, providers: list):
    """Logits of a plain ``onnxruntime.InferenceSession`` on ``path`` over all ``pixels``, and
    :func:`_latency` of its calls (ms per batch, images per second)."""
    import numpy as np

    from ..runtime._ort import import_onnxruntime

    ort = import_onnxruntime()
    session = ort.InferenceSession(str(path), providers=providers)
    name = session.get_inputs()[0].name
    outputs, times = [], []
    for start in range(0, len(pixels), batch):
        x = pixels[start : start + batch]
        t0 = time.perf_counter()
        outputs.append(session.run(None, {name: x})[0])
        times.append((time.perf_counter() - t0, len(x)))
    return (np.concatenate(outputs), *_latency(times, batch))




def _run_export_mnist(args: argparse.Namespace) -> int:
    import numpy as np

    from ..core.device import Device
    from ..core.tensor import Tensor
    from ..zoo import mnist

    parts = set(args.only or TOUR_PARTS)
    device = Device(args.device)
    out_dir: Path = args.out
    _make_out_dir(out_dir)  # before any work: a folder that cannot be made is one line naming it
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.is_cuda else ["CPUExecutionProvider"]

    weights = mnist.weights_path()
    model = mnist.load_pretrained(device)
    images, labels = mnist.load_digits()
    pixels = images.astype(np.float32)
    n, batch = len(images), args.batch_size
    starts = range(0, n, batch)
    _out(f"model:    Burn MNIST example, {model.num_params():,} params, weights {weights}")
    _out(f"digits:   {n} images {list(images.shape[1:])}, batch size {batch} ({len(starts)} calls)")
    rows: list[_TourRow] = []

    def accuracy(logits: np.ndarray) -> float:
        return float((logits.argmax(axis=1) == labels).mean())

    # 1. float32: the module through ONNX Runtime, then its exported graph in a plain session.
    logits = np.empty((n, mnist.NUM_CLASSES), dtype=np.float32)
    times = []
    progress = _progress(n, "classifying", quiet=getattr(args, "quiet", False), unit="img")
    for start in starts:
        x = Tensor.from_numpy(pixels[start : start + batch], device)
        t0 = time.perf_counter()
        y = model(x).to_numpy()
        times.append((time.perf_counter() - t0, len(y)))
        logits[start : start + batch] = y
        if progress is not None:
            progress.update(len(y))
    if progress is not None:
        progress.close()
    predicted = logits.argmax(axis=1)
    correct = int((predicted == labels).sum())
    _out(f"accuracy: {correct / n:.4f} ({correct}/{n}) through ONNX Runtime, device {device}")
    json_result("model", {"name": "mnist", "params": model.num_params(), "weights": str(weights), "device": str(device),
                          "images": n, "batch_size": batch, "correct": correct, "accuracy": correct / n})
    # NOTE: the first call traces the forward and builds the ORT session; latency is the
    # steady state after it (all calls when there is only one).
    per_batch_ms, images_per_s = _latency(times, batch)
    _out(
        f"latency:  {per_batch_ms:.2f} ms/batch (median), {images_per_s:,.0f} images/s; "
        f"first call {times[0][0] * 1e3:.1f} ms (trace + session)"
    )
    rows.append(_TourRow("float32 module", None, correct / n, per_batch_ms, images_per_s, "module calls"))

    if "float32" in parts:
        onnx_path = out_dir / TOUR_FILES["float32"]
        export_mnist_onnx(model, onnx_path)
        _out(f"wrote:    {onnx_path} ({onnx_path.stat().st_size:,} bytes)")
        plain, ms, ips = _session_pass(onnx_path, pixels, batch, providers)
        diff = float(np.max(np.abs(plain - logits)))
        same_labels = int((plain.argmax(axis=1) == predicted).sum())
        _out(
            f"check:    plain onnxruntime.InferenceSession on {onnx_path.name}: max |logits - module logits| = "
            f"{diff:.2e}, same label for {same_labels}/{n} digits"
        )
        if same_labels != n:
            raise RuntimeError(f"the exported graph disagrees with the module on {n - same_labels} digits")
        rows.append(_TourRow("float32 ONNX", onnx_path, accuracy(plain), ms, ips, "plain ORT session"))

    if "burnpack" in parts:
        rows.append(_tour_burnpack(model, out_dir / TOUR_FILES["burnpack"], weights, pixels, labels, batch, device))

    if "int8" in parts:
        rows.append(_tour_int8(model, out_dir / TOUR_FILES["int8"], pixels, batch, providers, accuracy))

    if "lora" in parts:
        rows += _tour_lora(model, out_dir, pixels, batch, providers, accuracy)

    _out()
    table = [["variant", "file", "bytes", "accuracy", "ms/batch", "images/s", "note"]]
    for r in rows:
        table.append(
            [
                r.variant,
                r.file.name if r.file else "-",
                f"{r.file.stat().st_size:,}" if r.file else "-",
                "-" if r.accuracy is None else f"{r.accuracy:.4f}",
                "-" if r.ms_per_batch is None else f"{r.ms_per_batch:.2f}",
                "-" if r.images_per_s is None else f"{r.images_per_s:,.0f}",
                r.note,
            ]
        )
    _print_table(table, right={2, 3, 4, 5})
    json_result("variants", [_row_json(r) for r in rows])
    _out()
    _out(f"note:     {LATENCY_NOTE}.")
    if any(r.variant.startswith("LoRA") and r.file for r in rows):
        _out(f"note:     {LORA_NOTE}.")
    if any(r.variant.startswith("int8") and r.file for r in rows):
        _out(f"note:     {INT8_NOTE}.")
    return EXIT_OK


def _row_json(row: _TourRow) -> dict:
    """One row of the tour's table for ``--json`` (a QDQ file adds its per-op report)."""
    doc = {"variant": row.variant, "path": None if row.file is None else str(row.file),
           "bytes": None if row.file is None else row.file.stat().st_size, "accuracy": row.accuracy,
           "ms_per_batch": row.ms_per_batch, "images_per_s": row.images_per_s, "note": row.note}
    if row.file is not None and row.file.suffix == ".onnx":
        from ..quant import quantized_ops

        doc["ops"] = quantized_ops(row.file)
    return doc


def _tour_burnpack(model, path: Path, weights: Path, pixels, labels, batch, device) -> _TourRow:
    """``module.save_file`` then every tensor compared, byte for byte, with Burn's file; then the
    file loaded into a fresh module, which classifies the digits."""
    import numpy as np

    from .. import burnpack
    from ..core.tensor import Tensor
    from ..zoo.mnist import Mnist

    model.save_file(path)
    problems = []
    with burnpack.read(weights) as burn, burnpack.read(path) as ours:
        for name, theirs in burn.tensors.items():
            mine = ours.tensors.get(name)
            if mine is None:
                problems.append(f"'{name}' missing")
            elif (mine.dtype, mine.shape, mine.param_id) != (theirs.dtype, theirs.shape, theirs.param_id):
                problems.append(
                    f"'{name}': {mine.dtype.name} {list(mine.shape)} id {mine.param_id} != "
                    f"{theirs.dtype.name} {list(theirs.shape)} id {theirs.param_id}"
                )
            elif bytes(mine.raw_bytes()) != bytes(theirs.raw_bytes()):
                problems.append(f"'{name}': data differs")
        extra = sorted(set(ours.tensors) - set(burn.tensors))
        problems += [f"'{name}' not in Burn's file" for name in extra]
        count = len(burn.tensors)
    if problems:
        raise RuntimeError(f"burnpack round trip: {path} differs from {weights}: " + "; ".join(problems))
    same_file = path.read_bytes() == weights.read_bytes()
    _out(
        f"burnpack: wrote {path} ({path.stat().st_size:,} bytes); {count}/{count} tensors byte-identical to "
        f"{weights.name} (dtype, shape, param id, data); whole file {'identical' if same_file else 'differs (metadata)'}"
    )
    reloaded = Mnist(device).load_file(path)
    logits, times = [], []
    for start in range(0, len(pixels), batch):
        x = Tensor.from_numpy(pixels[start : start + batch], device)
        t0 = time.perf_counter()
        logits.append(reloaded(x).to_numpy())
        times.append((time.perf_counter() - t0, len(x)))
    ms, ips = _latency(times, batch)
    acc = float((np.concatenate(logits).argmax(axis=1) == labels).mean())
    return _TourRow("burnpack", path, acc, ms, ips, f"module loaded from it; {count}/{count} tensors = Burn's")


def _tour_int8(model, path: Path, pixels, batch, providers, accuracy) -> _TourRow:
    quantizer, scheme = _quantizer("q8s", None)
    quantized = model.quantize_weights(quantizer)
    export_mnist_onnx(quantized, path)
    logits, ms, ips = _session_pass(path, pixels, batch, providers)
    _out(f"int8:     wrote {path} ({path.stat().st_size:,} bytes), weights {_scheme_text(scheme)}")
    return _TourRow("int8 QDQ ONNX", path, accuracy(logits), ms, ips, "plain ORT session")


def _tour_lora(model, out_dir: Path, pixels, batch, providers, accuracy) -> list:
    import numpy as np

    from ..core.dtype import DType
    from ..core.group import ParamGroup
    from ..core.record import ModuleRecord, TensorSnapshot
    from ..core.tensor import TensorData
    from ..lora._adapters import LoraConfig

    adapted = model.apply_lora(
        LoraConfig(TOUR_LORA_RANK, TOUR_LORA_ALPHA, seed=0, param_group=ParamGroup.from_regex(TOUR_LORA_TARGETS))
    )
    rng = np.random.default_rng(0)
    factors = {}
    for path, param in adapted.named_params():
        if path.endswith(".lora.b"):
            values = rng.normal(0.0, TOUR_LORA_B_STD, size=tuple(param.lazy_shape())).astype(np.float32)
            factors[path] = TensorSnapshot(
                DType.F32, values.shape, param.id, lambda _v=values: TensorData.from_numpy(_v)
            )
    adapted = adapted.try_load_record(ModuleRecord(factors), allow_partial=True)
    rows, results = [], {}
    for mode, label in (("merge", "LoRA merged ONNX"), ("keep", "LoRA kept ONNX")):
        path = out_dir / TOUR_FILES[f"lora-{mode}"]
        export_mnist_onnx(adapted, path, lora=mode)
        logits, ms, ips = _session_pass(path, pixels, batch, providers)
        results[mode] = logits
        _out(
            f"lora:     wrote {path} ({path.stat().st_size:,} bytes): rank {TOUR_LORA_RANK}, alpha "
            f"{TOUR_LORA_ALPHA:g} on {TOUR_LORA_TARGETS}, lora={mode!r}"
        )
        rows.append(_TourRow(label, path, accuracy(logits), ms, ips, "plain ORT session; random b, see note"))
    if len(results) == 2:
        diff = float(np.max(np.abs(results["merge"] - results["keep"])))
        _out(f"check:    LoRA merged vs kept: max |logits difference| = {diff:.2e}")
        if diff > 1e-3:
            raise RuntimeError(f"the merged and kept LoRA graphs disagree (max |difference| {diff:.2e})")
    return rows


def _run_export(args: argparse.Namespace) -> int:
    runners = {"mnist": _run_export_mnist}
    return runners[args.model](args)
