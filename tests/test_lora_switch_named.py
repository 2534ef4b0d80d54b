"""Switching a module's named adapters (``set_adapter``, ``add_adapter``) in the runtime builds
no new trace and no new session in the modes that feed the factors (``"inputs"``, and
``module(x, adapter_index=...)``), while each call still runs its own adapter.

Oracle: numpy's ``relu(x @ (W1 + s * a1 @ b1) + c1) @ (W2 + s * a2 @ b2) + c2`` on the arrays the
test draws (``s = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA), per adapter; the runtime's
counters (:func:`onnxparam.runtime.stats`) say what was traced and built.
"""

import math

import numpy as np
import pytest

import onnxparam as op
from onnxparam import LoraConfig, Module, Param, Tensor
from onnxparam.nn import Linear
from onnxparam.runtime import SessionConfig, set_session_config, stats

ATOL = 1e-4
# name: (rank, alpha, use_rslora, seed)
ADAPTERS = {"sql": (2, 5.0, False, 1), "chat": (4, 3.0, True, 2), "code": (8, 12.0, False, 3)}


class Mlp(Module):
    def __init__(self):
        self.fc1 = Linear(8, 16)
        self.fc2 = Linear(16, 5)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def drawn(module, seed):
    rng = np.random.default_rng(seed)
    return module.map(lambda path, p: Param(p.id, value=Tensor.from_numpy(
        rng.normal(0.0, 0.5, size=p.lazy_shape()).astype(np.float32)), require_grad=p.require_grad)
        if path.endswith((".lora.a", ".lora.b")) else p)


@pytest.fixture(scope="module")
def setup():
    base = drawn(Mlp(), 0)
    arrays = {path: np.asarray(p.val().to_numpy()) for path, p in base.named_params()}
    model, factors = base, {}
    for name, (rank, alpha, rslora, seed) in ADAPTERS.items():
        adapted = drawn(base.apply_lora(LoraConfig(rank=rank, alpha=alpha, use_rslora=rslora, seed=seed)), seed)
        factors[name] = {path: (np.asarray(p.adapter().a.val().to_numpy()), np.asarray(p.adapter().b.val().to_numpy()))
                         for path, p in adapted.named_params() if p.adapter() is not None}
        model = model.add_adapter(name, adapted)
    x = np.random.default_rng(9).normal(size=(3, 8)).astype(np.float32)
    return model, arrays, factors, x


def oracle(arrays, factors, name, x):
    h = x
    for i, layer in enumerate(("fc1", "fc2")):
        w = arrays[f"{layer}.weight"]
        if name is not None:
            rank, alpha, rslora, _ = ADAPTERS[name]
            a, b = factors[name][f"{layer}.weight"]
            w = w + (alpha / (math.sqrt(rank) if rslora else rank)) * (a @ b)
        h = h @ w + arrays[f"{layer}.bias"]
        if i == 0:
            h = np.maximum(h, 0.0)
    return h


def test_set_adapter_in_inputs_mode_reuses_the_trace_and_session(setup):
    model, arrays, factors, x = setup
    set_session_config(model, SessionConfig(lora_mode="inputs"))
    xt = Tensor.from_numpy(x)
    model.set_adapter("sql")(xt)  # the one trace and session of every adapter
    model.set_adapter(None)(xt)  # the base model (no factor inputs): another graph
    before = stats()
    for name in ["chat", "code", "sql", None, "code", "chat"]:
        got = model.set_adapter(name)(xt).to_numpy()
        np.testing.assert_allclose(got, oracle(arrays, factors, name, x), atol=ATOL, err_msg=str(name))
    after = stats()
    assert (after.traces - before.traces, after.sessions_built - before.sessions_built) == (0, 0)


@pytest.mark.parametrize("mode", ["keep", "merge"])
def test_set_adapter_in_the_other_modes_runs_each_adapter(setup, mode):
    """Modes whose graph holds the rank / scale (``keep``) or the values (``merge``) still
    give each adapter its own output after switching."""
    model, arrays, factors, x = setup
    set_session_config(model, SessionConfig(lora_mode=mode))
    xt = Tensor.from_numpy(x)
    for name in ["sql", "chat", "code", "sql"]:
        np.testing.assert_allclose(model.set_adapter(name)(xt).to_numpy(), oracle(arrays, factors, name, x),
                                   atol=ATOL, err_msg=name)


def test_adding_an_adapter_reuses_the_batched_trace_and_session(setup):
    model, arrays, factors, x = setup
    names = list(ADAPTERS)
    first = model.delete_adapter("code")
    rows = ["sql", None, "chat"]
    first(Tensor.from_numpy(x), adapter_index=rows)
    before = stats()
    got = model(Tensor.from_numpy(x), adapter_index=["code", "sql", None]).to_numpy()
    after = stats()
    assert (after.traces - before.traces, after.sessions_built - before.sessions_built) == (0, 0)
    for row, name in enumerate(["code", "sql", None]):
        np.testing.assert_allclose(got[row], oracle(arrays, factors, name, x[row:row + 1])[0], atol=ATOL)
    assert names == model.lora_adapters.names
    # another target set (adapters on fc1 only) is another trace
    plain = model
    for name in names:
        plain = plain.delete_adapter(name)
    only = plain.add_adapter("fc1", drawn(plain.apply_lora(LoraConfig(
        rank=2, param_group=op.ParamGroup.from_regex(r"^fc1\.weight$"))), 7))
    before = stats()
    only(Tensor.from_numpy(x), adapter_index=["fc1", None, "fc1"])
    assert stats().traces - before.traces == 1
