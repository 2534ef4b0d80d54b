"""Which format a file is, from its extension (formats layer; imports nothing, so the CLI can
ask it before loading any reader)."""

from pathlib import Path

__all__ = ["FORMATS", "WRITABLE", "format_of"]

FORMATS = {".bpk": "burnpack", ".safetensors": "safetensors", ".onnx": "onnx", ".pt": "pytorch", ".pth": "pytorch"}
"""File extension -> format name. ``pytorch`` (``torch.save`` checkpoints) is read, never written."""

WRITABLE = ("burnpack", "safetensors", "onnx")
"""The formats :func:`onnxparam.convert.convert` writes."""


def format_of(path) -> str:
    """``"burnpack"``, ``"safetensors"``, ``"onnx"`` or ``"pytorch"`` from the extension.

    Raises:
        ValueError: for any other extension.
    """
    suffix = Path(path).suffix.lower()
    try:
        return FORMATS[suffix]
    except KeyError:
        known = ", ".join(FORMATS)
        raise ValueError(f"cannot tell the format of '{path}' from its extension '{suffix}'; use one of {known}") from None
