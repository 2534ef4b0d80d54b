"""Which form each quantized weight takes in an exported graph, per consuming op, and the report
of those choices (see :mod:`onnxparam.quant._qdq`, "Which form each op gets").

The forms, as ONNX Runtime 1.32 on CPU runs them (measured with ``tools/bench.py quant``):

=====================  =========================================================================
form                   what is written / what ORT runs
=====================  =========================================================================
``dynamic int8``       ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` (ORT:
                       ``DynamicQuantizeMatMul``, an int8 GEMM; faster than float32)
``static int8``        activation ``QuantizeLinear -> DequantizeLinear`` pairs from calibration
                       (ORT: ``QLinearConv`` / ``QLinearMatMul``; faster than float32)
``4-bit MatMulNBits``  ``com.microsoft.MatMulNBits`` written directly (``accuracy_level`` 0: float32
                       compute, as ``MatMulNBitsQuantizer`` writes; the size-first form for 4
                       bits), or ``DequantizeLinear -> MatMul`` fused by ORT (opset >= 21 with
                       ``matmul="dequantize"``; the session's accuracy level, 4 by default)
``dequantize``         weight-only ``DequantizeLinear``: the weight is dequantized at every run
                       (smallest file; slower than float32 for Conv / ConvTranspose / Gemm / LSTM)
``int8 gather``        an embedding table read as ``Gather(int8 table) -> DequantizeLinear``:
                       only the gathered rows are dequantized (what ``quantize_dynamic`` writes)
``float``              a float initializer: what ``prefer="speed"`` (the default) writes where
                       only the weight-only form exists (a Conv without calibration data); the
                       original float values when ``QdqOptions.float_module`` gives them (what
                       ``onnxparam quantize`` does), else the dequantized ones (``param.val()``)
=====================  =========================================================================

**Integer-kernel weights are stored as uint8 codes with zero point 128** (:func:`unsigned_for_integer_kernels`):
an 8-bit weight that an integer kernel reads (``dynamic int8``: ``MatMulInteger``; ``static int8``:
the ``DequantizeLinear`` ORT fuses into ``QLinearMatMul`` / ``QLinearConv``) is written as
``code + 128`` (``UINT8``) with zero point 128, never as ``INT8``. The activations of both forms
are uint8, and on x86 CPUs with AVX2 but no AVX-VNNI / AVX512-VNNI, ONNX Runtime's MLAS runs a
uint8 x int8 product with ``VPMADDUBSW``, which adds two ``u8 * s8`` products into a **saturating
int16**: ``255 * 127 + 255 * 127 = 64770`` becomes 32767, silently (ORT 1.32: ``MatMulInteger`` of
a = 255 ``[1, 16]`` and b = 127 ``[16, 4]`` gives 262136 instead of 518160; MNIST's int8 accuracy
fell to 0.76-0.84 from 0.92). Its uint8 x uint8 kernels widen to int16 first and are exact on
every CPU. ``(code + 128) - 128`` is ``code``, so ``DequantizeLinear`` gives Burn's values bit for
bit and import reads the weight back as the same ``QFloat`` (Q8S / Q8F from the scheme metadata).
Rejected: ORT's ``reduce_range`` (7-bit weights, what its docs suggest for non-VNNI x86) changes
Burn's values; int8 activations are not what ``DynamicQuantizeLinear`` gives (uint8 only).
Cost (AVX2, 1 thread, interleaved; README's quantization notes): 1.01-1.16x the saturating int8
layout's time for ``dynamic int8``, 1.13-1.41x for ``static int8``; 0.63-1.10x of float32 (above
0.95x only on MNIST, a 0.2 ms model). ``tools/bench_quant_layout.py`` measures it.
``QdqOptions(kernel_weights="int8")`` is the opt-in for CPUs with VNNI: the ``INT8`` codes as they
are (ORT's own layout), with a warning unless this CPU reports VNNI (:func:`cpu_runs_int8_kernels_exactly`).
Weight-only ``DequantizeLinear`` (float compute: ``dequantize``, ``MatMulNBits``) keeps ``INT8``.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import re
import warnings

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ..core.dtype import DType

REPORT_KEY = "onnxparam.quant.ops"
"""Model ``metadata_props`` key: JSON list of ``{"node", "op", "weight", "form"}``, one per op
with a quantized weight (:func:`quantized_ops` reads it); a ``"float"`` row that was forced
(a 4-bit weight below opset 21 that no ``MatMulNBits`` can take) also has ``"reason"``."""

FLOAT_REASON_KEY = "onnxparam.qdq.float_reason"
"""``value.meta`` key: why a quantized weight was written float (the report row's ``reason``)."""

_REPORT_META = "onnxparam.quant.report"
_LOG = logging.getLogger("onnxparam.quant")

_SLOW_WEIGHT_ONLY = ("Conv", "ConvTranspose", "Gemm")
"""Ops ORT runs slower with a weight-only ``DequantizeLinear`` than with a float weight."""

_NO_INTEGER_KERNEL = ("LSTM", "GRU", "RNN")
"""Ops ORT has no integer kernel for (and fuses no ``DequantizeLinear`` into): a quantized weight
of any of their inputs dequantizes at every run, slower than the float model."""

SPEED_REASON = "prefer='speed'"
"""How a report ``reason`` of a weight :func:`keep_float` chose to keep float starts."""


def consumers(value: ir.Value) -> list:
    """``(node, input index)`` of every use of ``value``, looking through a ``Cast`` (an F16
    weight's ``DequantizeLinear -> Cast``)."""
    found = []
    for node, index in list(value.uses()):
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            found.extend(consumers(node.outputs[0]))
        else:
            found.append((node, index))
    return found


def _statically_quantized(node: ir.Node) -> bool:
    """Whether ``node``'s activation input comes from an activation ``DequantizeLinear``."""
    producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    return producer is not None and producer.op_type == "DequantizeLinear"


def keep_float(tracer, emitted: list, prefer: str) -> None:
    """``prefer="speed"``: a weight whose every use is a Conv / ConvTranspose / Gemm weight
    input without activation quantization, or any input of an LSTM / GRU / RNN (their report row
    gets a ``reason`` starting with :data:`SPEED_REASON`), becomes a float initializer (:func:`to_float`: the
    original values, or the dequantized ones); its ``DequantizeLinear`` (and scale constants) go away."""
    if prefer != "speed":
        return
    for e in emitted:
        if slow_weight_only(e):
            recurrent = sorted({node.op_type for node, _ in consumers(e.output._symbol.value)
                                if node.op_type in _NO_INTEGER_KERNEL})
            to_float(tracer, e)
            if recurrent and is_float(e.value):
                e.value.meta[FLOAT_REASON_KEY] = (
                    f"{SPEED_REASON}: ONNX Runtime has no integer {' / '.join(recurrent)} kernel, so a weight-only "
                    "DequantizeLinear would run at every call, slower than the float weight")


def slow_weight_only(e) -> bool:
    """Whether every use of ``e``'s dequantized weight is the weight input of an op ORT runs
    slower with a weight-only ``DequantizeLinear`` than in float (:func:`keep_float`)."""
    uses = consumers(e.output._symbol.value)
    return bool(uses) and all(node.op_type in _NO_INTEGER_KERNEL or node.op_type in _SLOW_WEIGHT_ONLY and index == 1
                              and not _statically_quantized(node) for node, index in uses)


_FLOAT_TYPES = {DType.F32: (np.float32, ir.DataType.FLOAT), DType.F16: (np.float16, ir.DataType.FLOAT16),
                DType.BF16: (ml_dtypes.bfloat16, ir.DataType.BFLOAT16), DType.F64: (np.float64, ir.DataType.DOUBLE)}


_ORIGINALS_META = "onnxparam.qdq.originals"
ORIGINAL_META = "onnxparam.qdq.original"
"""``value.meta`` key: ``True`` when a weight written float holds its original float values."""


def original_param(tracer, param):
    """The float param ``param`` was quantized from: the param with its id in
    :attr:`QdqOptions.float_module <onnxparam.quant.QdqOptions>` when that one is float and of
    the same shape, else ``None`` (no ``float_module``, or the param is not in it)."""
    from ._qdq_options import current_options

    source = current_options().float_module
    if source is None:
        return None
    held = tracer.graph.meta.get(_ORIGINALS_META)
    if held is None or held[0] is not source:
        held = (source, {p.id: p for _, p in source.named_params()})
        tracer.graph.meta[_ORIGINALS_META] = held
    found = held[1].get(param.id)
    if found is None or found.lazy_dtype() not in _FLOAT_TYPES:
        return None
    try:
        same = tuple(found.lazy_shape()) == tuple(param.lazy_shape())
    except ValueError:  # a lazy param declared without a shape
        same = False
    return found if same else None


def _original_array(param, np_dtype) -> np.ndarray:
    from ..trace.tracer import untraced

    with untraced():
        array = np.asarray(param.base().to_numpy())
    return array if array.dtype == np_dtype else array.astype(np_dtype)


def to_float(tracer, e, any_dtype: bool = False) -> None:
    """Write the quantized param ``e`` as a float initializer (F32 / F16; BF16 / F64 too with
    ``any_dtype``, else those keep the ``DequantizeLinear`` (+ ``Cast``) form): its original
    values when :func:`original_param` has them, else the dequantized ones (``param.val()``)."""
    dtype = e.quantized.float_dtype
    if dtype not in (DType.F32, DType.F16) and not (any_dtype and dtype in _FLOAT_TYPES):
        return
    np_dtype, onnx_dtype = _FLOAT_TYPES[dtype]
    layout_ref = e.value.meta["onnxparam.qdq.ref"]
    original = original_param(tracer, e.param)

    def make(_ref=layout_ref, _name=e.path, _np=np_dtype, _original=original):
        if _original is not None:
            return ir.Tensor(_original_array(_original, _np), name=_name)
        return ir.Tensor(_ref[0].dequantize().astype(_np), name=_name)

    e.value.const_value = ir.LazyTensor(make, onnx_dtype, e.value.shape, name=e.path)
    e.value.type = ir.TensorType(onnx_dtype)
    e.value.meta["onnxparam.qdq.float"] = True
    e.value.meta[ORIGINAL_META] = original is not None
    graph = e.node.graph
    out = e.output._symbol.value
    # NOTE: the uses of the value of the param's own dtype take the initializer: the DequantizeLinear
    # output, or that of the Cast emit_param adds after it; a Cast of the model's own (an F16 weight
    # cast to float) stays, reading the initializer as the source graph did
    for node, index in list(out.uses()):
        if out.dtype == onnx_dtype:
            node.replace_input_with(index, e.value)
        elif node.op_type == "Cast" and node.outputs[0].dtype == onnx_dtype:
            for user, i in list(node.outputs[0].uses()):
                user.replace_input_with(i, e.value)
    for cast, _ in list(out.uses()):  # the F16 Cast, now unused
        if not cast.outputs[0].uses() and not cast.outputs[0].is_graph_output():
            graph.remove(cast, safe=True)
    drop_unused_constants(tracer, e)


def drop_unused_constants(tracer, e) -> None:
    """Forget ``e``'s scale / zero-point constants once no node but its own (about to be
    removed) ``DequantizeLinear`` reads them (a deduplicated constant may serve others)."""
    def unused(v):
        return all(node is e.node for node, _ in v.uses())

    dropped = {id(v) for v in (e.scale, e.zero_point) if v is not None and unused(v)}
    tracer._constants[:] = [v for v in tracer._constants if id(v) not in dropped]


def is_float(value: ir.Value) -> bool:
    """Whether :func:`keep_float` turned this quantized param's initializer into a float one."""
    return bool(value.meta.get("onnxparam.qdq.float"))


# -- integer kernels: uint8 weight codes ---------------------------------------------------------


_INTEGER_STATIC_OPS = ("MatMul", "Conv", "Gemm")
"""Ops ORT fuses with a ``DequantizeLinear`` activation and weight into an integer kernel whose
uint8 x uint8 form exists (``QLinearMatMul``, ``QLinearConv``, ``QGemm``)."""


def _feeds_integer_kernel(e) -> bool:
    """Whether an integer kernel with uint8 activations reads ``e``'s 8-bit codes: a
    ``MatMulInteger`` (directly or through the ``Transpose`` of a ``transB`` Gemm), or a
    ``DequantizeLinear`` whose output is the weight of a statically quantized MatMul / Conv / Gemm."""
    for user, _ in list(e.value.uses()):
        if user.op_type == "MatMulInteger":
            return True
        if user.op_type == "Transpose" and any(u.op_type == "MatMulInteger" for u, _ in user.outputs[0].uses()):
            return True
        if user.op_type == "DequantizeLinear" and any(
                node.op_type in _INTEGER_STATIC_OPS and index == 1 and _statically_quantized(node)
                for node, index in _through_activation_qdq(list(user.outputs[0].uses()))):
            return True
    return False


def _zero_point_dims(e) -> list:
    """The shape a zero point of ``e``'s ``DequantizeLinear`` must have: its scale input's (which a
    folded ``BatchNormalization`` may have made per output channel)."""
    scale = e.node.inputs[1]
    if scale is not None and scale.shape is not None and all(isinstance(d, int) for d in scale.shape):
        return list(scale.shape)
    axis = e.node.attributes.get("axis")
    if axis is not None and scale is not None and scale.shape is not None and len(scale.shape) == 1:
        return [e.layout.values.shape[axis.value]]
    return list(e.layout.scale.shape)


_SAFE_CPU_FLAGS = ("avx512_vnni", "avx_vnni")
"""``/proc/cpuinfo`` flags of x86 CPUs whose ORT uint8 x int8 kernels add into int32 (VNNI)."""


@functools.lru_cache(maxsize=None)
def cpu_runs_int8_kernels_exactly() -> bool:
    """Whether this machine is known to run ONNX Runtime's uint8 x int8 kernels without int16
    saturation: an x86 CPU with AVX-VNNI or AVX512-VNNI in ``/proc/cpuinfo`` (Linux). ``False``
    where that cannot be read (other OSes, other architectures): unknown is not safe."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in _SAFE_CPU_FLAGS)
    except OSError:
        return False
    return False


def _warn_int8_kernel_weights(paths: list) -> None:
    if cpu_runs_int8_kernels_exactly():
        return
    from ..core.errors import QuantizationWarning

    shown = ", ".join(repr(p) for p in paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    warnings.warn(
        f"QdqOptions(kernel_weights='int8'): {shown} are stored as INT8 for ONNX Runtime's uint8 x int8 "
        "integer kernels, which on x86 CPUs with AVX2 but no AVX-VNNI / AVX512-VNNI add pairs of products "
        "into a saturating int16 and compute wrong values without an error; this CPU is not known to have "
        "VNNI. Run the file only on CPUs that do (or keep the default kernel_weights='uint8', exact everywhere)",
        QuantizationWarning, stacklevel=6)


def unsigned_for_integer_kernels(tracer, emitted: list, kernel_weights: str = "uint8") -> None:
    """Store every signed 8-bit weight an integer kernel with uint8 activations reads
    (:func:`_feeds_integer_kernel`: ``dynamic int8`` and ``static int8``, per tensor or per
    channel) as ``UINT8`` codes ``code + 128`` with zero point 128.

    Why (module docstring): ORT's uint8 x int8 kernels on x86 CPUs without VNNI
    (``VPMADDUBSW``) saturate pairs of products in int16, a wrong number with no error; its uint8 x
    uint8 kernels are exact everywhere. ``DequantizeLinear`` / ``MatMulInteger`` subtract the zero
    point exactly, so every consumer computes with the same values (Burn's ``q * scale``); the
    initializer keeps the Burn scheme metadata, so import restores the same ``QFloat``.

    The initializer, its layout (:class:`~onnxparam.quant._qdq_layout.WeightLayout`, ``UINT8``
    values ``[weight shape]``, zero point ``[scale shape]``) and ``e.zero_point`` change; the
    zero point (shaped as the ``DequantizeLinear`` scale: per tensor ``[]``, per channel ``[C]``)
    becomes the third input of the weight's ``DequantizeLinear`` and the fourth of each
    ``MatMulInteger`` reading it. Weights already unsigned, 4-bit, blocked, written float, or read
    by float compute only are left as they are.

    ``kernel_weights="int8"`` (``QdqOptions``, an opt-in for CPUs with VNNI): every such weight
    keeps its ``INT8`` codes, and a :class:`QuantizationWarning` names them unless this CPU is
    known to run uint8 x int8 kernels exactly (:func:`cpu_runs_int8_kernels_exactly`)."""
    from ._qdq_layout import with_zero_point_128

    kept = []
    for e in emitted:
        layout = e.layout
        if (layout.onnx_dtype != ir.DataType.INT8 or layout.zero_point is not None or layout.block_size is not None
                or is_float(e.value) or not _feeds_integer_kernel(e)):
            continue
        if kernel_weights == "int8":
            kept.append(e.path)
            continue
        new = with_zero_point_128(layout)
        ref = e.value.meta["onnxparam.qdq.ref"]
        ref[0] = e.layout = new
        props = dict(e.value.const_value.metadata_props)

        def make(_ref=ref, _name=e.path):
            return ir.Tensor(_ref[0].values, dtype=_ref[0].onnx_dtype, name=_name)

        e.value.const_value = ir.LazyTensor(make, new.onnx_dtype, e.value.shape, name=e.path)
        e.value.const_value.metadata_props.update(props)
        e.value.type = ir.TensorType(new.onnx_dtype)
        dims = _zero_point_dims(e)
        zero_point = ir.Value(name=tracer.unique_name(f"{e.path}_zero_point"),
                              const_value=ir.Tensor(np.full(dims, 128, np.uint8), dtype=new.onnx_dtype))
        zero_point.type = ir.TensorType(new.onnx_dtype)
        zero_point.shape = ir.Shape(dims)
        tracer._constants.append(zero_point)
        e.zero_point = zero_point
        readers = [(user, 2) for user, _ in e.value.uses() if user.op_type == "DequantizeLinear"]
        for user, _ in list(e.value.uses()):
            if user.op_type == "MatMulInteger":
                readers.append((user, 3))
            elif user.op_type == "Transpose":  # a transB Gemm's weight: the transposed codes are uint8 too
                user.outputs[0].type = ir.TensorType(new.onnx_dtype)
                readers += [(mmi, 3) for mmi, _ in user.outputs[0].uses() if mmi.op_type == "MatMulInteger"]
            elif user.op_type == "Gather" and id(user) in e.value.meta.get(_GATHER_META, ()):
                # a tied embedding's int8 gather (gather_then_dequantize): the gathered codes are uint8 too
                user.outputs[0].type = ir.TensorType(new.onnx_dtype)
                readers += [(dq, 2) for dq, _ in user.outputs[0].uses() if dq.op_type == "DequantizeLinear"]
        for node, index in readers:
            if len(node.inputs) <= index:
                node.resize_inputs(index + 1)
            node.replace_input_with(index, zero_point)
    if kept:
        _warn_int8_kernel_weights(kept)


def _form(node: ir.Node, e) -> str:
    if node.op_type in ("MatMul", "Conv") and _statically_quantized(node):
        return "static int8"
    if node.op_type == "MatMul" and e.layout.values.ndim == 2 and (
            e.layout.bits == 4 or e.layout.block_size is not None):
        return f"{e.layout.bits}-bit MatMulNBits"
    return "dequantize"


def _through_activation_qdq(uses: list) -> list:
    """``uses`` with each activation ``QuantizeLinear -> DequantizeLinear`` pair (static
    quantization puts one on a weight feeding e.g. an ``Add``) replaced by the pair's consumers:
    the ops that take the weight."""
    found = []
    for node, index in uses:
        if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx"):
            found.append((node, index))
            continue
        for dq, _ in list(node.outputs[0].uses()):
            if dq.op_type == "DequantizeLinear":
                found.extend(_through_activation_qdq(consumers(dq.outputs[0])))
            else:  # pragma: no cover - the static pass pairs every QuantizeLinear
                found.append((dq, _))
    return found


def record_report(tracer, emitted: list) -> None:
    """Note, on the graph, which form each op with a quantized weight got (:data:`REPORT_KEY`);
    rows hold the nodes themselves until :func:`write_report` (an imported graph's nodes get
    their source names back after the trace)."""
    rows = []
    for e in emitted:
        for user, _ in list(e.value.uses()):
            if user.op_type == "DequantizeLinear":
                for node, _ in _through_activation_qdq(consumers(user.outputs[0])):
                    rows.append({"node": node, "op": node.op_type, "weight": e.path, "form": _form(node, e)})
            elif user.op_type == "MatMulInteger":
                op = "Gemm" if id(user) in e.value.meta.get("onnxparam.qdq.gemm", ()) else "MatMul"
                rows.append({"node": user, "op": op, "weight": e.path, "form": "dynamic int8"})
            elif user.op_type == "Transpose" and any(u.op_type == "MatMulInteger" for u, _ in user.outputs[0].uses()):
                rows.append({"node": user, "op": "Gemm", "weight": e.path, "form": "dynamic int8"})
            elif user.op_type == "Gather" and id(user) in e.value.meta.get(_GATHER_META, ()):
                rows.append({"node": user, "op": "Gather", "weight": e.path, "form": "int8 gather"})
            elif user.op_type == "MatMulNBits":
                op = "Gemm" if id(user) in e.value.meta.get("onnxparam.qdq.nbits_gemm", ()) else "MatMul"
                rows.append({"node": user, "op": op, "weight": e.path,
                             "form": f"{e.quantized.scheme.value.name[1]}-bit MatMulNBits"})
            else:
                takers = consumers(user.outputs[0]) if user.op_type == "Cast" else [(user, None)]  # a float weight's Cast
                for taker, _ in takers:
                    row = {"node": taker, "op": taker.op_type, "weight": e.path,
                           "form": "float" if is_float(e.value) else "dequantize"}
                    if e.value.meta.get(FLOAT_REASON_KEY):
                        row["reason"] = e.value.meta[FLOAT_REASON_KEY]
                    rows.append(row)
    tracer.graph.meta[_REPORT_META] = rows
    if any(row.get("reason") for row in rows):  # reasons quote trace-time node names
        tracer.graph.meta[_REPORT_META + ".nodes"] = {node.name: node for node in tracer.graph if node.name}


def _final_names(text: str, nodes: dict) -> str:
    """``text`` with each quoted trace-time node name (``'/Add'``) replaced by the node's name
    in the written graph (an imported graph's nodes get their source names back)."""
    def name(match):
        node = nodes.get(match.group(1))
        return repr(node.name) if node is not None and node.name else match.group(0)

    return re.sub(r"'([^']*)'", name, text)


def write_report(model: ir.Model) -> list:
    """Move the traced graph's report into ``model.metadata_props[REPORT_KEY]`` and log its
    summary line (logger ``onnxparam.quant``, INFO); returns the rows (``[]`` without
    quantized weights). Node names (also those a ``reason`` quotes) are the written graph's."""
    nodes = model.graph.meta.get(_REPORT_META + ".nodes") or {}
    rows = []
    for row in model.graph.meta.get(_REPORT_META) or []:
        row = {**row, "node": row["node"].name if isinstance(row["node"], ir.Node) else row["node"]}
        if row.get("reason"):
            row["reason"] = _final_names(row["reason"], nodes)
        rows.append(row)
    if rows:
        model.metadata_props[REPORT_KEY] = json.dumps(rows, separators=(",", ":"))
        _LOG.info("quantized export: %s", summary(rows))
    return rows


def summary(rows: list) -> str:
    """One line: how many ops got each form (``"3 MatMul dynamic int8, 2 Conv float"``)."""
    counts: dict = {}
    for row in rows:
        key = f"{row['op']} {row['form']}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in counts.items())


def quantized_ops(model) -> list:
    """The per-op report of an exported model: rows ``{"node", "op", "weight", "form"}``.

    Args:
        model: an ``onnx.ModelProto``, an ``onnx_ir.Model``, or a ``.onnx`` path.

    Returns:
        the rows (``[]`` for a model exported without quantized weights).
    """
    if isinstance(model, ir.Model):
        props = model.metadata_props
    elif hasattr(model, "metadata_props"):
        props = {p.key: p.value for p in model.metadata_props}
    else:
        import onnx

        props = {p.key: p.value for p in onnx.load(str(model), load_external_data=False).metadata_props}
    text = props.get(REPORT_KEY)
    return json.loads(text) if text else []


# -- Gemm: dynamic int8 --------------------------------------------------------------------------


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _new_node(tracer, op: str, inputs: list, outputs: list, label: str, attrs=()) -> ir.Node:
    node = ir.Node("", op, inputs, list(attrs), num_outputs=len(outputs), name=tracer.unique_name(label))
    for out, (dtype, dims) in zip(node.outputs, outputs):
        out.name = tracer.unique_name(f"{node.name}_output_{out.index()}")
        out.type = ir.TensorType(dtype)
        out.shape = None if dims is None else ir.Shape(dims)
    return node


def _dims(value: ir.Value):
    return None if value.shape is None else [d if isinstance(d, int) else d.value for d in value.shape]


def dynamic_gemms(tracer, e) -> None:
    """``Gemm(x, DQ(W), C)`` (``transA=0``, ``alpha = beta = 1``) of an 8-bit weight with one scale
    per tensor or per output column -> ``DynamicQuantizeLinear(x) -> MatMulInteger(xq, W[^T]) ->
    Cast -> Mul (-> Add C)``, the form ORT fuses to ``DynamicQuantizeMatMul`` (``transB=1``: the
    int8 weight goes through a ``Transpose`` that ORT folds into a constant)."""
    layout = e.layout
    if layout.bits != 8 or layout.values.ndim != 2 or layout.block_size is not None:
        return
    f32, u8, i32 = ir.DataType.FLOAT, ir.DataType.UINT8, ir.DataType.INT32
    for node, index in list(e.output._symbol.value.uses()):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or index != 1:
            continue
        trans_b = _attr(node, "transB", 0) == 1
        if _attr(node, "transA", 0) != 0 or _attr(node, "alpha", 1.0) != 1.0 or _attr(node, "beta", 1.0) != 1.0:
            continue
        if layout.axis not in (None, 0 if trans_b else 1):
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x.dtype != f32:
            continue
        graph, label = node.graph, f"{node.name}/dynamic"
        n = layout.values.shape[0 if trans_b else 1]
        k = layout.values.shape[1 if trans_b else 0]
        new = []
        weight = e.value
        if trans_b:
            tr = _new_node(tracer, "Transpose", [e.value], [(e.value.dtype, [k, n])], f"{label}/Transpose",
                           [ir.AttrInt64s("perm", [1, 0])])
            new.append(tr)
            weight = tr.outputs[0]
        dql = _new_node(tracer, "DynamicQuantizeLinear", [x], [(u8, _dims(x)), (f32, []), (u8, [])],
                        f"{label}/DynamicQuantizeLinear")
        xq, xs, xz = dql.outputs
        mmi = _new_node(tracer, "MatMulInteger", [xq, weight, xz] + ([e.zero_point] if e.zero_point is not None else []),
                        [(i32, _dims(y))], f"{label}/MatMulInteger")
        cast = _new_node(tracer, "Cast", [mmi.outputs[0]], [(f32, _dims(y))], f"{label}/Cast",
                         [ir.AttrInt64("to", int(f32))])
        scale = _new_node(tracer, "Mul", [xs, e.scale], [(f32, list(layout.scale.shape))], f"{label}/Mul_scale")
        result = _new_node(tracer, "Mul", [cast.outputs[0], scale.outputs[0]], [(f32, _dims(y))], f"{label}/Mul")
        new += [dql, mmi, cast, scale, result]
        e.value.meta.setdefault("onnxparam.qdq.gemm", set()).add(id(mmi))
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            result = _new_node(tracer, "Add", [result.outputs[0], node.inputs[2]], [(f32, _dims(y))], f"{label}/Add")
            new.append(result)
        graph.insert_after(node, new)
        out = result.outputs[0]
        y.replace_all_uses_with(out, replace_graph_outputs=True)
        name = y.name
        graph.remove(node, safe=True)
        out.name = name


_GATHER_META = "onnxparam.qdq.gather"


def gather_then_dequantize(tracer, e) -> None:
    """``Gather(DQ(table), indices)`` (``axis=0``) of an 8-bit table with one scale per tensor or
    per column -> ``DequantizeLinear(Gather(table, indices))``: only the gathered rows are
    dequantized at each run, not the whole table (ONNX Runtime does not fold a
    ``DequantizeLinear`` of an initializer; ``quantize_dynamic`` writes this form). The values
    are the same elementwise products."""
    layout = e.layout
    if layout.bits != 8 or layout.block_size is not None or layout.values.ndim < 1:
        return
    if layout.axis is not None and layout.axis % layout.values.ndim == 0:
        return  # one scale per row: the gathered rows would need gathered scales
    out = e.output._symbol.value
    for node, index in list(out.uses()):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or index != 0:
            continue
        if _attr(node, "axis", 0) != 0 or out.dtype != ir.DataType.FLOAT:
            continue
        indices, y = node.inputs[1], node.outputs[0]
        if layout.axis is not None and (indices.shape is None):
            continue
        graph, label = node.graph, f"{node.name}/int8"
        gathered_dims = None if indices.shape is None else _dims(indices) + list(layout.values.shape[1:])
        gather = _new_node(tracer, "Gather", [e.value, indices], [(e.value.dtype, gathered_dims)], f"{label}/Gather",
                           [ir.AttrInt64("axis", 0)])
        attrs = []
        if layout.axis is not None:
            attrs.append(ir.AttrInt64("axis", len(indices.shape) + layout.axis % layout.values.ndim - 1))
        inputs = [gather.outputs[0], e.scale] + ([e.zero_point] if e.zero_point is not None else [])
        dq = _new_node(tracer, "DequantizeLinear", inputs, [(ir.DataType.FLOAT, _dims(y))],
                       f"{label}/DequantizeLinear", attrs)
        graph.insert_after(node, [gather, dq])
        e.value.meta.setdefault(_GATHER_META, set()).add(id(gather))
        new = dq.outputs[0]
        y.replace_all_uses_with(new, replace_graph_outputs=True)
        name = y.name
        graph.remove(node, safe=True)
        new.name = name
