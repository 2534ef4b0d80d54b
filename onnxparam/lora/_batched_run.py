"""Many LoRA adapters in one batch, runtime part: ``module(x, adapter_index=...)`` and the stacked
adapter sets of batched exports (writing them as ``.onnx_adapter`` files, checking that a set fits
an export). The export mode and the graph are in :mod:`onnxparam.lora._batched`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

from ._batched import (
    BASE_INDEX,
    BATCHED_MODE,
    INDEX_INPUT,
    METADATA_KEY,
    AdapterStacks,
    BatchedLora,
    batched_metadata,
    batched_options,
    index_array,
    named_adapters,
    stack_adapters,
    stack_names,
)
from ..core.errors import LoraError
from ._adapters import _ACTIVE_ATTR, _SET_ATTR

__all__ = ["call_batched", "batched_adapter_params", "write_batched_adapter", "check_batched_adapters"]

# -- the runtime: module(x, adapter_index=...) -------------------------------------------------

_STACK_CACHE: "OrderedDict" = OrderedDict()
_STACK_CACHE_SIZE = 4
_STACK_LOCK = threading.Lock()


def _stack_key(module, stacks_dims: AdapterStacks) -> tuple:
    """What the stacks' values are computed from (identity of every factor's storage, scales)."""
    from ..runtime._keys import _value_token

    parts = []
    for name, adapters in named_adapters(module):
        parts.append((name, tuple((path, _value_token(ad.a), _value_token(ad.b), float(ad.scale))
                                  for path, ad in adapters.items())))
    dtypes = tuple((p, t.dtype) for p, t in stacks_dims.targets.items())
    return (tuple(parts), dtypes)


def _forget_values(ids: set) -> int:
    """Drop the stacks computed from a factor stored as one of ``ids`` (written in place:
    :func:`onnxparam.runtime.forget_values`)."""
    from ..runtime._keys import _mentions

    with _STACK_LOCK:
        stale = [key for key in _STACK_CACHE if _mentions(key[0], ids)]
        for key in stale:
            del _STACK_CACHE[key]
    return len(stale)


def _register() -> None:
    from ..runtime._calls import register_value_cache

    register_value_cache(_forget_values)


_register()


def _runtime_stacks(module) -> AdapterStacks:
    dims = stack_adapters(module, values=False)
    key = _stack_key(module, dims)
    with _STACK_LOCK:
        hit = _STACK_CACHE.get(key)
        if hit is not None:
            _STACK_CACHE.move_to_end(key)
            return hit
    stacks = stack_adapters(module)
    with _STACK_LOCK:
        _STACK_CACHE[key] = stacks
        while len(_STACK_CACHE) > _STACK_CACHE_SIZE:
            _STACK_CACHE.popitem(last=False)
    return stacks


_FAST_MARK = "onnxparam.lora.batched"
"""What stands for ``adapter_index`` in the signature under which a batched call's runner is
remembered in the runtime's fast-path table (:func:`onnxparam.runtime._calls._remember`): a plain
value, so the key never matches a plain ``module(x)`` call's and does not depend on the index."""


def call_batched(module, args: tuple, kwargs: dict):
    """``module(*args, adapter_index=idx, **kwargs)``: ``module.forward(*args, **kwargs)`` with row
    ``n`` run under adapter ``idx[n]`` (module docstring), through ONNX Runtime.

    A repeated call (same module object, same input shapes and dtypes, its params, named
    adapters and active adapter the same objects) takes a fast path: the runner remembered with
    the stacks already fed, in the runtime's per-module table (dropped with it by
    ``clear_caches``, ``set_session_config`` and session eviction); only the index is new.

    Raises:
        LoraError: no adapters, an adapter that cannot be batched, a bad index.
        TraceError / ExecutionError: as any module call.
    """
    from ..trace.tracer import current_tracer
    from ..runtime import _calls
    from ..runtime._keys import call_signature

    kwargs = dict(kwargs)
    index = kwargs.pop(INDEX_INPUT)
    if current_tracer() is not None:
        raise LoraError(f"{type(module).__name__}(..., adapter_index=...) cannot run inside a trace: export the "
                        "outer module with lora='batched' instead")
    marked = {**kwargs, INDEX_INPUT: _FAST_MARK}
    # NOTE: inside quant.qdq_options the graph differs: no fast path, nothing remembered (as in
    # call_module)
    plain = _calls._passes().options() is None
    entry = _calls._fast.get(id(module)) if plain else None
    if entry is not None and entry.module() is module:
        leaves: list = []
        sig = call_signature(args, marked, leaves, cheap=True)
        runner = entry.by_sig.get(sig) if sig is not None else None
        if runner is not None and runner.batched[1] is getattr(module, _SET_ATTR, None) and \
                runner.batched[2] == getattr(module, _ACTIVE_ATTR, None) and entry.params_current(module):
            rows = index_array(index, runner.batched[0])
            _check_rows(module, rows, leaves)
            if runner._needs_ortvalues:
                return _with_index(runner, rows).run(leaves)
            return runner.run(leaves, {INDEX_INPUT: rows})
    stacks = _runtime_stacks(module)
    rows = index_array(index, stacks)
    with batched_options(BatchedLora(), fed=True):
        runner, tensors = _calls._resolve(module, args, kwargs, mode=BATCHED_MODE)
    fed = []
    for path, target in stacks.targets.items():
        a_name, b_name = stack_names(module, path)
        if a_name in runner.traced.graph.initializers:
            fed += [(a_name, target.a), (b_name, target.b)]
    _check_rows(module, rows, tensors)
    runner = runner.with_fed_params(fed)  # NOTE: a copy; its fast_keys list is the session's own
    runner.batched = (stacks, getattr(module, _SET_ATTR, None), getattr(module, _ACTIVE_ATTR, None))
    if plain and call_signature(args, marked, cheap=True) is not None:
        from ..core.module import named_params

        with _calls._LOCK:
            _calls._remember(module, args, marked, runner, runner.traced, dict(named_params(module)))
    return _with_index(runner, rows).run(tensors)


def _with_index(runner, rows: np.ndarray):
    """``runner`` (its stacks fed) feeding ``rows`` as the index too."""
    one = runner.with_fed_params([(INDEX_INPUT, rows)])
    one.fed = {**runner.fed, **one.fed}
    return one


def _check_rows(module, rows: np.ndarray, tensors) -> None:
    """An index of length 1 (every row) or one entry per row: the batch is dim 0 of the first
    input with a dim (as in the graph's own check, :meth:`onnxparam.lora._batched._Graph._checked`)."""
    batch = next((int(t.shape[0]) for t in tensors if len(t.shape) >= 1), None)
    if batch is None or len(rows) in (1, batch):
        return
    raise LoraError(f"{type(module).__name__}(..., adapter_index=...): adapter_index has {len(rows)} entries, "
                    f"the batch has {batch} rows: give one entry per row, or one entry for every row")


# -- checking and writing adapter sets --------------------------------------------------------


def batched_adapter_params(module, *, model=None, names: Optional[Sequence[str]] = None,
                           capacity: Optional[int] = None) -> dict:
    """``{stack input name: array}`` of ``module``'s named adapters stacked for a batched export:
    ``<W>.lora.a_stack`` ``(capacity + 1, d_in, r)`` and ``<W>.lora.b_stack``
    ``(capacity + 1, r, d_out)`` (slot 0 zeros, ``b`` scaled), at each base's float dtype.

    ``model`` (a batched export's path or model): the export's adapters first, in its index
    order, then the module's other named adapters (indices past them: adapters added to the
    export's spare capacity), its capacity, each stack zero-padded up to the export's rank (a
    larger rank fits too: the rank dims are symbolic); otherwise ``names`` / ``capacity``
    (default: every named adapter, capacity = their number).

    Raises:
        LoraError: an adapter that cannot be stacked, more adapters than the capacity, an export
            adapter name the module lacks, a weight the export has no stacks for, or a ``model``
            that is not a batched export.
    """
    ranks = None
    if model is not None:
        meta = batched_metadata(model)
        if meta is None:
            raise LoraError(f"{_model_label(model)} is not a batched LoRA export (no {METADATA_KEY!r} metadata)")
        if names is None:
            held = [n for n, _ in named_adapters(module)]
            names = list(meta["adapters"]) + [n for n in held if n not in meta["adapters"]]
        capacity = meta["capacity"] if capacity is None else capacity
        ranks = {t["path"]: int(t["rank"]) for t in meta["targets"]}
    stacks = stack_adapters(module, BatchedLora(tuple(names) if names is not None else None, capacity))
    params = {}
    for path, target in stacks.targets.items():
        a, b = target.a, target.b
        if ranks is not None:
            if path not in ranks:
                raise LoraError(f"adapter weight {path!r} is not a target of {_model_label(model)} "
                                f"(its targets: {sorted(ranks)[:6]} ...)")
            pad = max(ranks[path] - target.rank, 0)
            a = np.pad(a, ((0, 0), (0, 0), (0, pad)))
            b = np.pad(b, ((0, 0), (0, pad), (0, 0)))
        a_name, b_name = stack_names(module, path)
        params[a_name], params[b_name] = a, b
    return params


def _model_label(model) -> str:
    import os

    return f"'{os.fspath(model)}'" if isinstance(model, (str, os.PathLike)) else "the model"


def write_batched_adapter(module, path, *, model=None, names: Optional[Sequence[str]] = None,
                          capacity: Optional[int] = None, adapter_version: int = 1, model_version: int = 1):
    """Write ``module``'s named adapters, stacked (:func:`batched_adapter_params`), as one ONNX
    Runtime ``.onnx_adapter`` file for a batched export: activate it per run with
    ``RunOptions.add_active_adapter`` to replace every stack of the session at once.

    Returns:
        the ``pathlib.Path`` written.

    Raises:
        LoraError: as :func:`batched_adapter_params`.
        PermissionError / FileNotFoundError: as :func:`onnxparam.write_onnx_adapter`.
    """
    from ._adapter_file import write_onnx_adapter

    params = batched_adapter_params(module, model=model, names=names, capacity=capacity)
    return write_onnx_adapter(params, path, adapter_version=adapter_version, model_version=model_version)


def check_batched_adapters(model, adapters) -> dict:
    """Check that an adapter set fits the batched export ``model`` (a path, an ``onnx_ir.Model``
    or an ``onnx.ModelProto``), and return ``{stack input name: shape}``.

    ``adapters``: a ``.onnx_adapter`` file (:func:`write_batched_adapter`), a module with named
    adapters (stacked in the export's adapter order and capacity), or ``{name: array}``.

    Checked: every stack input of the export is given and nothing else; ``a`` ``(slots, d_in, r)``
    and ``b`` ``(slots, r, d_out)`` with the export's ``d_in`` / ``d_out``, one ``r`` per pair,
    one ``slots`` for every stack, ``1 <= slots <= capacity + 1`` (the export's capacity), the
    export's dtype, slot 0 all zeros (the base model's index), a grouped convolution's ``b``
    block-diagonal in each slot (PEFT's ``lora_B``: :func:`onnxparam.lora._conv_checks.grouped_b_problem`);
    a module's adapter names: the
    export's names first, in index order, each adapter's rank at most the export's.

    Raises:
        RecordError: every problem listed; a single adapter's factors (``<W>.lora.a`` /
            ``.lora.b``, an ``inputs`` export's file) say that a batched export needs the stacks
            of :func:`write_batched_adapter`.
        LoraError: ``model`` is not a batched export; a module's adapters cannot be stacked.
        ExecutionError: ONNX Runtime cannot read the adapter file.
        FileNotFoundError: a missing file.
    """
    import os
    from pathlib import Path

    from ..core.errors import RecordError

    if isinstance(model, (str, os.PathLike)) and not Path(model).is_file():
        raise FileNotFoundError(2, "no such file", os.fspath(model))
    meta = batched_metadata(model)
    if meta is None:
        raise LoraError(f"{_model_label(model)} is not a batched LoRA export (no {METADATA_KEY!r} metadata): "
                        "export it with export_onnx(..., lora='batched')")
    label = _model_label(model)
    problems = []
    source = "the adapters"
    if isinstance(adapters, (str, os.PathLike)):
        params, source = _read_adapter_file(adapters), f"'{os.fspath(adapters)}'"
    elif isinstance(adapters, dict):
        params = {str(k): np.asarray(v) for k, v in adapters.items()}
    else:
        found = [n for n, _ in named_adapters(adapters)]
        want = list(meta["adapters"])
        if found[:len(want)] != want:
            missing = [n for n in want if n not in found]
            problems.append(f"the export's adapters are {want} (indices 1..{len(want)}); the module holds {found}"
                            + (f" (missing {missing})" if missing else " (in another order)"))
        extra = [n for n in found if n not in want]
        if len(want) + len(extra) > int(meta["capacity"]):
            problems.append(f"{len(want) + len(extra)} adapters do not fit the export's capacity {meta['capacity']}")
        if problems:
            raise RecordError(f"the named adapters of {type(adapters).__name__} do not fit {label}", problems)
        order = want + extra
        try:
            params = batched_adapter_params(adapters, model=model, names=order, capacity=int(meta["capacity"]))
        except LoraError as e:
            raise RecordError(f"the named adapters of {type(adapters).__name__} do not fit {label}", [str(e)]) from e
        source = f"the named adapters of {type(adapters).__name__}"
    targets = {t["a"]: ("a", t) for t in meta["targets"]}
    targets.update({t["b"]: ("b", t) for t in meta["targets"]})
    single = sorted(n for n in params if n.endswith((".lora.a", ".lora.b")))
    if single and not any(n in targets for n in params):
        raise RecordError(
            f"{source} holds one adapter's factors ({single[0]!r} ...: an 'inputs' export's file, "
            f"write_onnx_adapter), not the stacked set the batched export {label} takes "
            f"(its inputs: {meta['targets'][0]['a']!r} ...): write the stacks with "
            f"onnxparam.write_batched_adapter(module, path, model={label}) from a module holding the named "
            "adapters (add_adapter)")
    slots_seen = {}
    ranks: dict = {}
    for name, value in sorted(params.items()):
        hit = targets.get(name)
        if hit is None:
            problems.append(f"{name!r} is not a stack input of {label}")
            continue
        which, t = hit
        if value.dtype != np.dtype(t["dtype"]):
            problems.append(f"{name!r} is {value.dtype}, the export's input is {t['dtype']}")
        fixed_axis, rank_axis = (1, 2) if which == "a" else (2, 1)
        fixed = t["d_in"] if which == "a" else t["d_out"]
        if value.ndim != 3 or value.shape[fixed_axis] != fixed:
            want = f"(slots, {fixed}, r)" if which == "a" else f"(slots, r, {fixed})"
            problems.append(f"{name!r} has shape {list(value.shape)}, the export needs {want}" + _conv_hint(t, which))
            continue
        slots_seen[name] = int(value.shape[0])
        ranks.setdefault(t["path"], {})[which] = int(value.shape[rank_axis])
        if value.shape[0] >= 1 and np.any(value[0] != 0):
            problems.append(f"{name!r}: slot {BASE_INDEX} (the base model's index) is not all zeros")
    for t in meta["targets"]:
        for which in ("a", "b"):
            if t[which] not in params:
                problems.append(f"{t[which]!r} is missing (a stack left out keeps the export's default values)")
        found = ranks.get(t["path"], {})
        if len(found) == 2 and found["a"] != found["b"]:
            problems.append(f"{t['a']!r} has rank {found['a']} but {t['b']!r} has rank {found['b']}")
    problems += _grouped_conv_problems(meta, params, slots_seen)
    distinct = sorted(set(slots_seen.values()))
    if len(distinct) > 1:
        problems.append(f"the stacks have different slot counts {distinct}: every stack needs the same")
    if distinct and not 1 <= distinct[-1] <= int(meta["slots"]):
        problems.append(f"the stacks hold {distinct[-1]} slots; the export's capacity is {meta['capacity']} adapters "
                        f"(+ slot {BASE_INDEX} for the base): at most {meta['slots']}")
    if problems:
        raise RecordError(f"{source} do not fit the batched export {label}", problems)
    return {name: tuple(value.shape) for name, value in params.items()}


def _grouped_conv_problems(meta: dict, params: dict, fitting: dict) -> list:
    """Each slot of a grouped convolution target (stacks of the export's shapes: ``fitting``)
    whose ``b``, cut to the slot's rank, is not PEFT's grouped ``lora_B``
    (:func:`onnxparam.lora._conv_checks.grouped_b_problem`; as :func:`onnxparam.write_batched_peft`
    reports it)."""
    from ._adapters import conv_adapter_groups
    from ._conv_checks import grouped_b_problem, slot_factors

    problems = []
    names = list(meta["adapters"])
    for t in meta["targets"]:
        if t.get("kind") != "conv" or t["a"] not in fitting or t["b"] not in fitting:
            continue
        a, b = params[t["a"]], params[t["b"]]
        groups = conv_adapter_groups(tuple(t["shape"]), int(t["d_in"]))
        if groups <= 1 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            continue
        for slot in range(BASE_INDEX + 1, a.shape[0]):
            _, b_slot = slot_factors(a[slot], b[slot], groups)
            problem = grouped_b_problem(b_slot, tuple(t["shape"]), int(t["d_in"]))
            if problem is not None:
                label = f"slot {slot}" + (f" ({names[slot - 1]!r})" if slot <= len(names) else "")
                problems.append(f"{label}: the stacks of {t['path']!r}: {problem}")
    return problems


def _conv_hint(target: dict, which: str) -> str:
    """What a convolution target's ``a`` rows are (PEFT's ``lora_A``: every input channel, the
    kernel), for a misfit message; ``""`` for other targets."""
    if target.get("kind") != "conv" or which != "a" or len(target.get("shape", ())) < 3:
        return ""
    from ._adapters import conv_adapter_groups

    shape = [int(d) for d in target["shape"]]
    groups = conv_adapter_groups(tuple(shape), int(target["d_in"]))
    kernel = int(np.prod(shape[2:]))
    return (f" (a convolution {shape}{f' with groups={groups}' if groups > 1 else ''}: a's rows are all "
            f"{shape[1] * groups} input channels times the kernel's {kernel} taps, PEFT's lora_A)")


def _read_adapter_file(path) -> dict:
    from pathlib import Path

    from ._adapter_file import _CXX_SOURCE
    from ..runtime._ort import import_onnxruntime
    from ..core.errors import ExecutionError

    if not Path(path).is_file():
        raise FileNotFoundError(2, "no such file", str(path))
    ort = import_onnxruntime()
    try:
        fmt = ort.AdapterFormat.read_adapter(str(path))
        return {name: value.numpy() for name, value in fmt.get_parameters().items()}
    except Exception as e:
        raise ExecutionError(f"ONNX Runtime cannot read '{path}' as an .onnx_adapter file: "
                             f"{' '.join(_CXX_SOURCE.sub('', str(e)).split()) or type(e).__name__}") from e
