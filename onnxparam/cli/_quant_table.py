"""The table of what each op with a quantized weight became (``quantize`` and ``inspect``)."""

from typing import Optional

from ..quant._qdq_forms import SPEED_REASON
from ._common import _out


def print_quantized_ops(rows: list) -> None:
    """``ops:`` summary line, then one row per op: node, op, weight, form
    (:func:`onnxparam.quant.quantized_ops`'s rows), then why each weight written float by force
    is float (``reason``). Prints nothing for no rows."""
    if not rows:
        return
    counts: dict = {}
    for row in rows:
        key = f"{row['op']} {row['form']}"
        counts[key] = counts.get(key, 0) + 1
    _out(f"ops:       {len(rows)} with quantized weights: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    table = [["node", "op", "weight", "form"]] + [[r["node"], r["op"], r["weight"], r["form"]] for r in rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(4)]
    for r in table:
        _out("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    reasons = {r["weight"]: r["reason"] for r in rows if r.get("reason")}
    for weight, reason in reasons.items():
        _out(f"  {weight} is float: {reason}")


LITTLE_GAIN = 0.9
"""An output at least this fraction of the input's size, with float weights, gained little."""


def _op_counts(rows: list) -> str:
    counts: dict = {}
    for row in rows:
        counts[row["op"]] = counts.get(row["op"], 0) + 1
    return ", ".join(f"{n} {op}" for op, n in counts.items())


def little_gained(rows: list, out_bytes: int, in_bytes: int, calibrated: bool, prefer: str) -> Optional[str]:
    """The warning ``onnxparam quantize`` gives when its .onnx output is (nearly) the float model:
    every op's weight was written float, or some were and the output is at least
    :data:`LITTLE_GAIN` of the input's size; ``None`` otherwise. It says which ops kept float
    weights, why, and what would change that (``--calibrate``, ``--prefer size``, ``--scheme``).

    Args:
        rows: :func:`onnxparam.quant.quantized_ops` of the output.
        out_bytes: the output file's size; in_bytes: the input file's size.
        calibrated: whether ``--calibrate`` was given; prefer: ``--prefer``.
    """
    floats = [r for r in rows if r["form"] == "float"]
    if not floats or (len(floats) < len(rows) and out_bytes < LITTLE_GAIN * in_bytes):
        return None
    ratio = out_bytes / in_bytes if in_bytes else 1.0
    if len(floats) == len(rows):
        head = (f"nothing got smaller or faster: every quantized weight was written float with its original "
                f"values ({_op_counts(floats)}), so the output computes exactly as the float model")
    else:
        head = (f"little got smaller: {len(floats)} of {len(rows)} ops keep float weights ({_op_counts(floats)}; "
                "original values)")
    parts = [f"{head}; the output is {ratio:.0%} of the input's size"]
    chosen = [r for r in floats if not r.get("reason") or r["reason"].startswith(SPEED_REASON)]
    forced = [r for r in floats if r not in chosen]
    if chosen and prefer == "speed":
        # NOTE: calibration gives static int8 to Conv / MatMul only (onnxparam.quant._qdq_static)
        calibratable = any(r["op"] in ("Conv", "MatMul") for r in chosen)
        fixes = ([] if calibrated or not calibratable else
                 ["--calibrate INPUTS.npz (representative inputs) for static int8 (QLinearConv / QLinearMatMul)"])
        fixes.append("--prefer size for a smaller file (those weights then dequantize at every run)")
        parts.append(f"{_op_counts(chosen)} stay float because ONNX Runtime runs them slower with a weight-only "
                     f"DequantizeLinear than in float; use " + " or ".join(fixes))
    if forced:
        parts.append(f"{_op_counts(forced)} have no quantized form here (reasons above); a 4-bit weight needs "
                     "opset 21 or a MatMul / Gemm use: --scheme q8s quantizes them")
    return "; ".join(parts)


def print_kept_float(rows: list) -> None:
    """One line per param left float by role or size (``{"weight", "reason"}`` rows of
    :func:`onnxparam.quant._module.kept_float`): ``  <path> is float: <reason>``."""
    for row in rows:
        _out(f"  {row['weight']} is float: {row['reason']}")


def not_smaller(out_bytes: int, in_bytes: int, kept: dict, quantized: int, fmt: str) -> str:
    """The warning for an output not smaller than its input, naming why: how many params stayed
    float and why (by reason kind), and the export's own overhead for the few that were quantized."""
    kinds: dict = {}
    for reason in kept.values():
        key = "not smaller quantized" if reason.startswith("not smaller") else "not weights"
        kinds[key] = kinds.get(key, 0) + 1
    why = ", ".join(f"{n} {k}" for k, n in kinds.items())
    return (f"the output ({out_bytes:,} bytes) is not smaller than the input ({in_bytes:,} bytes): only {quantized} "
            f"param(s) were quantized{f' ({why} stayed float)' if why else ''}, and the {fmt} "
            "form's nodes, scales and metadata cost more than their codes save; keep the float model")


def print_accuracy(report: dict, indent: str = "") -> None:
    """The accuracy report of ``onnxparam quantize`` (:data:`onnxparam.quant._accuracy.ACCURACY_KEY`):
    one line saying on what inputs, then one line per output (cosine, max abs error); a report
    that was skipped says why."""
    if report.get("skipped"):
        _out(f"{indent}accuracy:  not measured: {report['skipped']}")
        return
    outputs = report.get("outputs") or []
    _out(f"{indent}accuracy:  vs the float model on {report.get('inputs', '?')}"
         + (f" (--min-cosine {report['min_cosine']})" if report.get("min_cosine") is not None else ""))
    width = max((len(str(r.get("output", ""))) for r in outputs), default=0)
    for r in outputs:
        _out(f"{indent}  {str(r.get('output', '')).ljust(width)}  cosine {float(r['cosine']):.6f}  "
             f"max abs error {float(r['max_abs_error']):.6g}")
    for r in report.get("sensitivity") or []:
        _out(f"{indent}  moves the outputs most: {r['weight']} (alone: cosine {float(r['cosine']):.6f})")
    if report.get("weights_together") is not None:
        _out(f"{indent}  all the quantized weights' rounding together (activations float): cosine "
             f"{float(report['weights_together']):.6f}")
