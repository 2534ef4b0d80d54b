"""Gradients of the training forms of ``BatchNormalization`` (opset 14+ ``training_mode=1``; opset 9's
five outputs) and ``Dropout`` (opset 12+ ``training_mode`` true or fed), and a torch CNN with both
exported in training mode, imported and trained.

Oracles:

* ``BatchNormalization``: central finite differences in float64 of ``sum(w * y)`` on plain ONNX
  Runtime runs of the original file with one initializer entry perturbed (``tests/grad_check.py``),
  at two input shapes (batch and a spatial dim changing; one training session); and torch autograd
  in float64 of ``torch.nn.functional.batch_norm(training=True)`` and of the spec's statistics
  (``running_mean = momentum * mean + (1 - momentum) * batch_mean`` ...) written in torch.
* ``Dropout``: the mask ONNX Runtime drew in the same run (the training graph's own mask output
  read back): ``dx == g * mask / (1 - ratio)`` computed in numpy, and torch autograd of
  ``x * mask / (1 - ratio)`` with that mask; and, without reading the mask, Euler's identity for a
  loss linear in the param ``s``: ``loss == sum(s * dloss/ds)`` for the loss of the same run (a
  gradient from another mask than the forward's fails it) — a directional derivative along ``s``
  with the mask held fixed.
* the CNNs: torch autograd of the same torch module in train mode (same weights and inputs; in
  float64, a copy of the network), with dropout ``p = 0`` for the exact comparison, and ``p > 0``
  checked through the mask; ResNet18 (slow) likewise.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from grad_check import _weights, check_model_grads
from onnxparam.autodiff import check_gradients, grad, training_model

RNG = np.random.default_rng(25)
D, F, B, I64 = TensorProto.DOUBLE, TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
EPS, MOM = 1e-3, 0.7


# -- BatchNormalization, training form ------------------------------------------------------------


def _bn_model(opset: int, stats: bool, dtype=D):
    """``y = BN(x * s) [+ reshape(sum_k c_k * stat_k, [1, C, 1, 1])]``: the statistics outputs
    (running mean / var; opset 9 also saved mean / inverse std) weighed by params ``c_k`` and added
    to ``Y`` when ``stats``, so their gradients reach ``x``, ``s`` and the running inputs."""
    outs = ["Y", "rm", "rv"] + (["sm", "sv"] if opset < 14 else [])
    attrs = {"training_mode": 1} if opset >= 14 else {}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("BatchNormalization", ["xs", "scale", "bias", "mean", "var"], outs, epsilon=EPS,
                              momentum=MOM, **attrs)]
    npd = np.float64 if dtype == D else np.float32
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1)), "scale": RNG.uniform(0.5, 1.5, (3,)),
             "bias": RNG.uniform(-1, 1, (3,)), "mean": RNG.uniform(-1, 1, (3,)), "var": RNG.uniform(0.5, 1.5, (3,))}
    if stats:
        terms = []
        for k, name in enumerate(outs[1:]):
            inits[f"c{k}"] = RNG.uniform(-1, 1, (3,))
            nodes.append(helper.make_node("Mul", [name, f"c{k}"], [f"t{k}"]))
            terms.append(f"t{k}")
        nodes.append(helper.make_node("Sum", terms, ["st"]))
        nodes.append(helper.make_node("Reshape", ["st", "bshape"], ["st4"]))
        nodes.append(helper.make_node("Add", ["Y", "st4"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["Y"], ["y"]))
    initializers = [numpy_helper.from_array(v.astype(npd), k) for k, v in inits.items()]
    initializers.append(numpy_helper.from_array(np.array([1, 3, 1, 1], np.int64), "bshape"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, ["N", 3, "H", 5])],
                              [helper.make_tensor_value_info("y", dtype, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _bn_feeds(npd=np.float64):
    return [{"x": RNG.normal(0.5, 2.0, shape).astype(npd)} for shape in [(2, 3, 4, 5), (3, 3, 2, 5)]]


def _torch_bn(inits: dict, x, opset: int, stats: bool):
    """The same loss's graph in torch float64: ``batch_norm(training=True)`` and the statistics as
    the spec (and ONNX Runtime's saved outputs: batch mean, inverse standard deviation) write them."""
    import torch

    eps, mom = float(np.float32(EPS)), float(np.float32(MOM))  # (ONNX's float attributes)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inits.items() if v.dtype.kind == "f"}
    xs = torch.from_numpy(x) * t["s"]
    y = torch.nn.functional.batch_norm(xs, None, None, t["scale"], t["bias"], training=True, eps=eps)
    if stats:
        mu = xs.mean((0, 2, 3))
        var = xs.var((0, 2, 3), unbiased=False)
        outs = [mom * t["mean"] + (1 - mom) * mu, mom * t["var"] + (1 - mom) * var]
        if opset < 14:
            outs += [mu, 1 / torch.sqrt(var + eps)]
        st = sum(o * t[f"c{k}"] for k, o in enumerate(outs))
        y = y + st.reshape(1, 3, 1, 1)
    return y, t


@pytest.mark.parametrize("opset,stats", [(15, False), (15, True), (9, True),
                                         pytest.param(14, True, marks=pytest.mark.slow)])
def test_batch_norm_training_form_matches_finite_differences_and_torch(opset, stats):
    """Every param (``s``, scale, bias; the running inputs, frozen at import as PyTorch's buffers,
    unfrozen here; the statistics' weights) against central differences at two shapes with one
    session, then against torch autograd on the last shape."""
    model = _bn_model(opset, stats)
    module = op.import_onnx(model)
    assert set(module.onnx_tables) == {module.path_of("mean"), module.path_of("var")}  # (frozen by default)
    module = module.unfreeze_group(op.ParamGroup.from_paths(module.onnx_tables))
    feeds = _bn_feeds()
    counts = check_model_grads(model, feeds, eps=1e-5, rtol=1e-5, atol=1e-7, module=module)
    # ONNX Runtime's kernel writes the running statistics into its inputs' buffers: the trained
    # running mean / var fed to the session are read through copies, the module's arrays unchanged
    for name in ("mean", "var"):
        np.testing.assert_array_equal(getattr(module, module.path_of(name)).val().to_numpy(),
                                      numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name)))
    # (opset 9: ONNX types none of the statistics outputs under symbolic dims, and below opset 13
    # their Mul's gradient needs known ranks: one graph per shape)
    assert counts["graphs"] == counts["sessions"] == (1 if opset >= 14 else 2), counts

    torch = pytest.importorskip("torch")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    x = feeds[-1]["x"]
    y, t = _torch_bn(inits, x, opset, stats)
    w = _weights(tuple(y.shape), np.float64)
    (y * torch.from_numpy(w)).sum().backward()
    _, grads = grad(lambda m, ww, xx: (m(x=xx) * ww).sum(), module, op.Tensor.from_numpy(w), op.Tensor.from_numpy(x))
    by_path = grads.by_path()
    for name, tensor in t.items():
        expected = tensor.grad.numpy() if tensor.grad is not None else np.zeros_like(inits[name])
        np.testing.assert_allclose(by_path[module.path_of(name)].to_numpy(), expected, rtol=1e-7, atol=1e-9,
                                   err_msg=name)


@pytest.mark.parametrize("opset", [15, 9])
def test_batch_norm_running_outputs_do_not_drift_between_training_runs(opset):
    """ONNX Runtime's kernel updates the running statistics in place (its outputs alias inputs 3
    and 4): with the running mean / var frozen (initializers of the training session), a loss
    reading the running outputs is the same at every run of one session, equal to a fresh plain
    ONNX Runtime session's."""
    model = _bn_model(opset, True)
    module = op.import_onnx(model)
    x = _bn_feeds()[0]["x"]
    expected = float(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                     .run(None, {"x": x})[0].sum())

    def loss_fn(m, xx):
        return m(x=xx).sum()

    losses = [float(grad(loss_fn, module, op.Tensor.from_numpy(x))[0].to_numpy()) for _ in range(3)]
    np.testing.assert_allclose(losses, [expected] * 3, rtol=1e-12)


def test_batch_norm_training_form_float32_with_frozen_running_statistics():
    """The default import (running mean / var frozen: PyTorch's buffers) in float32: ``grad``
    builds, gives no gradient to the running inputs, and scale / bias match torch autograd."""
    torch = pytest.importorskip("torch")
    model = _bn_model(15, False, F)
    module = op.import_onnx(model)
    x = _bn_feeds(np.float32)[0]["x"]
    w = _weights(x.shape, np.float32)

    def loss_fn(m, ww, xx):
        return (m(x=xx) * ww).sum()

    assert check_gradients(loss_fn, module, op.Tensor.from_numpy(w), op.Tensor.from_numpy(x)) == []
    _, grads = grad(loss_fn, module, op.Tensor.from_numpy(w), op.Tensor.from_numpy(x))
    by_path = grads.by_path()
    assert set(by_path) == {module.path_of(n) for n in ("s", "scale", "bias")}
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    y, t = _torch_bn(inits, x.astype(np.float64), 15, False)
    (y * torch.from_numpy(w.astype(np.float64))).sum().backward()
    for name in ("s", "scale", "bias"):
        np.testing.assert_allclose(by_path[module.path_of(name)].to_numpy(), t[name].grad.numpy(), rtol=1e-4,
                                   atol=1e-4, err_msg=name)


# -- Dropout, training mode -----------------------------------------------------------------------


def _dropout_model(ratio, mode, mask_output: bool = False, opset: int = 13):
    """``y = Dropout(x * s, ratio, training_mode)`` on ``x [N, 4]`` (``s [4]`` the param):
    ``ratio`` / ``mode`` a constant value, or ``"fed"`` (a graph input ``r`` / ``t``); the
    file's node has a ``mask`` output only when ``mask_output`` (torch's dynamo export writes
    none)."""
    inits = [numpy_helper.from_array(RNG.uniform(0.5, 1.5, (4,)), "s")]
    inputs = [helper.make_tensor_value_info("x", D, ["N", 4])]
    if ratio == "fed":
        inputs.append(helper.make_tensor_value_info("r", F, []))
    else:
        inits.append(numpy_helper.from_array(np.array(ratio, np.float32), "r"))
    if mode == "fed":
        inputs.append(helper.make_tensor_value_info("t", B, []))
    else:
        inits.append(numpy_helper.from_array(np.array(mode), "t"))
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Dropout", ["xs", "r", "t"], ["y", "mask"] if mask_output else ["y"], name="drop",
                              seed=3)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", D, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _loss(m, w, *xs):
    names = ["x", "r", "t"][:len(xs)]
    return (m(**dict(zip(names, xs))) * w).sum()


def _run_reading_masks(loss_fn, module, *arrays) -> tuple:
    """``(outputs by name, masks)`` of ONE plain ONNX Runtime run of the training graph ``grad``
    builds, with every ``Dropout``'s mask output made a graph output too (the mask the forward drew
    in the run whose gradients are returned)."""
    tm = training_model(loss_fn, module, *[op.Tensor.from_numpy(a) for a in arrays])
    proto = tm.to_proto()
    masks = [n.output[1] for n in proto.graph.node if n.op_type == "Dropout"]
    assert all(masks), "the training graph's Dropouts have a mask output"
    proto.graph.output.extend(helper.make_tensor_value_info(name, B, None) for name in masks)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    from onnxparam.core.module import named_params

    values = {path: p.val().to_numpy() for path, p in named_params(module)}
    feeds = dict(zip(tm.input_names, list(arrays) + [values[p] for p in tm.input_names[len(arrays):]]))
    outs = session.run(None, feeds)
    named = dict(zip([o.name for o in proto.graph.output], outs))
    return named, [named[m] for m in masks]


@pytest.mark.parametrize("mask_output", [False, True])
def test_dropout_gradient_is_g_times_the_forward_mask_over_keep(mask_output):
    """``ds = sum_n(w * x * mask / (1 - p))`` with the mask of the same run (numpy), and torch
    autograd of ``(x * s) * mask / (1 - p)`` with that mask; then at two batch sizes through ``grad``
    (one session): Euler's identity ``loss == s . dloss/ds`` (the loss is linear in ``s``)."""
    p = 0.4
    model = _dropout_model(p, True, mask_output)
    module = op.import_onnx(model)
    x = RNG.normal(size=(64, 4))
    w = _weights(x.shape, np.float64)
    named, (mask,) = _run_reading_masks(_loss, module, w, x)
    assert 0.2 < 1 - mask.mean() < 0.6  # (a real draw)
    s = module.s.val().to_numpy()
    ds = named[module.path_of("s") + ".grad"]
    np.testing.assert_allclose(named["loss"], (w * x * s * mask / (1 - p)).sum(), rtol=1e-6)
    np.testing.assert_allclose(ds, (w * x * mask / (1 - np.float32(p))).sum(0), rtol=1e-12)  # (as ORT's kernel)
    torch = pytest.importorskip("torch")
    st = torch.tensor(s, requires_grad=True)
    y = torch.from_numpy(x) * st * torch.from_numpy(mask) / float(1 - np.float32(p))  # (1 - p in ratio's float32)
    (y * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(ds, st.grad.numpy(), rtol=1e-12)

    from onnxparam.autodiff import _training

    _training.clear_cache()
    for n in (8, 13):
        xn = RNG.normal(size=(n, 4))
        wn = _weights(xn.shape, np.float64)
        loss, grads = grad(_loss, module, op.Tensor.from_numpy(wn), op.Tensor.from_numpy(xn))
        np.testing.assert_allclose(float(loss.to_numpy()), (s * grads.by_path()["s"].to_numpy()).sum(), rtol=1e-10)
    assert len(_training._sessions) == 1


@pytest.mark.parametrize("r,t", [(0.3, True), (0.0, True), (0.3, False)])
def test_dropout_with_ratio_and_training_mode_fed_at_run_time(r, t):
    """``ratio`` and ``training_mode`` graph inputs: in training mode the gradient is the mask's
    over ``1 - r`` (the mask read back from the same run); out of it (or at ``r = 0``) the identity's,
    ``ds = sum_n(w * x)``, exactly."""
    module = op.import_onnx(_dropout_model("fed", "fed"))
    x = RNG.normal(size=(32, 4))
    w = _weights(x.shape, np.float64)
    feeds = (w, x, np.array(r, np.float32), np.array(t))
    named, (mask,) = _run_reading_masks(_loss, module, *feeds)
    ds = named[module.path_of("s") + ".grad"]
    if t and r > 0:
        assert not mask.all()
        np.testing.assert_allclose(ds, (w * x * mask / (1 - np.float32(r))).sum(0), rtol=1e-12)
    else:
        assert mask.all()
        np.testing.assert_allclose(ds, (w * x).sum(0), rtol=1e-12)
    loss, grads = grad(_loss, module, *[op.Tensor.from_numpy(a) for a in feeds])
    s = module.s.val().to_numpy()
    np.testing.assert_allclose(float(loss.to_numpy()), (s * grads.by_path()["s"].to_numpy()).sum(), rtol=1e-10)


# -- a torch CNN exported in training mode ----------------------------------------------------------


def _torch_net(p: float, stem: bool = False):
    """``Conv -> BatchNorm2d -> ReLU -> Dropout(p)`` (one sub-module ``block``; after a 1x1 ``stem``
    convolution when ``stem``), a spatial mean, ``Linear -> BatchNorm1d``; BatchNorm scales and
    shifts drawn (not 1 / 0)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(2, 2, 1) if stem else torch.nn.Identity()
            self.block = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                             torch.nn.ReLU(), torch.nn.Dropout(p))
            self.fc = torch.nn.Linear(4, 3)
            self.norm = torch.nn.BatchNorm1d(3)

        def forward(self, x):
            return self.norm(self.fc(self.block(self.stem(x)).mean((2, 3))))

    net = Net()
    with torch.no_grad():
        for bn in (net.block[1], net.norm):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return net.train()


def _export_training(net, dynamo: bool = False) -> bytes:
    """torch's ONNX export in training mode (BatchNormalization ``training_mode=1``, Dropout with
    ``training_mode`` true), batch and image dims dynamic."""
    import io
    import warnings

    import torch

    f = io.BytesIO()
    x = torch.randn(4, 2, 5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dim = torch.export.Dim
            torch.onnx.export(net, (x,), f, training=torch.onnx.TrainingMode.TRAINING, input_names=["x"],
                              dynamo=True, verbose=False,
                              dynamic_shapes=({0: dim("N", min=2), 2: dim("H", min=2), 3: dim("W", min=2)},))
        else:
            torch.onnx.export(net, (x,), f, training=torch.onnx.TrainingMode.TRAINING, input_names=["x"],
                              output_names=["y"], do_constant_folding=False, dynamo=False,
                              dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
    return f.getvalue()


def _torch_grads(net, x: np.ndarray, w: np.ndarray, mask=None, p: float = 0.0) -> dict:
    """torch autograd of ``sum(w * net(x))`` in train mode, in float64 (a copy of ``net``); with
    ``mask``, the Dropout multiplies by it over ``1 - p`` (``p`` in float32, as the file's ratio)
    instead of drawing its own."""
    import copy

    import torch

    net = copy.deepcopy(net).double()
    if mask is not None:
        scale = float(1 - np.float32(p))
        net.block[3].register_forward_hook(lambda _m, inp, _out: inp[0] * torch.from_numpy(mask) / scale)
    (net(torch.from_numpy(x).double()) * torch.from_numpy(w).double()).sum().backward()
    return {name: t.grad.numpy().copy() for name, t in net.named_parameters()}


_ZERO = ("block.0.bias", "fc.bias")
"""Biases right before a BatchNorm in training mode: their gradient is 0 in exact arithmetic (the
batch mean removes them); the imported model's is float32 rounding (ONNX Runtime has no double
Conv), so they are checked to be ~0 against the largest gradient entry."""


def _assert_close(got: dict, expected: dict, tol: float = 1e-4):
    """Each gradient within ``tol`` of torch's, relative to its largest entry (:data:`_ZERO`: both
    within ``tol`` of the largest entry of all)."""
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    top = max(float(np.abs(e).max()) for e in expected.values())
    for name, e in expected.items():
        if name in _ZERO:
            assert max(float(np.abs(got[name]).max()), float(np.abs(e).max())) <= tol * top, (name, got[name], e)
            continue
        np.testing.assert_allclose(got[name], e, rtol=0, atol=tol * float(np.abs(e).max()), err_msg=name)


def test_torch_cnn_exported_in_training_mode_trains_like_torch():
    """Dropout ``p = 0``: every param's gradient equals torch autograd's in train mode (batch
    statistics) at two shapes (batch and image size changing; one training session); the
    running statistics are frozen (PyTorch's buffers); five Adam steps lower an MSE loss."""
    torch = pytest.importorskip("torch")
    from onnxparam.autodiff import _training

    net = _torch_net(0.0)
    model = op.import_onnx(_export_training(net))
    stats = {f"{m}.running_{k}" for m in ("block.1", "norm") for k in ("mean", "var")}
    assert set(model.onnx_tables) == {model.path_of(n) for n in stats}
    _training.clear_cache()
    for shape in [(4, 2, 5, 6), (5, 2, 7, 8)]:
        x = RNG.normal(size=shape).astype(np.float32)
        w = _weights((shape[0], 3), np.float32)
        expected = _torch_grads(net, x, w)
        _, grads = grad(_loss, model, op.Tensor.from_numpy(w), op.Tensor.from_numpy(x))
        by_path = grads.by_path()
        _assert_close({n: by_path[model.path_of(n)].to_numpy() for n in expected}, expected)
    assert len(_training._sessions) == 1

    from onnxparam.optim import Adam

    x = op.Tensor.from_numpy(RNG.normal(size=(6, 2, 5, 5)).astype(np.float32))
    target = op.Tensor.from_numpy(RNG.normal(size=(6, 3)).astype(np.float32))

    def mse(m, xx, tt):
        d = m(x=xx) - tt
        return (d * d).mean()

    optim = Adam(lr=1e-2)
    loss0, grads = grad(mse, model, x, target)
    for _ in range(5):
        model = optim.step(model, grads)
        loss, grads = grad(mse, model, x, target)
    assert float(loss.to_numpy()) < 0.9 * float(loss0.to_numpy())
    del torch


@pytest.mark.parametrize("marked", [False, True])
def test_torch_cnn_with_dropout_matches_torch_with_the_forward_mask(marked):
    """Dropout ``p = 0.3``: the mask of the training graph's run (read back) put into torch's
    forward; every param's gradient equals torch autograd's. ``marked``: the block holding Conv,
    BatchNorm, ReLU and Dropout (after a stem convolution: its recomputed nodes wait on the
    backward) recomputed in backward (the Dropout's mask is kept, never redrawn)."""
    pytest.importorskip("torch")
    from onnxparam.autodiff import recompute

    p = 0.3
    net = _torch_net(p, stem=marked)
    model = op.import_onnx(_export_training(net))
    if marked:
        model = recompute(model, "block")
    x = RNG.normal(size=(5, 2, 6, 6)).astype(np.float32)
    w = _weights((5, 3), np.float32)
    named, (mask,) = _run_reading_masks(_loss, model, w, x)
    assert mask.shape == (5, 4, 6, 6) and 0.15 < 1 - mask.mean() < 0.45
    expected = _torch_grads(net, x, w, mask, p)
    _assert_close({n: named[model.path_of(n) + ".grad"] for n in expected}, expected)
    if marked:
        from onnxparam.autodiff._recompute import RECOMPUTE_PREFIX

        tm = training_model(_loss, model, op.Tensor.from_numpy(w), op.Tensor.from_numpy(x))
        cloned = [n.op_type for n in tm.graph if n.name.startswith(RECOMPUTE_PREFIX) and n.domain == ""]
        assert "Conv" in cloned and "Dropout" not in cloned, cloned


@pytest.mark.slow
def test_dynamo_exported_dropout_without_a_mask_output():
    """torch's dynamo exporter writes ``Dropout`` with no mask output (and, in training mode, drops
    BatchNorm from the graph: torch 2.13, so only the Dropout model is checked): the training graph
    adds the mask; gradients equal torch's with it."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    p = 0.4
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Dropout(p)).train()
    model = op.import_onnx(_export_training(net, dynamo=True))
    x = RNG.normal(size=(4, 2, 5, 6)).astype(np.float32)
    w = _weights((4, 3, 5, 6), np.float32)
    named, (mask,) = _run_reading_masks(_loss, model, w, x)
    net.zero_grad()
    hook = net[1].register_forward_hook(lambda _m, inp, _o: inp[0] * torch.from_numpy(mask) / float(1 - np.float32(p)))
    (net(torch.from_numpy(x)) * torch.from_numpy(w)).sum().backward()
    hook.remove()
    expected = {n: t.grad.numpy() for n, t in net.named_parameters()}
    _assert_close({n: named[model.path_of(n) + ".grad"] for n in expected}, expected)


def test_dropout_in_training_mode_inside_a_loop_body_is_refused_by_name():
    """A ``Loop`` body's backward recomputes the body's forward, which would draw another mask: the
    gradient is refused naming the node, never computed from a mask the forward did not use."""
    from onnxparam.core.errors import TraceError

    body = helper.make_graph(
        [helper.make_node("Mul", ["h_in", "s"], ["hs"]), helper.make_node("Dropout", ["hs", "r", "t"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", B, []),
         helper.make_tensor_value_info("h_in", D, ["N", 4])],
        [helper.make_tensor_value_info("cond_out", B, []), helper.make_tensor_value_info("h_out", D, ["N", 4])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body)], "g",
        [helper.make_tensor_value_info("x", D, ["N", 4])], [helper.make_tensor_value_info("y", D, None)],
        [numpy_helper.from_array(np.linspace(0.5, 1.5, 4), "s"), numpy_helper.from_array(np.array(0.3, np.float32), "r"),
         numpy_helper.from_array(np.array(True), "t"), numpy_helper.from_array(np.array(2, np.int64), "n")])
    module = op.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = op.Tensor.from_numpy(RNG.normal(size=(3, 4)))
    with pytest.raises(TraceError, match=r"Dropout in training mode inside an If / Loop / Scan body"):
        grad(lambda m, xx: m(x=xx).sum(), module, x)


@pytest.mark.slow
def test_resnet18_exported_in_training_mode_matches_torch_train_mode():
    """torchvision's ResNet18 (tests/torch_zoo.py; BatchNorm scales / shifts drawn), TorchScript
    export in training mode (20 ``BatchNormalization`` nodes with ``training_mode=1``), batch and
    image size dynamic: every param's gradient within 1e-3 of torch autograd's in train mode in
    float64 (the same network and weights; float32 torch itself strays up to ~4e-2 from it on some
    inputs: BatchNorm over the last layers' few values per channel and ReLU / MaxPool ties),
    relative to the largest entry of torch's gradient, at two shapes with one training session."""
    torch = pytest.importorskip("torch")
    import torch_zoo
    from onnxparam.autodiff import _training

    torch.manual_seed(0)
    net = torch_zoo.ResNet18(num_classes=10)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    net.train()
    import io
    import warnings

    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 3, 32, 40),), f, training=torch.onnx.TrainingMode.TRAINING,
                          input_names=["x"], output_names=["y"], do_constant_folding=False, dynamo=False,
                          dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}, "y": {0: "N"}})
    model = op.import_onnx(f.getvalue())
    net = net.double()
    _training.clear_cache()
    rng = np.random.default_rng(0)  # (fixed inputs, whatever ran before)
    worst = 0.0
    for shape in [(2, 3, 32, 40), (3, 3, 40, 48)]:
        x = rng.normal(size=shape).astype(np.float32)
        w = _weights((shape[0], 10), np.float32)
        net.zero_grad()
        (net(torch.from_numpy(x).double()) * torch.from_numpy(w).double()).sum().backward()
        _, grads = grad(_loss, model, op.Tensor.from_numpy(w), op.Tensor.from_numpy(x))
        by_path = grads.by_path()
        for name, t in net.named_parameters():
            e = t.grad.numpy()
            got = by_path[model.path_of(name)].to_numpy()
            err = float(np.abs(got - e).max()) / float(np.abs(e).max())
            worst = max(worst, err)
            assert err < 1e-3, (shape, name, err)
    print(f"resnet18 training mode: worst relative error {worst:.2e}")
    assert len(_training._sessions) == 1
