"""The external data files of an imported ONNX model, watched for changes after import.

``onnx_ir`` reads an external tensor (``location`` / ``offset`` / ``length`` in its
``TensorProto``, ONNX IR spec: "External Tensor Data") from a memory map of the data file on
first access. A data file edited in place after import (same size, other bytes) would then give
other weights silently (NaN outputs), and one truncated after import a numpy error that names no
file. So, like the burnpack and safetensors readers (:class:`onnxparam.formats._mapped.FileWatch`),
import records each data file's identity (:class:`FileStamp`: size, modification time, inode,
device; one ``stat`` per file, nothing read) on its tensors (``tensor.meta``), and every read of a
weight (:func:`check_tensor`) and every run or export of the imported graph (:func:`check_source`) ``stat`` s
the file again and raises :class:`~onnxparam.OnnxFormatError` naming the file and the tensor when
it changed.

NOTE: the check follows the *path* (ONNX Runtime and ``onnx_ir`` open data files by path): a
data file replaced by a rename also counts as changed. Arrays already handed out (a param's value
read before the change) are zero-copy views of the map: nothing can check their reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import onnx_ir as ir

from ..core.errors import OnnxFormatError

__all__ = ["FileStamp", "stamp_external_data", "carry_stamps", "check_tensor", "data_stamps", "check_stamps", "check_source",
           "pin_before_overwrite"]

STAMP_KEY = "onnxparam.data_file_stamp"
"""``tensor.meta`` key of an external tensor's :class:`FileStamp` (never serialized)."""


@dataclass(frozen=True)
class FileStamp:
    """One external data file as import saw it.

    Attributes:
        path: the file's absolute path.
        location: the ``location`` the model names it by.
        size: bytes.
        mtime_ns: modification time, nanoseconds.
        ino / dev: inode and device (a file replaced by a rename has other ones).
    """

    path: str
    location: str
    size: int
    mtime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, path: str, location: str) -> Optional["FileStamp"]:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        return cls(os.path.abspath(path), location, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def change(self) -> Optional[str]:
        """How the file differs from the stamp (``None``: unchanged)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return f"it can no longer be read ({e.strerror or e})"
        if (st.st_ino, st.st_dev) != (self.ino, self.dev):
            return "it was replaced by another file"
        if st.st_size != self.size:
            return f"its size changed from {self.size} to {st.st_size} bytes"
        if st.st_mtime_ns != self.mtime_ns:
            return "it was modified in place (same size)"
        return None

    def error(self, tensors: str, change: str) -> OnnxFormatError:
        """The error for a change (``tensors``: e.g. ``"tensor 'w'"``)."""
        return OnnxFormatError(
            f"the external data file '{self.path}' (location {self.location!r}) of {tensors} changed "
            f"on disk after the model was imported: {change}; its weights can no longer be read safely: "
            "import the model again"
        )


def iter_graphs(graph: ir.Graph):
    """``graph`` and every subgraph below it (``If``/``Loop``/``Scan`` bodies), depth first.
    (Defined here, the lower of the two modules, and re-exported by ``_source``.)"""
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.GRAPH:
                yield from iter_graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    yield from iter_graphs(sub)


def _external(model: ir.Model):
    for graph in iter_graphs(model.graph):
        for name, value in graph.initializers.items():
            if isinstance(value.const_value, ir.ExternalTensor):
                yield name, value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if not attr.is_ref() and attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    yield (node.outputs[0].name if node.outputs else node.name), attr.value


def stamp_external_data(model: ir.Model) -> None:
    """Record the current identity of every external data file on its tensors (at import)."""
    stamps: dict = {}
    for _, tensor in _external(model):
        path = os.fspath(tensor.path)
        if path not in stamps:
            stamps[path] = FileStamp.of(path, str(tensor.location))
        if stamps[path] is not None:
            tensor.meta[STAMP_KEY] = stamps[path]


def carry_stamps(src: ir.Model, dst: ir.Model) -> None:
    """Give ``dst``'s external tensors (a serialized copy of ``src``) the stamps of ``src``'s."""
    found = {name: t.meta.get(STAMP_KEY) for name, t in _external(src)}
    for name, tensor in _external(dst):
        stamp = found.get(name)
        if stamp is not None and STAMP_KEY not in tensor.meta:
            tensor.meta[STAMP_KEY] = stamp


def check_tensor(tensor) -> None:
    """Raise when ``tensor`` is an external tensor whose data file changed since import.

    Raises:
        OnnxFormatError: naming the data file and the tensor.
    """
    meta = getattr(tensor, "meta", None) if isinstance(tensor, ir.ExternalTensor) else None
    stamp = meta.get(STAMP_KEY) if meta is not None else None
    if stamp is not None:
        change = stamp.change()
        if change is not None:
            raise stamp.error(f"tensor {tensor.name!r}", change)


def data_stamps(model: ir.Model) -> tuple:
    """``((label, FileStamp), ...)``: one entry per stamped data file of ``model``; the label names
    the file's tensors (``"tensors 'a', 'b' and 3 more"``)."""
    found: dict = {}
    for name, tensor in _external(model):
        stamp = tensor.meta.get(STAMP_KEY)
        if stamp is not None:
            found.setdefault(stamp, []).append(name)
    out = []
    for stamp, names in found.items():
        shown = ", ".join(repr(n) for n in names[:2])
        label = f"tensor{'s' if len(names) > 1 else ''} {shown}" + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        out.append((label, stamp))
    return tuple(out)


def check_stamps(stamps: tuple) -> None:
    """Raise when a data file of ``stamps`` (:func:`data_stamps`) changed since import (one
    ``stat`` per file).

    Raises:
        OnnxFormatError: naming the data file and its first tensor.
    """
    for label, stamp in stamps:
        change = stamp.change()
        if change is not None:
            raise stamp.error(label, change)


def check_source(source) -> None:
    """:func:`check_stamps` for an imported model's source (its ``_SourceGraph``; the stamps are
    collected once, in ``source.cache``): before each run of its graph and each export.

    Raises:
        OnnxFormatError: naming the data file and its tensors.
    """
    stamps = source.cache.get("data_stamps")
    if stamps is None:
        stamps = source.cache["data_stamps"] = data_stamps(source.pristine)
    check_stamps(stamps)


def pin_before_overwrite(models, target, sources=()) -> int:
    """Before a save writes ``target`` (an ``.onnx`` file; its data files go beside it): map the
    bytes of every stamped external tensor of ``models`` whose data file sits in ``target``'s
    folder, and drop its stamp.

    A save replaces files by a rename (:mod:`onnxparam.onnx_io._save`); a read-only map of the
    old file keeps the old bytes (the old inode) alive, so a model imported from the file being
    written over keeps its weights — its old mapping — and stays callable. Its stamp is dropped:
    the tensor no longer reads through the path. ``sources`` (``_SourceGraph`` s) get their cached
    stamps cleared. Nothing is read (mapping is lazy). Returns how many tensors were pinned.
    """
    folder = os.path.dirname(os.path.realpath(os.fspath(target)))
    pinned = 0
    for model in models:
        if model is None:
            continue
        for _, tensor in _external(model):
            stamp = tensor.meta.get(STAMP_KEY)
            if stamp is None or os.path.dirname(os.path.realpath(stamp.path)) != folder:
                continue
            if stamp.change() is not None:
                continue  # already changed: the next read reports it
            try:
                tensor.numpy()  # maps the file (zero-copy); the map outlives a rename over it
            except Exception:  # noqa: BLE001 - an unreadable tensor is reported when it is read
                continue
            del tensor.meta[STAMP_KEY]
            pinned += 1
    for source in sources:
        source.cache.pop("data_stamps", None)
    return pinned
