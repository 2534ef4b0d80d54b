"""PyTorch <-> Burn layouts for a file-to-file conversion, where no module says which layer a
tensor belongs to (``convert(..., pytorch=True)``, ``onnxparam convert --pytorch``).

With a module, :class:`~onnxparam.convert._adapters.PyTorchAdapter` decides by the type of the
module holding each param (Burn's ``PyTorchToBurnAdapter``). A file has names and shapes only,
so this module acts only where they leave no doubt, and lists every tensor it left alone:

===========================================  ==============================================
PyTorch -> Burn (source in PyTorch's layout)
===========================================  ==============================================
rank-2 ``P.weight`` + rank-1 ``P.bias`` of    ``nn.Linear`` (``(out, in)``; an Embedding has no
length ``shape[0]``                           bias): transposed to ``(in, out)``
rank-2 ``P.weight`` without ``P.bias``        ``nn.Linear(bias=False)`` *or* ``nn.Embedding``
                                              (never transposed): **untouched**, listed
rank-1 ``P.weight`` + rank-1 ``P.bias`` (or   a norm layer: ``gamma`` / ``beta``
``P.running_mean``)
rank-1 ``P.weight`` alone                     a norm without bias *or* ``nn.PReLU``: untouched
``P.num_batches_tracked``                     BatchNorm's counter, no Burn param: left out
                                              (as the PyTorch adapter ignores it when loading)
===========================================  ==============================================

Burn -> PyTorch is the inverse (a rank-2 ``P.weight`` with a ``P.bias`` of length ``shape[1]``
is transposed; ``gamma`` / ``beta`` become ``weight`` / ``bias``). ``transpose`` regexes add
tensors, ``no_transpose`` regexes (both searched in the *target* names) take them out; either
settles an untouched name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["PytorchPlan", "plan_pytorch_layout", "DROPPED_BUFFERS"]

DROPPED_BUFFERS = ("num_batches_tracked",)
"""PyTorch buffers without a Burn param (BatchNorm's step counter)."""


@dataclass
class PytorchPlan:
    """What ``pytorch=True`` does to one file's tensors.

    Attributes:
        rules: ``(pattern, replacement)`` renames (norm ``weight``/``bias`` <-> ``gamma``/``beta``).
        transpose: source names to transpose.
        dropped: source names left out (``num_batches_tracked``).
        untouched: ``(source name, why)`` for rank-2 / rank-1 ``weight`` tensors the names and
            shapes do not settle.
    """

    rules: list = field(default_factory=list)
    transpose: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    untouched: list = field(default_factory=list)


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def plan_pytorch_layout(names_shapes, to_pytorch: bool) -> PytorchPlan:
    """The renames, transposes and drops for tensors ``[(name, shape)]`` (module docstring).

    Args:
        names_shapes: the source's tensor names and shapes, in order.
        to_pytorch: ``True`` when the target takes PyTorch's layout (source in Burn's).
    """
    shapes = {n: tuple(s) for n, s in names_shapes}
    plan = PytorchPlan()
    for name, shape in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        if not to_pytorch and leaf in DROPPED_BUFFERS:
            plan.dropped.append(name)
            continue
        if to_pytorch and leaf in ("gamma", "beta") and len(shape) == 1:
            plan.rules.append((f"^{re.escape(name)}$", _join(prefix, "weight" if leaf == "gamma" else "bias")))
            continue
        if leaf != "weight":
            continue
        bias = shapes.get(_join(prefix, "bias"))
        if len(shape) == 2:
            out_dim = shape[1] if to_pytorch else shape[0]
            if bias is not None and len(bias) == 1 and bias[0] == out_dim:
                plan.transpose.append(name)
            else:
                plan.untouched.append((name, "rank-2 weight without a matching bias: a bias-free Linear "
                                             "(transpose) or an Embedding (do not)"))
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
