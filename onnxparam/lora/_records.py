"""Records (``into_record``, ``save_file``, ``load_record``, ``load_file``; ``save_safetensors`` /
``load_safetensors`` too, the description in ``__metadata__``) of a module that owns
named adapters (:func:`~onnxparam.lora._adapters.add_adapter`): every adapter is saved, and each
loads back into the adapter of its name.

**Names.** A module without named adapters keeps Burn's naming, byte for byte: an adapter's
factors follow their weight as ``<W>.lora.a`` / ``<W>.lora.b``. A module that owns named adapters
stores **every** named adapter (the active one too) under its name: ``<W>.lora.<name>.a`` /
``<W>.lora.<name>.b``, each right after its weight ``W``, names in the order they were added
(a PEFT ``lora_bias`` is the adapter of the bias ``W``, ``a`` ``(1, 1)``, ``b`` ``(1, d)``).
The record's metadata (burnpack ``metadata``, text -> text) holds, under
:data:`LORA_METADATA_KEY`, the JSON ``{"version": 1, "active": name | null, "adapters": {name:
{W: {"rank": r, "scale": s, "transposed": bool}}}}``: a :class:`~onnxparam.LoraAdapter` keeps
its scale only (``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA), so that is what is
stored. Adapters not in the set (``apply_lora`` on a module whose named adapters are all
inactive) keep ``<W>.lora.a`` / ``.b``.

**Loading** (:func:`load_named_adapters`, inside :func:`onnxparam.convert.apply_record`):

* ``<W>.lora.<name>.*`` loads into the module's adapter ``name``, active or not. The module's
  active adapter stays active (``set_adapter`` before loading chooses); a module with none
  active (a bare architecture, or adapters added and none set) takes the file's active one, so
  the loaded module computes what the saved one did.
* An adapter the file holds and the module lacks is **added** (inactive) with the file's
  factors, scale and layout, as PEFT's ``load_adapter`` adds one; the module's adapters the file
  lacks are missing tensors (an error unless ``allow_partial``). A module with unnamed adapters
  (``apply_lora``) reads a file's adapter ``"default"`` into them, as ``add_adapter`` names them.
* An adapter of the file whose scale or layout differs from the module's adapter of that name
  is refused (``RecordError`` naming both): build the module with the training config.
* Old files (Burn's ``<W>.lora.a`` / ``.b``, one unnamed adapter) loaded into a module that owns
  named adapters go to the adapter whose factor ids (``ParamId``) they carry; without such
  evidence, to the module's one named adapter when it owns exactly one; otherwise the load is
  refused with a ``RecordError`` naming the file, the tensor and the adapters (rename the
  tensors to ``<W>.lora.<name>.a`` / ``.b`` to choose). Tensors without ids (a dict of arrays:
  ``<W>.lora.a`` is how ``named_params`` names the active adapter's factor) go to the active one. A record without the description (an
  old file, a dict) loads only the adapters it has tensors for (the others keep their values);
  one with no LoRA factor at all still needs the active adapter's, as before.

Every problem is collected and raised at once; the module is never changed (value semantics),
so a failed load leaves nothing half-loaded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Callable, Optional

from ..core.errors import RecordError
from ..core.param import Param, ParamId
from ..core.record import ModuleRecord, TensorSnapshot
from ._adapters import (
    _ACTIVE_ATTR,
    _SET_ATTR,
    DEFAULT_ADAPTER_NAME,
    LoraAdapter,
    LoraAdapterSet,
    _current_adapters,
    _owning,
    active_adapter,
    adapter_set,
    conv_adapter_groups,
)

__all__ = ["LORA_METADATA_KEY", "module_record", "saved_description", "carries_named_adapters", "load_named_adapters",
           "factor_name"]

LORA_METADATA_KEY = "onnxparam_lora_adapters"
"""Record / burnpack metadata key of the named adapters' JSON description (module docstring)."""

_VERSION = 1
_UNNAMED = re.compile(r"^(?P<base>.+)\.lora\.(?P<slot>a|b)$")


def factor_name(path: str, name: str, slot: str) -> str:
    """The record name of named adapter ``name``'s factor ``slot`` (``"a"`` / ``"b"``) of the
    param at ``path``: ``<path>.lora.<name>.<slot>``."""
    return f"{path}.lora.{name}.{slot}"


def _owns(module) -> bool:
    return getattr(module, _SET_ATTR, None) is not None


# -- saving -------------------------------------------------------------------------------------


def module_record(module) -> ModuleRecord:
    """The record of ``module`` (``into_record`` / ``save_file``): Burn's
    :meth:`ModuleRecord.from_module` for a module that owns no named adapter (unchanged, so its
    file is byte-identical to before); with named adapters, every one of them by name and the
    :data:`LORA_METADATA_KEY` metadata (module docstring). Lazy: no param is initialized.

    Raises:
        RecordError: two adapters' factors would get one record name (names containing
            ``.lora.``), naming them.
    """
    from ..core.module import named_params

    if not _owns(module):
        return ModuleRecord.from_module(module)
    sets, active = adapter_set(module), active_adapter(module)
    by_path: dict = {}
    for name in sets.names:
        for path, adapter in sets.adapters(name).items():
            by_path.setdefault(path, []).append((name, adapter))
    active_paths = set(sets.adapters(active)) if active is not None and active in sets.names else set()
    items: dict = {}

    def put(key: str, param: Param):
        if key in items:
            raise RecordError(f"cannot write the record of {type(module).__name__}: two tensors are named '{key}' "
                              f"(adapter names {sets.names}); rename the adapter whose name holds '.lora.'")
        items[key] = TensorSnapshot.of_param(param)

    def put_named(path: str):
        for name, adapter in by_path.pop(path, ()):
            put(factor_name(path, name, "a"), adapter.a)
            put(factor_name(path, name, "b"), adapter.b)

    for path, param in named_params(module):
        unnamed = _UNNAMED.match(path)
        if unnamed and unnamed.group("base") in active_paths:
            continue  # the active adapter: saved under its name, after its weight
        put(path, param)
        if not unnamed:
            put_named(path)
    for path in list(by_path):  # an adapter for a param the module does not reach (not expected)
        put_named(path)
    description = {
        "version": _VERSION,
        "active": active,
        "adapters": {name: {path: {"rank": adapter.rank, "scale": float(adapter.scale),
                                   "transposed": bool(adapter.transposed)}
                            for path, adapter in sets.adapters(name).items()} for name in sets.names},
    }
    return ModuleRecord(items, {LORA_METADATA_KEY: json.dumps(description, separators=(",", ":"), ensure_ascii=False)})


def saved_description(record: ModuleRecord, saved: Mapping) -> dict:
    """The metadata to write with the part of ``record`` (:func:`module_record`) that a writer
    kept: ``saved`` maps record paths to the names written. The description lists only the
    adapters whose factors were both written under their own names (a filter or a rename of
    the others would make them unreadable by name); ``{}`` when none is left or none was there."""
    raw = record.metadata.get(LORA_METADATA_KEY)
    if raw is None:
        return {}
    description = json.loads(raw)
    kept = {}
    for name, paths in description["adapters"].items():
        mine = {path: info for path, info in paths.items()
                if all(saved.get(factor_name(path, name, slot)) == factor_name(path, name, slot) for slot in "ab")}
        if mine:
            kept[name] = mine
    if not kept:
        return {}
    active = description.get("active") if description.get("active") in kept else None
    return {LORA_METADATA_KEY: json.dumps({**description, "active": active, "adapters": kept}, separators=(",", ":"),
                                          ensure_ascii=False)}


# -- loading ------------------------------------------------------------------------------------


def carries_named_adapters(module, record: Mapping) -> bool:
    """Whether loading ``record`` into ``module`` goes through :func:`load_named_adapters`:
    the module owns named adapters, or the record describes some (:data:`LORA_METADATA_KEY`)."""
    return _owns(module) or LORA_METADATA_KEY in (getattr(record, "metadata", None) or {})


def _file_description(record: Mapping, where: str) -> tuple:
    """``(active, {name: {path: info}})`` of the record's :data:`LORA_METADATA_KEY` entry;
    ``(None, {})`` without one.

    Raises:
        RecordError: the entry is no valid description (names the file).
    """
    raw = (getattr(record, "metadata", None) or {}).get(LORA_METADATA_KEY)
    if raw is None:
        return None, {}
    bad = f"{where}: metadata entry {LORA_METADATA_KEY!r} is not a valid named-adapter description"
    try:
        found = json.loads(raw)
    except ValueError as exc:
        raise RecordError(f"{bad} (not JSON: {exc})") from None
    adapters = found.get("adapters") if isinstance(found, dict) else None
    if not isinstance(adapters, dict) or not all(
            isinstance(paths, dict) and all(
                isinstance(info, dict) and isinstance(info.get("scale"), (int, float)) and not isinstance(
                    info.get("scale"), bool) and isinstance(info.get("transposed", False), bool)
                for info in paths.values()) for paths in adapters.values()):
        raise RecordError(f"{bad}: expected {{'adapters': {{name: {{param path: {{'scale': number, "
                          f"'transposed': bool}}}}}}}}")
    if int(found.get("version", _VERSION)) > _VERSION:
        raise RecordError(f"{bad}: version {found.get('version')} is newer than this library reads ({_VERSION})")
    return found.get("active"), adapters


def _fit_problem(shape: tuple, a_shape: tuple, b_shape: tuple) -> Optional[str]:
    """Why factors ``a_shape`` / ``b_shape`` are no adapter of a param of ``shape`` (as
    :meth:`LoraAdapterSet.activate` checks), or ``None``."""
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != b_shape[0]:
        return f"factors {list(a_shape)} and {list(b_shape)} are no (d_in, r) and (r, d_out) pair"
    d_in, d_out = int(a_shape[0]), int(b_shape[1])
    size = math.prod(int(d) for d in shape)
    grouped = len(shape) >= 3 and d_out == shape[0] and conv_adapter_groups(shape, d_in) > 1
    if d_in * d_out != size and not grouped:
        return f"the adapter makes a ({d_in}, {d_out}) delta, the param is {list(shape)}"
    return None


def _placeholder(snap: TensorSnapshot, device) -> Param:
    """A lazy param of ``snap``'s shape and dtype that the record's tensor replaces (an adapter
    the module lacks gets its factors from the file); its init is never run."""

    def never(dev, require_grad):  # pragma: no cover - the load replaces this param
        raise RecordError("internal: a placeholder LoRA factor was read before its tensor was loaded")

    return Param.uninitialized(snap.param_id if snap.param_id is not None else ParamId(), never, device, True,
                               tuple(int(d) for d in snap.shape), snap.dtype)


def _route_unnamed(record: Mapping, params: Mapping, sets: LoraAdapterSet, active: Optional[str], where: str) -> tuple:
    """``({old name: new name}, problems, undecided)``: the record's unnamed factors
    ``<W>.lora.a`` / ``.b`` (an old file, Burn's naming) that no param of the module takes, each
    pair sent to the named adapter whose factor ids it carries; a pair without ids (numpy arrays)
    to the ``active`` adapter, whose factors ``named_params`` names so; else to the one named
    adapter; else left undecided (one line each)."""
    pairs: dict = {}
    for key in record:
        match = _UNNAMED.match(key)
        if match and key not in params:
            pairs.setdefault(match.group("base"), {})[match.group("slot")] = key
    renames, problems, undecided = {}, [], []
    for base, slots in pairs.items():
        owners = {name: adapters[base] for name in sets.names
                  if base in (adapters := sets.adapters(name))}
        by_id = set()
        for slot, key in slots.items():
            pid = record[key].param_id
            if pid is not None:
                by_id |= {name for name, adapter in owners.items() if getattr(adapter, slot).id == pid}
        no_ids = all(record[key].param_id is None for key in slots.values())
        if len(by_id) == 1:
            chosen = next(iter(by_id))
        elif no_ids and active in owners:
            chosen = active  # arrays without ids (a dict): '<W>.lora.a' is the active factor's own path
        elif not by_id and len(sets.names) == 1 and owners:
            chosen = sets.names[0]
        else:
            shown = " / ".join(f"'{k}'" for k in slots.values())
            why = (f"its ids match several adapters' factors: {sorted(by_id)}" if by_id else
                   "it has no ids and the active adapter does not target it" if no_ids else "its ids match none")
            undecided.append(f"{shown}: adapters targeting '{base}': {list(owners)}; {why}")
            continue
        for slot, key in slots.items():
            new = factor_name(base, chosen, slot)
            if new in record:
                problems.append(f"'{key}' (an unnamed factor of adapter '{chosen}', by its ids) and '{new}' are both "
                                f"in {where}: two tensors for one factor")
            else:
                renames[key] = new
    return renames, problems, undecided


def load_named_adapters(module, record: Mapping, apply: Callable, *, source: str = "", report=None):
    """``module`` loaded from ``record`` with every named adapter restored by name (module
    docstring); ``apply(view, record)`` is the record application (the caller's
    :func:`onnxparam.convert.apply_record` with its options), run once on a view of the module
    where each named adapter's factors are params at ``<W>.lora.<name>.a`` / ``.b``.

    Raises:
        RecordError: every problem of the load at once (the application's: missing, unexpected,
            mis-shaped tensors; and these: an unnamed factor that cannot be placed, an adapter
            whose scale or layout differs from the module's, a file adapter for a param the
            module lacks or that does not fit it); its ``report`` attribute holds the
            application's report when it ran (``report``, the one the application fills, otherwise).
    """
    from ..core.module import named_params, rebuild

    where = f"'{source}'" if source else "the record"
    file_active, file_adapters = _file_description(record, where)
    owned = _owns(module)
    if owned:
        sets, active = adapter_set(module), active_adapter(module)
    else:
        current = _current_adapters(module)
        sets = LoraAdapterSet({DEFAULT_ADAPTER_NAME: current}) if current else LoraAdapterSet()
        active = DEFAULT_ADAPTER_NAME if current else None
    strip = active is not None
    view = rebuild(module, lambda path, p: p.with_adapter(None) if strip and p.adapter() is not None else p)
    object.__setattr__(view, _SET_ATTR, None)
    object.__setattr__(view, _ACTIVE_ATTR, None)
    params = dict(named_params(view))
    problems: list = []
    extras: dict = {}  # the factors of adapters the file adds (placeholders its tensors replace)
    added: dict = {}
    for name, paths in file_adapters.items():
        if name in sets.names:
            mine = sets.adapters(name)
            for path, info in paths.items():
                adapter = mine.get(path)
                if adapter is None:
                    continue  # its tensors are unexpected: the application reports them
                if float(info["scale"]) != float(adapter.scale) or bool(info.get("transposed", False)) != adapter.transposed:
                    problems.append(
                        f"adapter '{name}' on '{path}': {where} has scale {float(info['scale']):g}"
                        f"{', transposed' if info.get('transposed') else ''}, the module's adapter has scale "
                        f"{float(adapter.scale):g}{', transposed' if adapter.transposed else ''}; build the module with "
                        "the config the file was trained with (rank, alpha, use_rslora)")
            continue
        added[name] = {}
        for path, info in paths.items():
            ka, kb = factor_name(path, name, "a"), factor_name(path, name, "b")
            lacking = [k for k in (ka, kb) if k not in record]
            if lacking:
                problems.append(f"adapter '{name}' on '{path}' (in {where}'s {LORA_METADATA_KEY!r}): the file has no "
                                + " and no ".join(f"'{k}'" for k in lacking))
                continue
            base = params.get(path)
            if base is None:
                problems.append(f"adapter '{name}' of {where} targets '{path}', which is no param of "
                                f"{type(module).__name__}")
                continue
            why = _fit_problem(tuple(base.lazy_shape()), tuple(record[ka].shape), tuple(record[kb].shape))
            if why is not None:
                problems.append(f"adapter '{name}' of {where} on '{path}': {why}")
                continue
            device = base.lazy_device()
            extras[ka], extras[kb] = _placeholder(record[ka], device), _placeholder(record[kb], device)
            added[name][path] = info
    renames: dict = {}
    if sets.names:
        renames, more, undecided = _route_unnamed(record, params, sets, active, where)
        if undecided:
            raise RecordError(
                f"cannot load {where} into {type(module).__name__}: it holds unnamed LoRA factors (one adapter, "
                f"Burn's '<W>.lora.a' naming: a file saved before named adapters were recorded, or by another tool), "
                f"and the module owns the named adapters {sets.names}; their param ids do not tell which adapter they "
                f"were saved from, so none is loaded into a guessed adapter (nothing was loaded). Rename them to "
                f"'<W>.lora.<name>.a' / '.b' to choose: module.try_load_record({{re.sub(r'\\.lora\\.(a|b)$', "
                f"r'.lora.<name>.\\1', k): v for k, v in onnxparam.ModuleRecord.load_file(path).items()}}, allow_partial=True) "
                f"(the other adapters keep their values), or load the file into a module owning that one adapter", undecided)
        problems += more
    items = {renames.get(k, k): v for k, v in record.items()}
    mine: dict = {}  # the module's adapters the record loads: every one for a file that names them
    for name in sets.names:
        keys = {path: (factor_name(path, name, "a"), factor_name(path, name, "b")) for path in sets.adapters(name)}
        mine[name] = any(k in items for pair in keys.values() for k in pair)
    if not file_adapters and not any(mine.values()) and active is not None:
        mine[active] = True  # an old record without factors: the active adapter's are missing, as before
    for name, wanted in mine.items():
        if wanted or file_adapters:
            for path, adapter in sets.adapters(name).items():  # clones: tied factors stay distinct params
                extras[factor_name(path, name, "a")] = adapter.a.with_adapter(None)
                extras[factor_name(path, name, "b")] = adapter.b.with_adapter(None)
    metadata = {k: v for k, v in (getattr(record, "metadata", None) or {}).items() if k != LORA_METADATA_KEY}
    for key, param in extras.items():
        object.__setattr__(view, key, param)
    what = f"cannot load {where} into {type(module).__name__}"
    try:
        loaded = apply(view, ModuleRecord(items, metadata))
    except RecordError as error:
        if not problems:
            raise
        everything = list(error.problems) + problems
        combined = RecordError(f"{what}: {len(everything)} problem(s)", everything)
        combined.report = getattr(error, "report", report)
        raise combined from None
    if problems:
        error = RecordError(f"{what}: {len(problems)} problem(s)", problems)
        error.report = report
        raise error
    if report is not None:
        report.renamed.extend(renames.items())
    factors = {key: vars(loaded)[key] for key in extras}
    for key in extras:
        object.__delattr__(loaded, key)
    restored: dict = {}
    for name in sets.names:
        restored[name] = {path: adapter.with_factors(factors[factor_name(path, name, "a")],
                                                     factors[factor_name(path, name, "b")])
                          if factor_name(path, name, "a") in factors else adapter
                          for path, adapter in sets.adapters(name).items()}
    for name, paths in added.items():
        if paths:
            restored[name] = {path: LoraAdapter(factors[factor_name(path, name, "a")],
                                                factors[factor_name(path, name, "b")], float(info["scale"]),
                                                bool(info.get("transposed", False)))
                              for path, info in paths.items()}
    new_sets = LoraAdapterSet(restored)
    if active is None and file_active in new_sets.names and not _current_adapters(loaded):
        active = file_active  # the target chose none: the file's (the saved module computes with it)
    body = new_sets.activate(loaded, active) if active is not None else loaded
    if not owned and (not new_sets.names or (new_sets.names == [DEFAULT_ADAPTER_NAME] and active == DEFAULT_ADAPTER_NAME)):
        return _owning(body, LoraAdapterSet(), None)  # unnamed adapters (on the params) stay unnamed
    return _owning(body, new_sets, active)
