"""Which format a file is: read files are told by their *content* (magic bytes, headers),
written files by their extension (formats layer; imports only the errors, so the CLI can ask it
before loading any reader).

:func:`detect_format` (reading) recognises, from the first bytes of the file:

==============  ====================================================================
burnpack        ``4E 52 55 42`` ("NRUB", Burn's magic ``0x4255524E``)
safetensors     a ``u64`` little-endian header length that fits the file, then ``{``
pytorch         a zip archive (``PK\\x03\\x04``: ``torch.save`` since 1.6), a legacy stream (a
                pickle whose first value is torch's magic number ``0x1950a86a20f9469cfc6c``)
                or a legacy tar (``ustar`` at byte 257: torch < 0.4)
onnx            a protobuf ``ModelProto``: its first top-level fields are ModelProto fields
                with their wire types, each inside the file
==============  ====================================================================

:func:`format_of` (writing) takes the extension: ``.bpk``, ``.safetensors``, ``.onnx``
(``.pt`` / ``.pth`` name PyTorch files, which are read, never written).
"""

import errno
import os
from pathlib import Path

from ..core.errors import FileAccessError, RecordError, file_error

__all__ = ["FORMATS", "WRITABLE", "format_of", "detect_format", "pytorch_container", "check_readable",
           "read_error", "content_format", "other_format_message"]

FORMATS = {".bpk": "burnpack", ".safetensors": "safetensors", ".onnx": "onnx", ".pt": "pytorch", ".pth": "pytorch"}
"""File extension -> format name. ``pytorch`` (``torch.save`` checkpoints) is read, never written."""

WRITABLE = ("burnpack", "safetensors", "onnx")
"""The formats :func:`onnxparam.convert.convert` writes."""

_BURNPACK_MAGIC = b"NRUB"
_ZIP_MAGIC = b"PK\x03\x04"
_TORCH_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_ORT_ADAPTER_ID = b"TORT"  # ONNX Runtime's adapter flatbuffer file identifier (bytes 4..8)
_HEAD = 512

_HOW_TO_READ = {
    "burnpack": "use Module.load_file / onnxparam.convert.convert",
    "safetensors": "use onnxparam.convert.load_safetensors / convert",
    "pytorch": "use onnxparam.convert.load_pytorch / convert",
    "onnx": "use onnxparam.import_onnx / onnxparam.convert.load_onnx",
}
"""Format -> how this library reads it (for messages that refuse a file of another format)."""

# ModelProto fields (onnx.proto): number -> wire type (0 varint, 2 length-delimited).
_MODEL_FIELDS = {1: 0, 2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2, 26: 2}


def _folder_message(path) -> str:
    return f"cannot read '{path}': it is a folder, not a file; give the path of the weights file"


def _adapter_message(path) -> str:
    return (f"'{path}' is an ONNX Runtime LoRA adapter file (.onnx_adapter, as write_onnx_adapter writes), not "
            "a weights file: it holds LoRA factors fed to a model exported with lora='inputs'; check it against "
            "its model with onnxparam.check_onnx_adapter(adapter, model), read it with "
            "onnxruntime.AdapterFormat.read_adapter")


def content_format(path) -> "str | None":
    """:func:`detect_format`'s answer, ``"onnx_adapter"`` for an ONNX Runtime adapter file, or
    None (unreadable, or of no known format). Never raises."""
    try:
        return detect_format(path)
    except RecordError as e:
        return "onnx_adapter" if "ONNX Runtime LoRA adapter" in str(e) else None
    except OSError:
        return None


def other_format_message(path, expected: str) -> "str | None":
    """When the file at ``path`` is, by its content, a burnpack, safetensors or PyTorch file
    other than ``expected`` (or an ONNX Runtime adapter file), a message saying so and naming the reader to use
    ("'x.bpk' is a burnpack file, not ONNX; use Module.load_file / ..."); otherwise None
    (unreadable, or of no known format). Never raises."""
    fmt = content_format(path)
    if fmt == "onnx_adapter":
        return _adapter_message(path)
    # NOTE: ONNX is told by a heuristic (protobuf field tags) that some malformed files of the
    # other formats pass; only the formats with a magic number / checked header are named
    if fmt is None or fmt == expected or fmt == "onnx":
        return None
    names = {"onnx": "ONNX", "pytorch": "PyTorch (torch.save)"}
    return (f"'{path}' is a {names.get(fmt, fmt)} file, not {names.get(expected, expected)}; "
            f"{_HOW_TO_READ[fmt]}")


def read_error(path, error: OSError, what: str = "the weights file") -> FileAccessError:
    """The library's :class:`FileAccessError` leaf for an ``OSError`` met reading ``path``: a
    missing file is a ``FileMissingError`` (also a ``FileNotFoundError``), a folder an
    ``IsAFolderError`` (also an ``IsADirectoryError``); the message names the path."""
    label = os.fspath(path)
    if isinstance(error, FileAccessError):
        return error
    code = error.errno or errno.EIO
    if code == errno.ENOENT:
        return file_error(code, f"no such file: '{label}'", label)
    if code == errno.EISDIR:
        return file_error(code, f"cannot read '{label}': it is a folder, not a file; give the path of {what}", label)
    return file_error(code, f"cannot read '{label}': {error.strerror or error}", label)


def check_readable(path, what: str = "the weights file") -> None:
    """Raise before reading when ``path`` is missing or is a folder (``what`` names the file
    expected, for the folder message).

    Raises:
        FileMissingError: no such file or folder. IsAFolderError: ``path`` is a folder.
    """
    p = Path(path)
    if p.is_dir():
        raise read_error(p, IsADirectoryError(errno.EISDIR, "Is a directory"), what)
    if not p.exists():
        raise read_error(p, FileNotFoundError(errno.ENOENT, "No such file or directory"), what)


def format_of(path) -> str:
    """``"burnpack"``, ``"safetensors"``, ``"onnx"`` or ``"pytorch"`` from the extension (the
    writer a target gets).

    Raises:
        RecordError: for any other extension (a ``ValueError``), naming the known ones.
    """
    suffix = Path(path).suffix.lower()
    try:
        return FORMATS[suffix]
    except KeyError:
        known = ", ".join(FORMATS)
        raise RecordError(f"cannot tell the format of '{path}' from its extension '{suffix}'; use one of "
                          f"{known}") from None


def _varint(data: bytes, pos: int):
    value = shift = 0
    while pos < len(data) and shift < 70:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None, pos


def _looks_like_onnx(head: bytes, size: int) -> bool:
    """The first top-level fields (up to 4, within ``head``) are ModelProto fields with their wire
    types, each inside the file; ``ir_version`` or ``graph`` among them, or at least two."""
    pos = fields = 0
    seen = set()
    while pos < len(head) and fields < 4:
        tag, pos = _varint(head, pos)
        if tag is None:
            break
        number, wire = tag >> 3, tag & 7
        if _MODEL_FIELDS.get(number) != wire:
            return False
        seen.add(number)
        fields += 1
        if wire == 0:
            value, pos = _varint(head, pos)
            if value is None:
                return False
        else:
            length, pos = _varint(head, pos)
            if length is None or pos + length > size:
                return False
            pos += length
    return bool(seen & {1, 7}) or fields >= 2


def pytorch_container(head: bytes) -> "str | None":
    """``"zip"``, ``"stream"`` or ``"tar"`` for the first bytes of a ``torch.save`` file, else None."""
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if len(head) >= 2 and head[0] == 0x80 and _TORCH_MAGIC in head[:32]:
        return "stream"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def detect_format(path) -> str:
    """The format of the file at ``path`` from its content (module docstring), whatever its name.

    Raises:
        FileMissingError: no such file. IsAFolderError: a folder.
        FileAccessError: the file cannot be read.
        RecordError: the content is none of the formats (the message names the first bytes
            found and the file's size).
    """
    path = Path(path)
    try:
        if path.is_dir():
            raise file_error(errno.EISDIR, _folder_message(path), os.fspath(path))
        with open(path, "rb") as f:
            head = f.read(_HEAD)
            size = os.fstat(f.fileno()).st_size
    except FileAccessError:
        raise
    except FileNotFoundError:
        raise file_error(errno.ENOENT, f"no such file: '{path}'", os.fspath(path)) from None
    except IsADirectoryError:
        raise file_error(errno.EISDIR, _folder_message(path), os.fspath(path)) from None
    except OSError as e:
        raise file_error(e.errno or errno.EIO, f"cannot read '{path}': {e.strerror or e}", os.fspath(path)) from None
    if head.startswith(_BURNPACK_MAGIC):
        return "burnpack"
    if pytorch_container(head) is not None:
        return "pytorch"
    if len(head) >= 9:
        n = int.from_bytes(head[:8], "little")
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    if _looks_like_onnx(head, size):
        return "onnx"
    if head[4:8] == _ORT_ADAPTER_ID:
        raise RecordError(_adapter_message(path))
    if size == 0:
        found = "an empty file"
    else:
        shown = head[:16]
        text = shown.decode("ascii", "replace") if all(32 <= b < 127 or b in (9, 10, 13) for b in shown) else None
        found = (f"{size} bytes starting with {text!r}" if text is not None
                 else f"{size} bytes starting with {shown.hex(' ')}")
    raise RecordError(f"'{path}' is not a weights file this library reads: found {found}; expected a burnpack "
                      "(.bpk), safetensors, ONNX model or PyTorch checkpoint (zip, legacy stream or legacy tar)")
