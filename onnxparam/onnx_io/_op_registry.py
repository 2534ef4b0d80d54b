"""Which operators exist, asked of the runtime that runs them: ONNX Runtime's schema registry
(ONNX's operators plus ONNX Runtime's contrib operators) together with ``onnx.defs``.

ONNX Runtime decides what runs; this module only answers the questions the validator and the
importer need answered the way ONNX Runtime answers them (checked on onnxruntime 1.32):

* **Opset imports** (:func:`effective_opsets`): ``""`` and ``"ai.onnx"`` are one domain; when a
  domain is imported twice the **last** entry counts (ONNX Runtime's ``Model`` fills its
  domain -> version map entry by entry); a domain a node uses but the model does not import
  gets the newest version ONNX Runtime knows, when ONNX Runtime knows the domain
  (``com.microsoft`` nodes in a model that imports only ``ai.onnx``). A domain nobody knows is
  not given a version (ONNX Runtime refuses it: "No opset import for domain").
* **Registrations** (:func:`is_registered`): an operator exists at an opset when ``onnx.defs`` or
  ONNX Runtime registers a version of it at or below that opset. ONNX Runtime registers
  ``LayerNormalization`` in the default domain from version 1 (a contrib schema; ONNX defines it
  from 17), which its BERT / GPT-2 fusion test models use at opsets 11 to 13.

Without ONNX Runtime's Python binding (a stripped build), only ``onnx.defs`` answers.
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping, Optional

import onnx

__all__ = ["effective_opsets", "is_registered", "known_domain", "latest_opset", "opsets_of_entries"]


def _norm(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


@functools.lru_cache(maxsize=1)
def _ort_registry() -> Mapping:
    """``(domain, op_type) -> sorted since-versions`` of ONNX Runtime's registry (empty without it)."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

        schemas = get_all_operator_schema()
    except Exception:  # noqa: BLE001 - no ORT, or a build without the schema binding
        return {}
    table: dict = {}
    for schema in schemas:
        table.setdefault((_norm(schema.domain), schema.name), set()).add(int(schema.since_version))
    return {key: tuple(sorted(v)) for key, v in table.items()}


@functools.lru_cache(maxsize=1)
def _latest() -> Mapping:
    """Domain -> the newest opset version ONNX Runtime knows (``onnx.defs`` for the domains ONNX
    Runtime does not know, or without ONNX Runtime)."""
    latest: dict = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        domain = _norm(schema.domain)
        latest[domain] = max(latest.get(domain, 0), int(schema.since_version))
    latest[""] = max(latest.get("", 0), int(onnx.defs.onnx_opset_version()))
    ort_latest: dict = {}
    for (domain, _), versions in _ort_registry().items():
        ort_latest[domain] = max(ort_latest.get(domain, 0), versions[-1])
    latest.update(ort_latest)
    return latest


def latest_opset(domain: str) -> Optional[int]:
    """The newest version of ``domain`` ONNX Runtime (or ``onnx.defs``) knows; ``None`` for an
    unknown (custom) domain."""
    return _latest().get(_norm(domain))


def known_domain(domain: str) -> bool:
    return latest_opset(domain) is not None


def opsets_of_entries(entries: Iterable) -> dict:
    """``{domain: version}`` of opset import entries (``(domain, version)`` pairs or objects with
    ``.domain`` / ``.version``), ``"ai.onnx"`` as ``""``, the last entry of a domain counting."""
    out: dict = {}
    for entry in entries:
        domain, version = (entry.domain, entry.version) if hasattr(entry, "domain") else entry
        key = _norm(domain)
        out.pop(key, None)  # NOTE: re-inserted, so the order is that of the counting entries
        out[key] = int(version)
    return out


def effective_opsets(imports: Mapping, used_domains: Iterable[str] = ()) -> dict:
    """The opset versions ONNX Runtime runs a model at: ``imports`` (domain -> version, as
    :func:`opsets_of_entries` gives) plus, for every domain of ``used_domains`` that is not
    imported and that ONNX Runtime knows, its newest version (module docstring)."""
    out = {_norm(d): int(v) for d, v in imports.items()}
    for domain in used_domains:
        domain = _norm(domain)
        if domain not in out:
            latest = latest_opset(domain)
            if latest is not None:
                out[domain] = latest
    return out


def is_registered(op_type: str, domain: str, version: int) -> bool:
    """True when ``onnx.defs`` or ONNX Runtime registers ``op_type`` of ``domain`` at a version
    at or below ``version``."""
    domain = _norm(domain)
    try:
        onnx.defs.get_schema(op_type, int(version), domain)
        return True
    except onnx.defs.SchemaError:
        pass
    versions = _ort_registry().get((domain, op_type))
    return bool(versions) and versions[0] <= int(version)


def model_opsets(model) -> dict:
    """:func:`effective_opsets` of an ``onnx_ir.Model``: its imports (``""`` and ``"ai.onnx"``
    as one domain, the later counting) plus ONNX Runtime's default versions of the known domains
    its nodes (subgraphs included) use without importing them."""
    from ._data_watch import iter_graphs

    used = {node.domain for graph in iter_graphs(model.graph) for node in graph}
    return effective_opsets(opsets_of_entries(model.opset_imports.items()), sorted(used))
