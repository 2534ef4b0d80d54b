"""Static activation quantization: calibrating activation ranges by running the traced module in
ONNX Runtime (the graph rewrite is :mod:`onnxparam.quant._qdq`'s)."""

from __future__ import annotations

import math

import numpy as np

from ..core.dtype import DType
from ..core.errors import QuantizationError
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
        QuantizationError: when the module has no quantized weight feeding a MatMul / Conv (naming
            the ops its quantized weights feed, e.g. ``Gemm``, which static int8 does not cover),
            when ``batch_size`` is not a positive integer, when a calibration input holds no
            samples or a NaN / infinite value (naming the input and the first such index), or when
            an activation's observed range is not finite (naming the activation).
        ExecutionError: when ONNX Runtime fails on a calibration batch (naming the samples).
    """
    import onnx

    from ..core.module import rebuild
    from ..runtime._ort import import_onnxruntime
    from ..trace.tracer import InputSpec
    from ._passes import trace_module

    ort = import_onnxruntime()
    args = list(calibration_inputs) if isinstance(calibration_inputs, (list, tuple)) else [calibration_inputs]
    # NOTE: ONNX Runtime reads an array's bytes in native order: a big-endian one becomes a native copy
    args = [a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("=")) for a in map(np.asarray, args)]
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size <= 0):
        raise QuantizationError(f"batch_size must be a positive integer or None, got {batch_size!r}")
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
        raise QuantizationError(_no_sites(traced.graph, emitted))
    for name, a in zip(traced.input_names, args):
        check_calibration_input(a, f"calibration input '{name}'")
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
        try:
            results = session.run(out_names, feed)
        except Exception as e:  # noqa: BLE001 - ORT's errors have no common public base class
            from ..runtime._sessions import execution_error

            samples = f"{start}..{min(start + step, n) - 1}"
            error = execution_error(e, traced, "the module",
                                    f"run calibration samples {samples} (batch size {step}) through")
            raise type(error)(f"{error}; a model that takes one sample at a time needs batch_size=1") from None
        for name, result in zip(out_names, results):
            if name in lo and result.size:
                _check_observed(result, name, start, start + len(feed[traced.input_names[0]]))
                lo[name] = min(lo[name], float(np.min(result)))
                hi[name] = max(hi[name], float(np.max(result)))
        if progress is not None:
            progress(min(start + step, n), n)
    ranges = tuple((name, lo[name], hi[name]) for name in sites if math.isfinite(lo[name]))

    def set_ranges(path, m):
        if path == "":
            object.__setattr__(m, ACTIVATION_RANGES_ATTR, ranges)

    return rebuild(module, lambda p, param: param, set_ranges)


def _no_sites(graph, emitted: set) -> str:
    """Why calibration has nothing to measure: no quantized weight at all, or the ops its
    quantized weights feed (counted by op type), none of which static int8 covers."""
    fed: dict = {}
    for n in graph:
        if any(v is not None and id(v) in emitted for v in n.inputs):
            fed[n.op_type] = fed.get(n.op_type, 0) + 1
    if not emitted:
        return ("no MatMul / Conv with a quantized weight to calibrate: the module has no quantized weight; "
                "quantize the weights first (module.quantize_weights(Quantizer(...)))")
    if not fed:
        return ("no MatMul / Conv with a quantized weight to calibrate: no op of the traced graph takes a quantized "
                "weight through a DequantizeLinear (4-bit weights are written in other forms)")
    found = ", ".join(f"{k} {op}" for op, k in fed.items())
    return (f"no MatMul / Conv with a quantized weight to calibrate: the quantized weights feed {found}; "
            "static int8 calibration covers MatMul and Conv only")


def check_calibration_input(array: np.ndarray, what: str) -> None:
    """Refuse a calibration array with no samples (batch axis of length 0) or a NaN / infinite value.

    Raises:
        QuantizationError: naming ``what``, the shape or the first bad index and how many there are.
    """
    if array.ndim == 0 or len(array) == 0:
        raise QuantizationError(f"{what} holds no samples (shape {list(array.shape)}); calibration needs at least "
                                "one sample along the first (batch) axis")
    if array.dtype.kind in "fc":
        bad = ~np.isfinite(array)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise QuantizationError(
                f"{what} holds {int(bad.sum())} non-finite value(s) (NaN or infinite), the first at index {first} "
                f"({array[first]}); calibration ranges need finite inputs")


def _check_observed(result: np.ndarray, name: str, start: int, stop: int) -> None:
    if np.issubdtype(result.dtype, np.floating) and not np.isfinite(result).all():
        raise QuantizationError(
            f"activation '{name}' took a non-finite value (NaN or infinite) on calibration samples "
            f"{start}..{stop - 1}; its quantization range would not be finite")
