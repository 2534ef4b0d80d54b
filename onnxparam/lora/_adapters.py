"""LoRA: low-rank adapters on rank-2 params (Burn's ``LoraConfig`` / LoRA reparameterization).

Formula (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; Burn's
``burn-core/src/module/lora.rs``)::

    W_eff = W + scale * (A @ B),    scale = alpha / rank  (alpha / sqrt(rank): rsLoRA)
    A: (d_in, rank), float, row-major, init ~ N(0, init_std or 1/rank)
    B: (rank, d_out), float, row-major, init = 0

for a weight ``W`` of shape ``(d_in, d_out)`` (Burn's ``Linear`` layout, ONNX ``MatMul``'s B).
The factors are params with their own ids; records hold them at ``<path>.lora.a`` and
``<path>.lora.b``. The scale is configuration: Burn does not store it, so loading a record with
factors needs a module that already has adapters of the same rank and alpha.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from ..core.errors import LoraError, LoraTypeError
from ..core.dtype import DType
from ..core.group import ParamGroup
from ..core.param import Param, ParamId
from ..core.tensor import Tensor
from ..trace.passes import LORA_MODES, TRACE_LORA_MODES  # noqa: F401  (re-exported: the modes of a trace)

__all__ = ["LoraConfig", "LoraAdapter", "LoraAdapterSet", "apply_lora", "merge_param", "transposed_paths", "untargetable_paths",
           "LORA_LAYOUT_METHOD", "LORA_TARGETS_METHOD", "LORA_DEFAULT_SKIPS_METHOD", "default_skipped_paths", "adapter_set", "active_adapter", "add_adapter", "set_adapter",
           "disable_adapter", "delete_adapter", "DEFAULT_ADAPTER_NAME", "with_every_named_target"]


@dataclass(frozen=True)
class LoraConfig:
    """Configuration of :func:`apply_lora` (Burn's ``LoraConfig``).

    Args:
        rank: the adapter rank ``r`` (> 0); 8 when left out, as PEFT's ``LoraConfig(r=8)``.
        alpha: the scaling numerator; ``scale = alpha / rank``; 8 when left out, as PEFT's
            ``lora_alpha=8`` (so ``LoraConfig(rank=4)`` scales by 2, as PEFT's ``LoraConfig(r=4)``).
        init_std: standard deviation of ``A``'s normal init; ``1 / rank`` when ``None``.
        dtype: the factors' dtype; the base's float dtype when ``None`` (F32 for a quantized base).
        param_group: which rank-2 float params get adapters. The default (every param)
            adapts the matrices of linear maps (and this library's ``nn.Embedding`` tables),
            and leaves out what a module declares is no linear map
            (:data:`LORA_TARGETS_METHOD`: a ``(1, d)`` scale) or no default target
            (:data:`LORA_DEFAULT_SKIPS_METHOD`: in an imported graph, as PEFT's defaults, the
            tables ``Gather`` reads (embeddings of the inputs, position tables) and an output
            projection tied to an embedding table); a narrower group adapts the latter too.
        seed: seed of ``A``'s random init; fresh randomness when ``None``.
        use_rslora: rank-stabilized LoRA (Kalajdzievski 2023, PEFT's ``use_rslora``):
            ``scale = alpha / sqrt(rank)`` instead of ``alpha / rank``.

    Raises:
        LoraTypeError: (a ``LoraError`` and a ``TypeError``) for a rank that is not an int (a
            bool or a float is refused), an alpha or init_std that is not a real number, or a
            dtype that is not a :class:`DType`.
        LoraError: (a ``ValueError``) for a rank <= 0, a non-finite alpha, an init_std that is
            not finite and > 0, or a dtype that is not a float dtype (``QFloat`` included: factors stay float).
    """

    rank: int = 8
    alpha: float = 8.0
    init_std: Optional[float] = None
    dtype: Optional[DType] = None
    param_group: ParamGroup = field(default_factory=ParamGroup.all)
    seed: Optional[int] = None
    use_rslora: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, numbers.Integral):
            raise LoraTypeError(f"LoraConfig.rank must be an int; got {type(self.rank).__name__} {self.rank!r}")
        if self.rank <= 0:
            raise LoraError(f"LoraConfig.rank must be positive; got {self.rank}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real):
            raise LoraTypeError(f"LoraConfig.alpha must be a real number; got {type(self.alpha).__name__} {self.alpha!r}")
        if not math.isfinite(self.alpha):
            raise LoraError(f"LoraConfig.alpha must be finite; got {self.alpha}")
        if self.init_std is not None:
            if isinstance(self.init_std, bool) or not isinstance(self.init_std, numbers.Real):
                raise LoraTypeError(f"LoraConfig.init_std must be a real number or None; got "
                                f"{type(self.init_std).__name__} {self.init_std!r}")
            if not (math.isfinite(self.init_std) and self.init_std > 0):
                raise LoraError(f"LoraConfig.init_std must be finite and > 0; got {self.init_std}")
        if self.dtype is not None:
            if not isinstance(self.dtype, DType):
                raise LoraTypeError(f"LoraConfig.dtype must be a DType or None; got {type(self.dtype).__name__} "
                                f"{self.dtype!r}")
            if not self.dtype.is_float or self.dtype is DType.QFloat:
                raise LoraError(f"LoraConfig.dtype must be a float dtype (F64, F32, F16, BF16); got {self.dtype.name}")

    @property
    def scale(self) -> float:
        """``alpha / rank``, or ``alpha / sqrt(rank)`` with ``use_rslora``."""
        if self.use_rslora:
            return float(self.alpha) / math.sqrt(int(self.rank))
        return float(self.alpha) / int(self.rank)

    def with_rank(self, rank: int) -> "LoraConfig":
        return replace(self, rank=rank)

    def with_alpha(self, alpha: float) -> "LoraConfig":
        return replace(self, alpha=alpha)

    def with_param_group(self, group: ParamGroup) -> "LoraConfig":
        return replace(self, param_group=group)


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter: factors ``a`` ``(d_in, rank)`` and ``b`` ``(rank, d_out)`` and ``scale``.

    ``transposed=True`` marks a base stored ``(d_out, d_in)`` (ONNX ``Gemm`` with ``transB=1``,
    PyTorch ``Linear``): the delta is then ``scale * (a @ b).T``, still in the weight's own layout.
    """

    a: Param
    b: Param
    scale: float
    transposed: bool = False

    @property
    def rank(self) -> int:
        return int(self.a.lazy_shape()[1])

    def with_factors(self, a: Param, b: Param) -> "LoraAdapter":
        return replace(self, a=a, b=b)

    def merges_into(self, shape: tuple) -> bool:
        """Whether the adapter is a delta of a param of ``shape`` (it can be merged): every
        adapter but a grouped convolution's (:func:`conv_adapter_groups` > 1), which runs as a
        branch only. ``module(x)`` in ``lora_mode="merge"`` runs a module holding one in
        ``"keep"`` (:mod:`onnxparam.runtime`, duck-typed: the runtime does not import LoRA)."""
        return len(shape) < 3 or conv_adapter_groups(tuple(shape), int(self.a.lazy_shape()[0])) <= 1

    def delta(self) -> np.ndarray:
        """``scale * (a @ b)`` (transposed for a transposed base), float32 or the factor dtype."""
        a = np.asarray(self.a.val().to_numpy())
        b = np.asarray(self.b.val().to_numpy())
        compute = np.float64 if a.dtype == np.float64 else np.float32
        delta = (a.astype(compute) @ b.astype(compute)) * compute(self.scale)
        return delta.T if self.transposed else delta

    def delta_for(self, shape: tuple) -> np.ndarray:
        """:meth:`delta` in a param's ``shape``: a 1-d param (a bias with PEFT's ``lora_bias``,
        ``a`` ``(1, 1)``, ``b`` ``(1, d)``) gets the ``(1, d)`` delta flattened; a convolution
        weight ``(out, in, *kernel)`` (PEFT's conv LoRA: a transposed adapter with ``a``
        ``(in * prod(kernel), r)``, ``b`` ``(r, out)``) gets the ``(out, ...)`` delta reshaped.

        Raises:
            LoraError: a grouped convolution's adapter (:func:`conv_adapter_groups` > 1): it is
                no weight delta.
        """
        groups = conv_adapter_groups(shape, int(self.a.lazy_shape()[0])) if len(shape) >= 3 else 1
        if groups > 1:
            raise LoraError(grouped_conv_message(shape, groups, "merged into the weight"))
        delta = self.delta()
        return delta.reshape(shape) if len(shape) != 2 else delta

    def apply(self, base: Tensor) -> Tensor:
        """``base + delta`` at ``base``'s dtype (computed in float32, or float64 for F64)."""
        w = np.asarray(base.to_numpy())
        compute = np.float64 if w.dtype == np.float64 else np.float32
        merged = (w.astype(compute) + self.delta_for(w.shape).astype(compute)).astype(w.dtype)
        return Tensor.from_numpy(merged, base.device)


def conv_adapter_groups(shape: tuple, d_in: int) -> int:
    """The ``groups`` of PEFT's LoRA on a convolution weight ``shape`` ``(out, in / groups,
    *kernel)`` whose adapter ``a`` is ``(d_in, r)``: PEFT's ``lora_A`` is a conv of **every**
    input channel (``(r, in, *kernel)``, never grouped), so ``d_in = in * prod(kernel)`` and
    ``groups = d_in / prod(shape[1:])``; ``0`` when ``d_in`` is no multiple of it.

    ``groups == 1`` is a weight delta (``(a @ b).T`` reshaped to the weight). ``groups > 1``
    (PEFT's ``lora_B``: a 1x1 conv with the base's ``groups``, here ``b`` ``(r, out)`` with
    zeros outside each group's ``r / groups`` rows) is **not**: ``lora_A`` mixes the groups'
    channels, so the adapter runs only as a branch (``Conv(x, a)`` then ``b``) in ``"keep"`` /
    ``"inputs"`` / ``"batched"`` graphs, and cannot be merged (PEFT refuses that too)."""
    size = math.prod(int(d) for d in shape[1:])
    return d_in // size if size and d_in % size == 0 else 0


def grouped_conv_message(shape: tuple, groups: int, what: str) -> str:
    return (f"a LoRA adapter on a grouped convolution's weight {list(shape)} (groups={groups}: PEFT's lora_A reads "
            f"all {groups * int(shape[1])} input channels) is no weight delta and cannot be {what}; it runs as a "
            "branch after the Conv: export with lora='keep', 'inputs' or 'batched' (module(x) runs it so); PEFT "
            "cannot merge it either")


LORA_LAYOUT_METHOD = "lora_transposed_paths"
"""The optional method a module defines to say which of its rank-2 params are stored
``(d_out, d_in)`` (PyTorch's layout; ONNX ``Gemm`` B with ``transB=1``): it returns their paths
relative to the module. :func:`apply_lora` gives those params transposed adapters (``a``
``(d_in, rank)``, ``b`` ``(rank, d_out)``, delta ``(a @ b).T`` in the weight's own layout).
An imported :class:`~onnxparam.OnnxModule` answers from its graph."""


LORA_TARGETS_METHOD = "lora_weight_layouts"
"""The optional method a module defines to say, for its rank-2 params, how its graph uses them:
``{path: "in_out" | "out_in" | reason}`` (an imported :class:`~onnxparam.OnnxModule` reads it from
the nodes consuming each weight: ``MatMul`` B, ``Gemm``, ``Transpose -> MatMul``). A param whose
entry is a reason (a LayerNorm scale of shape ``(1, d)`` used by ``Mul``, a bias used by ``Add``) is
no matrix of a linear map: :func:`apply_lora` leaves it without an adapter under the default
(every-param) group and refuses it, naming the reason, when a narrower group selects it."""


LORA_DEFAULT_SKIPS_METHOD = "lora_default_skips"
"""The optional method a module defines to name rank-2 params that have a layout but that the
default (every-param) group should not adapt: ``{path: reason}`` (an imported
:class:`~onnxparam.OnnxModule` names the tables ``Gather`` reads, embeddings of the inputs and
position tables such as GPT-2's ``wpe``, and an output projection tied to an embedding table,
such as GPT-2's ``lm_head`` that torch's exporter folds into a constant ``onnx::MatMul_N``, as
PEFT's defaults target linear layers and embeddings only when asked). A narrower group that
selects one adapts it."""


def default_skipped_paths(module) -> dict:
    """``{path: reason}`` of rank-2 params that the modules of the tree declare (through
    :data:`LORA_DEFAULT_SKIPS_METHOD`) the default group leaves without an adapter."""
    from ..core.module import named_modules

    found = {}
    for prefix, sub in named_modules(module):
        method = getattr(sub, LORA_DEFAULT_SKIPS_METHOD, None)
        if callable(method):
            found.update({f"{prefix}.{p}" if prefix else p: reason for p, reason in method().items()})
    return found


def untargetable_paths(module) -> dict:
    """``{path: reason}`` of rank-2 params that the modules of the tree declare (through
    :data:`LORA_TARGETS_METHOD`) are not used as the matrix of a linear map."""
    from ..core.module import named_modules

    found = {}
    for prefix, sub in named_modules(module):
        method = getattr(sub, LORA_TARGETS_METHOD, None)
        if callable(method):
            layouts = method()
            for p, param in sub.named_params():
                layout = layouts.get(p, "no node of the graph uses it as a matrix")
                if len(param.lazy_shape()) == 2 and layout not in ("in_out", "out_in"):
                    found[f"{prefix}.{p}" if prefix else p] = layout
    return found


def transposed_paths(module) -> set:
    """Paths (from ``module``) of params stored ``(d_out, d_in)``, as the modules of the tree
    declare them through :data:`LORA_LAYOUT_METHOD`."""
    from ..core.module import named_modules

    found = set()
    for prefix, sub in named_modules(module):
        method = getattr(sub, LORA_LAYOUT_METHOD, None)
        if callable(method):
            found.update(f"{prefix}.{p}" if prefix else p for p in method())
    return found


def _is_factor_path(path: str) -> bool:
    """Whether ``path`` is a LoRA factor's (``<param>.lora.a`` / ``<param>.lora.b``, as
    :func:`onnxparam.core.module.named_params` yields them)."""
    return path.endswith((".lora.a", ".lora.b")) or path in ("lora.a", "lora.b")


def frozen_base_param(path: str, param: Param) -> Param:
    """``param`` with ``require_grad=False`` when it is a float base param; unchanged when it is
    a LoRA factor (``path`` ends ``.lora.a`` / ``.lora.b``) or not float. What :func:`apply_lora`
    and :func:`add_adapter` freeze (PEFT's ``_mark_only_adapters_as_trainable`` with
    ``bias="none"`` and no ``modules_to_save``: only the adapter factors train)."""
    if _is_factor_path(path) or not param.lazy_dtype().is_float:
        return param
    return param.set_require_grad(False)


def freeze_base(module):
    """A copy of ``module`` whose float params, except LoRA factors, do not require grad
    (:func:`frozen_base_param` on each); already-frozen params stay frozen, factors keep their
    flags."""
    from ..core.module import rebuild

    return rebuild(module, frozen_base_param)


def has_adapters(module) -> bool:
    """Whether ``module`` carries a LoRA adapter on a param or owns a named one: adding the
    first adapter to a module without freezes its base (:func:`freeze_base`), as PEFT's
    ``inject_adapter`` does on its first injection; later ones keep every flag."""
    from ..core.module import named_params

    return getattr(module, _SET_ATTR, None) is not None or any(p.adapter() is not None for _, p in named_params(module))


def apply_lora(module, config: LoraConfig, *, allow_empty: bool = False):
    """A copy of ``module`` with every float param frozen and an adapter on each rank-2 float
    param that ``config.param_group`` matches (Burn's ``Module::apply_lora``).

    Rank-2 params that the module's graph does not use as a linear map's matrix (declared through
    :data:`LORA_TARGETS_METHOD`) get no adapter under the default group; a narrower group that
    selects one is an error naming it.
    Params a module declares no default target (:data:`LORA_DEFAULT_SKIPS_METHOD`: an imported
    graph's embedding and position tables and tied output projection) get no adapter under the
    default group, one when a narrower group selects them.

    A param stored ``(d_out, d_in)`` (declared through :data:`LORA_LAYOUT_METHOD`, e.g. an
    imported ONNX ``Gemm`` weight with ``transB=1``) gets a transposed adapter, so its delta is
    in its own layout. The factors are lazy params: ``A`` is drawn from N(0, std) only when
    first needed.

    Args:
        module: the module to adapt (unchanged).
        config: the :class:`LoraConfig`.
        allow_empty: accept a result with no adapter at all (a ``LoraWarning`` names why
            nothing was adapted) instead of raising.

    Warns:
        LoraWarning: a narrower group (not the default) matches params of rank >= 3
            (convolution kernels) while other params got adapters: they are listed, as
            ``apply_lora`` creates adapters for 2-d weights only (PEFT's convolution LoRA loads
            through :func:`onnxparam.load_peft_adapter`).

    Raises:
        LoraError: (a ``ValueError``) a matched param already has an adapter (the new config
            would otherwise be silently ignored for it); a narrower group selects a rank-2
            param that is no linear map's matrix; or no param gets an adapter (unless
            ``allow_empty``), the message listing the candidate params and why each was skipped.
    """
    from ..core.errors import LoraError, LoraWarning
    from ..core.module import rebuild

    transposed = transposed_paths(module)
    not_linear = untargetable_paths(module)
    every_param = repr(config.param_group) == repr(ParamGroup.all())
    by_default_not = default_skipped_paths(module) if every_param else {}
    rng = np.random.default_rng(config.seed)
    rank = int(config.rank)
    std = float(config.init_std) if config.init_std is not None else 1.0 / rank
    skipped: dict = {"linear": [], "rank": [], "group": [], "default": []}  # why float params got no adapter
    adapted = []
    kernels = []  # params of rank >= 3 (convolution kernels) that a narrower group matches

    def adapt(path: str, param: Param) -> Param:
        dtype = param.lazy_dtype()
        if not dtype.is_float or _is_factor_path(path):
            return param
        frozen = frozen_base_param(path, param)
        shape = param.lazy_shape()
        if len(shape) != 2:
            skipped["rank"].append(f"{path!r} {tuple(shape)}")
            if len(shape) >= 3 and not every_param and config.param_group.matches(param.id, path):
                kernels.append(f"{path!r} {tuple(shape)}")
            return frozen
        if not config.param_group.matches(param.id, path):
            skipped["group"].append(f"{path!r} {tuple(shape)}")
            return frozen
        if path in not_linear:
            if every_param:
                skipped["linear"].append(f"{path!r} {tuple(shape)}: {not_linear[path]}")
                return frozen
            raise LoraError(f"{path!r} {tuple(shape)} is not the matrix of a linear map in its graph "
                            f"({not_linear[path]}): LoRA cannot adapt it; narrow the param_group")
        if path in by_default_not:
            skipped["default"].append(f"{path!r} {tuple(shape)}: {by_default_not[path]}")
            return frozen
        if param.adapter() is not None:
            old = param.adapter()
            raise LoraError(f"{path!r} already has a LoRA adapter (rank {old.rank}, scale {old.scale:g}); "
                            "merge_lora() first or apply the new config to a module without adapters "
                            "(or narrow its param_group)")
        flip = path in transposed
        d_out, d_in = shape if flip else shape[::-1]
        factor_dtype = config.dtype or (DType.F32 if dtype is DType.QFloat else dtype)
        np_dtype = factor_dtype.to_numpy()
        seed = int(rng.integers(0, 2**63))

        def init_a(device, require_grad, _seed=seed):
            values = np.random.default_rng(_seed).normal(0.0, std, size=(d_in, rank))
            return Tensor.from_numpy(values.astype(np_dtype), device)

        def init_b(device, require_grad):
            return Tensor.from_numpy(np.zeros((rank, d_out), dtype=np_dtype), device)

        device = param.lazy_device()
        a = Param.uninitialized(ParamId(), init_a, device, True, (d_in, rank), factor_dtype)
        b = Param.uninitialized(ParamId(), init_b, device, True, (rank, d_out), factor_dtype)
        adapted.append(path)
        return frozen.with_adapter(LoraAdapter(a, b, config.scale, transposed=flip))

    out = rebuild(module, adapt)
    if not adapted:
        message = _nothing_adapted(module, config, skipped)
        if not allow_empty:
            raise LoraError(message + "; pass allow_empty=True to accept a module without adapters")
        import warnings

        warnings.warn(message, LoraWarning, stacklevel=3)
    elif kernels:
        import warnings

        shown = ", ".join(kernels[:8]) + (f" ... ({len(kernels) - 8} more)" if len(kernels) > 8 else "")
        warnings.warn(f"apply_lora: the param_group matches {len(kernels)} param(s) of rank >= 3 that got no "
                      f"adapter: {shown}; apply_lora creates adapters for 2-d weights only (a convolution "
                      "LoRA loads from PEFT: load_peft_adapter); narrow the param_group to silence this",
                      LoraWarning, stacklevel=3)
    return out


def _nothing_adapted(module, config: LoraConfig, skipped: dict) -> str:
    """Why :func:`apply_lora` attached no adapter to ``module``: the candidate params and the
    reason each was skipped (a few named per reason)."""

    def listed(items: list) -> str:
        return "; ".join(items[:4]) + (f"; ... ({len(items) - 4} more)" if len(items) > 4 else "")

    source = getattr(module, "source_path", None)
    name = type(module).__name__ + (f" ('{source}')" if source is not None else "")
    reasons = []
    if skipped["linear"]:
        reasons.append(f"{len(skipped['linear'])} rank-2 float param(s) are not the matrix of a linear map in "
                       f"the graph (no MatMul / Gemm / Gather uses them as one), so LoRA cannot adapt them: "
                       f"{listed(skipped['linear'])}")
    if skipped["default"]:
        reasons.append(f"{len(skipped['default'])} rank-2 float param(s) are left out by the default param_group "
                       f"(a param_group naming them adapts them): {listed(skipped['default'])}")
    if skipped["group"]:
        reasons.append(f"{len(skipped['group'])} rank-2 float param(s) do not match the param_group "
                       f"{config.param_group!r}: {listed(skipped['group'])}")
    if skipped["rank"]:
        reasons.append(f"{len(skipped['rank'])} float param(s) are not rank-2 (LoRA adapts matrices only): "
                       f"{listed(skipped['rank'])}")
    if not reasons:
        reasons.append("it has no float param to adapt (only integer or bool params, LoRA factors, or none)")
    return f"apply_lora (rank {config.rank}): no param of {name} got a LoRA adapter: " + "; ".join(reasons)


def merge_param(param: Param, path: Optional[str] = None) -> Param:
    """``param`` with its adapter folded in (``base + scale * a @ b``); unchanged without one.

    A quantized base is dequantized first, so the merged weight is float.

    Raises:
        LoraError: an adapter that is no weight delta (a grouped convolution's,
            :meth:`LoraAdapter.merges_into`), naming ``path`` when given.
    """
    if param.adapter() is None:
        return param
    try:
        merged = param.val()
    except LoraError as e:
        if path is None:
            raise
        raise LoraError(f"{path!r}: {e}") from e
    return Param(param.id, value=merged, require_grad=param.require_grad, mapper=param._mapper)


class LoraAdapterSet:
    """Named adapters for one module (PEFT's ``add_adapter`` / ``set_adapter`` /
    ``disable_adapter`` / ``delete_adapter``), on top of Burn's one adapter per param: each
    name holds ``{param path: LoraAdapter}``; :meth:`activate` returns the module with exactly
    that name's adapters attached. Immutable: :meth:`add` and :meth:`delete` return new sets.

    Example::

        adapters = LoraAdapterSet().add("sql", load_peft_adapter(base, "sql/")).add("chat", chat)
        model = adapters.activate(base, "sql")   # base + the "sql" adapters
        plain = adapters.disable(model)          # the base model

    A module can own its set instead (``base.add_adapter("sql", ...).set_adapter("sql")``,
    :func:`add_adapter`): then copies, ``load_record``, saving and exporting by name carry it.
    """

    def __init__(self, sets: Optional[dict] = None):
        self._sets = dict(sets or {})

    @property
    def names(self) -> list:
        """The adapter names, in the order they were added."""
        return list(self._sets)

    def adapters(self, name: str) -> dict:
        """``{param path: LoraAdapter}`` of ``name``. Raises ``KeyError`` naming the known names."""
        if name not in self._sets:
            raise KeyError(f"no adapter named {name!r}; the set holds {self.names}")
        return dict(self._sets[name])

    def add(self, name: str, module) -> "LoraAdapterSet":
        """A set with ``name`` -> the adapters ``module`` carries (``apply_lora``,
        ``load_peft_adapter``, a trained module ...), or ``module`` itself when it is a
        ``{param path: LoraAdapter}`` mapping.

        Raises:
            LoraError: (a ``ValueError``) ``name`` is already in the set, or ``module`` has no adapters.
        """
        if name in self._sets:
            raise LoraError(f"an adapter named {name!r} is already in the set; delete it first")
        found = dict(module) if isinstance(module, dict) else _current_adapters(module)
        if not found:
            raise LoraError(f"{type(module).__name__} has no LoRA adapters to add as {name!r}")
        return LoraAdapterSet({**self._sets, name: found})

    def _with(self, name: str, adapters: dict) -> "LoraAdapterSet":
        """A set whose ``name`` holds ``adapters`` (in ``name``'s place when it is there)."""
        return LoraAdapterSet({**self._sets, name: dict(adapters)})

    def delete(self, name: str) -> "LoraAdapterSet":
        """A set without ``name`` (``KeyError`` when it has none)."""
        self.adapters(name)
        return LoraAdapterSet({k: v for k, v in self._sets.items() if k != name})

    def activate(self, module, name: Optional[str]):
        """``module`` with exactly ``name``'s adapters attached (every other adapter removed);
        ``None``: no adapter (:meth:`disable`).

        Raises:
            KeyError: an unknown name.
            LoraError: (a ``ValueError``) ``module`` lacks a param the adapters are for, or has it
                in another shape.
        """
        from ..core.module import named_params, rebuild

        chosen = {} if name is None else self.adapters(name)
        params = dict(named_params(module))
        problems = [f"{path!r}: not a param of {type(module).__name__}" for path in chosen if path not in params]
        for path, adapter in chosen.items():
            if path in params:
                shape = tuple(params[path].lazy_shape())
                d_in, d_out = int(adapter.a.lazy_shape()[0]), int(adapter.b.lazy_shape()[1])
                size = math.prod(int(d) for d in shape)
                grouped = len(shape) >= 3 and d_out == shape[0] and conv_adapter_groups(shape, d_in) > 1
                if d_in * d_out != size and not grouped:
                    problems.append(f"{path!r}: the adapter makes a ({d_in}, {d_out}) delta, the param is {list(shape)}")
        if problems:
            raise LoraError(f"cannot activate adapter {name!r}: " + "; ".join(problems))
        return rebuild(module, lambda path, p: p.with_adapter(chosen.get(path)) if (
            p.adapter() is not None or path in chosen) else p)

    def disable(self, module):
        """``module`` without any adapter: the base model (PEFT's ``disable_adapter``)."""
        return self.activate(module, None)


def _current_adapters(module) -> dict:
    """``{param path: LoraAdapter}`` of the adapters ``module``'s params carry now."""
    from ..core.module import named_params

    return {path: p.adapter() for path, p in named_params(module) if p.adapter() is not None}


DEFAULT_ADAPTER_NAME = "default"
"""The name :func:`add_adapter` gives adapters a module already carries unnamed (PEFT's
``adapter_name`` default)."""

_SET_ATTR = "_lora_adapter_set"
_ACTIVE_ATTR = "_lora_active_adapter"
# NOTE: private attributes of the root module: traversal skips names starting with "_", and
# rebuild's copy.copy carries them, so the named set follows every copy (map, load_record,
# to_device, train ...). The ACTIVE adapter lives in the params only (trained, loaded and moved
# with them); the set keeps the inactive ones and is refreshed from the params on each switch.


def active_adapter(module) -> Optional[str]:
    """The name of ``module``'s active named adapter, or ``None`` (no named adapter active)."""
    return getattr(module, _ACTIVE_ATTR, None)


def adapter_set(module) -> LoraAdapterSet:
    """The named adapters ``module`` owns (:func:`add_adapter`), the active one with the values
    its params hold now (after training or ``load_record``); an empty set for a module without."""
    sets = getattr(module, _SET_ATTR, None) or LoraAdapterSet()
    active = active_adapter(module)
    if active is not None and active in sets.names:
        sets = sets._with(active, _current_adapters(module))
    return sets


def _owning(module, sets: LoraAdapterSet, active: Optional[str]):
    """``module`` (a fresh copy) made the owner of ``sets`` with ``active`` active."""
    object.__setattr__(module, _SET_ATTR, sets if sets.names else None)
    object.__setattr__(module, _ACTIVE_ATTR, active)
    return module


def _copy(module):
    from ..core.module import rebuild

    return rebuild(module, lambda path, p: p)


def add_adapter(module, name: str, source):
    """A copy of ``module`` that owns one more named adapter (PEFT's ``add_adapter``; it does
    not become active): ``source`` is a module carrying adapters for ``module``'s params (e.g.
    ``load_peft_adapter(module, folder)``) or a ``{param path: LoraAdapter}`` mapping.
    Adapters ``module`` already carries unnamed (``apply_lora``) are first named
    :data:`DEFAULT_ADAPTER_NAME` and stay active.

    Trainability follows PEFT's ``inject_adapter``: the first adapter added to a module that
    carries none (no adapter on its params, no named adapter) freezes its base as
    :func:`apply_lora` does (every float param except LoRA factors gets ``require_grad=False``;
    PEFT's default ``bias="none"``, no ``modules_to_save``), so training the result after
    :func:`set_adapter` updates the adapter factors only. Adding to a module that already has
    adapters keeps every param's flag as it is (a frozen param stays frozen, one the caller
    unfroze stays trainable). The factors keep the flags ``source`` gave them.

    For full fine-tuning (base and adapter), unfreeze after adding:
    ``model.unfreeze_group(ParamGroup.all())`` (or a narrower :class:`~onnxparam.ParamGroup`,
    e.g. for PEFT's ``bias="all"``); later ``add_adapter`` / ``set_adapter`` calls keep it.

    Each named adapter has factor ids of its own (optimizer state and records are keyed by
    them): a factor of ``source`` whose id one of ``module``'s adapters already has (a
    ``load_peft_adapter`` refill of the module's unnamed adapters) is added under a fresh id.

    Raises:
        LoraError: (a ``ValueError``) ``name`` is taken, or ``source`` has no adapters.
    """
    sets, active = adapter_set(module), active_adapter(module)
    current = _current_adapters(module)
    first = not has_adapters(module)
    if active is None and current:
        sets, active = sets.add(DEFAULT_ADAPTER_NAME, current), DEFAULT_ADAPTER_NAME
    taken = {f.id for n in sets.names for ad in sets.adapters(n).values() for f in (ad.a, ad.b)}
    taken |= {f.id for ad in current.values() for f in (ad.a, ad.b)}
    sets = sets.add(name, source)
    sets = sets._with(name, {path: _own_ids(adapter, taken) for path, adapter in sets.adapters(name).items()})
    return _owning(freeze_base(module) if first else _copy(module), sets, active)


def _own_ids(adapter: LoraAdapter, taken: set) -> LoraAdapter:
    """``adapter`` whose factors with an id in ``taken`` are copies under fresh ids (same values
    and flags)."""

    def own(p: Param) -> Param:
        if p.id not in taken:
            return p
        return Param.initialized(ParamId(), p.base(), p.require_grad)

    a, b = own(adapter.a), own(adapter.b)
    return adapter if a is adapter.a and b is adapter.b else adapter.with_factors(a, b)


def set_adapter(module, name: Optional[str]):
    """A copy of ``module`` with its named adapter ``name`` active (PEFT's ``set_adapter``), the
    one active before kept in the set with its current values; ``None``: no adapter.

    Switching changes no ``require_grad`` flag: the base stays as :func:`add_adapter` left it
    (frozen, unless the caller unfroze it, e.g. ``model.unfreeze_group(ParamGroup.all())`` for
    full fine-tuning), and the activated adapter's factors train with the flags they were
    added with (trainable from ``load_peft_adapter`` / ``apply_lora``).

    Raises:
        KeyError: an unknown name (the known ones listed).
        LoraError: (a ``ValueError``) the adapter does not fit ``module``'s params
            (:meth:`LoraAdapterSet.activate`).
    """
    sets = adapter_set(module)
    return _owning(sets.activate(module, name), sets, name)


def disable_adapter(module):
    """A copy of ``module`` with no adapter active, its named adapters kept (PEFT's
    ``disable_adapter``): the base model."""
    return set_adapter(module, None)


def delete_adapter(module, name: str):
    """A copy of ``module`` without its named adapter ``name`` (PEFT's ``delete_adapter``); when
    it was active, no adapter is active afterwards (PEFT activates another one instead: here a
    deletion never switches to an adapter the caller did not name).

    Raises:
        KeyError: an unknown name.
    """
    sets, active = adapter_set(module), active_adapter(module)
    sets = sets.delete(name)
    if active == name:
        return _owning(sets.disable(module), sets, None)
    return _owning(_copy(module), sets, active)


def with_every_named_target(module):
    """``module`` (unchanged when it owns no named adapter) where every param that one of its
    named adapters targets carries an adapter: the active one, else a named one's. Used for
    ``lora="inputs"`` exports, whose factor inputs then cover every named adapter (their
    defaults are zero-rank: the values of a stand-in adapter never reach the graph), so each
    name's ``.onnx_adapter`` file fits the one export."""
    from ..core.module import rebuild

    sets = getattr(module, _SET_ATTR, None)
    if sets is None:
        return module
    stand_in: dict = {}
    for name in sets.names:
        for path, adapter in sets.adapters(name).items():
            stand_in.setdefault(path, adapter)
    return rebuild(module, lambda path, p: p if p.adapter() is not None or path not in stand_in
                   else p.with_adapter(stand_in[path]))


def no_adapter_reason(module) -> str:
    """Why ``module`` has no adapter on its params, for "nothing to write" messages: its named
    adapters when it owns some but none is active (``set_adapter(None)``), else "no LoRA adapters"."""
    names = list(adapter_set(module).names)
    if names:
        shown = ", ".join(repr(n) for n in names[:6])
        return (f"{type(module).__name__} has named adapters ({shown}) but none is active: "
                f"set_adapter({names[0]!r}) first, or pass adapter_name=")
    return f"{type(module).__name__} has no LoRA adapters (apply_lora or load_peft_adapter first)"
