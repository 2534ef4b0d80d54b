"""``module(x, adapter_index=...)`` called again and again: the repeated call takes the runtime's
fast path (the runner remembered with the stacks fed), and anything that changes what the call
computes (the index, the input shape, another adapter set, a param swapped in place, a plain
``module(x)`` call between) gives the new result, never a stale one.

Oracle: the LoRA formula in numpy on the params' own values, row by row
(``relu(x @ W1 + c1 + s * (x @ A1) @ B1) @ W2 + c2 + s * ...``, ``s = alpha / r``).
"""

from __future__ import annotations

import numpy as np

from onnxparam import LoraConfig, Module, Param, Tensor, runtime
from onnxparam.nn import LinearConfig

RANKS = {"p": (2, 4.0), "q": (3, 1.5)}


class Net(Module):
    def __init__(self):
        self.fc1 = LinearConfig(5, 7).init()
        self.fc2 = LinearConfig(7, 3).init()

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def _source(base, r, alpha, seed):
    rng = np.random.default_rng(seed)
    module = base.apply_lora(LoraConfig(rank=r, alpha=alpha, seed=seed))
    return module.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(
        rng.normal(0, 0.5, size=p.lazy_shape()).astype(np.float32))) if path.endswith("lora.b") else p)


def _values(layer):
    return (np.asarray(layer.weight.val().to_numpy(), np.float64), np.asarray(layer.bias.val().to_numpy(), np.float64))


def _oracle(x, layers, sources, name):
    """Row ``x`` through ``layers`` (``(W, c)`` pairs) with adapter ``name`` of ``sources``."""
    h = x.astype(np.float64)
    for k, (w, c) in enumerate(layers):
        out = h @ w + c
        if name is not None:
            r, alpha = RANKS[name]
            adapter = getattr(sources[name], f"fc{k + 1}").weight.adapter()
            a = np.asarray(adapter.a.val().to_numpy(), np.float64)
            b = np.asarray(adapter.b.val().to_numpy(), np.float64)
            out = out + alpha / r * (h @ a) @ b
        h = np.maximum(out, 0) if k == 0 else out
    return h


def _check(got, x, layers, sources, names):
    for row, name in enumerate(names):
        np.testing.assert_allclose(got[row], _oracle(x[row], layers, sources, name), atol=1e-5, rtol=0)


def _served(source_seed: int, x_seed: int, shape: tuple):
    """``(base, sources, module, layers, x)``: a fresh :class:`Net`, the adapters of
    :data:`RANKS` drawn from ``source_seed`` on, the base carrying them as named adapters "p" and
    "q", the base layers' ``(W, c)`` values and a float32 input of ``shape`` drawn from ``x_seed``."""
    base = Net()
    sources = {name: _source(base, r, alpha, source_seed + k) for k, (name, (r, alpha)) in enumerate(RANKS.items())}
    module = base.add_adapter("p", sources["p"]).add_adapter("q", sources["q"])
    layers = [_values(base.fc1), _values(base.fc2)]
    return base, sources, module, layers, np.random.default_rng(x_seed).normal(size=shape).astype(np.float32)


def test_repeated_calls_follow_the_index_the_shape_and_plain_calls_between():
    _, sources, module, layers, x = _served(20, 1, (4, 2, 5))
    xt = Tensor.from_numpy(x)
    module(xt, adapter_index=[0, 1, 2, 1])
    before = runtime.stats()
    for names in (["p", None, "q", "q"], [None, None, "p", "q"], ["q", "p", None, "p"]):
        _check(module(xt, adapter_index=names).to_numpy(), x, layers, sources, names)
    _check(module(xt, adapter_index=np.array([2], np.int64)).to_numpy(), x, layers, sources, ["q"] * 4)
    after = runtime.stats()
    assert (after.sessions_built, after.traces) == (before.sessions_built, before.traces)
    # a plain call of the same module object between batched calls: no adapter active, the base
    plain = module(xt).to_numpy()
    _check(plain, x, layers, sources, [None] * 4)
    _check(module(xt, adapter_index=["p", "q", "p", None]).to_numpy(), x, layers, sources, ["p", "q", "p", None])
    np.testing.assert_array_equal(module(xt).to_numpy(), plain)
    # another batch size and sequence length, then the first shape again
    small = Tensor.from_numpy(x[:3, :1])
    _check(module(small, adapter_index=["q", None, "p"]).to_numpy(), x[:3, :1], layers, sources, ["q", None, "p"])
    _check(module(xt, adapter_index=[1, 1, 0, 2]).to_numpy(), x, layers, sources, ["p", "p", None, "q"])


def test_another_adapter_set_or_a_param_swapped_in_place_is_never_served_stale():
    base, sources, module, layers, x = _served(30, 2, (3, 5))
    xt = Tensor.from_numpy(x)
    names = ["q", "p", None]
    for _ in range(2):
        _check(module(xt, adapter_index=names).to_numpy(), x, layers, sources, names)
    # the same names with other factors: a module with another set (same structure)
    others = {name: _source(base, r, alpha, 40 + k) for k, (name, (r, alpha)) in enumerate(RANKS.items())}
    other = base.add_adapter("p", others["p"]).add_adapter("q", others["q"])
    for _ in range(2):
        _check(other(xt, adapter_index=names).to_numpy(), x, layers, others, names)
        _check(module(xt, adapter_index=names).to_numpy(), x, layers, sources, names)
    # "p" active: the set is the same object, the active adapter's values come from the params
    active = module.set_adapter("p")
    for _ in range(2):
        _check(active(xt, adapter_index=names).to_numpy(), x, layers, sources, names)
    # a layer swapped in place (attribute assignment): the adapters (by path) apply to its weight
    fresh = LinearConfig(7, 3).init()
    module.fc2 = fresh
    layers = [layers[0], _values(fresh)]
    for _ in range(2):
        _check(module(xt, adapter_index=names).to_numpy(), x, layers, sources, names)


def test_a_served_index_array_is_checked_on_the_fast_path():
    """An int array index on a repeated call: any integer dtype is taken (rows as the numpy
    oracle), an entry outside ``[0, slots)`` (negative, or past the last adapter) is a
    ``LoraError`` naming it, as on the first call."""
    import pytest

    from onnxparam import LoraError

    _, sources, module, layers, x = _served(50, 3, (3, 5))
    xt = Tensor.from_numpy(x)
    for _ in range(2):
        for dtype in (np.int64, np.uint8, np.int32):
            got = module(xt, adapter_index=np.array([2, 0, 1], dtype)).to_numpy()
            _check(got, x, layers, sources, ["q", None, "p"])
        for bad in ([0, -1, 1], [3, 0, 1]):
            with pytest.raises(LoraError, match=f"adapter_index {bad[1] if bad[1] < 0 else bad[0]} is outside"):
                module(xt, adapter_index=np.array(bad, np.int64))
