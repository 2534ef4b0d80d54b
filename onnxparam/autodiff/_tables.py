"""Which float weights of an imported model are tables rather than trainable weights.

An exporter writes everything a PyTorch module held (parameters *and* buffers: a rotary
frequency table, a causal mask, a position table) as initializers or ``Constant`` nodes, and
the importer makes every float one a param. Training those changes what PyTorch never trained.
:func:`find_tables` recognizes them from the graph alone (what consumes them), so the importer
freezes them by default (``OnnxModule.onnx_tables`` lists them with the reason; unfreeze with
``module.unfreeze_group(ParamGroup.from_paths(module.onnx_tables))``). The rules:

0. **the file's marks** first: torch dynamo writes
   ``pkg.torch.export.graph_signature.InputSpec.kind`` on the initializers of PyTorch's
   parameters and buffers. At every rank, ``PARAMETER`` stays trainable whatever its values
   (a learned position table initialised with sinusoids; the mark does not record
   ``requires_grad=False``, so a frozen ``nn.Parameter`` trains too) and ``BUFFER`` (or another
   kind that is not a parameter) is frozen, with that reason (:data:`BUFFER`). Rules 1-5 apply
   only to unmarked values: every weight of a TorchScript (or other exporter's) file, and the
   values dynamo's optimizer folded (``val_N``, ``embedding``: ``folded_from`` metadata only).
   An unmarked float initializer of a dynamo file that rules 1-5 leave trainable is frozen
   too (:data:`EXPORTER_CONSTANT`) unless it may hold a parameter's value: named as one of the
   parameters the file's graph signature lists (``pkg.torch.export.ExportedProgram.graph_signature``),
   folded from one, or without a ``folded_from`` record at all (the optimizer's rewrites, such as
   a BatchNormalization fused into its Conv, keep none): the zeros an RNN starts from
   (``torch.zeros`` folded into ``val_10``, recorded) are no weight, a weight transposed or
   concatenated by the optimizer is.

1. **periodic encodings**: every path on which the weight's value meets the model's float
   activations (values computed from a float graph input or an embedding lookup of the
   inputs) passes through ``Sin`` / ``Cos``
   first, and such a meeting exists: a frequency table applied to positions (rotary
   embeddings' ``inv_freq``, sinusoidal position tables built in the graph). A learned
   frequency multiplied with the *data* before ``Sin`` meets the activations raw, so it stays
   trainable;
2. **masks**: a tensor holding ``-inf``, ``NaN`` or only ``0`` and one fill value ``<= -1e4``
   (attention masks, ``finfo.min`` fills);
3. **fill constants**: a ``Constant`` node's value with one element equal to 0 or 1 (the
   fill values exporters write inline, e.g. ``where(mask, x, 0)``, ``expand(1, shape)``;
   PyTorch parameters become initializers). Other one-element constants stay trainable.
4. **windows and rotary caches**: a tensor used only as ``STFT``'s window (``torch.stft``'s
   window is a fresh ``hann_window`` or a buffer, never a parameter) or only as a
   ``RotaryEmbedding``'s cos / sin cache (``ai.onnx`` or ``com.microsoft``: the rotary
   tables PyTorch models hold as buffers), or only as a ``BatchNormalization``'s running mean /
   variance (inputs 3 and 4, inference or training form: PyTorch's buffers).

5. **sinusoidal position tables** (:func:`is_sinusoid_table`): a weight added to or gathered into
   the activations whose values *are* a sinusoidal position encoding — row ``t`` (position ``t``,
   or column ``t`` in the transposed layout) holds ``sin(w_c t + phi_c)`` with ``phi_c`` in
   ``{0, pi/2}``: row 0 is all zeros and ones, and every channel obeys the sinusoid recurrence
   ``v[t+1] + v[t-1] = 2 cos(w_c) v[t]`` (all-zero padding rows aside). The graph cannot tell
   such a table from a learned position embedding (ViT's ``pos_embed`` is an ``Add`` of a
   parameter too); its values can: a trained table never satisfies the recurrence. Whisper's
   encoder (``embed_positions``, a frozen parameter), fairseq / Marian / DistilBERT's sinusoidal
   embeddings (Vaswani et al. 2017, section 3.5, interleaved or ``[sin | cos]``).

6. **exporters' scalar constants** (:func:`find_scalar_constants`; 0-d float initializers,
   which import as params since a scalar ``nn.Parameter`` is written as one): the file's own
   evidence first: the dynamo exporter marks parameters and buffers with
   ``pkg.torch.export.graph_signature.InputSpec.kind`` metadata (``PARAMETER``: trainable;
   ``BUFFER``: frozen). Its unmarked constants (``val_3``, the ``clone`` of a
   ``torch.tensor(0.1)`` literal) are no weights at all
   (:func:`onnxparam.onnx_io._weights.marked_constants`), except one its optimizer folded from
   a value that may have been a parameter (``pkg.onnxscript.optimizer.folded_from``): a doubt,
   frozen here with the sources in the reason. Without marks (TorchScript, jax2tf), an
   exporter's name (``val_N``, ``onnx::Mul_12``, ``Const_4:0`` ...: anything not an identifier
   path as PyTorch names parameters) or a use only as ``Pow``'s exponent freezes it; a
   state-dict-like name (``pre``, ``blk.alpha``) stays trainable (TorchScript does not tell a
   scalar buffer from a parameter).

Layer: graph analysis on ``onnx_ir`` only (the importer in :mod:`onnxparam.onnx_io` calls it).
"""

from __future__ import annotations

import re
from typing import Optional

import ml_dtypes
import numpy as np
import onnx_ir as ir

__all__ = ["find_tables", "find_scalar_constants", "is_marked_parameter", "is_generated_name", "SCALAR_BUFFER",
           "SCALAR_FOLDED", "SCALAR_GENERATED", "BUFFER", "EXPORTER_CONSTANT", "marked_kind",
           "parameter_targets", "SCALAR_EXPONENT", "PERIODIC", "MASK", "CONSTANT_SCALAR", "RUNNING_STATS", "WINDOW", "ROTARY_CACHE",
           "SINUSOID", "is_sinusoid_table"]

PERIODIC = "reaches the activations only through Sin/Cos (a frequency / position table)"
MASK = "a mask: holds -inf / NaN or only 0 and a large negative fill value"
CONSTANT_SCALAR = "a one-element Constant of the graph equal to 0 or 1 (a fill value, not a weight)"
RUNNING_STATS = ("a BatchNormalization running mean / variance (a buffer in PyTorch: inference statistics, which "
                 "the training form updates without a gradient; an optimizer step could make a variance negative)")

WINDOW = "an STFT window (a fresh window or a buffer in PyTorch, not a parameter)"
ROTARY_CACHE = "a RotaryEmbedding cos / sin cache (a buffer in PyTorch)"
_ROTARY_CACHE_INPUTS = {"": (1, 2), "ai.onnx": (1, 2), "com.microsoft": (2, 3)}

_UNFREEZE = "; unfreeze with module.unfreeze_group(ParamGroup.from_paths([path])) if it is a weight"
SINUSOID = ("a sinusoidal position table (its values are sin / cos of the position: fixed in PyTorch, a buffer or a "
            "frozen parameter such as Whisper's embed_positions)" + _UNFREEZE)
SCALAR_BUFFER = "a 0-d PyTorch buffer (the exporter's InputSpec kind BUFFER), not a parameter" + _UNFREEZE
BUFFER = "a PyTorch buffer (the exporter's InputSpec kind BUFFER), not a parameter" + _UNFREEZE
EXPORTER_CONSTANT = ("a constant torch dynamo computed, not from any parameter of the file's graph signature "
                     "(folded from {})") + _UNFREEZE
SCALAR_FOLDED = ("a 0-d constant the exporter's optimizer folded from {} (not marked a parameter by the file's "
                 "InputSpec metadata; if one of those was a parameter, this is its folded value)") + _UNFREEZE
SCALAR_GENERATED = "a 0-d constant named as an exporter names its own ({}), not as PyTorch names parameters" + _UNFREEZE
SCALAR_EXPONENT = "a 0-d constant used only as Pow's exponent (a literal power such as x ** 2)" + _UNFREEZE
_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLDED = "pkg.onnxscript.optimizer.folded_from"
_STATE_DICT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
_GENERATED_NAME = re.compile(r"(_?val_\d+(_\d+)*|scalar_tensor_default(_\d+)?|_?tensor_constant\d+"
                             r"|(c_)?lifted_tensor_\d+|const_fold_opt__\d+|Constant_\d+.*|const(_\d+)?)")
"""Names exporters give their own constants: torch dynamo (``val_3``, ``scalar_tensor_default``,
``lifted_tensor_0``, ``_tensor_constant0``), tf2onnx (``const_fold_opt__12``), onnxparam's own
tracer (``const``, ``const_1``)."""

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_ENCODERS = frozenset({"Sin", "Cos"})
_STOPS = frozenset({"Shape", "Size", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And",
                    "Or", "Xor", "ArgMax", "ArgMin", "NonZero", "IsNaN", "IsInf", "Sign", "Floor", "Ceil", "Round",
                    "ConstantOfShape", "EyeLike", "Range", "RandomNormalLike", "RandomUniformLike"})
_MASK_CHECK_MAX = 1 << 24
_SINUSOID_USES = frozenset({"Add", "Gather", "Slice", "Concat", "Reshape", "Unsqueeze", "Squeeze", "Identity",
                            "Expand"})
"""Ops through which a position table reaches the activations (added, or rows selected)."""
_SINUSOID_MIN = (8, 4)
"""Smallest ``(positions, channels)`` checked: below that a recurrence fit proves nothing."""
_SINUSOID_TOL = 1e-3
"""Largest recurrence residual, relative to a channel's largest magnitude (float32 tables: ~1e-6; 8 ulps of
a coarser dtype when larger: float16's 8 * 2^-10)."""
_WEIGHT_INPUTS = {"MatMul": (1,), "Gemm": (1,), "Conv": (1,), "ConvTranspose": (1,), "Gather": (0,)}


def _is_float(v: Optional[ir.Value]) -> bool:
    return v is not None and v.dtype in _FLOATS


def _maybe_float(v: Optional[ir.Value]) -> bool:
    """Float, or untyped (an imported file need not type its intermediate values)."""
    return v is not None and (v.dtype is None or v.dtype in _FLOATS)


def _float_outputs(node: ir.Node) -> list:
    if node.op_type in _STOPS:
        return []
    if node.op_type == "Cast":
        to = node.attributes.get("to")
        to_float = to is not None and ir.DataType(int(to.value)) in _FLOATS
        return list(node.outputs) if _maybe_float(node.inputs[0]) and to_float else []
    return [o for o in node.outputs if _maybe_float(o)]


def _activations(graph: ir.Graph, nodes: list) -> set:
    """The model's float activations: values computed from a float graph input, or from an
    embedding lookup (a ``Gather`` / ``GatherElements`` whose indices come from the graph
    inputs' *values*; sizes read by ``Shape`` / ``Size`` do not count, so positions built by
    ``Range`` over a sequence length are not activations), through differentiable flow."""
    inputs = [v for v in graph.inputs if not v.is_initializer()]
    act = {v for v in inputs if _maybe_float(v)}
    data = set(inputs)  # values that depend on graph-input values
    for node in nodes:
        if node.op_type in ("Shape", "Size"):
            continue
        if any(v is not None and v in data for v in node.inputs):
            data.update(node.outputs)
            if node.op_type in ("Gather", "GatherElements", "GatherND") and len(node.inputs) > 1 \
                    and node.inputs[1] in data:
                act.update(_float_outputs(node))
        if any(v is not None and v in act for v in node.inputs):
            act.update(_float_outputs(node))
    return act


def _periodic(start: ir.Value, nodes: list, act: set) -> bool:
    """Rule 1 for the weight ``start``."""
    label = {start: "raw"}
    met = False
    for node in nodes:
        tainted = [label[v] for v in node.inputs if v is not None and v in label]
        if not tainted:
            continue
        if any(v is not None and v in act and v not in label for v in node.inputs):
            if "raw" in tainted:
                return False
            met = True
            continue  # an encoded table met the activations: its influence is accounted for
        out = "enc" if node.op_type in _ENCODERS else ("raw" if "raw" in tainted else "enc")
        for o in _float_outputs(node):
            label[o] = out
    return met


def _is_mask(tensor) -> bool:
    try:
        arr = np.asarray(tensor.numpy())
    except Exception:  # noqa: BLE001 - unreadable (external, lazy): not a table by this rule
        return False
    if arr.size == 0 or not np.issubdtype(arr.dtype, np.floating):
        return False
    if not np.all(np.isfinite(arr)):
        return True
    values = np.unique(arr)
    return len(values) <= 2 and values.min() <= -1e4 and (len(values) == 1 or values.max() == 0)


def _sinusoid_rows(table: np.ndarray, tol: float) -> bool:
    """Rule 5 with positions along axis 0 of the 2-D float64 ``table`` (``tol``: its dtype's)."""
    if not _zeros_and_ones(table[0]):
        return False  # NOTE: row 0 is position 0: sin -> 0, cos -> 1
    if not np.all(np.abs(table) <= 1 + tol):
        return False
    live = ~np.all(table == 0, axis=1)  # padding rows (fairseq zeroes the padding index's row)
    ok = live[2:] & live[1:-1] & live[:-2]
    if ok.sum() < _SINUSOID_MIN[0] - 2:
        return False
    prev, mid, nxt = table[:-2][ok], table[1:-1][ok], table[2:][ok]
    outer = prev + nxt
    k = (outer * mid).sum(axis=0) / np.maximum((mid * mid).sum(axis=0), np.finfo(np.float64).tiny)
    if np.any(np.abs(k) > 2 + 2 * tol) or np.all(k > 2 - 1e-3):
        return False  # 2 cos(w) lies in [-2, 2]; some channel must oscillate (not only ramps and constants)
    scale = np.maximum(np.abs(table).max(axis=0), 1e-12)
    return bool(np.all(np.abs(outer - k * mid).max(axis=0) <= tol * scale))


def is_sinusoid_table(array) -> bool:
    """True when ``array`` (float, 2-D after dropping leading 1-dims) is a sinusoidal position
    table, positions along either axis (rule 5 of this module: row 0 of zeros and ones, and the
    sinusoid recurrence ``v[t+1] + v[t-1] = 2 cos(w) v[t]`` per channel within
    :data:`_SINUSOID_TOL`), and some channel oscillating (``2 cos(w) < 2 - 1e-3``); at least :data:`_SINUSOID_MIN` ``(positions, channels)``."""
    a = np.asarray(array)
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or not _is_float_dtype(a.dtype):
        return False
    tol = max(_SINUSOID_TOL, 8 * float(ml_dtypes.finfo(a.dtype).eps))  # NOTE: float16 rounds to ~5e-4
    for t in (a, a.T):
        if t.shape[0] >= _SINUSOID_MIN[0] and t.shape[1] >= _SINUSOID_MIN[1] and np.all(np.isfinite(t[0])) \
                and _sinusoid_rows(np.asarray(t, np.float64), tol):
            return True
    return False


def _first_row_is_binary(tensor, shape: tuple) -> bool:
    """A cheap first look for rule 5 (reads one row or column, not the table)."""
    dims = [d for d in shape]
    while len(dims) > 2 and dims[0] == 1:
        dims = dims[1:]
    if len(dims) != 2 or min(dims) < _SINUSOID_MIN[1] or max(dims) < _SINUSOID_MIN[0]:
        return False
    try:
        a = np.asarray(tensor.numpy()).reshape(dims)
    except Exception:  # noqa: BLE001 - unreadable (external, lazy): not a table by this rule
        return False
    if not _is_float_dtype(a.dtype):
        return False
    return _zeros_and_ones(np.asarray(a[0], np.float64)) or _zeros_and_ones(np.asarray(a[:, 0], np.float64))


def _is_float_dtype(dtype) -> bool:
    """numpy's floats and ``ml_dtypes``' (bfloat16, float8 ...)."""
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


def _zeros_and_ones(row: np.ndarray) -> bool:
    """Position 0 of a sinusoidal table: ``sin(0) = 0`` and ``cos(0) = 1``, both present."""
    zero, one = np.abs(row) <= 1e-6, np.abs(row - 1) <= 1e-6
    return bool(np.all(zero | one) and zero.any() and one.any())


def find_tables(model: ir.Model, candidates) -> dict:
    """``{name: reason}`` for the float weights among ``candidates`` that are tables.

    Args:
        model: the model (its main graph is analysed; weights of subgraphs are left alone).
        candidates: ``(name, value, tensor, is_constant_node)`` per float weight: the
            initializer (or ``Constant`` output) value, its tensor, and whether a ``Constant``
            node holds it.
    """
    graph = model.graph
    nodes = list(graph)
    try:
        act = _activations(graph, nodes)
    except Exception:  # noqa: BLE001 - a graph the analysis cannot walk: nothing is a table
        return {}
    out = {}
    targets = parameter_targets(model)
    for name, value, tensor, constant_node in candidates:
        if value is None or value.graph is not graph and value.producer() is None:
            continue
        kind = marked_kind(value)
        if kind == "PARAMETER":
            continue  # rule 0: the file says torch trained it; no value heuristic overrides that
        if kind is not None:
            out[name] = BUFFER if kind == "BUFFER" else (
                f"a PyTorch {kind.lower()} (the exporter's InputSpec kind), not a parameter" + _UNFREEZE)
            continue
        shape = tuple(tensor.shape.numpy()) if tensor is not None else ()
        size = int(np.prod(shape)) if shape else 1
        if constant_node and size == 1 and tensor is not None:
            v = float(np.asarray(tensor.numpy()).reshape(-1)[0])
            if v in (0.0, 1.0):
                out[name] = CONSTANT_SCALAR
                continue
        uses = list(value.uses())
        if not uses:
            continue
        if all(node.op_type == "BatchNormalization" and index in (3, 4) for node, index in uses):
            out[name] = RUNNING_STATS
            continue
        if all(node.op_type == "STFT" and node.domain in ("", "ai.onnx") and index == 2 for node, index in uses):
            out[name] = WINDOW
            continue
        if all(node.op_type == "RotaryEmbedding" and index in _ROTARY_CACHE_INPUTS.get(node.domain, ())
               for node, index in uses):
            out[name] = ROTARY_CACHE
            continue
        weightish = any(index in _WEIGHT_INPUTS.get(node.op_type, ()) for node, index in uses)
        if not weightish and size <= _MASK_CHECK_MAX and tensor is not None and _is_mask(tensor):
            out[name] = MASK
            continue
        if _periodic(value, nodes, act):
            out[name] = PERIODIC
            continue
        if tensor is not None and all(node.op_type in _SINUSOID_USES for node, _ in uses) \
                and _first_row_is_binary(tensor, shape) and is_sinusoid_table(tensor.numpy().reshape(shape)):
            out[name] = SINUSOID
            continue
        if targets is not None and not constant_node and not _from_a_parameter(name, value, targets):
            out[name] = EXPORTER_CONSTANT.format(_marks(value).get(_FOLDED, "nothing"))
    return out


_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
_SIGNATURE_LINE = re.compile(r"\s*\w+: PARAMETER target='([^']*)'")


def parameter_targets(model: ir.Model) -> Optional[frozenset]:
    """The state-dict names of the PyTorch parameters a torch dynamo file lists in its graph
    signature metadata (``p_fc_weight: PARAMETER target='fc.weight'``), or ``None`` for a file
    without one (TorchScript, other exporters)."""
    text = model.graph.metadata_props.get(_SIGNATURE)
    if text is None:
        return None
    return frozenset(m.group(1) for m in map(_SIGNATURE_LINE.match, text.splitlines()) if m)


def _from_a_parameter(name: str, value: ir.Value, targets: frozenset) -> bool:
    """True when an unmarked initializer of a dynamo file may hold a parameter's value: it is
    named as one, or the exporter's optimizer folded it from one (``folded_from`` metadata).
    No record is no evidence (the optimizer's rewrites, e.g. a BatchNormalization fused into the
    Conv before it, write ``conv1.weight_bias`` from parameters without one), and neither is an
    unparsable record: both count as a parameter's value."""
    if name in targets:
        return True
    text = _marks(value).get(_FOLDED)
    if not text:
        return True
    try:
        import ast

        sources = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return True
    return not isinstance(sources, (list, tuple)) or any(str(n) in targets for n in sources)


def _marks(value: ir.Value) -> dict:
    try:
        return dict(value.metadata_props)
    except Exception:  # noqa: BLE001 - a value without metadata
        return {}


def is_generated_name(name: str) -> bool:
    """True when ``name`` is one an exporter gives its own constants (:data:`_GENERATED_NAME`)."""
    return _GENERATED_NAME.fullmatch(name) is not None


def marked_kind(value: ir.Value) -> Optional[str]:
    """The kind torch dynamo marked ``value`` with (``pkg.torch.export.graph_signature.InputSpec.kind``:
    ``PARAMETER``, ``BUFFER``, ``CONSTANT_TENSOR`` ...), or ``None`` when unmarked."""
    return _marks(value).get(_KIND)


def is_marked_parameter(value: ir.Value) -> bool:
    """True when the exporter marked ``value`` as a PyTorch parameter (InputSpec metadata)."""
    return _marks(value).get(_KIND) == "PARAMETER"


def find_scalar_constants(model: ir.Model, candidates) -> dict:
    """``{name: reason}`` for the 0-d float initializers among ``candidates`` that are an
    exporter's constants rather than parameters (rule 5 of the module docstring); every graph
    of the model (subgraphs too).

    Args:
        model: the model.
        candidates: ``(name, value)`` per 0-d float weight held by an initializer.
    """
    # NOTE: the exporter marks parameters and buffers where it writes them: the main graph
    marked = any(_KIND in _marks(v) for v in model.graph.initializers.values())
    out = {}
    for name, value in candidates:
        marks = _marks(value)
        kind = marks.get(_KIND)
        if kind == "PARAMETER":
            continue
        if kind is not None:
            out[name] = SCALAR_BUFFER if kind == "BUFFER" else (
                f"a 0-d PyTorch {kind.lower()} (the exporter's InputSpec kind), not a parameter" + _UNFREEZE)
            continue
        if marked:  # NOTE: only folded ones reach here (onnx_io._weights.marked_constants)
            out[name] = SCALAR_FOLDED.format(marks.get(_FOLDED, "?"))
            continue
        if _GENERATED_NAME.fullmatch(name) or not _STATE_DICT_NAME.fullmatch(name):
            out[name] = SCALAR_GENERATED.format(repr(name))
            continue
        uses = list(value.uses())
        if uses and all(node.op_type == "Pow" and index == 1 for node, index in uses):
            out[name] = SCALAR_EXPONENT
    return out
