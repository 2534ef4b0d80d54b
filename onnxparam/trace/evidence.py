"""Graph evidence shared by the passes that ask how an ONNX graph uses a tensor: which values
hold a weight's data (:func:`stored_tensor`) and which depend on the model inputs' values
(:class:`DataDependence`). LoRA's layouts and default targets, PEFT's names (``lora/``),
quantization's weight roles (``quant/``) and the importer (``onnx_io/``) all read these, so
they agree on what a weight is and how it is used.

Whether a value depends on the **values** of the model's inputs tells an embedding lookup from
a table read by position: a ``Gather`` whose ``indices`` depend on a graph input's values (token ids) reads an
embedding table; one whose indices are computed from shapes only (``Range(0, Shape(x)[1])``,
GPT-2's position ids made in the graph) or from constants reads a table by position.
Quantization (:func:`onnxparam.quant._roles.graph_roles`) and LoRA's default targets
(:func:`onnxparam.lora._tables.position_tables`) both ask :class:`DataDependence`.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["DataDependence", "SHAPE_ONLY_OPS", "stored_tensor"]

SHAPE_ONLY_OPS = ("Shape", "Size")
"""Ops whose output depends on their input's shape only (a graph input reached only through
them does not make a value data-dependent)."""


class DataDependence:
    """``depends(value)``: True when ``value`` depends on the values of a (non-initializer) input
    of ``graph``, memoized over the graph. A value made in a subgraph from the subgraph's own
    inputs (a ``Loop`` counter) counts as not depending on the model's inputs."""

    def __init__(self, graph: ir.Graph):
        self.inputs = {id(v) for v in graph.inputs if not v.is_initializer()}
        self.memo: dict = {}

    def __call__(self, value: "ir.Value | None") -> bool:
        if value is None:
            return False
        stack = [(value, False)]
        while stack:  # NOTE: iterative: graphs thousands of nodes deep
            v, expanded = stack.pop()
            if id(v) in self.memo:
                continue
            node = v.producer()
            if id(v) in self.inputs or node is None or node.op_type in SHAPE_ONLY_OPS:
                self.memo[id(v)] = id(v) in self.inputs
                continue
            inputs = [i for i in node.inputs if i is not None]
            if expanded:
                self.memo[id(v)] = any(self.memo.get(id(i), False) for i in inputs)
            else:
                stack.append((v, True))
                stack.extend((i, False) for i in inputs if id(i) not in self.memo)
        return self.memo[id(value)]


def stored_tensor(value: "ir.Value | None") -> "ir.TensorProtocol | None":
    """The tensor ``value`` holds when it is a weight candidate (:mod:`onnxparam.onnx_io._weights`): an
    initializer's data, or the ``value`` tensor attribute of the ``Constant`` node producing it
    (Paddle's exports: every weight is a ``Constant`` output, no initializer at all); ``None``
    for anything else (an activation, a graph input without data, a ``Constant`` with
    ``value_float`` / ``value_ints`` / ... or an attribute reference).

    Every pass that asks the graph how a weight is used (LoRA layouts, PEFT's names, the
    quantization roles) must find both kinds through this one test: ``value.is_initializer()``
    alone misses ``Constant`` weights."""
    if value is None:
        return None
    if value.is_initializer() and value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if (producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx")
            or len(producer.outputs) != 1):
        return None
    attr = producer.attributes.get("value")
    if attr is None or attr.is_ref() or attr.type != ir.AttributeType.TENSOR:
        return None
    return attr.value
