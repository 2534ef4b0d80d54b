"""Naming the imported file in errors raised while an imported model is called or exported.

An :class:`~onnxparam.onnx_io.OnnxModule` knows the file it was imported from; an error raised
while it runs (ONNX Runtime's, a trace's, a wrong argument) names that file, so a user with
several models can tell which one failed:

* :func:`naming_source` wraps a call or an export of the module itself: a library error, a
  ``TypeError`` or a ``ValueError`` that does not name the source yet gets it as a prefix (same exception object,
  same type, same traceback).
* When the module is traced inside another module's ``forward``, its nodes run in the enclosing
  module's session; :func:`record_scope` remembers, per traced graph, the node-name scope
  (``/encoder``) the imported graph was inlined under, and :func:`imported_source` maps a failing
  node's name back to the file (used by ``runtime._sessions.execution_error``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional

from ..core.errors import OnnxParamError

__all__ = ["source_label", "naming_source", "record_scope", "imported_source"]

_SCOPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""traced ``onnx_ir.Graph`` -> {node-name scope: source label} of the imported graphs inlined."""


def source_label(module) -> str:
    """The imported file's path (``str``), or the in-memory source's label (``<onnx.ModelProto>``)."""
    loaded = module._source.loaded
    return str(loaded.path) if loaded.path is not None else loaded.source


def _name_in(error: BaseException, label: str) -> None:
    """Prefix ``error``'s message with ``label`` unless it names it already (in place)."""
    if isinstance(error, OSError) or not error.args or not isinstance(error.args[0], str):
        return  # OSError's text is built from errno / filename, not args[0]
    if label in str(error):
        return
    error.args = (f"{label}: {error.args[0]}",) + error.args[1:]


@contextlib.contextmanager
def naming_source(module) -> Iterator[None]:
    """Re-raise library errors, ``TypeError`` s and ``ValueError`` s (wrong arguments) raised inside
    with the module's source named."""
    try:
        yield
    except (OnnxParamError, TypeError, ValueError) as e:
        _name_in(e, f"the model imported from {source_label(module)!r}"
                 if module._source.loaded.path is not None else f"the imported model {source_label(module)}")
        raise


def record_scope(tracer, module) -> None:
    """Remember that ``module``'s graph is being inlined into ``tracer``'s graph under its scope."""
    try:
        _SCOPES.setdefault(tracer.graph, {})[tracer.module_scope(module)] = source_label(module)
    except TypeError:  # pragma: no cover - a graph type without weak references
        pass


def imported_source(graph, node_name: str) -> Optional[str]:
    """The source label of the imported graph whose inlined node is ``node_name`` in ``graph``
    (the deepest scope that prefixes the name), or ``None``."""
    scopes = _SCOPES.get(graph)
    if not scopes or not node_name:
        return None
    best = None
    for scope, label in scopes.items():
        if node_name.startswith(scope + "/") and (best is None or len(scope) > len(best[0])):
            best = (scope, label)
    return None if best is None else best[1]
