"""Static activation quantization in an exported graph: where the ``QuantizeLinear ->
DequantizeLinear`` pairs go (from calibrated ranges, :func:`onnxparam.quant.quantize_activations`)
so that ONNX Runtime runs integer kernels end to end (see :mod:`onnxparam.quant._qdq`).

Placement (what ``onnxruntime.quantization.quantize_static`` writes, and what ORT 1.32's QDQ
optimizer needs to fuse; the per-value choices checked in ``tests/test_qdq_static.py``):

* the activation input and the output of every ``MatMul`` / ``Conv`` whose weight is a dequantized
  param (ORT: ``QLinearConv`` / ``QLinearMatMul``), and the inputs and output of every ``Add`` of
  two activations (``QLinearAdd``);
* an output whose only use is a ``Relu`` gets its pair after the ``Relu``: ORT drops a ``Relu``
  whose ``Q`` has zero point 0 and fuses ``Conv + Relu + Q``; a pair before it would make ORT
  requantize (``DQ -> Q``) between two integer ops;
* no pair is tied through ``MaxPool``: ORT's ``QDQPropagationTransformer`` already moves a ``Q``
  after a ``MaxPool`` above it (``MaxPool`` then runs on uint8, which ORT 1.32 does much slower
  than its float NCHWc ``MaxPool``: measured 72 ms vs 20 ms on MNIST at batch 256), and a pair after a
  ``Flatten`` keeps the ``MaxPool`` before it in float (``Flatten`` does not propagate).

* a ``BatchNormalization`` (inference, constant statistics) right after a ``Conv`` whose int8
  weight is per-tensor or per output channel is folded into that conv before the pairs go in
  (:func:`fold_batch_norms`), as ORT folds it in a float graph: the weight's ``DequantizeLinear``
  scale becomes ``scale * gamma / sqrt(var + eps)`` (per output channel, exact for the stored int8
  values) and the bias ``(b - mean) * gamma / sqrt(var + eps) + beta``, written as nodes on the
  params that ORT constant-folds at load. Otherwise a float ``BatchNormalization`` sits between
  two integer convs, with a ``DQ -> BN -> Q`` and two NHWC/NCHW ``Transpose`` s around it (and
  always below opset 13, where ``DequantizeLinear`` has no per-axis scales: a warning says so). The
  conv's output takes the ``BatchNormalization`` output's name, whose range calibration measures.

Activations are uint8, asymmetric, MinMax ranges widened to include 0 (ORT's defaults). The
weights of those ops are written as uint8 codes with zero point 128 once the pairs are in
(:func:`onnxparam.quant._qdq_forms.unsigned_for_integer_kernels`: ORT's uint8 x int8 kernels
saturate on x86 CPUs without VNNI).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

QUANTIZED_OPS = ("MatMul", "Conv")

MIN_PER_AXIS_OPSET = 13
"""``DequantizeLinear`` takes per-axis scales (its ``axis`` attribute) from this ``ai.onnx`` opset
(ONNX operator spec, DequantizeLinear-13); below it no ``BatchNormalization`` is folded."""
def node(tracer, graph, op: str, inputs: list, outputs: list, label: str, attrs=None, domain: str = "") -> ir.Node:
    """A new node named uniquely from ``label``, outputs typed ``[(dtype, dims)]`` (not inserted)."""
    name = tracer.unique_name(label)
    new = ir.Node(domain, op, inputs, [ir.AttrInt64(k, int(v)) for k, v in (attrs or {}).items()],
                  num_outputs=len(outputs), name=name)
    for out, (dtype, dims) in zip(new.outputs, outputs):
        out.name = tracer.unique_name(f"{name}_output_{out.index()}")
        out.type = ir.TensorType(dtype)
        out.shape = None if dims is None else ir.Shape(dims)
    return new


def dims(value: ir.Value):
    """``value``'s dims as ints / symbol names, or ``None`` when its shape is unknown."""
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def _is_float(value) -> bool:
    return value is not None and value.dtype == ir.DataType.FLOAT


def _standard(n: ir.Node) -> bool:
    return n.domain in ("", "ai.onnx")


def _past_relu(value: ir.Value) -> ir.Value:
    """The output of the ``Relu`` that is ``value``'s only use, else ``value`` (module docstring)."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return value
    user, _ = uses[0]
    if user.op_type != "Relu" or not _standard(user) or not _is_float(user.outputs[0]):
        return value
    return user.outputs[0]


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def activation_sites(graph: ir.Graph, emitted_outputs: set) -> list:
    """Value names to put a pair on (module docstring), in graph order of discovery."""
    names: list = []

    def add(v):
        if _is_float(v) and v.name not in names:
            names.append(v.name)

    for n in graph:
        if n.op_type not in QUANTIZED_OPS or not _standard(n) or len(n.inputs) < 2:
            continue
        if id(n.inputs[1]) in emitted_outputs:
            add(n.inputs[0])
            bn = _foldable_batch_norm(n)
            add(_past_relu(bn.outputs[0] if bn is not None else n.outputs[0]))
    if names:
        # NOTE: residual adds of two activations too (ORT fuses DQ, DQ -> Add -> Q into QLinearAdd,
        # as onnxruntime.quantization.quantize_static's QDQ output does); bias adds are left float
        for n in graph:
            if n.op_type != "Add" or not _standard(n) or len(n.inputs) != 2:
                continue
            values = (n.inputs[0], n.inputs[1], n.outputs[0])
            if any(not _is_float(v) or _is_constant(v) for v in values):
                continue
            for v in values[:2] + (_past_relu(values[2]),):
                add(v)
    return names


def uint8_qparams(lo: float, hi: float) -> tuple:
    """Asymmetric uint8 ``(scale, zero_point)`` covering ``[min(lo, 0), max(hi, 0)]`` (ORT's
    calibrated activations: zero must be exact)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = np.float32((hi - lo) / 255.0) if hi > lo else np.float32(1.0)
    zero = int(np.clip(np.round(-lo / float(scale)), 0, 255))
    return scale, np.uint8(zero)


def insert_activation_qdq(tracer, ranges: dict, emitted_outputs: set) -> None:
    """Put a ``QuantizeLinear -> DequantizeLinear`` pair on every site with a calibrated range
    (``ranges``: ``{value name: (min, max)}``)."""
    graph = tracer.graph
    by_name = {}
    for n in graph:
        for out in n.outputs:
            by_name[out.name] = out
    for v in graph.inputs:
        by_name[v.name] = v
    for name in activation_sites(graph, emitted_outputs):
        value = by_name.get(name)
        if value is None or name not in ranges:
            continue
        scale, zero = uint8_qparams(*ranges[name])
        s = tracer.constant(np.asarray(scale, np.float32), name=f"{name}_scale")._symbol.value
        z = tracer.constant(np.asarray(zero, np.uint8), name=f"{name}_zero_point")._symbol.value
        uses = list(value.uses())
        shape = dims(value)
        q = node(tracer, graph, "QuantizeLinear", [value, s, z], [(ir.DataType.UINT8, shape)], f"{name}/QuantizeLinear")
        dq = node(tracer, graph, "DequantizeLinear", [q.outputs[0], s, z], [(ir.DataType.FLOAT, shape)],
                  f"{name}/DequantizeLinear")
        producer = value.producer()
        if producer is None:
            graph.insert_before(next(iter(graph)), [q, dq])
        else:
            graph.insert_after(producer, [q, dq])
        for user, index in uses:
            user.replace_input_with(index, dq.outputs[0])
        if value.is_graph_output():
            for i, out in enumerate(graph.outputs):
                if out is value:
                    graph.outputs[i] = dq.outputs[0]
                    value.name, dq.outputs[0].name = dq.outputs[0].name, value.name


# -- BatchNormalization folded into a Conv ---------------------------------------------------------


def _constant_input(value) -> bool:
    """A value no node computes: an initializer (param or constant)."""
    return value is not None and value.producer() is None and not value.is_graph_input()


def _foldable_weight(conv: ir.Node) -> bool:
    """``conv``'s weight is an int8 ``DequantizeLinear`` (no zero point or zeros, per-tensor or axis-0
    scale) used by ``conv`` alone: its scale can take a per-output-channel factor."""
    weight = conv.inputs[1]
    dq = weight.producer() if weight is not None else None
    if dq is None or dq.op_type != "DequantizeLinear" or not _standard(dq) or len(list(weight.uses())) != 1:
        return False
    if dq.inputs[0].dtype != ir.DataType.INT8 or (len(dq.inputs) > 2 and not _zero_or_none(dq.inputs[2])):
        return False
    if not _is_float(weight) or dq.attributes.get("block_size") is not None or dq.inputs[1].shape is None:
        return False
    axis = dq.attributes.get("axis")
    return len(dq.inputs[1].shape) == 0 or (len(dq.inputs[1].shape) == 1 and (axis is None or axis.value == 0))


def _zero_or_none(zero_point) -> bool:
    """No zero point, or constant zeros (what ``_qdq.explicit_zero_points`` writes for int8
    codes once the graph is finished; calibration reads the finished graph)."""
    if zero_point is None:
        return True
    const = zero_point.const_value
    return const is not None and not np.any(const.numpy())


def _foldable_batch_norm(conv: ir.Node):
    """The inference ``BatchNormalization`` that is the only use of ``conv``'s output, with
    constant statistics, when ``conv``'s weight can take it (:func:`_foldable_weight`), else ``None``."""
    if conv.op_type != "Conv" or not _is_float(conv.outputs[0]) or conv.outputs[0].is_graph_output():
        return None
    if len(conv.inputs) < 2 or not _foldable_weight(conv):
        return None
    uses = list(conv.outputs[0].uses())
    if len(uses) != 1:
        return None
    bn, index = uses[0]
    if bn.op_type != "BatchNormalization" or not _standard(bn) or index != 0 or len(bn.outputs) != 1:
        return None
    mode = bn.attributes.get("training_mode")
    if mode is not None and mode.value != 0:
        return None
    if len(bn.inputs) != 5 or not all(_is_float(v) and _constant_input(v) for v in bn.inputs[1:]):
        return None
    return bn


def fold_batch_norms(tracer, emitted: list) -> None:
    """Fold each foldable ``BatchNormalization`` into the ``Conv`` before it (module docstring),
    when the conv's weight is one of ``emitted``'s int8 ``DequantizeLinear`` s with a per-tensor or
    axis-0 scale, no zero point, used by that conv alone (:func:`_foldable_batch_norm`). Formula: the ONNX operator spec of
    ``BatchNormalization`` (``y = (x - mean) / sqrt(var + eps) * scale + B``) applied to the
    conv's output channels."""
    by_output = {id(e.output._symbol.value): e for e in emitted}
    graph = tracer.graph
    unfolded = []
    for conv in list(graph):
        if conv.op_type != "Conv" or not _standard(conv) or len(conv.inputs) < 2:
            continue
        e = by_output.get(id(conv.inputs[1]))
        bn = _foldable_batch_norm(conv)
        if e is not None and bn is not None and e.node is conv.inputs[1].producer():
            if tracer.opset < MIN_PER_AXIS_OPSET:
                unfolded.append(bn.name or conv.name)
                continue
            _fold(tracer, graph, conv, bn, e)
    if unfolded:
        import warnings

        from ..core.errors import QuantizationWarning

        shown = ", ".join(unfolded[:4]) + (f" and {len(unfolded) - 4} more" if len(unfolded) > 4 else "")
        warnings.warn(
            f"{len(unfolded)} BatchNormalization node(s) ({shown}) stay float after their int8 Conv: folding one "
            f"into the conv's int8 weight needs a per-channel DequantizeLinear (axis attribute, opset "
            f"{MIN_PER_AXIS_OPSET}), the model's opset is {tracer.opset}; convert the model to opset "
            f"{MIN_PER_AXIS_OPSET} or later to fold them", QuantizationWarning, stacklevel=2)


def _fold(tracer, graph, conv: ir.Node, bn: ir.Node, e) -> None:
    f32 = ir.DataType.FLOAT
    channels = conv.inputs[1].shape[0] if conv.inputs[1].shape is not None else None
    c = [channels] if isinstance(channels, int) else None
    label = f"{bn.name}/folded"
    _, gamma, beta, mean, var = bn.inputs
    eps = bn.attributes.get("epsilon")
    eps = tracer.constant(np.asarray(1e-5 if eps is None else eps.value, np.float32), name=f"{bn.name}_epsilon")
    new = []

    def op(kind, inputs, suffix):
        n = node(tracer, graph, kind, inputs, [(f32, c)], f"{label}/{suffix}")
        new.append(n)
        return n.outputs[0]

    std = op("Sqrt", [op("Add", [var, eps._symbol.value], "var_eps")], "std")
    factor = op("Div", [gamma, std], "factor")
    scale = op("Mul", [e.node.inputs[1], factor], "weight_scale")
    shift = op("Neg", [mean], "neg_mean") if len(conv.inputs) < 3 or conv.inputs[2] is None else \
        op("Sub", [conv.inputs[2], mean], "bias_minus_mean")
    bias = op("Add", [op("Mul", [shift, factor], "scaled_bias"), beta], "bias")
    graph.insert_before(e.node, new)
    e.node.replace_input_with(1, scale)
    e.node.attributes["axis"] = ir.AttrInt64("axis", 0)
    if len(conv.inputs) >= 3:
        conv.replace_input_with(2, bias)
    else:
        conv.resize_inputs(3)
        conv.replace_input_with(2, bias)
    y, out = bn.outputs[0], conv.outputs[0]
    name = y.name
    y.replace_all_uses_with(out, replace_graph_outputs=True)
    graph.remove(bn, safe=True)
    out.name = name
