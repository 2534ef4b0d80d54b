"""The optimizer base: updates params by ``ParamId``, keeps per-param state, saves it as a
burnpack record.

**Record layout** (a burnpack file, Burn's optimizer-record naming: the adaptor record is a map
``ParamId -> state`` and each state's fields keep Burn's names)::

    tensors:  "{param_id}.{field}"   e.g. "4817238491.moment_1"  (param_id also in the descriptor)
    scalars:  "step"                 optimizer steps taken (Int)
              "{param_id}.{scalar}"  per-param scalars, e.g. Adam's "time" (Int)
    metadata: "format" = "burnpack", "producer" = "onnxparam", "version", "optimizer" = "Sgd" | "Adam"

State arrays are exact copies, in the dtype the optimizer keeps them in (the param's; float32 for a
16-bit float param under Adam), so an optimizer reloaded from its file continues bit for bit as the
one that saved it.
"""

from __future__ import annotations

import os
import re
import weakref
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ..core.errors import RecordError, ShapeMismatchError
from ..core.device import CPU
from ..core.param import Param, ParamId
from ..core.tensor import Tensor

__all__ = ["Optimizer", "OptimizerRecord", "STEP_SCALAR", "OPTIMIZER_METADATA_KEY"]

STEP_SCALAR = "step"
"""The scalar holding the optimizer's step count."""

OPTIMIZER_METADATA_KEY = "optimizer"
"""The metadata entry naming the optimizer that wrote a record (``"Sgd"``, ``"Adam"``)."""

_NAME = re.compile(r"^(\d+)\.(\w+)$")


class OptimizerRecord:
    """An optimizer's state: ``tensors`` (``"{param_id}.{field}"`` -> array), ``scalars``
    (name -> int / float), ``optimizer`` (the kind)."""

    def __init__(self, optimizer: str, tensors: Mapping[str, np.ndarray], scalars: Mapping[str, object]):
        self.optimizer = optimizer
        self.tensors = dict(tensors)
        self.scalars = dict(scalars)

    def __repr__(self) -> str:
        return f"OptimizerRecord({self.optimizer}, {len(self.tensors)} tensors, scalars={self.scalars})"


class Optimizer:
    """Base of :class:`~onnxparam.optim.SGD` and :class:`~onnxparam.optim.Adam`.

    Subclasses set :attr:`kind`, :attr:`tensor_fields`, :attr:`scalar_fields` and implement
    :meth:`_update`. The optimizer itself is stateful (Burn's ``&mut self``); modules are
    values: :meth:`step` returns the updated module and leaves the given one as it was, unless
    ``in_place=True`` asks it to write into the arrays it made at an earlier step (PyTorch's
    in-place update; see :meth:`step`).

    Args:
        lr: the learning rate (a :meth:`step` may override it, e.g. from a schedule).
    """

    kind = "Optimizer"
    tensor_fields: tuple = ()
    scalar_fields: tuple = ()

    def __init__(self, lr: float):
        self.lr = float(lr)
        self.step_count = 0
        self.state: dict = {}  # ParamId -> {field: np.ndarray | int}
        # ParamId -> weak reference to the array this optimizer last allocated for that param's
        # value (an in-place step may write into it: see step); weak: it keeps no weights alive
        self._owned: dict = {}

    # -- updating -----------------------------------------------------------------------------

    def _update(self, value: np.ndarray, grad: np.ndarray, state: Optional[dict], lr: float,
                out: Optional[np.ndarray] = None) -> tuple:
        """``(new value, new state)`` for one param (arrays of the param's dtype). With ``out``
        (a writable array of ``value``'s shape and dtype, possibly ``value``'s own memory) the new
        value is written into it, reading ``value`` never after writing there (the same bits as
        without), and ``out`` is returned."""
        raise NotImplementedError

    def step(self, module, grads, lr: Optional[float] = None, *, in_place: bool = False):
        """One update of every param of ``module`` that has a gradient in ``grads`` and requires
        grad, by ``ParamId`` (LoRA factors included; frozen params are never touched).

        ``grads`` may hold gradients of params ``module`` does not have (they are skipped: e.g.
        gradients of a larger model stepped one part at a time), but not only such gradients:
        when none of a non-empty ``grads``' ids is a param of ``module``, nothing would change,
        and that is refused.

        **Value or in place.** By default modules are values: the returned module holds new
        arrays and ``module`` (and every other module sharing its tensors, e.g. a ``best = model``
        kept earlier) keeps the old values, which costs a second copy of the updated weights
        while both exist. With ``in_place=True`` a param's new value is written into the memory
        of its current one when this optimizer allocated that array itself in an earlier step
        for that param (and the array is still the param's stored value, host memory, and held
        by no other param of ``module``): **every module sharing those tensors — ``module``
        itself, any copy or ``best = model`` kept since that step — then sees the new values**.
        Other params (a first step's imported, file-mapped or user-given arrays, lazy params,
        device tensors) get a new array as by default, so the first step allocates and later
        steps of a loop ``model = optim.step(model, grads, in_place=True)`` update in place.
        The result is the same bits either way; cached sessions built from the overwritten
        values are dropped (:func:`onnxparam.runtime.forget_values`), so calling any module
        that holds them computes with the new values.

        Args:
            module: the :class:`~onnxparam.Module`.
            grads: :class:`~onnxparam.autodiff.Gradients` (or any mapping ``ParamId -> Tensor``).
            lr: this step's learning rate (default :attr:`lr`).
            in_place: write into the arrays this optimizer made in earlier steps (above).

        Returns:
            the updated module (same structure and ids, new values for the updated params; new
            :class:`~onnxparam.Tensor` objects also where the memory was written in place).

        Raises:
            ShapeMismatchError: (a ``RecordError``, a ``ValueError``) when a gradient's shape
                differs from its param's.
            RecordError: (a ``ValueError``) when ``grads`` is not empty and none of its ids is
                a param of ``module`` (typically: the base module stepped with the gradients of
                its LoRA-adapted copy, or gradients of another import of the same file, whose
                params have other ids); the optimizer and the module are left as they were.
        """
        from ..core.module import named_params, rebuild

        lr = self.lr if lr is None else float(lr)
        named = list(named_params(module))
        # NOTE: every check before any update (an in-place one changes the given module's memory)
        stepped = 0
        for path, param in named:
            if param.id in grads:
                stepped += 1
                if param.require_grad:
                    g = grads[param.id]
                    g_shape, p_shape = tuple(g.shape if hasattr(g, "shape") else np.shape(g)), param.lazy_shape()
                    if g_shape != p_shape:
                        raise ShapeMismatchError(f"gradient for {path!r} has shape {list(g_shape)}, the param "
                                                 f"{list(p_shape)}")
        if stepped == 0 and len(grads) > 0:
            raise RecordError(_foreign_gradients(module, grads, len(named)))
        shared = _shared_owners(named) if in_place else set()
        written = []  # the arrays written in place

        def update(path: str, param: Param) -> Param:
            if not param.require_grad or param.id not in grads:
                return param
            g = np.asarray(grads[param.id].to_numpy())
            value = np.asarray(param.base().to_numpy())
            target = self._writable(param, value, shared) if in_place else None
            new, state = self._update(value, g.astype(value.dtype, copy=False), self.state.get(param.id), lr,
                                      out=target)
            self.state[param.id] = state
            if target is not None:
                written.append(_memory_owner(target))
                return param.map(lambda _old: Tensor.from_numpy(target))
            device = param.lazy_device()
            # NOTE: reshaped back: ascontiguousarray makes a 0-d array 1-d (a scalar param stays 0-d)
            tensor = Tensor.from_numpy(np.ascontiguousarray(new, dtype=value.dtype).reshape(value.shape), device)
            self._own(param.id, tensor, device, (value, g, state))
            return param.map(lambda _old: tensor)

        try:
            updated = rebuild(module, update)
        finally:
            if written:
                from ..runtime import forget_values

                forget_values(written)
        self.step_count += 1
        return updated

    def _own(self, pid: ParamId, tensor: Tensor, device, inputs: tuple) -> None:
        """Remember ``tensor``'s host memory as this optimizer's own for ``pid`` (an in-place step
        may write it) when it is an array :meth:`_update` made: writable, owning its memory, and
        none of ``inputs``' arrays (the old value, the gradient, the state)."""
        self._owned.pop(pid, None)
        host = tensor._host
        if host is None or device != CPU:
            return
        owner = _memory_owner(host)
        if not (owner.flags.writeable and owner.flags.owndata):
            return
        value, g, state = inputs
        others = [value, g] + [a for a in (state or {}).values() if isinstance(a, np.ndarray)]
        if any(_memory_owner(a) is owner for a in others):
            return
        self._owned[pid] = weakref.ref(owner)

    def _writable(self, param: Param, value: np.ndarray, shared: set) -> Optional[np.ndarray]:
        """A writable view of ``param``'s stored memory when an in-place step may write it: this
        optimizer allocated it for ``param.id`` (:attr:`_owned`), it is still the whole of the
        param's stored host value, and no other param of the module holds it; else ``None``."""
        ref = self._owned.get(param.id)
        owner = ref() if ref is not None else None
        stored = param._value  # NOTE: None for a lazy param: never written
        if owner is None or stored is None or stored._host is None or stored._quant is not None:
            return None
        host = stored._host
        if _memory_owner(host) is not owner or id(owner) in shared or not owner.flags.writeable or \
                owner.dtype != value.dtype or owner.size != value.size or not host.flags.c_contiguous or \
                host.__array_interface__["data"][0] != owner.__array_interface__["data"][0]:
            return None
        return owner.reshape(value.shape)

    # -- records ------------------------------------------------------------------------------

    def to_record(self) -> OptimizerRecord:
        """The state as an :class:`OptimizerRecord` (arrays copied: the optimizer updates its own in place)."""
        tensors, scalars = {}, {STEP_SCALAR: int(self.step_count)}
        for pid in sorted(self.state):
            fields = self.state[pid]
            for name in self.tensor_fields:
                if fields.get(name) is not None:
                    tensors[f"{int(pid)}.{name}"] = np.array(fields[name], copy=True)
            for name in self.scalar_fields:
                if fields.get(name) is not None:
                    scalars[f"{int(pid)}.{name}"] = int(fields[name])
        return OptimizerRecord(self.kind, tensors, scalars)

    def load_record(self, record: OptimizerRecord) -> "Optimizer":
        """Replace this optimizer's state with ``record``'s (arrays copied); returns ``self``.

        Raises:
            RecordError: for a record of another optimizer kind, or names / fields this
                optimizer does not know (all listed).
        """
        if record.optimizer != self.kind:
            raise RecordError(f"the record holds {record.optimizer} state; this optimizer is {self.kind}: "
                              f"load it into a {record.optimizer} optimizer")
        problems, state = [], {}
        for name, array in record.tensors.items():
            match = _NAME.match(name)
            if match is None or match.group(2) not in self.tensor_fields:
                problems.append(f"unexpected tensor {name!r} (expected '<param_id>.<field>' with field in "
                                f"{', '.join(self.tensor_fields) or 'nothing'})")
                continue
            state.setdefault(ParamId(int(match.group(1))), {})[match.group(2)] = np.array(array, copy=True)
        step = 0
        for name, value in record.scalars.items():
            if name == STEP_SCALAR:
                step = int(value)
                continue
            match = _NAME.match(name)
            if match is None or match.group(2) not in self.scalar_fields:
                problems.append(f"unexpected scalar {name!r}")
                continue
            state.setdefault(ParamId(int(match.group(1))), {})[match.group(2)] = int(value)
        if problems:
            raise RecordError(f"cannot load {self.kind} state: " + "; ".join(problems))
        self.state = state
        self.step_count = step
        return self

    def save_file(self, path: "str | os.PathLike") -> Path:
        """Write the state as a burnpack file (``.bpk`` appended when missing), atomically.

        Returns:
            the path written.
        """
        from .. import burnpack
        from ..burnpack import Scalar, TensorEntry
        from ..core.version import __version__

        path = Path(path)
        if path.suffix != ".bpk":
            path = path.with_name(path.name + ".bpk")
        record = self.to_record()
        entries = [TensorEntry.from_numpy(name, np.ascontiguousarray(array), param_id=int(name.split(".", 1)[0]))
                   for name, array in record.tensors.items()]
        metadata = {"format": "burnpack", "producer": "onnxparam", "version": __version__,
                    OPTIMIZER_METADATA_KEY: self.kind}
        scalars = {k: Scalar("Int", int(v)) for k, v in record.scalars.items()}
        burnpack.write(path, entries, metadata=metadata, scalars=scalars)
        return path

    def load_file(self, path: "str | os.PathLike") -> "Optimizer":
        """Load the state written by :meth:`save_file`; returns ``self``.

        Raises:
            RecordError: for a malformed file, a file of another optimizer kind, or unknown
                tensors / scalars.
        """
        from .. import burnpack

        with burnpack.read(path) as f:
            kind = f.metadata.get(OPTIMIZER_METADATA_KEY)
            if kind is None:
                raise RecordError(f"{path}: no '{OPTIMIZER_METADATA_KEY}' metadata; not an optimizer record")
            tensors = {name: np.array(entry.to_numpy(), copy=True) for name, entry in f.tensors.items()}
            scalars = {name: s.value for name, s in f.scalars.items()}
        return self.load_record(OptimizerRecord(kind, tensors, scalars))


def _memory_owner(array: np.ndarray) -> np.ndarray:
    """The array owning ``array``'s memory (``base`` followed through views)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _shared_owners(named) -> set:
    """``id`` s of the arrays owning the host memory of more than one of the ``(path, param)``
    (an in-place write into one would change the other)."""
    counts: dict = {}
    for _, param in named:
        stored = param._value
        host = stored._host if stored is not None else None
        if host is not None:
            key = id(_memory_owner(host))
            counts[key] = counts.get(key, 0) + 1
    return {key for key, n in counts.items() if n > 1}


def _foreign_gradients(module, grads, n_params: int) -> str:
    """The message of a step whose gradients all belong to params ``module`` does not have."""
    paths = getattr(grads, "path", None)
    named = [paths(pid) for pid in list(grads)[:3]] if callable(paths) else []
    named = [p for p in named if p]
    example = f" (e.g. {', '.join(map(repr, named))})" if named else ""
    return (f"none of the {len(grads)} gradient(s){example} is for a param of the {type(module).__name__} being "
            f"stepped ({n_params} params): nothing would change. Typical causes: stepping the base module "
            "instead of the LoRA-adapted one (apply_lora returns a new module: step the one grad() was "
            "computed on), or gradients of another copy (a re-imported file's params have fresh ids). "
            "The module and the optimizer are unchanged")
