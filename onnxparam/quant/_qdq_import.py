"""QDQ import: ``DequantizeLinear`` of integer initializers (and the dynamic ``MatMulInteger`` form)
folded into one weight that becomes a ``QFloat`` param (see :mod:`onnxparam.quant._qdq`)."""

from __future__ import annotations

import json
from typing import NamedTuple

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import QuantizationError
from ..core.quant_scheme import QuantScheme, QuantValue
from ..core.tensor import QuantizedTensor
from ._nbits_import import fold_matmul_nbits
from ._qdq_options import _INT_TYPES, GLOBAL_SCALE_KEY, SCHEME_KEY, _const

# -- import --------------------------------------------------------------------------------------------



def _scheme_from_props(props, values: np.ndarray, scale_shape, axis, block, rank, q: np.ndarray) -> QuantScheme:
    """The Burn scheme of codes ``values`` (``q``: the codes minus their zero point): the one the
    exporter wrote in ``props``, else symmetric (Q8S / Q4S) when no ``q`` is the negative extreme
    (a uint8 code 0 with zero point 128 is -128: Q8F), full range otherwise."""
    text = props.get(SCHEME_KEY) if props is not None else None
    if text:
        return QuantScheme.from_cbor(json.loads(text))
    four = False
    if values.dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
        four = True
    if four:
        value = QuantValue.Q4S if q.min(initial=0) >= -7 else QuantValue.Q4F
    else:
        value = QuantValue.Q8S if q.min(initial=0) >= -127 else QuantValue.Q8F
    if axis is None or int(np.prod(scale_shape)) == 1:
        return QuantScheme(value)
    if block is None:  # per-axis: a block covering every other axis
        return None  # decided by the caller (extents may exceed Burn's 255)
    extents = [1] * rank
    extents[axis] = block
    return QuantScheme(value, block_size=tuple(extents))


def _grid_fits(shape, scheme: QuantScheme, scale: np.ndarray) -> bool:
    from ..core.quant_layout import params_shape

    try:
        return int(np.prod(params_shape(shape, scheme))) == scale.size
    except QuantizationError:
        return False


def _burn_tensor(values, scale, zero_point, axis, block, props) -> QuantizedTensor | None:
    """The Burn ``QFloat`` tensor of a ``DequantizeLinear`` weight, or ``None`` when Burn cannot
    hold it (values outside int8 after removing the zero point, a per-axis scale on an axis
    longer than Burn's 255-element blocks, non-positive scales)."""
    values = np.asarray(values)
    scale = np.asarray(scale, dtype=np.float32)
    rank = values.ndim
    if axis is not None and axis < 0:
        axis += rank
    q = values.astype(np.int32)
    if zero_point is not None:
        zp = np.asarray(zero_point).astype(np.int32)
        if zp.ndim and axis is not None:
            if block is None:
                shape = [1] * rank
                shape[axis] = -1
                zp = zp.reshape(shape)
            else:
                zp = np.repeat(zp, block, axis=axis).take(range(values.shape[axis]), axis=axis)
        q = q - zp
    if q.size and (q.min() < -128 or q.max() > 127):
        return None
    if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        return None
    scheme = _scheme_from_props(props, values, scale.shape, axis, block, rank, q)
    if scheme is not None and props is not None and props.get(SCHEME_KEY) and not _grid_fits(values.shape, scheme, scale):
        # NOTE: an ONNX per-axis tensor (QuantizedTensor.axis, extents over Burn's 255) carries its
        # per-tensor scheme in SCHEME_KEY but one scale per channel: decided from the layout alone
        scheme = _scheme_from_props(None, values, scale.shape, axis, block, rank, q)
    global_scale = None
    if scheme is None:  # per-axis
        extents = [d for d in values.shape]
        extents[axis] = 1
        if any(e > 255 for e in extents):
            return None
        value = QuantValue.Q8S if q.min(initial=0) >= -127 else QuantValue.Q8F
        if values.dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
            value = QuantValue.Q4S if q.min(initial=0) >= -7 else QuantValue.Q4F
        scheme = QuantScheme(value, block_size=tuple(extents))
    if props is not None and props.get(GLOBAL_SCALE_KEY):
        global_scale = np.float32(float.fromhex(props[GLOBAL_SCALE_KEY]))
        scale = (scale / global_scale).astype(np.float32)
    try:
        from ..core.quant_layout import params_shape

        grid = params_shape(values.shape, scheme)
        if int(np.prod(grid)) != scale.size:
            return None  # a scale grid the scheme does not describe: left unfolded
        qt = QuantizedTensor(values.shape, scheme, q.astype(np.int8), scale.reshape(grid), global_scale)
        qt.to_bytes()  # scales representable in the scheme's dtype
    except QuantizationError:
        return None
    return qt


def has_foldable_nodes(model: ir.Model) -> bool:
    """True when :func:`fold_dequantize_weights` may rewrite ``model``'s main graph (callers that
    must keep the model as it is then fold a copy)."""
    return any(node.op_type in ("DequantizeLinear", "MatMulInteger") and node.domain in ("", "ai.onnx")
               or node.op_type == "MatMulNBits" and node.domain == "com.microsoft" for node in model.graph)


def imported_quantized(site) -> "QuantizedTensor | None":
    """The quantized value :func:`fold_dequantize_weights` gave the weight ``site``
    (a :class:`~onnxparam.onnx_io._weights.WeightSite`), else ``None``."""
    return site.value.meta.get(_IMPORTED) if site.value is not None else None


def fold_dequantize_weights(model: ir.Model) -> int:
    """Turn each ``DequantizeLinear(integer initializer, constant scale[, constant zero point])``
    of the main graph (and the ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` form the
    exporter writes) into one float initializer named as the integer initializer, whose value
    :func:`imported_param` makes a ``QFloat`` param. Called by the ONNX importer before it looks
    for weights. Returns the number of weights folded."""
    graph = model.graph
    folded = fold_matmul_nbits(graph)  # com.microsoft.MatMulNBits (quant/_nbits_import.py)
    for node in list(graph):
        if node.op_type == "MatMulInteger" and node.domain in ("", "ai.onnx"):
            folded += _fold_dynamic(graph, node)
    for node in list(graph):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
        data, scale, zp = (_const(v) for v in inputs[:3])
        source = inputs[0]
        if data is None or scale is None or (inputs[2] is not None and zp is None) or data.dtype not in _INT_TYPES:
            continue
        if source.is_graph_input() or len(source.uses()) != 1:
            continue
        axis = node.attributes.get("axis")
        block = node.attributes.get("block_size")
        axis = int(axis.value) if axis is not None else 1
        block = int(block.value) if block is not None and int(block.value) > 0 else None
        scale_arr = np.asarray(scale.numpy(), np.float32)
        if scale_arr.ndim == 0 or scale_arr.size == 1 and block is None:
            axis_used = None
        else:
            axis_used = axis
        qt = _burn_tensor(data.numpy(), scale_arr, None if zp is None else zp.numpy(), axis_used, block,
                          data.metadata_props)
        if qt is None:
            continue
        origin = QuantOrigin("DequantizeLinear", source.name, inputs[1].name,
                             None if inputs[2] is None else inputs[2].name, axis_used, block)
        _replace_with_weight(graph, node.outputs[0], source, qt, data.metadata_props, origin)
        graph.remove(node, safe=True)
        for value in inputs[1:3]:
            if value is not None:
                value.meta[_FOLDED_INPUT] = True
        folded += 1
    for value in list(graph.initializers.values()):
        if not value.uses() and not value.is_graph_output() and not value.is_graph_input() \
                and value.meta.get(_FOLDED_INPUT):
            graph.initializers.pop(value.name)
    return folded


_FOLDED_INPUT = "onnxparam.qdq.folded_input"
_IMPORTED = "onnxparam.qdq.imported"
_ORIGIN = "onnxparam.qdq.origin"


class QuantOrigin(NamedTuple):
    """Where a folded weight came from in the unfolded graph: the names of its integer codes, scale
    and zero point (``None`` when absent) values, and the scale's layout (``axis`` ``None``:
    per-tensor; ``block`` ``None``: per-axis, else blocks of ``block`` along ``axis``)."""

    form: str
    codes: str
    scale: str
    zero_point: "str | None"
    axis: "int | None"
    block: "int | None"

    def describe(self, scale_shape) -> str:
        """The layout in words, e.g. ``DequantizeLinear per-axis (axis 0), scale [16]``."""
        if self.axis is None:
            kind = "per-tensor"
        elif self.block is None:
            kind = f"per-axis (axis {self.axis})"
        else:
            kind = f"blocked (axis {self.axis}, block {self.block})"
        zp = f", zero point {self.zero_point!r}" if self.zero_point else ""
        return f"{self.form} {kind}, scale {list(scale_shape)}{zp}"


def quant_origin(site) -> "QuantOrigin | None":
    """The :class:`QuantOrigin` :func:`fold_dequantize_weights` recorded for the weight ``site``
    (``DequantizeLinear`` and ``MatMulInteger`` forms; ``None`` for others)."""
    return site.value.meta.get(_ORIGIN) if site.value is not None else None


def _replace_with_weight(graph, float_value: ir.Value, source: ir.Value, qt: QuantizedTensor, props,
                         origin: "QuantOrigin | None" = None) -> None:
    name = source.name
    lazy = ir.LazyTensor(lambda _qt=qt: ir.tensor(_qt.dequantize()), ir.DataType.FLOAT, ir.Shape(list(qt.shape)),
                         name=name)
    lazy.metadata_props.update({k: v for k, v in props.items() if k not in (SCHEME_KEY, GLOBAL_SCALE_KEY)})
    graph.initializers.pop(name)
    new = ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(list(qt.shape)),
                   const_value=lazy)
    new.meta[_IMPORTED] = qt
    if origin is not None:
        new.meta[_ORIGIN] = origin
    graph.register_initializer(new)
    outputs = list(graph.outputs)
    if float_value in outputs:
        # NOTE: a dequantized weight that is also a graph output keeps its output name (the
        # graph's interface): an Identity of the folded weight takes the name, not the weight
        out_name = float_value.name
        float_value.name = f"{out_name}.folded"
        identity = ir.node("Identity", [new])
        identity.outputs[0].name = out_name
        identity.outputs[0].type, identity.outputs[0].shape = float_value.type, float_value.shape
        graph.append(identity)
        for i, value in enumerate(outputs):
            if value is float_value:
                graph.outputs[i] = identity.outputs[0]
        float_value.replace_all_uses_with(new)
        return
    float_value.replace_all_uses_with(new, replace_graph_outputs=True)


def _gemm_transpose(b: ir.Value, x: ir.Value):
    """The ``Transpose`` (perm ``[1, 0]``) that gives ``MatMulInteger`` input ``b`` from ``[N, K]``
    codes, as the exporter writes a ``Gemm(transB=1)`` weight, when ``x`` is 2-D (a Gemm's ``A``);
    else ``None``."""
    node = b.producer() if b is not None else None
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(b.uses()) != 1:
        return None
    perm = node.attributes.get("perm")
    if (perm is not None and list(perm.value) != [1, 0]) or x is None or x.shape is None or len(x.shape) != 2:
        return None
    return node


def _fold_dynamic(graph, mmi: ir.Node) -> int:
    """``DynamicQuantizeLinear(x) -> MatMulInteger(xq, W, xz[, wz]) -> Cast -> Mul(·, Mul(xs, s))``
    -> ``MatMul(x, W_float)``; with ``W = Transpose(codes [N, K])`` and a 2-D ``x`` (the exporter's
    ``Gemm(transB=1)`` form) -> ``Gemm(x, W_float [N, K], transB=1)``, the scales per row of ``W``."""
    inputs = list(mmi.inputs)
    dql = inputs[0].producer() if inputs[0] is not None else None
    if dql is None or dql.op_type != "DynamicQuantizeLinear" or len(inputs) < 3 or inputs[2] is not dql.outputs[2]:
        return 0
    transpose = _gemm_transpose(inputs[1], dql.inputs[0])
    w_source = inputs[1] if transpose is None else transpose.inputs[0]
    w = _const(w_source)
    wz = _const(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else None
    if w is None or w.dtype not in (ir.DataType.INT8, ir.DataType.UINT8) or len(w_source.uses()) != 1:
        return 0
    if transpose is not None and len(w.shape) != 2:
        return 0
    if len(inputs) > 3 and inputs[3] is not None and wz is None:
        return 0
    uses = list(mmi.outputs[0].uses())
    if len(uses) != 1 or uses[0][0].op_type != "Cast":
        return 0
    cast = uses[0][0]
    cuses = list(cast.outputs[0].uses())
    if len(cuses) != 1 or cuses[0][0].op_type != "Mul":
        return 0
    mul = cuses[0][0]
    other = mul.inputs[1 - cuses[0][1]]
    smul = other.producer() if other is not None else None
    if smul is None or smul.op_type != "Mul" or len(list(other.uses())) != 1:
        return 0
    s_in = [v for v in smul.inputs if v is not dql.outputs[1]]
    if len(s_in) != 1 or _const(s_in[0]) is None:
        return 0
    scale = np.asarray(_const(s_in[0]).numpy(), np.float32)
    axis = None if scale.size == 1 and scale.ndim <= 1 else 1 if transpose is None else 0
    qt = _burn_tensor(w.numpy(), scale.reshape(()) if axis is None else scale, None if wz is None else wz.numpy(),
                      axis, None, w.metadata_props)
    if qt is None:
        return 0
    x = dql.inputs[0]
    name = mmi.name.replace("/dynamic/MatMulInteger", "") or None
    if transpose is None:
        matmul = ir.Node("", "MatMul", [x, inputs[1]], name=name)
    else:
        matmul = ir.Node("", "Gemm", [x, w_source], [ir.AttrInt64("transB", 1)], name=name)
    y = mul.outputs[0]
    out = matmul.outputs[0]
    out.name = y.name
    out.type, out.shape = y.type, y.shape
    graph.insert_before(dql, [matmul])
    y.name = None
    y.replace_all_uses_with(out, replace_graph_outputs=True)
    for node in (mul, smul, cast, mmi) + (() if transpose is None else (transpose,)):
        graph.remove(node, safe=True)
    if not any(o.uses() for o in dql.outputs):
        graph.remove(dql, safe=True)
    float_value = ir.Value(name=None)
    matmul.replace_input_with(1, float_value)
    origin = QuantOrigin("MatMulInteger", w_source.name, s_in[0].name, None if wz is None else inputs[3].name, axis,
                         None)
    _replace_with_weight(graph, float_value, w_source, qt, w.metadata_props, origin)
    for value in (s_in[0],) + ((inputs[3],) if wz is not None else ()):
        if not value.uses() and value.is_initializer() and value.name in graph.initializers:
            value.meta[_FOLDED_INPUT] = True
    return 1


def imported_param(site, meta):
    """The ``QFloat`` param of a weight :func:`fold_dequantize_weights` made, else ``None``
    (called by the importer for every weight site)."""
    qt = imported_quantized(site)
    if qt is None:
        return None
    from ..core.param import Param, ParamId

    pid = meta.param_id if meta.param_id is not None else ParamId()
    require_grad = bool(meta.require_grad) if meta.require_grad is not None else False

    def init(device, require_grad, _qt=qt):
        return _qt.to_tensor()

    return Param.uninitialized(pid, init, "cpu", require_grad, qt.shape, DType.QFloat)
