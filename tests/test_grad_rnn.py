"""Gradients of ONNX's LSTM / GRU / RNN (imported single-node models, every input a param).

Oracles: central finite differences in float64 of a numpy implementation of the ONNX operator
specification (tests/rnn_reference.py, itself checked against plain ONNX Runtime's forward);
torch autograd on torch's nn.LSTM / nn.GRU / nn.RNN exported to ONNX (TorchScript exporter).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import grad

import rnn_reference

ort = pytest.importorskip("onnxruntime")

INPUTS = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _arrays(op_type, *, T, N, I, H, direction, layout, lens, states, peep, bias, seed):
    rng = np.random.default_rng(seed)
    D = 2 if direction == "bidirectional" else 1
    G = GATES[op_type]
    a = {"X": rng.normal(size=(N, T, I) if layout else (T, N, I)),
         "W": rng.normal(size=(D, G * H, I)) * 0.5, "R": rng.normal(size=(D, G * H, H)) * 0.5}
    if bias:
        a["B"] = rng.normal(size=(D, 2 * G * H)) * 0.3
    if lens is not None:
        a["sequence_lens"] = np.asarray(lens, np.int32)
    if states:
        shape = (N, D, H) if layout else (D, N, H)
        a["initial_h"] = rng.normal(size=shape) * 0.5
        if op_type == "LSTM":
            a["initial_c"] = rng.normal(size=shape) * 0.5
    if peep:
        a["P"] = rng.normal(size=(D, 3 * H)) * 0.5
    return a


def _model(op_type, arrays, attrs, opset=14, drop_y=False):
    names = [n if n in arrays else "" for n in INPUTS[:8 if op_type == "LSTM" else 6]]
    while names and names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][:3 if op_type == "LSTM" else 2]
    # NOTE: ONNX's schema marks the initial states non-differentiable, so the importer keeps
    # them constants; read through an Identity they are weights (params) like the others
    nodes = []
    for k in ("initial_h", "initial_c"):
        if k in names:
            nodes.append(helper.make_node("Identity", [k], [k + "_read"]))
            names[names.index(k)] = k + "_read"
    node = helper.make_node(op_type, names, [""] + outs[1:] if drop_y else outs, **attrs)
    outs = outs[1:] if drop_y else outs
    inits = [numpy_helper.from_array(v.astype(np.float32) if v.dtype == np.float64 else v, k)
             for k, v in arrays.items()]
    graph = helper.make_graph(nodes + [node], "g", [],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _coefs(outputs, seed):
    rng = np.random.default_rng(seed + 100)
    return [rng.normal(size=o.shape) for o in outputs]


CASES = {
    "lstm_bidirectional_lens_states_peepholes": ("LSTM", dict(direction="bidirectional", layout=0, lens=[4, 2, 3],
                                                               states=True, peep=True, bias=True)),
    "lstm_reverse_lens": ("LSTM", dict(direction="reverse", layout=0, lens=[3, 4, 1], states=True, peep=False,
                                               bias=True)),
    "lstm_forward_x_w_r_only": ("LSTM", dict(direction="forward", layout=0, lens=None, states=False, peep=False,
                                             bias=False)),
    "lstm_without_y_output": ("LSTM", dict(direction="bidirectional", layout=0, lens=[3, 4, 2], states=True,
                                           peep=False, bias=True, drop_y=True)),
    "gru_bidirectional_lens_linear_before_reset": ("GRU", dict(direction="bidirectional", layout=0, lens=[4, 1, 3],
                                                               states=True, peep=False, bias=True, lbr=1)),
    "gru_reverse_reset_after": ("GRU", dict(direction="reverse", layout=0, lens=None, states=True, peep=False,
                                                    bias=True, lbr=0)),
    "rnn_bidirectional_lens": ("RNN", dict(direction="bidirectional", layout=0, lens=[2, 4, 3], states=True,
                                           peep=False, bias=True)),
    "rnn_forward_sigmoid": ("RNN", dict(direction="forward", layout=0, lens=None, states=False, peep=False,
                                                bias=True, act="Sigmoid")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recurrent_gradient_matches_float64_central_differences(case):
    op_type, kw = CASES[case]
    kw = dict(kw)
    lbr, act, drop_y = kw.pop("lbr", None), kw.pop("act", None), kw.pop("drop_y", False)
    arrays = _arrays(op_type, T=4, N=3, I=3, H=2, seed=len(case), **kw)
    attrs = {"hidden_size": 2, "direction": kw["direction"]}
    if kw["layout"]:
        attrs["layout"] = 1
    if lbr is not None:
        attrs["linear_before_reset"] = lbr
    if act is not None:
        attrs["activations"] = [act] * (2 if kw["direction"] == "bidirectional" else 1)
    model = _model(op_type, arrays, attrs, drop_y=drop_y)  # drop_y: the node does not output Y
    # the oracle computes what plain ONNX Runtime computes
    f32 = {k: (v.astype(np.float32).astype(np.float64) if v.dtype == np.float64 else v) for k, v in arrays.items()}
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})
    want = rnn_reference.run(op_type, f32, attrs)[1 if drop_y else 0:]
    for got, ref in zip(plain, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    coefs = _coefs(want, len(case))

    def np_loss(values):
        outs = rnn_reference.run(op_type, values, attrs)[1 if drop_y else 0:]
        return sum(float((o * c).sum()) for o, c in zip(outs, coefs))

    def loss_fn(m):
        outs = m()
        total = None
        for o, c in zip(outs, coefs):
            term = (o * op.Tensor.from_numpy(c.astype(np.float32))).sum()
            total = term if total is None else total + term
        return total

    module = op.import_onnx(model)
    loss, grads = grad(loss_fn, module)
    np.testing.assert_allclose(float(loss.to_numpy()), np_loss(f32), rtol=1e-4, atol=1e-4)
    by_path = grads.by_path()
    floats = [k for k, v in arrays.items() if v.dtype == np.float64]
    assert sorted(by_path) == sorted(floats)
    eps = 1e-6
    for name in floats:
        got = by_path[name].to_numpy().astype(np.float64)
        want_g = np.zeros_like(f32[name])
        for idx in np.ndindex(*f32[name].shape):
            plus, minus = dict(f32), dict(f32)
            plus[name], minus[name] = f32[name].copy(), f32[name].copy()
            plus[name][idx] += eps
            minus[name][idx] -= eps
            want_g[idx] = (np_loss(plus) - np_loss(minus)) / (2 * eps)
        np.testing.assert_allclose(got, want_g, rtol=1e-3, atol=1e-4, err_msg=f"{case}: d/d{name}")


# -- torch's nn.LSTM / nn.GRU / nn.RNN exported by the TorchScript exporter ---------------------

# ONNX gate order per torch gate block (torch LSTM: i f g o -> ONNX i o f c; GRU: r z n -> z r h)
TORCH_BLOCKS = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}


def _torch_to_onnx_layout(op_type, weight, hidden):
    blocks = [weight[k * hidden:(k + 1) * hidden] for k in range(len(TORCH_BLOCKS[op_type]))]
    return np.concatenate([blocks[k] for k in TORCH_BLOCKS[op_type]], axis=0)


@pytest.mark.parametrize("op_type", ["LSTM", "GRU", "RNN"])
def test_torch_exported_bidirectional_batch_first_recurrent_gradients_match_torch_autograd(op_type):
    torch = pytest.importorskip("torch")
    import io
    import warnings

    import onnx

    from onnxparam.onnx_io._naming import onnx_name_to_path

    hidden, layers = 4, 2 if op_type == "LSTM" else 1

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(3, 3)
            self.rnn = getattr(torch.nn, op_type)(3, hidden, num_layers=layers, batch_first=True, bidirectional=True)

        def forward(self, x):
            out = self.rnn(self.proj(x))
            return (out[0],) + (tuple(out[1]) if op_type == "LSTM" else (out[1],))

    torch.manual_seed(len(op_type))
    net = Net().eval()
    names = ["y", "h", "c"][:3 if op_type == "LSTM" else 2]
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 5, 3),), buffer, dynamo=False, input_names=["x"], output_names=names,
                          dynamic_axes={"x": {0: "N", 1: "T"}}, opset_version=17)
    model = onnx.load_from_string(buffer.getvalue())
    module = op.import_onnx(model)
    rec_nodes = [n for n in model.graph.node if n.op_type == op_type]
    assert len(rec_nodes) == layers
    from onnxparam.autodiff import _training

    def loss_fn(m, x, *coefs):  # one function object: the training graph is cached by it
        total = None
        for o, c in zip(m(x), coefs):
            term = (o * c).sum()
            total = term if total is None else total + term
        return total

    _training.clear_cache()
    sessions = []
    for length in (5, 3, 7):  # one symbolic session serves every length
        rng = np.random.default_rng(length)
        x = rng.normal(size=(2, length, 3)).astype(np.float32)
        outs = net(torch.from_numpy(x))
        coefs = [rng.normal(size=tuple(o.shape)).astype(np.float32) for o in outs]
        net.zero_grad()
        sum((o * torch.from_numpy(c)).sum() for o, c in zip(outs, coefs)).backward()

        _, grads = grad(loss_fn, module, op.Tensor.from_numpy(x), *(op.Tensor.from_numpy(c) for c in coefs))
        sessions.append(len(_training._sessions))
        got = grads.by_path()
        params = dict(net.named_parameters())
        # the exporter stores proj.weight transposed, as the MatMul's second input
        matmul = next(n for n in model.graph.node if n.op_type == "MatMul")
        np.testing.assert_allclose(got[onnx_name_to_path(matmul.input[1])].to_numpy(),
                                   params["proj.weight"].grad.numpy().T, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["proj.bias"].to_numpy(), params["proj.bias"].grad.numpy(), rtol=1e-4, atol=1e-5)
        for layer, node in enumerate(rec_nodes):
            w, r, b = (got[onnx_name_to_path(n)].to_numpy() for n in node.input[1:4])
            for d, suffix in enumerate(["", "_reverse"]):
                def torch_grad(kind, layer=layer, suffix=suffix):
                    return params[f"rnn.{kind}_l{layer}{suffix}"].grad.numpy()

                want_w = _torch_to_onnx_layout(op_type, torch_grad("weight_ih"), hidden)
                want_r = _torch_to_onnx_layout(op_type, torch_grad("weight_hh"), hidden)
                want_b = np.concatenate([_torch_to_onnx_layout(op_type, torch_grad("bias_ih"), hidden),
                                         _torch_to_onnx_layout(op_type, torch_grad("bias_hh"), hidden)])
                where = f"{op_type} layer {layer} direction {d} length {length}"
                np.testing.assert_allclose(w[d], want_w, rtol=1e-4, atol=1e-5, err_msg=where + " W")
                np.testing.assert_allclose(r[d], want_r, rtol=1e-4, atol=1e-5, err_msg=where + " R")
                np.testing.assert_allclose(b[d], want_b, rtol=1e-4, atol=1e-5, err_msg=where + " B")
    assert sessions == [1, 1, 1]  # the export's dynamic dims: one symbolic training graph from the first call


@pytest.mark.parametrize("op_type", ["LSTM", "GRU"])
def test_one_backward_graph_and_session_serve_two_sequence_lengths(op_type):
    """The rule alone on a graph whose sequence length and batch are symbolic: forward node, then
    its backward for output gradients fed as inputs; one ONNX Runtime session, two lengths."""
    import onnx_ir as ir

    from onnxparam.autodiff._emitter import Emitter
    from onnxparam.autodiff._rules import RULES

    H, I, D = 2, 3, 2
    G = GATES[op_type]
    names = INPUTS[:8 if op_type == "LSTM" else 6]
    float_t = ir.TensorType(ir.DataType.FLOAT)
    shapes = {"X": ["T", "N", I], "W": [D, G * H, I], "R": [D, G * H, H], "B": [D, 2 * G * H],
              "sequence_lens": ["N"], "initial_h": [D, "N", H], "initial_c": [D, "N", H], "P": [D, 3 * H]}
    inputs = {n: ir.Value(name=n, type=ir.TensorType(ir.DataType.INT32) if n == "sequence_lens" else float_t,
                          shape=ir.Shape(shapes[n])) for n in names}
    outs = ["Y", "Y_h", "Y_c"][:3 if op_type == "LSTM" else 2]
    node = ir.Node("", op_type, [inputs[n] for n in names],
                   [ir.AttrInt64("hidden_size", H), ir.AttrString("direction", "bidirectional")]
                   + ([ir.AttrInt64("linear_before_reset", 0)] if op_type == "GRU" else []), num_outputs=len(outs),
                   name="rec")
    grads_in = []
    for out, name, shape in zip(node.outputs, outs, [["T", D, "N", H], [D, "N", H], [D, "N", H]]):
        out.name, out.type, out.shape = name, float_t, ir.Shape(shape)
        grads_in.append(ir.Value(name="g_" + name, type=float_t, shape=ir.Shape(shape)))
    graph = ir.Graph(list(inputs.values()) + grads_in, [], nodes=[node], name="g", opset_imports={"": 17})
    e = Emitter(graph, 17)
    need = [n != "sequence_lens" for n in names]
    results = RULES[op_type](e, node, grads_in, need)
    wanted = [n for n, k in zip(names, need) if k]
    for n, g in zip(names, results):
        if g is not None:
            out = e.op("Identity", g)
            out.name = "d_" + n
            graph.outputs.append(out)
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=9))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for length, lens in ((5, [5, 2, 4]), (3, [1, 3, 2])):
        arrays = _arrays(op_type, T=length, N=3, I=I, H=H, direction="bidirectional", layout=0, lens=lens,
                         states=True, peep=op_type == "LSTM", bias=True, seed=length)
        attrs = {"hidden_size": H, "direction": "bidirectional", "linear_before_reset": 0}
        f32 = {k: (v.astype(np.float32).astype(np.float64) if v.dtype == np.float64 else v) for k, v in arrays.items()}
        coefs = _coefs(rnn_reference.run(op_type, f32, attrs), length)
        feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in arrays.items()}
        feeds.update({"g_" + n: c.astype(np.float32) for n, c in zip(outs, coefs)})
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))

        def np_loss(values):
            return sum(float((o * c).sum()) for o, c in zip(rnn_reference.run(op_type, values, attrs), coefs))

        eps = 1e-6
        for name in wanted:
            want = np.zeros_like(f32[name])
            for idx in np.ndindex(*f32[name].shape):
                plus, minus = dict(f32), dict(f32)
                plus[name], minus[name] = f32[name].copy(), f32[name].copy()
                plus[name][idx] += eps
                minus[name][idx] -= eps
                want[idx] = (np_loss(plus) - np_loss(minus)) / (2 * eps)
            np.testing.assert_allclose(got["d_" + name], want, rtol=1e-3, atol=1e-4, err_msg=f"length {length}: {name}")


@pytest.mark.parametrize("attrs, message", [({"clip": 1.0}, "clip"), ({"input_forget": 1}, "input_forget"),
                                            ({"activations": ["Relu", "Tanh", "Tanh"]}, "default activations")])
def test_lstm_forms_without_a_rule_are_refused_naming_the_node(attrs, message):
    arrays = _arrays("LSTM", T=3, N=2, I=3, H=2, direction="forward", layout=0, lens=None, states=False,
                     peep=False, bias=True, seed=0)
    model = _model("LSTM", arrays, {"hidden_size": 2, **attrs})
    module = op.import_onnx(model)
    with pytest.raises(op.TraceError, match=rf"LSTM.*{message}"):
        grad(lambda m: m()[0].sum(), module)
