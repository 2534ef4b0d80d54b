"""Loading Hugging Face PEFT LoRA adapters onto a module: :func:`load_peft_adapter`.

A PEFT LoRA checkpoint is a folder with ``adapter_config.json`` and
``adapter_model.safetensors`` (PEFT ``save_pretrained``; ``peft/utils/save_and_load.py``,
``peft/tuners/lora/layer.py``). For a target module ``<name>`` (a PyTorch ``Linear``) it holds::

    <name>.lora_A.weight   (r, in_features)     PyTorch Linear(in, r).weight
    <name>.lora_B.weight   (out_features, r)    PyTorch Linear(r, out).weight
    delta (PyTorch layout, (out, in)) = scale * B @ A
    scale = lora_alpha / r,   or lora_alpha / sqrt(r) with use_rslora (Kalajdzievski 2023)

and ``r`` / ``lora_alpha`` may be overridden per module by ``rank_pattern`` / ``alpha_pattern``
(regex keys matched against the end of the module name, as PEFT does).

In this library's adapter (:class:`~onnxparam.LoraAdapter`), ``a`` is ``(d_in, r)`` and ``b`` is
``(r, d_out)`` whatever the base's layout, so ``a = A.T`` and ``b = B.T`` always: for a base
stored ``(d_in, d_out)`` (Burn's Linear, ONNX ``MatMul`` B) the delta is ``scale * a @ b``
``= (scale * B @ A).T``; for a base stored ``(d_out, d_in)`` (PyTorch's layout, ONNX ``Gemm``
``transB=1``; a *transposed* adapter) it is ``(scale * a @ b).T = scale * B @ A``. PEFT's
``fan_in_fan_out`` (GPT-2 ``Conv1D`` bases stored ``(in, out)``) describes the PyTorch base and
changes neither factor; the layout that matters is the target param's here: an adapter already
attached says it, else the module's declared layout (``lora_transposed_paths``), else the shape
(``(in, out)`` vs ``(out, in)``; a square weight is taken as ``(in, out)``, Burn's layout).

Unsupported PEFT variants raise :class:`~onnxparam.RecordError` naming the option: DoRA
(``use_dora``), trained biases (``bias`` other than ``"none"``), ``modules_to_save`` weights,
embedding / convolution LoRA (``lora_embedding_A``, 4-d factors), non-LoRA ``peft_type``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..dtype import DType
from ..errors import RecordError, ShapeMismatchError
from ..lora import LoraAdapter, transposed_paths
from ..module import named_params, rebuild
from ..param import Param, ParamId
from ..tensor import Tensor

__all__ = ["load_peft_adapter", "PeftConfig", "read_peft_config", "DEFAULT_PEFT_KEY_MAP",
           "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

DEFAULT_PEFT_KEY_MAP = ((r"^base_model\.model\.", ""),)
"""Applied before the user's rules: PEFT prefixes every key with ``base_model.model.``."""

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
"""``<module>.lora_A.weight`` (and the older ``<module>.lora_A.<adapter name>.weight``)."""


PEFT_DEFAULT_LORA_ALPHA = 8
"""``lora_alpha`` when ``adapter_config.json`` leaves it out: PEFT's ``LoraConfig`` default."""


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
        for key in ("use_qalora", "lora_bias"):
            if raw.get(key):
                problems.append(f"{key}=true is not supported")
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
        self.fan_in_fan_out = bool(raw.get("fan_in_fan_out", False))
        # NOTE (reliability fuzzing): patterns are checked here, so a bad key or value is a
        # RecordError naming it, not a re.error / ValueError while the weights are matched.
        self.rank_pattern = _patterns(raw, "rank_pattern", _rank, source)
        self.alpha_pattern = _patterns(raw, "alpha_pattern", _alpha, source)

    @staticmethod
    def _pattern(patterns: dict, name: str):
        # PEFT (tuners/lora/model.py): the first key k with re.match(rf"(.*\.)?({k})$", name)
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        return None

    def scale_for(self, name: str, rank: int) -> float:
        """The adapter scale of PEFT module ``name`` whose factors have rank ``rank``."""
        alpha = self._pattern(self.alpha_pattern, name)
        alpha = self.lora_alpha if alpha is None else alpha
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def rank_for(self, name: str) -> int:
        rank = self._pattern(self.rank_pattern, name)
        return self.r if rank is None else rank


def _rank(value) -> int:
    """A LoRA rank: an integer >= 1 (``2.0`` is taken, ``2.7``, ``true`` and ``0`` are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
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


def _files(folder_or_files) -> tuple:
    if isinstance(folder_or_files, (str, os.PathLike)) and Path(folder_or_files).is_dir():
        folder = Path(folder_or_files)
        weights = folder / WEIGHTS_FILE
        if not weights.exists() and (folder / "adapter_model.bin").exists():
            raise RecordError(f"{folder} holds adapter_model.bin (a pickle); save the adapter with "
                              "safe_serialization=True to get adapter_model.safetensors")
        return folder / CONFIG_FILE, weights
    files = [Path(p) for p in (folder_or_files if isinstance(folder_or_files, (list, tuple)) else [folder_or_files])]
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


def load_peft_adapter(module, folder_or_files, key_map: Optional[Sequence] = None, *,
                      allow_partial: bool = False):
    """A copy of ``module`` with the LoRA adapters of a PEFT checkpoint attached.

    Args:
        module: any :class:`~onnxparam.Module`.
        folder_or_files: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``,
            or those two paths.
        key_map: ``[(regex, replacement), ...]`` applied in order (``re.sub``) to each PEFT
            module name, after :data:`DEFAULT_PEFT_KEY_MAP` strips ``base_model.model.``; the
            result is the module path of the adapted param (``"fc1.weight"``), or of its module
            (``"fc1"``, ``.weight`` is appended when that is not a param).
        allow_partial: ignore PEFT modules that map to no param (else an error lists them).

    Returns:
        the new module: each target param (frozen) carries a :class:`~onnxparam.LoraAdapter`
        with ``a = lora_A.T`` ``(d_in, r)``, ``b = lora_B.T`` ``(r, d_out)`` at the param's
        float dtype, the PEFT scale, and the param's layout (module docstring). A target that
        already has an adapter keeps its factors' ids.

    Raises:
        RecordError: for an unsupported variant (the option named), keys that are not LoRA
            factors, unmatched modules, or factors whose shapes do not fit the target (every
            problem listed together).
    """
    from ..formats.safetensors import read_safetensors

    config_path, weights_path = _files(folder_or_files)
    config = read_peft_config(config_path)
    rules = list(DEFAULT_PEFT_KEY_MAP) + [tuple(r) for r in (key_map or ())]
    if not weights_path.is_file():  # NOTE: else read_safetensors' FileNotFoundError escapes
        raise RecordError(f"the PEFT adapter weights {weights_path} are missing; a PEFT adapter folder holds "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    tensors = read_safetensors(weights_path).tensors
    pairs: dict = {}
    problems = []
    for key, snap in tensors.items():
        match = _KEY.match(key)
        if match is None:
            what = ("lora_embedding factors (embedding LoRA)" if "lora_embedding_" in key else
                    "a bias (bias training)" if key.endswith(".bias") else
                    "a full weight (modules_to_save)" if ".modules_to_save." in key or ".lora_" not in key
                    else "not a LoRA factor")
            problems.append(f"{key!r}: {what} is not supported")
            continue
        pairs.setdefault(match["module"], {})[match["which"]] = snap
    params = dict(named_params(module))
    flipped = transposed_paths(module)
    plan: dict = {}
    for name, factors in pairs.items():
        if set(factors) != {"A", "B"}:
            problems.append(f"PEFT module {name!r} has lora_{next(iter(factors))} but not its pair")
            continue
        mapped = _map_key(name, rules)
        target = mapped if mapped in params else f"{mapped}.weight"
        if target not in params:
            if not allow_partial:
                problems.append(f"PEFT module {name!r} maps to {mapped!r}, which is not a param (nor is "
                                f"{mapped + '.weight'!r}); add a key_map rule (regex, replacement)")
            continue
        A, B = factors["A"], factors["B"]
        if len(A.shape) != 2 or len(B.shape) != 2:
            problems.append(f"PEFT module {name!r}: factors of shapes {list(A.shape)} / {list(B.shape)} "
                            "(convolution LoRA) are not supported")
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
        param = params[target]
        shape = tuple(param.lazy_shape())
        adapter = param.adapter()
        if adapter is not None:
            transposed = bool(adapter.transposed)
        elif target in flipped:
            transposed = True
        else:
            transposed = shape == (d_out, d_in) and shape != (d_in, d_out)
        want = (d_out, d_in) if transposed else (d_in, d_out)
        if len(shape) != 2 or shape != want:
            problems.append(
                f"PEFT module {name!r} -> {target!r}: the factors make a ({d_out}, {d_in}) PyTorch weight, "
                f"the param is {list(shape)}"
                + ("" if len(shape) != 2 else "; check the key_map points at the right weight"))
            continue
        if target in plan:
            problems.append(f"PEFT modules {plan[target][0]!r} and {name!r} both map to {target!r}")
            continue
        plan[target] = (name, A, B, config.scale_for(name, rank), transposed)
    if problems:
        kind = ShapeMismatchError if all("the param is" in p for p in problems) else RecordError
        raise kind(f"cannot load the PEFT adapter {weights_path} onto {type(module).__name__}", problems)

    def attach(path: str, param: Param) -> Param:
        entry = plan.get(path)
        if entry is None:
            return param
        name, A, B, scale, transposed = entry
        dtype = param.lazy_dtype()
        # NOTE: factors follow the base's float dtype (F32 for a quantized base), as apply_lora's
        np_dtype = np.float32 if dtype is DType.QFloat or not dtype.is_float else dtype.to_numpy()
        device = param.lazy_device()
        old = param.adapter()
        a_id = old.a.id if old is not None else ParamId()
        b_id = old.b.id if old is not None else ParamId()
        # NOTE: PEFT's A is (r, in), B is (out, r); ours are their transposes (module docstring)
        a = np.ascontiguousarray(np.asarray(A.to_data().to_numpy()).T.astype(np_dtype))
        b = np.ascontiguousarray(np.asarray(B.to_data().to_numpy()).T.astype(np_dtype))
        pa = Param.initialized(a_id, Tensor.from_numpy(a, device), True)
        pb = Param.initialized(b_id, Tensor.from_numpy(b, device), True)
        return param.set_require_grad(False).with_adapter(LoraAdapter(pa, pb, float(scale), transposed=transposed))

    return rebuild(module, attach)
