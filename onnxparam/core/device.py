"""Devices: where a tensor lives and which ONNX Runtime execution provider runs a module.

``Device("cpu")`` maps to ``CPUExecutionProvider``; ``Device("cuda")`` / ``Device("cuda:N")``
map to ``CUDAExecutionProvider`` with ``device_id=N``. Availability is checked by the runtime
(:func:`onnxparam.runtime.providers_for`) when a session is built or a tensor is moved, never
silently replaced by the CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Device", "CPU"]

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True, init=False)
class Device:
    """A device: ``kind`` is ``"cpu"`` or ``"cuda"``, ``index`` the CUDA device id (0 for cpu).

    Args:
        spec: ``"cpu"``, ``"cuda"`` (device 0) or ``"cuda:N"``; a ``Device`` is returned as is.

    Raises:
        ValueError: for any other spelling.
    """

    kind: str
    index: int

    def __init__(self, spec: "str | Device" = "cpu"):
        if isinstance(spec, Device):
            kind, index = spec.kind, spec.index
        else:
            match = _DEVICE_RE.match(str(spec).strip().lower())
            if match is None:
                raise ValueError(f"unknown device {spec!r}: expected 'cpu', 'cuda' or 'cuda:N'")
            kind = match.group(1)
            index = int(match.group(2) or 0)
            if kind == "cpu" and index != 0:
                raise ValueError(f"unknown device {spec!r}: the CPU has no index other than 0")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "index", index)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"


CPU = Device("cpu")
