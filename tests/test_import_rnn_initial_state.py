"""A learned initial state fed straight to an RNN imports as a param (fresh7 F17): ONNX's
schemas mark ``initial_h`` / ``initial_c`` of ``GRU`` / ``LSTM`` / ``RNN`` non-differentiable,
but the library's rules differentiate them, so an initializer read only there is a weight.
Oracle: torch ``nn.GRU`` / ``nn.LSTM`` (bidirectional) with ``h0`` / ``c0`` ``nn.Parameter``s
passed directly, exported by TorchScript and by dynamo; every imported param's gradient that
holds a torch parameter's value equals torch autograd's, and ``check_gradients`` lists nothing.
Also the rule table itself: every input a rule declares it differentiates counts as a weight
use, and a rule that declares one is held to it by the gradient check."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import onnxparam as op
from onnxparam.autodiff import check_gradients, grad

torch = pytest.importorskip("torch")

T, B, I, H = 5, 3, 3, 4


class _Rnn(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.rnn = (torch.nn.GRU if kind == "gru" else torch.nn.LSTM)(I, H, bidirectional=True)
        self.h0 = torch.nn.Parameter(torch.randn(2, B, H) * 0.5)
        if kind == "lstm":
            self.c0 = torch.nn.Parameter(torch.randn(2, B, H) * 0.5)

    def forward(self, x):
        if self.kind == "gru":
            y, h = self.rnn(x, self.h0)
        else:
            y, (h, _) = self.rnn(x, (self.h0, self.c0))
        return y.sum(0) + h.sum(0).repeat(1, 2)


X = np.random.default_rng(3).normal(size=(T, B, I)).astype(np.float32)


@pytest.fixture(scope="module", params=[("gru", "torchscript"), ("lstm", "torchscript"), ("gru", "dynamo"),
                                        ("lstm", "dynamo")], ids=lambda p: "-".join(p))
def exported(request, tmp_path_factory):
    kind, exporter = request.param
    model = _Rnn(kind).eval()
    path = tmp_path_factory.mktemp(f"{kind}_{exporter}") / "rnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(X),), str(path), input_names=["x"], output_names=["y"],
                          dynamo=exporter == "dynamo", opset_version=18 if exporter == "dynamo" else 17,
                          **({"external_data": False} if exporter == "dynamo" else {}))
    model.zero_grad()
    y = model(torch.from_numpy(X))
    (y * y).sum().backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    values = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return kind, path, grads, values


def _loss(m, x):
    y = m(x)
    return (y * y).sum()


def test_initial_states_are_params_with_torch_gradients(exported):
    kind, path, torch_grads, torch_values = exported
    m = op.import_onnx(str(path))
    x = op.Tensor.from_numpy(X)
    params = dict(m.named_params())
    # which imported param holds each initial state: the same values (dynamo renames them val_N)
    states = ["h0"] + (["c0"] if kind == "lstm" else [])
    found = {}
    for name in states:
        hits = [k for k, p in params.items() if p.shape == torch_values[name].shape
                and np.array_equal(p.val().to_numpy(), torch_values[name])]
        assert hits, f"{name} is not a param of the import ({sorted(params)})"
        found[name] = hits[0]
        assert params[hits[0]].require_grad, f"{name} imported frozen"
    assert check_gradients(_loss, m, x) == []
    _, g = grad(_loss, m, x)
    for name, key in found.items():
        got = g.get(params[key].id)
        assert got is not None, f"no gradient for {name} ({key})"
        np.testing.assert_allclose(got.to_numpy(), torch_grads[name], rtol=1e-4, atol=1e-4 * np.abs(
            torch_grads[name]).max())
    # the torch params the file keeps under their names (TorchScript) match too
    for name, p in params.items():
        if name in torch_grads and name not in found:
            np.testing.assert_allclose(g.get(p.id).to_numpy(), torch_grads[name], rtol=1e-4, atol=1e-5)


def test_declared_inputs_are_weight_uses():
    """Every input a rule declares it differentiates is one the ONNX schema marks
    non-differentiable (else the declaration is noise), and the importer counts it as a weight use."""
    import onnx

    from onnxparam.autodiff import _backward  # noqa: F401
    from onnxparam.autodiff._rules import DIFFERENTIATED_INPUTS, RULES
    from onnxparam.onnx_io._weights import _differentiated_inputs

    assert _differentiated_inputs() is DIFFERENTIATED_INPUTS
    assert {"GRU", "LSTM", "RNN"} <= set(DIFFERENTIATED_INPUTS)
    assert DIFFERENTIATED_INPUTS["LSTM"] == (5, 6)
    nd = onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable
    for op_type, indices in DIFFERENTIATED_INPUTS.items():
        assert op_type in RULES
        schema = onnx.defs.get_schema(op_type)
        for i in indices:
            assert schema.inputs[i].differentiation_category == nd, (op_type, i)


class _ZeroStart(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = (torch.nn.GRU if kind == "gru" else torch.nn.LSTM)(I, H, bidirectional=True)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_the_zero_initial_state_dynamo_folds_is_no_trainable_weight(kind, tmp_path):
    """Without ``h0`` torch starts from zeros it creates in ``forward``; a static-batch dynamo export
    folds them into an initializer read at ``initial_h`` / ``initial_c``. It is no torch parameter
    (the file's graph signature lists the parameters; the value is not folded from one), so it
    imports frozen; the RNN's weights, folded from the parameters, train."""
    model = _ZeroStart(kind).eval()
    path = tmp_path / "zero.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(X),), str(path), input_names=["x"], dynamo=True,
                          opset_version=18, external_data=False)
    import onnx

    g = onnx.load(str(path)).graph
    rnn = next(n for n in g.node if n.op_type in ("GRU", "LSTM"))
    states = {name for name in rnn.input[5:] if name}
    assert states and states <= {i.name for i in g.initializer}  # the exporter's form this test is about
    m = op.import_onnx(str(path))
    params = dict(m.named_params())
    for name in states:
        assert name in params and not params[name].require_grad and name in m.onnx_tables, name
    trainable = [p for p, v in params.items() if v.require_grad]
    assert len(trainable) == 3  # W, R, B: the 8 torch parameters of both directions, folded by the exporter
    assert check_gradients(_loss, m, op.Tensor.from_numpy(X)) == []
