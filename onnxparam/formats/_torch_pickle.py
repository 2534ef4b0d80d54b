"""A restricted unpickler for PyTorch checkpoints: rebuilds tensor *descriptions*, runs nothing.

``torch.save`` pickles the object tree (usually a state_dict) and replaces every storage by a
*persistent id*; the storage bytes live outside the pickle (see ``docs/pytorch_checkpoint.md``).
This module turns such a pickle into plain Python containers whose tensor leaves are
:class:`TensorRef` values (storage reference, offset, size, stride, dtype) without reading any
storage byte and without calling anything the pickle names, except the few stand-ins below.

How safety is kept: :class:`RestrictedUnpickler` overrides ``find_class`` — the only way a pickle
reaches a Python callable (opcodes GLOBAL, STACK_GLOBAL, and the extension registry go through
it). ``find_class`` returns our own stand-in for each allowed global (a function that builds a
``TensorRef``, ``tuple`` for ``torch.Size`` ...) and raises :class:`PickleRefused` for anything
else, so a reduce naming ``os.system`` or ``builtins.eval`` never gets its callable.
The allow-list mirrors what ``torch.load(weights_only=True)`` accepts for plain checkpoints.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import types
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "TensorRef",
    "StorageRef",
    "PickleRefused",
    "RestrictedUnpickler",
    "STORAGE_DTYPES",
    "TORCH_DTYPES",
]


class PickleRefused(Exception):
    """The pickle names a global, or holds a persistent id, outside the allow-list."""


# NOTE: the legacy ``torch.<Name>Storage`` classes name a storage's element type; since torch 1.13
# they are written for the dtypes that existed before 2022 (torch/storage.py,
# ``_dtype_to_storage_type_map``). Quantized storages (QInt8Storage ...) carry scales elsewhere
# and are not listed, so they are refused.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "DoubleStorage": np.dtype(np.float64),
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
    "ComplexDoubleStorage": np.dtype(np.complex128),
    "ComplexFloatStorage": np.dtype(np.complex64),
}

# NOTE: newer dtypes (uint16/32/64, float8) are saved as an untyped (byte) storage plus a
# ``torch.<dtype>`` global passed to ``_rebuild_tensor_v3``; every ``torch.<dtype>`` name that
# has a numpy equivalent is listed here (torch/storage.py, ``_new_dtypes``).
TORCH_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
}

_UNTYPED = np.dtype(np.uint8)


@dataclasses.dataclass(frozen=True)
class StorageRef:
    """A storage named by a persistent id: ``key`` (the ``data/<key>`` record, or the legacy
    stream's key), the element type it was saved with and its length in those elements."""

    key: str
    dtype: np.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(eq=False)
class TensorRef:
    """A tensor as the pickle describes it: a strided view of a storage, nothing read yet.

    ``offset`` and ``stride`` count elements of ``dtype`` (torch's ``storage_offset()`` and
    ``stride()``); ``conj`` / ``neg`` are torch's lazy conjugate / negative bits.
    """

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: np.dtype
    conj: bool = False
    neg: bool = False
    is_parameter: bool = False


class _Sealed:
    """Base of the stand-ins a pickle can hold: the BUILD opcode cannot change them.

    NOTE: ``_TorchDtype`` / ``_Tensor`` instances are shared by every read, and BUILD calls
    ``__setstate__`` (or ``setattr``) on whatever object the pickle names; a frozen dataclass is
    not enough (``slots=True`` adds a ``__setstate__`` that writes the fields).
    """

    __slots__ = ()

    def __setattr__(self, key, value):
        raise PickleRefused(f"the pickle tries to set '{key}' on {self!r}")

    def __setstate__(self, state):
        raise PickleRefused(f"the pickle tries to change {self!r} (BUILD)")


class _TorchDtype(_Sealed):
    __slots__ = ("name",)

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _Tensor(_Sealed):
    """Stand-in for the ``torch.Tensor`` / ``Parameter`` classes as arguments of a rebuild."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __call__(self, data=None, requires_grad=True):
        # ``Parameter(data, requires_grad)`` called directly by a reduce; ``Tensor(...)`` is not.
        if self.name != "Parameter":
            raise PickleRefused(f"calling torch.{self.name} is not allowed in a weights file")
        return _as_parameter(data)


def _int(value: Any, what: str) -> int:
    if type(value) is not int:
        raise PickleRefused(f"{what} is {value!r}, expected an int")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise PickleRefused(f"{what} is {value!r}, expected a tuple of ints")
    return tuple(_int(v, what) for v in value)


def _metadata_bits(metadata: Any) -> tuple[bool, bool]:
    if not metadata:
        return False, False
    if not isinstance(metadata, dict) or set(metadata) - {"conj", "neg"}:
        raise PickleRefused(f"unsupported tensor metadata {metadata!r} (only 'conj' and 'neg' are known)")
    return bool(metadata.get("conj", False)), bool(metadata.get("neg", False))


def _make_ref(storage: Any, offset: Any, size: Any, stride: Any, dtype: np.dtype, metadata: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise PickleRefused(f"a tensor rebuild got {type(storage).__name__}, expected a storage persistent id")
    size_t, stride_t = _ints(size, "size"), _ints(stride, "stride")
    if len(size_t) != len(stride_t):
        raise PickleRefused(f"size {size_t} and stride {stride_t} have different ranks")
    if any(v < 0 for v in size_t + stride_t) or _int(offset, "storage offset") < 0:
        raise PickleRefused(f"negative size, stride or offset: size {size_t}, stride {stride_t}, offset {offset}")
    conj, neg = _metadata_bits(metadata)
    return TensorRef(storage, offset, size_t, stride_t, dtype, conj, neg)


def _rebuild_tensor(storage, storage_offset, size, stride):
    dtype = storage.dtype if isinstance(storage, StorageRef) else None
    return _make_ref(storage, storage_offset, size, stride, dtype, None)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    dtype = storage.dtype if isinstance(storage, StorageRef) else None
    return _make_ref(storage, storage_offset, size, stride, dtype, metadata)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(dtype, _TorchDtype):
        raise PickleRefused(f"_rebuild_tensor_v3 got dtype {dtype!r}, expected a torch dtype global")
    return _make_ref(storage, storage_offset, size, stride, TORCH_DTYPES[dtype.name], metadata)


def _as_parameter(data: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise PickleRefused(f"a Parameter rebuild got {type(data).__name__}, expected a tensor")
    return dataclasses.replace(data, is_parameter=True)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    return _as_parameter(data)


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    return _as_parameter(data)


def _rebuild_from_type_v2(func, new_type, args, state):
    # NOTE: torch uses this for tensor subclasses; only plain Tensor / Parameter are accepted,
    # and ``func`` must itself be one of our rebuild stand-ins (it came through find_class).
    func = func.function if isinstance(func, _Call) else None
    if not isinstance(new_type, _Tensor) or func not in _REBUILDS:
        raise PickleRefused(f"_rebuild_from_type_v2 of {getattr(new_type, 'name', new_type)!r} is not a plain tensor")
    ref = func(*args)
    return _as_parameter(ref) if new_type.name == "Parameter" else ref


def _codecs_encode(text, encoding="utf-8"):
    # Protocol-2 pickles write ``bytes`` as ``_codecs.encode(str, 'latin1')``.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise PickleRefused(f"_codecs.encode({text!r:.40}, {encoding!r}) is not a latin-1 bytes literal")
    return text.encode("latin1")


def _device(*args):
    return ":".join(str(a) for a in args)


class _Call(_Sealed):
    """One allowed function as the pickle sees it (see ``find_class``)."""

    __slots__ = ("function",)

    def __init__(self, function):
        object.__setattr__(self, "function", function)

    def __repr__(self) -> str:
        return f"<allowed {self.function.__name__}>"

    def __call__(self, *args):
        if not isinstance(self.function, types.FunctionType) or self.function not in _STAND_INS:
            raise PickleRefused(f"a pickled call was redirected to {self.function!r:.60}")
        return self.function(*args)


_REBUILDS = {_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3}

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _Tensor("Tensor"),
    ("torch._tensor", "Tensor"): _Tensor("Tensor"),
    ("torch.nn.parameter", "Parameter"): _Tensor("Parameter"),
    ("torch", "Size"): tuple,
    ("torch", "device"): _device,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("_codecs", "encode"): _codecs_encode,
}
_ALLOWED.update({("torch", name): _TorchDtype(name) for name in TORCH_DTYPES})
_STAND_INS = {f for f in _ALLOWED.values() if isinstance(f, types.FunctionType)}
_STORAGE_CLASSES = {("torch", name) for name in STORAGE_DTYPES} | {
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "TypedStorage"),
}


class _StorageClass(_Sealed):
    """A ``torch.<Name>Storage`` class named by a persistent id (a fresh one per lookup)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def dtype(self) -> np.dtype | None:
        if self.name in STORAGE_DTYPES:
            return STORAGE_DTYPES[self.name]
        return _UNTYPED if self.name == "UntypedStorage" else None


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the allow-listed globals and storage persistent ids.

    Args:
        file: a binary file positioned at the start of one pickle.
        legacy: True for the pre-1.6 stream, whose storage ids carry a sixth field (view
            metadata).

    After :meth:`load`, :attr:`storages` maps each storage key to its :class:`StorageRef`.

    Raises (from :meth:`load`):
        PickleRefused: a global outside the allow-list, an unknown persistent id, a storage key
            seen with two dtypes, or arguments of the wrong kind to a rebuild function.
    """

    def __init__(self, file: io.BufferedIOBase, *, legacy: bool = False):
        super().__init__(file)
        self.legacy = legacy
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STORAGE_CLASSES:
            return _StorageClass(module, name)
        try:
            found = _ALLOWED[(module, name)]
        except KeyError:
            raise PickleRefused(f"global '{module}.{name}' is not allowed in a weights file") from None
        # NOTE: a fresh slotted wrapper per lookup: the BUILD opcode can setattr on any object the
        # pickle holds, and must not reach our module-level functions (``__defaults__`` ...).
        return _Call(found) if isinstance(found, types.FunctionType) else found

    def persistent_load(self, pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or not pid or pid[0] != "storage":
            kind = pid[0] if isinstance(pid, tuple) and pid else pid
            raise PickleRefused(f"persistent id {kind!r:.60} is not a storage")
        expected = 6 if self.legacy else 5
        if len(pid) != expected:
            raise PickleRefused(f"storage persistent id has {len(pid)} fields, expected {expected}")
        storage_class, key, location, numel = pid[1:5]
        if not isinstance(storage_class, _StorageClass) or storage_class.dtype is None:
            raise PickleRefused(f"storage type {storage_class!r:.60} is not a known torch storage class")
        if not isinstance(key, str) or not isinstance(location, str):
            raise PickleRefused(f"storage key {key!r:.40} / location {location!r:.40} are not strings")
        if self.legacy and pid[5] is not None:
            raise PickleRefused(f"storage '{key}' is a pre-1.3 storage view (view metadata {pid[5]!r:.60})")
        ref = StorageRef(key, storage_class.dtype, _int(numel, "storage numel"))
        if ref.numel < 0:
            raise PickleRefused(f"storage '{key}' has a negative length {ref.numel}")
        seen = self.storages.setdefault(key, ref)
        if seen.dtype != ref.dtype:
            raise PickleRefused(f"storage '{key}' is referenced as {seen.dtype} and as {ref.dtype}")
        return seen
