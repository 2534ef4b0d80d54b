"""Helpers of ``tools/bench.py lora-batched``: switching the whole adapter set of a
``lora="batched"`` export without a new session (imported by :func:`bench.bench_lora_batched`;
nothing here runs on its own).

* ORT, IO binding, vs the same set: binding the other set than the previous run's vs binding
  the same set again, in one session.
* ORT, IO binding: one session of the batched export; a switch binds the other adapter set's
  stacks (``OrtValue`` s made once, as a server keeps its loaded sets) with
  ``IOBinding.bind_ortvalue_input``, then runs (``run_with_iobinding``; ONNX Runtime ignores
  active ``.onnx_adapter`` s under IO binding, so binding the stacks is how IO-binding serving
  switches), vs building a session of the batched export holding the other set (its stacks as
  the file's defaults) and one run.
* ``module(x, adapter_index=...)``: two modules with the same base, structure and adapter names
  but other factor values, called in turn (one session serves both: the stacks are fed), vs the
  same call on a copy of the module with fresh storage for every param (a new session, then the
  run; the trace is cached: it depends on the structure only).

Both sides include the run, so a ratio cannot be below ``run / (new + run)``: that bound is
printed beside each case, measured.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from bench_lora_serve import _median_pair  # one interleaved pair of medians for both lora benches


def bind_switch_cases(Result, modules, rows, x, config, folder, repeats: int, target: float,
                      steady_repeats: int, run_target: float) -> list:
    """The switching cases (module docstring) for ``modules``: two modules with the same named
    adapters (names, targets, ranks) and other factor values; ``rows``: the ``adapter_index``
    of the batch ``x``. First, in ORT, a run binding the other set than the previous run's vs
    runs binding the same set (``steady_repeats``, target ``run_target``): what the switch itself
    costs, without a session build between the runs evicting the served session's weights from
    the caches (the build-interleaved medians include that)."""
    import onnxruntime as ort

    from onnxparam import Param, Tensor, export_onnx, runtime
    from onnxparam.lora._batched_run import batched_adapter_params

    seq = x.shape[1]
    paths = [export_onnx(m, folder / f"bind-{i}.onnx", x, lora="batched") for i, m in enumerate(modules)]
    sets = [{name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))
             for name, value in batched_adapter_params(m, model=paths[0]).items()} for m in modules]

    def session(path):
        return ort.InferenceSession(str(path), sess_options=config.session_options(),
                                    providers=["CPUExecutionProvider"])

    served = session(paths[0])
    output = served.get_outputs()[0].name
    x_value = ort.OrtValue.ortvalue_from_numpy(x)
    index_value = ort.OrtValue.ortvalue_from_numpy(rows)
    binding = served.io_binding()
    turn = [0]

    def switch():
        turn[0] ^= 1
        binding.bind_ortvalue_input("x", x_value)
        binding.bind_ortvalue_input("adapter_index", index_value)
        for name, value in sets[turn[0]].items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(output, "cpu")
        served.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    def rebuild():
        turn[0] ^= 1
        return session(paths[turn[0]]).run(None, {"x": x, "adapter_index": rows})[0]

    # the bound sets give each set's own export's output (an independent session per set)
    for i in (1, 0):
        np.testing.assert_allclose(switch(), session(paths[i]).run(None, {"x": x, "adapter_index": rows})[0],
                                   rtol=1e-4, atol=1e-4)
    def same():
        binding.bind_ortvalue_input("x", x_value)
        binding.bind_ortvalue_input("adapter_index", index_value)
        for name, value in sets[0].items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(output, "cpu")
        served.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    t_switch, t_same = _median_pair(switch, same, steady_repeats)
    results = [Result("lora", f"batched switch ORT IO binding vs same set, seq {seq}", t_switch, t_same, run_target)]
    warm = session(paths[0])
    t_ours, t_new = _median_pair(switch, rebuild, repeats)
    t_run, _ = _median_pair(lambda: warm.run(None, {"x": x, "adapter_index": rows})[0], lambda: None, repeats)
    results.append(Result("lora", f"batched switch ORT IO binding, seq {seq} [run/new {t_run / t_new:.2f}]", t_ours,
                          t_new, target))

    xt = Tensor.from_numpy(x)
    for m in modules:
        runtime.set_session_config(m, config)
    flip = [0]

    def call_switch():
        flip[0] ^= 1
        return modules[flip[0]](xt, adapter_index=rows).to_numpy()

    def copy_of(module):  # the same module with fresh storage for every param: a new session
        fresh = module.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(np.array(p.val().to_numpy())),
                                                 require_grad=p.require_grad))
        runtime.set_session_config(fresh, config)
        return fresh

    pool = iter([copy_of(modules[i % 2]) for i in range(repeats + 3)])

    def call_new():
        return next(pool)(xt, adapter_index=rows).to_numpy()

    for i in (0, 1):  # the runtime agrees with the export of each set
        np.testing.assert_allclose(modules[i](xt, adapter_index=rows).to_numpy(),
                                   session(paths[i]).run(None, {"x": x, "adapter_index": rows})[0],
                                   rtol=1e-4, atol=1e-4)
    runtime.set_cache_size(sessions=3)  # the served session stays; each new one is evicted later
    try:
        before = runtime.stats()
        for _ in range(2):
            call_switch()
        steady = runtime.stats().sessions_built - before.sessions_built
        call_new()
        t_ours, t_new = _median_pair(call_switch, call_new, repeats)
        built = runtime.stats().sessions_built - before.sessions_built
        t_run = statistics.median(_time(lambda: modules[0](xt, adapter_index=rows), repeats))
    finally:
        runtime.set_cache_size(sessions=runtime.MAX_CACHED_SESSIONS)
    print(f"lora-batched: switch module(x, adapter_index=...) seq {seq}: {steady} sessions built by 2 switches "
          f"after the first calls, {built} in all ({repeats + 1} new-session calls): the stacks are fed, one session "
          "serves both sets", file=sys.stderr)
    results.append(Result("lora", f"batched switch module, seq {seq} [run/new {t_run / t_new:.2f}]", t_ours, t_new,
                          target))
    return results


def _time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times
