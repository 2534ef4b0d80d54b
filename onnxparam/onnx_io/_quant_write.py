"""A ``QFloat`` record entry written back into a quantized ONNX template, where it is exact.

The template holds the weight as ``DequantizeLinear(codes, scale[, zero point])`` (ONNX operator
spec: DequantizeLinear-21, ``y = (x - zero_point) * scale``; per-tensor, per-axis or blocked) or as
the exporter's ``MatMulInteger -> Cast -> Mul(scale)`` form; :func:`onnxparam.quant._qdq_import.fold_dequantize_weights`
records which initializers (a :class:`~onnxparam.quant._qdq_import.QuantOrigin`) it folded. The
entry's codes ``q`` (Burn holds no zero point) become ``q + zero_point`` in the codes initializer's
dtype, and its per-element scales (Burn ``BlockLayout``, ``docs/burnpack.md`` §2.3) are laid out as
the template's scale initializer, in its dtype. A layout that cannot hold the entry's scales
exactly (another block layout), codes out of the dtype's range, or a two-level scheme is refused.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np
import onnx_ir as ir

__all__ = ["QuantWrite", "plan_quant_write"]


class QuantWrite(NamedTuple):
    """The arrays to write: ``codes`` into the initializer named ``codes_name``, ``scales`` into
    ``scale_name`` (both with the template's shapes and dtypes)."""

    codes_name: str
    codes: np.ndarray
    scale_name: str
    scales: np.ndarray


def _const_array(graph: ir.Graph, name: "str | None"):
    value = graph.initializers.get(name) if name else None
    return None if value is None or value.const_value is None else value.const_value


def _element_scales(qt) -> np.ndarray:
    """The scale of every element of ``qt`` (float32, ``qt.shape``)."""
    from ..core.quant_layout import expand_scales

    if qt.axis is not None:
        shape = [1] * len(qt.shape)
        shape[qt.axis] = -1
        return np.broadcast_to(np.asarray(qt.scales, np.float32).reshape(shape), qt.shape)
    scale = np.asarray(expand_scales(qt.scales, qt.shape, qt.scheme), np.float32)
    return np.broadcast_to(scale, qt.shape) if scale.size == 1 else scale.reshape(qt.shape)


def _template_form(per_element: np.ndarray, axis, block) -> np.ndarray:
    """The scales ``per_element`` would have in the template's layout (one sample per block)."""
    if axis is None:
        return per_element.reshape(-1)[:1]
    if block is None:  # per-axis: one scale per index along axis
        index = [slice(0, 1)] * per_element.ndim
        index[axis] = slice(None)
    else:  # blocked: the scale has the codes' shape, axis divided into blocks
        index = [slice(None)] * per_element.ndim
        index[axis] = slice(0, None, block)
    return per_element[tuple(index)]


def _expand(form: np.ndarray, shape, axis, block) -> np.ndarray:
    if axis is None:
        return np.broadcast_to(form.reshape(()), shape)
    if block is not None:
        form = np.repeat(form, block, axis=axis).take(range(shape[axis]), axis=axis)
    return np.broadcast_to(form, shape)


def plan_quant_write(qt, origin, graph: ir.Graph, path: str) -> "QuantWrite | str":
    """The codes and scales of the quantized tensor ``qt`` in the template's form ``origin``
    (initializers of ``graph``), or a message saying why that form cannot hold it exactly.

    Args:
        qt: the record entry as a :class:`~onnxparam.core.tensor.QuantizedTensor`.
        origin: the template's :class:`~onnxparam.quant._qdq_import.QuantOrigin` for that weight.
        graph: the unfolded template's main graph.
        path: the record path, for messages.

    Returns:
        a :class:`QuantWrite` (codes: the codes initializer's dtype and shape, ``q + zero_point``;
        scales: the scale initializer's dtype and shape), or the problem as text naming ``path``,
        the ONNX codes name and both layouts.
    """
    codes_t = _const_array(graph, origin.codes)
    scale_t = _const_array(graph, origin.scale)
    zp_t = _const_array(graph, origin.zero_point)
    where = f"'{path}' (ONNX {origin.codes!r})"
    if codes_t is None or scale_t is None or (origin.zero_point and zp_t is None):
        return f"{where}: the template's codes / scale / zero point are not all initializers; cannot write them"
    layout = origin.describe(scale_t.shape)
    if qt.global_scale is not None:
        return f"{where}: a two-level scheme ({qt.describe()}) has no place in the template's {layout}"
    if tuple(codes_t.shape) != tuple(qt.shape):
        return f"{where}: the template's codes are {list(codes_t.shape)}, the record has {list(qt.shape)}"
    per_element = _element_scales(qt)
    form = _template_form(per_element, origin.axis, origin.block)
    scale_dtype = scale_t.dtype.numpy()
    scales = np.ascontiguousarray(form).astype(scale_dtype)
    exact = (np.array_equal(_expand(form, qt.shape, origin.axis, origin.block), per_element)
             and np.array_equal(scales.astype(np.float32), form) and scales.size == scale_t.size)
    if not exact:
        return (f"{where}: the record's layout ({qt.describe()}) does not fit the template's {layout} exactly; "
                "re-quantize with the template's layout or write it without --graph")
    codes = np.asarray(qt.values, np.int32)
    if zp_t is not None:
        zp = np.asarray(zp_t.numpy()).astype(np.int32)
        codes = codes + _expand(zp.reshape(np.shape(form)) if zp.size > 1 else zp.reshape(-1)[:1],
                                qt.shape, origin.axis if zp.size > 1 else None, origin.block)
    codes_dtype = codes_t.dtype.numpy()
    info = ml_dtypes.iinfo(codes_dtype)
    if codes.size and (codes.min() < info.min or codes.max() > info.max):
        return (f"{where}: the record's codes plus the template's zero point span {codes.min()}..{codes.max()}, "
                f"outside {codes_t.dtype.name}")
    return QuantWrite(origin.codes, codes.astype(codes_dtype).reshape(codes_t.shape), origin.scale,
                      scales.reshape(tuple(scale_t.shape)))
