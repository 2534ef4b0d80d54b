"""4-bit ``MatMul`` weights below opset 21: ONNX Runtime's ``com.microsoft.MatMulNBits``.

``DequantizeLinear`` takes ``INT4`` values and blocked scales only from opset 21; below it a 4-bit
weight would be written as int8 (or float32 for blocked scales). ORT's contrib operator
``MatMulNBits`` (ONNX Runtime contrib operator spec: ``com.microsoft.MatMulNBits``, ``bits=4``)
runs 4-bit weights at any opset:

* ``Y = A @ dequantize(B)^T``; ``A`` float ``[..., K]``; attributes ``K``, ``N``, ``bits``,
  ``block_size`` (a power of 2, at least 16);
* ``B`` uint8 ``[N, ceil(K / block_size), block_size / 2]``: row ``n`` holds column ``n`` of the
  ``[K, N]`` weight, blocks along K, two codes per byte, the first in the low nibble;
* ``scales`` ``A``'s float type, ``[N * ceil(K / block_size)]`` (``n`` major);
* no ``zero_points`` input: the zero point is ``2^(bits-1) = 8``, so a code is Burn's signed
  value + 8 (lossless for Q4S / Q4F, values -8..7); padding codes (K not a multiple of the
  block) are 8, i.e. 0.

The param's initializer (named by its path) then holds ``B``; its scales are a constant.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir

from ..errors import QuantizationWarning
from ._qdq_forms import drop_unused_constants, to_float
from ._qdq_options import NBITS_MIN_BLOCK

MS_DOMAIN = "com.microsoft"


def _grid(e):
    """``(scale [K_blocks, N], block)`` of a 4-bit ``[K, N]`` weight, or ``None`` when its scales
    are not constant along blocks of K (blocks along N)."""
    from ._qdq_layout import _onnx_grid

    qt = e.quantized
    k, n = qt.shape
    grid = _onnx_grid(qt, 21)
    if grid is None:
        return None
    scale, axis, block = grid
    if axis is None:
        block = _block_for(k)
        return np.full((-(-k // block), n), np.float32(scale), np.float32), block
    if block is None:
        if axis != 1:
            return None
        block = _block_for(k)
        return np.broadcast_to(scale.reshape(1, n), (-(-k // block), n)).astype(np.float32), block
    if axis == 0 and block >= NBITS_MIN_BLOCK and block & (block - 1) == 0:
        return np.asarray(scale, np.float32).reshape(-1, n), block
    return None


def _block_for(k: int) -> int:
    block = NBITS_MIN_BLOCK
    while block < 128 and block < k:
        block *= 2
    return block


def pack(values: np.ndarray, block: int) -> np.ndarray:
    """``MatMulNBits`` ``B`` of signed 4-bit ``values`` ``[K, N]`` (module docstring)."""
    k, n = values.shape
    blocks = -(-k // block)
    codes = np.full((n, blocks * block), 8, np.uint8)
    codes[:, :k] = (values.astype(np.int16).T + 8).astype(np.uint8)
    codes = codes.reshape(n, blocks, block // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)


def matmul_nbits(tracer, e) -> None:
    """Below opset 21: every ``MatMul(A, DQ(W))`` of a 4-bit ``[K, N]`` weight becomes
    ``MatMulNBits``; a 4-bit weight that cannot (other uses, blocks along N) is written as the
    float weight when its ``DequantizeLinear`` is not valid at this opset (a warning names it)."""
    if e.quantized.scheme.value.name not in ("Q4S", "Q4F") or len(e.quantized.shape) != 2:
        return
    out = e.output._symbol.value
    uses = list(out.uses())
    grid = _grid(e)
    fits = grid is not None and uses and all(
        node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and index == 1
        and node.inputs[0].dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16) for node, index in uses)
    if not fits:
        if e.value.meta.get("onnxparam.qdq.opset21"):
            warnings.warn(f"{e.path!r} ({e.quantized.describe()}) is 4-bit with scales DequantizeLinear takes only "
                          f"from opset 21, and not only a MatMul weight (MatMulNBits): it is exported as the float "
                          f"weight at opset {tracer.opset}", QuantizationWarning, stacklevel=6)
            to_float(tracer, e)
        return
    scale, block = grid
    k, n = e.quantized.shape
    packed = pack(np.asarray(e.quantized.values), block)
    e.value.const_value = ir.Tensor(packed, name=e.path)
    e.value.type = ir.TensorType(ir.DataType.UINT8)
    e.value.shape = ir.Shape(list(packed.shape))
    graph = e.node.graph
    fused = []
    for node, _ in uses:
        a, y = node.inputs[0], node.outputs[0]
        np_dtype = np.float16 if a.dtype == ir.DataType.FLOAT16 else np.float32
        s = tracer.constant(np.ascontiguousarray(scale.T).reshape(-1).astype(np_dtype),
                            name=f"{e.path}_nbits_scale")._symbol.value
        new = ir.Node(MS_DOMAIN, "MatMulNBits", [a, e.value, s],
                      [ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", 4),
                       ir.AttrInt64("block_size", block)], num_outputs=1, name=tracer.unique_name(f"{node.name}/nbits"))
        result = new.outputs[0]
        result.type, result.shape = y.type, y.shape
        graph.insert_after(node, [new])
        y.replace_all_uses_with(result, replace_graph_outputs=True)
        name = y.name
        graph.remove(node, safe=True)
        result.name = name
        fused.append(new)
    e.value.meta["onnxparam.qdq.nbits"] = fused
    tracer.opset_imports.setdefault(MS_DOMAIN, 1)
    drop_unused_constants(tracer, e)
