#!/usr/bin/env python
"""The project's benchmarks: ``python tools/bench.py [section ...] [--repeats N]``.

Each section measures onnxparam against a baseline measured *in the same run* (interleaved
repetitions, alternating which goes first, medians) and prints ratios with their targets.
Benchmarks are not tests: nothing here fails the suite; the exit code is 1 only when a ratio
misses its target, so CI can watch it.

Sections (add one by writing ``bench_<name>(args) -> list[Result]`` and listing it in
:data:`SECTIONS`):

* ``mnist``: forward latency of the MNIST module (``module(Tensor)`` -> numpy, through the
  runtime's cached session) vs a plain ``onnxruntime.InferenceSession`` on the graph exported
  from the same module, with the same session options, at batch 1 and 256. Targets: ratio
  <= 1.05 at batch 1, <= 1.01 at 256.
* ``convert``: ``onnxparam.convert.convert`` on a synthetic model of :data:`CONVERT_MODEL_BYTES`
  (1 GiB, float32 plus some float16 / int64 tensors; ``--convert-mib``) for every pair of
  formats: ``.bpk``, ``.safetensors``, ``.onnx`` (weights inline in the protobuf) and ``.pt``
  (``torch.save``; a source only, made when torch is installed), and ``.bpk -> .onnx`` into
  a template (``graph=`` the inline ``.onnx``: its weights replaced), each case in a fresh
  subprocess that first converts a small model of the same pair (imports paid), then times the
  big one; ``--convert-repeats`` times, each beside a run copying the case's source file once +
  fsync (alternating which goes first; files in the page cache); the time ratio is median /
  median of those pairs. Once more as the command line (``onnxparam convert SRC DST -q``: imports included,
  the whole process's RSS). Prints GB/s of tensor data, the time ratio
  (in process: target <= :data:`CONVERT_TIME_TARGET`) and the peak RSS growth split into
  anonymous and file-backed (the mapped source) pages; target: anonymous growth <=
  :data:`CONVERT_MEMORY_TARGET` x the largest tensor + :data:`CONVERT_MEMORY_SLACK`. Temporary
  files (~5 GiB at most) are removed at the end.
* ``lora``: a transformer encoder block (:class:`onnxparam.nn.TransformerEncoder`, one layer,
  ``d_model`` :data:`LORA_WIDTH`, ``d_ff`` 4x, :data:`LORA_HEADS` heads) on
  ``[`` :data:`LORA_BATCH` ``,`` :data:`LORA_SEQ` ``, d_model]``, LoRA on its six weight matrices
  (q, k, v, out, two feed-forward) at ranks :data:`LORA_RANKS`, exported in the three LoRA modes
  and run in plain ``onnxruntime.InferenceSession`` s (same options). ``keep`` and ``inputs``
  (with an adapter active through ``RunOptions.add_active_adapter``) vs ``merge``: target
  the floor (the factor ``MatMul`` s' share of the block's multiply-adds, counted from shapes,
  printed beside it) + :data:`LORA_OVERHEAD_POINTS`. Switching adapters
  (``tools/bench_lora_serve.py``): a run with the other ``.onnx_adapter`` active, and the
  runtime's ``module.set_adapter(other)(x)`` in ``"inputs"`` mode (no new session), vs building
  a session for the other adapter merged (and one run; ``"merge"`` mode in the runtime), at the
  bench's batch and at one request; target :data:`LORA_SWITCH_TARGET`. Many adapters in one
  batch (also alone as ``lora-batched``): four named adapters (:data:`LORA_BATCHED_RANKS`) over
  :data:`LORA_BATCHED_ROWS` rows in one ``lora="batched"`` run vs the four per-adapter runs of
  the ``"inputs"`` export (target :data:`LORA_BATCHED_SPLIT_TARGET`) and vs one ``"inputs"`` run
  of the same batch with one adapter (target :data:`LORA_BATCHED_SINGLE_TARGET`), pairwise and
  again in round robins with the base model alone at 8 rows and at the split's row groups
  (``tools/bench_lora_floor.py``: the floors, printed beside the ratios); then switching
  the whole adapter set of the batched export without a new session
  (``tools/bench_lora_bind.py``): other stacks bound with IO binding in ONNX Runtime, and
  ``module(x, adapter_index=...)`` of a module with other factors, vs a new session (target
  :data:`LORA_SWITCH_TARGET`), and the bound switch vs binding the same set
  (:data:`LORA_SWITCH_RUN_TARGET`); and at one token per row ``module(x, adapter_index=...)`` vs
  a plain run of the batched export (target :data:`LORA_BATCHED_MODULE_TARGET`).
* ``train``: one MNIST training step at batch :data:`TRAIN_BATCH` (``autodiff.grad`` +
  ``optim.Adam.step``; all params, and LoRA rank 4 on the linear layers) vs the same step in
  PyTorch (same weights, eval-mode BatchNorm, ``torch.optim.Adam``), target
  :data:`TRAIN_TARGET`. Without PyTorch it prints ``torch not installed`` and our step times.
  Then ``tools/bench_train.py``: BERT-tiny and ResNet18 built in torch (random weights), exported,
  imported, fine-tuned (all params, Adam) vs the same torch models' eager steps: time (ratio of
  interleaved medians, target 1.0), peak RSS growth of a step in child processes (target 1.3;
  also with the encoder layers / residual stages marked for recomputation), and the training
  sessions built at three batch sizes (target 1).
* ``quant``: ``tools/bench_quant.py``: a ResNet-like conv net, a transformer block and the MNIST
  model, each as float32, the default int8 export, calibrated static int8, 4-bit, and ONNX
  Runtime's ``quantize_dynamic`` / ``quantize_static`` / ``MatMulNBitsQuantizer``, timed
  interleaved (ratio of medians vs float32); file sizes, cosine vs float32, MNIST accuracy.
  Targets: default <= 1.0 everywhere, static conv net <= 0.5, every onnxparam variant no slower
  than the matching ORT tool. Then ``tools/bench_quant_memory.py``: ``onnxparam quantize`` of a
  ``--convert-mib`` (1 GiB) external-data model, peak ``RssAnon`` growth in process (target 1.2 x
  the largest tensor + 100 MiB) and as a process vs ORT's ``quantize_dynamic``.
* ``import``: :func:`bench_import`: the imported PP-OCRv4 detector (``tests/data/onnx``) called at
  :data:`IMPORT_SIZES` (32 input sizes, the largest first): sessions built (target 1, the graph's
  dynamic dims serve every size) and peak RSS over the 32 calls vs RSS after the first call
  (target <= :data:`IMPORT_RSS_TARGET`).
* ``export``: ``tools/bench_export.py``: peak RSS growth of ``export_onnx`` (anonymous / file
  pages, and / the model's bytes) for a module loaded from a ``.bpk`` and for an imported inline
  ``.onnx`` whose shape initializers sit between its weights (``--convert-mib`` of weights);
  target: anonymous growth <= 1.2 x the largest tensor + 100 MiB.
* ``dynamic``: ``tools/bench_dynamic.py``: a transformer block's ``module(x)`` at new shapes vs
  plain ORT on its dynamic export: first-call and new-shape latency, sessions built and peak RSS
  over 32 shapes (targets: 2 sessions, RSS <= 1.2x the first call's).
* ``inspect``: :func:`bench_inspect`: ``onnxparam inspect --no-count`` of an inline ``.onnx`` of
  :data:`INSPECT_MODEL_BYTES` vs ``onnx.load`` of it, fresh processes: time (target
  :data:`INSPECT_TIME_TARGET`) and peak anonymous RSS (target :data:`INSPECT_MEMORY_TARGET`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Result:
    """One measured comparison: ``ratio = ours_s / baseline_s`` (lower is better)."""

    section: str
    case: str
    ours_s: float
    baseline_s: float
    target: float
    unit: str = "ms"
    """How ``ours_s`` / ``baseline_s`` print: ``"ms"`` (seconds shown as ms) or ``"MiB"`` (bytes)."""

    def show(self, value: float) -> str:
        if self.unit == "count":
            return f"{value:8.0f}   "
        return f"{value / 2**20:8.1f} MiB" if self.unit == "MiB" else f"{value * 1e3:8.3f} ms"

    @property
    def ratio(self) -> float:
        return self.ours_s / self.baseline_s

    @property
    def ok(self) -> bool:
        return self.ratio <= self.target


def interleaved_medians(ours: Callable[[], object], baseline: Callable[[], object], repeats: int,
                        warmup: int = 5, clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Median seconds of ``ours()`` and ``baseline()``, timed alternately (the order swaps
    every repetition so neither always runs on a warmer cache). ``clock``: wall time by default;
    ``time.thread_time`` for this thread's CPU time (with one intra-op thread ONNX Runtime runs
    every kernel on the calling thread, so on a loaded machine the time others take the CPU is
    left out: wall-clock medians there mix in preemption, which hits a longer run more often)."""
    for _ in range(warmup):
        ours()
        baseline()
    t_ours, t_base = [], []
    for i in range(repeats):
        pair = ((ours, t_ours), (baseline, t_base))
        for fn, times in (pair if i % 2 == 0 else pair[::-1]):
            t0 = clock()
            fn()
            times.append(clock() - t0)
    return statistics.median(t_ours), statistics.median(t_base)


# -- sections -----------------------------------------------------------------------------------

MNIST_TARGETS = {1: 1.05, 256: 1.01}
"""Batch size -> the highest acceptable ``module / plain session`` latency ratio."""


def bench_mnist(args: argparse.Namespace) -> list[Result]:
    import onnxruntime as ort

    from onnxparam import Tensor, runtime
    from onnxparam.cli import export_mnist_onnx
    from onnxparam.zoo import mnist

    config = runtime.SessionConfig(intra_op_num_threads=args.threads)
    model = mnist.load_pretrained()
    runtime.set_session_config(model, config)
    images, _ = mnist.load_digits()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mnist.onnx"
        export_mnist_onnx(model, path)
        session = ort.InferenceSession(str(path), sess_options=config.session_options(),
                                       providers=["CPUExecutionProvider"])
        input_name = session.get_inputs()[0].name
        for batch, target in MNIST_TARGETS.items():
            x = np.ascontiguousarray(images[:batch].astype(np.float32))
            # NOTE: each side gets its input in its own API's type, made outside the timing: a
            # Tensor for the module (wrapping is zero-copy, ~3 us), a numpy array for the
            # session; both return numpy.
            xt = Tensor.from_numpy(x)
            repeats = args.repeats if batch == 1 else max(args.repeats // 10, 20)

            def ours(_x=xt):
                return model(_x).to_numpy()

            def plain(_x=x):
                return session.run(None, {input_name: _x})[0]

            np.testing.assert_allclose(ours(), plain(), rtol=1e-5, atol=1e-5)
            t_ours, t_plain = interleaved_medians(ours, plain, repeats)
            results.append(Result("mnist", f"forward batch {batch}", t_ours, t_plain, target))
    return results


CONVERT_MODEL_BYTES = 2**30
"""Tensor bytes of the synthetic model (default 1 GiB; ``--convert-mib`` changes it), so the
file is far larger than any one tensor."""
CONVERT_LARGEST_SHAPE = (4096, 4096)
"""The largest tensors: float32 (4096, 4096) = 64 MiB each (plus smaller ones)."""
CONVERT_TIME_TARGET = 2.0
"""In-process conversion time / (copying the file once + fsync). Both read and write every
byte once (page cache to page cache) and fsync the target; a conversion also plans offsets,
decodes headers and writes per tensor."""
CONVERT_MEMORY_TARGET = 1.2
"""Peak RSS growth minus the file-backed pages (the mapped source) <= this x the largest tensor
+ :data:`CONVERT_MEMORY_SLACK`: memory bounded by one tensor plus a margin."""
CONVERT_MEMORY_SLACK = 100 * 2**20
CONVERT_SOURCES = {"bpk": "model.bpk", "safetensors": "model.safetensors", "onnx": "model.onnx", "pt": "model.pt"}
"""Source format -> file in the bench folder (``.onnx``: weights inline in the protobuf;
``.pt``: ``torch.save`` of the state dict, written only when torch is installed)."""
CONVERT_TARGETS = {"bpk": "out.bpk", "safetensors": "out.safetensors", "onnx": "out.onnx"}
GRAPH_CASE = "bpk->onnx graph="
"""``convert(model.bpk, out.onnx, graph=model.onnx)``: a template's weights replaced (streamed)."""
CONVERT_WARM = "warm"
"""Sub-folder of the bench folder holding the small model each case process converts first."""
CONVERT_WARM_BYTES = 8 * 2**20
COPY_OF = "copy of "
"""Case-name prefix of a baseline run: the named case's source file copied + fsync."""
CONVERT_CASE_FLAG = "--run-convert-case"
"""Internal: ``bench.py --run-convert-case CASE FOLDER`` runs one case and prints JSON."""
RSS_SAMPLE_S = 0.002
RSS_KEYS = ("VmRSS", "RssAnon", "RssFile")


def _convert_cases(with_pt: bool) -> dict:
    """case -> (source file, target file): every pair of formats, ``.pt`` as a source only."""
    cases = {"copy": ("model.bpk", "copy.bpk")}
    for src, src_file in CONVERT_SOURCES.items():
        if src == "pt" and not with_pt:
            continue
        for dst, dst_file in CONVERT_TARGETS.items():
            if src != dst:
                cases[f"{src}->{dst}"] = (src_file, dst_file)
    cases[GRAPH_CASE] = (CONVERT_SOURCES["bpk"], CONVERT_TARGETS["onnx"])  # the inline .onnx as the template
    return cases


def _synthetic_tensors(model_bytes: int = CONVERT_MODEL_BYTES, largest=CONVERT_LARGEST_SHAPE):
    """``(name, shape, dtype)`` of the synthetic model, data order; ``model_bytes`` of tensor data."""
    big = int(np.prod(largest)) * 4
    tensors, total, i = [], 0, 0
    while total + big <= model_bytes - model_bytes // 64:
        tensors.append((f"layers.{i}.weight", largest, np.float32))
        tensors.append((f"layers.{i}.bias", (largest[1],), np.float32))
        total += big + largest[1] * 4
        i += 1
    rest = model_bytes - total
    head_rows = rest // 2 // (largest[1] * 2)
    tensors.append(("head.weight", (head_rows, largest[1]), np.float16))
    tensors.append(("head.steps", (-(-(rest - head_rows * largest[1] * 2) // 8),), np.int64))  # rounded up
    return tensors


def _rss_kib(pid="self") -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in RSS_KEYS}


def _copy_fsync(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def _run_convert_case(case: str, folder: str) -> int:
    """One case in this (fresh) process: seconds and RSS before / peak (sampled every 2 ms).

    The same pair is first converted once on the small model in ``folder/warm`` (imports and
    first-call set-up paid, as in a program that converts more than once); the CLI line of the
    section measures the cold command."""
    from onnxparam.convert import convert

    copying = case.startswith(COPY_OF)
    if copying:  # the baseline of a case: its source file copied once + fsync
        src, dst = Path(folder) / _convert_cases(True)[case[len(COPY_OF):]][0], Path(folder) / "copy.bin"
        case = "copy"
    else:
        src, dst = (Path(folder) / name for name in _convert_cases(True)[case])
    warm = src.parent / CONVERT_WARM
    graph = {"graph": src.parent / CONVERT_SOURCES["onnx"]} if case == GRAPH_CASE else {}
    if case == "copy":
        _copy_fsync(warm / src.name, warm / dst.name)
    else:
        convert(warm / src.name, warm / dst.name, **({"graph": warm / CONVERT_SOURCES["onnx"]} if graph else {}))
    _remove_target(dst.parent / CONVERT_WARM, dst.name)
    start = _rss_kib()
    peak = dict(start)
    done = threading.Event()

    def sample():
        while not done.is_set():
            for k, v in _rss_kib().items():
                peak[k] = max(peak[k], v)
            time.sleep(RSS_SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if case == "copy":
        _copy_fsync(src, dst)
    else:
        convert(src, dst, **graph)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    for k, v in _rss_kib().items():
        peak[k] = max(peak[k], v)
    print(json.dumps({"seconds": seconds, "start": start, "peak": peak}))
    return 0


def _child_env() -> dict:
    """The environment of the case processes: this checkout's ``onnxparam`` first on the path."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run_case_process(case: str, folder: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, CONVERT_CASE_FLAG, case, str(folder)],
                         capture_output=True, text=True, check=True, env=_child_env())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_cli_case(src: Path, dst: Path, graph: "Path | None" = None) -> dict:
    """``onnxparam convert SRC DST -q`` as a command: wall seconds (imports included) and the
    child's peak RSS (sampled from /proc every 2 ms; start = 0, the whole process)."""
    extra = ["--graph", str(graph)] if graph is not None else []
    run = _child_peak([sys.executable, "-m", "onnxparam", "convert", str(src), str(dst), "-q", *extra], env=_child_env())
    return {**run, "start": dict.fromkeys(RSS_KEYS, 0)}


def _median_run(runs: list) -> dict:
    """The run of median seconds (its RSS figures with it)."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return ordered[(len(ordered) - 1) // 2]


def _remove_target(folder: Path, name: str) -> None:
    for path in folder.glob(name + "*"):
        path.unlink()


def _write_sources(folder: Path, tensors: list) -> bool:
    """The ``.bpk`` (random data), then the other sources from it, and the same formats of a
    small model in ``folder/warm``; ``False`` when torch (for the ``.pt``) is missing."""
    (folder / CONVERT_WARM).mkdir(exist_ok=True)
    _write_source_files(folder / CONVERT_WARM, _synthetic_tensors(CONVERT_WARM_BYTES, (512, 512)))
    return _write_source_files(folder, tensors)


def _write_source_files(folder: Path, tensors: list) -> bool:
    from onnxparam import burnpack
    from onnxparam.convert import convert

    rng = np.random.default_rng(0)

    def entry(name, shape, dt):
        def data(_shape=shape, _dt=dt):
            if np.dtype(_dt).kind == "f":
                return rng.standard_normal(_shape, dtype=np.float32).astype(_dt, copy=False)
            return np.arange(int(np.prod(_shape)), dtype=_dt).reshape(_shape)

        return burnpack.TensorEntry(name, _dtype(dt), shape, data, param_id=len(name))

    burnpack.write(folder / "model.bpk", (entry(*t) for t in tensors), metadata={"model": "synthetic"})
    convert(folder / "model.bpk", folder / "model.safetensors")
    convert(folder / "model.bpk", folder / "model.onnx")
    try:
        import torch
    except ImportError:
        return False
    from onnxparam.convert import read_record

    record = read_record(folder / "model.bpk")
    state = {name: torch.from_numpy(np.array(snap.to_data().to_numpy())) for name, snap in record.items()}
    torch.save(state, folder / "model.pt")
    del state
    return True


def bench_convert(args: argparse.Namespace) -> list[Result]:
    model_bytes = args.convert_mib * 2**20
    tensors = _synthetic_tensors(model_bytes)
    largest = max(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in tensors)
    data_bytes = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in tensors)
    memory_limit = CONVERT_MEMORY_TARGET * largest + CONVERT_MEMORY_SLACK
    results = []
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-convert-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        with_pt = _write_sources(folder, tensors)
        cases = _convert_cases(with_pt)
        size = (folder / "model.bpk").stat().st_size
        print(f"convert: synthetic model {len(tensors)} tensors, {data_bytes / 2**30:.2f} GiB of tensor data, "
              f"largest tensor {largest / 2**20:.0f} MiB; .bpk {size:,} bytes (setup {time.perf_counter() - t0:.1f} s)"
              + ("" if with_pt else "; torch not installed: no .pt cases"), file=sys.stderr)
        runs: dict = {case: [] for case in cases}
        copies: dict = {case: [] for case in cases if case != "copy"}
        cli: dict = {}
        for repeat in range(args.convert_repeats):
            for case, (src, dst) in cases.items():
                if case == "copy":
                    continue
                # NOTE: the copy baseline runs beside each case, first or second by turns, so
                # both see the same load on a shared machine: the ratio is of medians of pairs.
                # NOTE: the baseline copies the case's own source file, so both read the same
                # pages (a source read less often may have left the page cache).
                for which in ((COPY_OF + case, case) if repeat % 2 == 0 else (case, COPY_OF + case)):
                    run = _run_case_process(which, folder)
                    if which == case:
                        runs[case].append(run)
                    else:
                        runs["copy"].append(run)
                        copies[case].append(run)
                    _remove_target(folder, "copy.bin" if which != case else dst)
                if repeat == 0:
                    template = folder / CONVERT_SOURCES["onnx"] if case == GRAPH_CASE else None
                    cli[case] = _run_cli_case(folder / src, folder / dst, template)
                    _remove_target(folder, dst)
        best = {case: _median_run(case_runs) for case, case_runs in runs.items()}
        copy_s = best["copy"]["seconds"]
        print(f"convert: copy + fsync {size / copy_s / 1e9:.2f} GB/s ({copy_s:.2f} s); memory target: growth less "
              f"file-backed pages <= {memory_limit / 2**20:.0f} MiB", file=sys.stderr)
        print(f"convert: {'case':<22} {'GB/s':>6} {'s':>6} {'x copy':>6}  peak RSS growth MiB: {'anon':>7} "
              f"{'file':>7} {'all':>7}", file=sys.stderr)
        for case in cases:
            if case == "copy":
                continue
            paired_copy = statistics.median(r["seconds"] for r in copies[case])
            for how, run in (("in process", best[case]), ("CLI", cli[case])):
                growth = {k: (run["peak"][k] - run["start"][k]) * 1024 for k in RSS_KEYS}
                print(f"convert: {case + ' ' + how:<22} {data_bytes / run['seconds'] / 1e9:6.2f} {run['seconds']:6.2f} "
                      f"{run['seconds'] / paired_copy:6.2f}  {'':>19}{growth['RssAnon'] / 2**20:7.1f} "
                      f"{growth['RssFile'] / 2**20:7.1f} {growth['VmRSS'] / 2**20:7.1f}", file=sys.stderr)
            results.append(Result("convert", f"{case} time", best[case]["seconds"], paired_copy, CONVERT_TIME_TARGET))
            anon = max(r["peak"]["RssAnon"] - r["start"]["RssAnon"] for r in runs[case]) * 1024  # the worst run
            results.append(Result("convert", f"{case} memory", float(anon), memory_limit, 1.0, unit="MiB"))
    return results


LORA_WIDTH = 512
LORA_HEADS = 8
LORA_SEQ = 64
LORA_BATCH = 4
LORA_RANKS = (8, 16)
LORA_OVERHEAD_POINTS = 0.03
"""kept / inputs latency over merged: at most the floor + 3 points. The floor is the LoRA
branch's share of the block's multiply-adds (``r * (d_in + d_out)`` per row and weight, counted
from the shapes of one run: :func:`bench_lora_serve.factor_share`); on top of it each adapted
weight adds an ``Add`` of its output (memory-bound) and the two skinny ``MatMul`` s run below
the big ones' efficiency. The scale is folded into ``b`` (a constant ORT folds in ``keep``; in
the fed ``b`` for ``inputs``)."""
LORA_SWITCH_TARGET = 0.25
"""Switching adapters / a new session for the other adapter: a run with the other
``.onnx_adapter`` active (ORT) or ``module.set_adapter(other)(x)`` in ``"inputs"`` mode (the
runtime) vs building a session of the other adapter merged and running it once. Both sides include
the run, which bounds the ratio from below by ``run / (build + run)`` (printed beside each case as
``run/new``): at the bench's batch the run is a large part, at one request (batch 1) the build
dominates."""
LORA_SWITCH_RUN_TARGET = 1.05
"""A run with the other adapter than the previous run's / runs with the same adapter: what
switching costs in one session (ORT feeds the adapter's tensors; nothing is rebuilt)."""


def bench_lora(args: argparse.Namespace) -> list[Result]:
    import onnxruntime as ort

    from onnxparam import LoraConfig, Param, ParamGroup, Tensor, export_onnx, runtime, write_onnx_adapter
    from onnxparam.nn import TransformerEncoder

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_lora_serve import factor_share, kernel_share, switch_cases

    def with_factors(module, seed):
        rng = np.random.default_rng(seed)
        return module.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(
            rng.normal(0, 0.05, size=p.lazy_shape()).astype(np.float32)), require_grad=p.require_grad)
            if path.endswith((".lora.a", ".lora.b")) else p)

    config = runtime.SessionConfig(intra_op_num_threads=args.threads)
    x = np.random.default_rng(0).normal(size=(LORA_BATCH, LORA_SEQ, LORA_WIDTH)).astype(np.float32)
    base = TransformerEncoder(LORA_WIDTH, 4 * LORA_WIDTH, LORA_HEADS, 1, dropout=0.0)
    weights = ParamGroup.from_regex(r"\.(mha|pwff)\.[a-z_]+\.weight$")
    results = []
    repeats = max(args.repeats // 5, 20)
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-lora-") as tmp:
        folder = Path(tmp)

        def session(path):
            return ort.InferenceSession(str(path), sess_options=config.session_options(),
                                        providers=["CPUExecutionProvider"])

        for rank in LORA_RANKS:
            first = with_factors(base.apply_lora(LoraConfig(rank=rank, alpha=2.0 * rank, seed=0,
                                                            param_group=weights)), 1)
            second = with_factors(first, 2)
            paths = {mode: export_onnx(first, folder / f"r{rank}-{mode}.onnx", x, lora=mode)
                     for mode in ("merge", "keep", "inputs")}
            lora_macs, all_macs = factor_share(paths["keep"], {"x": x})
            floor = 1.0 + lora_macs / (all_macs - lora_macs)
            print(f"lora: r{rank}: the factor MatMuls are {100 * lora_macs / all_macs:.2f}% of the block's "
                  f"multiply-adds ({lora_macs / 1e6:.1f}M of {all_macs / 1e6:.1f}M): keep / inputs vs merge "
                  f">= {floor:.3f}; target <= floor + {100 * LORA_OVERHEAD_POINTS:.0f} points", file=sys.stderr)
            adapters, loaded = [], []
            for i, module in enumerate((first, second)):
                file = write_onnx_adapter(module, folder / f"r{rank}-{i}.onnx_adapter")
                adapter = ort.LoraAdapter()
                adapter.Load(str(file))
                loaded.append(adapter)  # NOTE: RunOptions does not keep its adapters alive
                options = ort.RunOptions()
                options.add_active_adapter(adapter)
                adapters.append(options)
            sessions = {mode: session(path) for mode, path in paths.items()}

            def plain(mode, options=None):
                return lambda: sessions[mode].run(None, {"x": x}, options)[0]

            reference = plain("merge")()
            for mode, options in (("keep", None), ("inputs", adapters[0])):
                np.testing.assert_allclose(plain(mode, options)(), reference, rtol=1e-3, atol=1e-3)
                lora_s, all_s = kernel_share(paths[mode], {"x": x}, config.session_options(), repeats, options)
                print(f"lora: r{rank} {mode}: the LoRA nodes take {100 * lora_s / all_s:.2f}% of ONNX Runtime's "
                      f"kernel time (profiler, node medians): {lora_s / (all_s - lora_s):+.3f} over the rest "
                      f"(floor {floor - 1:+.3f})", file=sys.stderr)
                t_ours, t_base = interleaved_medians(plain(mode, options), plain("merge"), repeats)
                results.append(Result("lora", f"r{rank} {mode} vs merge [floor {floor:.3f}]", t_ours, t_base,
                                      floor + LORA_OVERHEAD_POINTS))
            turn = [0]

            def switch():
                turn[0] ^= 1
                return sessions["inputs"].run(None, {"x": x}, adapters[turn[0]])[0]

            def steady():
                return sessions["inputs"].run(None, {"x": x}, adapters[0])[0]

            t_ours, t_base = interleaved_medians(switch, steady, repeats)
            results.append(Result("lora", f"r{rank} switch vs same adapter", t_ours, t_base, LORA_SWITCH_RUN_TARGET))
            results += switch_cases(Result, first, second, with_factors, x, config, folder, max(repeats // 10, 5),
                                    LORA_SWITCH_TARGET)
    return results + bench_lora_batched(args)


LORA_BATCHED_ROWS = 8
LORA_BATCHED_RANKS = (8, 16, 8, 16)
"""The ``lora`` section's batched case: four named adapters (these ranks, so the stacks are
zero-padded to 16) over a batch of :data:`LORA_BATCHED_ROWS` rows, two rows each."""
LORA_BATCHED_SEQS = (LORA_SEQ, 1)
"""Rows of :data:`LORA_SEQ` tokens (a prompt: compute-bound, each split run does its share of
the same multiply-adds) and of one token (a decoding step: each split run reads every weight
again, and the run's fixed cost repeats)."""
LORA_BATCHED_SPLIT_TARGET = 0.5
"""One ``lora="batched"`` run of the whole mixed batch / the four runs a server makes with the
``"inputs"`` export and ONNX Runtime's adapters (one run per adapter, its rows only). At one token
per row the split runs each read every base weight again and repeat a run's fixed cost: measured
0.49-0.64 shuffled, 0.59-0.87 hot (thread CPU time, one thread, 1-minute load 2-9 on 2 shared
cores). It is (batched / one ``"inputs"`` run) x (one ``"inputs"`` run / the split runs), and the
second factor, printed beside it (``tools/bench_lora_floor.py``, same round robin), is the base
model's: 0.40-0.47 shuffled, 0.48-0.66 hot; the base alone at 8 rows / 4 base runs of 2 rows
0.40-0.45 shuffled, 0.43-0.72 hot. At 0.5 or above, the target is out of reach for any LoRA graph.
At :data:`LORA_SEQ` tokens the split runs do the same multiply-adds as the batched one, so the
ratio's floor is about 1.0 there (measured 0.95-1.02): the target can be met at seq 1 only."""

LORA_BATCHED_SINGLE_TARGET = 1.15
"""One batched run of the mixed batch / one ``"inputs"`` run of the same batch with one adapter
(the rank-16 one: the batched graph multiplies at the padded rank 16 for every row). Missed at
one token per row: measured 1.20-1.38 (thread CPU time, load 2-9; 1.14 once in a blocked run). The
batched run reads each row's factors (four adapters' bytes instead of one's) and first copies them
(per-row ``Gather`` s, 1-14%): the same graph without its gathers, printed beside it, measured
1.14-1.27. Every other form measured (``tools/bench_lora_forms.py``: masking every slot, rows grouped
by slot, one wide adapter holding the four adapters' bytes, an ``If`` choosing per run) is as slow,
or slower at 64 tokens, at a larger capacity or on a skewed batch, and none reached 1.15 in most
runs (:mod:`onnxparam.lora._batched`, "Cost")."""


LORA_BATCHED_MODULE_TARGET = 1.05
"""``module(x, adapter_index=rows)`` / a plain ONNX Runtime run of the batched export on the same
batch (the module's session feeds the stacks; the plain one reads its defaults): the runtime's
overhead, as :data:`MNIST_TARGETS` at batch 1."""


def lora_batched_base():
    """The ``lora-batched`` cases' base model: one transformer encoder layer of width
    :data:`LORA_WIDTH` (feed-forward 4x), :data:`LORA_HEADS` heads, no dropout."""
    from onnxparam.nn import TransformerEncoder

    return TransformerEncoder(LORA_WIDTH, 4 * LORA_WIDTH, LORA_HEADS, 1, dropout=0.0)


def adapter_run_options(module, names, folder):
    """``(run options, adapters)``: one ``RunOptions`` per adapter of ``names`` with that adapter's
    ``.onnx_adapter`` (written into ``folder``) active, for runs of an ``"inputs"`` export; keep the
    ``LoraAdapter`` s alive as long as the options (``RunOptions`` does not)."""
    import onnxruntime as ort

    from onnxparam import write_onnx_adapter

    options, adapters = [], []
    for name in names:
        adapters.append(ort.LoraAdapter())
        adapters[-1].Load(str(write_onnx_adapter(module, folder / f"{name}.onnx_adapter", adapter_name=name)))
        options.append(ort.RunOptions())
        options[-1].add_active_adapter(adapters[-1])
    return options, adapters


def lora_batched_adapters(base, seed: int):
    """``(module, names)``: ``base`` with the named adapters of :data:`LORA_BATCHED_RANKS` on its
    attention and feed-forward weights (``alpha = 2 * rank``), factors drawn from ``seed``."""
    from onnxparam import LoraConfig, Param, ParamGroup, Tensor

    weights = ParamGroup.from_regex(r"\.(mha|pwff)\.[a-z_]+\.weight$")
    module, names = base, []
    for i, rank in enumerate(LORA_BATCHED_RANKS):
        rng = np.random.default_rng(seed + i)
        adapted = base.apply_lora(LoraConfig(rank=rank, alpha=2.0 * rank, seed=i, param_group=weights)).map(
            lambda path, p: Param(p.id, value=Tensor.from_numpy(rng.normal(0, 0.05, size=p.lazy_shape()).astype(
                np.float32))) if path.endswith((".lora.a", ".lora.b")) else p)
        names.append(f"a{i}-r{rank}")
        module = module.add_adapter(names[-1], adapted)
    return module, names


def bench_lora_batched(args: argparse.Namespace) -> list[Result]:
    """Many adapters in one batch (the ``lora`` section runs it; ``lora-batched`` alone), at
    each sequence length of :data:`LORA_BATCHED_SEQS`."""
    from onnxparam import runtime

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_lora_bind import bind_switch_cases

    config = runtime.SessionConfig(intra_op_num_threads=args.threads)
    base = lora_batched_base()
    module, names = lora_batched_adapters(base, 100)
    rows = np.repeat(np.arange(1, len(names) + 1), LORA_BATCHED_ROWS // len(names)).astype(np.int64)
    results = []
    for seq in LORA_BATCHED_SEQS:
        x = np.random.default_rng(0).normal(size=(LORA_BATCHED_ROWS, seq, LORA_WIDTH)).astype(np.float32)
        repeats = max(args.repeats // 5, 20) if seq > 1 else args.repeats
        results += _bench_lora_batched_at(module, names, rows, x, config, repeats, base)
    x = np.random.default_rng(0).normal(size=(LORA_BATCHED_ROWS, 1, LORA_WIDTH)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-lora-bind-") as tmp:
        results += bind_switch_cases(Result, (module, lora_batched_adapters(base, 200)[0]), rows, x, config, Path(tmp),
                                     max(args.repeats // 20, 5), LORA_SWITCH_TARGET, args.repeats,
                                     LORA_SWITCH_RUN_TARGET)
    return results


def _bench_lora_batched_at(module, names, rows, x, config, repeats, base) -> list[Result]:
    import onnxruntime as ort

    from bench_lora_floor import floor_cases, without_gathers

    from onnxparam import export_onnx

    results, seq = [], x.shape[1]
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-lora-batched-") as tmp:
        folder = Path(tmp)

        def session(path):
            return ort.InferenceSession(str(path), sess_options=config.session_options(),
                                        providers=["CPUExecutionProvider"])

        batched = session(export_onnx(module, folder / "batched.onnx", x, lora="batched"))
        inputs = session(export_onnx(module, folder / "inputs.onnx", x, lora="inputs"))
        plain = session(export_onnx(base, folder / "base.onnx", x))  # the base alone: the floors
        plain_input = plain.get_inputs()[0].name
        options, keep = adapter_run_options(module, names, folder)
        parts = [np.flatnonzero(rows == k + 1) for k in range(len(names))]

        def one_batched():
            return batched.run(None, {"x": x, "adapter_index": rows})[0]

        def split():
            return [inputs.run(None, {"x": x[part]}, options[k])[0] for k, part in enumerate(parts)]

        def single():
            return inputs.run(None, {"x": x}, options[1])[0]

        got, expected = one_batched(), split()
        for k, part in enumerate(parts):  # each row equals its adapter's own run
            np.testing.assert_allclose(got[part], expected[k], rtol=1e-3, atol=1e-3)
        load = os.getloadavg()[0]
        # with one intra-op thread ORT runs on this thread: its CPU time leaves out the preemption
        # that wall-clock medians mix in on a loaded machine (it hits the longer runs more often)
        clock = time.thread_time if config.intra_op_num_threads == 1 else time.perf_counter
        clocked = ", thread CPU time" if clock is time.thread_time else ""
        t_ours, t_base = interleaved_medians(one_batched, split, repeats, clock=clock)
        results.append(Result("lora", f"batched {LORA_BATCHED_ROWS} rows / {len(names)} adapters vs "
                                      f"{len(names)} split inputs runs, seq {seq}{clocked}", t_ours, t_base,
                              LORA_BATCHED_SPLIT_TARGET))
        t_ours, t_base = interleaved_medians(one_batched, single, repeats, clock=clock)
        results.append(Result("lora", f"batched vs one r16 inputs run, {LORA_BATCHED_ROWS} rows, seq {seq}{clocked}",
                              t_ours, t_base, LORA_BATCHED_SINGLE_TARGET))
        # the floors (tools/bench_lora_floor.py): the base alone and one adapter, in the same round robin
        fns = {"batched": one_batched, "split": split, "single": single,
               "base": lambda: plain.run(None, {plain_input: x}),
               "base split": lambda: [plain.run(None, {plain_input: x[part]}) for part in parts]}
        bound = session(without_gathers(folder / "batched.onnx", rows, folder / "no-gathers.onnx"))
        np.testing.assert_allclose(bound.run(None, {"x": x, "adapter_index": rows})[0], got, rtol=1e-5, atol=1e-5)
        fns["no gathers"] = lambda: bound.run(None, {"x": x, "adapter_index": rows})
        results += floor_cases(Result, fns, seq, repeats, clock, LORA_BATCHED_SPLIT_TARGET,
                               LORA_BATCHED_SINGLE_TARGET, lambda: os.getloadavg()[0])
        if seq == 1:  # the runtime's call of the same batch: its own session, the stacks fed
            from onnxparam import Tensor, runtime

            runtime.set_session_config(module, config)
            xt = Tensor.from_numpy(x)
            np.testing.assert_allclose(module(xt, adapter_index=rows).to_numpy(), got, rtol=1e-4, atol=1e-4)
            t_ours, t_base = interleaved_medians(lambda: module(xt, adapter_index=rows), one_batched, repeats,
                                                 clock=clock)
            results.append(Result("lora", f"batched module(x, adapter_index=...) vs its ORT run, seq {seq}{clocked}",
                                  t_ours, t_base, LORA_BATCHED_MODULE_TARGET))
        print(f"lora-batched seq {seq}: 1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} after "
              f"({os.cpu_count()} CPUs)", file=sys.stderr)
    return results


def _dtype(np_dtype):
    from onnxparam import DType

    return DType.from_numpy(np.dtype(np_dtype))


TRAIN_BATCH = 64
"""Batch size of the ``train`` section's steps."""
TRAIN_TARGET = 2.0
"""``onnxparam / PyTorch`` time of one training step (forward + backward + Adam update on the
same model, weights, batch and thread count). Provisional: no measurement against PyTorch has
been made in this environment yet."""


def _torch_mnist(model, lora_rank: int = 0, lora_alpha: float = 0.0):
    """The MNIST module as a PyTorch ``nn.Module`` holding the same weights (Linear weights
    transposed to PyTorch's ``(out, in)``; BatchNorm in eval mode = the inference form), and
    the list of its trainable params (every param, or the LoRA factors with the base frozen)."""
    import torch
    from torch import nn as tnn

    def t(param):
        return torch.from_numpy(np.array(param.base().to_numpy(), dtype=np.float32))

    class Block(tnn.Module):
        def __init__(self, block):
            super().__init__()
            w = t(block.conv.weight)
            self.conv = tnn.Conv2d(w.shape[1], w.shape[0], tuple(w.shape[2:]))
            self.norm = tnn.BatchNorm2d(w.shape[0], eps=block.norm.epsilon)
            with torch.no_grad():
                self.conv.weight.copy_(w)
                self.conv.bias.copy_(t(block.conv.bias))
                self.norm.weight.copy_(t(block.norm.gamma))
                self.norm.bias.copy_(t(block.norm.beta))
                self.norm.running_mean.copy_(t(block.norm.running_mean))
                self.norm.running_var.copy_(t(block.norm.running_var))

        def forward(self, x):
            return torch.nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2, 2)

    class Linear(tnn.Module):
        def __init__(self, linear):
            super().__init__()
            self.weight = tnn.Parameter(t(linear.weight).T.contiguous())
            self.bias = tnn.Parameter(t(linear.bias))
            self.a = self.b = None
            if lora_rank:
                d_out, d_in = self.weight.shape
                self.a = tnn.Parameter(torch.randn(d_in, lora_rank) / lora_rank)
                self.b = tnn.Parameter(torch.zeros(lora_rank, d_out))

        def forward(self, x):
            y = torch.nn.functional.linear(x, self.weight, self.bias)
            if self.a is not None:
                y = y + (lora_alpha / lora_rank) * ((x @ self.a) @ self.b)
            return y

    class Net(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = Block(model.conv1), Block(model.conv2)
            self.fc1, self.fc2, self.fc3 = Linear(model.fc1), Linear(model.fc2), Linear(model.fc3)

        def forward(self, x):
            x = (((x / 255.0) - 0.1307) / 0.3081).unsqueeze(1)
            x = self.conv2(self.conv1(x)).flatten(1)
            x = torch.nn.functional.gelu(self.fc1(x))
            x = torch.nn.functional.gelu(self.fc2(x))
            return self.fc3(x)

    net = Net().eval()  # NOTE: eval = BatchNorm's inference form, as onnxparam traces it
    if lora_rank:
        trainable = [p for name, p in net.named_parameters() if name.endswith((".a", ".b"))]
        for name, p in net.named_parameters():
            p.requires_grad_(name.endswith((".a", ".b")))
    else:
        trainable = list(net.parameters())
    return net, trainable


def bench_train(args: argparse.Namespace) -> list[Result]:
    """One training step (``grad`` + ``Adam.step``) of the MNIST model at batch
    :data:`TRAIN_BATCH`, all params and LoRA (rank 4, linear layers), vs the same step in
    PyTorch (skipped when PyTorch is not installed)."""
    import onnxparam as op
    from onnxparam import runtime
    from onnxparam.autodiff import cross_entropy, grad
    from onnxparam.optim import Adam
    from onnxparam.zoo import mnist

    images, labels = mnist.load_digits()
    x = np.ascontiguousarray(images[:TRAIN_BATCH].astype(np.float32))
    y = labels[:TRAIN_BATCH].astype(np.int64)
    pretrained = mnist.load_pretrained()
    lora_config = op.LoraConfig(rank=4, alpha=8, seed=0, param_group=op.ParamGroup.from_regex(r"^fc\d\.weight$"))
    cases = {"full step batch 64": (pretrained, 0), "lora step batch 64": (pretrained.apply_lora(lora_config), 4)}

    def loss_fn(m, xb, yb):
        return cross_entropy(m(xb), yb)

    ours = {}
    for case, (start, _) in cases.items():
        runtime.set_session_config(start, runtime.SessionConfig(intra_op_num_threads=args.threads))
        state = {"model": start, "optim": Adam(lr=1e-4)}

        def step(_state=state):
            _, grads = grad(loss_fn, _state["model"], x, y)
            _state["model"] = _state["optim"].step(_state["model"], grads)

        ours[case] = step
    try:
        import torch
    except ImportError:
        repeats = max(args.repeats // 25, 10)
        for case, step in ours.items():
            for _ in range(3):
                step()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            print(f"train    {case:<26} {statistics.median(times) * 1e3:>8.3f} ms   (no baseline)")
        print("train: torch not installed; skipped the comparison (pip install torch to run it)")
        return []

    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for case, (start, rank) in cases.items():
        net, trainable = _torch_mnist(pretrained, rank, 8.0)
        optim = torch.optim.Adam(trainable, lr=1e-4, eps=1e-5)

        def baseline(_net=net, _optim=optim):
            _optim.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(_net(xt), yt)
            loss.backward()
            _optim.step()

        t_ours, t_base = interleaved_medians(ours[case], baseline, max(args.repeats // 25, 10), warmup=3)
        results.append(Result("train", case, t_ours, t_base, TRAIN_TARGET))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_train import run as imported_models  # imported BERT-tiny and ResNet18 (tools/bench_train.py)

    return results + imported_models(args, Result, interleaved_medians)


def bench_quant(args: argparse.Namespace) -> list[Result]:
    """Quantized exports vs float32 and vs ONNX Runtime's tools: :mod:`bench_quant` (tools/); then
    the memory of quantizing a ``--convert-mib`` model (1 GiB) one weight at a time, vs the target
    and ORT's ``quantize_dynamic``: :mod:`bench_quant_memory` (tools/)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_quant import bench_quant as run
    from bench_quant_memory import run as run_memory

    return run(args, Result) + run_memory(args, Result)


IMPORT_SIZES = [(h, w) for h in (384, 352, 320, 288, 256, 224) for w in (384, 352, 320, 288, 256, 224)][:32]
"""``(H, W)`` of the 32 calls of the ``import`` section (the largest first)."""

IMPORT_RSS_TARGET = 1.2
"""Highest acceptable peak RSS over the 32 calls / RSS after the first call."""


def bench_import(args: argparse.Namespace) -> list[Result]:
    """An imported model called at many input sizes: one session, flat memory (module docstring)."""
    import onnxparam as op
    from onnxparam.runtime import sessions_built

    path = Path(__file__).resolve().parents[1] / "tests" / "data" / "onnx" / "ppocr_v4_det.onnx"
    module = op.import_onnx(path)
    rng = np.random.default_rng(0)
    before = sessions_built()
    peak = 0
    first = None
    for h, w in IMPORT_SIZES:
        module(rng.normal(size=(1, 3, h, w)).astype(np.float32))
        rss = _rss_kib()["VmRSS"] * 1024
        first = rss if first is None else first
        peak = max(peak, rss)
    built = sessions_built() - before
    print(f"import: ppocr_v4_det at {len(IMPORT_SIZES)} sizes: {built} session(s) built, RSS after the first "
          f"call {first / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")
    return [Result("import", "ppocr det sessions/32 sizes", built, 1, 1.0, unit="count"),
            Result("import", "ppocr det peak RSS/first", peak, first, IMPORT_RSS_TARGET, unit="MiB")]


def bench_dynamic(args: argparse.Namespace) -> list[Result]:
    """A traced transformer block at new shapes vs plain ORT: :mod:`bench_dynamic` (tools/)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_dynamic import run

    return run(args, Result, interleaved_medians)


INSPECT_MODEL_BYTES = 256 * 2**20
"""Tensor bytes of the ``inspect`` section's inline ``.onnx`` (16 float32 tensors)."""
INSPECT_TIME_TARGET = 1.0
INSPECT_MEMORY_TARGET = 0.25


def _child_peak(argv: list, env: "dict | None" = None) -> dict:
    """Run ``argv``; wall seconds and the child's peak RSS (kB, sampled every 2 ms)."""
    t0 = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peak = dict.fromkeys(RSS_KEYS, 0)
    while child.poll() is None:
        try:
            for k, v in _rss_kib(child.pid).items():
                peak[k] = max(peak[k], v)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
        time.sleep(RSS_SAMPLE_S)
    if child.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {child.stderr.read().decode()}")
    return {"seconds": time.perf_counter() - t0, "peak": peak}


def bench_inspect(args: argparse.Namespace) -> list[Result]:
    """``onnxparam inspect --no-count`` of an inline ``.onnx`` (weights inside the protobuf) vs
    ``onnx.load`` of the same file (after importing ``onnxparam.cli``), each a fresh process: wall time (target
    :data:`INSPECT_TIME_TARGET`) and peak anonymous RSS (target :data:`INSPECT_MEMORY_TARGET`):
    inspect walks the protobuf in a map and parses only the structure
    (:func:`onnxparam.formats.onnx_stream.read_onnx_mapped`)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    side = int((INSPECT_MODEL_BYTES // 16 // 4) ** 0.5)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((side, side), dtype=np.float32), f"w{i}") for i in range(16)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(16)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", side])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(16)], inits)
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-inspect-") as tmp:
        path = Path(tmp) / "inline.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        del inits, graph
        ours = _child_peak([sys.executable, "-m", "onnxparam", "inspect", str(path), "--no-count", "-q"])
        size = path.stat().st_size
        # NOTE: the baseline imports what the command imports, so both sides differ by the reading alone
        base = _child_peak([sys.executable, "-c", f"import onnx, onnxparam.cli; onnx.load({str(path)!r})"])
    print(f"inspect: inline .onnx {size:,} bytes: "
          f"inspect {ours['seconds']:.2f} s, peak anon RSS {ours['peak']['RssAnon'] / 2**10:.0f} MiB; onnx.load "
          f"{base['seconds']:.2f} s, {base['peak']['RssAnon'] / 2**10:.0f} MiB", file=sys.stderr)
    return [Result("inspect", "inline onnx time", ours["seconds"], base["seconds"], INSPECT_TIME_TARGET),
            Result("inspect", "inline onnx memory", ours["peak"]["RssAnon"] * 1024.0,
                   base["peak"]["RssAnon"] * 1024.0, INSPECT_MEMORY_TARGET, unit="MiB")]


def bench_export(args: argparse.Namespace) -> list[Result]:
    """Peak memory of ``export_onnx`` (a mapped module; an imported model): :mod:`bench_export` (tools/)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_export import bench_export as run

    return run(args, Result)


SECTIONS: dict[str, Callable[[argparse.Namespace], list[Result]]] = {
    "mnist": bench_mnist,
    "convert": bench_convert,
    "lora": bench_lora,
    "lora-batched": bench_lora_batched,
    "train": bench_train,
    "quant": bench_quant,
    "import": bench_import,
    "dynamic": bench_dynamic,
    "inspect": bench_inspect,
    "export": bench_export,
}
"""Section name -> function; run in this order when none is named."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION",
                        help=f"sections to run (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=500, help="timed repetitions per case (default: 500)")
    parser.add_argument("--threads", type=int, default=0,
                        help="ONNX Runtime intra-op threads for both sides (default: 0 = ONNX Runtime's choice)")
    parser.add_argument("--convert-repeats", type=int, default=5,
                        help="runs of each convert case, each beside a copy baseline; medians kept (default: 5)")
    parser.add_argument("--convert-mib", type=int, default=CONVERT_MODEL_BYTES // 2**20,
                        help="tensor MiB of the convert section's synthetic model (default: 1024)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    names = args.sections or list(SECTIONS)
    print(f"{'section':<8} {'case':<26} {'onnxparam':>11} {'baseline':>11} {'ratio':>7} {'target':>7}")
    all_ok = True
    for name in names:
        for r in SECTIONS[name](args):
            all_ok &= r.ok
            print(f"{r.section:<8} {r.case:<26} {r.show(r.ours_s):>11} {r.show(r.baseline_s):>11} "
                  f"{r.ratio:>7.3f} {'<=' + format(r.target, '.2f'):>7} {'ok' if r.ok else 'MISSED'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == CONVERT_CASE_FLAG:
        sys.exit(_run_convert_case(sys.argv[2], sys.argv[3]))
    sys.exit(main())
