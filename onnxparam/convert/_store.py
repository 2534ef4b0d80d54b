"""Loading foreign weights into modules and saving modules for other tools (Burn's store API).

:func:`apply_record` loads any record (safetensors, burnpack, ONNX) into a module through a
layout adapter, key remapping, filters and casts, and returns a :class:`LoadReport`;
:func:`collect_record` is the inverse, producing the record a file is written from.
:func:`load_safetensors` / :func:`save_safetensors` are the two applied to safetensors files.

How a param finds its tensor (as Burn's ``Applier``): the file's names are first renumbered
(``contiguous_indices``) and remapped (``remap``); then each param of the module, in traversal
order, takes the tensor named by its path, or else the tensor of the adapter's name for it
(``norm.gamma`` <- ``norm.weight`` under the PyTorch adapter). The adapter then fixes the
layout (a ``Linear`` weight is transposed), a cast changes the precision, and the shape and
dtype are checked against the param. Every problem is collected before anything is loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Optional

from ..core.dtype import DType
from ..core.errors import RecordError
from ..core.module import named_modules
from ..core.record import ModuleRecord, TensorSnapshot, _dtype_fits, as_record
from ..lora._folded_norms import folded_norm_paths, folded_reason, holds_folded_norms
from ..formats._safetensors import read_safetensors, write_safetensors
from ._adapters import (
    KeyRemapper,
    ModuleAdapter,
    PathFilter,
    PyTorchAdapter,
    cast_snapshot,
    cast_spec,
    map_indices_contiguous,
    resolve_adapter,
    transpose_snapshot,
)
from ._pytorch_layout import IN_OUT, family_of, linear_layouts
from ._report import LoadReport, SaveReport

__all__ = ["apply_record", "collect_record", "load_safetensors", "load_pytorch", "load_onnx", "save_safetensors",
           "module_types"]


def module_types(module) -> dict:
    """``{module path: class-name lineage}`` of ``module`` and every sub-module.

    The lineage is the names of ``type(m).__mro__``, so a subclass of ``Linear`` counts as one.
    """
    return {path: tuple(cls.__name__ for cls in type(m).__mro__) for path, m in named_modules(module)}


def _owner(path: str, types: Mapping) -> tuple:
    return types.get(path.rpartition(".")[0], ())


def _shape(shape) -> list:
    return [int(d) for d in shape]


def apply_record(
    module,
    record: Mapping,
    *,
    adapter: "ModuleAdapter | str | None" = None,
    remap=None,
    include=None,
    exclude=None,
    cast=None,
    allow_partial: bool = False,
    contiguous_indices: bool = False,
    source: str = "",
    report: Optional[LoadReport] = None,
    _from_torch: bool = False,
):
    """A copy of ``module`` holding the tensors of ``record``: THE record application.

    Every loader goes through here: :meth:`Module.load_record <onnxparam.Module.load_record>`,
    :meth:`Module.load_file <onnxparam.Module.load_file>` (burnpack), :func:`load_safetensors`,
    :func:`load_pytorch`, :func:`load_onnx` and :func:`onnxparam.core.record.load_record`. Each
    returns the loaded module; the :class:`LoadReport` is filled into the ``report`` you pass
    (and attached to a raised ``RecordError`` as ``error.report``).

    Args:
        module: the target :class:`~onnxparam.Module`; it is not changed.
        record: ``name -> tensor``: a :class:`~onnxparam.ModuleRecord` (``TensorSnapshot``
            values), or a plain dict of numpy arrays, :class:`~onnxparam.Tensor` /
            ``TensorData`` values or torch tensors (a ``model.state_dict()``; torch is not
            imported for it).
        adapter: ``"pytorch"`` (PyTorch layouts and names, see
            :class:`~onnxparam.convert._adapters.PyTorchAdapter`), ``None``, or an adapter.
        remap: key remapping rules applied to the record's names: a
            :class:`~onnxparam.convert._adapters.KeyRemapper`, ``[(pattern, replacement)]`` or
            ``{pattern: replacement}``.
        include, exclude: regexes (one or a list) searched in *module paths*; params left out
            keep their current value and are reported as ``skipped``.
        cast: ``None`` (dtypes must match the module's), ``"module"`` (each float tensor is cast
            to its param's dtype), a float dtype (every float tensor becomes it) or
            ``{from: to}``; see :func:`~onnxparam.convert._adapters.cast_spec`.
        allow_partial: tolerate params the record has no tensor for and tensors no param
            takes (both still reported). Shape and dtype mismatches always raise.
        contiguous_indices: renumber integer path segments of the record's names to 0, 1, 2...
            (PyTorch ``nn.Sequential`` gaps) before remapping.
        source: the name used in messages and the report (a file path).
        report: a :class:`LoadReport` to fill in (``report = LoadReport(); m = apply_record(m,
            rec, report=report)``); ``None`` when you do not need it.

    A module owning named adapters, or a record describing some (``save_file`` of such a
    module), loads each adapter by name (:mod:`onnxparam.lora._records`: an adapter the module
    lacks is added, an old file's unnamed factors go where their param ids say or are refused).

    Returns:
        The loaded copy of ``module`` (lazy: no data is read until a value is needed; ids from
        the record where it has them, else the module's).

    Raises:
        RecordError: listing every problem (missing, unused, mis-shaped, mis-typed tensors, two
            tensors renamed to one name), each naming the tensor with expected and found
            shape / dtype; its ``report`` attribute holds the :class:`LoadReport`. From
            :func:`load_pytorch` also, whatever ``allow_partial`` says, a tensor for an imported
            weight holding a BatchNorm the exporter folded into it
            (``OnnxModule.onnx_folded_norms``): torch's unfolded tensor does not fit there, and
            the file lacks the BatchNorm's scale to unfold it.
    """
    record = as_record(record)
    adapter = resolve_adapter(adapter)
    remapper = KeyRemapper.of(remap)
    from ..lora._records import carries_named_adapters, load_named_adapters

    if carries_named_adapters(module, record):
        # named adapters (lora/_records.py): each loads by name into a view of the module where
        # every adapter's factors are params; the view is applied here, with the caller's options
        renamed = _renamed(record, remapper, contiguous_indices)
        if renamed is not None:
            report = LoadReport() if report is None else report

            def inner(view, translated):
                return apply_record(view, translated, adapter=adapter, include=include, exclude=exclude, cast=cast,
                                    allow_partial=allow_partial, source=source, report=report)

            loaded = load_named_adapters(module, renamed, inner, source=source, report=report)
            report.renamed[:0] = [(old, new) for old, new in zip(record, renamed) if old != new]
            return loaded
    path_filter = PathFilter(include, exclude)
    to_module_dtype = isinstance(cast, str) and cast.lower() == "module"
    casts = None if to_module_dtype else cast_spec(cast)
    report = LoadReport() if report is None else report
    report.source = str(source)
    has = "the file has" if source else "the record has"
    problems: list[str] = []

    renumbered = map_indices_contiguous(record) if contiguous_indices else {n: n for n in record}
    by_name: dict[str, str] = {}
    for original in record:
        name = remapper.apply(renumbered[original])
        if name in by_name:
            problems.append(f"name clash: tensors '{by_name[name]}' and '{original}' are both renamed to '{name}'")
            report.errors.append(problems[-1])
            continue
        by_name[name] = original
    snaps = {name: record[original] for name, original in by_name.items()}

    types = module_types(module)
    params = dict(module.named_params())
    restructured: set = set()
    restructure = getattr(adapter, "restructure", None)
    if restructure is not None:
        from ._torch_layers import layer_mapper

        mapped, consumed = restructure(module, snaps, layer_mapper)
        for name, layer in consumed.items():
            report.renamed.append((by_name.pop(name), layer))
            del snaps[name]
        for name, snap in mapped.items():
            by_name[name], snaps[name] = name, snap
        restructured = set(mapped)
    used: set = set()
    matched: dict[str, TensorSnapshot] = {}
    folded = folded_norm_paths(module)  # BatchNorms an exporter folded into imported weights
    refused_folded: list = []
    evidence = (linear_layouts((n, tuple(snap.shape)) for n, snap in snaps.items())
                if isinstance(adapter, PyTorchAdapter) else {})
    conv1d: list = []
    for path, param in params.items():
        owner = _owner(path, types)
        key = path if path in by_name else adapter.file_name(path, owner)
        if not path_filter.matches(path):
            report.skipped.append(path)
            used.add(key)  # its tensor (if any) is left out on purpose, not unused
            continue
        if key not in by_name:
            report.missing.append(path)
            continue
        used.add(key)
        original = by_name[key]
        snap = snaps[key]
        if original != path:
            report.renamed.append((original, path))
        where = f"'{path}'" + (f" (from '{original}')" if original != path else "")
        if _from_torch and path in folded:  # NOTE: a PyTorch checkpoint's tensor is torch's unfolded one
            problems.append(f"cannot load {where} from a PyTorch checkpoint: " + folded_reason(path, *folded[path]))
            report.errors.append(problems[-1])
            refused_folded.append(path)
            continue
        expected_shape = tuple(int(d) for d in param.lazy_shape())
        if key not in restructured and adapter.transposes(path, owner, tuple(snap.shape)):
            found = evidence.get(key)
            if found is not None and found.layout == IN_OUT and not adapter.forced(path):
                problems.append(
                    f"{where} is a Linear weight, but the file stores it (in, out) ({found.why}): the layout of "
                    "Hugging Face's Conv1D (GPT-2, GPT-J), which is Burn's own, not nn.Linear's (out, in); "
                    "the pytorch adapter would transpose it into the wrong layout")
                report.errors.append(problems[-1])
                conv1d.append(path)
                continue
            try:
                snap = transpose_snapshot(snap)
            except ValueError as exc:
                problems.append(f"cannot transpose {where}: {exc}")
                report.errors.append(problems[-1])
                continue
            report.transposed.append((path, _shape(snap.shape[::-1]), _shape(snap.shape)))
        expected_dtype = param.lazy_dtype()
        target = None
        if to_module_dtype:
            if (snap.dtype != expected_dtype and snap.dtype.is_float and expected_dtype.is_float
                    and DType.QFloat not in (snap.dtype, expected_dtype)):
                target = expected_dtype
        elif casts is not None:
            target = casts.get(snap.dtype)
        if target is not None and target != snap.dtype and snap.dtype.is_float and snap.scheme is None:
            report.cast.append((path, snap.dtype, target))
            snap = cast_snapshot(snap, target, name=path)
        error = None
        if tuple(snap.shape) != expected_shape:
            error = (f"shape mismatch for {where}: the module expects {list(expected_shape)}, {has} "
                     f"{_shape(snap.shape)}" + _shape_hint(expected_shape, tuple(snap.shape), path, report))
        elif not _dtype_fits(expected_dtype, snap.dtype):
            error = (f"dtype mismatch for {where}: the module expects {expected_dtype.name}, {has} "
                     f"{snap.dtype.name}; convert it to the module's dtype with "
                     f"onnxparam.convert.apply_record(module, record, cast='module') (or a load_* function's cast=)")
        if error is not None:
            problems.append(error)
            report.errors.append(error)
            continue
        matched[path] = snap
        report.applied.append(path)

    for name, original in by_name.items():
        if name in used:
            continue
        if adapter.ignores(name, _owner(name, types)):
            report.ignored.append(original)
        elif path_filter and not path_filter.matches(name):
            if original not in report.skipped:
                report.skipped.append(original)
        else:
            report.unused.append(original)

    if not allow_partial:
        for path in report.missing:
            param_desc = _describe(params[path])
            problems.append(f"missing tensor '{path}': the module expects {param_desc}, {has} none"
                            + _missing_hint(path, report))
        for original in report.unused:
            renamed = remapper.apply(renumbered[original]) if original in renumbered else original
            shown = f"'{original}'" + (f" (renamed to '{renamed}')" if renamed != original else "")
            problems.append(f"unexpected tensor {shown}: " + _unexpected_hint(renamed, params, refused_folded))
    if conv1d:
        families = sorted({family_of(p.rpartition(".")[0]) for p in conv1d})
        pattern = "|".join(re.escape(f).replace(r"\*", r"\d+") for f in families)
        problems.append(f"load Conv1D weights without transposing them: adapter=PyTorchAdapter("
                        f"no_transpose=r\"^({pattern})\\.weight$\") (onnxparam.convert.PyTorchAdapter)")
    if problems:
        what = f"'{source}'" if source else "the record"
        error = RecordError(f"cannot load {what} into {type(module).__name__}: {len(problems)} problem(s)", problems)
        error.report = report
        raise error
    return _rebuild(module, matched)


def _renamed(record: Mapping, remapper, contiguous_indices: bool) -> "ModuleRecord | None":
    """``record`` (a :class:`ModuleRecord`, metadata kept) under the names renumbering and
    ``remapper`` give; ``None`` when two tensors get one name (the plain application reports it)."""
    renumbered = map_indices_contiguous(record) if contiguous_indices else {n: n for n in record}
    names = {original: remapper.apply(renumbered[original]) for original in record}
    if len(set(names.values())) != len(names):
        return None
    if all(new == old for old, new in names.items()) and isinstance(record, ModuleRecord):
        return record
    return ModuleRecord({names[k]: record[k] for k in record}, getattr(record, "metadata", None))


def _rebuild(module, matched: Mapping):
    """A copy of ``module`` whose params at ``matched``'s paths take those (checked) snapshots,
    each through ``Param.transform_for_load``; no data is read here."""
    from ..core.module import rebuild

    def load(path: str, param):
        snap = matched.get(path)
        if snap is None:
            return param
        return param.transform_for_load(snap, snap.param_id if snap.param_id is not None else param.id)

    return rebuild(module, load)


_LORA_FACTOR = re.compile(r"^(?P<base>.+)\.lora\.(?:a|b)$")


def _unexpected_hint(name: str, params: Mapping, refused_folded=()) -> str:
    match = _LORA_FACTOR.match(name)
    if match and match.group("base") in params:
        return (f"it is a LoRA factor, but '{match.group('base')}' has no adapter; LoRA's scale is not stored "
                "in records, so apply_lora(LoraConfig(rank, alpha)) with the training config first, then load")
    if refused_folded:  # NOTE: allow_partial would load torch's unfolded weights around the folded ones
        return ("the module has no param at this path (the file folded its BatchNorms into "
                f"{', '.join(repr(p) for p in refused_folded[:4])}: see above; allow_partial cannot help): "
                "load the checkpoint into an export that keeps the BatchNorms")
    return ("the module has no param at this path; rename it with remap=[(pattern, replacement)], "
            "or pass allow_partial=True")


def _describe(param) -> str:
    return f"{param.lazy_dtype().name} {list(param.lazy_shape())}"


def _shape_hint(expected: tuple, found: tuple, path: str, report: LoadReport) -> str:
    if len(expected) != 2 or expected != found[::-1]:
        return ""
    if report.transposed and report.transposed[-1][0] == path:
        return "; the adapter transposed it: the file already stores it as the module does, so load without the adapter"
    return ("; the file looks transposed: PyTorch stores Linear weights as (out, in), Burn as (in, out); "
            "use adapter='pytorch' (or PyTorchAdapter(transpose=[pattern]) for non-Linear modules)")


def _missing_hint(path: str, report: LoadReport) -> str:
    why = dict(report.undecided).get(path)
    if why is not None:
        return f"; the exporter renamed it and no checkpoint tensor is certainly it: {why}"
    leaf = path.rpartition(".")[2]
    near = [u for u in report.unused if u.rpartition(".")[2] == leaf]
    if near:
        return f"; the file has unused tensors with the same leaf name ({', '.join(repr(n) for n in near[:3])}): rename them with remap"
    if leaf in ("gamma", "beta"):
        return "; PyTorch names norm params weight/bias: use adapter='pytorch'"
    return ""


def collect_record(module, *, adapter=None, remap=None, include=None, exclude=None, cast=None):
    """The record to write for ``module`` in a file's naming and layout, and a :class:`SaveReport`.

    The inverse of :func:`apply_record`: each param (traversal order) not filtered out by
    ``include``/``exclude`` (regexes on module paths) is transposed and renamed by the adapter,
    renamed by ``remap``, and cast. Nothing is read until the record's data is.

    Raises:
        RecordError: when two params end up with one name.
    """
    adapter = resolve_adapter(adapter)
    remapper = KeyRemapper.of(remap)
    path_filter = PathFilter(include, exclude)
    casts = cast_spec(cast)
    report = SaveReport()
    types = module_types(module)
    items: dict[str, TensorSnapshot] = {}
    origin: dict[str, str] = {}
    problems: list[str] = []
    from ..lora._records import module_record, saved_description

    whole = module_record(module)  # Burn's naming; every named adapter by name when the module owns some
    for path, snap in whole.items():
        if not path_filter.matches(path):
            report.skipped.append(path)
            continue
        owner = _owner(path, types)
        name = remapper.apply(adapter.file_name(path, owner))
        if adapter.transposes(path, owner, tuple(snap.shape)):
            try:
                snap = transpose_snapshot(snap)
            except ValueError as exc:
                problems.append(f"cannot transpose '{path}' (saved as '{name}'): {exc}")
                continue
            report.transposed.append((name, _shape(snap.shape[::-1]), _shape(snap.shape)))
        if casts is not None and snap.dtype in casts and casts[snap.dtype] != snap.dtype:
            report.cast.append((name, snap.dtype, casts[snap.dtype]))
            snap = cast_snapshot(snap, casts[snap.dtype], name=name)
        if name in items:
            problems.append(f"name clash: params '{origin[name]}' and '{path}' are both saved as '{name}'")
            continue
        if name != path:
            report.renamed.append((path, name))
        items[name] = snap
        origin[name] = path
        report.saved.append(name)
    if problems:
        raise RecordError(f"cannot save {type(module).__name__}: {len(problems)} problem(s)", problems)
    return ModuleRecord(items, saved_description(whole, {path: name for name, path in origin.items()})), report


def load_safetensors(
    module,
    path: "str | os.PathLike",
    *,
    adapter: "ModuleAdapter | str | None" = None,
    remap=None,
    include=None,
    exclude=None,
    cast=None,
    allow_partial: bool = False,
    contiguous_indices: bool = False,
    report: Optional[LoadReport] = None,
):
    """Load a safetensors file into a copy of ``module`` through :func:`apply_record`.

    Example, a PyTorch checkpoint into Burn-layout layers::

        report = LoadReport()
        model = load_safetensors(model, "model.safetensors", adapter="pytorch",
                                 remap=[(r"^backbone\\.", "")], allow_partial=True, report=report)
        print(report)

    Into an imported model, the weights torch's exporter renamed are matched by evidence as
    :func:`load_pytorch` does.

    Returns:
        The loaded copy of ``module``; the file's data stays memory-mapped until a value is needed.

    Raises:
        RecordError: for a malformed file, or tensors that do not fit (all listed); a file that
            holds the running statistics of a BatchNorm the exporter folded into an imported
            weight (``OnnxModule.onnx_folded_norms``; its module path from the graph's
            ``name_scopes``) is torch's state dict, refused for the folded weights as
            :func:`load_pytorch` refuses them.
        FileMissingError / IsAFolderError: no such file / a folder (the path named).
    """
    st_file = read_safetensors(path)
    report = LoadReport() if report is None else report
    # NOTE: a file holding the running statistics of a BatchNorm the exporter folded into an imported
    # weight is torch's state dict (its weights unfolded): refused for those weights, as load_pytorch
    torch_state = holds_folded_norms(module, st_file.tensors)
    record, exclude = _renamed_by_exporter(module, st_file.to_record(), adapter, exclude, report)
    return apply_record(module, record, adapter=adapter, remap=remap, include=include,
                        exclude=exclude, cast=cast, allow_partial=allow_partial,
                        contiguous_indices=contiguous_indices, source=str(path), report=report,
                        _from_torch=torch_state)


def load_pytorch(
    module,
    path: "str | os.PathLike | Mapping",
    *,
    top_level_key: Optional[str] = None,
    adapter: "ModuleAdapter | str | None" = "pytorch",
    remap=None,
    include=None,
    exclude=None,
    cast=None,
    allow_partial: bool = False,
    contiguous_indices: bool = False,
    report: Optional[LoadReport] = None,
):
    """Load a ``torch.save`` checkpoint (``.pt`` / ``.pth``) into a copy of ``module``, without torch.

    The file is read by :func:`onnxparam.formats._pytorch.read_pytorch` (restricted unpickler:
    nothing in the file runs; contiguous tensors stay views of the mapped file) and applied by
    :func:`apply_record` with the PyTorch adapter by default: by the type of the module holding
    each param, ``Linear`` weights are transposed, ``Embedding`` tables are not, norm
    ``weight``/``bias`` load into ``gamma``/``beta``, and BatchNorm's ``num_batches_tracked``
    is reported as ``ignored``.

    Into an imported model (an :class:`~onnxparam.OnnxModule`, or a module holding one), the
    weights torch's exporter renamed (``onnx::MatMul_N``: a bias-free ``nn.Linear``'s folded
    transpose, a tied ``lm_head``) get their checkpoint tensor by evidence only
    (:mod:`onnxparam.convert._torch_renamed`: the node naming the module, shapes, equal values,
    the file's tie), transposed where the shapes or values say so, noted in
    ``report.renamed`` / ``report.transposed``; what the evidence does not decide is in
    ``report.undecided`` (and missing) with the reason. The graph's own ``Constant`` tensors,
    which no checkpoint holds, are reported as skipped.

    Example::

        model = load_pytorch(Net(), "net.pt", top_level_key="state_dict", remap=[(r"^module\\.", "")])

    Args:
        path: the checkpoint file, or an in-memory state dict (``{name: torch tensor / numpy
            array}``, e.g. ``model.state_dict()``; torch is not imported for it).
        top_level_key: the entry of a checkpoint dict holding the state dict (``"state_dict"``,
            ``"model"``); ``None`` for a plain ``torch.save(model.state_dict())`` file.
        adapter: ``"pytorch"`` (default) or ``None`` for a checkpoint already in Burn's layout.

    Returns:
        The loaded copy of ``module``. Non-tensor entries of the checkpoint (an epoch number,
        optimizer hyper-parameters) are listed in ``report.skipped``.

    Raises:
        RecordError: for a file that is not a torch checkpoint, a pickle naming a global outside
            the allow-list (nothing is run), a missing ``top_level_key``, or tensors that do not
            fit (all listed).
    """
    from ..formats._pytorch import read_pytorch

    report = LoadReport() if report is None else report
    if isinstance(path, Mapping):  # an in-memory state dict: {name: torch tensor / array}
        state = path
        if top_level_key is not None:
            if top_level_key not in state or not isinstance(state[top_level_key], Mapping):
                raise RecordError(f"top_level_key {top_level_key!r} is not a dict entry of the state dict; it holds "
                                  f"{sorted(map(str, state))[:8]}")
            state = state[top_level_key]
        record = as_record(dict(state))
        record, exclude = _renamed_by_exporter(module, record, adapter, exclude, report)
        return apply_record(module, record, adapter=adapter, remap=remap, include=include, exclude=exclude,
                            cast=cast, allow_partial=allow_partial, contiguous_indices=contiguous_indices,
                            source="the state dict", report=report, _from_torch=True)
    if not isinstance(path, (str, os.PathLike)):
        raise RecordError(f"load_pytorch takes a checkpoint path or a state dict (a mapping of names to tensors), "
                          f"not {type(path).__name__}")
    checkpoint = read_pytorch(path, top_level_key=top_level_key)
    record = _lazy_record(checkpoint.tensors)
    record, exclude = _renamed_by_exporter(module, record, adapter, exclude, report)
    try:
        return apply_record(module, record, adapter=adapter, remap=remap, include=include, exclude=exclude,
                            cast=cast, allow_partial=allow_partial, contiguous_indices=contiguous_indices,
                            source=str(path), report=report, _from_torch=True)
    finally:
        report.skipped.extend(f"{name} (not a tensor)" for name in checkpoint.skipped)


def _renamed_by_exporter(module, record: Mapping, adapter, exclude, report: LoadReport) -> tuple:
    """``(record, exclude)`` for loading a torch checkpoint into ``module`` when it holds
    imported graphs: weights torch's exporter renamed (``onnx::MatMul_N``) get the checkpoint
    tensor the evidence names (:func:`~onnxparam.convert._torch_renamed.match_renamed_weights`),
    re-keyed to the param's path (transposed where needed; both noted in ``report``), the
    undecided ones go to ``report.undecided``, and params that are ``Constant`` nodes' tensors
    of a graph (which no checkpoint holds) are added to ``exclude`` (reported as skipped)."""
    from ._torch_renamed import graph_constant_paths, match_renamed_weights

    constants = graph_constant_paths(module)
    if not constants and not any(hasattr(type(sub), "onnx_names") for _, sub in named_modules(module)):
        return record, exclude
    adapter_obj = resolve_adapter(adapter)
    types = module_types(module)
    by_name: dict = {}
    for path, _ in module.named_params():
        name = path if path in record else adapter_obj.file_name(path, _owner(path, types))
        if name in record:
            by_name[path] = name
    shapes = {name: tuple(int(d) for d in snap.shape) for name, snap in record.items()}
    matches, undecided = match_renamed_weights(
        module, shapes, lambda name: record[name].to_data().to_numpy(), by_name, set(constants))
    snaps = dict(record.items())
    for m in matches:
        snap = record[m.source]
        if m.transpose:
            snap = transpose_snapshot(snap)
            report.transposed.append((m.path, _shape(snap.shape[::-1]), _shape(snap.shape)))
        snaps[m.path] = snap
        report.renamed.append((m.source, m.path))
    for source in {m.source for m in matches} - set(by_name.values()):
        snaps.pop(source, None)  # taken under the param's path (a name no param has would be 'unused')
    report.undecided.extend(sorted(undecided.items()))
    if constants:
        extra = [f"^{re.escape(p)}$" for p in constants if p not in record]
        exclude = ([exclude] if isinstance(exclude, str) else list(exclude or [])) + extra
    return (ModuleRecord(snaps, getattr(record, "metadata", None)) if matches else record), exclude


def _lazy_record(tensors) -> ModuleRecord:
    """A record of a checkpoint's :class:`~onnxparam.formats.CheckpointTensors` whose
    snapshots look each tensor up only when its data is read (a strided one is copied then)."""
    from ..core.dtype import dtype_from_numpy
    from ..core.tensor import TensorData

    snapshots = {}
    for name in tensors:
        try:
            dtype = dtype_from_numpy(tensors.dtype(name))
        except ValueError as exc:
            raise RecordError(f"record entry '{name}': {exc}") from None
        shape = tuple(int(d) for d in tensors.shape(name))
        snapshots[name] = TensorSnapshot(dtype, shape, None,
                                         lambda _n=name, _d=dtype, _s=shape: TensorData(tensors[_n], _d, _s))
    return ModuleRecord(snapshots)


def load_onnx(module, path: "str | os.PathLike", *, adapter=None, remap=None, include=None, exclude=None,
              cast=None, allow_partial: bool = False, contiguous_indices: bool = False,
              report: Optional[LoadReport] = None):
    """Load the weights of an ``.onnx`` file (a model onnxparam exported, or a weights-only one
    ``onnxparam convert`` wrote) into a copy of ``module`` through :func:`apply_record`.

    The weights are found by :func:`onnxparam.onnx_io._records.read_onnx_record`. To build a
    module *from* an ONNX graph use :func:`onnxparam.import_onnx` instead (it returns a new
    ``OnnxModule``; it is a constructor, not a loader).

    Returns:
        The loaded copy of ``module``.

    Raises:
        RecordError / OnnxFormatError: for a malformed file or tensors that do not fit.
    """
    from ._converter import read_record

    return apply_record(module, read_record(path), adapter=adapter, remap=remap, include=include, exclude=exclude,
                        cast=cast, allow_partial=allow_partial, contiguous_indices=contiguous_indices,
                        source=str(path), report=report)


def save_safetensors(
    module,
    path: "str | os.PathLike",
    *,
    adapter: "ModuleAdapter | str | None" = None,
    remap=None,
    include=None,
    exclude=None,
    cast=None,
    metadata: Optional[Mapping[str, str]] = None,
    lossless: bool = True,
) -> SaveReport:
    """Write ``module``'s params to a safetensors file (streaming, atomic); see :func:`collect_record`.

    Args:
        adapter: ``"pytorch"`` writes PyTorch's layout and names (``Linear`` weights
            ``(out, in)``, norm ``weight``/``bias``).
        metadata: ``str -> str`` for ``__metadata__`` (PyTorch tools write ``{"format": "pt"}``).
        lossless: also write param ids and data order (``onnxparam.*`` keys) so loading back
            restores them; ``False`` writes exactly what PyTorch tools write.

    Returns:
        a :class:`SaveReport` (``report.path`` is the file written).

    Raises:
        RecordError: for a name clash or a tensor safetensors cannot hold.
    """
    record, report = collect_record(module, adapter=adapter, remap=remap, include=include, exclude=exclude, cast=cast)
    metadata = {**record.metadata, **(metadata or {})}
    report.path = str(write_safetensors(path, record, metadata=metadata or None, lossless=lossless))
    return report
