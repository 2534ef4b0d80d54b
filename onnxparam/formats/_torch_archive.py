"""The two containers ``torch.save`` writes, opened without torch: the zip archive and the legacy
stream. Each yields the unpickled object tree (tensor leaves are :class:`TensorRef`) and a
function that returns a storage's bytes, bounds-checked, sliced from a read-only map of the file.

Layouts (in our words; the full description is ``docs/pytorch_checkpoint.md``):

Zip archive (``torch.save`` since torch 1.6)::

    <archive>/data.pkl              the object tree, pickle protocol 2; storages are persistent
                                    ids ('storage', StorageClass, key, location, numel)
    <archive>/data/<key>            one record per storage: its raw bytes, stored (not deflated),
                                    aligned to 64 bytes in the file through the local header's
                                    extra field
    <archive>/byteorder             optional: 'little' or 'big', the element byte order
    <archive>/version, .format_version, .storage_alignment, .data/...   ignored

``<archive>`` is any single folder name (torch writes the stem of the file name it was given, or
``archive`` when it writes to a file object).

Legacy stream (``_use_new_zipfile_serialization=False``, and every file before torch 1.6): five
pickles and raw data back to back::

    pickle  MAGIC_NUMBER             0x1950a86a20f9469cfc6c
    pickle  PROTOCOL_VERSION         1001
    pickle  sys_info                 {'protocol_version', 'little_endian', 'type_sizes'}
    pickle  the object tree          storages are ('storage', Class, key, location, numel, view)
    pickle  storage keys             a list of str, in the order the storages follow
    then per key: int64 little-endian element count, then count * itemsize raw bytes

Legacy tar (torch < 0.4; ``tarfile`` PAX/ustar; torch/serialization.py ``_load``, tar branch): four
members::

    sys_info    one pickle: {'protocol_version', 'little_endian', 'type_sizes'}
    storages    pickle count; per storage: pickle (key, location, StorageClass), then int64
                little-endian element count and count * itemsize raw bytes; then pickle a list
                of views (view key, root key, offset, numel), in elements of the root
    tensors     pickle count; per tensor: pickle (key, storage key, TensorClass), then int32 ndim,
                4 padding bytes, ndim int64 sizes, ndim int64 strides, int64 storage offset
    pickle      the object tree; a tensor (or storage) is the persistent id str(key)
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from typing import Any

from ..core.errors import RecordError
from ._torch_pickle import STORAGE_DTYPES, PickleRefused, RestrictedUnpickler, StorageRef, TensorRef, _StorageClass

__all__ = ["MAGIC_NUMBER", "PROTOCOL_VERSION", "open_checkpoint", "StorageBytes"]

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
"""First pickle of a legacy stream (torch/serialization.py)."""
PROTOCOL_VERSION = 1001
"""Second pickle of a legacy stream."""

_ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, 22 bytes we skip, name length, extra length
_PICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    AttributeError,
    TypeError,
    ValueError,
    IndexError,
    KeyError,
    RecursionError,
    OverflowError,
    MemoryError,
    struct.error,
)

class StorageBytes:
    """``storage_bytes(ref)``: a storage's bytes (exactly ``ref.nbytes``, a read-only view of the
    map) or a RecordError; :meth:`file_offset` says where they start in the file."""

    def __init__(self, read: Callable[[StorageRef], "tuple[memoryview, int | None]"]):
        self._read = read
        self._cache: dict[str, tuple[memoryview, int | None]] = {}

    def _get(self, ref: StorageRef) -> "tuple[memoryview, int | None]":
        found = self._cache.get(ref.key)
        if found is None:
            found = self._cache[ref.key] = self._read(ref)
        return found

    def __call__(self, ref: StorageRef) -> memoryview:
        return self._get(ref)[0]

    def file_offset(self, ref: StorageRef) -> "int | None":
        """The byte of the file where the storage's bytes start; ``None`` when they were
        decompressed (a zip re-packed with deflate)."""
        return self._get(ref)[1]


def open_checkpoint(path: str | os.PathLike) -> tuple[Any, StorageBytes, str]:
    """Open a ``torch.save`` file and unpickle its object tree without reading storages.

    Returns:
        ``(tree, storage_bytes, byteorder)``: the object tree with :class:`TensorRef` leaves, a
        function giving one storage's bytes (a read-only memoryview of the mapped file), and
        ``'little'`` or ``'big'``, the element byte order of every storage.

    Raises:
        RecordError: the file is neither container, is truncated, or its pickle names a global
            outside the allow-list (the message names the file and the global).
        FileMissingError / IsAFolderError: no such file / a folder.
    """
    path = os.fspath(path)
    from ._extensions import check_readable

    check_readable(path, "the PyTorch checkpoint")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise RecordError(f"{path}: the file is empty, expected a PyTorch checkpoint")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if head == _ZIP_MAGIC:
                return _open_zip(path, f, mapped)
            if mapped[257:262] == b"ustar":
                return _open_tar(path, f, mapped)
            f.seek(0)
            return _open_legacy(path, f, mapped)
    except OSError as e:
        raise RecordError(f"{path}: cannot read the file ({e.strerror or e})") from e


def _unpickle(path: str, file, *, legacy: bool, what: str) -> tuple[Any, dict[str, StorageRef]]:
    unpickler = RestrictedUnpickler(file, legacy=legacy)
    try:
        tree = unpickler.load()
    except PickleRefused as e:
        raise RecordError(f"{path}: refused {what}: {e}; nothing in it was run") from None
    except _PICKLE_ERRORS as e:
        raise RecordError(f"{path}: {what} is not a valid pickle ({type(e).__name__}: {e})") from None
    return tree, unpickler.storages


# -- zip archive -----------------------------------------------------------------------------


def _open_zip(path: str, f, mapped: mmap.mmap) -> tuple[Any, StorageBytes, str]:
    try:
        archive = zipfile.ZipFile(f)
        infos = {info.filename: info for info in archive.infolist()}
    except (zipfile.BadZipFile, EOFError, ValueError, struct.error) as e:
        raise RecordError(f"{path}: not a readable zip archive ({e}); the file may be truncated") from None
    pickles = [name for name in infos if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise RecordError(
            f"{path}: expected exactly one '<archive>/data.pkl' record in the zip, found "
            f"{pickles or 'none'}; this is not a torch.save file"
        )
    prefix = pickles[0][: -len("data.pkl")]
    try:
        with archive.open(pickles[0]) as pkl:
            tree, storages = _unpickle(path, pkl, legacy=False, what=f"'{pickles[0]}'")
        byteorder = "little"
        if prefix + "byteorder" in infos:
            byteorder = archive.read(prefix + "byteorder").decode("ascii", "replace").strip()
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise RecordError(f"{path}: zip record unreadable ({e}); the file may be truncated") from None
    if byteorder not in ("little", "big"):
        raise RecordError(f"{path}: '{prefix}byteorder' says {byteorder!r}, expected 'little' or 'big'")
    def storage_bytes(ref: StorageRef) -> tuple[memoryview, int | None]:
        name = f"{prefix}data/{ref.key}"
        info = infos.get(name)
        if info is None:
            raise RecordError(f"{path}: storage '{ref.key}' has no record '{name}' in the zip")
        if info.file_size < ref.nbytes:
            raise RecordError(
                f"{path}: storage '{ref.key}' holds {info.file_size} bytes, but the pickle declares "
                f"{ref.numel} elements of {ref.dtype} = {ref.nbytes} bytes"
            )
        if info.compress_type == zipfile.ZIP_STORED:
            start = _data_offset(path, mapped, info)
            return memoryview(mapped)[start : start + ref.nbytes], start
        else:  # NOTE: torch never compresses storages; other zip tools may have re-packed the file.
            try:
                with zipfile.ZipFile(path) as reopened:  # the handle opened above is closed by now
                    view = memoryview(reopened.read(name))[: ref.nbytes]
            except (zipfile.BadZipFile, EOFError, OSError) as e:
                raise RecordError(f"{path}: record '{name}' unreadable ({e})") from None
        return view, None

    return tree, StorageBytes(storage_bytes), byteorder


def _data_offset(path: str, mapped: mmap.mmap, info: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes start: after its local header, name and extra field."""
    start = info.header_offset
    if start + _LOCAL_HEADER.size > len(mapped):
        raise RecordError(f"{path}: the local header of '{info.filename}' lies past the end of the file")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(mapped, start)
    if signature != _ZIP_MAGIC:
        raise RecordError(f"{path}: bad local header signature for '{info.filename}' at byte {start}")
    data = start + _LOCAL_HEADER.size + name_len + extra_len
    if data + info.file_size > len(mapped):
        raise RecordError(
            f"{path}: record '{info.filename}' ends at byte {data + info.file_size}, past the end of "
            f"the file ({len(mapped)} bytes); the file is truncated"
        )
    return data


# -- legacy stream ---------------------------------------------------------------------------


def _open_legacy(path: str, f, mapped: mmap.mmap) -> tuple[Any, StorageBytes, str]:
    magic, _ = _unpickle(path, f, legacy=True, what="the magic number")
    if magic != MAGIC_NUMBER:
        raise RecordError(
            f"{path}: neither a zip archive nor a legacy torch stream (first pickle {magic!r:.40}, "
            f"expected the magic number {MAGIC_NUMBER:#x}) nor a legacy tar"
        )
    protocol, _ = _unpickle(path, f, legacy=True, what="the protocol version")
    if protocol != PROTOCOL_VERSION:
        raise RecordError(f"{path}: legacy protocol version {protocol!r}, expected {PROTOCOL_VERSION}")
    sys_info, _ = _unpickle(path, f, legacy=True, what="sys_info")
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
        raise RecordError(
            f"{path}: the legacy stream was written big-endian (sys_info {sys_info!r:.80}); re-save it with "
            "torch.save on a little-endian machine"
        )
    tree, storages = _unpickle(path, f, legacy=True, what="the main pickle")
    keys, _ = _unpickle(path, f, legacy=True, what="the storage key list")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise RecordError(f"{path}: the storage key list is {keys!r:.60}, expected a list of str")
    offsets: dict[str, int] = {}
    pos = f.tell()
    for key in keys:
        ref = storages.get(key)
        if ref is None:
            raise RecordError(f"{path}: storage '{key}' follows the pickle but no tensor refers to it")
        if pos + 8 > len(mapped):
            raise RecordError(f"{path}: storage '{key}' starts at byte {pos}, past the end of the file")
        (count,) = struct.unpack_from("<q", mapped, pos)
        if count != ref.numel:
            raise RecordError(
                f"{path}: storage '{key}' holds {count} elements, the pickle declares {ref.numel}"
            )
        offsets[key] = pos + 8
        pos += 8 + count * ref.dtype.itemsize
        if pos > len(mapped):
            raise RecordError(
                f"{path}: storage '{key}' ends at byte {pos}, past the end of the file ({len(mapped)} "
                "bytes); the file is truncated"
            )
    missing = sorted(set(storages) - set(offsets))
    if missing:
        raise RecordError(f"{path}: storages {missing} are referenced but not in the storage key list")

    def storage_bytes(ref: StorageRef) -> tuple[memoryview, int]:
        start = offsets[ref.key]
        return memoryview(mapped)[start : start + ref.nbytes], start

    return tree, StorageBytes(storage_bytes), "little"


# -- legacy tar ------------------------------------------------------------------------------


class _TarUnpickler(RestrictedUnpickler):
    """The legacy tar's pickles: its metadata pickles also name ``torch.<Type>Tensor`` classes
    (the tensor's original type, unused), and its object tree names tensors by the persistent
    id ``str(key)``."""

    def __init__(self, file, tensors: "dict | None" = None):
        super().__init__(file, legacy=True)
        self.tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name.endswith("Tensor") and name[: -len("Tensor")] + "Storage" in STORAGE_DTYPES:
            return _StorageClass(module, name)  # a sealed marker; never called
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self.tensors is None or not isinstance(pid, str):
            raise PickleRefused(f"persistent id {pid!r:.60} is not a tensor key of a legacy tar")
        try:
            return self.tensors[int(pid)]
        except (ValueError, KeyError):
            raise PickleRefused(f"persistent id {pid!r:.60} names no tensor of the 'tensors' member") from None


def _tar_load(path: str, file, what: str, tensors=None) -> Any:
    unpickler = _TarUnpickler(file, tensors)
    try:
        return unpickler.load()
    except PickleRefused as e:
        raise RecordError(f"{path}: refused {what}: {e}; nothing in it was run") from None
    except _PICKLE_ERRORS as e:
        raise RecordError(f"{path}: {what} is not a valid pickle ({type(e).__name__}: {e})") from None


class _Section:
    """One tar member as a read-only file over the map (``read`` / ``readline`` / ``tell``)."""

    def __init__(self, mapped: mmap.mmap, start: int, size: int):
        self.view = memoryview(mapped)[start : start + size]
        self.start, self.pos = start, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = bytes(self.view[self.pos : end])
        self.pos = end
        return out

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        end = bytes(self.view[self.pos :]).find(b"\n")
        return self.read(-1 if end < 0 else end + 1)

    def exact(self, n: int, what: str, path: str) -> bytes:
        data = self.read(n)
        if len(data) != n:
            raise RecordError(f"{path}: {what} ends past its tar member; the file is truncated")
        return data


def _int_key(value: Any, what: str, path: str) -> int:
    if type(value) is not int:
        raise RecordError(f"{path}: {what} is {value!r:.40}, expected an int key")
    return value


def _open_tar(path: str, f, mapped: mmap.mmap) -> tuple[Any, StorageBytes, str]:
    import tarfile

    try:
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r:") as tar:
            members = {m.name: m for m in tar.getmembers()}
    except (tarfile.TarError, EOFError, OSError, ValueError, UnicodeError) as e:
        raise RecordError(f"{path}: not a readable legacy torch tar ({e}); the file may be truncated") from None
    sections = {}
    for name in ("sys_info", "storages", "tensors", "pickle"):
        member = members.get(name)
        if member is None or not member.isfile():
            raise RecordError(f"{path}: a legacy torch tar needs a '{name}' file member; the tar holds "
                              f"{sorted(members)[:8]}")
        if member.offset_data + member.size > len(mapped):
            raise RecordError(f"{path}: tar member '{name}' ends past the end of the file; the file is truncated")
        sections[name] = _Section(mapped, member.offset_data, member.size)
    sys_info = _tar_load(path, sections["sys_info"], "sys_info")
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
        raise RecordError(f"{path}: the legacy tar was written big-endian (sys_info {sys_info!r:.80}); re-save it "
                          "with torch.save on a little-endian machine")

    storages: dict[int, tuple[StorageRef, int]] = {}  # key -> (ref, first byte in the file)
    sec = sections["storages"]
    count = _tar_load(path, sec, "the storage count")
    if type(count) is not int or count < 0 or count > len(mapped):
        raise RecordError(f"{path}: the storage count is {count!r:.40}, expected a small int")
    for _ in range(count):
        entry = _tar_load(path, sec, "a storage header")
        if not isinstance(entry, tuple) or len(entry) != 3 or not isinstance(entry[2], _StorageClass) \
                or entry[2].dtype is None or entry[2].name == "UntypedStorage":
            raise RecordError(f"{path}: storage header {entry!r:.80} is not (key, location, torch.<Type>Storage)")
        key = _int_key(entry[0], "a storage key", path)
        dtype = entry[2].dtype
        (numel,) = struct.unpack("<q", sec.exact(8, f"storage {key}'s length", path))
        nbytes = numel * dtype.itemsize
        if numel < 0 or sec.pos + nbytes > len(sec.view):
            raise RecordError(f"{path}: storage {key} declares {numel} elements, past the end of the 'storages' "
                              "member; the file is truncated")
        storages[key] = (StorageRef(str(key), dtype, numel), sec.start + sec.pos)
        sec.pos += nbytes
    views = _tar_load(path, sec, "the storage view list")
    if not isinstance(views, list):
        raise RecordError(f"{path}: the storage view list is {views!r:.60}, expected a list")
    for view in views:
        if not isinstance(view, tuple) or len(view) != 4 or not all(type(v) is int for v in view):
            raise RecordError(f"{path}: storage view {view!r:.60} is not (key, root key, offset, numel)")
        target, root_key, offset, numel = view
        root = storages.get(root_key)
        if root is None or offset < 0 or numel < 0 or offset + numel > root[0].numel:
            raise RecordError(f"{path}: storage view {view!r:.60} reaches outside its root storage")
        storages[target] = (StorageRef(str(target), root[0].dtype, numel), root[1] + offset * root[0].dtype.itemsize)

    tensors: dict[int, TensorRef] = {}
    sec = sections["tensors"]
    count = _tar_load(path, sec, "the tensor count")
    if type(count) is not int or count < 0 or count > len(mapped):
        raise RecordError(f"{path}: the tensor count is {count!r:.40}, expected a small int")
    for _ in range(count):
        entry = _tar_load(path, sec, "a tensor header")
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise RecordError(f"{path}: tensor header {entry!r:.80} is not (key, storage key, tensor type)")
        key = _int_key(entry[0], "a tensor key", path)
        found = storages.get(_int_key(entry[1], "a tensor's storage key", path))
        if found is None:
            raise RecordError(f"{path}: tensor {key} refers to storage {entry[1]!r:.40}, which the tar does not hold")
        (ndim,) = struct.unpack("<i", sec.exact(4, f"tensor {key}'s rank", path))
        if not 0 <= ndim <= 64:
            raise RecordError(f"{path}: tensor {key} has rank {ndim}")
        sec.exact(4, f"tensor {key}'s padding", path)
        size = struct.unpack(f"<{ndim}q", sec.exact(8 * ndim, f"tensor {key}'s sizes", path))
        stride = struct.unpack(f"<{ndim}q", sec.exact(8 * ndim, f"tensor {key}'s strides", path))
        (offset,) = struct.unpack("<q", sec.exact(8, f"tensor {key}'s offset", path))
        if any(v < 0 for v in size + stride) or offset < 0:
            raise RecordError(f"{path}: tensor {key} has a negative size, stride or offset")
        ref = found[0]
        tensors[key] = TensorRef(ref, offset, tuple(size), tuple(stride), ref.dtype)
    tree = _tar_load(path, sections["pickle"], "the object tree", tensors)
    starts = {ref.key: start for ref, start in storages.values()}

    def storage_bytes(ref: StorageRef) -> tuple[memoryview, int]:
        start = starts[ref.key]
        return memoryview(mapped)[start : start + ref.nbytes], start

    return tree, StorageBytes(storage_bytes), "little"
