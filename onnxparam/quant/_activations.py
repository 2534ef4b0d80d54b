"""Static activation quantization: calibrating activation ranges by running the traced module in
ONNX Runtime (runtime layer; the graph rewrite is :mod:`onnxparam.quant._qdq`'s)."""

from __future__ import annotations

import math

import numpy as np

from ..dtype import DType
from ..errors import QuantizationError
from ._qdq_options import _QDQ_META, ACTIVATION_RANGES_ATTR, qdq_options
from ._qdq_static import activation_sites as _activation_sites


def quantize_activations(module, calibration_inputs, *, batch_size: int | None = None, progress=None):
    """A copy of ``module`` that carries activation ranges measured on ``calibration_inputs``, so
    its traced graphs (``module(x)`` and export) get static ``QuantizeLinear -> DequantizeLinear``
    pairs around every ``MatMul`` / ``Conv`` with a quantized weight (module docstring).

    Quantize the weights first (:meth:`~onnxparam.Module.quantize_weights`); activations of ops
    whose weight is float are left alone.

    Args:
        module: a module with quantized weights.
        calibration_inputs: an array (or a sequence of arrays, one per forward argument) holding
            representative inputs, batch first; run in batches of ``batch_size`` (all at once
            when ``None``).
        batch_size: calibration batch size.
        progress: called as ``progress(done, total)`` (samples) after each batch, or ``None``.

    Returns:
        the module copy (ranges in the private attribute :data:`ACTIVATION_RANGES_ATTR`).

    Raises:
        QuantizationError: when the module has no quantized weight feeding a MatMul / Conv.
    """
    import onnx

    from .._ort import import_onnxruntime
    from .._trace import InputSpec, trace_module
    from ..module import rebuild

    ort = import_onnxruntime()
    args = list(calibration_inputs) if isinstance(calibration_inputs, (list, tuple)) else [calibration_inputs]
    args = [np.asarray(a) for a in args]
    plain = rebuild(module, lambda p, param: param,
                    lambda path, m: m.__dict__.pop(ACTIVATION_RANGES_ATTR, None) if path == "" else None)
    source = getattr(plain, "_source", None)
    # NOTE: an imported graph's export keeps its own input names; calibrate under the same ones
    names = [v.name for v in source.inputs] if source is not None and hasattr(source, "inputs") else None
    with qdq_options(matmul="dequantize", prefer="size"):
        traced = trace_module(plain, tuple(InputSpec(("batch",) + a.shape[1:], DType.from_numpy(a.dtype))
                                           for a in args), input_names=names)
    emitted = {id(v.meta[_QDQ_META].output._symbol.value) for v in traced.graph.initializers.values()
               if _QDQ_META in v.meta}
    sites = _activation_sites(traced.graph, emitted)
    if not sites:
        raise QuantizationError("no MatMul / Conv with a quantized weight to calibrate: quantize the weights first "
                                "(module.quantize_weights(Quantizer(...)))")
    proto = traced.to_proto()
    proto.graph.ClearField("value_info")
    known = {o.name for o in proto.graph.output}
    for name in sites:
        if name not in known:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in session.get_outputs()]
    lo = {n: math.inf for n in sites}
    hi = {n: -math.inf for n in sites}
    n = len(args[0])
    step = n if batch_size is None else int(batch_size)
    for start in range(0, n, step):
        feed = {name: a[start:start + step] for name, a in zip(traced.input_names, args)}
        for name, result in zip(out_names, session.run(out_names, feed)):
            if name in lo and result.size:
                lo[name] = min(lo[name], float(np.min(result)))
                hi[name] = max(hi[name], float(np.max(result)))
        if progress is not None:
            progress(min(start + step, n), n)
    ranges = tuple((name, lo[name], hi[name]) for name in sites if math.isfinite(lo[name]))

    def set_ranges(path, m):
        if path == "":
            object.__setattr__(m, ACTIVATION_RANGES_ATTR, ranges)

    return rebuild(module, lambda p, param: param, set_ranges)
