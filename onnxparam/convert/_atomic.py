"""Atomic file replacement for the converters: :func:`onnxparam._scratch.atomic_output`."""

from .._scratch import atomic_output

__all__ = ["atomic_output"]
