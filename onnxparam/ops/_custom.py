"""Any ONNX node (:func:`custom`) and subgraphs for graph attributes (:func:`subgraph`)."""

from __future__ import annotations

import numpy as np

from ..core.dtype import DType
from ..core.tensor import Tensor
from ..trace import tracer as _trace
from ._core import _is_scalar, _op, _tracer

__all__ = ["custom", "subgraph"]

subgraph = _trace.subgraph

def _custom_input(x):
    if x is None or isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return x
    if _is_scalar(x):
        kind = np.float32 if isinstance(x, (float, np.floating)) else np.bool_ if isinstance(x, (bool, np.bool_)) \
            else np.int64
        return np.asarray(x, dtype=kind)
    raise TypeError(f"custom: inputs are Tensors, arrays, scalars or None; got {type(x).__name__}")


@_op
def custom(op_type: str, *inputs, domain: str = "", num_outputs: int = 1, output_dtypes=None,
           output_shapes=None, **attributes):
    """Any ONNX node: ``op_type`` in ``domain`` with ``inputs`` and ``attributes``.

    Args:
        op_type: the operator name (``"Resize"``, ``"If"``, ``"LabelEncoder"``).
        inputs: tensors, arrays / scalars (as constants; Python floats as float32, ints as
            int64), or ``None`` for a missing optional input.
        domain: ``""`` (``ai.onnx``), ``"ai.onnx.ml"``, ``"com.microsoft"`` ... ; a new domain
            is imported at the version the module declares (``onnx_opset_imports``) or a default.
        num_outputs: the number of outputs; one returns a Tensor, more a tuple.
        output_dtypes, output_shapes: the outputs' dtypes and shapes (dims int / str / None;
            an entry may be ``None``), needed for operators ONNX has no schema for and for
            outputs ONNX's inference leaves untyped (``Loop`` state); given ones override it.
        attributes: the node attributes: ints, floats, strings, lists of them, ``DType`` s
            (element types), arrays / tensors, ``onnx_ir.Graph`` s (graph attributes, e.g.
            from :func:`subgraph`; they may use tensors of the enclosing trace as outer-scope
            values), ``onnx_ir.Attr`` s (also reference attributes), onnx protos.

    ONNX: ``op_type`` itself.

    Raises:
        TraceError: when the output types cannot be inferred and were not given, or ONNX shape
            inference rejects the node.
    """
    tracer = _tracer()
    ins = [_custom_input(x) for x in inputs]
    hints = None
    if output_dtypes is not None or output_shapes is not None:
        for given, what in ((output_dtypes, "output_dtypes"), (output_shapes, "output_shapes")):
            if given is not None and len(given) != num_outputs:
                raise ValueError(f"custom {op_type}: {what} has {len(given)} entries for {num_outputs} outputs")
        dtypes = [None] * num_outputs if output_dtypes is None else [
            None if d is None else DType.from_onnx(d) if isinstance(d, int) else DType(d) for d in output_dtypes]
        shapes = [None] * num_outputs if output_shapes is None else [
            None if s is None else tuple(s) for s in output_shapes]
        hints = list(zip(dtypes, shapes))
    outs = tracer.emit(op_type, ins, attributes, domain=domain, num_outputs=num_outputs, output_hints=hints)
    return outs[0] if num_outputs == 1 else tuple(outs)
