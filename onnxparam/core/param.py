"""``ParamId`` and ``Param``: a parameter with a stable id and lazy, run-once initialization.

Semantics follow Burn's ``burn::module::Param`` (``burn-core/src/module/param/base.rs``).

States of a ``Param``:

* **lazy** (``Param.uninitialized``): holds an init function, a device, a shape and a dtype.
  ``lazy_shape()``, ``lazy_device()``, ``lazy_dtype()``, ``repr`` and cloning never run it.
  The first ``val()`` runs it exactly once, under a lock, even when many threads (or many
  clones: clones share the once-cell) ask at the same time; every clone then sees that value.
* **initialized**: holds a :class:`~onnxparam.Tensor`.
* **frozen / trainable**: ``require_grad``. Per param object; never shared between clones.
* **adapted**: carries a :class:`~onnxparam.LoraAdapter`; ``val()`` is
  ``base + scale * (a @ b)``, ``base()`` the raw stored value.
* **quantized**: the stored value is a ``QFloat`` tensor; ``val()`` dequantizes it.

Cheap calls (no init, no copy): ``clone``, ``id``, ``require_grad``, ``lazy_*``,
``is_initialized``, ``repr``, ``set_require_grad``, mapper setters. Transformations (``map``,
mappers, ``set_require_grad``) return or change *this* param only and never reach other clones.
"""

from __future__ import annotations

import copy

import secrets
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import extension
from .device import CPU, Device
from .dtype import DType
from .errors import ShapeMismatchError
from .tensor import Tensor, TensorData

__all__ = ["ParamId", "Param", "ParamMapper"]


class ParamId:
    """A parameter's stable 64-bit unsigned id (Burn's ``ParamId``).

    ``ParamId()`` draws a random id; ``ParamId(n)`` wraps ``n``. Hashable, ordered, ``int(pid)``.
    Written to burnpack files as ``param_id`` and kept through every format round trip.

    Raises:
        ValueError: when ``n`` is outside ``0 .. 2**64-1``.
    """

    __slots__ = ("_value",)

    def __init__(self, value: "int | ParamId | None" = None):
        if value is None:
            value = secrets.randbits(64)
        value = int(value)
        if not 0 <= value < 2**64:
            raise ValueError(f"a ParamId is a u64; got {value}")
        self._value = value

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __eq__(self, other) -> bool:
        return isinstance(other, ParamId) and other._value == self._value

    def __lt__(self, other: "ParamId") -> bool:
        return self._value < other._value

    def __hash__(self) -> int:
        return hash(("ParamId", self._value))

    def __repr__(self) -> str:
        return f"ParamId({self._value})"

    def __str__(self) -> str:
        return str(self._value)


@dataclass(frozen=True)
class ParamMapper:
    """The load and save mappers of a param (Burn's ``ParamMapper``).

    ``load`` is applied to a tensor loaded from a record, ``save`` to the value written to one.
    """

    load: Optional[Callable[[Tensor], Tensor]] = None
    save: Optional[Callable[[Tensor], Tensor]] = None

    def on_load(self, tensor: Tensor) -> Tensor:
        return tensor if self.load is None else self.load(tensor)

    def on_save(self, tensor: Tensor) -> Tensor:
        return tensor if self.save is None else self.save(tensor)


class _Lazy:
    """A once-cell: ``get()`` runs ``init(device, require_grad)`` at most once, under a lock.
    ``source``: the cell whose value this one returns unchanged (a clone given another
    ``require_grad`` flag before its first ``get``), so sessions key both by one value."""

    __slots__ = ("init", "device", "shape", "dtype", "require_grad", "value", "lock", "source")

    def __init__(self, init, device: Device, shape, dtype: DType, require_grad: bool):
        self.init = init
        self.device = device
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        self.dtype = dtype
        self.require_grad = require_grad
        self.value: Optional[Tensor] = None
        self.lock = threading.Lock()
        self.source: Optional["_Lazy"] = None

    def __deepcopy__(self, memo) -> "_Lazy":
        # NOTE: a once-cell is shared, never copied (clones initialize once, together); its lock
        # cannot be copied anyway
        return self

    def __copy__(self) -> "_Lazy":
        return self

    def get(self) -> Tensor:
        value = self.value
        if value is not None:
            return value
        with self.lock:
            if self.value is None:
                value = self.init(self.device, self.require_grad)
                if not isinstance(value, Tensor):
                    value = Tensor.from_numpy(value, self.device)
                if self.shape is not None and tuple(value.shape) != self.shape:
                    raise ShapeMismatchError(
                        f"the init function of a lazy param returned shape {tuple(value.shape)}, "
                        f"but the param was declared with shape {self.shape}"
                    )
                self.value = value
                self.init = None  # let the closure (and what it holds) go
            return self.value


class Param:
    """A parameter: a tensor (or a lazy one) with a :class:`ParamId`; see the module docstring.

    Construct with :meth:`initialized`, :meth:`uninitialized`, :meth:`from_tensor` or
    :meth:`from_data`.
    """

    __slots__ = ("id", "_cell", "_value", "require_grad", "_mapper", "_adapter")

    def __init__(self, id: ParamId, *, value: Optional[Tensor] = None, cell: Optional[_Lazy] = None,
                 require_grad: bool = True, mapper: ParamMapper = ParamMapper(), adapter=None):
        if (value is None) == (cell is None):
            raise TypeError("a Param holds exactly one of a value or a lazy cell")
        self.id = id if isinstance(id, ParamId) else ParamId(id)
        self._value = value
        self._cell = cell
        self.require_grad = bool(require_grad)
        self._mapper = mapper
        self._adapter = adapter

    # -- constructors (Burn's names) -----------------------------------------------------------

    @staticmethod
    def initialized(id: ParamId, value: Tensor, require_grad: Optional[bool] = None) -> "Param":
        """A param holding ``value``. ``require_grad`` defaults to True for float tensors."""
        if not isinstance(value, Tensor):
            value = Tensor.from_numpy(value)
        if require_grad is None:
            require_grad = value.dtype.is_float
        return Param(id, value=value, require_grad=require_grad)

    @staticmethod
    def uninitialized(id: ParamId, init: Callable[[Device, bool], Tensor], device: "Device | str" = CPU,
                      is_require_grad: bool = True, shape=None, dtype: DType = DType.F32) -> "Param":
        """A lazy param: ``init(device, require_grad) -> Tensor`` runs on the first ``val()``.

        Args:
            id: the param's id.
            init: called at most once (across clones and threads); may return a numpy array.
            device: where the value will live.
            is_require_grad: the trainable flag.
            shape: the shape ``init`` will return (checked when it runs); required so that
                ``lazy_shape``, records and ONNX export never need the value.
            dtype: the dtype ``init`` will return.
        """
        cell = _Lazy(init, Device(device), shape, dtype, is_require_grad)
        return Param(id, cell=cell, require_grad=is_require_grad)

    @staticmethod
    def from_tensor(tensor: Tensor) -> "Param":
        """A param with a fresh random id; float tensors require grad, others do not."""
        return Param.initialized(ParamId(), tensor)

    @staticmethod
    def from_data(data: "TensorData | np.ndarray", device: "Device | str | None" = None) -> "Param":
        """A param holding ``data`` (``TensorData`` or an array) on ``device``."""
        if not isinstance(data, TensorData):
            data = TensorData.from_numpy(data)
        return Param.from_tensor(Tensor.from_data(data, device))

    @staticmethod
    def from_mapped_value(id: ParamId, value: Tensor, mapper: ParamMapper, require_grad: Optional[bool] = None) -> "Param":
        """A param holding ``value`` with the given mappers (the inverse of :meth:`consume`)."""
        param = Param.initialized(id, value, require_grad)
        param._mapper = mapper
        return param

    # -- values -------------------------------------------------------------------------------

    def is_initialized(self) -> bool:
        """True when the value exists (an eager param, or a lazy one whose init has run)."""
        return self._value is not None or self._cell.value is not None

    def base(self) -> Tensor:
        """The raw stored value, without the adapter (runs a lazy init once)."""
        if self._value is not None:
            return self._value
        return self._cell.get()

    def val(self) -> Tensor:
        """The effective value: ``base + scale * (a @ b)`` with a LoRA adapter, dequantized when
        the base is quantized. Inside a traced forward, the graph initializer of this param."""
        traced = extension.tensor_ops().param_value(self)
        if traced is not None:
            return traced
        base = self.base()
        if base.is_quantized:
            array = base.to_numpy()  # float32 (Burn's dequantize), at the quantized param's float dtype
            base = Tensor.from_numpy(array.astype(base._quant.float_dtype.to_numpy(), copy=False))
        if self._adapter is None:
            return base
        return self._adapter.apply(base)

    def into_value(self) -> Tensor:
        """The effective value (``val()``), for a param that is no longer needed."""
        return self.val()

    def consume(self) -> tuple:
        """``(id, raw base value, mapper)``; the adapter is dropped (as Burn's ``consume``)."""
        return self.id, self.base(), self._mapper

    def adapter(self):
        """The attached :class:`~onnxparam.LoraAdapter`, or ``None``."""
        return self._adapter

    def with_adapter(self, adapter) -> "Param":
        """A clone carrying ``adapter`` (``None`` removes it)."""
        clone = self.clone()
        clone._adapter = adapter
        return clone

    # -- lazy info ----------------------------------------------------------------------------

    def lazy_shape(self) -> tuple:
        """The shape, without running a lazy init."""
        if self._value is not None:
            return tuple(self._value.shape)
        cell = self._cell
        if cell.value is not None:
            return tuple(cell.value.shape)
        if cell.shape is None:
            raise ValueError("this lazy param was declared without a shape; pass shape= to Param.uninitialized")
        return cell.shape

    def lazy_device(self) -> Device:
        """The device, without running a lazy init."""
        if self._value is not None:
            return self._value.device
        cell = self._cell
        return cell.value.device if cell.value is not None else cell.device

    def lazy_dtype(self) -> DType:
        """The stored dtype (``QFloat`` for a quantized base), without running a lazy init."""
        if self._value is not None:
            return self._value.dtype
        cell = self._cell
        return cell.value.dtype if cell.value is not None else cell.dtype

    @property
    def shape(self) -> tuple:
        return self.lazy_shape()

    @property
    def dtype(self) -> DType:
        return self.lazy_dtype()

    @property
    def device(self) -> Device:
        return self.lazy_device()

    def numel(self) -> int:
        n = 1
        for d in self.lazy_shape():
            n *= d
        return n

    # -- transformations ----------------------------------------------------------------------

    def clone(self) -> "Param":
        """A cheap copy that shares the lazy once-cell and the value; never initializes."""
        return Param(self.id, value=self._value, cell=self._cell if self._value is None else None,
                     require_grad=self.require_grad, mapper=self._mapper, adapter=self._adapter)

    __copy__ = clone

    def __deepcopy__(self, memo) -> "Param":
        """``copy.deepcopy``: :meth:`clone` with the value deep-copied (its host memory copied
        when it is writable, e.g. an optimizer's array that ``in_place=True`` steps overwrite;
        see :meth:`Tensor.__deepcopy__`), so a deep copy is a snapshot later in-place steps on
        the original cannot change; so are its LoRA adapter's factors. A lazy param not yet
        initialized shares its once-cell (its init reads the source, which nothing writes), so
        it initializes once, with its original. Params sharing one value stay sharing one
        (``memo``)."""
        adapter = copy.deepcopy(self._adapter, memo)  # a LoRA adapter's factors are params too
        if self._value is None:
            return Param(self.id, cell=self._cell, require_grad=self.require_grad, mapper=self._mapper,
                         adapter=adapter)
        return Param(self.id, value=copy.deepcopy(self._value, memo), require_grad=self.require_grad,
                     mapper=self._mapper, adapter=adapter)

    def map(self, func: Callable[[Tensor], Tensor]) -> "Param":
        """A param (same id, mappers, flags and adapter) whose base is ``func(base)``.

        The base is materialized (a lazy init runs once). Other clones are not affected.
        """
        return self._replace_value(func(self.base()))

    def init_mapper(self, func: Callable[[Tensor], Tensor]) -> "Param":
        """Apply ``func`` to the value: chained onto a pending lazy init without running it
        (the new init is ``func(old_init())``), or applied now to an initialized param."""
        if self.is_initialized():
            return self.map(func)
        old = self._cell

        def chained(device, require_grad, _old=old, _func=func):
            return _func(_old.get())

        clone = self.clone()
        clone._cell = _Lazy(chained, old.device, old.shape, old.dtype, old.require_grad)
        return clone

    def load_mapper(self, func: Callable[[Tensor], Tensor]) -> "Param":
        """A clone whose load mapper is ``func`` (applied to tensors loaded from a record)."""
        clone = self.clone()
        clone._mapper = ParamMapper(func, self._mapper.save)
        return clone

    def save_mapper(self, func: Callable[[Tensor], Tensor]) -> "Param":
        """A clone whose save mapper is ``func`` (applied to the value written to a record)."""
        clone = self.clone()
        clone._mapper = ParamMapper(self._mapper.load, func)
        return clone

    def set_require_grad(self, flag: bool) -> "Param":
        """A clone with ``require_grad = flag`` (this param is unchanged)."""
        clone = self.clone()
        clone.require_grad = bool(flag)
        if clone._cell is not None and clone._cell.value is None and clone._cell.require_grad != flag:
            old = clone._cell
            clone._cell = _Lazy(lambda device, rg, _old=old: _old.get(), old.device, old.shape, old.dtype, flag)
            clone._cell.source = old.source or old  # the same value: one session serves both flags
        return clone

    def to_device(self, device: "Device | str") -> "Param":
        """A clone on ``device``; a lazy param stays lazy and will initialize there."""
        device = Device(device)
        if self.lazy_device() == device:
            return self
        if self.is_initialized():
            return self._replace_value(self.base().to_device(device))
        old = self._cell
        clone = self.clone()

        def on_device(dev, require_grad, _old=old, _device=device):
            return _old.get().to_device(_device)

        clone._cell = _Lazy(on_device, device, old.shape, old.dtype, old.require_grad)
        return clone

    def transform_for_load(self, tensor, param_id: Optional[ParamId] = None) -> "Param":
        """The param a record loads into this one: shape checked first, moved to this param's
        device, load mapper applied, ``require_grad`` kept; this param's init never runs.

        Args:
            tensor: a :class:`Tensor`, or a lazy snapshot (anything with ``shape``, ``dtype`` and
                ``to_tensor()``, e.g. :class:`~onnxparam.core.record.TensorSnapshot`); a snapshot is
                loaded only when the new param's value is first needed.
            param_id: the id to take (the record's); this param's id when ``None``.

        Raises:
            ShapeMismatchError: when the shapes differ (checked before any data is read).
        """
        expected = self.lazy_shape()
        found = tuple(tensor.shape)
        if found != expected:
            raise ShapeMismatchError(
                f"shape mismatch: the module expects {list(expected)}, the record has {list(found)}"
            )
        pid = self.id if param_id is None else ParamId(param_id)
        device = self.lazy_device()
        mapper = self._mapper
        if isinstance(tensor, Tensor):
            value = mapper.on_load(tensor.to_device(device))
            return Param(pid, value=value, require_grad=self.require_grad, mapper=mapper, adapter=self._adapter)

        def load(dev, require_grad, _snapshot=tensor, _mapper=mapper):
            return _mapper.on_load(_snapshot.to_tensor(dev))

        cell = _Lazy(load, device, found, tensor.dtype, self.require_grad)
        return Param(pid, cell=cell, require_grad=self.require_grad, mapper=mapper, adapter=self._adapter)

    def transform_for_save(self) -> "Param":
        """A param whose value is the save mapper applied to the raw base (adapter dropped,
        as records hold the adapter factors as their own params)."""
        value = self._mapper.on_save(self.base())
        return Param(self.id, value=value, require_grad=self.require_grad, mapper=self._mapper)

    def _replace_value(self, value: Tensor) -> "Param":
        return Param(self.id, value=value, require_grad=self.require_grad, mapper=self._mapper, adapter=self._adapter)

    # -- display ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        try:
            shape = "[" + ", ".join(str(d) for d in self.lazy_shape()) + "]"
        except ValueError:
            shape = "?"
        state = "initialized" if self.is_initialized() else "lazy"
        extra = ", lora" if self._adapter is not None else ""
        return (f"Param(id={self.id}, shape={shape}, dtype={self.lazy_dtype().name}, device={self.lazy_device()}, "
                f"{state}, require_grad={self.require_grad}{extra})")

    __str__ = __repr__
