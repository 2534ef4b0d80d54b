"""``Module``: a tree of sub-modules and params, with one traversal and value semantics.

A ``Module`` subclass declares its children as attributes in ``__init__``: sub-modules, params,
and lists / tuples / dicts of them (``None`` allowed; other attributes are configuration).
Attributes whose name starts with ``_`` are private and never traversed.

**The one traversal.** :func:`named_params` yields ``(path, param)`` depth-first, children in
attribute-definition order, list/tuple items by index, dict items in insertion order. The
dotted path (``conv1.conv.weight``, ``layers.0.bias``, ``fc.weight.lora.a``) is the one key
everywhere: record names, burnpack tensor names, ONNX initializer names, error messages.
A LoRA adapter's factors follow their base as ``<path>.lora.a`` and ``<path>.lora.b`` (Burn's
reparameterization naming). A param object reachable from two places (tied weights) is yielded
once, at its first path. Groups, freezing, LoRA, quantization, records, ONNX naming and
``num_params`` all use this traversal.

**Value semantics** (as Burn's): a transforming method returns a new module and leaves the
receiver as it was. Structure is copied; tensor storage is shared and never mutated in place.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator, Optional

from . import extension
from .device import Device
from .param import Param
from .verbs import ModuleVerbs

__all__ = ["Module", "ModuleVisitor", "ModuleMapper", "named_params", "named_modules", "rebuild"]


class ModuleVisitor:
    """Visits params (Burn's ``ModuleVisitor``). Override what you need."""

    def enter_module(self, path: str, module: "Module") -> None:
        """Called before a module's children; ``path`` is ``""`` for the root."""

    def exit_module(self, path: str, module: "Module") -> None:
        """Called after a module's children."""

    def visit(self, path: str, param: Param) -> None:
        """Called for each param in traversal order."""


class ModuleMapper:
    """Maps params to new params (Burn's ``ModuleMapper``)."""

    def map(self, path: str, param: Param) -> Param:
        return param


def _join(prefix: str, name) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _children(node) -> list:
    """The ``(name, child)`` pairs of a traversable node, in traversal order."""
    if isinstance(node, Module):
        return [(k, v) for k, v in vars(node).items() if not k.startswith("_")]
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    if isinstance(node, dict):
        return [(k, v) for k, v in node.items()]
    return []


def _is_node(value) -> bool:
    return isinstance(value, (Module, Param)) or (
        isinstance(value, (list, tuple, dict)) and any(_is_node(v) for _, v in _children(value))
    )


def _walk(node, path: str, seen: set, visitor: Optional[ModuleVisitor]) -> Iterator[tuple]:
    if isinstance(node, Param):
        if id(node) in seen:
            return
        seen.add(id(node))
        yield path, node
        adapter = node.adapter()
        if adapter is not None:
            yield _join(path, "lora.a"), adapter.a
            yield _join(path, "lora.b"), adapter.b
        return
    if isinstance(node, Module) and visitor is not None:
        visitor.enter_module(path, node)
    for name, child in _children(node):
        if _is_node(child):
            yield from _walk(child, _join(path, name), seen, visitor)
    if isinstance(node, Module) and visitor is not None:
        visitor.exit_module(path, node)


def named_params(module: "Module", prefix: str = "") -> Iterator[tuple[str, Param]]:
    """``(path, param)`` for every param of ``module``, in traversal order (module docstring)."""
    return _walk(module, prefix, set(), None)


def named_modules(module: "Module", prefix: str = "") -> Iterator[tuple[str, "Module"]]:
    """``(path, module)`` for ``module`` (path ``""``) and every sub-module, depth-first."""
    seen: set = set()

    def walk(node, path):
        if isinstance(node, Module):
            if id(node) in seen:
                return
            seen.add(id(node))
            yield path, node
        for name, child in _children(node):
            if isinstance(child, (Module, list, tuple, dict)):
                yield from walk(child, _join(path, name))

    return walk(module, prefix)


def rebuild(module: "Module", fn: Callable[[str, Param], Param], module_fn: Optional[Callable] = None) -> "Module":
    """A structural copy of ``module`` whose params are ``fn(path, param)``.

    ``fn`` is called once per param object, in traversal order (tied params stay tied), and on
    adapter factors at their ``.lora.a`` / ``.lora.b`` paths. ``module_fn(path, copy)`` may
    adjust each copied module (for flags such as training mode). The receiver is not changed.
    """
    memo: dict = {}

    def map_param(param: Param, path: str) -> Param:
        key = id(param)
        if key in memo:
            return memo[key]
        new = fn(path, param)
        adapter = new.adapter()
        if adapter is not None:
            a = map_param(adapter.a, _join(path, "lora.a"))
            b = map_param(adapter.b, _join(path, "lora.b"))
            if a is not adapter.a or b is not adapter.b:
                new = new.with_adapter(adapter.with_factors(a, b))
        memo[key] = new
        return new

    def copy_node(node, path: str):
        if isinstance(node, Param):
            return map_param(node, path)
        if isinstance(node, Module):
            key = id(node)
            if key in memo:
                return memo[key]
            new = copy.copy(node)
            memo[key] = new
            for name, child in _children(node):
                if _is_node(child):
                    object.__setattr__(new, name, copy_node(child, _join(path, name)))
            if module_fn is not None:
                module_fn(path, new)
            return new
        if isinstance(node, list):
            return [copy_node(c, _join(path, i)) if _is_node(c) else c for i, c in enumerate(node)]
        if isinstance(node, tuple):
            items = [copy_node(c, _join(path, i)) if _is_node(c) else c for i, c in enumerate(node)]
            return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
        if isinstance(node, dict):
            return type(node)((k, copy_node(v, _join(path, k)) if _is_node(v) else v) for k, v in node.items())
        return node

    try:
        return copy_node(module, "")
    finally:
        # NOTE: copy_node and map_param close over themselves, memo and fn: a reference cycle that
        # kept every new param (through memo) and fn's captures (an optimizer step's gradients)
        # alive until the next full garbage collection: a model's worth per training step
        memo.clear()
        del copy_node, map_param


_CALL_MODULE = None


def _call_module():
    """The executor's ``call_module`` (:class:`onnxparam.core.extension.Executor`), looked up once."""
    global _CALL_MODULE
    if _CALL_MODULE is None:
        _CALL_MODULE = extension.executor().call_module
    return _CALL_MODULE


_MUTATIONS = [0]
"""Bumped whenever an attribute of a watched module is set or deleted (see ``Module.__setattr__``)."""

_WATCHED: set = set()
"""``id``s of the modules whose calls the runtime's fast path remembers, and of their sub-modules.
An id reused by another object only bumps :data:`_MUTATIONS` needlessly (never the reverse)."""


class Module(ModuleVerbs):
    """Base class of every module; see the module docstring for traversal and value semantics.

    Subclasses set their params and sub-modules as attributes in ``__init__`` and define
    ``forward``. Calling the module (``module(x)``) traces ``forward`` into an ONNX graph and runs
    it through ONNX Runtime (:mod:`onnxparam.runtime`).
    """

    _training: bool = False

    # -- execution ----------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} defines no forward")

    def __call__(self, *args, **kwargs):
        # NOTE: bound once; an import statement on every call costs ~1 us, measurable at batch 1.
        return (_CALL_MODULE or _call_module())(self, args, kwargs)

    def __setattr__(self, name: str, value) -> None:
        # NOTE: configuration attributes are baked into the traced graph; the runtime's fast path
        # rechecks a module's structure only when this counter moved (rebinding, sub-module swaps).
        if id(self) in _WATCHED:
            _MUTATIONS[0] += 1
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if id(self) in _WATCHED:
            _MUTATIONS[0] += 1
        object.__delattr__(self, name)

    # -- traversal ----------------------------------------------------------------------------

    def named_params(self) -> Iterator[tuple[str, Param]]:
        """``(path, param)`` in traversal order; see :func:`named_params`."""
        return named_params(self)

    def named_modules(self) -> Iterator[tuple[str, "Module"]]:
        return named_modules(self)

    def visit(self, visitor: "ModuleVisitor | Callable[[str, Param], None]") -> None:
        """Call ``visitor`` on every param (a :class:`ModuleVisitor` also gets enter/exit calls)."""
        if not isinstance(visitor, ModuleVisitor):
            func = visitor
            visitor = ModuleVisitor()
            visitor.visit = func  # type: ignore[method-assign]
        for path, param in _walk(self, "", set(), visitor):
            visitor.visit(path, param)

    def map(self, mapper: "ModuleMapper | Callable[[str, Param], Param]") -> "Module":
        """A copy whose params are ``mapper(path, param)`` (or ``mapper.map(path, param)``)."""
        fn = mapper.map if isinstance(mapper, ModuleMapper) else mapper
        return rebuild(self, fn)

    def num_params(self) -> int:
        """Total element count of every param (adapter factors included); never initializes."""
        return sum(param.numel() for _, param in named_params(self))

    # -- devices ------------------------------------------------------------------------------

    def to_device(self, device: "Device | str") -> "Module":
        """A copy whose params live on ``device`` (lazy params stay lazy)."""
        device = Device(device)
        return rebuild(self, lambda path, p: p.to_device(device))

    def fork(self, device: "Device | str") -> "Module":
        """As :meth:`to_device`; in Burn it also detaches autodiff state, which this library
        does not have yet."""
        return self.to_device(device)

    def collect_devices(self, devices: list) -> list:
        """Append the devices of this module's params to ``devices`` (no duplicates); return it."""
        for _, param in named_params(self):
            device = param.lazy_device()
            if device not in devices:
                devices.append(device)
        return devices

    def devices(self) -> list:
        """The distinct devices of this module's params, in traversal order."""
        return self.collect_devices([])

    # -- gradients flags ----------------------------------------------------------------------

    def no_grad(self) -> "Module":
        """A copy in which no param requires grad."""
        return rebuild(self, lambda path, p: p.set_require_grad(False))

    def freeze_group(self, group) -> "Module":
        """A copy in which the float params matched by ``group`` do not require grad.

        Raises:
            ParamGroupError: ``group`` matches no param of the module, or one of a
                ``ParamGroup.from_paths`` group's paths names none (an imported weight's ONNX
                name stands for its path): see :func:`onnxparam.core.group.resolve_group`.
        """
        group = _checked_group(self, group, "freeze_group")
        return rebuild(self, lambda path, p: p.set_require_grad(False) if group.matches(p.id, path) else p)

    def unfreeze_group(self, group) -> "Module":
        """A copy in which the float params matched by ``group`` require grad.

        Raises:
            ParamGroupError: as :meth:`freeze_group`.
        """
        group = _checked_group(self, group, "unfreeze_group")
        return rebuild(self, lambda path, p: p.set_require_grad(True)
                       if group.matches(p.id, path) and p.lazy_dtype().is_float else p)

    def train(self) -> "Module":
        """A copy marked as training; ``require_grad`` flags are kept.

        NOTE: gradients do not need this flag: :func:`onnxparam.autodiff.grad` differentiates
        every param with ``require_grad``. Layers with a training form use it in this mode:
        ``Dropout`` drops, ``BatchNorm`` normalizes with batch statistics (its running
        statistics are updated by :func:`onnxparam.nn.update_running_stats`).
        """
        return rebuild(self, lambda path, p: p, lambda path, m: object.__setattr__(m, "_training", True))

    @staticmethod
    def from_inner(module: "Module") -> "Module":
        """The training module of an inference module (Burn's ``AutodiffModule::from_inner``)."""
        return module.train()

    @property
    def training(self) -> bool:
        return self._training

    # NOTE: the verbs of the features (records and files: load_file, save_file, load_record ...;
    # LoRA: apply_lora, merge_lora, valid, the named adapters; quantization: quantize_weights,
    # apply_qlora) are methods of this class too, installed by the top layer
    # (onnxparam/_assembly.py), each a plain import of its feature: this file imports none.

    # -- display ------------------------------------------------------------------------------

    def extra_repr(self) -> str:
        """Configuration shown after the type name in the display (layers override it)."""
        return ""

    def __repr__(self) -> str:
        return display(self)


def display(module: Module, indent: str = "  ") -> str:
    """The module tree with types, shapes, dtypes and parameter counts (Burn's
    ``ModuleDisplay``). Never initializes a lazy param."""
    lines: list[str] = []

    def count(node) -> int:
        return sum(p.numel() for _, p in _walk(node, "", set(), None))

    def show(node, name: Optional[str], depth: int):
        pad = indent * depth
        label = f"{name}: " if name is not None else ""
        if isinstance(node, Param):
            lines.append(f"{pad}{label}{_param_line(node)}")
            adapter = node.adapter()
            if adapter is not None:
                lines.append(f"{pad}{indent}lora: rank={adapter.rank}, scale={adapter.scale:g}")
            return
        if isinstance(node, Module):
            extra = node.extra_repr()
            head = type(node).__name__ + (f"({extra})" if extra else "")
        else:
            head = type(node).__name__
        lines.append(f"{pad}{label}{head} {{")
        for child_name, child in _children(node):
            if _is_node(child):
                show(child, str(child_name), depth + 1)
        lines.append(f"{pad}{indent}params: {count(node)}")
        lines.append(f"{pad}}}")

    show(module, None, 0)
    return "\n".join(lines)


def _param_line(param: Param) -> str:
    try:
        shape = "[" + ", ".join(str(d) for d in param.lazy_shape()) + "]"
    except ValueError:
        shape = "[?]"
    flags = "" if param.require_grad else ", frozen"
    return f"{shape} {param.lazy_dtype().name}{flags}"


def _checked_group(module, group, verb: str):
    """``group`` resolved against ``module`` (:func:`onnxparam.core.group.resolve_group`): the ONNX
    names of its imported graphs (sub-modules with an ``onnx_names`` property: path -> name)."""
    from .group import ParamGroup, resolve_group

    if not isinstance(group, ParamGroup):
        return group  # NOTE: any object with matches(id, path) is accepted as before, unchecked
    params = [(path, p.id) for path, p in named_params(module)]
    onnx_names: dict = {}
    for prefix, sub in named_modules(module):
        if isinstance(getattr(type(sub), "onnx_names", None), property):
            for path, name in sub.onnx_names.items():
                onnx_names.setdefault(name, []).append(f"{prefix}.{path}" if prefix else path)
    return resolve_group(group, params, onnx_names, verb)

