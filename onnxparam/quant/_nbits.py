"""4-bit MatMul / Gemm weights: ONNX Runtime's ``com.microsoft.MatMulNBits``.

``DequantizeLinear`` takes ``INT4`` values only from opset 21. Below it a 4-bit weight is never
stored as int8 (a file that claims 4 bits and holds 8): every ``MatMul`` use and every ``Gemm``
weight use (``transA=0``, ``alpha = beta = 1``) becomes ORT's contrib operator ``MatMulNBits``
(ONNX Runtime contrib operator spec: ``com.microsoft.MatMulNBits``, ``bits=4``), which runs 4-bit
weights at any opset; a 4-bit weight with any other use (Conv, ConvTranspose, Mul, ...: no 4-bit
form exists below opset 21) is written as its float values (``param.val()``, or the original
ones given ``QdqOptions.float_module``), with a :class:`QuantizationWarning` and ``"reason"``
in its per-op report rows.

``MatMulNBits`` (the layout ORT documents and packs itself):

* ``Y = A @ dequantize(B)^T``; ``A`` float ``[..., K]``; attributes ``K``, ``N``, ``bits``,
  ``block_size`` (a power of 2, at least 16);
* ``B`` uint8 ``[N, ceil(K / block_size), block_size / 2]``: row ``n`` holds column ``n`` of the
  ``[K, N]`` weight (row ``n`` of a ``Gemm`` ``transB=1`` weight ``[N, K]``), blocks along K, two
  codes per byte, the first in the low nibble;
* ``scales`` ``A``'s float type, ``[N * ceil(K / block_size)]`` (``n`` major);
* no ``zero_points`` input: the zero point is ``2^(bits-1) = 8``, so a code is Burn's signed
  value + 8 (lossless for Q4S / Q4F, values -8..7); padding codes (K not a multiple of the
  block) are 8, i.e. 0.

Blocks: a blocked Burn scheme along K keeps its block (a power of 2 >= 16). A per-tensor or
per-output-channel weight has one scale for all of K, so any block repeats the same scale; it
gets the power of 2 in 16..256 that makes ``B`` plus scales smallest (one block over K when K is
a power of 2 up to 256; MLAS' 4-bit kernels take blocks of 16..256).

The param's initializer (named by its path) then holds ``B``; its scales are a constant. A
``Gemm``'s ``C`` is added after the ``MatMulNBits`` (``Add``). No ``accuracy_level`` attribute is
written: 0, float32 compute with exactly the dequantized weights (what ``MatMulNBitsQuantizer``
writes).

**At opset 21 and later** ``DequantizeLinear`` takes ``INT4``, and ORT fuses ``DQ -> MatMul`` into
``MatMulNBits`` itself, but with the session's ``accuracy_level``, 4 (int8 activations) unless
the session config says otherwise; on an AVX2 CPU that ran 1.27-1.35x the time of level 0 on a
transformer block (M = 512; 0.9x at M = 1). So the default export (``QdqOptions.matmul``
``"auto"`` / ``"dynamic"``) writes ``MatMulNBits`` there too, where every use of the weight can
take it; a weight that cannot keeps its ``INT4`` ``DequantizeLinear`` (no float fallback), and
``matmul="dequantize"`` keeps the standard-ONNX form everywhere.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir

from ..core.errors import QuantizationWarning
from ._qdq_forms import FLOAT_REASON_KEY, drop_unused_constants, is_float, slow_weight_only, to_float
from ._qdq_options import NBITS_MIN_BLOCK, NBITS_TRANS_KEY
from ._stream import spilled

MS_DOMAIN = "com.microsoft"

NBITS_MAX_BLOCK = 256
"""The largest block a per-tensor / per-channel 4-bit weight gets (module docstring)."""


def _grid(e, trans: bool):
    """``(scale [K_blocks, N], block)`` of a 4-bit weight used as ``[K, N]`` (``[N, K]`` when
    ``trans``), or ``None`` when its scales are not constant along blocks of K."""
    from ._qdq_layout import _onnx_grid

    qt = e.quantized
    k_axis = 1 if trans else 0
    k, n = qt.shape[k_axis], qt.shape[1 - k_axis]
    grid = _onnx_grid(qt, 21)
    if grid is None:
        return None
    scale, axis, block = grid
    if axis is None:
        block = _block_for(k)
        return np.full((-(-k // block), n), np.float32(scale), np.float32), block
    if block is None:
        if axis != 1 - k_axis:
            return None
        block = _block_for(k)
        return np.broadcast_to(np.asarray(scale, np.float32).reshape(1, n), (-(-k // block), n)).copy(), block
    if axis == k_axis and block >= NBITS_MIN_BLOCK and block & (block - 1) == 0:
        scale = np.asarray(scale, np.float32)
        return (scale.T if trans else scale).reshape(-1, n), block
    return None


def _block_for(k: int) -> int:
    """The power of 2 in ``16..256`` giving the fewest bytes for one row of ``B`` plus its
    float32 scales (module docstring)."""
    sizes = [b for b in (NBITS_MIN_BLOCK << i for i in range(8)) if b <= NBITS_MAX_BLOCK]
    return min(sizes, key=lambda b: (-(-k // b) * (b // 2 + 4), b))


def pack(values: np.ndarray, block: int) -> np.ndarray:
    """``MatMulNBits`` ``B`` of signed 4-bit ``values`` ``[K, N]`` (module docstring)."""
    k, n = values.shape
    blocks = -(-k // block)
    codes = np.full((n, blocks * block), 8, np.uint8)
    codes[:, :k] = (values.astype(np.int16).T + 8).astype(np.uint8)
    codes = codes.reshape(n, blocks, block // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _use_kind(node: ir.Node, index: int):
    """``"MatMul"`` / ``"Gemm"`` / ``"GemmT"`` (``transB=1``) for a use ``MatMulNBits`` can take
    the place of, else the reason it cannot (a string starting with a space is a reason)."""
    if node.domain not in ("", "ai.onnx") or index != 1:
        return f" {node.op_type} {node.name!r} takes it as input {index}"
    if node.inputs[0] is None or node.inputs[0].dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return f" {node.op_type} {node.name!r} has a non-float32/float16 input"
    if node.op_type == "MatMul":
        return "MatMul"
    if node.op_type == "Gemm":
        if _attr(node, "transA", 0) != 0 or _attr(node, "alpha", 1.0) != 1.0 or (
                len(node.inputs) > 2 and node.inputs[2] is not None and _attr(node, "beta", 1.0) != 1.0):
            return f" Gemm {node.name!r} has transA / alpha / beta"
        return "GemmT" if _attr(node, "transB", 0) == 1 else "Gemm"
    return f" {node.op_type} {node.name!r} has no 4-bit form below opset 21"


def matmul_nbits(tracer, e, prefer: str = "size", direct: bool = False) -> None:
    """Below opset 21, a 4-bit weight (module docstring): every ``MatMul(A, DQ(W))`` /
    ``Gemm(A, DQ(W)[, C])`` use becomes ``MatMulNBits``; a weight that cannot (another use,
    blocks along N, mixed ``transB``) is written as the float weight, with a warning naming it
    and the reason recorded for the per-op report (silently with ``prefer="speed"`` when every
    use is one that preference writes float at any opset: an uncalibrated Conv).

    ``direct`` (opset >= 21, ``QdqOptions.matmul`` ``"auto"`` / ``"dynamic"``): the same
    ``MatMulNBits`` where every use can take it (module docstring, "At opset 21 and later");
    a weight that cannot keeps its ``INT4`` ``DequantizeLinear``, valid at that opset."""
    if e.quantized.scheme.value.name not in ("Q4S", "Q4F"):
        return
    if not direct and not e.value.meta.get("onnxparam.qdq.opset21"):
        return
    if direct and is_float(e.value):
        return
    out = e.output._symbol.value
    uses = list(out.uses())
    kinds = {_use_kind(node, index) for node, index in uses}
    reason = next((k.strip() for k in sorted(kinds) if k.startswith(" ")), None)
    if reason is None and len(e.quantized.shape) != 2:
        reason = f"a rank-{len(e.quantized.shape)} weight is no MatMul matrix"
    if reason is None and not uses:
        reason = "no op uses it"
    if reason is None and "GemmT" in kinds and len(kinds) > 1:
        reason = "its uses take it both as [K, N] and transposed"
    trans = "GemmT" in kinds
    grid = _grid(e, trans) if reason is None else None
    if reason is None and grid is None:
        reason = "its scales vary along N within a block (MatMulNBits blocks run along K)"
    if direct and reason is not None:
        return  # the INT4 DequantizeLinear stays: valid at opset >= 21 (_check_fusable warns about N blocks)
    if reason is not None and prefer == "speed" and slow_weight_only(e):
        to_float(tracer, e)  # what prefer="speed" writes at any opset (_qdq_forms.keep_float)
        return
    if reason is not None:
        warnings.warn(f"{e.path!r} ({e.quantized.describe()}) is 4-bit, and at opset {tracer.opset} 4-bit weights "
                      f"exist only as com.microsoft MatMulNBits (opset 21 has INT4 DequantizeLinear), which this "
                      f"weight cannot be: {reason}; it is exported as the float weight (not as int8)",
                      QuantizationWarning, stacklevel=6)
        e.value.meta[FLOAT_REASON_KEY] = f"4-bit below opset 21: {reason}"
        to_float(tracer, e, any_dtype=True)
        return
    scale, block = grid
    values = np.asarray(e.quantized.values)
    if trans:
        values = values.T
    k, n = values.shape
    packed = spilled(pack(values, block))  # NOTE (issue 27): file-mapped when streaming (_stream)
    props = dict(e.value.const_value.metadata_props)  # the Burn scheme: import restores it
    if trans:
        props[NBITS_TRANS_KEY] = "1"
    e.value.const_value = ir.Tensor(packed, name=e.path)
    e.value.const_value.metadata_props.update(props)
    e.value.type = ir.TensorType(ir.DataType.UINT8)
    e.value.shape = ir.Shape(list(packed.shape))
    graph = e.node.graph
    fused, gemms = [], set()
    for node, _ in uses:
        a, y = node.inputs[0], node.outputs[0]
        np_dtype = np.float16 if a.dtype == ir.DataType.FLOAT16 else np.float32
        s = tracer.constant(spilled(np.ascontiguousarray(scale.T).reshape(-1).astype(np_dtype)),
                            name=f"{e.path}_nbits_scale")._symbol.value
        new = ir.Node(MS_DOMAIN, "MatMulNBits", [a, e.value, s],
                      [ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", 4),
                       ir.AttrInt64("block_size", block)], num_outputs=1, name=tracer.unique_name(f"{node.name}/nbits"))
        added = [new]
        result = new.outputs[0]
        result.type, result.shape = y.type, y.shape
        if node.op_type == "Gemm":
            gemms.add(id(new))
            if len(node.inputs) > 2 and node.inputs[2] is not None:
                result.name = tracer.unique_name(f"{new.name}_output_0")
                add = ir.Node("", "Add", [result, node.inputs[2]], num_outputs=1,
                              name=tracer.unique_name(f"{node.name}/nbits/Add"))
                add.outputs[0].type, add.outputs[0].shape = y.type, y.shape
                added.append(add)
                result = add.outputs[0]
        graph.insert_after(node, added)
        y.replace_all_uses_with(result, replace_graph_outputs=True)
        name = y.name
        graph.remove(node, safe=True)
        result.name = name
        fused.append(new)
    e.value.meta["onnxparam.qdq.nbits"] = fused
    e.value.meta["onnxparam.qdq.nbits_gemm"] = gemms
    tracer.opset_imports.setdefault(MS_DOMAIN, 1)
    drop_unused_constants(tracer, e)
