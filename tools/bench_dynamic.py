"""The ``dynamic`` section of ``tools/bench.py``: dynamic shapes (see ``bench.py``'s docstring).

A transformer-style block (causal self-attention + MLP, d_model :data:`D_MODEL`) called as
``module(x)`` at new ``(batch, seq)`` shapes, against a plain ``onnxruntime.InferenceSession``
on the same block exported with dynamic batch and sequence (same session options):

* ``first call``: a fresh runtime (caches cleared) tracing, building and running at one shape vs
  plain ORT building the session from the file and running once;
* ``2nd shape (retrace)``: the call that retraces with symbolic dims and builds the dynamic
  session (a one-time cost) vs plain ORT's first call (building its session and running); plain
  ORT's run at that new shape on its existing session is printed beside it;
* ``later new shape``: a call at a never-seen shape once the dynamic session exists vs plain ORT
  at that shape (both: a run, nothing built);
* ``sessions / 32 shapes``: sessions built over :data:`SHAPES` shapes (target 2);
* ``peak RSS / 32 shapes``: the process's largest RSS over those calls vs its RSS after the
  first call (target 1.2).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

D_MODEL = 256
HEADS = 8
SHAPES = 32
FIRST_CALL_TARGET = 2.0
NEW_SHAPE_TARGET = 2.0
LATER_SHAPE_TARGET = 1.25
SESSIONS_TARGET = 2
RSS_TARGET = 1.2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _block():
    import onnxparam as op
    from onnxparam import nn, ops

    class Block(op.Module):
        def __init__(self, d=D_MODEL, heads=HEADS):
            self.heads = heads
            self.norm1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.norm2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.act = nn.Gelu()
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, d = x.shape
            qkv = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            scores = (q @ k.transpose(-2, -1)) * (1.0 / float(np.sqrt(d // self.heads)))
            pos = ops.arange(s)
            scores = ops.where(pos[None, :] > pos[:, None], ops.full((1,), -1e9), scores)
            att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
            x = x + self.proj(att)
            return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    return Block


def run(args, Result, interleaved_medians) -> list:
    import onnxruntime as ort

    import onnxparam as op
    from onnxparam import runtime

    rng = np.random.default_rng(0)
    config = runtime.SessionConfig(intra_op_num_threads=args.threads)
    Block = _block()
    model = Block()
    runtime.set_session_config(model, config)
    results = []
    shapes = [(1 + i % 4, 8 + 5 * i) for i in range(SHAPES)]  # 32 (batch, seq) pairs, all distinct
    inputs = [rng.normal(size=(b, s, D_MODEL)).astype(np.float32) for b, s in shapes]
    repeats = max(3, min(args.repeats // 100, 7))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "block.onnx"
        op.export_onnx(model, path, inputs[0], dynamic_axes={"x": {0: "batch", 1: "seq"},
                                                             "output": {0: "batch", 1: "seq"}})
        options = config.session_options()

        def plain_session():
            return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])

        # first call and the second shape, each from a fresh runtime cache
        firsts, plain_firsts, seconds, plain_seconds = [], [], [], []
        for _ in range(repeats):
            runtime.clear_caches()
            t0 = time.perf_counter()
            model(inputs[0])
            t1 = time.perf_counter()
            model(inputs[1])
            t2 = time.perf_counter()
            firsts.append(t1 - t0)
            seconds.append(t2 - t1)
            t0 = time.perf_counter()
            session = plain_session()
            session.run(None, {"x": inputs[0]})
            t1 = time.perf_counter()
            session.run(None, {"x": inputs[1]})
            t2 = time.perf_counter()
            plain_firsts.append(t1 - t0)
            plain_seconds.append(t2 - t1)
        results.append(Result("dynamic", "first call", statistics.median(firsts),
                              statistics.median(plain_firsts), FIRST_CALL_TARGET))
        results.append(Result("dynamic", "2nd shape (retrace)", statistics.median(seconds),
                              statistics.median(plain_firsts), NEW_SHAPE_TARGET))
        print(f"dynamic: plain ORT's run at the 2nd shape on its session: {statistics.median(plain_seconds) * 1e3:.3f} ms")

        # 32 shapes: sessions built and RSS, from a fresh cache
        runtime.clear_caches()
        session = plain_session()
        before = runtime.stats().sessions_built
        model(inputs[0])
        rss_first = peak = _rss_bytes()
        later, plain_later = [], []
        for i, x in enumerate(inputs[1:], start=1):
            t0 = time.perf_counter()
            ours = model(x).to_numpy()
            t1 = time.perf_counter()
            theirs = session.run(None, {"x": x})[0]
            t2 = time.perf_counter()
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
            if i >= 2:
                later.append(t1 - t0)
                plain_later.append(t2 - t1)
            peak = max(peak, _rss_bytes())
        built = runtime.stats().sessions_built - before
        results.append(Result("dynamic", "later new shape", statistics.median(later),
                              statistics.median(plain_later), LATER_SHAPE_TARGET))
        results.append(Result("dynamic", f"sessions / {SHAPES} shapes", built, SESSIONS_TARGET, 1.0, unit="count"))
        results.append(Result("dynamic", f"peak RSS / {SHAPES} shapes", peak, rss_first, RSS_TARGET, unit="MiB"))
    return results
