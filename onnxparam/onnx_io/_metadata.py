"""What onnxparam keeps in ONNX metadata, so burnpack -> ONNX -> burnpack loses nothing.

ONNX has two string -> string maps that fit: the model's ``metadata_props``
(``ModelProto.metadata_props``, every IR version) and each initializer's own
``metadata_props`` (``TensorProto.metadata_props``, IR version 10 / ONNX 1.16 on). onnxparam
writes a param's facts in **both**, and reads the initializer's first:

Initializer ``metadata_props`` (one initializer = one param):

=============================  ==============================================================
key                            value
=============================  ==============================================================
``onnxparam.param_id``         the :class:`~onnxparam.ParamId`, a decimal u64 (``"42"``)
``onnxparam.require_grad``     ``"true"`` or ``"false"``
``onnxparam.lora.scale``       on a kept LoRA factor: the adapter's ``alpha / rank`` (``repr``
                               of the float); absent on plain params
=============================  ==============================================================

Model ``metadata_props``:

=============================  ==============================================================
key                            value
=============================  ==============================================================
``onnxparam.params``           JSON object: initializer name -> ``{"param_id": "<decimal u64>",
                               "require_grad": true|false}`` (+ ``"lora_scale": float``); the
                               same facts as above, for tools that rewrite initializers and
                               drop their metadata (external-data writers, optimizers)
``onnxparam.version``          the onnxparam version that wrote the file
``onnxparam.core.module``           the exported module's class (``package.module.QualName``)
``onnxparam.core.record.<key>``     a ``ModuleRecord.metadata`` entry (e.g. burnpack metadata that
                               went through a converter)
=============================  ==============================================================

NOTE: ids are decimal strings, not JSON numbers: a u64 does not fit a double, and JSON readers
in other languages parse numbers as doubles.

Metadata of a model that was imported is kept as it was (other producers' keys included);
onnxparam's own keys are replaced on export.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from ..core.errors import OnnxFormatError
from ..core.param import ParamId

__all__ = [
    "PREFIX",
    "PARAM_ID_KEY",
    "REQUIRE_GRAD_KEY",
    "LORA_SCALE_KEY",
    "PARAMS_KEY",
    "VERSION_KEY",
    "MODULE_KEY",
    "RECORD_PREFIX",
    "ParamMetadata",
    "tensor_props",
    "model_params_prop",
    "read_params",
    "strip_own_keys",
]

PREFIX = "onnxparam."
"""Every key onnxparam writes starts with this."""

PARAM_ID_KEY = "onnxparam.param_id"
REQUIRE_GRAD_KEY = "onnxparam.require_grad"
LORA_SCALE_KEY = "onnxparam.lora.scale"
PARAMS_KEY = "onnxparam.params"
VERSION_KEY = "onnxparam.version"
MODULE_KEY = "onnxparam.module"
RECORD_PREFIX = "onnxparam.record."
ZERO_COPY_KEY = "onnxparam.zero_copy"
"""Model key of a zero-copy model (weights = slices of a ``.bpk`` / ``.safetensors`` file): JSON
``{"location", "size", "header_bytes", "header_sha256"}`` describing that file when the model was
written, so a reader notices when it was replaced (ONNX Runtime itself would read stale slices)."""

_TRUE, _FALSE = "true", "false"


@dataclass(frozen=True)
class ParamMetadata:
    """The facts onnxparam records about one initializer (``None``: not recorded)."""

    param_id: Optional[ParamId] = None
    require_grad: Optional[bool] = None
    lora_scale: Optional[float] = None

    def is_empty(self) -> bool:
        return self.param_id is None and self.require_grad is None and self.lora_scale is None


def tensor_props(meta: ParamMetadata) -> dict[str, str]:
    """The initializer ``metadata_props`` entries of ``meta``."""
    props: dict[str, str] = {}
    if meta.param_id is not None:
        props[PARAM_ID_KEY] = str(int(meta.param_id))
    if meta.require_grad is not None:
        props[REQUIRE_GRAD_KEY] = _TRUE if meta.require_grad else _FALSE
    if meta.lora_scale is not None:
        props[LORA_SCALE_KEY] = repr(float(meta.lora_scale))
    return props


def model_params_prop(metas: Mapping[str, ParamMetadata]) -> str:
    """The JSON value of the model-level :data:`PARAMS_KEY` entry."""
    table = {}
    for name, meta in metas.items():
        entry: dict = {}
        if meta.param_id is not None:
            entry["param_id"] = str(int(meta.param_id))
        if meta.require_grad is not None:
            entry["require_grad"] = bool(meta.require_grad)
        if meta.lora_scale is not None:
            entry["lora_scale"] = float(meta.lora_scale)
        if entry:
            table[name] = entry
    return json.dumps(table, separators=(",", ":"), sort_keys=True)


def _parse_id(text: str, where: str) -> ParamId:
    try:
        return ParamId(int(text, 10))
    except (TypeError, ValueError):
        raise OnnxFormatError(f"{where}: {PARAM_ID_KEY} must be a decimal u64, found {text!r}") from None


def _parse_flag(text, where: str) -> bool:
    if isinstance(text, bool):
        return text
    if text in (_TRUE, _FALSE):
        return text == _TRUE
    raise OnnxFormatError(f"{where}: {REQUIRE_GRAD_KEY} must be 'true' or 'false', found {text!r}")


def _parse_scale(text, where: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise OnnxFormatError(f"{where}: {LORA_SCALE_KEY} must be a float, found {text!r}") from None


def read_params(model_props: Mapping[str, str], tensor_props_by_name: Mapping[str, Mapping[str, str]],
                source: str = "the model") -> dict[str, ParamMetadata]:
    """The recorded facts per initializer name: initializer ``metadata_props`` first, then the
    model-level :data:`PARAMS_KEY` table for what the initializer does not say.

    Args:
        model_props: the model's ``metadata_props``.
        tensor_props_by_name: initializer name -> its ``metadata_props``.
        source: the file (or "the model"), named in error messages.

    Raises:
        OnnxFormatError: when a recorded value is malformed (not JSON, not a u64 ...).
    """
    table: dict = {}
    raw = model_props.get(PARAMS_KEY)
    if raw:
        try:
            table = json.loads(raw)
        # NOTE (reliability fuzzing): a corrupted file can hold bytes that are not UTF-8
        # (UnicodeDecodeError, a ValueError) or JSON nested past Python's stack.
        except (ValueError, RecursionError) as e:
            raise OnnxFormatError(f"{source}: model metadata {PARAMS_KEY!r} is not valid JSON ({e})") from None
        if not isinstance(table, dict):
            raise OnnxFormatError(f"{source}: model metadata {PARAMS_KEY!r} must be a JSON object")
    names = set(table) | set(tensor_props_by_name)
    out: dict[str, ParamMetadata] = {}
    for name in names:
        entry = table.get(name) or {}
        props = tensor_props_by_name.get(name) or {}
        where = f"{source}, initializer {name!r}"
        if not isinstance(entry, dict):
            raise OnnxFormatError(f"{where}: model metadata {PARAMS_KEY!r} must map names to JSON objects, "
                                  f"found {entry!r}")
        pid = props.get(PARAM_ID_KEY, entry.get("param_id"))
        flag = props.get(REQUIRE_GRAD_KEY, entry.get("require_grad"))
        scale = props.get(LORA_SCALE_KEY, entry.get("lora_scale"))
        meta = ParamMetadata(
            None if pid is None else _parse_id(str(pid), where),
            None if flag is None else _parse_flag(flag, where),
            None if scale is None else _parse_scale(scale, where),
        )
        if not meta.is_empty():
            out[name] = meta
    return out


def strip_own_keys(props: Mapping[str, str]) -> dict[str, str]:
    """``props`` without onnxparam's keys (those are rewritten on every export)."""
    return {k: v for k, v in props.items() if not k.startswith(PREFIX)}


def zero_copy_fingerprint(path: "str | os.PathLike", location: str, header_bytes: int) -> str:
    """The :data:`ZERO_COPY_KEY` value for the weight file at ``path`` (referenced as ``location``):
    its size and the SHA-256 of its first ``header_bytes`` bytes (the burnpack / safetensors
    header, which holds every tensor's name, dtype, shape and offsets)."""
    import hashlib

    with open(path, "rb") as f:
        head = f.read(header_bytes)
        size = os.fstat(f.fileno()).st_size
    return json.dumps({"location": location, "size": size, "header_bytes": header_bytes,
                       "header_sha256": hashlib.sha256(head).hexdigest()}, separators=(",", ":"))


def zero_copy_problem(value: str, base_dir: "str | os.PathLike") -> "str | None":
    """Why the weight file a :data:`ZERO_COPY_KEY` value describes no longer matches, or ``None``."""
    import hashlib

    try:
        facts = json.loads(value)
        location, size, header_bytes, digest = (facts["location"], int(facts["size"]), int(facts["header_bytes"]),
                                                str(facts["header_sha256"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"its {ZERO_COPY_KEY} metadata is malformed ({e})"
    target = os.path.join(os.fspath(base_dir), location)
    try:
        with open(target, "rb") as f:
            now = os.fstat(f.fileno()).st_size
            head = f.read(header_bytes)
    except OSError as e:
        return f"its weight file '{location}' cannot be read ({e.strerror or e})"
    if now != size:
        return f"its weight file '{location}' changed after the model was written ({size} bytes then, {now} now)"
    if hashlib.sha256(head).hexdigest() != digest:
        return f"its weight file '{location}' changed after the model was written (its header differs)"
    return None
