"""Small readers of ``onnx_ir`` values and nodes shared by the LoRA graph passes
(:mod:`onnxparam.lora._graph`, :mod:`onnxparam.lora._batched`, :mod:`onnxparam.lora._batch_axis`,
:mod:`onnxparam.lora._batch_index`)."""

from __future__ import annotations

import ast
from typing import Optional

import onnx_ir as ir


def dims(value: Optional[ir.Value]) -> Optional[list]:
    """``value``'s dims: ints for static dims, the symbol's name (``str``) or ``None`` for the
    others; ``None`` when its shape (or the value) is unknown."""
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def rank(value: Optional[ir.Value]) -> Optional[int]:
    """``value``'s rank, ``None`` when its shape is unknown."""
    found = dims(value)
    return None if found is None else len(found)


def attr(node: ir.Node, name: str, default=None):
    """The value of ``node``'s attribute ``name``, ``default`` when the node does not set it."""
    found = node.attributes.get(name)
    return default if found is None else found.value


def dynamo_scope(node: ir.Node) -> Optional[str]:
    """The PyTorch module path a node was written for, from torch's dynamo exporter's
    ``pkg.torch.onnx.name_scopes`` metadata (the scope before the op's own: ``['', 'fc1',
    'linear']`` -> ``"fc1"``); ``None`` without that metadata, for malformed metadata or for the
    root module."""
    raw = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not raw:
        return None
    try:
        scopes = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    if isinstance(scopes, list) and len(scopes) >= 2 and all(isinstance(s, str) for s in scopes):
        return scopes[-2] or None
    return None
