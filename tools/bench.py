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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
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

    @property
    def ratio(self) -> float:
        return self.ours_s / self.baseline_s

    @property
    def ok(self) -> bool:
        return self.ratio <= self.target


def interleaved_medians(ours: Callable[[], object], baseline: Callable[[], object], repeats: int,
                        warmup: int = 5) -> tuple[float, float]:
    """Median seconds of ``ours()`` and ``baseline()``, timed alternately (the order swaps
    every repetition so neither always runs on a warmer cache)."""
    for _ in range(warmup):
        ours()
        baseline()
    t_ours, t_base = [], []
    clock = time.perf_counter
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


SECTIONS: dict[str, Callable[[argparse.Namespace], list[Result]]] = {
    "mnist": bench_mnist,
}
"""Section name -> function; run in this order when none is named."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION",
                        help=f"sections to run (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=500, help="timed repetitions per case (default: 500)")
    parser.add_argument("--threads", type=int, default=0,
                        help="ONNX Runtime intra-op threads for both sides (default: 0 = ONNX Runtime's choice)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    names = args.sections or list(SECTIONS)
    print(f"{'section':<8} {'case':<22} {'onnxparam':>11} {'baseline':>11} {'ratio':>7} {'target':>7}")
    all_ok = True
    for name in names:
        for r in SECTIONS[name](args):
            all_ok &= r.ok
            print(f"{r.section:<8} {r.case:<22} {r.ours_s * 1e3:>8.3f} ms {r.baseline_s * 1e3:>8.3f} ms "
                  f"{r.ratio:>7.3f} {'<=' + format(r.target, '.2f'):>7} {'ok' if r.ok else 'MISSED'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
