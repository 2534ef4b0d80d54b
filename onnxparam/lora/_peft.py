"""Loading Hugging Face PEFT LoRA adapters onto a module: :func:`load_peft_adapter`.

A PEFT LoRA checkpoint is a folder with ``adapter_config.json`` and
``adapter_model.safetensors`` (PEFT ``save_pretrained``; ``peft/utils/save_and_load.py``,
``peft/tuners/lora/layer.py``). For a target module ``<name>`` (a PyTorch ``Linear``) it holds::

    <name>.lora_A.weight   (r, in_features)     PyTorch Linear(in, r).weight
    <name>.lora_B.weight   (out_features, r)    PyTorch Linear(r, out).weight
    delta (PyTorch layout, (out, in)) = scale * B @ A
    scale = lora_alpha / r,   or lora_alpha / sqrt(r) with use_rslora (Kalajdzievski 2023)

and ``r`` / ``lora_alpha`` may be overridden per module by ``rank_pattern`` / ``alpha_pattern``
(regex keys matched, as PEFT does, against the end of the module's path in the wrapped model:
the key without ``base_model.model.``; a ``^`` key anchors at that path's start).

In this library's adapter (:class:`~onnxparam.LoraAdapter`), ``a`` is ``(d_in, r)`` and ``b`` is
``(r, d_out)`` whatever the base's layout, so ``a = A.T`` and ``b = B.T`` always: for a base
stored ``(d_in, d_out)`` (Burn's Linear, ONNX ``MatMul`` B) the delta is ``scale * a @ b``
``= (scale * B @ A).T``; for a base stored ``(d_out, d_in)`` (PyTorch's layout, ONNX ``Gemm``
``transB=1``; a *transposed* adapter) it is ``(scale * a @ b).T = scale * B @ A``. PEFT's
``fan_in_fan_out`` (GPT-2 ``Conv1D`` bases stored ``(in, out)``) describes the PyTorch base and
changes neither factor; the layout that matters is the target param's here, and it comes from the graph that
consumes it (``MatMul`` B, ``Transpose -> MatMul``, ``Gemm transB``, ``Conv``), else the module's
declared layout (``lora_transposed_paths``), else Burn's ``(in, out)``: never from the shape.

Embedding LoRA (``lora_embedding_A`` / ``_B``), convolution LoRA (``lora_A`` a conv,
``lora_B`` a 1x1 conv; the delta reshaped to the weight) and ``lora_bias`` (``lora_B.bias``,
added to the layer's bias times the scale, as PEFT merges it) are loaded.

The base tensors PEFT's ``save_pretrained`` stores next to the factors by default for a targeted
``embed_tokens`` / ``lm_head`` (``save_embedding_layers="auto"``: ``<m>.base_layer.weight``; with
``save_embedding_layers=True`` and no embedding targeted, the whole layers ``<m>.weight``), which
PEFT's loader copies into the base, are accepted when they equal the module's (nothing changes)
and refused, naming the key, the param and the difference, when they do not
(:func:`_check_stored_bases`).

Unsupported PEFT variants raise :class:`~onnxparam.RecordError` naming the option: DoRA
(``use_dora``), trained biases (``bias`` other than ``"none"``), ``modules_to_save`` weights
(whole modules trained in place), ``trainable_token_indices`` (trained token rows, refused
under that name), non-LoRA ``peft_type``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..core.dtype import DType
from ..core.errors import LoraError, RecordError, ShapeMismatchError
from ..core.module import named_params, rebuild
from ..core.param import Param, ParamId
from ..core.tensor import Tensor
from ._adapters import (_SET_ATTR, DEFAULT_ADAPTER_NAME, LoraAdapter, _owning, active_adapter, adapter_set,
                        frozen_base_param, has_adapters, transposed_paths)
from ._folded_norms import folded_norm_paths, folded_reason
from ._ir import dynamo_scope
from ._layouts import CONV, IN_OUT, OUT_IN
from ._tables import matmul_weights, table_owners

__all__ = ["load_peft_adapter", "load_peft_adapters", "PeftLoadReport", "PeftConfig", "read_peft_config", "DEFAULT_PEFT_KEY_MAP",
           "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

DEFAULT_PEFT_KEY_MAP = ((r"^base_model\.model\.", ""),)
"""Applied before the user's rules: PEFT prefixes every key with ``base_model.model.``."""

_PEFT_PREFIX = "base_model.model."


def peft_module_path(name: str) -> str:
    """The path in the wrapped model (``model.named_modules()`` of the model ``get_peft_model``
    wrapped) of a checkpoint's PEFT module name: ``name`` without PEFT's ``base_model.model.``
    prefix (``"base_model.model.model.layers.0.q_proj"`` -> ``"model.layers.0.q_proj"``); the
    name PEFT matches ``rank_pattern`` / ``alpha_pattern`` keys against."""
    return name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
"""``<module>.lora_A.weight`` (and the older ``<module>.lora_A.<adapter name>.weight``)."""
_EMBEDDING_KEY = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<which>A|B)(?:\.[^.]+)?$")
"""``<module>.lora_embedding_A`` ``(r, num_embeddings)`` / ``_B`` ``(dim, r)`` (embedding LoRA)."""
_BIAS_KEY = re.compile(r"^(?P<module>.+)\.lora_B(?:\.[^.]+)?\.(?P<which>bias)$")
"""``<module>.lora_B.bias`` ``(out,)`` (``lora_bias=True``)."""
_BASE_KEY = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<which>weight|bias)$")
"""``<module>.base_layer.weight`` / ``.bias``: the base layer of LoRA module ``<module>``, PyTorch's
layout (``nn.Embedding`` ``(num, dim)``, ``nn.Linear`` ``(out, in)``, a conv's ``(out, in / groups,
*kernel)``). PEFT's ``save_pretrained`` stores it with ``save_embedding_layers`` (its default
``"auto"`` turns that on when ``target_modules`` names ``embed_tokens`` or ``lm_head``:
``peft/utils/save_and_load.py``), and its loader copies it into the base (``load_state_dict``)."""
_FULL_KEY = re.compile(r"^(?P<module>.+)\.(?P<which>weight)$")
"""``<module>.weight`` with no ``lora_`` in it: a whole module's weight (``modules_to_save``, or
``save_embedding_layers`` for an embedding layer no LoRA adapts, after a vocabulary resize)."""


PEFT_DEFAULT_LORA_ALPHA = 8
"""``lora_alpha`` when ``adapter_config.json`` leaves it out: PEFT's ``LoraConfig`` default."""


def pattern_key(path: str, paths) -> str:
    r"""The ``rank_pattern`` / ``alpha_pattern`` key a writer gives module ``path`` so that it
    selects ``path`` alone among the modules ``paths``: ``re.escape(path)``, unless PEFT's rule
    (``(.*\.)?(key)$`` on the path in the wrapped model, :meth:`PeftConfig._pattern`) would also
    select another of ``paths`` (``fc1`` selects ``block.fc1``): then ``"^" + re.escape(path)``
    (PEFT's own anchored form; the plain key is kept otherwise, as PEFT versions before 0.14,
    whose rule was ``.*\.key$``, fall back to the exact name)."""
    key = re.escape(path)
    if any(other != path and re.match(rf"(.*\.)?({key})$", other) for other in paths):
        return "^" + key
    return key


class PeftConfig:
    """The fields of ``adapter_config.json`` this loader uses.

    Attributes:
        r: the default rank; ``lora_alpha``: the default alpha (PEFT's default, 8, when the
        file leaves it out); ``use_rslora``: scale
        ``alpha / sqrt(r)`` instead of ``alpha / r``; ``rank_pattern`` / ``alpha_pattern``:
        per-module overrides (regex key -> value); ``fan_in_fan_out``: the PyTorch base stores
        ``(in, out)`` (informational, see the module docstring); ``raw``: the whole JSON.
    """

    def __init__(self, raw: dict, source: str):
        self.raw = raw
        self.source = source
        problems = []
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            problems.append(f"peft_type {peft_type!r}: only LoRA adapters are supported")
        if raw.get("use_dora"):
            problems.append("use_dora=true (DoRA): the magnitude vector has no equivalent in a LoRA adapter")
        if raw.get("bias", "none") not in ("none", None):
            problems.append(f"bias={raw.get('bias')!r}: trained biases are not part of a LoRA adapter; "
                            "only bias='none' is supported")
        for key in ("use_qalora",):
            if raw.get(key):
                problems.append(f"{key}=true is not supported")
        if raw.get("trainable_token_indices"):
            problems.append(f"trainable_token_indices={raw.get('trainable_token_indices')!r:.80}: PEFT's trainable "
                            "tokens (embedding rows replaced by trained ones) are not a LoRA adapter and are not "
                            "supported; merge them with PEFT (merge_and_unload) and load the merged weights")
        if problems:
            raise RecordError(f"unsupported PEFT adapter in {source}", problems)
        try:
            self.r = _rank(raw["r"])
            # NOTE: PEFT's LoraConfig declares ``lora_alpha: int = 8`` (peft/tuners/lora/config.py),
            # so a config that leaves the key out was trained with alpha 8, not alpha = r.
            self.lora_alpha = _alpha(raw.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA))
        except (KeyError, TypeError, ValueError) as e:
            raise RecordError(f"{source}: adapter_config.json needs an integer 'r' >= 1 and a finite number "
                              f"'lora_alpha' ({type(e).__name__}: {e})") from None
        self.use_rslora = bool(raw.get("use_rslora", False))
        self.lora_bias = bool(raw.get("lora_bias", False))
        self.fan_in_fan_out = bool(raw.get("fan_in_fan_out", False))
        # NOTE (reliability fuzzing): patterns are checked here, so a bad key or value is a
        # RecordError naming it, not a re.error / ValueError while the weights are matched.
        self.rank_pattern = _patterns(raw, "rank_pattern", _rank, source)
        self.alpha_pattern = _patterns(raw, "alpha_pattern", _alpha, source)

    @staticmethod
    def _pattern(patterns: dict, name: str):
        # PEFT 0.21 (tuners/lora/model.py _create_and_replace -> utils/other.py get_pattern_key): the
        # first key k with re.match(rf"(.*\.)?({k})$", current_key), else the entry of current_key
        # itself; current_key is the module's name in the wrapped model (inject_adapter iterates
        # model.named_modules() of the model get_peft_model wraps), so a "^fc1" key anchors at the
        # start of "fc1", never of the checkpoint's "base_model.model.fc1" (fresh8 F6).
        name = peft_module_path(name)
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        return patterns.get(name)

    def scale_for(self, name: str, rank: int) -> float:
        """The adapter scale of PEFT module ``name`` whose factors have rank ``rank``.

        ``name`` is the checkpoint's module name (``base_model.model.<path>``) or the path in the
        wrapped model; ``alpha_pattern`` / ``rank_pattern`` keys are matched, as PEFT matches them,
        against the latter (:func:`peft_module_path`), so PEFT's anchored keys
        (``{"^model.decoder.layers.0.encoder_attn.k_proj": 16}``) apply."""
        alpha = self._pattern(self.alpha_pattern, name)
        alpha = self.lora_alpha if alpha is None else alpha
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def rank_for(self, name: str) -> int:
        """The rank PEFT module ``name`` was created with (``r`` / ``rank_pattern``, matched as in
        :meth:`scale_for`)."""
        rank = self._pattern(self.rank_pattern, name)
        return self.r if rank is None else rank

    def saves_module(self, name: str) -> bool:
        """Whether ``modules_to_save`` names PEFT module ``name`` (a key of the list ends it, as
        PEFT's ``_set_trainable`` matches): PEFT trains and saves that whole module."""
        listed = self.raw.get("modules_to_save") or ()
        listed = [listed] if isinstance(listed, str) else listed
        return any(isinstance(entry, str) and entry and name.endswith(entry) for entry in listed)


def _rank(value) -> int:
    """A LoRA rank: an integer >= 1 (``2.0`` is taken, ``2.7``, ``true`` and ``0`` are not)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value) or value < 1):
        raise ValueError(f"a rank is an integer >= 1, found {value!r}")
    return int(value)


def _alpha(value) -> float:
    """A LoRA alpha: a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"lora_alpha is a finite number, found {value!r}")
    return float(value)


def _patterns(raw: dict, key: str, check, source: str) -> dict:
    patterns = raw.get(key) or {}
    if not isinstance(patterns, dict):
        raise RecordError(f"{source}: {key} maps module-name regexes to values; found {patterns!r}")
    out = {}
    for regex, value in patterns.items():
        try:
            re.compile(regex)
            out[regex] = check(value)
        except (re.error, TypeError, ValueError) as e:
            raise RecordError(f"{source}: {key} entry {regex!r}: {value!r} is not usable ({e})") from None
    return out


def read_peft_config(path: "str | os.PathLike") -> PeftConfig:
    """Parse an ``adapter_config.json``.

    Raises:
        RecordError: for unreadable JSON or an unsupported variant (every option named).
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: JSON and UTF-8 decoding errors
        raise RecordError(f"cannot read the PEFT config {path}: {e}") from None
    except RecursionError:  # NOTE (reliability fuzzing): "[[[[..." deeper than Python's stack
        raise RecordError(f"cannot read the PEFT config {path}: JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise RecordError(f"{path}: a PEFT adapter_config.json holds a JSON object")
    return PeftConfig(raw, str(path))


def _missing(path, what: str):
    """``FileMissingError`` (also a ``FileNotFoundError``) naming a missing ``what`` at ``path``."""
    import errno

    from ..core.errors import file_error

    return file_error(errno.ENOENT, f"no such {what}: '{os.fspath(path)}'", os.fspath(path))


def _files(folder_or_files) -> tuple:
    if isinstance(folder_or_files, (str, os.PathLike)) and Path(folder_or_files).is_dir():
        folder = Path(folder_or_files)
        weights = folder / WEIGHTS_FILE
        if not weights.exists() and (folder / "adapter_model.bin").exists():
            raise RecordError(f"{folder} holds adapter_model.bin (a pickle); save the adapter with "
                              "safe_serialization=True to get adapter_model.safetensors")
        return folder / CONFIG_FILE, weights
    if isinstance(folder_or_files, (str, os.PathLike)) and not Path(folder_or_files).exists():
        raise _missing(folder_or_files, "PEFT adapter folder")
    files = [Path(p) for p in (folder_or_files if isinstance(folder_or_files, (list, tuple)) else [folder_or_files])]
    from ..formats._extensions import check_readable

    for p in files:
        check_readable(p, "the PEFT config / weights file")
    config = next((p for p in files if p.suffix == ".json"), None)
    weights = next((p for p in files if p.suffix == ".safetensors"), None)
    if config is None or weights is None:
        raise RecordError(f"expected a PEFT adapter folder or (adapter_config.json, adapter_model.safetensors); "
                          f"got {[str(p) for p in files]}")
    return config, weights


def _map_key(name: str, rules: Sequence) -> str:
    for pattern, repl in rules:
        name = re.sub(pattern, repl, name)
    return name


@dataclass
class PeftLoadReport:
    """What :func:`load_peft_adapter` did with each PEFT module of a checkpoint.

    Attributes:
        matched: PEFT module name -> the param path its adapter was attached to.
        unmatched: PEFT module names that map to no param (ignored with ``allow_partial``).
        problems: one line per problem that stopped the load (empty on success).
    """

    matched: dict = field(default_factory=dict)
    unmatched: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.matched)} PEFT module(s) matched, {len(self.unmatched)} unmatched"]
        lines += [f"  {name} -> {path}" for name, path in self.matched.items()]
        lines += [f"  {name}: no param" for name in self.unmatched]
        return "\n".join(lines)


class _Targets:
    """Resolves a mapped PEFT module name to a param path and says each param's layout.

    Names resolve, in order, as a module path (``fc1.weight``, or ``fc1`` + ``.weight``), as an
    ONNX weight name of an imported module (``onnx::MatMul_352`` as the file spells it), or,
    in an imported graph, as the ``<module>.weight`` whose ``MatMul`` / ``Gemm`` output gets
    ``<module>.bias`` added (how torch's TorchScript exporter leaves ``nn.Linear`` weights it
    renamed), or as the module path that torch's dynamo exporter records on the ``aten.linear``
    node reading an unnamed ``val_N`` weight (:func:`_dynamo_linear_scope`), or as the module
    an embedding table's ``Gather`` s belong to (:func:`onnxparam.lora._tables.table_owners`:
    GPT-2's ``wte`` when dynamo named the tied table ``lm_head.weight``; that path then resolves
    to the weight the graph names ``lm_head``'s, the projection). Layouts come from
    modules that declare them from their graph (``lora_weight_layouts``: an imported
    ``OnnxModule``), else from ``lora_transposed_paths``
    declarations, else Burn's ``(d_in, d_out)`` (this library's ``nn`` modules); never from
    shapes."""

    def __init__(self, module):
        from ..core.module import named_modules

        self.params = dict(named_params(module))
        self.modules = {path: sub for path, sub in named_modules(module) if not callable(
            getattr(sub, "lora_weight_layouts", None))}  # this library's modules (not imported graphs)
        self.layouts: dict = {p: OUT_IN for p in transposed_paths(module)}
        self.graph_prefixes: list = []
        self.names: dict = {}  # ONNX name (and bias-derived alias) -> path
        # table path -> the projection weight of the module its path names (or None): a table whose
        # Gathers name another module (dynamo's lm_head.weight for a tied wte) is not module
        # <m>'s weight; an exact ONNX name / path still resolves to the table
        self.renamed_tables: dict = {}
        self.tables: set = set()  # paths of the tables a Gather of an imported graph reads
        for prefix, sub in named_modules(module):
            method = getattr(sub, "lora_weight_layouts", None)
            if not callable(method):
                continue
            join = (lambda p, _pre=prefix: f"{_pre}.{p}" if _pre else p)
            self.graph_prefixes.append(f"{prefix}." if prefix else "")
            self.layouts.update({join(p): layout for p, layout in method().items()})
            onnx_names = sub.onnx_names  # a property: path -> ONNX name
            for path, name in onnx_names.items():
                self.names.setdefault(name, join(path))
            by_name = {name: join(path) for path, name in onnx_names.items()}
            aliases = _linear_aliases(sub.ir_model)
            for alias, name in aliases.items():
                if name in by_name:
                    self.names.setdefault(alias, by_name[name])
            for name, (owners, _) in table_owners(sub.ir_model).items():
                if name in by_name:
                    self.tables.add(by_name[name])
                if name in by_name and len(owners) == 1:  # an embedding table: the module its Gathers name
                    owner = join(next(iter(owners)))
                    self.names[f"{owner}.weight"] = by_name[name]
                    if by_name[name] != f"{owner}.weight":  # named after another module (a tied lm_head)
                        self.renamed_tables[by_name[name]] = by_name.get(aliases.get(name))  # that module's own
                        # weight (the projection's MatMul reads it), if the graph names one

    def resolve(self, mapped: str) -> Optional[str]:
        if mapped in self.params:
            return mapped
        if f"{mapped}.weight" in self.renamed_tables:  # module <m> (lm_head) is not the table named after it
            if self.renamed_tables[f"{mapped}.weight"] is not None:
                return self.renamed_tables[f"{mapped}.weight"]
        elif f"{mapped}.weight" in self.params:
            return f"{mapped}.weight"
        for candidate in (mapped, f"{mapped}.weight"):
            if candidate in self.names:
                return self.names[candidate]
        for candidate in (mapped, f"{mapped}.weight"):  # a tied table's path with no other weight of that name
            if candidate in self.params:
                return candidate
        return None

    def is_table(self, path: str) -> bool:
        """Whether ``path`` is an embedding table: one a ``Gather`` of an imported graph reads, or
        the weight of this library's ``nn.Embedding``."""
        from ..nn import Embedding

        owner = path[: -len(".weight")] if path.endswith(".weight") else None
        return path in self.tables or isinstance(self.modules.get(owner), Embedding)

    def bias_of(self, mapped: str, weight_path: str) -> Optional[str]:
        """The bias param of the module whose weight is ``weight_path`` (``fc.weight`` ->
        ``fc.bias``; ``<mapped>.bias`` as a path or an ONNX name)."""
        candidates = [f"{mapped}.bias"]
        if weight_path.endswith(".weight"):
            candidates.insert(0, weight_path[: -len(".weight")] + ".bias")
        for candidate in candidates:
            if candidate in self.params:
                return candidate
            if candidate in self.names and self.names[candidate] in self.params:
                return self.names[candidate]
        return None

    def layout(self, path: str) -> str:
        """``IN_OUT`` / ``OUT_IN``, or why the layout is not known."""
        if path in self.layouts:
            return self.layouts[path]
        if any(path.startswith(prefix) for prefix in self.graph_prefixes):
            return "the graph does not use it as a 2-d weight"
        # this library's modules: Linear / Embedding (d_in, d_out), Conv (out, in / groups, *kernel)
        return CONV if len(self.params[path].lazy_shape()) >= 3 else IN_OUT


def _linear_aliases(model) -> dict:
    """``{"<m>.weight": weight name}`` for each ``MatMul`` / ``Gemm`` whose B is a weight (an
    initializer or a ``Constant`` node's output, directly or through a 2-d ``Transpose``) and
    whose output gets a tensor named ``<m>.bias`` added (an ``Add``, or ``Gemm``'s C); the first
    claim of an alias wins (:func:`linear_alias_pairs` lists them all)."""
    aliases = {}
    for alias, name in linear_alias_pairs(model):
        aliases.setdefault(alias, name)
    return aliases


def linear_alias_pairs(model) -> list:
    """Every ``("<m>.weight", weight name)`` claim the graph makes, in node order: for each
    ``MatMul`` / ``Gemm`` whose B is a weight (an initializer or a ``Constant`` node's output,
    directly or through a 2-d ``Transpose``), the module ``<m>`` of a tensor named ``<m>.bias``
    added to its output (an ``Add``, or ``Gemm``'s C), of its node name (torch's TorchScript
    exporter names nodes ``/<module path>/MatMul``) and of dynamo's ``name_scopes`` metadata
    (:func:`_dynamo_linear_scope`). One weight may be claimed by several aliases, one alias by
    several weights: callers that need one answer must check."""
    from ..trace.evidence import stored_tensor

    pairs = []
    for node, weight in matmul_weights(model):
        if stored_tensor(weight) is None:  # neither an initializer nor a Constant node's tensor
            continue
        biases = [node.inputs[2]] if node.op_type == "Gemm" and len(node.inputs) > 2 else []
        for user, _ in node.outputs[0].uses():
            if user.op_type == "Add":
                biases += [v for v in user.inputs if v is not None and v is not node.outputs[0]]
        for bias in biases:  # NOTE: torch dedupes equal initializers: the bias may be an Identity's output
            if bias is not None and bias.name and bias.name.endswith(".bias"):
                pairs.append((bias.name[: -len(".bias")] + ".weight", weight.name))
        scope = node.name or ""
        if scope.startswith("/") and scope.count("/") >= 2:  # torch's node names: /<module path>/MatMul
            pairs.append((scope[1:].rsplit("/", 1)[0].replace("/", ".") + ".weight", weight.name))
        module_path = _dynamo_linear_scope(node)
        if module_path:
            pairs.append((module_path + ".weight", weight.name))
    return pairs


def _dynamo_linear_scope(node) -> Optional[str]:
    """The module path of an ``aten.linear`` node written by torch's dynamo exporter, from the
    node's ``pkg.torch.onnx.name_scopes`` metadata (``['', 'fc1', 'linear']`` -> ``"fc1"``);
    ``None`` for any other node. (The exporter folds ``nn.Linear``'s weight transpose into an
    unnamed ``val_N`` initializer: this names it whether or not the layer has a bias.)"""
    props = node.metadata_props
    if "aten.linear" not in props.get("pkg.torch.onnx.fx_node", ""):
        return None
    return dynamo_scope(node)


def _factor_array(snap) -> np.ndarray:
    return np.asarray(snap.to_data().to_numpy())


def load_peft_adapter(module, folder_or_files, key_map: Optional[Sequence] = None, *,
                      allow_partial: bool = False, return_report: bool = False):
    """A copy of ``module`` with the LoRA adapters of a PEFT checkpoint attached.

    Args:
        module: any :class:`~onnxparam.Module` (an imported :class:`~onnxparam.OnnxModule` too).
        folder_or_files: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``,
            or those two paths.
        key_map: ``[(regex, replacement), ...]`` applied in order (``re.sub``) to each PEFT
            module name, after :data:`DEFAULT_PEFT_KEY_MAP` strips ``base_model.model.``. The
            result names the adapted param as a module path (``"fc1.weight"``, or ``"fc1"``,
            ``.weight`` appended), or, on an imported model, as the ONNX weight name users see
            (``"onnx::MatMul_352"``, ``"bert.encoder.layer.0.attention.self.query.weight"``).
            Without a rule, an imported ``nn.Linear`` weight that torch's exporter renamed is
            found through its ``<module>.bias`` (see :class:`_Targets`).
        allow_partial: ignore PEFT modules that map to no param (they are listed in the
            report); zero matched modules is an error all the same.
        return_report: return ``(module, PeftLoadReport)`` instead of the module.

    Returns:
        the new module: each target param (frozen) carries a :class:`~onnxparam.LoraAdapter`
        with ``a = lora_A.T`` ``(d_in, r)``, ``b = lora_B.T`` ``(r, d_out)`` at the param's
        float dtype, the PEFT scale (``alpha / r``, rsLoRA ``alpha / sqrt(r)``) and the layout
        its graph (or module) declares. Embedding LoRA (``lora_embedding_A`` ``(r, num)``,
        ``lora_embedding_B`` ``(dim, r)``) attaches the same way to the ``(num, dim)`` table;
        convolution LoRA to a ``Conv`` weight (:func:`_conv_entry`).
        With ``lora_bias`` the bias param gets a rank-1 adapter whose delta is
        ``scale * lora_B.bias`` (PEFT's merge); a bias-free ``nn.Linear(bias=False)`` gets an
        adapter-owned bias (a frozen zero ``bias`` param carrying that adapter: PEFT's unmerged
        forward; merging it makes a new bias, where PEFT refuses to merge).

        The result carries exactly the folder's adapter, as PEFT's ``load_adapter`` makes one
        adapter of exactly the folder (the base model plus the folder's factors), whatever
        adapters ``module`` carries (``module`` itself is not changed and keeps them):

        * ``module`` with an active named adapter (``add_adapter`` + ``set_adapter``): that
          adapter's factors are on none of the result's params (targets get new factors with
          new ids: never a named adapter's); the result still owns every named adapter (the
          active one with its current values), none active, so
          ``module.add_adapter("a3", load_peft_adapter(module, "a3/"))`` adds exactly the
          folder's ``a3`` and ``result.set_adapter("a1")`` switches back.
        * ``module`` with unnamed adapters (``apply_lora``, an earlier ``load_peft_adapter``):
          on a target the folder's factors replace the adapter's values and keep its factors'
          ids (a refill: an optimizer state or record keyed by those ids goes on); adapters on
          params the folder does not target are not in the result, with a
          :class:`~onnxparam.LoraWarning` naming them (``module.add_adapter(name, result)``
          keeps both: the module's as ``"default"``).
        Trainability is PEFT's (``PeftModel.from_pretrained(..., is_trainable=True)``,
        ``bias="none"``): on a module without adapters every float param except the new
        factors is frozen (as :func:`~onnxparam.lora.apply_lora` freezes); on one that has
        adapters only the targets are, the other flags kept. For full fine-tuning,
        ``unfreeze_group(ParamGroup.all())`` on the result.

        A base tensor PEFT stored with ``save_embedding_layers`` (its default for a targeted
        ``embed_tokens`` / ``lm_head``: ``<m>.base_layer.weight`` / ``.bias``, PyTorch's layout;
        or a whole ``<m>.weight`` of an embedding layer no LoRA adapts) must equal the base value
        of the param its module resolves to, bit for bit after a cast to that param's dtype: then
        PEFT's load (which copies it into the base) changes nothing, and it is not applied.

    Raises:
        RecordError: for an unsupported variant (the option named: DoRA, trained biases,
            ``modules_to_save`` ...), a base tensor stored with ``save_embedding_layers`` that
            differs from the module's (key, param, shapes or largest difference named, with the
            ways out: load it into the base first, or ``save_pretrained(...,
            save_embedding_layers=False)`` when the base is unchanged),
            keys that are not LoRA factors, unmatched modules (without ``allow_partial``), no
            matched module at all, or a target whose layout the graph does not decide; every
            problem listed together; ``error.report`` is the :class:`PeftLoadReport`.
        LoraError: a target holds a BatchNorm the exporter folded into it
            (``OnnxModule.onnx_folded_norms``: dynamo's ``FuseBatchNormIntoConv`` / ``...Gemm`` /
            ``...ConvTranspose``): PEFT's delta was trained before that BatchNorm, whose
            per-channel scale the file does not hold (the param, node and evidence named).
        ShapeMismatchError: (a ``RecordError``) when the only problems are factors that do
            not fit their target (the param and both shapes named).
        FileMissingError: the folder (or a file given) does not exist (also a
            ``FileNotFoundError``). IsAFolderError: a folder given as one of the two files.
    """
    removed: list = []
    result, report = _load_peft_adapter(module, folder_or_files, key_map, allow_partial, removed)
    if removed:
        import warnings

        from ..core.errors import LoraWarning

        shown = ", ".join(repr(p) for p in removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        where = os.fspath(folder_or_files) if isinstance(folder_or_files, (str, os.PathLike)) else folder_or_files
        warnings.warn(f"load_peft_adapter: the result carries the adapter of {where} only; the unnamed adapters "
                      f"{type(module).__name__} carries on {len(removed)} param(s) the folder does not target "
                      f"({shown}) are not in it (the module passed in keeps them). To keep both, name them: "
                      "module.add_adapter(name, load_peft_adapter(module, folder)) keeps the module's as "
                      f"'{DEFAULT_ADAPTER_NAME}' (set_adapter chooses)", LoraWarning, stacklevel=2)
    return (result, report) if return_report else result


def _load_peft_adapter(module, folder_or_files, key_map: Optional[Sequence], allow_partial: bool, removed: list):
    """:func:`load_peft_adapter`'s work: ``(module, report)``; the paths of unnamed adapters left
    out of the result (not targeted by the folder) are appended to ``removed``."""
    from ..formats._safetensors import read_safetensors

    config_path, weights_path = _files(folder_or_files)
    config = read_peft_config(config_path)
    rules = list(DEFAULT_PEFT_KEY_MAP) + [tuple(r) for r in (key_map or ())]
    if not weights_path.is_file():  # NOTE: else read_safetensors' FileNotFoundError escapes
        raise RecordError(f"the PEFT adapter weights {weights_path} are missing; a PEFT adapter folder holds "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    tensors = read_safetensors(weights_path).tensors
    pairs: dict = {}
    report = PeftLoadReport()
    problems = report.problems
    stored: dict = {}  # PEFT module name -> {"weight" / "bias": (key, snap)}: whole base tensors (checked below)
    loose_biases: dict = {}  # PEFT module name -> (key, snap): a "<m>.bias" outside any LoRA factor
    kinds: dict = {}  # PEFT module name -> "embedding" for embedding LoRA factors
    for key, snap in tensors.items():
        match = _KEY.match(key) or _EMBEDDING_KEY.match(key) or _BIAS_KEY.match(key)
        if match is not None:
            pairs.setdefault(match["module"], {})[match["which"]] = snap
            if ".lora_embedding_" in key:
                kinds[match["module"]] = "embedding"
            continue
        base = _BASE_KEY.match(key)
        full = _FULL_KEY.match(key) if ".lora_" not in key else None
        module_name = base["module"] if base else full["module"] if full else key.rsplit(".", 1)[0]
        if ".trainable_tokens_" in key or ".token_adapter." in key:
            problems.append(f"{key!r}: trained token rows (trainable_token_indices) are not supported")
        elif ".modules_to_save." in key or (".lora_" not in key and config.saves_module(module_name)):
            problems.append(f"{key!r}: a whole module trained in place (modules_to_save="
                            f"{config.raw.get('modules_to_save')!r:.80}) is not supported: it is not a LoRA "
                            "adapter; merge it with PEFT (merge_and_unload) and load the merged weights")
        elif base is not None:
            stored.setdefault(base["module"], {})[base["which"]] = (key, snap)
        elif ".lora_" not in key and key.endswith(".bias"):
            loose_biases[key[: -len(".bias")]] = (key, snap)
        elif full is not None:
            stored.setdefault(full["module"], {})["weight"] = (key, snap)
        else:
            problems.append(f"{key!r}: not a LoRA factor (lora_A / lora_B, lora_embedding_A / _B, lora_B.bias) "
                            "nor a base weight PEFT stores next to them; it is not supported")
    for name, (key, snap) in loose_biases.items():
        if name in pairs:  # PEFT's bias="lora_only" / "all" writes "<m>.bias" of its LoRA modules
            problems.append(f"{key!r}: a bias (bias training) is not supported")
        else:  # a whole layer's bias, as save_embedding_layers writes it for a layer no LoRA adapts
            stored.setdefault(name, {})["bias"] = (key, snap)
    targets = _Targets(module)
    folded = folded_norm_paths(module)  # BatchNorms the exporter folded into a weight (refused below)
    refused: list = []
    plan: dict = {}
    new_biases: dict = {}  # module path -> (d_out, weight path): adapter-owned biases (lora_bias, no bias)
    for name, factors in pairs.items():
        if not {"A", "B"} <= set(factors):
            have = sorted(factors)
            problems.append(f"PEFT module {name!r} has lora_{have[0]} but not its pair")
            continue
        mapped = _map_key(name, rules)
        target = targets.resolve(mapped)
        if target is None:
            report.unmatched.append(name)
            if not allow_partial:
                problems.append(f"PEFT module {name!r} maps to {mapped!r}, which is not a param (nor is "
                                f"{mapped + '.weight'!r}, nor an ONNX weight of that name); add a key_map rule "
                                "(regex, replacement)")
            continue
        if target in folded:
            refused.append(f"PEFT module {name!r} -> {folded_reason(target, *folded[target])}")
            continue
        A, B = factors["A"], factors["B"]
        if len(A.shape) != 2 or len(B.shape) != 2:
            entry = _conv_entry(name, target, A, B, targets, config, problems)
            if entry is not None:
                plan[target] = entry
                report.matched[name] = target
                if "bias" in factors:  # a conv's lora_B (a 1x1 conv) has the bias
                    _plan_bias(name, mapped, target, factors["bias"], B.shape[0], entry[3], targets, plan, problems,
                               new_biases)
            continue
        rank, d_in = A.shape
        d_out, rank_b = B.shape
        if rank_b != rank:
            problems.append(f"PEFT module {name!r}: lora_A is {list(A.shape)} but lora_B is {list(B.shape)}")
            continue
        expected_rank = config.rank_for(name)
        if expected_rank != rank:
            problems.append(f"PEFT module {name!r}: the config's rank is {expected_rank} (r / rank_pattern), "
                            f"the factors have rank {rank}")
            continue
        param = targets.params[target]
        shape = tuple(param.lazy_shape())
        layout = targets.layout(target)
        if layout not in (IN_OUT, OUT_IN):
            problems.append(f"PEFT module {name!r} -> {target!r}: the layout of {target!r} {list(shape)} is not "
                            f"known: {layout}; an adapter cannot be attached without knowing its input axis")
            continue
        transposed = layout == OUT_IN
        want = (d_out, d_in) if transposed else (d_in, d_out)
        if shape != want:
            problems.append(
                f"PEFT module {name!r} -> {target!r}: the factors make a ({d_out}, {d_in}) PyTorch weight "
                f"(in {d_in} -> out {d_out}), the param is {list(shape)}, stored "
                f"{'(d_out, d_in)' if transposed else '(d_in, d_out)'} as its graph / module says, so it needs "
                f"{list(want)}; check the key_map points at the right weight")
            continue
        if target in plan:
            problems.append(f"PEFT modules {plan[target][0]!r} and {name!r} both map to {target!r}")
            continue
        scale = config.scale_for(name, rank)
        plan[target] = (name, _factor_array(A).T, _factor_array(B).T, scale, transposed)
        report.matched[name] = target
        if "bias" in factors:
            _plan_bias(name, mapped, target, factors["bias"], d_out, scale, targets, plan, problems, new_biases)
    _check_stored_bases(stored, pairs, kinds, report, targets, rules, allow_partial, problems)
    if not report.matched and not problems:
        problems.append(f"no PEFT module of the checkpoint matched a param of {type(module).__name__} "
                        f"({len(report.unmatched)} unmatched: {report.unmatched[:5]}); add key_map rules")
    if refused:
        raise LoraError(f"cannot load the PEFT adapter {weights_path} onto {type(module).__name__}: PEFT trained "
                        "these adapters on torch's weights, which the file no longer holds:\n  - "
                        + "\n  - ".join(refused + problems))
    if problems:
        kind = ShapeMismatchError if all("the param is" in p for p in problems) else RecordError
        error = kind(f"cannot load the PEFT adapter {weights_path} onto {type(module).__name__}", problems)
        error.report = report
        raise error

    first = not has_adapters(module)  # NOTE: PEFT freezes the base on its first injection only
    # NOTE (fresh8 F10): the result carries the folder's adapter and nothing else, as PEFT's
    # load_adapter makes one adapter of exactly the folder: the module's adapters on params the
    # folder does not target are removed from the result (a named active one stays in the set,
    # inactive; unnamed ones are named in a LoraWarning); the factors on targets replace theirs,
    # with fresh ids when they are a named adapter's (sharing ids would alias two adapters in
    # optimizers and records), with their ids when they are unnamed (a refill: apply_lora, then
    # the trained values).
    named_active = active_adapter(module) is not None

    def attach(path: str, param: Param) -> Param:
        entry = plan.get(path)
        if entry is None:
            if param.adapter() is not None:
                if not named_active:
                    removed.append(path)
                param = param.with_adapter(None)
            return frozen_base_param(path, param) if first else param
        name, a, b, scale, transposed = entry
        dtype = param.lazy_dtype()
        # NOTE: factors follow the base's float dtype (F32 for a quantized base), as apply_lora's
        np_dtype = np.float32 if dtype is DType.QFloat or not dtype.is_float else dtype.to_numpy()
        device = param.lazy_device()
        old = None if named_active else param.adapter()
        a_id = old.a.id if old is not None else ParamId()
        b_id = old.b.id if old is not None else ParamId()
        # NOTE: PEFT's A is (r, in), B is (out, r); ours are their transposes (module docstring)
        pa = Param.initialized(a_id, Tensor.from_numpy(np.ascontiguousarray(a.astype(np_dtype)), device), True)
        pb = Param.initialized(b_id, Tensor.from_numpy(np.ascontiguousarray(b.astype(np_dtype)), device), True)
        return param.set_require_grad(False).with_adapter(LoraAdapter(pa, pb, float(scale), transposed=transposed))

    def add_bias(path: str, copy) -> None:
        found = new_biases.get(path)
        if found is None:
            return
        d_out, weight_path = found
        weight = targets.params[weight_path]
        dtype = weight.lazy_dtype()
        np_dtype = np.float32 if dtype is DType.QFloat or not dtype.is_float else dtype.to_numpy()
        zero = Param.initialized(ParamId(), Tensor.from_numpy(np.zeros(d_out, np_dtype), weight.lazy_device()), False)
        copy.bias = attach(f"{path}.bias" if path else "bias", zero)

    result = rebuild(module, attach, add_bias if new_biases else None)
    if getattr(module, _SET_ATTR, None) is not None:  # named adapters stay owned, none active
        result = _owning(result, adapter_set(module), None)
    return result, report


def _check_stored_bases(stored: dict, pairs: dict, kinds: dict, report: PeftLoadReport, targets, rules: Sequence,
                        allow_partial: bool, problems: list) -> None:
    """Checks the whole base tensors a PEFT file holds next to its factors against the module's.

    PEFT's ``save_pretrained(save_embedding_layers="auto")`` (its default) stores the base layer of
    a targeted ``embed_tokens`` / ``lm_head`` (``<m>.base_layer.weight``, ``.base_layer.bias``),
    and, for an embedding layer no LoRA adapts whose vocabulary was resized, that layer's
    ``<m>.weight`` / ``<m>.bias``; PEFT's loader copies each into the base model
    (``set_peft_model_state_dict`` -> ``load_state_dict``). Here none is applied nor ignored: each
    must equal, bit for bit after a cast to the param's dtype, the base value (without any
    adapter) of the param its module resolves to (the bias: that module's bias), so that
    PEFT's load would change nothing; any other is a problem naming the key, the param, the
    shapes or the largest difference, and the ways out. PyTorch's layout is turned to the
    param's: an ``nn.Embedding`` table ``(num, dim)`` (a module with embedding LoRA factors; without
    factors, a ``Gather``-read table or this library's ``nn.Embedding``) is the ``(d_in, d_out)``
    layout, an ``nn.Linear`` weight ``(out, in)`` the ``(d_out, d_in)`` one, a conv kernel is
    the param's own. A module whose factors did not match (listed already, or unmatched with
    ``allow_partial``) is skipped with them."""
    way_out = ("PEFT's loader would replace the base weight with it (a resized or retrained vocabulary?): load "
               "that weight into the base model first, or, if this base is the one the adapter was trained on, "
               "save the adapter with save_pretrained(..., save_embedding_layers=False)")
    for name, found in stored.items():
        if name in pairs:
            if name not in report.matched:
                continue  # its factors' problem is listed (or it is unmatched, with allow_partial)
            target = report.matched[name]
        else:
            mapped = _map_key(name, rules)
            target = targets.resolve(mapped)
            if target is None:
                if allow_partial:
                    report.unmatched.append(name)
                else:
                    problems.append(f"{found[next(iter(found))][0]!r}: a whole base tensor of PEFT module {name!r} "
                                    f"(save_embedding_layers), which maps to {mapped!r}, not a param nor an ONNX "
                                    "weight; add a key_map rule (regex, replacement)")
                continue
        kind = kinds.get(name) or ("embedding" if name not in pairs and targets.is_table(target) else "linear")
        for which, (key, snap) in sorted(found.items(), reverse=True):  # weight, then bias
            path = target if which == "weight" else targets.bias_of(_map_key(name, rules), target)
            if path is None:
                problems.append(f"{key!r}: PEFT stored the bias of module {name!r} (save_embedding_layers), but "
                                f"{target!r} has no bias param to compare it with; {way_out}")
                continue
            param = targets.params[path]
            current = np.asarray(param.base().to_numpy())  # NOTE: a quantized base reads dequantized
            value = _factor_array(snap)
            layout = targets.layout(path) if which == "weight" else None
            note = ""
            if value.ndim == 2 and layout in (IN_OUT, OUT_IN) and (kind == "embedding") != (layout == IN_OUT):
                value = value.T  # PyTorch's layout -> the param's
                note = f" (PyTorch's {'(num, dim)' if kind == 'embedding' else '(out, in)'}, transposed to the param's)"
            if value.shape != current.shape:
                problems.append(f"{key!r}: PEFT stored the base {which} of module {name!r} (save_embedding_layers) "
                                f"as {list(_factor_array(snap).shape)}{note}, but {path!r} is {list(current.shape)}; "
                                f"{way_out}")
                continue
            cast = value.astype(current.dtype, copy=False)
            if np.array_equal(cast, current, equal_nan=current.dtype.kind in "fc"):
                continue
            diff = np.abs(cast.astype(np.float64) - current.astype(np.float64))
            problems.append(f"{key!r}: PEFT stored the base {which} of module {name!r} (save_embedding_layers), "
                            f"{list(current.shape)}{note}, and it differs from {path!r}: max |difference| "
                            f"{float(np.nanmax(diff)) if np.isfinite(diff).any() else float('nan'):.3g} "
                            f"({int(np.count_nonzero(cast != current))} of {cast.size} values); {way_out}")


def _plan_bias(name: str, mapped: str, target: str, snap, d_out: int, scale: float, targets, plan: dict,
               problems: list, new_biases: Optional[dict] = None) -> None:
    """Plans PEFT's ``lora_B.bias`` (``lora_bias=True``; ``(out,)``) as a rank-1 adapter on the
    layer's bias param: ``a = [[1]]``, ``b = lora_B.bias`` ``(1, out)``, the weight's scale (PEFT
    adds ``scale * lora_B.bias`` to the output; it merges it into the bias the same way).

    A layer without a bias (PEFT 0.21 runs it unmerged: the bias lives in ``lora_B``) whose
    module has an empty ``bias`` slot (this library's ``nn.Linear(bias=False)``) gets an
    adapter-owned bias: a frozen zero ``bias`` param carrying that adapter, listed in
    ``new_biases`` (module path -> ``(d_out, weight path)``); merging it gives the layer a bias
    ``scale * lora_B.bias``, where PEFT refuses to merge."""
    bias_path = targets.bias_of(mapped, target)
    bias = _factor_array(snap).reshape(-1)
    if bias.shape[0] != d_out:
        problems.append(f"PEFT module {name!r} has lora_B.bias of size {bias.shape[0]}, but its layer {target!r} "
                        f"has {d_out} outputs")
        return
    owner = target[: -len(".weight")] if target.endswith(".weight") else None
    if (bias_path is None and new_biases is not None and owner is not None and owner in targets.modules
            and hasattr(targets.modules[owner], "bias") and targets.modules[owner].bias is None):
        new_biases[owner] = (d_out, target)
        plan[f"{owner}.bias"] = (name, np.ones((1, 1), np.float32), bias.reshape(1, -1), scale, False)
        return
    if bias_path is None or tuple(targets.params[bias_path].lazy_shape()) != (d_out,):
        problems.append(f"PEFT module {name!r} has lora_B.bias ({bias.shape[0]}) (lora_bias=true) but "
                        f"{target!r} has no bias param of size {d_out} to attach it to")
        return
    plan[bias_path] = (name, np.ones((1, 1), np.float32), bias.reshape(1, -1), scale, False)


def _conv_entry(name: str, target: str, A, B, targets, config, problems: list):
    """The plan entry of a convolution LoRA (PEFT ``Conv1d/2d/3d``, ``peft/tuners/lora/layer.py``
    ``_ConvNd``): ``lora_A`` is a conv of every input channel ``(r, in, *kernel)`` with the base's
    stride and padding, ``lora_B`` a 1x1 conv ``(out, r / groups, 1, ...)`` with the base's
    ``groups``. A transposed adapter ``a = A.flatten(1).T`` ``(in * prod(kernel), r)``, ``b``
    ``(r, out)``: ``B.flatten(1).T`` for ``groups == 1`` (the delta ``scale * B.flatten(1) @
    A.flatten(1)`` reshaped to the weight ``(out, in, *kernel)``); for a grouped base (weight
    ``(out, in / groups, *kernel)``, ``groups = r / B.shape[1]``) ``b`` is ``B``
    block-diagonal: output channel ``o`` of group ``g = o // (out / groups)`` reads rows
    ``g * r / groups ...`` (zeros elsewhere), a branch only
    (:func:`~onnxparam.lora._adapters.conv_adapter_groups`)."""
    param = targets.params[target]
    shape = tuple(param.lazy_shape())
    layout = targets.layout(target)
    rank = A.shape[0]
    groups = rank // B.shape[1] if len(B.shape) >= 2 and B.shape[1] and rank % B.shape[1] == 0 else 0
    if layout != CONV or len(A.shape) < 3 or len(B.shape) != len(A.shape) or not groups \
            or any(k != 1 for k in B.shape[2:]):
        problems.append(f"PEFT module {name!r} -> {target!r}: factors of shapes {list(A.shape)} / {list(B.shape)} "
                        f"do not make a convolution LoRA for {target!r} {list(shape)} ({layout})")
        return None
    want = (B.shape[0], A.shape[1] // groups) + tuple(A.shape[2:])
    if shape != want or B.shape[0] % groups or A.shape[1] % groups:
        problems.append(f"PEFT module {name!r} -> {target!r}: the factors make a {list(want)} convolution weight"
                        f"{f' (groups={groups})' if groups > 1 else ''}, the param is {list(shape)}")
        return None
    if config.rank_for(name) != rank:
        problems.append(f"PEFT module {name!r}: the config's rank is {config.rank_for(name)} (r / rank_pattern), "
                        f"the factors have rank {rank}")
        return None
    a = _factor_array(A).reshape(rank, -1).T
    flat = _factor_array(B).reshape(B.shape[0], rank // groups)
    if groups > 1:
        per_in, per_out = rank // groups, B.shape[0] // groups
        b = np.zeros((rank, B.shape[0]), dtype=flat.dtype)
        for g in range(groups):
            b[g * per_in:(g + 1) * per_in, g * per_out:(g + 1) * per_out] = flat[g * per_out:(g + 1) * per_out].T
        return name, a, b, config.scale_for(name, rank), True
    b = flat.T
    return name, a, b, config.scale_for(name, rank), True



def load_peft_adapters(module, folder: "str | os.PathLike", key_map: Optional[Sequence] = None):
    """A copy of ``module`` owning every adapter of a PEFT multi-adapter folder as a named
    adapter (``Module.add_adapter``), none active: ``folder`` itself holds ``"default"`` (when
    it has ``adapter_config.json``), each sub-folder with one holds the adapter of its name
    (PEFT's ``save_pretrained`` layout; :func:`onnxparam.save_peft_adapters`).

    Each adapter is exactly its folder's (:func:`load_peft_adapter`), whatever ``module``
    carries; ``module``'s unnamed adapters (``apply_lora``) stay, named ``"default"`` and
    active (:func:`~onnxparam.lora.add_adapter`), so no ``LoraWarning`` is given about them.

    Raises:
        RecordError: ``folder`` holds no adapter, or one does not load
            (:func:`load_peft_adapter`, every module required).
        FileMissingError: ``folder`` does not exist (also a ``FileNotFoundError``).
        ValueError: a name is taken already (``module`` owns it, or carries unnamed adapters
            and a folder is named ``"default"``).
    """
    folder = Path(folder)
    if not folder.exists():
        raise _missing(folder, "PEFT adapter folder")
    found = []
    if folder.is_dir():
        if (folder / CONFIG_FILE).is_file():
            found.append(("default", folder))
        found += sorted((sub.name, sub) for sub in folder.iterdir() if (sub / CONFIG_FILE).is_file())
    if not found:
        raise RecordError(f"{folder} holds no PEFT adapter ({CONFIG_FILE} in it or in a sub-folder)")
    result = module
    for name, path in found:  # NOTE: add_adapter keeps module's unnamed adapters: no LoraWarning about them
        result = result.add_adapter(name, _load_peft_adapter(module, path, key_map, False, [])[0])
    return result
