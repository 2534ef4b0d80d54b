"""Writing an ``onnx_ir`` model to disk: external data when needed, streamed, atomic.

Layout of a saved model::

    model.onnx                       the protobuf (graph, small tensors, metadata)
    model.onnx.data                  external data, one file, or shards:
    model-00001-of-00003.onnx.data   ... when it is larger than ``max_shard_size_bytes``

* **When external data is used.** On request (``external_data=True`` or a file name), and
  automatically when the tensors would not fit one protobuf: protobuf refuses messages of 2 GiB
  or more (:data:`PROTOBUF_MAX_BYTES`), so tensors totalling more than
  :data:`AUTO_EXTERNAL_DATA_BYTES` (2 GiB minus headroom for the graph itself) go external.
* **Alignment.** Tensors larger than :data:`ALIGN_THRESHOLD_BYTES` start on a
  :data:`DEFAULT_ALIGNMENT_BYTES` boundary, so ONNX Runtime can memory-map them directly (64 KiB
  is the Windows allocation granularity, a multiple of every page size); smaller tensors are
  packed. Tensors of at most :data:`EXTERNAL_DATA_MIN_TENSOR_BYTES` stay in the protobuf.
* **Streaming.** ``onnx_ir`` writes external data one tensor at a time; a lazy tensor
  (``onnx_ir.LazyTensor``) is evaluated when it is written and dropped after, so peak memory is
  about the largest tensor, not the model.
* **Atomic.** Everything is written into a temporary folder beside the target, flushed to disk,
  and moved into place with ``os.replace``, data files first and the ``.onnx`` last: a reader
  never sees a half-written file, and a failed save leaves the old files as they were. NOTE:
  one rename per file, so between the data files' renames and the ``.onnx``'s an old ``.onnx``
  sits beside new data files of the same name; data names are kept stable (``model.onnx.data``)
  rather than made unique per save, which would close that window but leave old data behind.
* **Permissions.** A read-only ``.onnx``, or a read-only data file the save would replace or
  remove, makes the save fail before anything is written (as ``open(path, "w")`` would; a rename
  alone would not); replaced files keep their permission bits.

Initializer ``metadata_props`` survive external data (``onnx_ir`` drops them when it turns a
tensor external; they are put back before the protobuf is written).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Optional, Union

import onnx
import onnx_ir as ir

from ..core.errors import OnnxFormatError
from ..formats._scratch import (
    check_replaceable,
    create_scratch,
    disk_full_error,
    make_parent_folder,
    preserve_mode,
    release,
)
from ._source import iter_graphs

__all__ = [
    "PROTOBUF_MAX_BYTES",
    "AUTO_EXTERNAL_DATA_BYTES",
    "DEFAULT_MAX_SHARD_SIZE_BYTES",
    "DEFAULT_ALIGNMENT_BYTES",
    "ALIGN_THRESHOLD_BYTES",
    "EXTERNAL_DATA_MIN_TENSOR_BYTES",
    "DATA_SUFFIX",
    "tensor_bytes",
    "save_model",
    "rewrite_metadata",
]

PROTOBUF_MAX_BYTES = 2**31 - 1
"""Protobuf's hard limit on one serialized message (2 GiB - 1)."""

AUTO_EXTERNAL_DATA_BYTES = PROTOBUF_MAX_BYTES - 64 * 2**20
"""Above this many tensor bytes, external data is chosen automatically (64 MiB of headroom is
left for the graph, names and metadata)."""

DEFAULT_MAX_SHARD_SIZE_BYTES = 2**31
"""Default largest external data shard: 2 GiB (a single larger tensor gets a shard of its own)."""

DEFAULT_ALIGNMENT_BYTES = 65536
"""Offset alignment of large external tensors: 64 KiB, the Windows mmap granularity."""

ALIGN_THRESHOLD_BYTES = 2**20
"""Only external tensors larger than 1 MiB are aligned; smaller ones are packed."""

EXTERNAL_DATA_MIN_TENSOR_BYTES = 1024
"""With external data, tensors of at most 1 KiB stay inside the protobuf."""

DATA_SUFFIX = ".data"
"""Default external data file: the model file's name + this suffix (``model.onnx.data``)."""


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of every tensor of the model: initializers (all graphs) and tensor attributes."""
    total = 0
    for graph in iter_graphs(model.graph):
        for value in graph.initializers.values():
            if value.const_value is not None:
                total += value.const_value.nbytes
        for node in graph:
            for attr in node.attributes.values():
                if attr.is_ref():
                    continue
                if attr.type == ir.AttributeType.TENSOR and attr.value is not None:
                    total += attr.value.nbytes
                elif attr.type == ir.AttributeType.TENSORS and attr.value is not None:
                    total += sum(t.nbytes for t in attr.value)
    return total


def _shard_pattern(location: str) -> re.Pattern:
    """The names ``onnx_ir`` gives the shards of ``location``: ``model.onnx.data`` ->
    ``model-00001-of-00003.onnx.data`` (the marker goes before the chain of extensions)."""
    name, suffixes = location, ""
    while True:
        stem, ext = os.path.splitext(name)
        if not ext or not re.fullmatch(r"\.[A-Za-z][A-Za-z0-9_]*", ext):
            break
        name, suffixes = stem, ext + suffixes
    return re.compile(re.escape(name) + r"-\d{5}-of-\d{5}" + re.escape(suffixes) + "$")


def save_model(
    model: ir.Model,
    path: "str | os.PathLike",
    *,
    external_data: Union[None, bool, str] = None,
    max_shard_size_bytes: Optional[int] = DEFAULT_MAX_SHARD_SIZE_BYTES,
    alignment_bytes: Optional[int] = DEFAULT_ALIGNMENT_BYTES,
    external_data_min_tensor_bytes: int = EXTERNAL_DATA_MIN_TENSOR_BYTES,
) -> Path:
    """Write ``model`` to ``path`` (see the module docstring).

    The model is not changed (initializers turned external while writing are restored).

    Args:
        model: the model; lazy initializers are evaluated one at a time while writing.
        path: the ``.onnx`` file.
        external_data: ``None`` (automatic), ``True`` (``<file name>.data``), ``False`` (never),
            or a file name relative to the model's folder.
        max_shard_size_bytes: largest external data shard; ``None`` writes one data file.
        alignment_bytes: alignment of large external tensors; ``None`` packs them.
        external_data_min_tensor_bytes: tensors of at most this size stay in the protobuf.

    Returns:
        the ``pathlib.Path`` of the ``.onnx`` file.

    Raises:
        OnnxFormatError: when ``external_data=False`` but the tensors exceed what one protobuf
            holds, or when ``external_data`` is not a plain relative file name.
        PermissionError: (``EACCES``) the ``.onnx`` or a data file it would replace is read-only
            (whatever the process's privileges), or the folder is not writable; nothing is
            written. The message names that file. Also a folder that refuses new entries
            (``/proc``), or a missing folder that cannot be created there.
        NotADirectoryError: (``ENOTDIR``) a path above ``path`` is a file; the message names it.
        OSError: when the files cannot be written; the message names ``path``.
        Exception: whatever a lazy tensor's function raises (a param's init), as it raised it.
    """
    target = Path(path)
    size = tensor_bytes(model)
    if external_data is None:
        external_data = size > AUTO_EXTERNAL_DATA_BYTES
    if external_data is False and size > AUTO_EXTERNAL_DATA_BYTES:
        raise OnnxFormatError(
            f"{target}: the model's tensors take {size} bytes, more than one protobuf can hold (2 GiB); "
            "save with external_data=True (or None, the default)"
        )
    location: Optional[str] = None
    if external_data is True:
        location = target.name + DATA_SUFFIX
    elif isinstance(external_data, (str, os.PathLike)) and external_data is not False:
        location = os.fspath(external_data)
        if os.path.isabs(location) or os.path.dirname(location):
            raise OnnxFormatError(
                f"{target}: external_data must be a file name in the model's folder, got {location!r}"
            )
    make_parent_folder(target)  # NOTE: library errors naming the path (a file on the way, /proc ...)
    # NOTE: a rename replaces a read-only file that open(path, "w") refuses: check the model
    # file and every data file this save may replace or remove, before anything is written.
    modes = {target.name: check_replaceable(target)}
    if location is not None:
        shards = _shard_pattern(location)
        for entry in sorted(target.parent.iterdir()):
            if entry.name == location or shards.match(entry.name):
                modes[entry.name] = check_replaceable(entry)
    tmp_dir, _ = create_scratch(target, lambda p: p.mkdir())
    try:
        tmp_model = tmp_dir / target.name
        try:
            if location is None:
                from ._ir_stream import save_inline  # NOTE: field by field, one tensor in memory

                save_inline(model, tmp_model)
            else:
                _save_external(model, tmp_model, location, max_shard_size_bytes, alignment_bytes,
                               external_data_min_tensor_bytes)
        except ir.serde.SerdeError as e:
            # NOTE: onnx_ir wraps an error raised while it evaluates a lazy value (a param's init
            # function) in one SerdeError per nesting level, each naming its own call; the
            # caller's own error is the useful one.
            root = e
            while isinstance(root, ir.serde.SerdeError) and root.__cause__ is not None:
                root = root.__cause__
            if isinstance(root, UnicodeEncodeError):
                raise _not_unicode(target, root) from None
            if root is e:
                raise
            raise root from None
        except UnicodeEncodeError as e:
            raise _not_unicode(target, e) from None
        written = sorted(p.name for p in tmp_dir.iterdir() if p.name != target.name)
        for name in written + [target.name]:
            _fsync(tmp_dir / name)
        _move_into_place(tmp_dir, target, written, modes)
        if location is not None:
            _remove_stale_shards(target.parent, location, set(written))
    except OSError as e:
        full = disk_full_error(e, target, _file_written(e, tmp_dir, target, location))
        if full is not None:
            raise full from e
        raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        release(tmp_dir)
    return target


def _not_unicode(target: Path, error: UnicodeEncodeError) -> OnnxFormatError:
    """A name (initializer, node, value, metadata) that protobuf cannot store as UTF-8 text."""
    text = error.object if isinstance(error.object, str) else repr(error.object)
    return OnnxFormatError(f"{target}: the name {text!r} is not valid Unicode ({error.reason}: a lone surrogate); "
                           "ONNX stores names as UTF-8, nothing was written")


def _file_written(error: OSError, tmp_dir: Path, target: Path, location: Optional[str]) -> Path:
    """The user's file a failed write was for: the error's file moved out of the scratch folder;
    for numpy's errno-less short write (``tofile``, which onnx_ir writes external data with) the
    data file; else the model."""
    name = getattr(error, "filename", None)
    if isinstance(name, (str, bytes, os.PathLike)) and name:  # NOTE: some writers put the file object there
        path = Path(os.fsdecode(name))
        if path.parent == tmp_dir:
            return target.parent / path.name
        if tmp_dir not in path.parents:
            return path
    if error.errno is None and location is not None:
        return target.parent / location
    return target


_BACKUP_FOLDER = "previous"
"""Sub-folder of the scratch folder holding the data files a save replaces until it is complete."""


def _move_into_place(tmp_dir: Path, target: Path, written: list, modes: dict | None = None) -> None:
    """Rename the data files, then the ``.onnx``, from ``tmp_dir`` over the old ones.

    ``modes`` maps a file name to the permission bits of the file it replaces (from
    ``check_replaceable``); each new file gets them before its rename.

    NOTE (reliability, fault injection): a rename failing after the data files were replaced
    would leave the old ``.onnx`` beside new data it does not describe; so the old data files
    are first moved aside into the scratch folder and moved back if any rename fails. Data
    files this save added (no old one) are removed again. A process killed inside this window
    (microseconds) can still leave the pair mixed.
    """
    modes = modes or {}
    for name in written + [target.name]:
        preserve_mode(modes.get(name), tmp_dir / name)
    backups = tmp_dir / _BACKUP_FOLDER
    backups.mkdir()
    saved, added = [], []
    try:
        for name in written:
            final = target.parent / name
            if final.exists():
                os.replace(final, backups / name)
                saved.append(name)
            else:
                added.append(name)
            os.replace(tmp_dir / name, final)
        os.replace(tmp_dir / target.name, target)
    except BaseException:
        for name in added:
            with contextlib.suppress(OSError):
                (target.parent / name).unlink()
        for name in saved:
            with contextlib.suppress(OSError):
                os.replace(backups / name, target.parent / name)
        raise


def _fsync(path: Path) -> None:
    """Flush ``path`` to disk, so the rename never exposes a file whose data is not written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_external(model: ir.Model, tmp_model: Path, location: str, max_shard_size_bytes, alignment_bytes,
                   min_tensor_bytes: int) -> None:
    values = [v for graph in iter_graphs(model.graph) for v in graph.initializers.values()]
    originals = [v.const_value for v in values]
    try:
        ir.external_data.unload_from_model(
            model, str(tmp_model.parent), location,
            size_threshold_bytes=min_tensor_bytes,
            max_shard_size_bytes=max_shard_size_bytes,
            alignment=alignment_bytes,
            align_threshold=ALIGN_THRESHOLD_BYTES,
        )
        for value, original in zip(values, originals):
            tensor = value.const_value
            if tensor is not original and tensor is not None and original is not None and original.metadata_props:
                tensor.metadata_props.update(original.metadata_props)
        proto = ir.serde.serialize_model(model)
        onnx.save(proto, tmp_model)
    finally:
        for value, original in zip(values, originals):
            value.const_value = original


def _remove_stale_shards(folder: Path, location: str, written: set) -> None:
    """Remove shards of an earlier save to the same data name that this save did not write
    (a different shard count gives different names; they would otherwise linger)."""
    pattern = _shard_pattern(location)
    for entry in folder.iterdir():
        if entry.name not in written and pattern.match(entry.name):
            with contextlib.suppress(OSError):
                entry.unlink()
    if written and location not in written and (folder / location).is_file():
        with contextlib.suppress(OSError):
            (folder / location).unlink()


def rewrite_metadata(path: "str | os.PathLike", props: dict) -> None:
    """Set the model ``metadata_props`` ``props`` (``{key: text}``) of the inline ``.onnx`` at
    ``path``, rewriting it atomically one tensor at a time: the file is read as a map of itself
    (:func:`onnxparam.formats._onnx_nested.read_onnx_mapped`: each initializer of more than 1 KiB
    a reference to its bytes in the file) and written back by :func:`onnxparam.onnx_io._ir_stream.save_inline` (each tensor's
    bytes copied from the old file), so its weights are never all in memory.

    Raises:
        OnnxFormatError: the file is not an ONNX protobuf.
        OSError: the file cannot be written (the old file stays as it was).
    """
    from ..formats._onnx_nested import read_onnx_mapped

    proto = read_onnx_mapped(path, min_bytes=1024)
    existing = {p.key: p for p in proto.metadata_props}
    for key, value in props.items():
        if key in existing:
            existing[key].value = str(value)
        else:
            proto.metadata_props.add(key=key, value=str(value))
    model = ir.serde.deserialize_model(proto)
    ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    save_model(model, path, external_data=False)
