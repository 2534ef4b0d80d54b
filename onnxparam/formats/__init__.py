"""File formats other than burnpack (:mod:`onnxparam.burnpack`): bytes in, lazy tensors out.

Formats layer: these modules know bytes and tensor snapshots, not modules (the bridges in
:mod:`onnxparam.convert` load them into modules).

* :mod:`.safetensors`: Hugging Face safetensors files (lazy zero-copy reads, streaming writes).
* ``._mapped``: the memory map + in-place-change watch shared with the burnpack reader.
"""

import importlib

_NAMES = {
    "SafetensorsFile": ".safetensors", "SafetensorsTensor": ".safetensors",
    "read_safetensors": ".safetensors", "write_safetensors": ".safetensors",
}
"""Each public name and its module, imported on first use: the burnpack reader imports
``._mapped``, and importing this package must not pull in every format."""

__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onnxparam.formats' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
