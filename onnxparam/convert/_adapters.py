"""Tensor renaming, filtering, layout adapters and casts, as Burn's store has them.

The pieces (each usable alone; :mod:`onnxparam.convert._store` and
:func:`onnxparam.convert.convert` combine them):

* :class:`KeyRemapper` — an ordered list of ``(regex, replacement)`` rules applied to every
  tensor name, each rule to the result of the one before (Burn's ``burn-store`` ``KeyRemapper``).
  :func:`map_indices_contiguous` renumbers ``fc.0, fc.2, fc.4`` to ``fc.0, fc.1, fc.2`` (PyTorch
  ``nn.Sequential`` with parameter-free layers in between; Burn's function of the same name).
* :class:`PathFilter` — include / exclude regexes (Burn's ``PathFilter``).
* :class:`PyTorchAdapter` — PyTorch <-> Burn layouts (Burn's ``PyTorchToBurnAdapter`` and
  ``BurnToPyTorchAdapter``, ``burn-store/src/adapter.rs``): a ``Linear`` weight is ``(out, in)``
  in PyTorch and ``(in, out)`` in Burn, and a norm layer's ``weight``/``bias`` are Burn's
  ``gamma``/``beta``. As in Burn, the decision rests on the *type of the module that holds the
  param* in the target module (class name ``Linear``, ``BatchNorm``, ``LayerNorm``,
  ``GroupNorm``, or a subclass), never on the shape alone; explicit ``transpose`` regexes add
  tensors the module types cannot name (and serve conversions that have no module).
* :func:`cast_spec` / :func:`cast_snapshot` — float precision changes (``F32 <-> F16 / BF16``),
  round to nearest even (numpy / ``ml_dtypes``), applied lazily.

Everything here transforms :class:`~onnxparam.core.record.TensorSnapshot`\\ s lazily: a transpose or a
cast runs when that tensor's data is read, one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Optional, Sequence, Union

import numpy as np

from ..core.dtype import DType
from ..core.snapshot import TensorSnapshot
from ..core.tensor import TensorData
from ..formats._names import KeyRemapper, map_indices_contiguous

__all__ = [
    "KeyRemapper",
    "PathFilter",
    "ModuleAdapter",
    "PyTorchAdapter",
    "PyTorchToBurnAdapter",
    "BurnToPyTorchAdapter",
    "resolve_adapter",
    "map_indices_contiguous",
    "cast_spec",
    "cast_snapshot",
    "transpose_snapshot",
    "LINEAR_TYPES",
    "NORM_TYPES",
]

LINEAR_TYPES = ("Linear",)
"""Module class names whose rank-2 ``weight`` is transposed between PyTorch and Burn (Burn's
``module_names::LINEAR``)."""
NORM_TYPES = ("BatchNorm", "LayerNorm", "GroupNorm", "RmsNorm", "InstanceNorm")
"""Module class names whose ``weight``/``bias`` are Burn's ``gamma``/``beta`` (Burn's
``is_normalization_layer``: BatchNorm, LayerNorm, GroupNorm, RmsNorm; and InstanceNorm, whose
affine params PyTorch also calls ``weight``/``bias``)."""
PRELU_TYPES = ("PRelu",)
"""Module class names whose ``alpha`` is PyTorch's ``nn.PReLU.weight`` (same shape)."""
BATCH_NORM_TYPES = ("BatchNorm",)
"""Module class names whose PyTorch ``num_batches_tracked`` buffer has no Burn counterpart."""

_NORM_TO_BURN = {"weight": "gamma", "bias": "beta"}
_NORM_TO_PYTORCH = {"gamma": "weight", "beta": "bias"}
PYTORCH_ONLY_BUFFERS = ("num_batches_tracked",)


# -- names: one implementation, in the formats layer (re-exported here) ------------------------


Patterns = Union[str, Sequence[str], None]


def _compile_all(patterns: Patterns) -> Optional[tuple]:
    if patterns is None:
        return None
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    return tuple(re.compile(p) for p in patterns)


class PathFilter:
    """Which tensors take part: ``include`` (any matches; all when ``None``) minus ``exclude``.

    Patterns are regexes searched anywhere in the dotted path (``re.search``, as Rust's
    ``Regex::is_match`` in Burn's ``PathFilter``); anchor them with ``^``/``$`` for exact names.

    Raises:
        re.error: for an invalid pattern.
    """

    def __init__(self, include: Patterns = None, exclude: Patterns = None):
        self.include = _compile_all(include)
        self.exclude = _compile_all(exclude) or ()

    def __bool__(self) -> bool:
        return self.include is not None or bool(self.exclude)

    def matches(self, path: str) -> bool:
        if self.include is not None and not any(p.search(path) for p in self.include):
            return False
        return not any(p.search(path) for p in self.exclude)

    __call__ = matches


# -- layout adapters ----------------------------------------------------------------------------


class ModuleAdapter:
    """Translates between the module's (Burn's) names and layouts and a file's.

    ``module_types`` is the class-name lineage (``type(m).__mro__`` names) of the module that
    holds the param, or ``()`` when it is not held by a module (or there is no module).
    The base class is the identity (Burn's ``IdentityAdapter``).
    """

    name = "identity"

    def file_name(self, path: str, module_types: tuple) -> str:
        """The name the param at ``path`` has in the file."""
        return path

    def transposes(self, path: str, module_types: tuple, shape: tuple) -> bool:
        """Whether the tensor at ``path`` is stored transposed in the file (rank 2 only)."""
        return False

    def ignores(self, file_name: str, module_types: tuple) -> bool:
        """Whether a file tensor has no module counterpart by design (so is not 'unused')."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PyTorchAdapter(ModuleAdapter):
    """PyTorch's layouts and names <-> Burn's (Burn's ``PyTorchToBurnAdapter`` when loading,
    ``BurnToPyTorchAdapter`` when saving; the mapping is its own inverse).

    * A rank-2 ``weight`` of a module whose type is in ``linear_types`` (``Linear``) is
      transposed: PyTorch ``nn.Linear.weight`` is ``(d_output, d_input)``, Burn's ``Linear`` and
      ONNX ``MatMul`` take ``(d_input, d_output)``. So is any rank-2 tensor whose module path
      matches a ``transpose`` regex.
    * In a module whose type is in ``norm_types`` (``BatchNorm``, ``LayerNorm``, ``GroupNorm``,
      ``RmsNorm``, ``InstanceNorm``) Burn's ``gamma``/``beta`` are PyTorch's ``weight``/``bias``.
      ``running_mean`` and ``running_var`` keep their names; PyTorch's ``num_batches_tracked``
      (BatchNorm) has no Burn counterpart and is ignored when loading.
    * A ``PRelu``'s ``alpha`` is PyTorch's ``nn.PReLU.weight``.
    * Conv weights need nothing: both store ``(out, in/groups, k...)``; nor do transposed
      convolutions: both store ``(in, out/groups, k...)``.
    * Hugging Face's ``Conv1D`` (GPT-2, GPT-J ...) is *not* ``nn.Linear``: it stores
      ``(in, out)``, Burn's ``Linear`` layout already. Loading (:func:`~onnxparam.convert.apply_record`)
      checks each ``Linear`` weight against the file's evidence (the dim its bias follows, see
      :func:`onnxparam.convert._pytorch_layout.linear_layouts`) and refuses one the file shows in
      ``(in, out)``, naming the ``no_transpose`` that loads it: for GPT-2,
      ``PyTorchAdapter(no_transpose=r"\\.(c_attn|c_proj|c_fc)\\.weight$")``.

    Args:
        linear_types: class names treated as ``Linear``.
        norm_types: class names treated as normalization layers.
        transpose: extra regexes (searched in the module path) of rank-2 tensors to transpose.
        no_transpose: regexes (searched in the module path) of ``Linear`` weights stored
            ``(in, out)`` in the file (``Conv1D``): never transposed.
    """

    name = "pytorch"

    def __init__(self, linear_types: Sequence[str] = LINEAR_TYPES, norm_types: Sequence[str] = NORM_TYPES,
                 transpose: Patterns = None, no_transpose: Patterns = None):
        self.linear_types = frozenset(linear_types)
        self.norm_types = frozenset(norm_types)
        self.transpose = _compile_all(transpose) or ()
        self.no_transpose = _compile_all(no_transpose) or ()

    def _is(self, module_types: tuple, names: frozenset) -> bool:
        return any(t in names for t in module_types)

    def file_name(self, path: str, module_types: tuple) -> str:
        parent, _, leaf = path.rpartition(".")
        if leaf in _NORM_TO_PYTORCH and self._is(module_types, self.norm_types):
            leaf = _NORM_TO_PYTORCH[leaf]
            return f"{parent}.{leaf}" if parent else leaf
        if leaf == "alpha" and self._is(module_types, frozenset(PRELU_TYPES)):
            return f"{parent}.weight" if parent else "weight"
        return path

    def transposes(self, path: str, module_types: tuple, shape: tuple) -> bool:
        if len(shape) != 2 or any(p.search(path) for p in self.no_transpose):
            return False
        if path.rpartition(".")[2] == "weight" and self._is(module_types, self.linear_types):
            return True
        return any(p.search(path) for p in self.transpose)

    def forced(self, path: str) -> bool:
        """Whether an explicit ``transpose`` regex names ``path`` (the caller's decision, which
        no file evidence overrides)."""
        return any(p.search(path) for p in self.transpose)

    def restructure(self, module, tensors: Mapping, mapper_of) -> tuple[dict, dict]:
        """PyTorch's packed layers as Burn's params, by the type of each sub-module of ``module``.

        ``nn.LSTM`` / ``nn.GRU`` (gates packed in one matrix), ``nn.MultiheadAttention``
        (``in_proj_weight`` packs query, key and value) and ``nn.TransformerEncoderLayer`` /
        ``DecoderLayer`` have no one-to-one param mapping; for each sub-module that is an
        ``Lstm``, ``BiLstm``, ``Gru``, ``BiGru``, ``MultiHeadAttention`` or
        ``TransformerEncoderLayer`` / ``DecoderLayer``, the file tensors under its path go through
        :mod:`onnxparam.convert._torch_layers` (which reads them: these layers are loaded
        eagerly) and come back under Burn's names, in Burn's layouts (not transposed again).

        Args:
            module: the target module.
            tensors: file name (after remapping) -> ``TensorSnapshot``.
            mapper_of: ``sub-module -> (state subtree -> Burn record) or None``
                (:func:`onnxparam.convert._torch_layers.layer_mapper`; passed in, so this
                module does not import torch_layers, which uses this adapter).

        Returns:
            ``(mapped, consumed)``: Burn path -> snapshot, and file name -> the layer (``"path
            (Type)"``) it went into.

        Raises:
            RecordError: a layer's tensors are missing or mis-shaped (named by torch_layers).
        """
        from ..core.module import named_modules
        from ..core.record import as_snapshot

        mapped: dict = {}
        consumed: dict = {}
        claimed: list = []
        for path, sub in named_modules(module):
            if any(path == c or path.startswith(c + ".") for c in claimed):
                continue
            mapper = mapper_of(sub)
            if mapper is None:
                continue
            prefix = f"{path}." if path else ""
            names = [n for n in tensors if n.startswith(prefix)]
            if not names:
                continue
            claimed.append(path)
            subtree = {n[len(prefix):]: tensors[n].to_data().to_numpy() for n in names}
            for leaf, array in mapper(subtree).items():
                mapped[prefix + leaf] = as_snapshot(np.ascontiguousarray(array), prefix + leaf)
            consumed.update({n: f"{path or '<root>'} ({type(sub).__name__})" for n in names})
        return mapped, consumed

    def ignores(self, file_name: str, module_types: tuple) -> bool:
        return (file_name.rpartition(".")[2] in PYTORCH_ONLY_BUFFERS
                and self._is(module_types, frozenset(BATCH_NORM_TYPES) | self.norm_types))

    def __repr__(self) -> str:
        extra = f", transpose={[p.pattern for p in self.transpose]!r}" if self.transpose else ""
        if self.no_transpose:
            extra += f", no_transpose={[p.pattern for p in self.no_transpose]!r}"
        return f"PyTorchAdapter(linear_types={sorted(self.linear_types)!r}, norm_types={sorted(self.norm_types)!r}{extra})"


PyTorchToBurnAdapter = PyTorchAdapter
"""Burn's name for the adapter used when loading PyTorch weights (the same mapping)."""
BurnToPyTorchAdapter = PyTorchAdapter
"""Burn's name for the adapter used when saving for PyTorch (the same mapping)."""


def resolve_adapter(adapter: "ModuleAdapter | str | None") -> ModuleAdapter:
    """``None`` -> identity, ``"pytorch"`` -> :class:`PyTorchAdapter`, an adapter -> itself.

    Raises:
        RecordError: (a ``ValueError``) for an unknown name.
    """
    if adapter is None:
        return ModuleAdapter()
    if isinstance(adapter, ModuleAdapter):
        return adapter
    if isinstance(adapter, str) and adapter.lower() in ("pytorch", "torch"):
        return PyTorchAdapter()
    if isinstance(adapter, str) and adapter.lower() in ("identity", "none", "burn"):
        return ModuleAdapter()
    from ..core.errors import RecordError

    raise RecordError(f"unknown adapter {adapter!r}; use 'pytorch', None, or a ModuleAdapter")


# -- snapshot transforms (lazy) -----------------------------------------------------------------


def transpose_snapshot(snapshot: TensorSnapshot) -> TensorSnapshot:
    """A rank-2 snapshot with its axes swapped; the data is copied (contiguous) when read.

    Bit-exact for every dtype: it only moves elements.

    Raises:
        ValueError: for a tensor that is not rank 2, or a quantized one.
    """
    if len(snapshot.shape) != 2:
        raise ValueError(f"only rank-2 tensors are transposed; this one has shape {list(snapshot.shape)}")
    if snapshot.dtype is DType.QFloat:
        raise ValueError("a quantized (QFloat) tensor cannot be transposed without requantizing it")
    shape = (snapshot.shape[1], snapshot.shape[0])

    def load(_snap=snapshot, _shape=shape):
        data = _snap.to_data()
        array = np.ascontiguousarray(data.to_numpy().T)
        array.flags.writeable = False
        return TensorData(array, data.dtype, _shape)

    return TensorSnapshot(snapshot.dtype, shape, snapshot.param_id, load)


_FLOAT_CASTABLE = (DType.F64, DType.F32, DType.Flex32, DType.F16, DType.BF16)

_DTYPE_ALIASES = {
    "f64": DType.F64, "float64": DType.F64, "double": DType.F64,
    "f32": DType.F32, "float32": DType.F32, "float": DType.F32,
    "f16": DType.F16, "float16": DType.F16, "half": DType.F16,
    "bf16": DType.BF16, "bfloat16": DType.BF16,
    "flex32": DType.Flex32,
}


def _as_dtype(value) -> DType:
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = _DTYPE_ALIASES.get(value.lower())
        if found is not None:
            return found
        try:
            return DType(value)
        except ValueError:
            pass
    raise ValueError(f"{value!r} is not a float dtype; use DType.F16, 'f16', 'bf16', 'f32' or 'f64'")


def cast_spec(cast) -> Optional[dict]:
    """Normalize a cast argument to ``{source dtype: target dtype}`` (``None`` when no cast).

    ``cast`` is a float dtype (``DType.F16``, ``"f16"``, ``"bf16"`` ...: every float tensor
    becomes it) or a mapping ``{from: to}`` (``{"f32": "f16"}``: only those). Integer, bool and
    quantized tensors are never cast.

    Raises:
        ValueError: for a non-float or unknown dtype.
    """
    if cast is None:
        return None
    if isinstance(cast, Mapping):
        pairs = {_as_dtype(k): _as_dtype(v) for k, v in cast.items()}
    else:
        target = _as_dtype(cast)
        pairs = {d: target for d in _FLOAT_CASTABLE}
    for d in list(pairs) + list(pairs.values()):
        if d not in _FLOAT_CASTABLE:
            raise ValueError(f"only float tensors are cast; {d.name} is not a float dtype")
    return pairs


def cast_snapshot(snapshot: TensorSnapshot, target: DType, name: Optional[str] = None) -> TensorSnapshot:
    """The snapshot converted to the float dtype ``target`` when read (round to nearest even).

    Args:
        snapshot: a plain float tensor.
        target: the float dtype to cast to.
        name: the tensor's path, named in the warning below.

    Warns:
        PrecisionWarning: when the cast (run on read) turns finite values into infinities
            (a narrower range: F32 -> F16 beyond 65504, F64 -> F32, rounding up near the top of
            BF16's range); the message names the path, the count and the largest magnitude.
            NaN / inf already in the source are kept as they are and not reported.

    Raises:
        ValueError: when the snapshot is not a plain float tensor.
    """
    if snapshot.dtype not in _FLOAT_CASTABLE or target not in _FLOAT_CASTABLE:
        raise ValueError(f"cannot cast {snapshot.dtype.name} to {target.name}: only plain float tensors are cast")
    if snapshot.dtype is target:
        return snapshot

    def load(_snap=snapshot, _target=target, _name=name):
        data = _snap.to_data()
        source = data.to_numpy()
        # NOTE: numpy's own "overflow encountered in cast" RuntimeWarning names no tensor; it is
        # replaced by a PrecisionWarning that does.
        with np.errstate(over="ignore", invalid="ignore"):
            array = source.astype(_target.to_numpy())
        _warn_overflow(_name, _snap.dtype, _target, source, array)
        array.flags.writeable = False
        return TensorData(array, _target, tuple(data.shape))

    return TensorSnapshot(target, tuple(snapshot.shape), snapshot.param_id, load)


def _warn_overflow(name: Optional[str], source_dtype: DType, target: DType, source: np.ndarray, cast: np.ndarray) -> None:
    """Warn (:class:`~onnxparam.core.errors.PrecisionWarning`) when ``cast`` has infinities where
    ``source`` had finite values."""
    if cast.size == 0 or source.dtype.itemsize < cast.dtype.itemsize:
        return  # a widening cast cannot overflow
    overflow = np.isinf(cast) & np.isfinite(source)
    count = int(np.count_nonzero(overflow))
    if not count:
        return
    import warnings

    from ..core.errors import PrecisionWarning

    largest = float(np.abs(source[overflow].astype(np.float64)).max())
    import ml_dtypes  # NOTE: its finfo knows bfloat16 too

    limit = float(ml_dtypes.finfo(cast.dtype).max)
    where = f"'{name}'" if name is not None else "a tensor"
    warnings.warn(
        f"casting {where} from {source_dtype.name} to {target.name}: {count} of {source.size} finite values "
        f"overflow to inf (largest magnitude {largest:.6g}, {target.name} max {limit:.6g}); keep "
        f"{source_dtype.name} for this tensor or rescale it",
        PrecisionWarning,
        stacklevel=3,
    )
