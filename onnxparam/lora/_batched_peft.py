"""A stacked adapter set of a batched export written as PEFT's multi-adapter folder:
:func:`write_batched_peft`.

A batched export (``export_onnx(..., lora="batched")``, :mod:`onnxparam.lora._batched`) takes
its adapters as stacks ``<W>.lora.a_stack`` ``(slots, d_in, r)`` and ``<W>.lora.b_stack``
``(slots, r, d_out)``; slot 0 is the base model, slot ``k`` the ``k``-th adapter, its scale
folded into ``b``, a smaller rank zero-padded. A server holds such a set (the export's own
defaults, a stacked ``.onnx_adapter`` file from :func:`onnxparam.write_batched_adapter`, or
arrays it fed): this writes it back as the folder ``PeftModel.save_pretrained`` writes for
several adapters, so PyTorch / PEFT (``PeftModel.from_pretrained`` + ``load_adapter``) and
:func:`onnxparam.load_peft_adapters` read it.

Per adapter slot and target weight (PEFT's ``peft/tuners/lora/layer.py`` layout): ``lora_A.weight``
``(r, d_in) = a[:, :r].T``, ``lora_B.weight`` ``(d_out, r) = b[:r].T`` (an embedding table:
``lora_embedding_A`` ``(r, num) = a.T``, ``lora_embedding_B`` ``(dim, r) = b.T``), where ``r``
is the slot's rank with the zero padding cut off (the last column of ``a`` / row of ``b`` that
is not all zeros). The scale is already in ``b``, so ``lora_alpha`` is ``r`` for every module
(PEFT's scale ``alpha / r = 1``; ``rank_pattern`` / ``alpha_pattern`` for the modules whose
``r`` differs from the most common one): the written adapter gives the same outputs, not the
original ``alpha``.

A convolution weight ``(out, in / groups, *kernel)`` (PEFT's ``Conv1d/2d/3d``): ``lora_A.weight``
``(r, in, *kernel)`` is ``a[:, :r].T`` reshaped (a conv of every input channel), ``lora_B.weight``
``(out, r / groups, 1, ...)`` a 1x1 conv with the base's ``groups``: ``b[:r].T`` for
``groups == 1``, else ``b``'s diagonal blocks (``b`` must be zero outside them; ``r`` rounded up
to a multiple of ``groups``, as PEFT needs). A bias target (PEFT's ``lora_bias``) with a non-zero
delta ``a @ b`` in a slot becomes ``lora_B.bias`` of its module (``<m>.bias``: module ``<m>``)
and sets ``lora_bias`` in that adapter's config, which gives every module of the adapter a
``lora_B.bias`` (zeros where the module's bias has no delta; zero factors of rank ``groups``
for a module whose bias has a delta but whose weight has none in that slot). PEFT refuses
``lora_bias`` on ``Embedding`` layers, so an adapter with both is refused.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..core.errors import LoraError, RecordError
from ._batched import BASE_INDEX, METADATA_KEY, STACK_SUFFIXES, batched_metadata
from ._conv_checks import slot_factors

__all__ = ["write_batched_peft"]

_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _load_model(model):
    """``model`` (a path, ``onnx.ModelProto`` or ``onnx_ir.Model``) as an ``onnx_ir.Model``."""
    import onnx_ir as ir

    if isinstance(model, (str, os.PathLike)):
        if not Path(model).is_file():
            raise FileNotFoundError(2, "no such file", os.fspath(model))
        return ir.load(os.fspath(model))
    if isinstance(model, ir.Model):
        return model
    return ir.serde.deserialize_model(model)


def _label(model) -> str:
    return f"'{os.fspath(model)}'" if isinstance(model, (str, os.PathLike)) else "the model"


def _stacks_of(adapters, model, ir_model, meta) -> dict:
    """``{stack input name: array}`` of ``adapters`` (a file, arrays, a module, or ``None``: the
    export's own defaults), checked against the export."""
    from ._batched_run import batched_adapter_params, check_batched_adapters

    if adapters is None:
        params = {}
        for t in meta["targets"]:
            for name in (t["a"], t["b"]):
                value = ir_model.graph.initializers.get(name)
                if value is None or value.const_value is None:
                    raise RecordError(f"{_label(model)} has no default values for its stack input {name!r}: "
                                      "pass the adapter set (a .onnx_adapter file or arrays)")
                params[name] = np.asarray(value.const_value.numpy())
        return params
    if isinstance(adapters, (str, os.PathLike)):
        from ._batched_run import _read_adapter_file

        params = _read_adapter_file(adapters)
    elif isinstance(adapters, dict):
        params = {str(k): np.asarray(v) for k, v in adapters.items()}
    else:
        check_batched_adapters(ir_model, adapters)
        params = batched_adapter_params(adapters, model=ir_model)
    check_batched_adapters(ir_model, params)
    return params


def _module_names(ir_model, meta, key_map) -> dict:
    """``{target path: (PEFT module name, kind)}``: ``kind`` ``"embedding"`` for a table a
    ``Gather`` (axis 0) reads as its data, ``"conv"`` for a convolution weight, ``"bias"`` for
    a bias (PEFT's ``lora_bias``: the ``lora_B.bias`` of its module), else ``"linear"``. A
    weight named ``<m>.weight`` (a bias ``<m>.bias``) is module ``<m>``; a weight torch's
    exporter renamed (``onnx::MatMul_N``, ``val_N``) is the module the graph names (its
    ``<m>.bias``, its node's ``/<m>/MatMul`` name, dynamo's ``name_scopes``), as
    :func:`onnxparam.load_peft_adapter` finds it; then ``key_map``. An embedding table is the
    module its ``Gather`` s name (:func:`onnxparam.lora._tables.owner_name`: a tied table with no
    such evidence is refused unless a ``key_map`` rule matches it)."""
    from ._graph import _attr_int
    from ._peft import _linear_aliases

    aliases: dict = {}
    for alias, weight in _linear_aliases(ir_model).items():
        aliases.setdefault(weight, set()).add(alias[: -len(".weight")])
    tables = {node.inputs[0].name for node in ir_model.graph.all_nodes()
              if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.inputs
              and node.inputs[0] is not None and _attr_int(node, "axis", 0) == 0}
    from ._tables import owner_name, table_owners

    owners = table_owners(ir_model)
    rules = [tuple(r) for r in (key_map or ())]
    names, problems, table_problems = {}, [], []
    for t in meta["targets"]:
        kind = t.get("kind", "matrix")
        weight = t["a"][: -len(STACK_SUFFIXES[0])]
        if kind == "bias":
            name = weight[: -len(".bias")] if weight.endswith(".bias") else weight
            for pattern, repl in rules:
                name = re.sub(pattern, repl, name)
            if name == weight:
                problems.append(f"bias {weight!r} is not named '<module>.bias': give a key_map rule (regex, module "
                                "name) for it")
                continue
            names[t["path"]] = (name, "bias")
            continue
        if weight in owners and kind != "conv":  # an embedding table: the module its Gathers name
            name, problem = owner_name(weight, weight[: -len(".weight")] if weight.endswith(".weight") else weight,
                                       owners[weight], rules)
            if problem is not None:
                table_problems.append(problem)
            else:
                names[t["path"]] = (name, "embedding")
            continue
        if weight.endswith(".weight"):
            name = weight[: -len(".weight")]
        else:
            found = sorted(aliases.get(weight, ()))
            if len(found) > 1:
                problems.append(f"weight {weight!r}: the graph names it as several modules {found}")
                continue
            name = found[0] if found else weight
        for pattern, repl in rules:
            name = re.sub(pattern, repl, name)
        if name == weight and not weight.endswith(".weight"):
            problems.append(f"weight {weight!r} is not named '<module>.weight' and the graph does not say which "
                            "module it belongs to; give a key_map rule (regex, module name) for it")
            continue
        names[t["path"]] = (name, "conv" if kind == "conv" else "embedding" if weight in tables else "linear")
    for which in ("weights", "biases"):
        taken = Counter(n for n, k in names.values() if (k == "bias") == (which == "biases"))
        problems += [f"several {which} are written for PEFT module {n!r}" for n, c in taken.items() if c > 1]
    if table_problems:
        raise LoraError("cannot name the batched export's adapted weights as PEFT modules: "
                        + "; ".join(table_problems))
    if problems:
        raise RecordError("cannot name the batched export's adapted weights as PEFT modules", problems)
    return names


def _groups(target: dict) -> int:
    """A target's PEFT ``groups``: a convolution's (:func:`~onnxparam.lora._adapters.conv_adapter_groups`),
    else 1."""
    from ._adapters import conv_adapter_groups

    return conv_adapter_groups(tuple(target["shape"]), int(target["d_in"])) if target.get("kind") == "conv" else 1


def _module_tensors(key: str, kind: str, t: dict, a: np.ndarray, b: np.ndarray, label: str, problems: list) -> dict:
    """One PEFT module's factors from ``a`` ``(d_in, r)``, ``b`` ``(r, d_out)`` (module docstring)."""
    if kind == "embedding":
        return {f"{key}.lora_embedding_A": np.ascontiguousarray(a.T),
                f"{key}.lora_embedding_B": np.ascontiguousarray(b.T)}
    if kind != "conv":
        return {f"{key}.lora_A.weight": np.ascontiguousarray(a.T), f"{key}.lora_B.weight": np.ascontiguousarray(b.T)}
    from ._peft_save import conv_factors

    factors = conv_factors(a, b, tuple(t["shape"]))
    if isinstance(factors, str):
        problems.append(f"{label}: the stacks of {t['path']!r}: {factors}")
        return {}
    return {f"{key}.lora_A.weight": factors[0], f"{key}.lora_B.weight": factors[1]}


def write_batched_peft(adapters, folder: "str | os.PathLike", *, model, names: Optional[Sequence[str]] = None,
                       key_map: Optional[Sequence] = None, base_model_name_or_path: Optional[str] = None) -> Path:
    """Write a stacked adapter set of the batched export ``model`` as PEFT's multi-adapter folder
    (module docstring): the adapter named ``"default"`` in ``folder`` itself, every other one in
    ``folder/<name>/``, each with ``adapter_config.json`` and ``adapter_model.safetensors``, as
    ``PeftModel.save_pretrained`` writes several adapters. ``PeftModel.from_pretrained(torch_model,
    folder / name, adapter_name=name)`` and ``load_adapter`` load them onto the PyTorch model the
    export came from; :func:`onnxparam.load_peft_adapters` reads the folder back.

    Args:
        adapters: the stacked set: a stacked ``.onnx_adapter`` file
            (:func:`onnxparam.write_batched_adapter`), ``{stack input name: array}`` (``a``
            ``(slots, d_in, r)``, ``b`` ``(slots, r, d_out)``, the export's dtype), a module with
            named adapters (stacked as :func:`onnxparam.write_batched_adapter` does), or ``None``
            for the export's own default stacks. It must fit the export
            (:func:`onnxparam.check_batched_adapters`).
        folder: the folder to write (created if needed; files of the same names are replaced).
        model: the batched export (a path, ``onnx.ModelProto`` or ``onnx_ir.Model``): its
            metadata names the adapters and targets, its graph the PyTorch modules.
        names: the adapter names of slots ``1, 2, ...`` in order (default: the export's adapter
            names, then a module's other named adapters); slots past the names that are all
            zeros (spare capacity) are skipped.
        key_map: ``[(regex, replacement), ...]`` applied (``re.sub``) to each PEFT module name.
        base_model_name_or_path: recorded in each config (informational).

    Returns:
        ``folder``'s ``Path``.

    Raises:
        LoraError: ``model`` is not a batched export (a ``ValueError``); an embedding table
            tied to an output projection whose graph does not name the module owning it (dynamo's
            ``name_scopes`` or a TorchScript ``/<m>/Gather`` node name; PEFT would drop an
            embedding adapter written under the projection's ``nn.Linear``), or whose
            ``Gather`` s name several modules, without a ``key_map`` rule for it.
        RecordError: the set does not fit the export (every misfit listed), a slot past the
            names holds an adapter, a named slot is all zeros, a name that is not a plain folder
            name or is repeated, a weight or bias no PEFT module name can be given to, a grouped
            conv's ``b`` that is not block-diagonal, a bias delta whose module's weight is no
            target, or ``lora_bias`` with an embedding adapter in one slot.
        FileNotFoundError: a missing ``model`` or adapter file.

    Warns:
        LoraWarning: a convolution target on a dilated or ``reflect`` / ``edge`` / ``wrap``
            padded conv: the export applies its merged weight delta, which PEFT's unmerged
            forward does not follow (:mod:`onnxparam.lora._peft_conv_warn`).
    """
    from safetensors.numpy import save_file

    ir_model = _load_model(model)
    meta = batched_metadata(ir_model)
    if meta is None:
        raise LoraError(f"{_label(model)} is not a batched LoRA export (no {METADATA_KEY!r} metadata): export it "
                        "with export_onnx(..., lora='batched')")
    params = _stacks_of(adapters, model, ir_model, meta)
    slots = int(next(iter(params.values())).shape[0])
    if names is None:
        names = list(meta["adapters"])
        if not isinstance(adapters, (str, os.PathLike, dict)) and adapters is not None:
            from ._batched import named_adapters

            # a module: its adapters past the export's fill the next slots (batched_adapter_params)
            names += [n for n, _ in named_adapters(adapters) if n not in names]
    names = [str(n) for n in names]
    problems = []
    if len(set(names)) != len(names):
        problems.append(f"the adapter names repeat: {names}")
    bad = [n for n in names if not _FOLDER_NAME.fullmatch(n)]
    if bad:
        problems.append(f"adapter names {bad} cannot be folder names (PEFT stores each adapter in a folder "
                        "named after it)")
    if len(names) > slots - 1:
        problems.append(f"{len(names)} names for {slots - 1} adapter slots")
    modules = _module_names(ir_model, meta, key_map)
    written = {}  # adapter name -> ({safetensors key: array}, {module: rank}, lora_bias)
    for slot in range(BASE_INDEX + 1, slots):  # slot 0: the base model, never written
        found, biases = {}, {}  # module -> (target, a (d_in, r), b (r, d_out)); module -> bias delta (d_out,)
        for t in meta["targets"]:
            a, b = params[t["a"]][slot], params[t["b"]][slot]
            name, kind = modules[t["path"]]
            if kind == "bias":  # a (1, r) @ b (r, d_out): the delta, scale folded in
                delta = (a.astype(np.float64) @ b.astype(np.float64)).reshape(-1)
                if np.any(delta != 0):
                    biases[name] = delta.astype(np.float32)
                continue
            a, b = slot_factors(a, b, _groups(t))  # PEFT: a grouped conv's rank divides by its groups
            if a.shape[1]:
                found[name] = (t, a, b)
        label = f"slot {slot}" + (f" ({names[slot - 1]!r})" if slot <= len(names) else "")
        if slot > len(names):
            if found or biases:
                problems.append(f"slot {slot} holds an adapter but has no name (names: {names}); pass names=")
            continue
        if not found and not biases:
            problems.append(f"{label} is all zeros: no adapter to write")
            continue
        for name in biases:
            if name not in found:  # PEFT's lora_bias is lora_B's bias: the module needs factors (zeros)
                t = next((t for t in meta["targets"] if modules[t["path"]] == (name, "conv")
                          or modules[t["path"]] in ((name, "linear"), (name, "embedding"))), None)
                if t is None:
                    problems.append(f"{label}: the bias of PEFT module {name!r} has an adapter but the module's weight "
                                    "is not a target of the export (PEFT's lora_bias belongs to the weight's adapter)")
                    continue
                r = _groups(t)
                found[name] = (t, np.zeros((t["d_in"], r), np.float32), np.zeros((r, t["d_out"]), np.float32))
        embeddings = sorted(n for n, (t, _, _) in found.items() if modules[t["path"]][1] == "embedding")
        if biases and embeddings:
            problems.append(f"{label} has bias adapters (lora_bias) and embedding adapters ({embeddings}): PEFT "
                            "refuses lora_bias on Embedding layers")
            continue
        tensors, ranks = {}, {}
        for name, (t, a, b) in sorted(found.items()):
            tensors.update(_module_tensors(f"base_model.model.{name}", modules[t["path"]][1], t, a, b, label,
                                           problems))
            ranks[name] = int(a.shape[1])
            if biases:  # every module's lora_B has a bias when the config says lora_bias
                tensors[f"base_model.model.{name}.lora_B.bias"] = biases.get(name, np.zeros(t["d_out"], np.float32))
        written[names[slot - 1]] = (tensors, ranks, bool(biases))
    if problems:
        raise RecordError(f"cannot write the adapter set of {_label(model)} as PEFT adapters", problems)
    from ._peft_conv_warn import export_conv_problems, warn_unmerged_convs

    warn_unmerged_convs(export_conv_problems(ir_model, meta["targets"]), "write_batched_peft")
    folder = Path(folder)
    for name, (tensors, ranks, lora_bias) in written.items():
        r = Counter(ranks.values()).most_common(1)[0][0]
        # NOTE: PEFT matches pattern keys as regexes against the end of the module name
        from ._peft import pattern_key

        rank_pattern = {pattern_key(m, ranks): k for m, k in sorted(ranks.items()) if k != r}
        alpha_pattern = {key: float(k) for key, k in rank_pattern.items()}
        config = {
            "peft_type": "LORA", "task_type": None, "r": int(r), "lora_alpha": float(r),
            "target_modules": sorted(ranks), "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
            "use_rslora": False, "use_dora": False, "lora_bias": lora_bias, "bias": "none", "lora_dropout": 0.0,
            "fan_in_fan_out": False, "init_lora_weights": True, "base_model_name_or_path": base_model_name_or_path,
            "inference_mode": True,
        }
        out = folder if name == "default" else folder / name
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder

