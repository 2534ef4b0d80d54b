"""Helpers of ``tools/bench.py lora-batched``: the floors of the batched ratios, measured in the
same round-robin run as the ratios themselves (imported by :func:`bench.bench_lora_batched`;
nothing here runs on its own).

Five calls, timed in turn in a new random order every repetition, medians; twice: *shuffled*
(each call follows another's session, whose weights evicted part of its own from the caches:
each call meets every predecessor equally often) and *hot* (each timed call right after an untimed
call of itself: its weights in the caches, a server running this one model). The two states give
different ratios (the base's ~12.6 MB fit the 32 MB L3 of the bench machine), so both are printed:


* ``batched``: one ``lora="batched"`` run of the mixed batch (every row, its adapter);
* ``split``: the four ``"inputs"`` runs a server makes (one per adapter, its rows only);
* ``single``: one ``"inputs"`` run of the whole batch with one adapter (the rank-16 one);
* ``base``: the base model alone (exported with no adapter) on the whole batch;
* ``base split``: the base model alone, four runs of the same row groups as ``split``;
* ``no gathers``: the batched export with each stack ``Gather`` replaced by a graph input holding
  its output for this batch (each row's factors, gathered once in numpy: :func:`without_gathers`).
  Not a usable export: the bound of the per-row form, where every row still reads its own factors
  but nothing copies them first.

The floors, as ratios of those medians:

* ``base / base split``: what one run of the whole batch saves over the four runs with no LoRA at
  all. The batched / split target (0.5) cannot be met with less than this unless the LoRA branch
  itself costs less in the batched run than in the split ones: at one token per row the base's run
  is its weights read once per run and each node's fixed cost, which the four split runs repeat
  but which the batched run does not save more of.
* ``single / base``: what one adapter's branch adds in ONNX Runtime's own multi-LoRA form (the
  ``"inputs"`` export with a ``.onnx_adapter`` active): the batched / single ratio is measured
  against that run, so it counts only what serving four adapters per row adds over one.
* ``single / split``: the batched / split ratio if the batched run cost no more than a
  single-adapter run of the same batch (batched / single = 1.0).
* ``no gathers / single``: the batched / single ratio of the per-row form without the copies of
  the gathered factors (``batched / no gathers``: what the gathers cost).
"""

from __future__ import annotations

import statistics
import sys
import time


def round_robin_medians(fns: dict, repeats: int, warmup: int = 5, clock=time.perf_counter,
                        hot: bool = False, seed: int = 0) -> dict:
    """``{name: median seconds}`` of each call in ``fns`` (``{name: callable}``), timed in turn
    ``repeats`` times, in a new random order every repetition (each call follows every other
    equally often: a fixed rotation would give each call the same predecessor, whose session's
    weights it finds in the caches, or not, every time). ``hot``: each timed call right after an
    untimed call of itself (its own weights in the caches, as a server running one model)."""
    import random

    names = list(fns)
    order = random.Random(seed)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for _ in range(repeats):
        order.shuffle(names)
        for name in names:
            if hot:
                fns[name]()
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def without_gathers(path, index, out_path):
    """The batched export at ``path`` with every ``Gather`` of a stack (``*.lora.a_stack`` /
    ``*.lora.b_stack``) replaced by a graph input named as its output, whose default (an
    initializer) is that stack's default gathered at ``index`` (int64 ``[batch]``): the same
    results for that index, no copy in the run. Saved to ``out_path``; returns it."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from onnxparam.lora._batched import STACK_SUFFIXES

    model = onnx.load(str(path))
    graph = model.graph
    stacks = {i.name: i for i in graph.initializer if i.name.endswith(STACK_SUFFIXES)}
    kept = []
    for node in graph.node:
        if node.op_type == "Gather" and node.input[0] in stacks:
            rows = np.ascontiguousarray(numpy_helper.to_array(stacks[node.input[0]])[index])
            graph.initializer.append(numpy_helper.from_array(rows, node.output[0]))
            graph.input.append(helper.make_tensor_value_info(node.output[0], stacks[node.input[0]].data_type,
                                                             list(rows.shape)))
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    onnx.save(model, str(out_path))
    return out_path


def floor_cases(Result, fns: dict, seq: int, repeats: int, clock, split_target: float,
                single_target: float, load) -> list:
    """The medians of ``fns`` (keys ``batched``, ``split``, ``single``, ``base``, ``base split``,
    ``no gathers``: module docstring) in two round robins (:func:`round_robin_medians`: shuffled, then hot),
    printed with the floors, and the two batched ratios of each as :class:`bench.Result` s whose
    labels carry their floors. ``load()``: the 1-minute load average."""
    results = []
    clock_label = "thread CPU time" if clock is time.thread_time else "wall time"
    for hot in (False, True):
        before = load()
        t = round_robin_medians(fns, repeats, clock=clock, hot=hot)
        base_floor = t["base"] / t["base split"]
        adapter = t["single"] / t["base"]
        ideal = t["single"] / t["split"]
        bound = t["no gathers"] / t["single"]
        label = f"{'hot' if hot else 'shuffled'}, {clock_label}"
        print(f"lora-batched seq {seq} floors ({label}, round robin of 6, {repeats} repeats, 1-min load "
              f"{before:.2f} -> {load():.2f}): base alone 8 rows / 4 base runs of 2 rows {base_floor:.3f}; "
              f"inputs (one r16 adapter) / base {adapter:.3f}; inputs 8 rows / 4 split inputs runs {ideal:.3f}; "
              f"batched / base {t['batched'] / t['base']:.3f}; batched without its gathers / inputs {bound:.3f} "
              f"(the gathers: {t['batched'] / t['no gathers']:.3f}); medians (ms): "
              + ", ".join(f"{name} {value * 1e3:.3f}" for name, value in t.items()), file=sys.stderr)
        results += [
            Result("lora", f"batched vs split inputs runs, seq {seq}, {label} "
                           f"[floor: base alone {base_floor:.3f}, one inputs run {ideal:.3f}]", t["batched"],
                   t["split"], split_target),
            Result("lora", f"batched vs one r16 inputs run, seq {seq}, {label} [inputs / base {adapter:.3f}, "
                           f"no gathers {bound:.3f}]",
                   t["batched"], t["single"], single_target),
        ]
    return results
