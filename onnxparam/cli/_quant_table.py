"""The table of what each op with a quantized weight became (``quantize`` and ``inspect``)."""

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
