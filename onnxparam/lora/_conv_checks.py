"""What a convolution LoRA adapter must be for its branch to be PEFT's (``peft/tuners/lora/layer.py``
``_ConvNd``, PEFT 0.21): the checks the export modes, the batched stacks and the PEFT writers share.

PEFT's conv LoRA on a base ``ConvNd(in, out, kernel, stride, padding, dilation, groups)`` is
``lora_A = ConvNd(in, r, kernel, stride, padding)`` (every input channel; **no** dilation, groups
or padding mode: zeros) then ``lora_B = ConvNd(r, out, 1, groups=groups)``. Here ``a`` is ``(in *
prod(kernel), r)`` and ``b`` ``(r, out)``; for ``groups > 1`` ``b`` is ``lora_B`` as a dense
matrix: zero outside each group's block (:func:`grouped_b_problem`).

* :func:`grouped_b_problem`: a grouped conv's ``b`` must be block-diagonal (rows ``g * r / groups
  ...`` feed only group ``g``'s ``out / groups`` output channels) and ``r`` a multiple of
  ``groups``; otherwise it is not PEFT's ``lora_B`` (PEFT cannot hold it, and a ``"keep"``
  graph's group mask would drop the entries a batched graph adds).
* :func:`conv_node_problem`: the ONNX ``Conv`` node a **grouped** convolution's adapter
  (``groups > 1``) runs beside. Such an adapter is no weight delta (``lora_A`` mixes the groups'
  channels): PEFT's unmerged forward is its only definition, which the branch (``lora_A`` as a
  ``Conv`` with the node's strides / pads / ``auto_pad``) must equal. Refused, where PEFT's
  ``lora_A`` and the base conv disagree on the input window, so that the branch would be a
  guess:

  - ``dilations`` > 1 on an axis whose kernel is longer than 1: PEFT's ``lora_A`` is not dilated,
    its output is another size (PEFT's forward fails: ``Conv2d(3, dilation=2, padding=2,
    groups=2)``) or, through a stride, the same size with other values;
  - an input padded by a ``Pad`` node of mode ``reflect`` / ``edge`` / ``wrap``: what torch's
    exporters write for ``ConvNd(padding_mode="reflect" / "replicate")`` (``Pad`` then ``Conv``
    with zero pads), where PEFT's ``lora_A`` pads the unpadded input with zeros instead; the
    same graph comes from an explicit ``ReflectionPad2d`` before a ``Conv2d(padding=0)``, where
    PEFT's ``lora_A`` reads the padded input: the graph cannot tell them apart;
  - an input wrapped by a ``Concat`` of a ``Slice`` of its middle input, that input, and another
    ``Slice`` of it (:func:`circular_pad`): what torch's TorchScript exporter writes for
    ``padding_mode="circular"`` (dynamo writes a ``Pad`` of mode ``wrap``), or an explicit
    ``F.pad(x, mode="circular")``: the same doubt.

  They agree (supported: the branch equals PEFT's forward): strides, symmetric and asymmetric
  ``pads`` (torch writes symmetric ones; asymmetric ones come from other exporters or from a
  zero ``Pad`` folded into the ``Conv``: PEFT's ``lora_A`` after a ``ZeroPad2d``), ``auto_pad``
  (torch's ``padding="same"``: PEFT's ``lora_A`` takes ``padding="same"`` too), a dilation on a
  length-1 kernel axis, a ``Pad`` of mode ``constant``.

  A ``groups == 1`` adapter is a weight delta: every mode applies the merged weight ``W +
  delta`` with the node's own attributes (dilated or on a reflect-padded input too), which is
  PEFT's merged model (``merge_and_unload``); PEFT's *unmerged* forward differs there (measured
  ``|unmerged - merged|`` ~1 for random factors on ``Conv2d(3, dilation=2, stride=3, padding=1)``
  and ``padding_mode="reflect"``, PEFT 0.21).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["grouped_b_problem", "check_grouped_b", "slot_factors", "conv_node_problem", "node_label", "check_conv_node"]


def grouped_b_problem(b: np.ndarray, shape: tuple, d_in: int) -> Optional[str]:
    """Why ``b`` ``(r, out)`` of a conv adapter on the weight ``shape`` ``(out, in / groups,
    *kernel)`` (``a`` with ``d_in`` rows) is not PEFT's grouped ``lora_B``, or ``None`` (also for
    ``groups == 1``, any ``b``): ``r`` or ``out`` no multiple of ``groups``, or an entry outside
    the diagonal blocks (rows ``g * r / groups ... (g + 1) * r / groups`` by columns ``g * out /
    groups ...``)."""
    from ._adapters import conv_adapter_groups

    groups = conv_adapter_groups(tuple(int(d) for d in shape), int(d_in))
    if groups <= 1:
        return None
    r, out = int(b.shape[0]), int(shape[0])
    if r % groups or out % groups:
        return f"rank {r} is no multiple of the conv's groups={groups} (PEFT needs one)"
    per_in, per_out = r // groups, out // groups
    mask = np.kron(np.eye(groups, dtype=bool), np.ones((per_in, per_out), dtype=bool))
    if np.any(b[~mask] != 0):
        return (f"b is not zero outside each group's {per_in} rows at rank {r} (a conv with groups={groups}): not "
                "PEFT's grouped-conv LoRA")
    return None


def check_grouped_b(b: np.ndarray, shape: tuple, d_in: int, what: str) -> None:
    """Raise :class:`~onnxparam.core.errors.LoraError` ``"<what>: <why>"`` when
    :func:`grouped_b_problem` finds ``b`` (the adapter's own, unscaled or scaled) is not PEFT's
    grouped ``lora_B``; ``what`` names the weight (and the mode or adapter)."""
    problem = grouped_b_problem(b, shape, d_in)
    if problem is not None:
        from ..core.errors import LoraError

        raise LoraError(f"{what} {[int(d) for d in shape]}: {problem}; a grouped convolution's lora_B feeds each "
                        "group's output channels from its own rows of b only (a 'keep' graph would drop the other "
                        "entries, an 'inputs' or 'batched' one add them)")


def slot_factors(a: np.ndarray, b: np.ndarray, groups: int) -> tuple:
    """One slot of a stack, ``a`` ``(d_in, r_max)`` / ``b`` ``(r_max, d_out)``, cut to its rank:
    ``1 +`` its last column of ``a`` / row of ``b`` with a non-zero entry (``0``: all zeros),
    rounded up to a multiple of ``groups`` (PEFT: a grouped conv's rank divides by its groups),
    zero-padded when that passes ``r_max``. Returns ``(a, b)``."""
    used = np.flatnonzero(np.any(a != 0, axis=0) | np.any(b != 0, axis=1))
    r = int(used[-1]) + 1 if used.size else 0
    if r:
        r = -(-r // groups) * groups
    pad = max(r - a.shape[1], 0)
    return np.pad(a, ((0, 0), (0, pad)))[:, :r], np.pad(b, ((0, pad), (0, 0)))[:r]


def _ints(node, name: str) -> Optional[list]:
    attr = node.attributes.get(name)
    return None if attr is None else [int(v) for v in attr.value]


def circular_pad(x):
    """The ``Concat`` node that makes ``x`` from ``[Slice(v), v, Slice(v)]`` (a circular pad of
    ``v``: torch's TorchScript ``padding_mode="circular"``), or ``None``."""
    producer = x.producer() if x is not None else None
    if producer is None or producer.op_type != "Concat" or producer.domain not in ("", "ai.onnx") \
            or len(producer.inputs) != 3 or producer.inputs[1] is None:
        return None
    middle = producer.inputs[1]
    for side in (producer.inputs[0], producer.inputs[2]):
        made = side.producer() if side is not None else None
        if made is None or made.op_type != "Slice" or not made.inputs or made.inputs[0] is not middle:
            return None
    return producer


def conv_node_problem(node, shape: tuple) -> Optional[str]:
    """Why PEFT's ``lora_A`` and the ONNX ``Conv`` ``node`` (weight ``shape`` ``(out, in / groups,
    *kernel)``) read different input windows (module docstring), or ``None`` when they agree."""
    kernel = [int(d) for d in shape[2:]]
    dilations = _ints(node, "dilations")
    if dilations and any(d != 1 and k != 1 for d, k in zip(dilations, kernel)):
        return (f"dilations={dilations} with a {kernel} kernel: PEFT's lora_A takes the base's stride and padding "
                "but no dilation, so PEFT's forward fails (another output size) or reads other input windows than "
                "the base conv; which one a branch should follow is unknown")
    x = node.inputs[0] if node.inputs else None
    producer = x.producer() if x is not None else None
    if producer is not None and producer.op_type == "Pad" and producer.domain in ("", "ai.onnx"):
        attr = producer.attributes.get("mode")
        mode = attr.value if attr is not None else "constant"
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        if mode != "constant":
            return (f"its input is padded by Pad node {producer.name!r} (mode={mode!r}): torch writes that for a "
                    "ConvNd with padding_mode='reflect' / 'replicate' / 'circular', where PEFT's lora_A pads the "
                    "unpadded input with zeros, and for an explicit pad before a ConvNd(padding=0), where lora_A reads "
                    "the padded input; the graph cannot tell which is meant")
    wrapped = circular_pad(x)
    if wrapped is not None:
        return (f"its input is wrapped by Concat node {wrapped.name!r} (Slices of its middle input around it, a "
                "circular pad): torch's TorchScript exporter writes that for a ConvNd with padding_mode='circular', "
                "where PEFT's lora_A pads the unpadded input with zeros, and for an explicit circular pad before a "
                "ConvNd(padding=0), where lora_A reads the padded input; the graph cannot tell which is meant")
    return None


def node_label(node) -> str:
    """``Conv node 'name' (group=g, strides=[..], pads=[..], dilations=[..])`` for a message."""
    group = node.attributes.get("group")
    parts = [f"group={int(group.value) if group is not None else 1}"]
    for name in ("strides", "pads", "dilations"):
        values = _ints(node, name)
        if values is not None:
            parts.append(f"{name}={values}")
    return f"Conv node {node.name!r} ({', '.join(parts)})"


def check_conv_node(node, path: str, shape: tuple, groups: int, mode: str) -> None:
    """Raise :class:`~onnxparam.core.errors.LoraError` naming the weight ``path``, the ``node`` and
    the mode when :func:`conv_node_problem` finds a doubt on the ``Conv`` whose weight it is and
    the adapter is a grouped convolution's (``groups > 1``)."""
    from ..core.errors import LoraError

    if groups <= 1:
        return  # a weight delta: the merged weight is the definition (module docstring)
    problem = conv_node_problem(node, shape)
    if problem is None:
        return
    weight = [int(d) for d in shape]
    raise LoraError(f"lora={mode!r}: {path!r} {weight} is the weight of {node_label(node)}: {problem}; "
                    "a grouped convolution's adapter has no merged weight to fall back on: leave this weight out of the "
                    "adapters (narrow target_modules / the param_group)")
