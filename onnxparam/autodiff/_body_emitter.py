"""The emitter of a subgraph's nodes (a body of ``If`` / ``Loop`` / ``Scan`` built by a rule)."""

from __future__ import annotations

import onnx_ir as ir

from ._emitter import Emitter

__all__ = ["BodyEmitter", "child_emitter"]


class BodyEmitter(Emitter):
    """An :class:`Emitter` that appends nodes to a subgraph (``graph``) while its constants go to
    the outermost graph (``root``'s) and its names stay unique across the whole model."""

    def __init__(self, root: Emitter, graph: ir.Graph):  # noqa: D107 - no super().__init__: shares root's state
        self.graph = graph
        self.opset = root.opset
        self._names = root._names
        self._consts = root._consts
        self._root = root

    def const(self, value, dtype) -> ir.Value:
        return self._root.const(value, dtype)


def child_emitter(e: Emitter, graph: ir.Graph) -> Emitter:
    """An emitter for ``graph`` (a subgraph) sharing ``e``'s constants and names."""
    return BodyEmitter(getattr(e, "_root", e), graph)
