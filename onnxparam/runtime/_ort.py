"""Import of ONNX Runtime with an error that names the extras providing it."""

from __future__ import annotations


def import_onnxruntime():
    """Return the ``onnxruntime`` module.

    Raises:
        ImportError: when neither ``onnxruntime`` nor ``onnxruntime-gpu`` is installed; the
            message names the extras ``onnxparam[cpu]`` and ``onnxparam[gpu]``.
    """
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - exercised only without ORT
        raise ImportError(
            "onnxparam runs modules through ONNX Runtime, which is not installed: "
            "install 'onnxparam[cpu]' (onnxruntime) or 'onnxparam[gpu]' (onnxruntime-gpu)"
        ) from e
    return onnxruntime
