"""Writing a module's LoRA adapters as a Hugging Face PEFT adapter folder:
:func:`save_peft_adapter` (the inverse of :func:`onnxparam.lora._peft.load_peft_adapter`).

PEFT's layout (``peft/tuners/lora/layer.py``; ``save_pretrained``): for a target module
``<m>``, ``base_model.model.<m>.lora_A.weight`` ``(r, in)`` and ``.lora_B.weight`` ``(out, r)``,
delta (PyTorch layout ``(out, in)``) ``= scale * B @ A``; ``scale = lora_alpha / r`` (per module
through ``alpha_pattern`` / ``rank_pattern``). This library's adapter has ``a`` ``(d_in, r)``
and ``b`` ``(r, d_out)`` in every layout, so ``A = a.T`` and ``B = b.T`` (an ``Embedding``'s are
``lora_embedding_A`` / ``_B``; a ``Conv``'s are reshaped to a conv of every input channel and
a 1x1 conv with the base's ``groups``: :func:`conv_factors`). A bias adapter
(PEFT's ``lora_bias``: ``a`` ``(1, 1)``, ``b`` ``(1, d_out)``) becomes ``lora_B.bias`` scaled
so that ``scale_of_the_weight * lora_B.bias`` is its delta.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..core.errors import LoraError, RecordError

__all__ = ["save_peft_adapter", "save_peft_adapters"]


def conv_factors(a: np.ndarray, b: np.ndarray, shape: tuple):
    """PEFT's factors of a convolution adapter (a transposed adapter ``a`` ``(in * prod(kernel),
    r)``, ``b`` ``(r, out)`` on a weight ``shape`` ``(out, in / groups, *kernel)``, ``groups``
    from :func:`~onnxparam.lora._adapters.conv_adapter_groups`): ``(lora_A, lora_B)``, ``lora_A``
    ``(r, in, *kernel)`` (a conv of every input channel), ``lora_B`` ``(out, r / groups, 1, ...)``
    (a 1x1 conv with the base's ``groups``: ``b``'s diagonal blocks). A string saying why instead
    when ``r`` is no multiple of ``groups`` or ``b`` is not zero outside its blocks
    (:func:`onnxparam.lora._conv_checks.grouped_b_problem`)."""
    from ._adapters import conv_adapter_groups
    from ._conv_checks import grouped_b_problem

    r, out = a.shape[1], int(shape[0])
    groups = conv_adapter_groups(tuple(shape), a.shape[0])
    kernel, ones = tuple(int(d) for d in shape[2:]), (1,) * (len(shape) - 2)
    A = np.ascontiguousarray(a.T.reshape((r, a.shape[0] // math.prod(kernel)) + kernel))
    if groups <= 1:
        return A, np.ascontiguousarray(b.T.reshape((out, r) + ones))
    problem = grouped_b_problem(b, shape, a.shape[0])
    if problem is not None:
        return problem
    per_in, per_out = r // groups, out // groups
    B = np.zeros((out, per_in), dtype=b.dtype)
    for g in range(groups):  # output channel o of group g reads rows g * per_in ... of b
        B[g * per_out:(g + 1) * per_out] = b[g * per_in:(g + 1) * per_in, g * per_out:(g + 1) * per_out].T
    return A, np.ascontiguousarray(B.reshape(B.shape + ones))


def _module_name(path: str, suffix: str, rules: Sequence) -> str:
    name = path[: -len(suffix)] if suffix and path.endswith(suffix) else path
    for pattern, repl in rules:
        name = re.sub(pattern, repl, name)
    return name


def _graph_facts(module) -> tuple:
    """What the graphs of ``module``'s imported parts (modules with ``ir_model`` and
    ``onnx_names``: an :class:`~onnxparam.OnnxModule`) say about their weights, as
    :func:`onnxparam.load_peft_adapter` reads them: ``(tables, modules)``, where ``tables`` is the
    set of param paths a ``Gather`` (``axis=0``) reads as its data input 0 (an embedding table:
    PEFT's ``Embedding`` layer), and ``modules`` maps the path of a weight torch's exporter renamed
    (``val_N``, ``onnx::MatMul_N``) to the PyTorch module names the graph gives it (its
    ``<m>.bias``, its node's ``/<m>/MatMul`` name or dynamo ``name_scopes``); ``biased``: the
    module names ``<m>`` whose ``<m>.bias`` the graph holds (a value of that name), the evidence
    :func:`onnxparam.load_peft_adapter` resolves ``<m>`` by; ``owners``: table path -> (its ONNX
    name, :func:`onnxparam.lora._tables.table_owners`' entry: the modules its ``Gather`` s name,
    whether it is tied to an output projection)."""
    from ..core.module import named_modules
    from ._graph import _attr_int
    from ._peft import _linear_aliases
    from ._tables import table_owners

    tables, modules, biased, owners = set(), {}, set(), {}
    for prefix, sub in named_modules(module):
        if not hasattr(type(sub), "ir_model") or not hasattr(type(sub), "onnx_names"):
            continue
        join = (lambda p, _pre=prefix: f"{_pre}.{p}" if _pre else p)
        by_name = {name: join(path) for path, name in sub.onnx_names.items()}
        model = sub.ir_model
        for node in model.graph.all_nodes():
            if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.inputs \
                    and node.inputs[0] is not None and node.inputs[0].name in by_name \
                    and _attr_int(node, "axis", 0) == 0:
                tables.add(by_name[node.inputs[0].name])
        for name, entry in table_owners(model).items():
            if name in by_name:
                owners[by_name[name]] = (name, entry)
        for alias, name in _linear_aliases(model).items():
            if name in by_name:
                modules.setdefault(by_name[name], set()).add(join(alias[: -len(".weight")]))
        values = [v for v in model.graph.initializers.values()] + list(model.graph.inputs)
        values += [out for node in model.graph.all_nodes() for out in node.outputs]
        biased |= {join(v.name[: -len(".bias")]) for v in values if v is not None and v.name
                   and v.name.endswith(".bias")}
    return tables, modules, biased, owners


def _one_module(path: str, shape: tuple, found: list, biased: set, rules: list, problems: list) -> Optional[str]:
    """The PyTorch module name of a weight the graph names as several modules ``found`` (torch's
    TorchScript exporter names the nodes of an ``nn.Sequential`` of blocks ``/b/b.0/qkv/MatMul``
    -> ``b.b.0.qkv`` while its bias is ``b.0.qkv.bias``): the one whose ``<m>.bias`` the graph
    holds (as :func:`onnxparam.load_peft_adapter` resolves it), else the one name ``key_map``
    makes of them all; ``None`` (a problem recorded) when neither settles it."""
    backed = [m for m in found if m in biased]
    if len(backed) == 1:
        return _module_name(backed[0], "", rules)
    mapped = sorted({_module_name(m, "", rules) for m in found})
    if len(mapped) == 1:
        return mapped[0]
    why = (f"its bias names {backed}" if backed else "no '<module>.bias' of theirs is in the graph")
    problems.append(f"{path!r} {list(shape)}: the graph names it as several modules {found} ({why}); give a "
                    f"key_map rule that maps them to one PyTorch module name (now they give {mapped})")
    return None


def save_peft_adapter(module, folder: "str | os.PathLike", *, key_map: Optional[Sequence] = None,
                      base_model_name_or_path: Optional[str] = None, adapter_name: Optional[str] = None) -> Path:
    """Write ``module``'s LoRA adapters as a PEFT adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
    PyTorch model with the same weights.

    Args:
        module: a module with adapters on 2-d weights named ``<m>.weight`` (and optionally
            ``lora_bias`` adapters on ``<m>.bias``). In an imported model, a weight that torch's
            exporter renamed (``val_N``, ``onnx::MatMul_N``) is written for the module its graph
            names, as :func:`onnxparam.load_peft_adapter` finds it (its ``<m>.bias``, its node's
            name or ``name_scopes``; of several names, the one whose ``<m>.bias`` the graph
            holds, else the one name ``key_map`` makes of them), and a weight a ``Gather`` reads as its data (input 0,
            ``axis=0``) is written as PEFT's ``Embedding`` (``lora_embedding_A`` ``(r, num)``,
            ``lora_embedding_B`` ``(dim, r)``), as this library's ``nn.Embedding`` is, under
            the module its ``Gather`` s belong to (dynamo's ``name_scopes``, TorchScript's
            ``/<m>/Gather`` node name): a table tied to an output projection may be named after
            the projection's ``nn.Linear`` (dynamo's ``lm_head.weight`` for GPT-2's ``wte``),
            where PEFT would drop embedding factors (:mod:`onnxparam.lora._tables`).
        folder: the folder to write (created if needed; the two files are replaced).
        key_map: ``[(regex, replacement), ...]`` applied (``re.sub``) to each module path
            ``<m>`` (the module the graph names, for a renamed weight) to give the PyTorch module
            name (default: unchanged). A renamed weight the graph names no module for is
            written under what these rules make of its param path, when they change it.
        base_model_name_or_path: recorded in the config (informational).
        adapter_name: write this named adapter of the module (``Module.add_adapter``) instead
            of the active one (``KeyError`` for an unknown name).

    Returns:
        the folder's ``Path``.

    Raises:
        LoraError: an imported embedding table tied to an output projection whose graph does
            not name the module owning it (and no ``key_map`` rule matches it), or whose ``Gather`` s
            name several modules: pass ``key_map`` (a rule matching the module name).
        RecordError: a module without adapters, an adapter on a param not named
            ``<m>.weight`` / ``<m>.bias`` (nor a renamed weight the graph or ``key_map`` names),
            two weights written for one module, a bias adapter without its weight's adapter, or
            a grouped convolution's adapter that is not PEFT's layout (:func:`conv_factors`).

    Warns:
        LoraWarning: a convolution adapter on a dilated or ``reflect`` / ``edge`` / ``wrap``
            padded conv: applied here as the merged weight delta, which PEFT's unmerged forward
            does not follow (:mod:`onnxparam.lora._peft_conv_warn`).
    """
    from safetensors.numpy import save_file

    from ..core.module import named_modules, named_params
    from ..nn import Embedding
    from ..trace.tracer import untraced

    if adapter_name is not None:
        module = module.set_adapter(adapter_name)
    rules = [tuple(r) for r in (key_map or ())]
    embeddings = {f"{prefix}.weight" if prefix else "weight" for prefix, sub in named_modules(module)
                  if isinstance(sub, Embedding)}
    tables, graph_modules, biased, owners = _graph_facts(module)
    embeddings |= tables
    weights, biases, kinds, problems, table_problems = {}, {}, {}, [], []
    with untraced():
        for path, param in named_params(module):
            adapter = param.adapter()
            if adapter is None:
                continue
            a = np.asarray(adapter.a.val().to_numpy(), dtype=np.float32)
            b = np.asarray(adapter.b.val().to_numpy(), dtype=np.float32)
            shape = tuple(param.lazy_shape())
            is_weight = len(shape) == 2 or (len(shape) >= 3 and adapter.transposed)
            if is_weight and path in owners:  # an imported embedding table: the module its Gathers name
                from ._tables import owner_name

                table, entry = owners[path]
                fallback = path[: -len(".weight")] if path.endswith(".weight") else path
                name, problem = owner_name(table, fallback, entry, rules)
                if problem is not None:
                    table_problems.append(problem)
                    continue
            elif is_weight and not path.endswith(".weight"):
                # a weight torch's exporter renamed: the module the graph names (as load_peft_adapter
                # resolves it), else what the user's key_map makes of the path
                found = sorted(graph_modules.get(path, ()))
                if len(found) > 1:
                    name = _one_module(path, shape, found, biased, rules, problems)
                    if name is None:
                        continue
                else:
                    name = _module_name(found[0], "", rules) if found else _module_name(path, "", rules)
                if not found and name == path:
                    problems.append(f"{path!r} {list(shape)}: PEFT adapters are written for a module's 'weight'; "
                                    "this param is not named '<module>.weight' and the graph does not say which "
                                    "module it belongs to; give a key_map rule (regex, module name) for it")
                    continue
            elif path.endswith(".weight") and is_weight:
                name = _module_name(path, ".weight", rules)
            elif path.endswith(".bias") and len(shape) == 1:
                biases[_module_name(path, ".bias", rules)] = (a @ b).reshape(-1) * float(adapter.scale)
                continue
            else:
                problems.append(f"{path!r} {list(shape)}: PEFT adapters are written for a module's 'weight' "
                                "(Linear, Embedding, Conv) or 'bias' (lora_bias); this param is neither")
                continue
            if name in weights:
                problems.append(f"{path!r} and {weights[name][3]!r} both are the weight of PEFT module {name!r}")
                continue
            weights[name] = (a, b, float(adapter.scale), path)
            kinds[name] = ("embedding" if path in embeddings else "conv" if len(shape) >= 3 else "linear", shape)
    if table_problems:
        raise LoraError(f"cannot save the adapters of {type(module).__name__} as a PEFT adapter: "
                        + "; ".join(table_problems))
    if not weights and not biases and not problems:
        from ._adapters import no_adapter_reason

        raise RecordError(f"no LoRA adapter to save: {no_adapter_reason(module)}")
    for name in biases:
        if name not in weights:
            problems.append(f"{name + '.bias'!r} has a bias adapter (lora_bias) but {name + '.weight'!r} has none")
    if problems:
        raise RecordError(f"cannot save the adapters of {type(module).__name__} as a PEFT adapter", problems)
    ranks = Counter(a.shape[1] for a, _, _, _ in weights.values())
    r = ranks.most_common(1)[0][0]
    alphas = Counter(scale * a.shape[1] for a, _, scale, _ in weights.values())
    alpha = alphas.most_common(1)[0][0]
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    for name, (a, b, scale, _) in weights.items():
        key = f"base_model.model.{name}"
        kind, shape = kinds[name]
        if kind == "embedding":  # PEFT's Embedding: lora_embedding_A (r, num), _B (dim, r)
            tensors[f"{key}.lora_embedding_A"] = np.ascontiguousarray(a.T)
            tensors[f"{key}.lora_embedding_B"] = np.ascontiguousarray(b.T)
        elif kind == "conv":  # PEFT's Conv: lora_A a conv (r, in, *kernel), lora_B 1x1 (out, r / groups, 1, ..)
            factors = conv_factors(a, b, shape)
            if isinstance(factors, str):
                problems.append(f"PEFT module {name!r} (a convolution {list(shape)}): {factors}")
                continue
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = factors
        else:
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a.T)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b.T)
        rank = a.shape[1]
        # NOTE: PEFT matches pattern keys as regexes against the end of the module name
        from ._peft import pattern_key

        anchored = pattern_key(name, weights)
        if rank != r:
            rank_pattern[anchored] = int(rank)
        if scale * rank != alpha:
            alpha_pattern[anchored] = float(scale * rank)
        if name in biases:
            tensors[f"{key}.lora_B.bias"] = np.ascontiguousarray((biases[name] / scale).astype(np.float32))
    if problems:
        raise RecordError(f"cannot save the adapters of {type(module).__name__} as a PEFT adapter", problems)
    from ._peft_conv_warn import module_conv_problems, warn_unmerged_convs

    convs = {weights[name][3]: shape for name, (kind, shape) in kinds.items() if kind == "conv"}
    warn_unmerged_convs(module_conv_problems(module, convs), "save_peft_adapter")
    config = {
        "peft_type": "LORA", "task_type": None, "r": int(r), "lora_alpha": float(alpha),
        "target_modules": sorted(weights), "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "use_rslora": False, "use_dora": False, "lora_bias": bool(biases), "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "init_lora_weights": True,
        "base_model_name_or_path": base_model_name_or_path, "inference_mode": True,
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def save_peft_adapters(module, folder: "str | os.PathLike", *, key_map: Optional[Sequence] = None,
                       base_model_name_or_path: Optional[str] = None) -> Path:
    """Write every named adapter ``module`` owns (``Module.add_adapter``) in PEFT's
    multi-adapter layout (``PeftModel.save_pretrained`` with several adapters): the adapter
    named ``"default"`` in ``folder`` itself, every other one in ``folder/<name>/``, each a
    :func:`save_peft_adapter` folder (``PeftModel.from_pretrained(model, folder / name,
    adapter_name=name)`` loads it). :func:`onnxparam.load_peft_adapters` reads it back.

    Returns:
        ``folder``'s ``Path``.

    Raises:
        RecordError: ``module`` owns no named adapter, or one that :func:`save_peft_adapter`
            refuses (a name that is not a plain folder name included).
    """
    names = module.lora_adapters.names
    if not names:
        raise RecordError(f"{type(module).__name__} owns no named adapters (Module.add_adapter); use "
                          "save_peft_adapter for its active adapters")
    bad = [name for name in names if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name)]
    if bad:
        raise RecordError(f"adapter names {bad} cannot be folder names; PEFT stores each adapter in a folder "
                          "named after it")
    folder = Path(folder)
    for name in names:
        save_peft_adapter(module, folder if name == "default" else folder / name, key_map=key_map,
                          base_model_name_or_path=base_model_name_or_path, adapter_name=name)
    return folder
