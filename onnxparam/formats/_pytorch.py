"""PyTorch checkpoints (``.pt`` / ``.pth`` / ``.bin`` written by ``torch.save``), read without torch.

:func:`read_pytorch` opens both containers torch writes — the zip archive (default since
torch 1.6) and the legacy stream (``_use_new_zipfile_serialization=False``) — and returns the
tensors as read-only numpy arrays keyed by dotted names. Nothing in the file is executed: the
pickle goes through a restricted unpickler that knows only the tensor / parameter rebuild
functions, ``OrderedDict``, the storage classes, ``torch.device`` / ``torch.Size`` / dtypes and
plain containers; any other global is refused with a :class:`~onnxparam.core.errors.RecordError`
naming it, before anything is called. The byte layouts are described in
``docs/pytorch_checkpoint.md``; the options mirror Burn's ``burn-store`` PyTorch reader
(``PytorchStore``: top-level key, chained regex key remapping, contiguous index re-numbering,
partial loading).

The file is mapped, not read: a tensor that is a contiguous slice of its storage is a read-only
view of the map (the map stays open while such an array lives); strided tensors (transposes,
``expand``'s zero strides, every other non-contiguous view) are copied out C-contiguous when
they are looked up (:class:`CheckpointTensors`), one at a time, never all at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..core.errors import RecordError
from ._limits import name_problem, shape_problem
from ._names import KeyRemapper, map_indices_contiguous
from ._torch_archive import StorageBytes, open_checkpoint
from ._torch_pickle import TensorRef

__all__ = ["PytorchCheckpoint", "CheckpointTensors", "read_pytorch", "pytorch_record", "MAX_EXPANDED_BYTES"]

MAX_EXPANDED_BYTES = 1 << 30
"""The largest copy of a view that is *bigger than its storage* (zero strides from ``expand``,
overlapping strides): 1 GiB. NOTE: such a view is cheap in torch but copied out here; without a
bound, a few bytes of file with shape ``(10**12,)`` and stride ``(0,)`` would exhaust memory.
Views that fit in their storage (slices, transposes) are never limited."""


@dataclasses.dataclass(frozen=True)
class PytorchCheckpoint:
    """The tensors of a PyTorch checkpoint, and what was left out.

    Attributes:
        tensors: dotted name -> read-only numpy array, in the file's order (the pickle's dict
            order): a :class:`CheckpointTensors` mapping (strided tensors are copied when
            looked up; shapes and dtypes are known without reading). Shape and dtype are torch's (``torch.bfloat16`` -> ``ml_dtypes.bfloat16``,
            ``torch.bool`` -> ``bool``, ``torch.uint16`` -> ``uint16`` ...); PyTorch layouts
            are kept (``nn.Linear.weight`` is ``(out, in)``).
        skipped: dotted paths of values that are not tensors (an epoch int, optimizer
            hyper-parameters ...). A container holding no tensor at all is reported once, by
            its own path.
        excluded: names of tensors left out by ``include``.
        tied: groups of names (each sorted, ``len >= 2``) that are one tensor in the file —
            the same storage, offset, size, stride and dtype, as ``lm_head.weight`` and
            ``embed.weight`` of a model with tied embeddings. NOTE: every name of a group maps
            to the *same* array object, so ties survive into ``tensors``.
        shared: groups of names whose tensors are *different* views of one storage (e.g. the
            q/k/v slices of a fused projection). They are separate arrays.
        byteorder: ``'little'`` or ``'big'``, as the file recorded it; arrays are returned in
            native order either way.
    """

    tensors: "CheckpointTensors"
    skipped: list[str]
    excluded: list[str]
    tied: list[tuple[str, ...]]
    shared: list[tuple[str, ...]]
    byteorder: str = "little"


def read_pytorch(
    path: str | os.PathLike,
    *,
    top_level_key: str | None = None,
    key_remap: Sequence[tuple[str, str]] | Any = (),
    renumber: bool = False,
    include: str | Sequence[str] | None = None,
) -> PytorchCheckpoint:
    """Read the tensors of a ``torch.save`` file without importing torch or running its pickle.

    Names are the dotted paths of the tensors in the saved object: nested dict keys (and list /
    tuple indices) joined with ``.``; a bare saved tensor is named ``"tensor"``. Then, in order:

    1. ``top_level_key`` selects one entry of the top dict first (``"state_dict"``, ``"model"``).
    2. ``key_remap`` applies each ``(pattern, replacement)`` with :func:`re.sub` to every name,
       one rule after the other (a later rule sees the earlier rules' output):
       :class:`~onnxparam.formats._names.KeyRemapper`, Burn's ``KeyRemapper``. ``[(r"^module\\.", "")]`` strips a DataParallel prefix.
    3. ``include`` keeps only names matching at least one regex (:func:`re.search`); the others
       are listed in ``excluded`` and their storages are never read.
    4. ``renumber`` renames integer path components to ``0..n-1`` in ascending order among
       siblings that share a prefix (:func:`~onnxparam.formats._names.map_indices_contiguous`): ``layers.0``, ``layers.2``, ``layers.5`` become
       ``layers.0``, ``layers.1``, ``layers.2`` (nested indices are re-numbered per parent).

    Args:
        path: the checkpoint file.
        top_level_key: an entry of the top-level dict holding the state dict.
        key_remap: ``(pattern, replacement)`` pairs in :func:`re.sub` syntax, or any object
            with an ``apply(name) -> name`` method (the converter's ``KeyRemapper``, which also
            takes Burn's ``$1`` replacements).
        renumber: re-number gappy integer indices contiguously (opt-in).
        include: a regex or several; ``None`` keeps every tensor.

    Returns:
        A :class:`PytorchCheckpoint` (tensors, skipped, excluded, tied and shared names).

    Raises:
        FileMissingError: no such file (also a ``FileNotFoundError``). IsAFolderError: a folder
            (also an ``IsADirectoryError``).
        RecordError: the file is not a torch checkpoint or is truncated; its pickle names a
            global outside the allow-list (message: the global's ``module.name`` and the file;
            nothing is called); a tensor's view reaches past its storage (message: tensor name,
            needed and available bytes); a view bigger than its storage would expand past
            :data:`MAX_EXPANDED_BYTES`; ``top_level_key`` is absent; a regex is invalid; two
            names collide after remapping / re-numbering.
    """
    path = os.fspath(path)
    try:
        tree, storage_bytes, byteorder = open_checkpoint(path)
    except RecordError as e:
        from ._extensions import other_format_message

        other = other_format_message(path, "pytorch")  # a burnpack / safetensors / ONNX file says so
        if other is None:
            raise
        raise RecordError(f"{e}; {other}") from e
    if top_level_key is not None:
        if not isinstance(tree, dict) or top_level_key not in tree:
            keys = sorted(map(str, tree)) if isinstance(tree, dict) else type(tree).__name__
            raise RecordError(f"{path}: top_level_key {top_level_key!r} not found; the top level holds {keys}")
        tree = tree[top_level_key]
    refs: dict[str, TensorRef] = {}
    skipped: list[str] = []
    _flatten(tree, "", refs, skipped)
    if not refs and isinstance(tree, TensorRef):
        refs["tensor"] = tree
    names = _remap(path, list(refs), key_remap)
    refs = _rename(path, refs, names)
    bad = [problem for problem in map(name_problem, refs) if problem is not None]
    if bad:
        raise RecordError(f"{path}: tensors the library cannot name", bad)
    patterns = _compile(path, [include] if isinstance(include, str) else list(include or ()), "include")
    excluded = [n for n in refs if patterns and not any(p.search(n) for p in patterns)]
    for name in excluded:
        del refs[name]
    if renumber:
        mapping = map_indices_contiguous(refs)
        refs = _rename(path, refs, [mapping[n] for n in refs])
    tensors, tied, shared = _materialize(path, refs, storage_bytes, byteorder)
    return PytorchCheckpoint(tensors, skipped, excluded, tied, shared, byteorder)


def pytorch_record(
    checkpoint: PytorchCheckpoint,
    *,
    drop: str | None = r"(^|\.)num_batches_tracked$",
) -> dict[str, np.ndarray]:
    """A plain ``{dotted name: array}`` dict of the checkpoint's tensors.

    To load a checkpoint into a module use :func:`onnxparam.convert.load_pytorch` (the one
    loading path: the PyTorch adapter transposes Linear weights by layer type, renames norm
    params and reports ``num_batches_tracked`` as ignored); this helper only filters names.

    Args:
        checkpoint: what :func:`read_pytorch` returned.
        drop: a regex of names to leave out; by default PyTorch's BatchNorm
            ``num_batches_tracked`` counters, which have no Burn param. ``None`` keeps all.

    Returns:
        A new dict (tied names still share one array object).
    """
    pattern = re.compile(drop) if drop else None
    return {n: a for n, a in checkpoint.tensors.items() if pattern is None or not pattern.search(n)}


# -- names -----------------------------------------------------------------------------------


def _flatten(node: Any, prefix: str, refs: dict[str, TensorRef], skipped: list[str]) -> bool:
    """Collect tensor leaves under dotted names; report non-tensors. Returns True if any tensor."""
    if isinstance(node, TensorRef):
        if prefix:
            refs[prefix] = node
        return True
    if isinstance(node, dict):
        items: Iterable = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        skipped.append(prefix or "<top level>")
        return False
    mark_skipped = len(skipped)
    found = False
    for key, value in items:
        found |= _flatten(value, f"{prefix}.{key}" if prefix else str(key), refs, skipped)
    if not found and prefix:
        del skipped[mark_skipped:]  # NOTE: a container without tensors is reported once, by its path
        skipped.append(prefix)
    return found


def _compile(path: str, patterns: Sequence[str], what: str) -> list[re.Pattern]:
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise RecordError(f"{path}: {what} regex {p!r} is invalid ({e})") from None
    return compiled


def _remap(path: str, names: list[str], rules: Any) -> list[str]:
    try:
        remapper = KeyRemapper.of(rules)
    except re.error as e:
        raise RecordError(f"{path}: key_remap regex {getattr(e, 'pattern', '?')!r} is invalid ({e})") from None
    try:
        return [remapper.apply(n) for n in names]
    except (re.error, IndexError) as e:
        raise RecordError(f"{path}: key_remap {remapper!r} failed ({e})") from None


def _rename(path: str, refs: dict[str, TensorRef], new_names: list[str]) -> dict[str, TensorRef]:
    out: dict[str, TensorRef] = {}
    sources: dict[str, str] = {}
    problems = []
    for old, new in zip(list(refs), new_names):
        if new in out:
            problems.append(f"'{sources[new]}' and '{old}' both become '{new}'")
            continue
        out[new], sources[new] = refs[old], old
    if problems:
        raise RecordError(f"{path}: tensor names collide after renaming", problems)
    return out


# -- bytes -----------------------------------------------------------------------------------


class CheckpointTensors(Mapping):
    """The tensors of a checkpoint: ``name -> read-only numpy array``, in the file's order.

    Nothing is copied when the checkpoint is read. A tensor that is a contiguous slice of its
    storage is a view of the mapped file; any other (a transpose, ``expand``'s zero strides, a
    big-endian file, a ``conj`` / ``neg`` view) is copied out C-contiguous *when it is looked
    up*, and the copy is held only as long as the caller holds it (so converting or inspecting a
    checkpoint of strided tensors holds one copy at a time). Names of one tensor (tied weights)
    give the same array object while it is alive. Bounds were checked when the file was read.
    """

    def __init__(self, views: dict[str, "_View"]):
        self._views = views

    def __getitem__(self, name: str) -> np.ndarray:
        return self._views[name].array()

    def __iter__(self):
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading its data."""
        return tuple(self._views[name].ref.size)

    def dtype(self, name: str) -> np.dtype:
        """The numpy dtype (native byte order) of the tensor, without reading its data."""
        return self._views[name].ref.dtype

    def file_slice(self, name: str) -> tuple[int, int] | None:
        """``(offset, byte count)`` of the tensor's bytes in the file when they are its value as
        it is (contiguous, little-endian, not a ``conj`` / ``neg`` view, stored uncompressed);
        ``None`` otherwise."""
        return self._views[name].file_slice

    def is_lazy_copy(self, name: str) -> bool:
        """Whether looking the tensor up copies it (a strided or converted view)."""
        return self._views[name].view is None


class _View:
    """One distinct tensor view of a storage: a ready array (a view of the map) or the recipe of
    the copy :meth:`array` makes on demand."""

    def __init__(self, ref: TensorRef, raw: memoryview, byteorder: str, file_offset: int | None):
        self.ref, self.raw, self.byteorder = ref, raw, byteorder
        self.view: np.ndarray | None = None
        self.file_slice: tuple[int, int] | None = None
        self._copy: weakref.ref | None = None
        numel = math.prod(ref.size)
        plain = byteorder == "little" and not ref.conj and not ref.neg
        if numel and plain and _is_contiguous(ref.size, ref.stride):
            dtype = ref.dtype
            flat = np.frombuffer(raw, dtype=dtype, count=len(raw) // dtype.itemsize)
            self.view = _read_only(flat[ref.offset : ref.offset + numel].reshape(ref.size))
            if file_offset is not None:
                self.file_slice = (file_offset + ref.offset * dtype.itemsize, numel * dtype.itemsize)

    def array(self) -> np.ndarray:
        if self.view is not None:
            return self.view
        held = self._copy() if self._copy is not None else None
        if held is None:
            held = _copy_out(self.ref, self.raw, self.byteorder)
            self._copy = weakref.ref(held)
        return held


def _materialize(
    path: str, refs: dict[str, TensorRef], storage_bytes: StorageBytes, byteorder: str
) -> tuple[CheckpointTensors, list[tuple[str, ...]], list[tuple[str, ...]]]:
    views: dict[tuple, _View] = {}
    by_view: dict[tuple, list[str]] = {}
    by_storage: dict[str, set[tuple]] = {}
    tensors: dict[str, _View] = {}
    problems = []
    for name, ref in refs.items():
        view = (ref.storage.key, ref.offset, ref.size, ref.stride, ref.dtype.str, ref.conj, ref.neg)
        if view not in views:
            raw = storage_bytes(ref.storage)
            try:
                _check_view(name, ref, raw, byteorder)
            except _ViewError as e:
                problems.append(str(e))
                continue
            views[view] = _View(ref, raw, byteorder, storage_bytes.file_offset(ref.storage))
        tensors[name] = views[view]
        by_view.setdefault(view, []).append(name)
        by_storage.setdefault(ref.storage.key, set()).add(view)
    if problems:
        raise RecordError(f"{path}: tensors do not fit their storage (the file is corrupt or truncated)", problems)
    tied = sorted(tuple(sorted(ns)) for ns in by_view.values() if len(ns) > 1)
    shared = sorted(
        tuple(sorted(n for v in views for n in by_view[v])) for views in by_storage.values() if len(views) > 1
    )
    return CheckpointTensors(tensors), tied, shared


class _ViewError(Exception):
    pass


def _check_view(name: str, ref: TensorRef, raw: memoryview, byteorder: str) -> None:
    """Refuse a view that reads past its storage or expands past :data:`MAX_EXPANDED_BYTES`."""
    itemsize = ref.dtype.itemsize
    problem = shape_problem(ref.size, itemsize)
    if problem is not None:
        raise _ViewError(f"'{name}': {problem}")
    numel = math.prod(ref.size)
    available = len(raw) // itemsize
    if numel * itemsize > max(len(raw), MAX_EXPANDED_BYTES):
        raise _ViewError(
            f"'{name}': shape {ref.size} with stride {ref.stride} would expand {len(raw)} bytes of storage "
            f"'{ref.storage.key}' into {numel * itemsize} bytes (limit {MAX_EXPANDED_BYTES})"
        )
    if numel:
        last = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride))
        if last >= available:
            raise _ViewError(
                f"'{name}': shape {ref.size}, stride {ref.stride}, offset {ref.offset} needs "
                f"{(last + 1) * itemsize} bytes of storage '{ref.storage.key}', which holds {len(raw)}"
            )


def _copy_out(ref: TensorRef, raw: memoryview, byteorder: str) -> np.ndarray:
    """The view's values, C-contiguous, native byte order, a new read-only array (bounds were
    checked by :func:`_check_view`)."""
    dtype = ref.dtype if byteorder == "little" else ref.dtype.newbyteorder(">")
    itemsize = dtype.itemsize
    if math.prod(ref.size) == 0:
        return _read_only(np.empty(ref.size, dtype=ref.dtype))
    flat = np.frombuffer(raw, dtype=dtype, count=len(raw) // itemsize)
    if _is_contiguous(ref.size, ref.stride):  # NOTE: a 0-d tensor too (as_strided would make it 1-d)
        out = flat[ref.offset : ref.offset + math.prod(ref.size)].reshape(ref.size)
    else:
        out = np.ascontiguousarray(np.lib.stride_tricks.as_strided(
            flat[ref.offset :], shape=ref.size, strides=[st * itemsize for st in ref.stride], writeable=False))
    if byteorder != "little" or ref.conj or ref.neg:
        out = out.astype(ref.dtype)  # native byte order; a copy we may modify
        if ref.conj:
            out = np.conj(out)
        if ref.neg:
            out = np.negative(out)
    return _read_only(out)


def _read_only(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable:
        array.flags.writeable = False
    return array


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """C-contiguous as torch defines it: strides of size-1 dims do not matter."""
    step = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != step:
            return False
        step *= s
    return True
