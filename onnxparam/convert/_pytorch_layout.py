"""PyTorch <-> Burn layouts for a file-to-file conversion, where no module says which layer a
tensor belongs to (``convert(..., pytorch=True)``, ``onnxparam convert --pytorch``).

With a module, :class:`~onnxparam.convert._adapters.PyTorchAdapter` decides by the type of the
module holding each param (Burn's ``PyTorchToBurnAdapter``). A file has names and shapes only,
so this module decides a layout from *the file's own evidence*, never from one tensor's shape,
and lists every tensor it could not decide (``report.untouched``, with the reason):

* A rank-2 ``P.weight`` with a rank-1 ``P.bias`` whose two dims differ says itself which dim
  its bias follows: dim 0 is PyTorch's ``nn.Linear`` layout ``(out, in)``; dim 1 is
  ``(in, out)``, Burn's ``Linear`` layout and the one Hugging Face's GPT-2 / GPT-J ``Conv1D``
  stores. A bias matching neither dim leaves the weight untouched.
* A *square* weight's bias fits both dims. It follows its **family**: the weights whose module
  path is the same once the integer segments are wildcarded (``h.0.attn.c_proj`` and
  ``h.11.attn.c_proj`` are one family ``h.*.attn.c_proj``), when the family's non-square members
  agree. A family with no non-square member follows **the whole file** when every non-square
  weight with a bias in it agrees (a GPT-2 file is all ``Conv1D``, a BERT file all
  ``nn.Linear``). Otherwise (no evidence, or both layouts present) it is untouched.
* To Burn, a weight in ``(out, in)`` is transposed and one in ``(in, out)`` is kept; to
  PyTorch (``nn.Linear``), the reverse.

Other rules (names only):

===========================================  ==============================================
rank-2 ``P.weight`` without ``P.bias``        ``nn.Linear(bias=False)`` *or* ``nn.Embedding``
                                              (never transposed): **untouched**, listed
rank-1 ``P.weight`` + rank-1 ``P.bias`` (or   a norm layer: ``gamma`` / ``beta``
``P.running_mean``)
rank-1 ``P.weight`` alone                     a norm without bias *or* ``nn.PReLU``: untouched
``P.num_batches_tracked``                     BatchNorm's counter, no Burn param: left out
                                              (as the PyTorch adapter ignores it when loading)
===========================================  ==============================================

``transpose`` regexes add tensors, ``no_transpose`` regexes (both searched in the *target*
names) take them out; either settles an untouched name.

**The layout a conversion decided is recorded in the file it writes** (metadata key
:data:`LAYOUT_KEY`: a JSON object ``written name -> true`` when PyTorch holds that rank-2 tensor
transposed with respect to Burn (``nn.Linear``), ``false`` when both hold it alike (GPT-2's
``Conv1D``, or a tensor the user kept with ``no_transpose``)). A Burn-layout file has no
evidence of the PyTorch module type (every linear weight is ``(in, out)`` there), so a later
``pytorch=True`` conversion of that file honours the record before any shape rule: ``.pt ->
.bpk -> .safetensors`` gives back GPT-2's ``Conv1D`` weights untransposed. Without a record,
Burn -> PyTorch transposes by the shape rules as ``nn.Linear`` and says so in a report note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["LAYOUT_KEY", "read_layout_record", "PytorchPlan", "plan_pytorch_layout", "DROPPED_BUFFERS", "LayoutEvidence", "linear_layouts", "family_of",
           "OUT_IN", "IN_OUT"]

DROPPED_BUFFERS = ("num_batches_tracked",)
"""PyTorch buffers without a Burn param (BatchNorm's step counter)."""

OUT_IN = "(out, in)"
"""A rank-2 weight whose bias follows dim 0: PyTorch ``nn.Linear``."""
IN_OUT = "(in, out)"
"""A rank-2 weight whose bias follows dim 1: Burn's ``Linear``, Hugging Face's ``Conv1D``."""

LAYOUT_KEY = "onnxparam_pytorch_transposed"
"""File metadata key: JSON ``{tensor name: bool}``, true when PyTorch holds that rank-2 tensor
transposed with respect to Burn (written by ``pytorch=True`` conversions; module docstring)."""


def read_layout_record(metadata: dict, source: str) -> dict:
    """The :data:`LAYOUT_KEY` record of a file's ``metadata`` (``{}`` when absent).

    Raises:
        RecordError: when the entry is not a JSON object of booleans (names the file).
    """
    import json

    from ..core.errors import RecordError

    raw = metadata.get(LAYOUT_KEY)
    if raw is None:
        return {}
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise RecordError(f"'{source}': metadata entry {LAYOUT_KEY!r} is not valid JSON ({exc})") from None
    if not isinstance(record, dict) or not all(isinstance(v, bool) for v in record.values()):
        raise RecordError(f"'{source}': metadata entry {LAYOUT_KEY!r} must be a JSON object of tensor name -> "
                          "true/false (PyTorch holds it transposed)")
    return record


_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


def family_of(prefix: str) -> str:
    """A module path with its integer segments wildcarded: ``h.3.attn.c_attn`` -> ``h.*.attn.c_attn``."""
    return _INDEX.sub("*", prefix)


@dataclass(frozen=True)
class LayoutEvidence:
    """What a file says about one rank-2 ``weight`` that has a rank-1 bias.

    Attributes:
        layout: :data:`OUT_IN`, :data:`IN_OUT`, or ``None`` when the file does not settle it.
        why: how it was decided, or why not (names the tensors that gave the evidence).
    """

    layout: "str | None"
    why: str


def _examples(names: list) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:2])
    return shown + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def linear_layouts(names_shapes) -> dict:
    """``weight name -> LayoutEvidence`` for every rank-2 ``P.weight`` with a rank-1 ``P.bias``
    among ``[(name, shape)]`` (the module docstring's rules: its own shape, then its family's
    non-square members, then the whole file's)."""
    shapes = {n: tuple(s) for n, s in names_shapes}
    own: dict = {}
    for name, shape in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        bias = shapes.get(_join(prefix, "bias"))
        if leaf != "weight" or len(shape) != 2 or bias is None or len(bias) != 1:
            continue
        rows, cols = shape
        if bias[0] == rows and rows != cols:
            own[name] = OUT_IN
        elif bias[0] == cols and rows != cols:
            own[name] = IN_OUT
        elif bias[0] == rows == cols:
            own[name] = "square"
        else:
            own[name] = f"its bias '{_join(prefix, 'bias')}' has length {bias[0]}, which is neither dim of {list(shape)}"
    families: dict = {}
    whole: dict = {OUT_IN: [], IN_OUT: []}
    for name, layout in own.items():
        if layout in (OUT_IN, IN_OUT):
            families.setdefault(family_of(name.rpartition(".")[0]), {OUT_IN: [], IN_OUT: []})[layout].append(name)
            whole[layout].append(name)
    out: dict = {}
    for name, layout in own.items():
        shape = list(shapes[name])
        if layout in (OUT_IN, IN_OUT):
            dim = 0 if layout == OUT_IN else 1
            out[name] = LayoutEvidence(layout, f"{shape}: its bias follows dim {dim}")
            continue
        if layout != "square":
            out[name] = LayoutEvidence(None, layout)
            continue
        family = family_of(name.rpartition(".")[0])
        seen = families.get(family)
        if seen and seen[OUT_IN] and seen[IN_OUT]:
            out[name] = LayoutEvidence(None, (
                f"square weight {shape}: its bias fits both dims, and its family '{family}' holds both layouts "
                f"({_examples(seen[OUT_IN])} {OUT_IN}; {_examples(seen[IN_OUT])} {IN_OUT})"))
        elif seen:
            layout = OUT_IN if seen[OUT_IN] else IN_OUT
            out[name] = LayoutEvidence(layout, f"square weight {shape}: follows its family '{family}' "
                                               f"({_examples(seen[layout])} {layout})")
        elif whole[OUT_IN] and whole[IN_OUT]:
            out[name] = LayoutEvidence(None, (
                f"square weight {shape}: its bias fits both dims, its family '{family}' has no non-square member, "
                f"and the file holds both layouts ({_examples(whole[OUT_IN])} {OUT_IN}; "
                f"{_examples(whole[IN_OUT])} {IN_OUT})"))
        elif whole[OUT_IN] or whole[IN_OUT]:
            layout = OUT_IN if whole[OUT_IN] else IN_OUT
            out[name] = LayoutEvidence(layout, f"square weight {shape}: follows the whole file (every non-square "
                                               f"weight with a bias is {layout}: {_examples(whole[layout])})")
        else:
            out[name] = LayoutEvidence(None, (
                f"square weight {shape}: its bias fits both dims, and no non-square weight with a bias in its "
                f"family or in the file says whether it is {OUT_IN} (nn.Linear) or {IN_OUT} (Conv1D / Burn)"))
    return out


@dataclass
class PytorchPlan:
    """What ``pytorch=True`` does to one file's tensors.

    Attributes:
        rules: ``(pattern, replacement)`` renames (norm ``weight``/``bias`` <-> ``gamma``/``beta``).
        transpose: source names to transpose.
        kept: ``(source name, why)``: rank-2 weights the file's evidence shows already in the
            target's layout (GPT-2's ``Conv1D`` going to Burn), left as they are.
        dropped: source names left out (``num_batches_tracked``).
        untouched: ``(source name, why)`` for rank-2 / rank-1 ``weight`` tensors the file does
            not settle, each with the true reason.
        guessed: source names transposed Burn -> PyTorch from the shape rules alone (no
            :data:`LAYOUT_KEY` record): assumed ``nn.Linear``.
        layouts: filled by the conversion: written name -> transposed, for every rank-2 tensor
            whose layout was decided (the target's :data:`LAYOUT_KEY` record).
        guessed_written: filled by the conversion: the written names of ``guessed`` tensors.
    """

    rules: list = field(default_factory=list)
    transpose: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    untouched: list = field(default_factory=list)
    guessed: list = field(default_factory=list)
    layouts: dict = field(default_factory=dict)
    guessed_written: list = field(default_factory=list)


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def plan_pytorch_layout(names_shapes, to_pytorch: bool, recorded: "dict | None" = None) -> PytorchPlan:
    """The renames, transposes and drops for tensors ``[(name, shape)]`` (module docstring).

    Args:
        names_shapes: the source's tensor names and shapes, in order.
        to_pytorch: ``True`` when the target takes PyTorch's layout (source in Burn's).
        recorded: the source's :data:`LAYOUT_KEY` record (``name -> transposed``), which
            decides a rank-2 tensor it names before any shape rule.
    """
    recorded = recorded or {}
    shapes = {n: tuple(s) for n, s in names_shapes}
    evidence = linear_layouts(shapes.items())
    moves = IN_OUT if to_pytorch else OUT_IN
    plan = PytorchPlan()
    for name, shape in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        if not to_pytorch and leaf in DROPPED_BUFFERS:
            plan.dropped.append(name)
            continue
        if to_pytorch and leaf in ("gamma", "beta") and len(shape) == 1:
            plan.rules.append((f"^{re.escape(name)}$", _join(prefix, "weight" if leaf == "gamma" else "bias")))
            continue
        if len(shape) == 2 and name in recorded:
            if recorded[name]:
                plan.transpose.append(name)
            else:
                plan.kept.append((name, f"the file records that PyTorch holds it as Burn does ({LAYOUT_KEY!r}, "
                                        "written by the conversion that made the file; e.g. GPT-2's Conv1D)"))
            continue
        if leaf != "weight":
            continue
        bias = shapes.get(_join(prefix, "bias"))
        if len(shape) == 2:
            found = evidence.get(name)
            if found is None:
                plan.untouched.append((name, f"rank-2 weight {list(shape)} without a bias: a bias-free Linear "
                                             "(transpose) or an Embedding (do not); nothing in the file says which"))
            elif found.layout is None:
                plan.untouched.append((name, found.why))
            elif found.layout == moves:
                plan.transpose.append(name)
                if to_pytorch:
                    plan.guessed.append(name)
            else:
                plan.kept.append((name, f"already {found.layout} ({found.why})"))
        elif len(shape) == 1 and not to_pytorch:
            running = shapes.get(_join(prefix, "running_mean"))
            if (bias is not None and bias == shape) or running == shape:
                plan.rules.append((f"^{re.escape(name)}$", _join(prefix, "gamma")))
                if bias is not None:
                    plan.rules.append((f"^{re.escape(_join(prefix, 'bias'))}$", _join(prefix, "beta")))
            else:
                plan.untouched.append((name, "rank-1 weight without a bias: a bias-free norm (gamma) or a "
                                             "PReLU (weight)"))
    return plan
