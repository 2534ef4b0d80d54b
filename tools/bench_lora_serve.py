"""Helpers of ``tools/bench.py lora``: the LoRA branch's arithmetic floor and the adapter
switching cases (imported by :func:`bench.bench_lora`; nothing here runs on its own).

* :func:`factor_share`: the multiply-adds of every ``MatMul`` / ``Gemm`` of an exported graph,
  counted from the shapes ONNX Runtime actually gives their inputs on one run, split into the LoRA
  branch's (nodes the LoRA pass wrote: ``onnxparam.lora.node`` metadata) and the rest: the
  ``keep`` / ``inputs`` overhead over ``merge`` cannot be below ``lora / (total - lora)``.
* :func:`kernel_share`: the LoRA nodes' share of ONNX Runtime's kernel time (its profiler).
* :func:`switch_cases`: switching adapters in one ONNX Runtime session (``RunOptions`` with the
  other ``.onnx_adapter`` active) and through ``module(x)`` (``set_adapter`` between two named
  adapters in ``lora_mode="inputs"``: no new trace, no new session) vs a new session of the other
  adapter merged (plain ORT; ``lora_mode="merge"`` in the runtime); each side includes one run,
  at the bench's batch and at one request (batch 1). Both sides include the run, so the ratio
  cannot be below ``run / (build + run)``: that bound is printed beside each case, measured.
  And the switch alone in ORT, no run on either side: loading the other ``.onnx_adapter`` and
  activating it vs building the other adapter's merged session.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _macs(a_shape, b_shape, op: str, node) -> int:
    if op == "Gemm":
        trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
        trans_b = next((x.i for x in node.attribute if x.name == "transB"), 0)
        m, k = a_shape[::-1] if trans_a else a_shape
        n = b_shape[0] if trans_b else b_shape[1]
        return int(m * k * n)
    a, b = list(a_shape), list(b_shape)
    if len(a) == 1:
        a = [1] + a
    if len(b) == 1:
        b = b + [1]
    batch = np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
    return int(np.prod(batch, dtype=np.int64) * a[-2] * a[-1] * b[-1])


def factor_share(path, feeds: dict, run_options=None) -> tuple:
    """``(lora multiply-adds, all multiply-adds)`` of one run of the model at ``path`` on
    ``feeds`` (``MatMul`` / ``Gemm`` only: the block's other ops are not multiply-adds)."""
    import onnx
    import onnxruntime as ort

    from onnxparam.lora._graph import LORA_NODE_KEY

    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx")]
    wanted = sorted({name for n in nodes for name in n.input[:2]})
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    graph_inputs = {i.name for i in model.graph.input}
    extra = [name for name in wanted if name not in inits and name not in outputs and name not in graph_inputs]
    for name in extra:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(None, feeds, run_options)))
    shapes = {name: tuple(v.shape) for name, v in values.items()}
    shapes.update({name: tuple(np.asarray(v).shape) for name, v in feeds.items()})
    shapes.update(inits)
    lora = total = 0
    for n in nodes:
        macs = _macs(shapes[n.input[0]], shapes[n.input[1]], n.op_type, n)
        total += macs
        if any(p.key == LORA_NODE_KEY for p in n.metadata_props):
            lora += macs
    return lora, total


def kernel_share(path, feeds: dict, session_options, runs: int, run_options=None) -> tuple:
    """``(lora kernel s, all kernel s)`` of one run: ONNX Runtime's profiler on ``runs`` runs, each
    node's median kernel time, summed over the nodes the LoRA pass wrote (named ``.../lora/...``)
    and over all: the branch's share of the time, less exposed to other processes' load than
    two sessions' end-to-end medians."""
    import json
    import os
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-profile-") as tmp:
        session_options.enable_profiling = True
        session_options.profile_file_prefix = os.path.join(tmp, "lora")
        try:
            session = ort.InferenceSession(str(path), sess_options=session_options, providers=["CPUExecutionProvider"])
        finally:
            session_options.enable_profiling = False
        for _ in range(runs):
            session.run(None, feeds, run_options)
        with open(session.end_profiling()) as f:
            events = json.load(f)
    times: dict = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            times.setdefault(e["name"][: -len("_kernel_time")], []).append(e["dur"] * 1e-6)
    medians = {name: statistics.median(t[len(t) // 5:]) for name, t in times.items()}
    return sum(t for name, t in medians.items() if "lora" in name), sum(medians.values())


def _median_pair(ours, base, repeats):
    t_ours, t_base = [], []
    for i in range(repeats):
        pair = ((ours, t_ours), (base, t_base))
        for fn, times in (pair if i % 2 == 0 else pair[::-1]):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(t_ours), statistics.median(t_base)


def switch_cases(Result, first, second, with_factors, x, config, folder: Path, repeats: int, target: float) -> list:
    """The switching cases (module docstring) for the adapted modules ``first`` / ``second``
    (same targets, other factors; ``with_factors(module, seed)`` draws others) on input ``x``
    (the bench's batch; the request is ``x[:1]``)."""
    import onnxruntime as ort

    from onnxparam import Tensor, export_onnx, runtime, write_onnx_adapter

    rank = next(p.adapter().rank for _, p in first.named_params() if p.adapter() is not None)

    def session(path):
        return ort.InferenceSession(str(path), sess_options=config.session_options(),
                                    providers=["CPUExecutionProvider"])

    inputs_path = export_onnx(first, folder / f"r{rank}-switch-inputs.onnx", x, lora="inputs")
    merged_paths = [export_onnx(m, folder / f"r{rank}-switch-merge-{i}.onnx", x, lora="merge")
                    for i, m in enumerate((first, second))]
    loaded, options = [], []
    for i, module in enumerate((first, second)):
        adapter = ort.LoraAdapter()
        adapter.Load(str(write_onnx_adapter(module, folder / f"r{rank}-switch-{i}.onnx_adapter")))
        loaded.append(adapter)  # NOTE: RunOptions does not keep its adapters alive
        options.append(ort.RunOptions())
        options[-1].add_active_adapter(adapter)
    served = session(inputs_path)
    results = []
    # the switch alone (no run on either side): load the other adapter's file and activate it vs
    # build the session of the other adapter merged
    files = [folder / f"r{rank}-switch-{i}.onnx_adapter" for i in (0, 1)]
    turn = [0]

    def activate():
        turn[0] ^= 1
        adapter = ort.LoraAdapter()
        adapter.Load(str(files[turn[0]]))
        run_options = ort.RunOptions()
        run_options.add_active_adapter(adapter)
        return adapter, run_options

    def build():
        turn[0] ^= 1
        return session(merged_paths[turn[0]])

    activate(), build()
    t_ours, t_base = _median_pair(activate, build, repeats)
    results.append(Result("lora", f"r{rank} switch ORT, load + activate vs build", t_ours, t_base, target))
    named = first.set_adapter(None).add_adapter("one", first).add_adapter("two", second)
    for label, batch in (("batch", x), ("request", x[:1])):
        feeds = {"x": batch}
        turn = [0]

        def switch():
            turn[0] ^= 1
            return served.run(None, feeds, options[turn[0]])[0]

        def rebuild():
            turn[0] ^= 1
            return session(merged_paths[turn[0]]).run(None, feeds)[0]

        warm = [session(p) for p in merged_paths]
        for _ in range(2):
            switch(), rebuild()
        t_switch, t_new = _median_pair(switch, rebuild, repeats)
        t_run, _ = _median_pair(lambda: warm[0].run(None, feeds)[0], lambda: None, repeats)
        bound = t_run / t_new
        results.append(Result("lora", f"r{rank} switch ORT {label} [run/new {bound:.2f}]", t_switch, t_new, target))
        # the runtime: set_adapter between two named adapters in inputs mode (one session) vs a module
        # with another adapter in merge mode (a new session: fresh factors each call, none cached)
        xt = Tensor.from_numpy(batch)
        served_module = named.set_adapter("one")
        runtime.set_session_config(served_module, config.with_lora_mode("inputs"))
        pool = iter([with_factors(first, 100 + i) for i in range(repeats + 2)])
        flip = [0]

        def call_inputs():
            flip[0] ^= 1
            return served_module.set_adapter(("one", "two")[flip[0]])(xt).to_numpy()

        def call_merge():
            module = next(pool)
            runtime.set_session_config(module, config.with_lora_mode("merge"))
            return module(xt).to_numpy()

        runtime.set_cache_size(sessions=3)  # the inputs session stays; merge sessions are evicted
        try:
            before = runtime.stats()
            for _ in range(2):
                call_inputs(), call_merge()
            t_ours, t_base = _median_pair(call_inputs, call_merge, repeats)
        finally:
            runtime.set_cache_size(sessions=runtime.MAX_CACHED_SESSIONS)
        built = runtime.stats().sessions_built - before.sessions_built
        print(f"lora: r{rank} switch module {label}: {built} sessions built in {2 * (repeats + 2)} calls "
              f"(merge mode: one per call; inputs mode: none after its first)", file=sys.stderr)
        results.append(Result("lora", f"r{rank} switch module {label}", t_ours, t_base, target))
    return results
