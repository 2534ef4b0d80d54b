"""``onnxparam quantize --calibrate``: each array of the file against the graph input it feeds
(element type, rank, the static dims after the batch axis), checked before any weight is
quantized, so a mismatch names the file and the array (not only the graph input, as the run
inside calibration would)."""

from __future__ import annotations

import numpy as np

__all__ = ["check_calibration_arrays"]


def check_calibration_arrays(path, model, chosen: dict) -> None:
    """``chosen``: the file's array key -> array, in graph input order (as ``_calibration_arrays``
    picks them). Axis 0 is the samples axis (batched by ``--calibrate-batch``), so only the
    dims after it are compared with the graph's static dims.

    Raises:
        ValueError: naming the file, the array, the graph input, what it takes and what the
            array holds (dims as the graph names them: ``['b', 3, 32, 32]``).
    """
    from ..onnx_io._importer import _dims

    source = getattr(model.module, "_source", None)
    inputs = list(getattr(source, "inputs", ()) or ())
    if len(inputs) != len(chosen):
        return
    for value, (key, array) in zip(inputs, chosen.items()):
        what = f"the --calibrate file '{path}': array '{key}' (for graph input '{value.name}')"
        try:
            want = np.dtype(value.type.dtype.numpy())
        except (TypeError, ValueError, AttributeError):
            want = None
        got = array.dtype.newbyteorder("=") if array.dtype.kind in "biufc" else array.dtype
        if want is not None and got != want:
            raise ValueError(f"{what} holds {got.name} values; the input takes {want.name}: save it as "
                             f"{want.name} (array.astype(np.{want.name}))")
        dims = _dims(value)
        if dims is None:
            continue
        shape = list(array.shape)
        shown = [d if d is not None else "?" for d in dims]
        if len(shape) != len(dims):
            raise ValueError(f"{what} has shape {shape} (rank {len(shape)}); the input takes shape {shown} "
                             f"(rank {len(dims)}, axis 0 the samples)")
        wrong = [i for i in range(1, len(dims)) if isinstance(dims[i], int) and dims[i] != shape[i]]
        if wrong:
            raise ValueError(f"{what} has shape {shape}; the input takes shape {shown} (axis "
                             f"{', '.join(map(str, wrong))} differ; axis 0 is the samples)")
