"""Import of ``com.microsoft.MatMulNBits``: its packed weight becomes one ``QFloat`` param.

A ``MatMulNBits(A, B, scales[, zero_points][, g_idx][, bias])`` node (ONNX Runtime contrib operator
spec: ``com.microsoft.MatMulNBits``) with constant ``B`` / ``scales`` / ``zero_points``, no
``g_idx``, ``bits`` 4 or 8, becomes ``MatMul(A, W)`` (``+ bias``) where ``W`` ``[K, N]`` is a float
initializer named as ``B`` whose value the importer turns into a ``QFloat`` param
(:func:`onnxparam.quant._qdq_import.imported_param`). ORT's layout, unpacked here:

* ``B`` uint8 ``[N, n_blocks, block_size * bits / 8]``: row ``n`` is column ``n`` of ``W``,
  blocks along K, codes from the low bits up; ``n_blocks = ceil(K / block_size)``;
* ``scales`` ``[N, n_blocks]`` (or flat), A's float type;
* ``zero_points`` uint8 packed like ``B`` (``[N, ceil(n_blocks * bits / 8)]``), or A's float type
  ``[N, n_blocks]``; without it ``2^(bits-1)``;
* ``W[k, n] = (code - zero_point) * scale`` of ``k``'s block in row ``n``.

The Burn tensor holds ``code - zero_point`` (no zero point in Burn, ``docs/burnpack.md`` §3):

* symmetric codes (zero point ``2^(bits-1)``): Q4S / Q4F (Q8S / Q8F for 8 bits) with blocks
  ``(block_size, 1)`` along K, Burn's 4-bit block scheme; a block over 255 (Burn's largest
  extent) is split into blocks of 128 with the same scale (lossless);
* other zero points: ``code - zero_point`` spans -15..15, so Q8S with the same blocks (lossless;
  re-exported as 8 bits);
* a ``B`` this package wrote (its initializer carries the Burn scheme, ``SCHEME_KEY``) gets that
  scheme back when its scales fit it (per-tensor, per-channel), and a ``Gemm`` ``transB=1``
  weight its ``[N, K]`` shape (``NBITS_TRANS_KEY``), so a re-export writes the same bytes.

The dequantized values equal what ORT computes from the packed weight exactly (float32 products).
A node this cannot read (float zero points that are not integers, ``g_idx``, a ``B`` used
elsewhere) is left as it is.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import QuantizationError
from ..core.quant_layout import params_shape
from ..core.quant_scheme import QuantScheme, QuantValue, ScaleDtype
from ..core.tensor import QuantizedTensor
from ._qdq_options import GLOBAL_SCALE_KEY, NBITS_TRANS_KEY, SCHEME_KEY, _const

MS_DOMAIN = "com.microsoft"

_BURN_MAX_EXTENT = 255
_IMPORTED = "onnxparam.qdq.imported"  # the key _qdq_import.imported_param reads


def _attrs(node: ir.Node) -> dict:
    return {name: attr.value for name, attr in node.attributes.items()}


def unpack_codes(packed: np.ndarray, n: int, k: int, bits: int) -> np.ndarray:
    """The integer codes ``[N, n_blocks * block_size]`` (padding included) of ``B`` / packed zero
    points: ``8 / bits`` codes per byte, the first in the low bits."""
    per_byte = 8 // bits
    raw = np.asarray(packed, np.uint8).reshape(n, -1)
    mask = (1 << bits) - 1
    codes = np.stack([(raw >> (bits * i)) & mask for i in range(per_byte)], axis=-1)
    return codes.reshape(n, -1).astype(np.int16)


def _integer_parts(node: ir.Node):
    """``(q [K, N] int16 = code - zero point, scales [n_blocks, N] float32, block, zero_points
    were default, float dtype)`` of a readable node, else ``None``."""
    attrs = _attrs(node)
    k, n, bits, block = (int(attrs.get(key, 0)) for key in ("K", "N", "bits", "block_size"))
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    if bits not in (4, 8) or k <= 0 or n <= 0 or block <= 0 or inputs[4] is not None:
        return None
    b, scales, zp = _const(inputs[1]), _const(inputs[2]), _const(inputs[3])
    if b is None or scales is None or (inputs[3] is not None and zp is None) or b.dtype != ir.DataType.UINT8:
        return None
    blocks = -(-k // block)
    b_arr, s_arr = b.numpy(), np.asarray(scales.numpy())
    if b_arr.size != n * blocks * block * bits // 8 or s_arr.size != n * blocks:
        return None
    codes = unpack_codes(b_arr, n, k, bits)
    if zp is None:
        zero = np.full((n, blocks), 1 << (bits - 1), np.int16)
    elif zp.dtype == ir.DataType.UINT8:
        zero = unpack_codes(zp.numpy(), n, k, bits)[:, :blocks]
    else:
        zf = np.asarray(zp.numpy(), np.float64).reshape(n, blocks)
        if not np.array_equal(zf, np.round(zf)):
            return None
        zero = zf.astype(np.int16)
    q = codes - np.repeat(zero, block, axis=1)
    half = s_arr.dtype == np.float16
    scale = s_arr.astype(np.float32).reshape(n, blocks)
    return q[:, :k].T, scale.T, block, zp is None or bool(np.all(zero == 1 << (bits - 1))), bits, half


def _generic_tensor(q, scale, block, symmetric, bits, half) -> QuantizedTensor | None:
    """Burn's block scheme along K (module docstring)."""
    k, n = q.shape
    if symmetric and bits == 4:
        value = QuantValue.Q4S if q.min(initial=0) >= -7 else QuantValue.Q4F
    else:
        value = QuantValue.Q8S if q.min(initial=0) >= -127 else QuantValue.Q8F
    extent = block
    while extent > _BURN_MAX_EXTENT and extent % 2 == 0:
        extent //= 2  # same scale repeated over the halves
    if extent > _BURN_MAX_EXTENT:
        return None
    scale = np.repeat(scale, block // extent, axis=0)[: -(-k // extent)]
    scheme = QuantScheme(value, block_size=(extent, 1))
    if half:
        scheme = scheme.with_scale_dtype(ScaleDtype.F16)
    return _checked(QuantizedTensor((k, n), scheme, q.astype(np.int8), scale))


def _checked(qt: QuantizedTensor) -> QuantizedTensor | None:
    try:
        if qt.axis is None:
            qt.to_bytes()  # scales representable in the scheme's dtype
    except QuantizationError:
        return None
    return qt


def _own_tensor(props, q, full_scale, trans: bool) -> QuantizedTensor | None:
    """The Burn tensor this package exported (its ``SCHEME_KEY``), when the unpacked scales
    are that scheme's (module docstring), else ``None``."""
    text = props.get(SCHEME_KEY) if props is not None else None
    if not text or props.get(GLOBAL_SCALE_KEY):
        return None
    scheme = QuantScheme.from_cbor(json.loads(text))
    values = q.T if trans else q
    scales = full_scale.T if trans else full_scale
    want = values.astype(np.float32) * scales
    candidates = []
    grid = params_shape(values.shape, scheme)
    if scheme.block is None:
        candidates.append(lambda: QuantizedTensor(values.shape, scheme, values.astype(np.int8), scales.reshape(-1)[:1]))
        axis = 0 if trans else 1  # ONNX per-axis (an extent over Burn's 255), one scale per column
        candidates.append(lambda: QuantizedTensor(values.shape, scheme, values.astype(np.int8),
                                                  scales.take(0, axis=1 - axis), axis=axis))
    else:
        extents = scheme.block.size.to_dim_vec(values.ndim)
        index = np.ix_(*[np.arange(g) * e for g, e in zip(grid, extents)])
        candidates.append(lambda: QuantizedTensor(values.shape, scheme, values.astype(np.int8), scales[index]))
    for make in candidates:
        try:
            qt = _checked(make())
        except QuantizationError:
            continue
        if qt is not None and np.array_equal(qt.dequantize(), want):
            return qt
    return None


def fold_matmul_nbits(graph: ir.Graph) -> int:
    """Turn each readable ``MatMulNBits`` of ``graph`` into ``MatMul`` (or the ``Gemm`` it was
    exported from) of a float initializer that the importer makes a ``QFloat`` param (module
    docstring). Returns the number of nodes folded."""
    folded = 0
    for node in list(graph):
        if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN:
            continue
        source = node.inputs[1]
        if source is None or source.is_graph_input() or len(source.uses()) != 1:
            continue
        parts = _integer_parts(node)
        if parts is None:
            continue
        q, scale, block, symmetric, bits, half = parts
        props = source.const_value.metadata_props
        trans = props.get(NBITS_TRANS_KEY) == "1"
        full_scale = np.repeat(scale, block, axis=0)[: q.shape[0]]
        qt = _own_tensor(props, q, full_scale, trans)
        if qt is None:
            trans = False
            qt = _generic_tensor(q, scale, block, symmetric, bits, half)
        if qt is None:
            continue
        if half:
            qt.float_dtype = DType.F16
        _replace(graph, node, source, qt, trans, props)
        folded += 1
    return folded


def _replace(graph: ir.Graph, node: ir.Node, source: ir.Value, qt: QuantizedTensor, trans: bool, props) -> None:
    name = source.name
    onnx_dtype = ir.DataType.FLOAT16 if qt.float_dtype is DType.F16 else ir.DataType.FLOAT
    np_dtype = np.float16 if qt.float_dtype is DType.F16 else np.float32
    lazy = ir.LazyTensor(lambda _qt=qt: ir.tensor(_qt.dequantize().astype(np_dtype)), onnx_dtype,
                         ir.Shape(list(qt.shape)), name=name)
    lazy.metadata_props.update({k: v for k, v in props.items() if k not in (SCHEME_KEY, GLOBAL_SCALE_KEY, NBITS_TRANS_KEY)})
    others = [v for v in list(node.inputs)[2:] if v is not None]
    order = list(graph.initializers)
    graph.initializers.pop(name)
    weight = ir.Value(name=name, type=ir.TensorType(onnx_dtype), shape=ir.Shape(list(qt.shape)), const_value=lazy)
    weight.meta[_IMPORTED] = qt
    graph.register_initializer(weight)
    # NOTE: the weight keeps its place among the initializers (the order of the params)
    after = [graph.initializers.pop(n) for n in order[order.index(name) + 1:]]
    for value in after:
        graph.register_initializer(value)
    a, y = node.inputs[0], node.outputs[0]
    bias = node.inputs[5] if len(node.inputs) > 5 else None
    if trans:
        new = [ir.Node("", "Gemm", [a, weight] + ([bias] if bias is not None else []), [ir.AttrInt64("transB", 1)],
                       name=node.name)]
    else:
        new = [ir.Node("", "MatMul", [a, weight], name=node.name)]
        if bias is not None:
            new.append(ir.Node("", "Add", [new[0].outputs[0], bias], name=f"{node.name}/bias"))
    out = new[-1].outputs[0]
    out.type, out.shape = y.type, y.shape
    graph.insert_before(node, new)
    y_name = y.name
    y.replace_all_uses_with(out, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    out.name = y_name
    for value in others:
        if value is not bias and not value.uses() and not value.is_graph_output() and value.name in graph.initializers:
            graph.initializers.pop(value.name)
