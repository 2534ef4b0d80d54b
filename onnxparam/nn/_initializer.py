"""Param initializers (Burn's ``Initializer``, ``burn-core/src/module/initializer.rs``).

Every initializer builds a *lazy* param (:meth:`Initializer.init_with`): the random draw happens
on the first ``val()`` (at most once, see :class:`~onnxparam.Param`), so a module whose weights
are then loaded from a file never pays for its random init.

Formulas (Burn's, which follow He et al. 2015 and Glorot & Bengio 2010)::

    KaimingUniform(gain, fan_out_only):  U(-a, a),  a   = sqrt(3) * gain / sqrt(fan)
    KaimingNormal(gain, fan_out_only):   N(0, std), std = gain / sqrt(fan)
    XavierUniform(gain):                 U(-a, a),  a   = sqrt(3) * gain * sqrt(2 / (fan_in + fan_out))
    XavierNormal(gain):                  N(0, std), std = gain * sqrt(2 / (fan_in + fan_out))

where ``fan`` is ``fan_out`` when ``fan_out_only`` else ``fan_in``. Burn's default for
``Linear`` and ``Conv*`` is ``KaimingUniform(gain=1/sqrt(3))``, i.e. ``U(-1/sqrt(fan_in),
1/sqrt(fan_in))`` for the weight *and* the bias.

Randomness comes from one process-wide generator (:func:`seed` resets it, as Burn's
``Backend::seed`` does); draws happen in float64 and are cast to the param's dtype.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from ..core import extension
from ..core.device import Device
from ..core.dtype import DType
from ..core.param import Param, ParamId
from ..core.tensor import Tensor

__all__ = ["Initializer", "seed", "DEFAULT_KAIMING_GAIN", "DEFAULT_INITIALIZER"]

DEFAULT_KAIMING_GAIN = 1.0 / math.sqrt(3.0)
"""The gain of Burn's default ``KaimingUniform`` for Linear and Conv: with it the bound is
``1/sqrt(fan_in)``, the same as PyTorch's default ``Linear``/``Conv`` init."""

_RNG_LOCK = threading.Lock()
_rng = np.random.default_rng()


def seed(value: int) -> None:
    """Reseed the generator every initializer draws from (Burn's ``Backend::seed``), and the
    separate stream training-mode :class:`~onnxparam.nn.Dropout` (and :class:`~onnxparam.nn.RRelu`)
    seeds its masks from.

    Draws happen when a lazy param is first read, so the values depend on the order in which
    params are first read after seeding, as in Burn.

    Dropout: each training-mode ``Dropout`` node traced after ``seed`` gets its own ``seed``
    attribute drawn from a stream of ``value`` (independent of the param draws, so seeding gives
    the same initial weights with or without dropout in the model). ONNX Runtime's random
    generator for that node starts at its seed when the session is built and advances at every
    run, so the masks differ from step to step, and the same seed, the same program and the same
    calls give the same masks. To make that hold within one process too, ``seed`` forgets the
    cached traces and sessions (:func:`onnxparam.runtime.clear_caches`, and the training graphs
    of :mod:`onnxparam.autodiff`, which key on :func:`seed_generation`): the next calls trace and
    build afresh.
    Without any ``seed`` call, dropout masks are drawn from ONNX Runtime's own random seed.
    """
    global _rng, _dropout_rng
    with _RNG_LOCK:
        _rng = np.random.default_rng(int(value))
        _dropout_rng = np.random.default_rng([int(value) & 0xFFFFFFFFFFFFFFFF, _DROPOUT_STREAM])
        _SEED_GENERATION[0] += 1
    # NOTE: the runtime's caches are cleared through the executor (nothing is cached before it
    # is loaded); the training graphs of autodiff key on seed_generation()
    executor = extension.loaded_executor()
    if executor is not None:
        executor.clear_caches()


def seed_generation() -> int:
    """How many times :func:`seed` has run: caches of seeded graphs compare it with theirs."""
    return _SEED_GENERATION[0]


_SEED_GENERATION = [0]


_DROPOUT_STREAM = 0x64726F70  # "drop": the dropout seeds' stream, apart from the param draws
_dropout_rng: Optional[np.random.Generator] = None


def next_dropout_seed() -> Optional[float]:
    """The ``seed`` attribute of the next training-mode dropout (or RReLU) node: ``None`` (ONNX Runtime
    picks one) until :func:`seed` was called, then the next draw of the dropout stream (an
    integer below ``2**24``, exact as the attribute's float)."""
    with _RNG_LOCK:
        if _dropout_rng is None:
            return None
        return float(_dropout_rng.integers(0, 1 << 24))


def _draw(method: str, *args, shape: tuple) -> np.ndarray:
    with _RNG_LOCK:
        return getattr(_rng, method)(*args, size=shape)


class Initializer:
    """How a param's values are created; the variants are nested classes, as Burn's enum::

        Initializer.KaimingUniform(gain=1 / math.sqrt(3), fan_out_only=False)
        Initializer.Normal(mean=0.0, std=1.0)
        Initializer.Zeros()

    Every variant is a frozen dataclass with :meth:`sample` (draw values now) and
    :meth:`init_with` (a lazy param that draws on first use).
    """

    # Filled in below, once the variants exist.
    Constant: ClassVar[type]
    Ones: ClassVar[type]
    Zeros: ClassVar[type]
    Uniform: ClassVar[type]
    Normal: ClassVar[type]
    KaimingUniform: ClassVar[type]
    KaimingNormal: ClassVar[type]
    XavierUniform: ClassVar[type]
    XavierNormal: ClassVar[type]

    def sample(self, shape: tuple, fan_in: Optional[int] = None, fan_out: Optional[int] = None) -> np.ndarray:
        """Values of ``shape`` as a float64 array.

        Raises:
            ValueError: when the variant needs ``fan_in`` / ``fan_out`` and it is missing.
        """
        raise NotImplementedError

    def init_with(self, shape, fan_in: Optional[int] = None, fan_out: Optional[int] = None,
                  device: "Device | str" = "cpu", dtype: DType = DType.F32,
                  require_grad: bool = True) -> Param:
        """A lazy param of ``shape`` and ``dtype`` on ``device`` whose init draws from this
        initializer (Burn's ``Initializer::init_with``). Nothing is drawn now.

        Raises:
            ValueError: right away (not at first use) when a fan this variant needs is missing.
        """
        shape = tuple(int(d) for d in shape)
        self._check_fans(fan_in, fan_out)
        np_dtype = dtype.to_numpy()

        def init(dev: Device, _require_grad: bool, _self=self) -> Tensor:
            values = _self.sample(shape, fan_in, fan_out)
            return Tensor.from_numpy(np.asarray(values).astype(np_dtype), dev)

        return Param.uninitialized(ParamId(), init, Device(device), require_grad, shape, dtype)

    def _check_fans(self, fan_in, fan_out) -> None:
        """Nothing for variants that need no fan."""


@dataclass(frozen=True)
class _Constant(Initializer):
    """Every value ``value``."""

    value: float

    def sample(self, shape, fan_in=None, fan_out=None):
        return np.full(shape, float(self.value))


@dataclass(frozen=True)
class _Ones(Initializer):
    """Every value 1."""

    def sample(self, shape, fan_in=None, fan_out=None):
        return np.ones(shape)


@dataclass(frozen=True)
class _Zeros(Initializer):
    """Every value 0."""

    def sample(self, shape, fan_in=None, fan_out=None):
        return np.zeros(shape)


@dataclass(frozen=True)
class _Uniform(Initializer):
    """``U(min, max)``."""

    min: float
    max: float

    def sample(self, shape, fan_in=None, fan_out=None):
        return _draw("uniform", float(self.min), float(self.max), shape=shape)


@dataclass(frozen=True)
class _Normal(Initializer):
    """``N(mean, std)``."""

    mean: float
    std: float

    def sample(self, shape, fan_in=None, fan_out=None):
        return _draw("normal", float(self.mean), float(self.std), shape=shape)


class _Kaiming(Initializer):
    gain: float
    fan_out_only: bool

    def _check_fans(self, fan_in, fan_out):
        fan = fan_out if self.fan_out_only else fan_in
        if fan is None:
            which = "fan_out" if self.fan_out_only else "fan_in"
            raise ValueError(f"{type(self).__name__} initialization needs {which}; pass it to init_with")

    def _std(self, fan_in, fan_out) -> float:
        self._check_fans(fan_in, fan_out)
        fan = fan_out if self.fan_out_only else fan_in
        return float(self.gain) / math.sqrt(fan)


@dataclass(frozen=True)
class _KaimingUniform(_Kaiming):
    """``U(-a, a)`` with ``a = sqrt(3) * gain / sqrt(fan)`` (He et al. 2015, uniform form)."""

    gain: float = DEFAULT_KAIMING_GAIN
    fan_out_only: bool = False

    def sample(self, shape, fan_in=None, fan_out=None):
        bound = math.sqrt(3.0) * self._std(fan_in, fan_out)
        return _draw("uniform", -bound, bound, shape=shape)


@dataclass(frozen=True)
class _KaimingNormal(_Kaiming):
    """``N(0, std)`` with ``std = gain / sqrt(fan)`` (He et al. 2015)."""

    gain: float = 1.0
    fan_out_only: bool = False

    def sample(self, shape, fan_in=None, fan_out=None):
        return _draw("normal", 0.0, self._std(fan_in, fan_out), shape=shape)


class _Xavier(Initializer):
    gain: float

    def _check_fans(self, fan_in, fan_out):
        if fan_in is None or fan_out is None:
            raise ValueError(f"{type(self).__name__} initialization needs fan_in and fan_out")

    def _std(self, fan_in, fan_out) -> float:
        self._check_fans(fan_in, fan_out)
        return float(self.gain) * math.sqrt(2.0 / (fan_in + fan_out))


@dataclass(frozen=True)
class _XavierUniform(_Xavier):
    """``U(-a, a)`` with ``a = sqrt(3) * gain * sqrt(2 / (fan_in + fan_out))`` (Glorot & Bengio 2010)."""

    gain: float = 1.0

    def sample(self, shape, fan_in=None, fan_out=None):
        bound = math.sqrt(3.0) * self._std(fan_in, fan_out)
        return _draw("uniform", -bound, bound, shape=shape)


@dataclass(frozen=True)
class _XavierNormal(_Xavier):
    """``N(0, std)`` with ``std = gain * sqrt(2 / (fan_in + fan_out))`` (Glorot & Bengio 2010)."""

    gain: float = 1.0

    def sample(self, shape, fan_in=None, fan_out=None):
        return _draw("normal", 0.0, self._std(fan_in, fan_out), shape=shape)


for _name, _cls in [
    ("Constant", _Constant), ("Ones", _Ones), ("Zeros", _Zeros), ("Uniform", _Uniform),
    ("Normal", _Normal), ("KaimingUniform", _KaimingUniform), ("KaimingNormal", _KaimingNormal),
    ("XavierUniform", _XavierUniform), ("XavierNormal", _XavierNormal),
]:
    _cls.__name__ = _name
    _cls.__qualname__ = f"Initializer.{_name}"
    setattr(Initializer, _name, _cls)
del _name, _cls

DEFAULT_INITIALIZER = Initializer.KaimingUniform(gain=DEFAULT_KAIMING_GAIN, fan_out_only=False)
"""Burn's default initializer of ``Linear`` and ``Conv*`` weights and biases:
``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
