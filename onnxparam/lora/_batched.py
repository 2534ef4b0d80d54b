"""Many LoRA adapters in one batch: the ``lora="batched"`` export mode and ``module(x, adapter_index=...)``.

A module's named adapters (``module.add_adapter(name, ...)``, :func:`onnxparam.lora.add_adapter`;
a module with unnamed adapters only counts as one adapter named ``"default"``) are **stacked** per
adapted weight ``W`` (``d_in -> d_out``)::

    <W>.lora.a_stack   (slots, d_in, r_max)    slot 0: zeros; slot i: adapter i's a, zero-padded
    <W>.lora.b_stack   (slots, r_max, d_out)   slot 0: zeros; slot i: scale_i * b_i, zero-padded

(``scale_i`` = ``alpha / r`` or ``alpha / sqrt(r)`` for rsLoRA, folded into ``b`` as in
``"inputs"`` exports and ``.onnx_adapter`` files; a smaller rank's padding columns / rows are zero,
so they add exactly nothing), and the graph takes an int64 input ``adapter_index`` of shape
``[batch]``: row ``n`` of the batch runs with slot ``adapter_index[n]``::

    y[n] = x[n] @ W + (x[n] @ a_stack[adapter_index[n]]) @ b_stack[adapter_index[n]]

**Index 0 (:data:`BASE_INDEX`) is "no adapter"**: its slot is zeros, so the branch adds exactly
``0.0`` and the row is the base model's. Adapter ``k`` (0-based, in the order of
``module.lora_adapters.names``, or of ``BatchedLora.names``) is index ``k + 1``; the model's
metadata (:data:`METADATA_KEY`, JSON) lists the names in index order, the capacity and each
target's input names, dims and rank. Slots ``N + 1 .. capacity`` (``BatchedLora(capacity=...)``)
are zeros: room for adapters added later without a new export. An index of length 1 applies to
every row (broadcast); any length but 1 and the batch (dim 0 of the first graph input) fails in
ONNX Runtime (``_Graph._checked``: ``Expand`` / ``Reshape`` of the index to the batch) and in
``module(x, adapter_index=...)`` (``LoraError``); an index outside ``[0, slots)`` fails in ONNX Runtime's ``Gather``:
a negative one where the index enters (``_Graph._not_negative``: ``Gather`` itself would read
``-1`` as the last slot), one past the slots in each target's ``Gather`` (a convolution target's
mask gathers the index from ``Range(0, slots)`` first, so it fails too).

The rows are the leading dim of each adapted ``MatMul`` / ``Gemm``'s input in batch-major order:
``[batch, ...]`` and the flattened ``[batch * seq, d]`` of a ``Gemm`` both work (the input is
viewed as ``[batch, -1, d_in]``). The pass first follows the batch through the graph
(:mod:`onnxparam.lora._batch_axis`, :meth:`_Target.rows_layout`): a ``MatMul`` input with the
batch on another axis (sequence-first ``[seq, batch, d]``) is transposed batch-first for the
branch and its delta back (:meth:`_Target.branch_moved`), one holding the batch as a factor of
an axis (``nn.MultiheadAttention``'s ``out_proj`` input ``[seq * batch, d]``) is viewed with the
batch as an axis of its own first (:meth:`_Target.branch_factored`); a ``Conv`` input folding the batch
(``[batch * T, C, L]``) is masked per ``[batch, T]`` block; sequence-first embedding ids
are transposed batch-first; an input, ids or (bias) output whose rows are not the batch's (rows
that mix batch elements, a value the analysis cannot follow, a subgraph's) is refused with a :class:`~onnxparam.core.errors.LoraError` naming the
weight, the node and where the batch axis was lost.

Graph, per target (``rows = Shape(adapter_index)``; ``Gather`` s at the top of the graph)::

    A = Gather(a_stack, adapter_index)            [batch, d_in, r]
    B = Gather(b_stack, adapter_index)            [batch, r, d_out]
    y = MatMul(x, W)                              (or Gemm; or MatMul(x, Transpose(W)))
    y + MatMul(MatMul(x, A), B)                   x: [batch, seq, d_in] (its dim 0 is the batch dim)
    y + Reshape(MatMul(MatMul(Reshape(x, [rows, -1, d_in]), A), B), Shape(y))    any other x

Targets: a weight used as ``MatMul``'s B, as ``Gemm``'s B (``transA=0``, ``transB`` matching the
adapter's layout; a ``Gemm``'s ``alpha`` multiplies ``B``), or through a 2-d ``Transpose`` into a
``MatMul`` (torch's exporters' ``nn.Linear``), and an embedding table read by ``Gather`` (axis 0;
row ``n`` adds ``a_stack[i_n, ids[n]] @ b_stack[i_n]``, ``a`` read at the looked-up ids only,
through ``GatherND``; PEFT's embedding LoRA); traced and imported graphs alike.

A **convolution** weight ``(d_out, in / group, *kernel)`` read by a ``Conv`` with a transposed
adapter (``a`` ``(in * prod(kernel), r)``, ``b`` ``(r, d_out)``: PEFT's conv LoRA, ``lora_A`` a
conv of every input channel with the weight's kernel, ``lora_B`` a 1x1 conv; for ``group > 1``
(grouped and depthwise convolutions) PEFT's ``lora_B`` has the base's ``groups``, here ``b``
zero outside each group's ``r / group`` rows, :func:`onnxparam.lora._adapters.conv_adapter_groups`;
an adapter whose ``b`` is not is refused, named: :func:`onnxparam.lora._conv_checks.grouped_b_problem`)
runs every slot's ``a`` as one conv of the node's own attributes but ``group`` (strides, pads,
``auto_pad``, dilations) and masks it to each row's slot (``h`` is small: ``slots * r`` channels).
Conv1d / Conv2d / Conv3d alike. A grouped conv whose windows PEFT's ``lora_A`` does not share (a
dilated kernel, an input a ``reflect`` / ``edge`` / ``wrap`` ``Pad`` fills) is refused
(:func:`onnxparam.lora._conv_checks.conv_node_problem`); with ``group == 1`` the branch is the
merged weight's::

    h = Conv(x, Reshape(Transpose(a_stack, [0, 2, 1]), [-1, in, *kernel]))   [batch, slots * r, *spatial]
    h = h * OneHot(adapter_index)                 (row n keeps its slot's r channels)
    y + Reshape(MatMul(Transpose(Reshape(b_stack, [-1, d_out])), h), Shape(y))

A **bias** ``(d_out,)`` with an adapter ``a`` ``(1, r)``, ``b`` ``(r, d_out)`` (PEFT's
``lora_bias``: ``a = [[1]]``, ``b = lora_B.bias``), added by an ``Add``, as a ``Gemm``'s C
(times ``beta``) or a ``Conv``'s B, adds ``a_stack[i_n] @ b_stack[i_n]`` to row ``n`` along the
channel axis (last; dim 1 for a ``Conv``; a ``Conv`` output folding the batch, ``[batch * m, d_out,
...]``, viewed ``[rows, m, d_out, ...]``: :meth:`_Target.bias_folded`). Any other use is refused with a
:class:`~onnxparam.core.errors.LoraError` naming the weight and the node.

Cost (ONNX Runtime 1.32, CPU, one thread; ``tools/bench.py lora-batched --threads 1``: width 512, 8
rows over 4 adapters of ranks 8 / 16, capacity 4; thread CPU time; 1-minute load 2-9 on 2 shared
cores; ``tools/bench_lora_floor.py`` times every case in one round robin, in a shuffled order and
hot, each call after itself). At 64 tokens per row a batched run takes about the time of one
single-adapter ``"inputs"`` run of the same batch (0.99-1.03) or of the 4 runs a server makes
splitting the rows by adapter (0.95-1.02): the same multiply-adds. At one token per row:

* batched / the 4 split ``"inputs"`` runs: 0.49-0.64 shuffled (target 0.5), 0.59-0.87 hot. It is
  (batched / one ``"inputs"`` run) x (one ``"inputs"`` run / the split runs), and the second factor
  is the base model's: one ``"inputs"`` run of the 8 rows / the 4 split runs measured 0.40-0.47
  shuffled, 0.48-0.66 hot, and the base alone at 8 rows / 4 base runs of 2 rows 0.40-0.45 shuffled,
  0.43-0.72 hot (the split runs repeat the weights' read and each node's fixed cost, nothing else):
  the target is met only when the base's floor leaves room for the batched run's own overhead.
* batched / one rank-16 ``"inputs"`` run: 1.20-1.38 (target 1.15; one blocked run of 40 calls per
  session measured 1.14 once, at load 3.3). The ``"inputs"`` run is 0.98-1.14x the base alone; both
  runs do the same multiply-adds (every row at the padded rank 16) but the batched one reads each
  row's factors (8 rows, 8 reads of ~0.6 MB at rank 16, beside the base's ~12.6 MB; 4 adapters'
  worth of distinct bytes, ~2.4 MB) and first copies them. The same graph with its ``Gather`` s
  replaced by inputs holding their outputs (the bench's ``no gathers`` case: not a usable export)
  measured 1.14-1.27: the gathers' copies are 1-14% (ONNX Runtime's profiler puts the 12 stack
  ``Gather`` s at ~310-630 us of kernel time, but under load its kernel sums exceed the run's own
  time: taking the copies out moves most of that time into the ``MatMul`` s, which then read the
  factors from memory themselves). No page faults and < 8 us of system time per run in steady state.

Measured alternatives, none kept (batched-form / the rank-16 ``"inputs"`` run at one token per row,
"beside" the exported form in the same round robin; load 2-6 unless said; ``tools/bench_lora_forms.py``
rewrites a batched export into each form, checks its rows and times it):

* Masking every slot (``x @ a`` of all slots, one ``MatMul`` with the flattened ``b`` stack): 1.44-1.70;
  again as one ``MatMul`` per side (every row by every slot's ``a``, ``[1, rows, d_in] @ a_stack``, then
  the masked ``[rows, slots * r]`` by ``b_stack`` viewed ``[slots * r, d_out]``) 1.39-1.43; as one-row
  products broadcast over ``[rows, slots]`` then that flattened ``b`` 1.47-1.49, or ``b`` per slot and a
  ``ReduceSum`` 1.38-1.42; beside 1.20-1.24. MLAS packs a non-constant B for a product of more than
  one row (in ONNX Runtime's profiler the flattened inner ``b``'s product, 80 x 2048, took ~555 us
  beside ~380 us for that target's ``b`` gather and per-row product); a one-row product
  (``[1, d_in] @ [d_in, r]``, the per-row form at one token) runs unpacked.
* Reading the four adapters' bytes without routing (timing only, not exact): one rank-64 adapter, the
  four adapters' factors side by side, on every row: 1.26-1.38 beside 1.22-1.31 (the same packing);
  each adapter's rows through its own factors held as separate inputs (no gather; rows split by
  hand, 13 nodes a target): 1.16-1.31 beside 1.22-1.36. Reading four adapters' factors where one
  run reads one adapter's is most of the gap, in every form measured.
* Grouping the rows by slot (each slot's factors read once, in place, no copy): rows gathered into a
  grid (``T`` the most rows of one slot; empty cells compute on row 0 and are never read back),
  ``MatMul`` broadcasting a stack over the grid, each row's delta gathered back.
  ``[slots, T, 1, d_in] @ [slots, 1, d_in, r]``: 1.16-1.22, 1.145-1.18 with its ~25 nodes building the
  grid taken out; ``[T, slots, seq, d_in] @ a_stack`` (a 2-d ``Gather`` of ``x``, a ``GatherND`` back,
  ~20 shared nodes on ``[rows]`` int64 values): 1.18-1.31 beside 1.22-1.38 in 14 round robins or blocks
  of 15 (1.19 beside 1.14 in the other). But the grid copies ``x`` and the delta, 3-6% slower at 64
  tokens per row (1.045-1.085 beside 1.01-1.03), and it computes every cell of ``T x slots``: capacity
  16 (17 slots, 4 used) 1.72-1.79 beside 1.17-1.26, every row on one adapter 1.39-1.81 beside 1.15-1.28,
  both 3.48 beside 1.32. Over the used slots only (``Unique``; the stacks gathered at those: a copy per
  used slot instead of per row, no cell for an unused slot): 1.17-1.40 beside 1.21-1.34 (better in 6
  runs of 9), capacity 16 1.16-1.43 beside 1.20-1.42, every row on one adapter 1.03-1.12 beside
  1.15-1.22, but 1.16-1.49 beside 1.15-1.33 with 5 of the 8 rows on one adapter (20 cells for 8 rows)
  and 1.02-1.10 beside 1.01-1.04 at 64 tokens. Choosing the grid per run with an ``If`` per target (on
  one token per row) costs about what it saves: 1.21-1.41 beside 1.22-1.38 (the grid alone 1.18-1.31);
  one ``If`` holding the whole graph after the index check twice (the weights stay outer-scope
  initializers) costs ~1% or nothing: 1.15-1.22 beside 1.21-1.26 (the grid alone 1.18-1.21), 0.96-1.03
  beside 1.01-1.04 at 64 tokens (its per-row branch). Taking the used-slot grid that way only when its
  cells are at most the rows plus the used slots (else the per-row branch): 1.20-1.23 beside 1.21-1.22,
  capacity 16 1.15-1.17 beside 1.20-1.22, every row on one adapter 1.10 beside 1.19-1.22, but 1.35
  beside 1.29-1.33 with 5 of the 8 rows on one adapter (the per-row branch, after the grid's ~22 nodes
  and the ``If``). Not built (it doubles the graph's nodes and moves them all into subgraphs, for a few
  points at best, short of 1.15).
* Each target's ``Gather`` s placed just before its first ``MatMul`` instead of at the top of the graph:
  1.23-1.26 and 1.35-1.42 beside 1.20-1.23 and 1.23-1.26 (two runs); no index check at all
  (``_checked`` and ``_not_negative`` taken out: unsafe): 0-2 points, within the noise; ONNX Runtime's
  graph optimization levels on both sides: ``all`` (the default) 1.21-1.25, ``extended`` 1.27-1.33,
  ``basic`` 1.26-1.27, ``all`` without the memory pattern 1.27-1.34; com.microsoft ``MoE`` (``k=1``, the
  index one-hot as its router): ~60 us a target at one token beside ~70 us, 4x the gathered form at
  64 tokens, and it takes each expert's weight as ``(out, in)``: the stacks transposed.

``module(x, adapter_index=...)`` adds ~10% to the session's run at
one token per row (a repeated call reuses the runner remembered with the stacks fed; only the index
is converted), was ~40% before that fast path.

Replacing adapters without a new session: the stacks are **graph inputs with initializer
defaults** (the exported values), with symbolic dims ``lora.slots`` and ``<W>.lora.rank``. Feed
new stacks by name (``session.run(None, {"x": x, "adapter_index": idx, "fc.weight.lora.a_stack":
a, ...})``), bind them as ``OrtValue`` s (``IOBinding.bind_ortvalue_input``: device-resident stacks too;
ONNX Runtime 1.32's ``bind_cpu_input`` refuses initializer inputs), or activate
a stacked ``.onnx_adapter`` file (:func:`write_batched_adapter`) with
``RunOptions.add_active_adapter`` (not under IO binding: ONNX Runtime ignores active adapters
there). A fed stack must cover every target (a target left out keeps its exported default).
:func:`check_batched_adapters` checks a set (a module, a file, or arrays) against an export.

In the runtime, ``module(x, adapter_index=idx)`` traces the same graph (index entries: ints,
adapter names, or ``None`` / ``"__base__"`` for the base model, as PEFT's ``adapter_names``) and
feeds the stacks on every call: one session serves any adapter values; the module's *active*
adapter does not apply in such a call (rows choose).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import LoraError
from ._ir import dims as _dims

__all__ = [
    "BATCHED_MODE", "INDEX_INPUT", "BASE_INDEX", "BASE_NAMES", "STACK_SUFFIXES", "METADATA_KEY", "SLOTS_DIM",
    "BatchedLora", "AdapterStacks", "named_adapters", "stack_adapters", "stack_names", "expand_batched",
    "batched_metadata", "index_array", "batched_options", "batched_tracing", "as_options",
]

BATCHED_MODE = "batched"
"""The LoRA mode of a batched export (``export_onnx(..., lora="batched")``)."""

INDEX_INPUT = "adapter_index"
"""The graph input choosing each row's adapter: int64, shape ``[batch]``."""

BASE_INDEX = 0
"""The index of "no adapter": its slot is zeros, the row is exactly the base model's."""

BASE_NAMES = (None, "__base__")
"""Entries of ``module(x, adapter_index=[...])`` that mean the base model (``"__base__"``: PEFT)."""

STACK_SUFFIXES = (".lora.a_stack", ".lora.b_stack")
"""Graph-input name suffixes of a target's stacks (after the weight's path, or an imported
model's own weight name)."""

METADATA_KEY = "onnxparam.lora.batched"
"""Model metadata of a batched export (JSON): ``index_input``, ``base_index``, ``adapters`` (names
in index order from 1), ``capacity``, ``slots`` and ``targets`` (``[{path, a, b, d_in, d_out, rank,
ranks, dtype, kind, shape}]``; ``kind``: ``"matrix"``, ``"conv"`` or ``"bias"``, ``shape``: the
adapted weight's)."""

SLOTS_DIM = "lora.slots"
"""The symbolic leading dim of every stack: ``capacity + 1``."""

RANK_DIM = "{path}.lora.rank"


@dataclass(frozen=True)
class BatchedLora:
    """Options of a batched export: ``export_onnx(m, path, x, lora=BatchedLora(capacity=8))``
    (``lora="batched"`` is ``BatchedLora()``).

    Args:
        names: the named adapters to stack, in index order (index ``k + 1`` for ``names[k]``);
            default: every named adapter of the module in its order.
        capacity: adapter slots (indices ``1 .. capacity``; default: the number of adapters):
            slots past the adapters are zeros, room for adapters fed later.
        index_name: the name of the index graph input.

    Raises:
        LoraError: (a ``ValueError``) a capacity below 1 or a duplicated name.
    """

    names: Optional[tuple] = None
    capacity: Optional[int] = None
    index_name: str = INDEX_INPUT

    def __post_init__(self):
        if self.names is not None:
            names = tuple(str(n) for n in self.names)
            if len(set(names)) != len(names):
                raise LoraError(f"BatchedLora.names has a duplicate: {list(names)}")
            object.__setattr__(self, "names", names)
        if self.capacity is not None and (isinstance(self.capacity, bool) or int(self.capacity) < 1):
            raise LoraError(f"BatchedLora.capacity must be an int >= 1; got {self.capacity!r}")


# contextvar: (BatchedLora, fed) for the trace being built; fed=True (runtime): the stacks are fed
# on every call, so their defaults are minimal zeros and no adapter value is read at trace time
_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("onnxparam_lora_batched", default=None)


@contextlib.contextmanager
def batched_options(options: BatchedLora, fed: bool = False):
    """Trace with ``options`` (the pass reads them)."""
    token = _OPTIONS.set((options, fed))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def batched_tracing() -> bool:
    """Whether :func:`batched_options` are set (a batched trace is being built)."""
    return _OPTIONS.get() is not None


def as_options(lora) -> Optional[BatchedLora]:
    """``lora`` as :class:`BatchedLora` when it asks for a batched export, else ``None``."""
    if isinstance(lora, BatchedLora):
        return lora
    if isinstance(lora, str) and lora == BATCHED_MODE:
        return BatchedLora()
    return None


# -- the adapter set --------------------------------------------------------------------------


def named_adapters(module, names: Optional[Sequence[str]] = None) -> list:
    """``[(name, {param path: LoraAdapter}), ...]``: ``module``'s named adapters (the active one
    with its current values), in set order or in ``names``' order; a module with unnamed adapters
    only gives ``[("default", its adapters)]``.

    Raises:
        LoraError: no adapter at all, or a name the module does not hold.
    """
    from ._adapters import DEFAULT_ADAPTER_NAME, _current_adapters, adapter_set

    sets = adapter_set(module)
    if sets.names:
        found = [(n, sets.adapters(n)) for n in sets.names]
    else:
        current = _current_adapters(module)
        found = [(DEFAULT_ADAPTER_NAME, current)] if current else []
    if not found:
        raise LoraError(f"lora='batched': {type(module).__name__} has no LoRA adapters to stack "
                        "(module.add_adapter(name, load_peft_adapter(module, folder)) first)")
    if names is None:
        return found
    by_name = dict(found)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise LoraError(f"lora='batched': no adapter named {', '.join(map(repr, missing))}; "
                        f"{type(module).__name__} holds {[n for n, _ in found]}")
    return [(n, by_name[n]) for n in names]


@dataclass
class StackTarget:
    """One adapted weight of an :class:`AdapterStacks`: ``a`` ``(slots, d_in, rank)``, ``b``
    ``(slots, rank, d_out)`` (``None`` until values are asked for), each adapter's rank.
    ``kind``: ``"matrix"`` (a linear map's or an embedding table's weight), ``"conv"`` (a
    convolution weight ``(d_out, in / groups, *kernel)``, ``d_in = in * prod(kernel)``) or ``"bias"``
    (a 1-d bias ``(d_out,)``, ``d_in = 1``: PEFT's ``lora_bias``); ``shape``: the weight's."""

    path: str
    d_in: int
    d_out: int
    rank: int
    transposed: bool
    dtype: DType
    ranks: dict
    a: Optional[np.ndarray] = None
    b: Optional[np.ndarray] = None
    kind: str = "matrix"
    shape: tuple = ()


@dataclass
class AdapterStacks:
    """Named adapters stacked per weight (module docstring): ``names[k]`` is index ``k + 1``."""

    names: tuple
    capacity: int
    targets: dict  # path -> StackTarget

    @property
    def slots(self) -> int:
        return self.capacity + 1

    def index_of(self, entry) -> int:
        """The index of an adapter name (``None`` / ``"__base__"``: :data:`BASE_INDEX`) or an int."""
        if entry is None or (isinstance(entry, str) and entry == "__base__"):
            return BASE_INDEX
        if isinstance(entry, str):
            try:
                return self.names.index(entry) + 1
            except ValueError:
                raise LoraError(f"adapter_index: no adapter named {entry!r}; the batch has {list(self.names)} "
                                f"(and None / '__base__' for the base model)") from None
        if isinstance(entry, (bool, np.bool_)) or not isinstance(entry, (int, np.integer)):
            raise LoraError(f"adapter_index entries are ints, adapter names or None; got "
                            f"{type(entry).__name__} {entry!r}")
        if not 0 <= int(entry) < self.slots:
            raise LoraError(f"adapter_index {int(entry)} is outside [0, {self.slots}): 0 is the base model, "
                            f"1..{len(self.names)} the adapters {list(self.names)}")
        return int(entry)


def _factor_dtype(dtype: DType) -> DType:
    return DType.F32 if dtype is DType.QFloat else dtype


def stack_adapters(module, options: Optional[BatchedLora] = None, *, values: bool = True) -> AdapterStacks:
    """``module``'s named adapters stacked per weight (module docstring), at each base's float
    dtype (float32 for a quantized base); ``values=False``: dims only (no factor is read).

    Raises:
        LoraError: an adapter that fits none of :attr:`StackTarget.kind` (module docstring), adapters
            of one weight that disagree on ``(d_in, d_out)`` or layout, more adapters than
            ``capacity``, an unknown name, or (``values``) a grouped convolution's ``b`` that is not
            block-diagonal (:func:`onnxparam.lora._conv_checks.grouped_b_problem`), named with
            its adapter and weight.
    """
    from ..trace.tracer import untraced
    from ..core.module import named_params

    options = options or BatchedLora()
    found = named_adapters(module, options.names)
    capacity = len(found) if options.capacity is None else int(options.capacity)
    if len(found) > capacity:
        raise LoraError(f"lora='batched': {len(found)} adapters ({[n for n, _ in found]}) do not fit capacity "
                        f"{capacity}")
    params = dict(named_params(module))
    targets: dict = {}
    problems = []
    for name, adapters in found:
        for path, adapter in adapters.items():
            base = params.get(path)
            if base is None:
                problems.append(f"adapter {name!r}: {path!r} is not a param of {type(module).__name__}")
                continue
            shape = tuple(base.lazy_shape())
            d_in, rank = (int(d) for d in adapter.a.lazy_shape())
            d_out = int(adapter.b.lazy_shape()[1])
            transposed = bool(adapter.transposed)
            kind = _target_kind(shape, d_in, d_out, transposed)
            if kind is None:
                problems.append(f"adapter {name!r} on {path!r} {list(shape)} with factors ({d_in}, {rank}) / ({rank}, "
                                f"{d_out}) transposed={transposed}: batched LoRA applies to a linear map's matrix "
                                f"({'(d_out, d_in)' if transposed else '(d_in, d_out)'}), a convolution weight "
                                "(d_out, in, *kernel) with a transposed adapter (d_in = in * prod(kernel)) or a 1-d "
                                "bias (d_out,) with d_in = 1 (lora_bias)")
                continue
            hit = targets.get(path)
            if hit is None:
                targets[path] = StackTarget(path, d_in, d_out, rank, transposed, _factor_dtype(base.lazy_dtype()),
                                            {name: rank}, kind=kind, shape=shape)
            elif (hit.d_in, hit.d_out, hit.transposed) != (d_in, d_out, transposed):
                problems.append(f"adapter {name!r} on {path!r} is ({d_in}, {d_out}) transposed={transposed}, "
                                f"another is ({hit.d_in}, {hit.d_out}) transposed={hit.transposed}")
            else:
                hit.rank = max(hit.rank, rank)
                hit.ranks[name] = rank
    if problems:
        raise LoraError("lora='batched': the adapters cannot be stacked: " + "; ".join(problems))
    stacks = AdapterStacks(tuple(n for n, _ in found), capacity, targets)
    if values:
        with untraced():
            _check_grouped_convs(found, targets)
            for target in targets.values():
                np_dtype = target.dtype.to_numpy()
                compute = np.float64 if target.dtype is DType.F64 else np.float32
                a = np.zeros((stacks.slots, target.d_in, target.rank), dtype=np_dtype)
                b = np.zeros((stacks.slots, target.rank, target.d_out), dtype=np_dtype)
                for k, (name, adapters) in enumerate(found):
                    adapter = adapters.get(target.path)
                    if adapter is None:
                        continue
                    r = adapter.rank
                    a[k + 1, :, :r] = np.asarray(adapter.a.val().to_numpy()).astype(compute).astype(np_dtype)
                    b[k + 1, :r, :] = (np.asarray(adapter.b.val().to_numpy()).astype(compute)
                                       * compute(adapter.scale)).astype(np_dtype)
                target.a, target.b = a, b
    return stacks


def _check_grouped_convs(found: list, targets: dict) -> None:
    """A grouped convolution target's ``b`` must be PEFT's grouped ``lora_B`` (block-diagonal:
    :func:`onnxparam.lora._conv_checks.grouped_b_problem`): the batched branch adds every entry
    of ``b``, a ``"keep"`` graph only its groups' blocks."""
    from ._adapters import conv_adapter_groups
    from ._conv_checks import grouped_b_problem

    problems = []
    for name, adapters in found:
        for path, adapter in adapters.items():
            t = targets[path]
            if t.kind == "conv" and conv_adapter_groups(t.shape, t.d_in) > 1:  # b read for grouped convs only
                problem = grouped_b_problem(np.asarray(adapter.b.val().to_numpy()), t.shape, t.d_in)
                if problem is not None:
                    problems.append(f"adapter {name!r} on {path!r} {list(t.shape)}: {problem}")
    if problems:
        raise LoraError("lora='batched': grouped convolution adapters must be PEFT's layout (lora_B a 1x1 conv with "
                        "the base's groups: b zero outside each group's block): " + "; ".join(problems))


def _target_kind(shape: tuple, d_in: int, d_out: int, transposed: bool) -> Optional[str]:
    """:attr:`StackTarget.kind` of a weight of ``shape`` with an adapter ``(d_in, r)`` /
    ``(r, d_out)``, or ``None`` when the adapter does not fit it."""
    from ._adapters import conv_adapter_groups

    if len(shape) == 2 and shape == ((d_out, d_in) if transposed else (d_in, d_out)):
        return "matrix"
    if len(shape) >= 3 and transposed and shape[0] == d_out and conv_adapter_groups(shape, d_in):
        return "conv"  # d_in = in * prod(kernel): groups = d_in / prod(shape[1:]) (PEFT's grouped conv LoRA)
    if len(shape) == 1 and shape[0] == d_out and d_in == 1:
        return "bias"
    return None


def stack_names(module, path: str) -> tuple:
    """The graph-input names of ``path``'s stacks: after an imported model's own weight name
    (``onnx::MatMul_7.lora.a_stack``), else after the path."""
    onnx_names = getattr(module, "onnx_names", None) or {}
    name = onnx_names.get(path, path)
    return tuple(f"{name}{suffix}" for suffix in STACK_SUFFIXES)


# -- the graph pass ---------------------------------------------------------------------------


class _Graph:
    """What the pass shares across the targets of one trace: the index input and its row count."""

    def __init__(self, tracer, options: BatchedLora):
        self.tracer = tracer
        self.options = options
        self._index = None
        self._rows = None
        self._layouts = None

    def analyse(self, none_values) -> None:
        """Follow the batch through the graph as traced (before any branch is added):
        :func:`onnxparam.lora._batch_axis.batch_layouts`; ``none_values``: the params."""
        from ._batch_axis import batch_layouts

        self._layouts = batch_layouts(self.tracer.graph, none_values)

    def layout(self, value: ir.Value):
        """Where the batch is in ``value`` (a :class:`~onnxparam.lora._batch_axis.Layout`), seen
        through the branches already added after it (``Add`` / ``Reshape`` nodes of this pass
        read the original value as input 0); ``None`` for a value the analysis did not reach (a
        subgraph's)."""
        from ._graph import LORA_NODE_KEY

        layouts = self._layouts or {}
        while id(value) not in layouts:
            producer = value.producer()
            if producer is None and (value.is_initializer() or value.const_value is not None):
                from ._batch_axis import NONE

                return NONE  # a weight or constant (a learned tensor): no batch in it
            if producer is None or LORA_NODE_KEY not in producer.metadata_props or not producer.inputs:
                return None
            value = producer.inputs[0]
        return layouts[id(value)]

    def batch_dim(self):
        for value in self.tracer.graph.inputs:
            if value.is_initializer() or value.const_value is not None:
                continue
            dims = _dims(value)
            if dims:
                return dims[0]
        return "batch"

    def index_dim(self):
        """The index's dim: the model's batch dim when symbolic; ``"adapter_rows"`` when the batch
        is a constant (an index of length 1 still applies to every row)."""
        batch = self.batch_dim()
        return batch if isinstance(batch, str) else "adapter_rows"

    def batch_input(self) -> Optional[ir.Value]:
        """The graph input whose dim 0 is the batch (:meth:`batch_dim`'s), or ``None``."""
        for value in self.tracer.graph.inputs:
            if value.is_initializer() or value.const_value is not None:
                continue
            if _dims(value):
                return value
        return None

    def index(self) -> ir.Value:
        """The index every target reads: the ``adapter_index`` input, checked against the batch
        (:meth:`_checked`)."""
        if self._index is None:
            name = self.options.index_name
            if name in self.tracer._names:
                raise LoraError(f"lora='batched': the index input name {name!r} is already used in the graph "
                                "(pass BatchedLora(index_name=...))")
            self.tracer._names.add(name)
            value = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([self.index_dim()]))
            self.tracer.graph.inputs.append(value)
            self._index = self._not_negative(self._checked(value))
        return self._index

    def _not_negative(self, index: ir.Value) -> ir.Value:
        """``index``, failing in ONNX Runtime for a negative entry (which every ``Gather`` would
        read counting from the last slot: ``-1`` is the last adapter, or a spare empty slot)::

            index + Gather([0], Min(index, 0) - 1)

        ``Gather`` of a 1-entry tensor takes only ``-1`` and ``0``: an entry ``>= 0`` reads it
        at ``-1`` (adding ``0``), a negative one at ``<= -2`` fails (``INT64_MIN`` wraps to
        ``INT64_MAX``: fails too). Once, where the index enters, for every target kind; four ops
        on ``[batch]`` int64 values per run."""
        tracer, i64 = self.tracer, ir.DataType.INT64
        rows = self.index_dim()
        zero = tracer.constant(np.asarray(0, dtype=np.int64), name="lora.batched.zero")._symbol.value
        one = tracer.constant(np.asarray(1, dtype=np.int64), name="lora.batched.one")._symbol.value
        only = tracer.constant(np.asarray([0], dtype=np.int64), name="lora.batched.start")._symbol.value
        nodes = [_new_node(tracer, "Min", [index, zero], i64, [rows], "/lora.batched/Min_index", "")]
        nodes.append(_new_node(tracer, "Sub", [nodes[-1].outputs[0], one], i64, [rows],
                               "/lora.batched/Sub_index", ""))
        nodes.append(_new_node(tracer, "Gather", [only, nodes[-1].outputs[0]], i64, [rows],
                               "/lora.batched/Gather_negative_index_refused", "", {"axis": 0}))
        nodes.append(_new_node(tracer, "Add", [index, nodes[-1].outputs[0]], i64, [rows],
                               "/lora.batched/Add_index", ""))
        _prepend(tracer.graph, nodes)
        return nodes[-1].outputs[0]

    def _checked(self, index: ir.Value) -> ir.Value:
        """``index``, failing in ONNX Runtime unless its length is 1 or the batch (dim 0 of
        :meth:`batch_input`), never read as a ``[batch * seq]`` layout::

            n = Shape(x)[0:1]                      (a constant for a static batch)
            Slice(Reshape(Expand(index, n), n), [0], Shape(index))

        ``Expand`` fails for a length that is neither 1 nor the batch (2 for a batch of 4),
        ``Reshape`` for a longer index than a batch of 1; ``Slice`` gives the index back (a
        length-1 index stays one entry). Five ops on ``[batch]`` int64 values, once per run."""
        tracer, i64 = self.tracer, ir.DataType.INT64
        source = self.batch_input()
        if source is None:
            return index
        rows = self.index_dim()
        batch = self.batch_dim()
        nodes = []
        if isinstance(batch, int):
            n = tracer.constant(np.asarray([batch], dtype=np.int64), name="lora.batched.batch")._symbol.value
        else:
            nodes.append(_new_node(tracer, "Shape", [source], i64, [1], "/lora.batched/Shape_batch", "",
                                   {"start": 0, "end": 1}))
            n = nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Expand", [index, n], i64, [batch], "/lora.batched/Expand_index", ""))
        nodes.append(_new_node(tracer, "Reshape", [nodes[-1].outputs[0], n], i64, [batch],
                               "/lora.batched/Reshape_index", ""))
        full = nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Shape", [index], i64, [1], "/lora.batched/Shape_index", ""))
        start = tracer.constant(np.asarray([0], dtype=np.int64), name="lora.batched.start")._symbol.value
        nodes.append(_new_node(tracer, "Slice", [full, start, nodes[-1].outputs[0]], i64, [rows],
                               "/lora.batched/Slice_index", ""))
        _prepend(tracer.graph, nodes)
        return nodes[-1].outputs[0]

    def first_stack(self, value: ir.Value) -> None:
        """Record a stack input: :meth:`mask` reads the slot count from the first one."""
        if getattr(self, "_first_stack", None) is None:
            self._first_stack = value

    def mask(self, dtype) -> ir.Value:
        """``[rows, slots, 1]`` at ``dtype``: ``1`` at each row's slot, else ``0`` (``OneHot`` of
        the index gathered from ``Range(0, slots)``: an index past the slots fails in ONNX
        Runtime's ``Gather``, as in the other targets; a negative one failed in :meth:`index`)."""
        masks = self.__dict__.setdefault("_masks", {})
        if dtype in masks:
            return masks[dtype]
        tracer, i64, f32 = self.tracer, ir.DataType.INT64, ir.DataType.FLOAT
        rows = self.index_dim()
        nodes = [_new_node(tracer, "Shape", [self._first_stack], i64, [1], "/lora.batched/Shape_slots", "",
                           {"end": 1})]
        slots = nodes[-1].outputs[0]
        # Gather(Range(0, slots), index): the index itself, but an entry past the slots fails in
        # ONNX Runtime as it does in every Gather target (OneHot alone would give such a row no
        # adapter, silently); a negative entry already failed where the index enters (index()).
        zero = tracer.constant(np.asarray(0, dtype=np.int64), name="lora.batched.zero")._symbol.value
        one = tracer.constant(np.asarray(1, dtype=np.int64), name="lora.batched.one")._symbol.value
        nodes.append(_new_node(tracer, "ReduceMax", [slots], i64, [], "/lora.batched/ReduceMax_slots", "",
                               {"keepdims": 0}))
        nodes.append(_new_node(tracer, "Range", [zero, nodes[-1].outputs[0], one], i64, [SLOTS_DIM],
                               "/lora.batched/Range_slots", ""))
        nodes.append(_new_node(tracer, "Gather", [nodes[-1].outputs[0], self.index()], i64, [rows],
                               "/lora.batched/Gather_index", "", {"axis": 0}))
        onoff = tracer.constant(np.asarray([0.0, 1.0], dtype=np.float32), name="lora.batched.onoff")._symbol.value
        nodes.append(_new_node(tracer, "OneHot", [nodes[-1].outputs[0], slots, onoff], f32, [rows, SLOTS_DIM],
                               "/lora.batched/OneHot", ""))
        if dtype != f32:
            nodes.append(_new_node(tracer, "Cast", [nodes[-1].outputs[0]], dtype, [rows, SLOTS_DIM],
                                   "/lora.batched/Cast_mask", "", {"to": int(dtype)}))
        axes = tracer.constant(np.asarray([2], dtype=np.int64), name="lora.batched.axis2")._symbol.value
        nodes.append(_new_node(tracer, "Unsqueeze", [nodes[-1].outputs[0], axes], dtype, [rows, SLOTS_DIM, 1],
                               "/lora.batched/Unsqueeze_mask", ""))
        _prepend(tracer.graph, nodes)
        masks[dtype] = nodes[-1].outputs[0]
        return masks[dtype]

    def by_slot(self) -> ir.Value:
        """``[0, slots, -1]``: a ``[rows, slots * r, L]`` tensor viewed ``[rows, slots, r * L]``."""
        if getattr(self, "_by_slot", None) is None:
            tracer, i64 = self.tracer, ir.DataType.INT64
            slots = _new_node(tracer, "Shape", [self._first_stack], i64, [1], "/lora.batched/Shape_slots", "",
                              {"end": 1})
            parts = [tracer.constant(np.asarray([0], dtype=np.int64), name="lora.batched.keep")._symbol.value,
                     slots.outputs[0],
                     tracer.constant(np.asarray([-1], dtype=np.int64), name="lora.batched.items")._symbol.value]
            node = _new_node(tracer, "Concat", parts, i64, [3], "/lora.batched/Concat_slots", "", {"axis": 0})
            _prepend(tracer.graph, [slots, node])
            self._by_slot = node.outputs[0]
        return self._by_slot

    def rows_by_items(self) -> ir.Value:
        """``[rows, -1]``: an id tensor viewed as one row of ids per batch row."""
        if getattr(self, "_rows_by_items", None) is None:
            tail = self.tracer.constant(np.asarray([-1], dtype=np.int64), name="lora.batched.items")._symbol.value
            node = _new_node(self.tracer, "Concat", [self.rows(), tail], ir.DataType.INT64, [2],
                             "/lora.batched/Concat_ids", "", {"axis": 0})
            _prepend(self.tracer.graph, [node])
            self._rows_by_items = node.outputs[0]
        return self._rows_by_items

    def rows(self) -> ir.Value:
        if self._rows is None:
            node = _new_node(self.tracer, "Shape", [self.index()], ir.DataType.INT64, [1], "/lora.batched/Shape", "")
            _prepend(self.tracer.graph, [node])
            self._rows = node.outputs[0]
        return self._rows


def _new_node(tracer, op: str, inputs: list, dtype, dims, label: str, path: str, attrs=None,
              attributes: Sequence = ()) -> ir.Node:
    from ._graph import LORA_NODE_KEY

    name = tracer.unique_name(label)
    attributes = list(attributes)
    for k, v in (attrs or {}).items():
        attributes.append(ir.AttrInt64s(k, v) if isinstance(v, list) else ir.AttrInt64(k, v))
    node = ir.Node("", op, inputs, attributes, name=name)
    out = node.outputs[0]
    out.name = tracer.unique_name(f"{name}_output_0")
    out.type = ir.TensorType(dtype)
    out.shape = ir.Shape(dims) if dims is not None else None
    node.metadata_props[LORA_NODE_KEY] = path
    return node


def _prepend(graph, nodes):
    from ._graph import _prepend as prepend

    prepend(graph, nodes)


class _Target:
    """The batched branch of one adapted weight at each of its uses."""

    def __init__(self, shared: _Graph, target: StackTarget, base: ir.Value, dtype: DType, names: tuple,
                 defaults: tuple):
        self.shared = shared
        self.tracer = shared.tracer
        self.target = target
        self.base = base
        self.dtype = ir.DataType(dtype.to_onnx())
        self.np_dtype = dtype.to_numpy()
        self.names = names
        self.defaults = defaults
        self._selected = None
        self._stacks = None
        self._scaled: dict = {}
        self._bias_rows: dict = {}
        self._conv_weights = None
        self._shape_in = None

    def stacks(self) -> list:
        """The target's two stack graph inputs ``(slots, d_in, r)`` / ``(slots, r, d_out)``."""
        if self._stacks is None:
            t, tracer = self.target, self.tracer
            rank = ir.SymbolicDim(RANK_DIM.format(path=t.path))
            slots = ir.SymbolicDim(SLOTS_DIM)
            stacks = []
            for name, dims, default in zip(self.names, ([slots, t.d_in, rank], [slots, rank, t.d_out]), self.defaults):
                if name in tracer._names:
                    raise LoraError(f"lora='batched': the stack input name {name!r} of {t.path!r} is already used "
                                    "in the graph")
                tracer._names.add(name)
                value = ir.Value(name=name, type=ir.TensorType(self.dtype), shape=ir.Shape(dims),
                                 const_value=ir.tensor(np.ascontiguousarray(default.astype(self.np_dtype, copy=False)),
                                                       name=name))
                tracer._constants.append(value)
                tracer.graph.inputs.append(value)
                stacks.append(value)
            self._stacks = stacks
            self.shared.first_stack(stacks[0])
        return self._stacks

    def selected(self) -> tuple:
        """``(A, B)``: the stacks gathered at the index, ``[batch, d_in, r]`` / ``[batch, r, d_out]``."""
        if self._selected is None:
            t, tracer = self.target, self.tracer
            rank = RANK_DIM.format(path=t.path)
            stacks = self.stacks()
            batch = self.shared.index_dim()
            index = self.shared.index()
            a = _new_node(tracer, "Gather", [stacks[0], index], self.dtype, [batch, t.d_in, rank],
                          f"/{t.path}.lora/Gather_a", t.path, {"axis": 0})
            b = _new_node(tracer, "Gather", [stacks[1], index], self.dtype, [batch, rank, t.d_out],
                          f"/{t.path}.lora/Gather_b", t.path, {"axis": 0})
            _prepend(tracer.graph, [a, b])
            self._selected = (a.outputs[0], b.outputs[0])
        return self._selected

    def scaled_b(self, coefficient: float) -> ir.Value:
        a, b = self.selected()
        if coefficient == 1.0:
            return b
        hit = self._scaled.get(coefficient)
        if hit is None:
            scale = self.tracer.constant(np.asarray(coefficient, dtype=self.np_dtype),
                                         name=f"{self.target.path}.lora.alpha")._symbol.value
            node = _new_node(self.tracer, "Mul", [b, scale], self.dtype, _dims(b), f"/{self.target.path}.lora/Mul",
                             self.target.path)
            _prepend(self.tracer.graph, [node])
            hit = self._scaled[coefficient] = node.outputs[0]
        return hit

    def shape_in(self) -> ir.Value:
        """``[rows, -1, d_in]``: the view of an input whose dim 0 is not (known to be) the batch."""
        if self._shape_in is None:
            tail = self.tracer.constant(np.asarray([-1, self.target.d_in], dtype=np.int64),
                                        name="lora.batched.view")._symbol.value
            node = _new_node(self.tracer, "Concat", [self.shared.rows(), tail], ir.DataType.INT64, [3],
                             f"/{self.target.path}.lora/Concat", self.target.path, {"axis": 0})
            _prepend(self.tracer.graph, [node])
            self._shape_in = node.outputs[0]
        return self._shape_in

    def rows_layout(self, node: ir.Node, value: ir.Value, what: str, axis_ok: bool = False, merged_ok: bool = False):
        """Where the batch is in ``value`` (``node``'s ``what``), when the branch can apply each
        row's adapter to it: batch-major rows (or a value holding no batch whose dim 0 is the
        batch's: broadcast to it), or (``axis_ok``) the batch on another axis.

        Raises:
            LoraError: the rows are not the batch's (:mod:`onnxparam.lora._batch_axis`): naming
                the weight, the node and where the batch axis was lost.
        """
        from ._batch_axis import describe

        layout = self.shared.layout(value)
        if layout is not None:
            if layout.batch_major or (axis_ok and layout.kind == "axis") or (merged_ok and layout.kind == "merged"):
                return layout
            dims = _dims(value)
            if layout.kind == "none" and dims and dims[0] is not None and dims[0] == self.shared.batch_dim():
                return layout
            why = describe(layout)
        else:
            why = "it is inside a subgraph (If / Loop / Scan body), where the batch axis is not followed"
        raise LoraError(
            f"lora='batched': {self.target.path!r} is adapted at node {node.name!r} ({node.op_type}), whose {what} "
            f"{value.name!r} {list(_dims(value) or [])} does not hold the batch's rows in batch-major order: {why}. "
            "Each row's adapter would be added to rows of other batch elements, so this is refused; a batch on "
            "axis 0 (or flattened batch-major, [batch * seq, d]) works: leave this weight out of the adapters "
            "(narrow target_modules / the param_group), make the model batch-first, or serve it with "
            "lora='inputs' (one adapter per run)")

    def branch(self, node: ir.Node, x: ir.Value, coefficient: float) -> None:
        from ._graph import _redirect

        layout = self.rows_layout(node, x, "input", axis_ok=node.op_type == "MatMul", merged_ok=True)
        if layout.kind == "axis" and layout.axis > 0:
            self.branch_moved(node, x, coefficient, layout.axis)
            return
        if layout.kind == "merged":
            self.branch_factored(node, x, coefficient, layout)
            return
        a, _ = self.selected()
        b = self.scaled_b(coefficient)
        t, tracer = self.target, self.tracer
        graph = node.graph
        y = node.outputs[0]
        y_dims, x_dims = _dims(y), _dims(x)
        batch, rows = self.shared.batch_dim(), self.shared.index_dim()
        rank = RANK_DIM.format(path=t.path)
        label = f"{node.name}/lora"
        uses = list(y.uses())  # before the branch's own Shape(y) uses it
        nodes = []
        direct = x_dims is not None and len(x_dims) == 3 and x_dims[0] == batch and batch is not None \
            and layout.kind in ("axis", "none")
        if direct:
            xa = _new_node(tracer, "MatMul", [x, a], self.dtype, x_dims[:-1] + [rank], f"{label}/MatMul_a", t.path)
            xab = _new_node(tracer, "MatMul", [xa.outputs[0], b], self.dtype, y_dims, f"{label}/MatMul_b", t.path)
            nodes += [xa, xab]
            delta = xab.outputs[0]
        else:
            view = _new_node(tracer, "Reshape", [x, self.shape_in()], self.dtype, [rows, None, t.d_in],
                             f"{label}/Reshape_x", t.path)
            xa = _new_node(tracer, "MatMul", [view.outputs[0], a], self.dtype, [rows, None, rank],
                           f"{label}/MatMul_a", t.path)
            xab = _new_node(tracer, "MatMul", [xa.outputs[0], b], self.dtype, [rows, None, t.d_out],
                            f"{label}/MatMul_b", t.path)
            shape = _new_node(tracer, "Shape", [y], ir.DataType.INT64, [len(y_dims)] if y_dims is not None else None,
                              f"{label}/Shape_y", t.path)
            back = _new_node(tracer, "Reshape", [xab.outputs[0], shape.outputs[0]], self.dtype, y_dims,
                             f"{label}/Reshape_y", t.path)
            nodes += [view, xa, xab, shape, back]
            delta = back.outputs[0]
        total = _new_node(tracer, "Add", [y, delta], self.dtype, y_dims, f"{label}/Add", t.path)
        graph.insert_after(node, nodes + [total])
        _redirect(y, total.outputs[0], uses)

    def branch_moved(self, node: ir.Node, x: ir.Value, coefficient: float, axis: int) -> None:
        """A ``MatMul`` whose input holds the batch on ``axis`` > 0 (``[seq, batch, d]``): the
        branch on ``x`` transposed batch-first, its delta transposed back::

            xt = Transpose(x, perm)                      perm: axis first, the others in order
            d  = Reshape(MatMul(MatMul(Reshape(xt, [rows, -1, d_in]), A), B), [*Shape(xt)[:-1], d_out])
            y + Transpose(d, inverse(perm))
        """
        from ._graph import _redirect

        a, _ = self.selected()
        b = self.scaled_b(coefficient)
        t, tracer = self.target, self.tracer
        y = node.outputs[0]
        x_dims, y_dims = _dims(x), _dims(y)
        if x_dims is None or (y_dims is not None and len(y_dims) != len(x_dims)) or axis >= len(x_dims) - 1:
            raise LoraError(f"lora='batched': {t.path!r} is adapted at node {node.name!r} (MatMul), whose input "
                            f"{x.name!r} holds the batch on axis {axis} of {x_dims}: only a batch on a row axis of "
                            "an input of the output's rank can be moved; make the model batch-first or serve it "
                            "with lora='inputs'")
        perm = [axis] + [i for i in range(len(x_dims)) if i != axis]
        inverse = [perm.index(i) for i in range(len(perm))]
        label = f"{node.name}/lora"
        nodes = [_new_node(tracer, "Transpose", [x], self.dtype, [x_dims[i] for i in perm], f"{label}/Transpose_x",
                           t.path, {"perm": perm})]
        moved = [x_dims[i] for i in perm[:-1]] + [t.d_out]
        nodes += self._batch_first_delta(nodes[-1].outputs[0], a, b, label, moved, y_dims, inverse)
        uses = list(y.uses())
        total = _new_node(tracer, "Add", [y, nodes[-1].outputs[0]], self.dtype, y_dims, f"{label}/Add", t.path)
        node.graph.insert_after(node, nodes + [total])
        _redirect(y, total.outputs[0], uses)

    def branch_factored(self, node: ir.Node, x: ir.Value, coefficient: float, layout) -> None:
        """A ``MatMul`` / ``Gemm`` whose input holds the batch as a factor of axis ``k`` (``layout``,
        :mod:`onnxparam.lora._batch_axis` "merged": ``outer * batch * inner``; torch's attention
        feeds ``out_proj`` ``[seq * batch, d]``): the input viewed with the batch as an axis of
        its own, then the branch of :meth:`branch_moved`, its delta viewed back::

            xv = Reshape(x, [*Shape(x)[:k], -1, rows, inner, *Shape(x)[k+1:]])   (inner: an int)
            xt = Transpose(xv, perm)                     perm: axis k + 1 first
            d  = Reshape(MatMul(MatMul(Reshape(xt, [rows, -1, d_in]), A), B), [*Shape(xt)[:-1], d_out])
            y + Reshape(Transpose(d, inverse(perm)), Shape(y))
        """
        from ._graph import _redirect

        t, tracer = self.target, self.tracer
        y = node.outputs[0]
        x_dims, y_dims = _dims(x), _dims(y)
        k, inner = layout.axis, layout.inner
        if x_dims is None or k >= len(x_dims) - 1 or inner is None or inner[1] or inner[0] < 1:
            from ._batch_axis import describe

            raise LoraError(f"lora='batched': {t.path!r} is adapted at node {node.name!r} ({node.op_type}), whose "
                            f"input {x.name!r} {list(x_dims or [])} has {describe(layout)}: only a batch whose "
                            "co-factor after it is a constant can be viewed per row; make the model batch-first or "
                            "serve it with lora='inputs'")
        a, _ = self.selected()
        b = self.scaled_b(coefficient)
        uses = list(y.uses())  # before the branch's own Shape(y) uses it
        rank_x = len(x_dims)
        label = f"{node.name}/lora"
        i64 = ir.DataType.INT64
        nodes, parts = [], []
        if k > 0:
            nodes.append(_new_node(tracer, "Shape", [x], i64, [k], f"{label}/Shape_lead", t.path, {"start": 0, "end": k}))
            parts.append(nodes[-1].outputs[0])
        parts += [self._const([-1], "lora.batched.items"), self.shared.rows(),
                  self._const([int(inner[0])], f"{t.path}.lora.inner{int(inner[0])}")]
        nodes.append(_new_node(tracer, "Shape", [x], i64, [rank_x - k - 1], f"{label}/Shape_rest", t.path,
                               {"start": k + 1}))
        parts.append(nodes[-1].outputs[0])
        nodes.append(_new_node(tracer, "Concat", parts, i64, [rank_x + 2], f"{label}/Concat_view", t.path, {"axis": 0}))
        nodes.append(_new_node(tracer, "Reshape", [x, nodes[-1].outputs[0]], self.dtype, [None] * (rank_x + 2),
                               f"{label}/Reshape_view", t.path))
        perm = [k + 1] + [i for i in range(rank_x + 2) if i != k + 1]
        inverse = [perm.index(i) for i in range(len(perm))]
        nodes.append(_new_node(tracer, "Transpose", [nodes[-1].outputs[0]], self.dtype, [None] * (rank_x + 2),
                               f"{label}/Transpose_x", t.path, {"perm": perm}))
        nodes += self._batch_first_delta(nodes[-1].outputs[0], a, b, label, [None] * (rank_x + 2),
                                         [None] * (rank_x + 2), inverse)
        nodes += self._reshape_like(node, nodes[-1].outputs[0], label)
        total = _new_node(tracer, "Add", [y, nodes[-1].outputs[0]], self.dtype, y_dims, f"{label}/Add", t.path)
        node.graph.insert_after(node, nodes + [total])
        _redirect(y, total.outputs[0], uses)

    def _batch_first_delta(self, xt: ir.Value, a: ir.Value, b: ir.Value, label: str, xt_dims: list,
                           out_dims, inverse: list) -> list:
        """The nodes of :meth:`branch_moved` / :meth:`branch_factored` after the input is moved
        batch-first (``xt``, dims ``xt_dims`` but the last, which is ``d_out`` here): each row's
        ``xt @ A @ B`` viewed back to ``[*Shape(xt)[:-1], d_out]``, then transposed by ``inverse``
        (dims ``out_dims``)::

            d = Reshape(MatMul(MatMul(Reshape(xt, [rows, -1, d_in]), A), B), [*Shape(xt)[:-1], d_out])
            Transpose(d, inverse)
        """
        t, tracer, i64 = self.target, self.tracer, ir.DataType.INT64
        rows, rank = self.shared.index_dim(), RANK_DIM.format(path=t.path)
        nodes = [_new_node(tracer, "Reshape", [xt, self.shape_in()], self.dtype, [rows, None, t.d_in],
                           f"{label}/Reshape_x", t.path)]
        nodes.append(_new_node(tracer, "MatMul", [nodes[-1].outputs[0], a], self.dtype, [rows, None, rank],
                               f"{label}/MatMul_a", t.path))
        nodes.append(_new_node(tracer, "MatMul", [nodes[-1].outputs[0], b], self.dtype, [rows, None, t.d_out],
                               f"{label}/MatMul_b", t.path))
        xab = nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Shape", [xt], i64, [len(xt_dims) - 1], f"{label}/Shape_xt", t.path,
                               {"end": -1}))
        nodes.append(_new_node(tracer, "Concat", [nodes[-1].outputs[0], self._const([t.d_out], f"{t.path}.lora.d_out")],
                               i64, [len(xt_dims)], f"{label}/Concat_shape", t.path, {"axis": 0}))
        nodes.append(_new_node(tracer, "Reshape", [xab, nodes[-1].outputs[0]], self.dtype, xt_dims,
                               f"{label}/Reshape_delta", t.path))
        nodes.append(_new_node(tracer, "Transpose", [nodes[-1].outputs[0]], self.dtype, out_dims,
                               f"{label}/Transpose_delta", t.path, {"perm": inverse}))
        return nodes

    def _const(self, values, name: str) -> ir.Value:
        return self.tracer.constant(np.asarray(values, dtype=np.int64), name=name)._symbol.value

    def _add_after(self, node: ir.Node, nodes: list, delta: ir.Value) -> None:
        """``y + delta`` after ``node`` (its output ``y``) and ``nodes``, replacing every use of ``y``
        (but ``nodes``' own)."""
        total = _new_node(self.tracer, "Add", [node.outputs[0], delta], self.dtype, _dims(node.outputs[0]),
                          f"{node.name}/lora/Add", self.target.path)
        self._replace_after(node, nodes + [total], total.outputs[0])

    def _reshape_like(self, node: ir.Node, value: ir.Value, label: str) -> list:
        """``[Shape(y), Reshape(value, Shape(y))]``: ``value`` in the shape of ``node``'s output ``y``."""
        y, t = node.outputs[0], self.target
        y_dims = _dims(y)
        shape = _new_node(self.tracer, "Shape", [y], ir.DataType.INT64, [len(y_dims)] if y_dims is not None else None,
                          f"{label}/Shape_y", t.path)
        back = _new_node(self.tracer, "Reshape", [value, shape.outputs[0]], self.dtype, y_dims, f"{label}/Reshape_y",
                         t.path)
        return [shape, back]

    def conv(self, node: ir.Node, x: ir.Value) -> None:
        """A ``Conv`` weight ``(d_out, in / group, *kernel)``: PEFT's conv LoRA per row (``a``
        reads all ``in`` channels: the adapters' ``groups`` must be the node's ``group``). Every
        slot's ``a`` is one conv of ``slots * r`` output channels (``a_stack`` transposed to
        ``(slots * r, in, *kernel)``, the node's own strides / pads / dilations, no group), its output
        masked to each row's slot, then ``b`` of every slot as one ``(d_out, slots * r)`` matrix::

            h = Conv(x, a_conv)                        [batch, slots * r, *spatial]
            h = h * mask (row n: its slot's r channels) [batch, slots * r, L]
            y + Reshape(MatMul(b_all, h), Shape(y))     b_all = Transpose(Reshape(b_stack, [-1, d_out]))
        """
        from ._graph import _attr_int

        t, tracer, shared = self.target, self.tracer, self.shared
        from ._adapters import conv_adapter_groups

        group, groups = _attr_int(node, "group", 1), conv_adapter_groups(t.shape, t.d_in)
        if group != groups:
            raise LoraError(
                f"lora='batched': {t.path!r} {list(t.shape)} is the weight of Conv node {node.name!r} with "
                f"group={group}, but its adapters' a has {t.d_in} rows, a conv of "
                f"{t.d_in // int(np.prod(t.shape[2:]))} input channels (groups={groups}): batched conv LoRA takes "
                f"PEFT's layout, lora_A a conv of all {int(t.shape[1]) * group} input channels (a weight delta of a grouped conv is not supported)")
        from ._conv_checks import check_conv_node

        check_conv_node(node, t.path, t.shape, groups, BATCHED_MODE)  # PEFT's and the merged weight's must agree
        layout = self.rows_layout(node, x, "input")
        folded = layout.kind in ("rows", "flat")  # [batch * m, C, ...]: each row's mask over its m samples
        a_stack, b_stack = self.stacks()
        rows, rank = shared.index_dim(), RANK_DIM.format(path=t.path)
        label = f"{node.name}/lora"
        if self._conv_weights is None:
            head = [_new_node(tracer, "Transpose", [a_stack], self.dtype, [SLOTS_DIM, rank, t.d_in],
                              f"/{t.path}.lora/Transpose_a", t.path, {"perm": [0, 2, 1]})]
            a_dims = [int(t.shape[1]) * group, *t.shape[2:]]  # every input channel (PEFT's lora_A)
            head.append(_new_node(tracer, "Reshape", [head[-1].outputs[0], self._const(
                [-1, *a_dims], f"{t.path}.lora.conv_shape")], self.dtype, [None, *a_dims],
                f"/{t.path}.lora/Reshape_a", t.path))
            a_conv = head[-1].outputs[0]
            head.append(_new_node(tracer, "Reshape", [b_stack, self._const([-1, t.d_out], "lora.batched.flat")],
                                  self.dtype, [None, t.d_out], f"/{t.path}.lora/Reshape_b", t.path))
            head.append(_new_node(tracer, "Transpose", [head[-1].outputs[0]], self.dtype, [t.d_out, None],
                                  f"/{t.path}.lora/Transpose_b", t.path, {"perm": [1, 0]}))
            _prepend(tracer.graph, head)
            self._conv_weights = (a_conv, head[-1].outputs[0])
        a_conv, b_all = self._conv_weights
        kept = [attr for name, attr in node.attributes.items() if name != "group"]
        nodes = [_new_node(tracer, "Conv", [x, a_conv], self.dtype, None, f"{label}/Conv_a", t.path, attributes=kept)]
        nodes.append(_new_node(tracer, "Reshape", [nodes[-1].outputs[0], self._const([0, 0, -1], "lora.batched.flat3")],
                               self.dtype, [rows, None, None], f"{label}/Reshape_h", t.path))
        h = nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Shape", [h], ir.DataType.INT64, [3], f"{label}/Shape_h", t.path))
        h_shape = nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Reshape", [h, shared.by_slot()], self.dtype, [rows, SLOTS_DIM, None],
                               f"{label}/Reshape_slots", t.path))
        if folded:  # [N, slots, r * L] viewed [rows, N / rows, slots, r * L], the mask [rows, 1, slots, 1]
            i64 = ir.DataType.INT64
            h_slots = nodes[-1].outputs[0]
            nodes.append(_new_node(tracer, "Shape", [h_slots], i64, [2], f"{label}/Shape_slots", t.path,
                                   {"start": 1}))
            nodes.append(_new_node(tracer, "Concat", [shared.rows(), self._const([-1], "lora.batched.items"),
                                                      nodes[-1].outputs[0]], i64, [4], f"{label}/Concat_rows",
                                   t.path, {"axis": 0}))
            nodes.append(_new_node(tracer, "Reshape", [h_slots, nodes[-1].outputs[0]], self.dtype,
                                   [rows, None, SLOTS_DIM, None], f"{label}/Reshape_rows", t.path))
            view = nodes[-1].outputs[0]
            nodes.append(_new_node(tracer, "Unsqueeze", [shared.mask(self.dtype), self._const(
                [1], "lora.batched.axis1")], self.dtype, [rows, 1, SLOTS_DIM, 1], f"{label}/Unsqueeze_mask", t.path))
            nodes.append(_new_node(tracer, "Mul", [view, nodes[-1].outputs[0]], self.dtype,
                                   [rows, None, SLOTS_DIM, None], f"{label}/Mul_mask", t.path))
        else:
            nodes.append(_new_node(tracer, "Mul", [nodes[-1].outputs[0], shared.mask(self.dtype)], self.dtype,
                                   [rows, SLOTS_DIM, None], f"{label}/Mul_mask", t.path))
        nodes.append(_new_node(tracer, "Reshape", [nodes[-1].outputs[0], h_shape], self.dtype, [rows, None, None],
                               f"{label}/Reshape_back", t.path))
        nodes.append(_new_node(tracer, "MatMul", [b_all, nodes[-1].outputs[0]], self.dtype, [rows, t.d_out, None],
                               f"{label}/MatMul_b", t.path))
        nodes += self._reshape_like(node, nodes[-1].outputs[0], label)
        self._add_after(node, nodes, nodes[-1].outputs[0])

    def bias(self, node: ir.Node, coefficient: float, channel_axis: int) -> None:
        """A 1-d bias ``(d_out,)`` added by ``node`` (``Add``, ``Gemm``'s C, ``Conv``'s B): row ``n``
        adds ``coefficient * a_stack[i_n] @ b_stack[i_n]`` (PEFT's ``lora_bias``: ``scale *
        lora_B.bias``) along the channel axis (``-1``, or ``1`` for a ``Conv``)."""
        t, tracer, shared = self.target, self.tracer, self.shared
        rows = shared.index_dim()
        label = f"{node.name}/lora"
        hit = self._bias_rows.get(coefficient)
        if hit is None:
            a, _ = self.selected()
            b = self.scaled_b(coefficient)
            row = _new_node(tracer, "MatMul", [a, b], self.dtype, [rows, 1, t.d_out], f"/{t.path}.lora/MatMul",
                            t.path)
            _prepend(tracer.graph, [row])
            hit = self._bias_rows[coefficient] = row.outputs[0]  # [rows, 1, d_out]
        y = node.outputs[0]
        y_dims = _dims(y)
        layout = self.rows_layout(node, y, "output")
        if channel_axis == 1 and layout.kind in ("rows", "flat"):
            if y_dims is None:
                raise LoraError(f"lora='batched': the bias {t.path!r} is adapted at Conv node {node.name!r}, whose "
                                f"output {y.name!r} folds the batch into its dim 0 and has an unknown rank; leave the "
                                "bias out of the adapters (lora_bias=False) or serve it with lora='inputs'")
            self.bias_folded(node, hit, len(y_dims))
            return
        if channel_axis != 1 and y_dims is not None and len(y_dims) == 3 and y_dims[0] == shared.batch_dim() \
                and layout.kind in ("axis", "none"):
            self._add_after(node, [], hit)  # [rows, seq, d_out] + [rows, 1, d_out]
            return
        if channel_axis == 1:  # [rows, d_out, *spatial] viewed [rows, d_out, -1], the delta as [rows, d_out, 1]
            nodes = [_new_node(tracer, "Transpose", [hit], self.dtype, [rows, t.d_out, 1], f"{label}/Transpose",
                               t.path, {"perm": [0, 2, 1]})]
            delta = nodes[-1].outputs[0]
            shape = self._const([0, 0, -1], "lora.batched.flat3")
        else:  # any batch-major layout, viewed [rows, -1, d_out]
            nodes = [_new_node(tracer, "Concat", [shared.rows(), self._const([-1, t.d_out], "lora.batched.view")],
                               ir.DataType.INT64, [3], f"{label}/Concat", t.path, {"axis": 0})]
            delta, shape = hit, nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Reshape", [y, shape], self.dtype, [rows, None, None], f"{label}/Reshape_view",
                               t.path))
        nodes.append(_new_node(tracer, "Add", [nodes[-1].outputs[0], delta], self.dtype, [rows, None, None],
                               f"{label}/Add_rows", t.path))
        nodes += self._reshape_like(node, nodes[-1].outputs[0], label)
        self._replace_after(node, nodes, nodes[-1].outputs[0])

    def bias_folded(self, node: ir.Node, hit: ir.Value, rank: int) -> None:
        """A ``Conv`` bias whose output ``y`` ``[batch * m, d_out, *spatial]`` folds the batch into
        dim 0 (batch-major: :mod:`onnxparam.lora._batch_axis` ``"rows"``): ``y`` viewed
        ``[rows, m, d_out, *spatial]`` (a view that does not divide fails in ONNX Runtime's
        ``Reshape``), row ``n``'s delta ``hit[n]`` (``[rows, 1, d_out]``) added as ``[rows, 1, d_out,
        1, ...]``, then back to ``Shape(y)``."""
        t, tracer, shared = self.target, self.tracer, self.shared
        rows, i64 = shared.index_dim(), ir.DataType.INT64
        label = f"{node.name}/lora"
        y = node.outputs[0]
        nodes = [_new_node(tracer, "Reshape", [hit, self._const([0, 1, t.d_out] + [1] * (rank - 2),
                                                                f"{t.path}.lora.bias_view{rank}")],
                           self.dtype, [rows, 1, t.d_out] + [1] * (rank - 2), f"{label}/Reshape_delta", t.path)]
        delta = nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Shape", [y], i64, [rank - 1], f"{label}/Shape_samples", t.path, {"start": 1}))
        nodes.append(_new_node(tracer, "Concat", [shared.rows(), self._const([-1], "lora.batched.items"),
                                                  nodes[-1].outputs[0]], i64, [rank + 1], f"{label}/Concat_rows",
                               t.path, {"axis": 0}))
        nodes.append(_new_node(tracer, "Reshape", [y, nodes[-1].outputs[0]], self.dtype, [rows] + [None] * rank,
                               f"{label}/Reshape_view", t.path))
        nodes.append(_new_node(tracer, "Add", [nodes[-1].outputs[0], delta], self.dtype, [rows] + [None] * rank,
                               f"{label}/Add_rows", t.path))
        nodes += self._reshape_like(node, nodes[-1].outputs[0], label)
        self._replace_after(node, nodes, nodes[-1].outputs[0])

    def _replace_after(self, node: ir.Node, nodes: list, value: ir.Value) -> None:
        """``nodes`` after ``node``; every use of ``node``'s output ``y`` (but ``nodes``' own) reads ``value``."""
        from ._graph import _redirect

        y = node.outputs[0]
        own = {id(n) for n in nodes}
        uses = [(user, i) for user, i in y.uses() if id(user) not in own]
        node.graph.insert_after(node, nodes)
        _redirect(y, value, uses)

    def lookup(self, node: ir.Node, ids: ir.Value) -> None:
        """An embedding ``Gather(W, ids)`` (``W`` ``(num, dim)``, ``ids`` ``[batch, ...]``): row
        ``n`` adds ``a_stack[i_n, ids[n, ...]] @ b_stack[i_n]``, ``i_n = adapter_index[n]``
        (``GatherND`` at ``[i_n, id]``: only the looked-up rows of ``a`` are read). Sequence-first
        ids (the batch on axis ``k > 0``) are transposed batch-first for the branch, its delta
        transposed back."""
        from ._graph import _redirect

        t, tracer, shared = self.target, self.tracer, self.shared
        layout = self.rows_layout(node, ids, "ids input", axis_ok=True)
        ids_dims = _dims(ids)
        moved = layout.kind == "axis" and layout.axis > 0
        if moved and ids_dims is None:
            raise LoraError(f"lora='batched': {t.path!r} is adapted at node {node.name!r} (Gather), whose ids "
                            f"{ids.name!r} hold the batch on axis {layout.axis} of an unknown rank; make the model "
                            "batch-first or serve it with lora='inputs'")
        _, b = self.selected()
        a_stack = self.stacks()[0]
        graph = node.graph
        y = node.outputs[0]
        uses = list(y.uses())
        y_dims = _dims(y)
        rank = RANK_DIM.format(path=t.path)
        label = f"{node.name}/lora"
        i64 = ir.DataType.INT64
        axes_tail = tracer.constant(np.asarray([-1], dtype=np.int64), name="lora.batched.last")._symbol.value
        nodes = []
        if ids.dtype is not None and ids.dtype != i64:
            nodes.append(_new_node(tracer, "Cast", [ids], i64, _dims(ids), f"{label}/Cast_ids", t.path,
                                   {"to": int(i64)}))
            ids = nodes[-1].outputs[0]
        if moved:  # [.., batch, ..] -> [batch, ..]: perm the batch axis first
            perm = [layout.axis] + [i for i in range(len(ids_dims)) if i != layout.axis]
            nodes.append(_new_node(tracer, "Transpose", [ids], i64, [ids_dims[i] for i in perm],
                                   f"{label}/Transpose_ids", t.path, {"perm": perm}))
            ids = nodes[-1].outputs[0]
        nodes.append(_new_node(tracer, "Reshape", [ids, shared.rows_by_items()], i64, [shared.index_dim(), None],
                               f"{label}/Reshape_ids", t.path))
        flat = nodes[-1].outputs[0]  # [rows, items]
        nodes.append(_new_node(tracer, "Shape", [flat], i64, [2], f"{label}/Shape_ids", t.path))
        nodes.append(_new_node(tracer, "Unsqueeze", [shared.index(), tracer.constant(
            np.asarray([1], dtype=np.int64), name="lora.batched.axis1")._symbol.value], i64,
            [shared.index_dim(), 1], f"{label}/Unsqueeze_index", t.path))
        nodes.append(_new_node(tracer, "Expand", [nodes[-1].outputs[0], nodes[-2].outputs[0]], i64,
                               [shared.index_dim(), None], f"{label}/Expand_index", t.path))
        pair = []
        for value, tag in ((nodes[-1].outputs[0], "index"), (flat, "ids")):
            nodes.append(_new_node(tracer, "Unsqueeze", [value, axes_tail], i64, [shared.index_dim(), None, 1],
                                   f"{label}/Unsqueeze_{tag}", t.path))
            pair.append(nodes[-1].outputs[0])
        nodes.append(_new_node(tracer, "Concat", pair, i64, [shared.index_dim(), None, 2], f"{label}/Concat",
                               t.path, {"axis": -1}))
        nodes.append(_new_node(tracer, "GatherND", [a_stack, nodes[-1].outputs[0]], self.dtype,
                               [shared.index_dim(), None, rank], f"{label}/GatherND_a", t.path))
        nodes.append(_new_node(tracer, "MatMul", [nodes[-1].outputs[0], b], self.dtype,
                               [shared.index_dim(), None, t.d_out], f"{label}/MatMul_b", t.path))
        if moved:  # the delta [rows, items, d_out] as [*Shape(ids batch-first), d_out], then the axes back
            delta = nodes[-1].outputs[0]
            nodes.append(_new_node(tracer, "Shape", [ids], i64, [len(ids_dims)], f"{label}/Shape_ids_first", t.path))
            nodes.append(_new_node(tracer, "Concat", [nodes[-1].outputs[0], self._const(
                [t.d_out], f"{t.path}.lora.d_out")], i64, [len(ids_dims) + 1], f"{label}/Concat_delta", t.path,
                {"axis": 0}))
            nodes.append(_new_node(tracer, "Reshape", [delta, nodes[-1].outputs[0]], self.dtype,
                                   [None] * (len(ids_dims) + 1), f"{label}/Reshape_delta", t.path))
            back = [perm.index(i) for i in range(len(perm))] + [len(perm)]
            nodes.append(_new_node(tracer, "Transpose", [nodes[-1].outputs[0]], self.dtype, y_dims,
                                   f"{label}/Transpose_delta", t.path, {"perm": back}))
        else:
            nodes.append(_new_node(tracer, "Shape", [y], i64, [len(y_dims)] if y_dims is not None else None,
                                   f"{label}/Shape_y", t.path))
            nodes.append(_new_node(tracer, "Reshape", [nodes[-2].outputs[0], nodes[-1].outputs[0]], self.dtype,
                                   y_dims, f"{label}/Reshape_y", t.path))
        total = _new_node(tracer, "Add", [y, nodes[-1].outputs[0]], self.dtype, y_dims, f"{label}/Add", t.path)
        graph.insert_after(node, nodes + [total])
        _redirect(y, total.outputs[0], uses)

    def expand(self) -> None:
        from ._graph import _attr_float, _attr_int, _transpose_to_matmul

        transposed, kind = self.target.transposed, self.target.kind
        for node, index in list(self.base.uses()):
            if node.domain in ("", "ai.onnx") and node.outputs:
                if kind == "bias":
                    if node.op_type == "Add" and index in (0, 1):
                        self.bias(node, 1.0, -1)
                        continue
                    if node.op_type == "Gemm" and index == 2:
                        self.bias(node, _attr_float(node, "beta", 1.0), -1)
                        continue
                    if node.op_type == "Conv" and index == 2:
                        self.bias(node, 1.0, 1)
                        continue
                elif kind == "conv":
                    if node.op_type == "Conv" and index == 1:
                        self.conv(node, node.inputs[0])
                        continue
                else:
                    if index == 0 and node.op_type == "Gather" and not transposed and _attr_int(node, "axis", 0) == 0:
                        self.lookup(node, node.inputs[1])  # an embedding table
                        continue
                    if index == 1 and node.op_type == "MatMul" and not transposed:
                        self.branch(node, node.inputs[0], 1.0)
                        continue
                    if index == 1 and node.op_type == "Gemm" and _attr_int(node, "transA", 0) == 0 \
                            and _attr_int(node, "transB", 0) == int(transposed):
                        self.branch(node, node.inputs[0], _attr_float(node, "alpha", 1.0))
                        continue
                    matmul = _transpose_to_matmul(node) if transposed else None
                    if matmul is not None:
                        self.branch(matmul, matmul.inputs[0], 1.0)
                        continue
            uses = {"bias": "an Add, a Gemm's C or a Conv's B (a bias)", "conv": "a Conv's weight",
                    "matrix": "a linear map's MatMul / Gemm or an embedding Gather"}[kind]
            raise LoraError(
                f"lora='batched': {self.target.path!r} ({kind}) is used by node {node.name!r} ({node.op_type}, input "
                f"{index}), which is not {uses}: batched adapters apply per row to those uses only; leave this weight "
                "out of the adapters (narrow target_modules / the param_group) or export with lora='inputs'")


def expand_batched(tracer) -> None:
    """The ``"batched"`` pass (module docstring): called by
    the tracer when a trace finishes (one of the standard passes, after
    :func:`onnxparam.lora._graph.expand_adapters`); a no-op in the other modes."""
    if tracer.mode != BATCHED_MODE:
        return
    options, fed = _OPTIONS.get() or (BatchedLora(), False)
    root = tracer._root
    stacks = stack_adapters(root, options, values=not fed)
    shared = _Graph(tracer, options)
    shared.analyse([t._symbol.value for t in tracer._param_tensors.values()])
    shared.index()  # the input exists even when no target is used by the graph
    used = []
    for tensor in list(tracer._param_tensors.values()):
        symbol = tensor._symbol
        param = symbol.param
        path = tracer._param_paths.get(id(param)) if param is not None else None
        target = stacks.targets.get(path)
        if target is None:
            continue
        names = stack_names(root, path)
        if fed:
            defaults = (np.zeros((1, target.d_in, 0)), np.zeros((1, 0, target.d_out)))
        else:
            defaults = (target.a, target.b)
        dtype = tensor.dtype if tensor.dtype is not DType.QFloat else DType.F32
        _Target(shared, target, symbol.value, dtype, names, defaults).expand()
        used.append({"path": path, "a": names[0], "b": names[1], "d_in": target.d_in, "d_out": target.d_out,
                     "rank": target.rank, "ranks": target.ranks, "dtype": np.dtype(dtype.to_numpy()).name,
                     "kind": target.kind, "shape": [int(d) for d in target.shape]})
    if not used:
        raise LoraError(f"lora='batched': no weight the adapters {list(stacks.names)} target "
                        f"({', '.join(sorted(stacks.targets)[:4])} ...) is used by the traced graph")
    tracer.graph.meta[METADATA_KEY] = json.dumps({
        "index_input": options.index_name, "base_index": BASE_INDEX, "adapters": list(stacks.names),
        "capacity": stacks.capacity, "slots": stacks.slots, "targets": used}, separators=(",", ":"))


def batched_metadata(model) -> Optional[dict]:
    """The :data:`METADATA_KEY` record of a batched export (an ``onnx_ir.Model``, an ``onnx``
    ``ModelProto`` or a file path), or ``None`` for another model."""
    import os

    if isinstance(model, (str, os.PathLike)):
        import onnx

        model = onnx.load(os.fspath(model), load_external_data=False)
    if isinstance(model, ir.Model):
        text = model.metadata_props.get(METADATA_KEY) or model.graph.meta.get(METADATA_KEY)
    else:
        text = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), None)
    return None if text is None else json.loads(text)


def index_array(index, stacks: AdapterStacks) -> np.ndarray:
    """``adapter_index`` as the int64 ``[batch]`` array the graph takes: a sequence of ints,
    names and ``None`` / ``"__base__"``, an int array / Tensor, or one int / name (a length-1
    index: every row).

    Raises:
        LoraError: an unknown name, an index outside ``[0, slots)``, or not 1-d.
    """
    if type(index) is np.ndarray and index.ndim == 1 and index.dtype.kind in "iu":
        # NOTE: a served call's index, checked with the fewest library calls (each costs tens of
        # microseconds right after a run has evicted them from the caches); an entry outside
        # [0, slots) is named by index_of below
        entries = index.tolist()
        if entries and min(entries) >= 0 and max(entries) < stacks.slots:
            return index if index.dtype == np.int64 else index.astype(np.int64)
        return np.asarray([stacks.index_of(e) for e in entries], dtype=np.int64)
    from ..core.tensor import Tensor

    if isinstance(index, Tensor):
        index = index.to_numpy()
    if isinstance(index, np.ndarray):
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise LoraError(f"adapter_index must be a 1-d integer array (one entry per row); got "
                            f"{index.dtype} {list(index.shape)}")
        entries = index.tolist()
    elif isinstance(index, (list, tuple)):
        entries = list(index)
    else:
        entries = [index]
    return np.asarray([stacks.index_of(e) for e in entries], dtype=np.int64)
