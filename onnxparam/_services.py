"""Services an upper layer provides to a lower one: registration instead of upward imports.

A lower-layer file that needs code of a higher layer at run time (``Tensor.__add__`` needs
:mod:`onnxparam.ops`, ``Module.__call__`` needs :mod:`onnxparam.runtime`) asks for it by service
name with :func:`service`; the package ``__init__`` (which may import every layer) registers each
name with :func:`provide` as a ``"module:attribute"`` target. The target is imported on first use,
so registering costs nothing at ``import onnxparam`` (the same pattern as
:data:`onnxparam.param.value_hook`, which the tracer sets to answer a param's value).
"""

from __future__ import annotations

import importlib

__all__ = ["provide", "service"]

_TARGETS: dict = {}
_RESOLVED: dict = {}


def provide(name: str, target) -> None:
    """Register ``target`` as service ``name``: an object, or ``"package.module:attribute"``
    (``"package.module"`` for a whole module), imported on the first :func:`service` call."""
    _TARGETS[name] = target
    _RESOLVED.pop(name, None)


def service(name: str):
    """The object registered as ``name`` (imported on first use).

    Raises:
        LookupError: when no layer registered ``name`` (``onnxparam`` was not imported as a package).
    """
    try:
        return _RESOLVED[name]
    except KeyError:
        pass
    try:
        target = _TARGETS[name]
    except KeyError:
        raise LookupError(f"no onnxparam service {name!r} is registered (import onnxparam first)") from None
    if isinstance(target, str):
        module_name, _, attribute = target.partition(":")
        target = importlib.import_module(module_name)
        if attribute:
            target = getattr(target, attribute)
    _RESOLVED[name] = target
    return target
