"""Quantizing a module's params: :class:`Quantizer`, :class:`Calibration`, :func:`quantize_weights`.

Burn's ``Module::quantize_weights(&mut quantizer)`` maps every float tensor the quantizer
visits (``crates/burn-core/src/module/quantize.rs``; ``docs/burnpack.md`` §4). Here the set of
params is explicit (:func:`is_weight`):

* float params (F64/F32/F16/BF16; an already quantized one that would be touched again is a
  :class:`~onnxparam.core.errors.QuantizationError`) of **rank >= 2**
  by default: Linear / Conv / Embedding weights. Biases, norms' ``gamma`` / ``beta`` and running
  statistics are rank 1: quantizing them saves next to nothing and costs accuracy, and ONNX
  Runtime's integer kernels take their bias in float. ``Quantizer(min_rank=1)`` quantizes them too
  (Burn's behaviour).
* LoRA factors (``<path>.lora.a`` / ``.b``) are never quantized: QLoRA keeps them float.
* with a group (:func:`quantize_weights` ``group=``), only the params the group matches;
* a param whose shape is not a whole number of the scheme's blocks is left float, with a
  :class:`~onnxparam.quant.QuantizationWarning` listing them (Burn panics there): a block size
  chosen for Linear weights then skips small conv kernels instead of failing.

A quantized param is frozen (``require_grad=False``): it holds integer values and scales (a
``QFloat`` :class:`~onnxparam.Tensor` wrapping a :class:`~onnxparam.quant.QuantizedTensor`), and
``val()`` dequantizes them. Quantizing is lazy: a lazy param stays lazy and is quantized when
its value is first needed (loading a record into the quantized module never quantizes).
"""

from __future__ import annotations

import enum
import re
import warnings
from dataclasses import dataclass, replace

import numpy as np

from ..core.dtype import DType
from ..core.errors import QuantizationError, QuantizationWarning
from ..core.param import Param, _Lazy
from ..core.quant_scheme import QuantScheme
from ..core.tensor import quantize, quantize_per_axis

__all__ = ["Calibration", "Quantizer", "is_weight", "quantize_weights"]

_FLOAT_DTYPES = (DType.F64, DType.F32, DType.F16, DType.BF16)


class Calibration(enum.Enum):
    """How the quantization range of a tensor is found (Burn ``Calibration``).

    ``MinMax``: ``alpha = max(|min|, |max|)`` per tensor or per block (``docs/burnpack.md`` §4.1).
    Burn's ``AbsMean`` (BitNet) is not implemented.
    """

    MinMax = "MinMax"


@dataclass(frozen=True)
class Quantizer:
    """Quantizes float tensors with a :class:`QuantScheme` (Burn ``Quantizer { calibration, scheme }``).

    Args:
        scheme: the scheme every quantized param gets.
        calibration: :attr:`Calibration.MinMax` (the only one).
        min_rank: the smallest param rank that is quantized (default 2: weights, not biases;
            0-d params, an imported model's scalars, are never quantized whatever it says).
        per_channel: one scale per **output channel** instead of the scheme's grid (the scheme
            must be per-tensor; it gives the value type): axis 0 of a Conv weight
            ``[O, I, kh, kw]``, axis 1 of a ConvTranspose weight ``[I, O/g, kh, kw]`` and of a
            ``[K, N]`` MatMul / Linear weight, axis 0 of a ``Gemm`` B with ``transB=1``
            (:func:`channel_axes`). Stored as Burn's block scheme when its extents fit (at most
            255), else as an ONNX per-axis tensor (:func:`~onnxparam.core.tensor.quantize_per_axis`).

    Raises:
        QuantizationError: for a scheme Burn cannot quantize with (checked on the first tensor)
            or an unknown calibration.
    """

    scheme: QuantScheme = QuantScheme()
    calibration: Calibration = Calibration.MinMax
    min_rank: int = 2
    per_channel: bool = False

    def __post_init__(self):
        if not isinstance(self.scheme, QuantScheme):
            raise QuantizationError(f"Quantizer.scheme must be a QuantScheme, found {self.scheme!r}")
        if not isinstance(self.calibration, Calibration):
            raise QuantizationError(f"unknown calibration {self.calibration!r}; use Calibration.MinMax")
        if self.per_channel and (self.scheme.block is not None or self.scheme.is_two_level):
            raise QuantizationError(f"per_channel takes a per-tensor scheme (it sets the scale grid itself); got "
                                    f"{self.scheme.describe()}")

    def with_scheme(self, scheme: QuantScheme) -> Quantizer:
        return replace(self, scheme=scheme)

    def with_min_rank(self, min_rank: int) -> Quantizer:
        return replace(self, min_rank=int(min_rank))

    def quantize(self, array, axis: int | None = None):
        """``array`` (float, any shape) as a :class:`~onnxparam.quant.QuantizedTensor` (§4);
        with :attr:`per_channel`, one scale per index of ``axis`` (default: the last axis of a
        2-D array, else axis 0); a 1-D array (a bias, with ``min_rank=1``) gets one scale per
        tensor even then (one per element would be no quantization)."""
        if self.per_channel and np.ndim(array) >= 2:
            if axis is None:
                axis = 1 if np.ndim(array) == 2 else 0
            return quantize_per_axis(array, self.scheme, int(axis) % np.ndim(array))
        return quantize(array, self.scheme)


def is_weight(path: str, param: Param, quantizer: Quantizer) -> bool:
    """Whether :func:`quantize_weights` quantizes ``param`` (module docstring)."""
    if ".lora." in path or param.lazy_dtype() not in _FLOAT_DTYPES:
        return False
    try:
        rank = len(param.lazy_shape())
    except ValueError:
        rank = param.base().ndim  # a lazy param declared without a shape: its value tells
    return rank >= max(1, quantizer.min_rank)  # a scalar: nothing to save, a scale per value


def quantize_param(param: Param, quantizer: Quantizer, path: str = "param", axis: int | None = None) -> Param:
    """``param`` with a ``QFloat`` base (same id, mappers and adapter; frozen), quantized lazily.

    Raises:
        QuantizationError: (now for an initialized param, else when the value is first needed)
            when the scheme cannot quantize the value, naming ``path``.
    """
    source = param.clone()

    def init(device, require_grad, _source=source, _quantizer=quantizer, _path=path, _axis=axis):
        from ._stream import quantize_chunked, spill_codes

        base = _source.base()
        array = base.to_numpy()
        try:
            # NOTE (issue 27): a large per-tensor weight is read in chunks (the same codes), its
            # codes spilled to disk when streaming (onnxparam.quant._stream)
            qt = quantize_chunked(array, _quantizer, _axis)
            if qt is None:
                qt = spill_codes(_quantizer.quantize(array, _axis))
        except QuantizationError as e:
            hint = ""
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                hint = (f"; it is no weight to quantize: leave it float with --exclude '^{re.escape(_path)}$' "
                        "(onnxparam quantize) or a ParamGroup without it")
            raise QuantizationError(f"cannot quantize {_path!r} {list(array.shape)}: {e}{hint}") from e
        qt.float_dtype = base.dtype  # dequantized back to the param's own float dtype (F16 stays F16)
        return qt.to_tensor()

    init.scheme = quantizer.scheme  # what _scheme_of reports before the value exists
    cell = _Lazy(init, param.lazy_device(), _shape_or_none(param), DType.QFloat, False)
    new = Param(param.id, cell=cell, require_grad=False, mapper=param._mapper, adapter=param.adapter())
    if param.is_initialized():
        new.base()  # an initialized param stays initialized (and a bad scheme raises here)
    return new


def _scheme_of(param: Param):
    """The scheme of a quantized param, without running a lazy init (``None`` if unknown)."""
    if param.is_initialized():
        quant = param.base()._quant
        return None if quant is None else quant.scheme
    return getattr(getattr(param._cell, "init", None), "scheme", None)


def _already_quantized(module, quantizer: Quantizer, group) -> list:
    """``path (scheme)`` of every ``QFloat`` param :func:`quantize_weights` would otherwise
    quantize (same rank / LoRA / group rules as a float param)."""
    from ..core.module import named_params

    found = []
    for path, param in named_params(module):
        if ".lora." in path or param.lazy_dtype() is not DType.QFloat:
            continue
        try:
            rank = len(param.lazy_shape())
        except ValueError:
            rank = param.base().ndim
        if rank < quantizer.min_rank or (group is not None and not group.matches(param.id, path)):
            continue
        scheme = _scheme_of(param)
        found.append(f"{path} ({scheme.describe() if scheme is not None else 'scheme not known until loaded'})")
    return found


def _shape_or_none(param: Param):
    try:
        return tuple(param.lazy_shape())
    except ValueError:
        return None


def quantize_weights(module, quantizer: Quantizer, group=None, weights_only: bool | None = None,
                     form_overhead: bool = False):
    """A copy of ``module`` whose weights are quantized by ``quantizer`` (module docstring).

    Args:
        module: any :class:`~onnxparam.Module`.
        quantizer: the :class:`Quantizer`.
        group: a :class:`~onnxparam.ParamGroup`; only matching params are quantized.
        weights_only: leave float every param of an imported ONNX graph that is not the weight
            of an op with an integer or weight-only kernel (:mod:`onnxparam.quant._roles`:
            MatMul / Gemm ``B``, Conv / ConvTranspose ``W``, embedding ``Gather`` tables), so
            constants feeding arithmetic, biases, norm scales, position embeddings and class
            tokens keep their exact values. Default: ``True`` without a ``group`` (the group
            names the params to quantize, whatever their role), else ``False``.

        form_overhead: count, for a param of an imported graph, the bytes its QDQ export form
            adds (nodes, value infos, metadata: :data:`DYNAMIC_FORM_BYTES`,
            :data:`DEQUANTIZE_FORM_BYTES`) in the size rule below (``onnxparam quantize`` to an
            ``.onnx`` does, so tiny weights stay float and the file does not grow).

    Never bigger: a param whose quantized form (codes + scales: :func:`quantized_form_bytes`,
    plus the form's nodes with ``form_overhead``) is not smaller than its float bytes stays
    float. Why each param stayed float is in :func:`kept_float` of the result (``{path: reason}``).

    Raises:
        QuantizationError: when a weight cannot be quantized with the scheme (e.g. a block
            size that does not divide its shape), naming the param's path: at once for
            initialized params, at the first use of the value for lazy ones; or, at once, when
            a param it would quantize is already quantized (its path and scheme are named).
    """
    from ..core.module import rebuild

    if not isinstance(quantizer, Quantizer):
        raise QuantizationError(f"quantize_weights takes a Quantizer, found {type(quantizer).__name__}")

    already = _already_quantized(module, quantizer, group)
    if already:
        raise QuantizationError(
            f"already quantized: {', '.join(already)}; quantizing them again with "
            f"{quantizer.scheme.describe()} would be ignored (their float values are gone). Quantize the "
            "float module instead, or pass a group that leaves them out")

    skipped = []
    axes = channel_axes(module) if quantizer.per_channel else {}
    if weights_only is None:
        weights_only = group is None
    roles, overheads = graph_facts(module, quantizer)
    if not form_overhead:
        overheads = {}
    kept = {}

    def fn(path: str, param: Param) -> Param:
        if not is_weight(path, param, quantizer):
            return param
        if group is not None and not group.matches(param.id, path):
            return param
        if weights_only and path in roles:
            kept[path] = f"{roles[path]}; not a weight of an op with an integer kernel ({_include_hint(path)})"
            return param
        shape = _shape_or_none(param)
        if shape is not None and not _blocks_divide(shape, quantizer.scheme):
            skipped.append(f"{path} {list(shape)}")
            return param
        if shape is not None:
            axis = axes.get(path) if len(shape) >= 2 else None  # NOTE: a 1-D param is quantized per tensor
            if quantizer.per_channel and axis is None and len(shape) >= 2:
                axis = 1 if len(shape) == 2 else 0
            q_bytes = quantized_form_bytes(shape, quantizer, axis) + overheads.get(path, 0)
            f_bytes = int(np.prod(shape, dtype=np.int64)) * param.lazy_dtype().itemsize
            if q_bytes >= f_bytes:
                extra = " and the nodes its form adds" if overheads.get(path) else ""
                kept[path] = (f"not smaller quantized: {q_bytes:,} bytes (codes + scales{extra}) vs {f_bytes:,} "
                              "float bytes")
                return param
        return quantize_param(param, quantizer, path, axes.get(path) if shape is None or len(shape) >= 2 else None)

    result = rebuild(module, fn)
    object.__setattr__(result, KEPT_FLOAT_ATTR, dict(kept))
    if skipped:
        block = list(quantizer.scheme.block.size.dims)
        warnings.warn(f"left float: {', '.join(skipped)}: not a whole number of {block} blocks (Burn's MinMax needs "
                      "every axis to divide evenly; Burn would panic)", QuantizationWarning, stacklevel=3)
    return result


KEPT_FLOAT_ATTR = "_onnxparam_kept_float"
"""Private module attribute: ``{path: reason}`` of the params :func:`quantize_weights` left float."""

DYNAMIC_FORM_BYTES = 1152
"""Bytes an exported 8-bit ``MatMul`` / ``Gemm`` weight adds besides its codes and scales: the
``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` nodes, their value infos and the scheme
metadata (measured on a torch-exported graph: 800 + 150 + 150 bytes)."""

DEQUANTIZE_FORM_BYTES = 320
"""Bytes an exported weight-only ``DequantizeLinear`` adds besides codes and scales (node, value
info, scale initializer header, scheme metadata)."""


def kept_float(module) -> dict:
    """``{param path: reason}`` of the params :func:`quantize_weights` (the call that made
    ``module``) left float: not a weight of an op with an integer kernel, or not smaller
    quantized. ``{}`` for a module not made by ``quantize_weights``."""
    return dict(getattr(module, KEPT_FLOAT_ATTR, None) or {})


def _include_hint(path: str) -> str:
    import re

    return f"--include '^{re.escape(path)}$' quantizes it"


def quantized_form_bytes(shape: tuple, quantizer: Quantizer, axis: int | None = None) -> int:
    """Bytes of a ``shape`` weight quantized by ``quantizer`` as ONNX stores it: codes (8 bits
    for Q8 / Q2, 4 for Q4), one float32 scale per tensor / output channel (``axis``, with
    ``per_channel``) / block."""
    numel = int(np.prod(shape, dtype=np.int64))
    bits = 4 if quantizer.scheme.value.name.startswith("Q4") else 8
    codes = (numel * bits + 7) // 8
    if quantizer.per_channel and axis is not None and len(shape) >= 2:
        scales = int(shape[axis % len(shape)])
    elif quantizer.scheme.block is not None and len(shape):
        extents = quantizer.scheme.block.size.to_dim_vec(len(shape))
        scales = max(1, numel // max(1, int(np.prod(extents, dtype=np.int64))))
    else:
        scales = 1
    return codes + 4 * scales


def graph_facts(module, quantizer: Quantizer) -> tuple:
    """``(roles, overheads)`` over the imported ONNX graphs in ``module``: ``roles`` ``{path:
    reason}`` of params that are not weights (:func:`onnxparam.quant._roles.graph_roles`),
    ``overheads`` ``{path: bytes}`` the export form of each weight adds (:data:`DYNAMIC_FORM_BYTES`
    for an 8-bit MatMul / Gemm ``B``, else :data:`DEQUANTIZE_FORM_BYTES`). Empty for modules
    without an imported graph."""
    from ..core.module import named_modules
    from ._roles import graph_roles

    roles, overheads = {}, {}
    eight = not quantizer.scheme.value.name.startswith("Q4")
    for prefix, sub in named_modules(module):
        source = getattr(sub, "_source", None)
        if source is None or not hasattr(source, "names") or not hasattr(source, "loaded"):
            continue
        base = f"{prefix}." if prefix else ""
        graph = source.loaded.model.graph
        cached = source.cache.get("quant.roles") if isinstance(getattr(source, "cache", None), dict) else None
        if cached is None:
            cached = graph_roles(graph, source.names)
            if isinstance(getattr(source, "cache", None), dict):
                source.cache["quant.roles"] = cached
        roles.update({base + path: reason for path, reason in cached.items()})
        matmul_b = {node.inputs[1].name for node in graph.all_nodes()
                    if node.op_type in ("MatMul", "Gemm") and len(node.inputs) > 1 and node.inputs[1] is not None}
        for path, name in source.names.items():
            overheads[base + path] = DYNAMIC_FORM_BYTES if eight and name in matmul_b else DEQUANTIZE_FORM_BYTES
    return roles, overheads


def onnx_only_weights(module, quantizer: Quantizer, group=None) -> list:
    """The weights :func:`quantize_weights` would quantize as **ONNX per-axis** tensors, which a
    burnpack file cannot store (checked before any value is quantized, from shapes alone).

    With :attr:`Quantizer.per_channel`, a weight's per-channel block is the whole tensor but 1 on
    its channel axis (:func:`channel_axes`); Burn's block extents are at most 255 (``docs/burnpack.md``
    §1.3), so a weight with another axis over 255 is ONNX-only
    (:func:`~onnxparam.core.tensor.quantize_per_axis`).

    Returns:
        ``[(path, shape, axis, extents)]``, ``[]`` without ``per_channel`` or when every weight fits.
    """
    from ..core.tensor import per_axis_block

    if not quantizer.per_channel:
        return []
    axes = channel_axes(module)
    found = []
    for path, param in module.named_params():
        if not is_weight(path, param, quantizer) or (group is not None and not group.matches(param.id, path)):
            continue
        shape = _shape_or_none(param)
        if not shape or len(shape) < 2:  # NOTE: a 1-D param is quantized per tensor (Quantizer.quantize)
            continue
        axis = axes.get(path)
        axis = (1 if len(shape) == 2 else 0) if axis is None else axis % len(shape)  # Quantizer.quantize's default
        extents = per_axis_block(shape, axis)
        if any(e > 255 for e in extents) or len(extents) > 5:
            found.append((path, shape, axis, extents))
    return found


def _blocks_divide(shape: tuple, scheme: QuantScheme) -> bool:
    if scheme.block is None:
        return True
    extents = scheme.block.size.to_dim_vec(len(shape))
    return len(scheme.block.size.dims) <= len(shape) and all(d % b == 0 for d, b in zip(shape, extents))


def channel_axes(module) -> dict:
    """``{param path: output-channel axis}`` of the weights of ``module`` whose layer is known:
    ``Conv`` 0, ``ConvTranspose`` 1 (ONNX operator spec: ConvTranspose, ``W`` is
    ``[C_in, C_out/group, k...]``), ``MatMul`` B / Linear ``[d_in, d_out]`` 1 (the last axis),
    ``Gemm`` B 1, or 0 with ``transB=1``. From the class names of ``onnxparam.nn`` modules and the
    nodes of imported ONNX graphs; other weights get :meth:`Quantizer.quantize`'s default."""
    from ..core.module import named_modules

    axes = {}
    for prefix, sub in named_modules(module):
        base = f"{prefix}." if prefix else ""
        source = getattr(sub, "_source", None)
        if source is not None and hasattr(source, "names") and hasattr(source, "loaded"):
            by_name = {name: path for path, name in source.names.items()}
            for node in source.loaded.model.graph.all_nodes():
                if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or node.inputs[1] is None:
                    continue
                path = by_name.get(node.inputs[1].name)
                axis = _node_axis(node)
                if path is not None and axis is not None:
                    axes.setdefault(base + path, axis)
            continue
        kind = type(sub).__name__
        if "weight" in getattr(sub, "__dict__", {}):
            if kind.startswith("ConvTranspose"):
                axes[base + "weight"] = 1
            elif kind.startswith("Conv"):
                axes[base + "weight"] = 0
            elif kind == "Linear":
                axes[base + "weight"] = 1
    return axes


def _node_axis(node) -> int | None:
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "MatMul":
        return -1
    if node.op_type == "Gemm":
        attr = node.attributes.get("transB")
        return 0 if attr is not None and attr.value == 1 else 1
    return None
