"""Many threads at once: shared modules, session building, lazy params, weights swapped mid-run.

Oracles: the single-threaded outputs of the same module (computed before any thread starts),
and, for the MNIST model, the digit labels it classifies (its accuracy on them is known to be
high); for weight swaps, the two single-threaded outputs of the old and the new weights.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from onnxparam import Param, ParamId, Tensor, runtime
from onnxparam.zoo import mnist

THREADS = 8


@pytest.fixture(scope="module")
def digits():
    images, labels = mnist.load_digits()
    return images[:64].astype(np.float32), labels[:64]


def run_threads(fn, count: int = THREADS, calls: int = 1) -> list:
    """``fn(thread index)`` in ``count`` threads released at once by a barrier, ``calls`` times each."""
    barrier = threading.Barrier(count)

    def work(i):
        barrier.wait()
        return [fn(i) for _ in range(calls)]

    with ThreadPoolExecutor(count) as pool:
        return [r for rs in pool.map(work, range(count)) for r in rs]


def test_many_threads_calling_one_shared_module_get_the_single_threaded_result(digits):
    images, labels = digits
    model = mnist.load_pretrained()
    batches = [images[i::4] for i in range(4)]
    oracle = [model(Tensor.from_numpy(b)).to_numpy() for b in batches]
    assert (np.concatenate([o.argmax(1) for o in oracle]) == np.concatenate([labels[i::4] for i in range(4)])).mean() > 0.9

    def call(i):
        k = i % 4
        return k, model(Tensor.from_numpy(batches[k])).to_numpy()

    for k, out in run_threads(call, calls=5):
        np.testing.assert_array_equal(out, oracle[k])


def test_a_session_is_built_once_when_many_threads_need_it_at_the_same_time(digits):
    images, _ = digits
    runtime.clear_caches()
    model = mnist.load_pretrained()  # a fresh module: its session is not built yet
    before = runtime.sessions_built()
    outs = run_threads(lambda i: model(Tensor.from_numpy(images[:8])).to_numpy())
    assert runtime.sessions_built() - before == 1
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_a_lazy_param_initializes_exactly_once_under_contention():
    calls = []
    release = threading.Event()

    def init(device, require_grad):
        calls.append(threading.get_ident())
        release.wait(5)  # keep the first caller inside init while the others arrive
        return Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))

    param = Param.uninitialized(ParamId(7), init, "cpu", shape=(2, 3))
    clones = [param.clone() for _ in range(THREADS)]
    timer = threading.Timer(0.2, release.set)
    timer.start()
    values = run_threads(lambda i: clones[i].val())
    timer.join()
    assert len(calls) == 1
    assert all(v is values[0] for v in values)  # one value, shared by every clone
    np.testing.assert_array_equal(values[0].to_numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_loading_weights_while_other_threads_run_gives_each_call_the_old_or_the_new_weights(tmp_path, digits):
    images, _ = digits
    x = images[:16]
    old = mnist.load_pretrained()
    new_path = tmp_path / "new.bpk"
    # new weights: every tensor scaled, so the two oracles differ everywhere
    old.map(lambda path, p: p.map(lambda t: Tensor.from_numpy(t.to_numpy() * np.float32(1.5)))).save_file(new_path)
    new = mnist.Mnist().load_file(new_path)
    oracle_old = old(Tensor.from_numpy(x)).to_numpy()
    oracle_new = new(Tensor.from_numpy(x)).to_numpy()
    assert not np.allclose(oracle_old, oracle_new)

    shared = {"model": old}
    stop = threading.Event()
    seen = {"old": 0, "new": 0}
    problems = []

    def swapper():
        flip = False
        while not stop.is_set():
            # NOTE: a fresh load each time, as a user reloading a checkpoint would do
            shared["model"] = mnist.Mnist().load_file(new_path) if flip else mnist.load_pretrained()
            flip = not flip

    def runner(i):
        for _ in range(15):
            out = shared["model"](Tensor.from_numpy(x)).to_numpy()
            if np.array_equal(out, oracle_old):
                seen["old"] += 1
            elif np.array_equal(out, oracle_new):
                seen["new"] += 1
            else:
                problems.append(float(np.abs(out - oracle_old).max()))

    swap = threading.Thread(target=swapper)
    swap.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(runner, range(4)))
    finally:
        stop.set()
        swap.join()
    assert problems == []
    assert seen["old"] + seen["new"] == 60
