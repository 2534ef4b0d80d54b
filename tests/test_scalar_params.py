"""0-d float initializers import as params (F2 of fresh6): a scalar ``nn.Parameter`` (a
pre-emphasis coefficient, a ReZero alpha) is trained by ``grad`` with the gradient PyTorch's
autograd gives it (the oracle), under both exporters; the exporter's own scalar constants
(a buffer, an exponent, TorchScript's ``onnx::`` names) are params too but frozen and listed
in ``onnx_tables`` with the reason, and dynamo's unmarked ``val_N`` (the file marks torch's
parameters and buffers) stay literals of the graph; ``convert`` writes the scalar and
bpk -> onnx gives back the file's bytes; an unmodified import exports the same initializers;
integer scalars and 0-d ``Constant`` literals stay part of the graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cli_run import run_main
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam import ParamGroup
from onnxparam.autodiff import grad
from onnxparam.autodiff._tables import SCALAR_BUFFER, SCALAR_EXPONENT

torch = pytest.importorskip("torch")
nn = torch.nn


class _Scalars(torch.nn.Module):
    """``pre`` and ``blk.alpha`` are scalar parameters, ``temp`` a scalar buffer; ``1e-5``,
    ``0.5`` and ``** 2`` are literals."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Parameter(torch.tensor(0.97))
        self.fc = nn.Linear(8, 8)
        self.blk = nn.Module()
        self.blk.alpha = nn.Parameter(torch.tensor(0.1))
        self.register_buffer("temp", torch.tensor(0.7))

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        h = (x - m) / torch.sqrt(v + 1e-5)
        h = self.fc(h) * 0.5 + self.pre * x
        return (h + self.blk.alpha * torch.tanh(h)) / self.temp


X = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def exported(request, tmp_path_factory):
    import warnings

    path = tmp_path_factory.mktemp(request.param) / "scalars.onnx"
    model = _Scalars().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if request.param == "dynamo":
            torch.onnx.export(model, (torch.from_numpy(X),), str(path), input_names=["x"], dynamo=True,
                              opset_version=18, verbose=False)
        else:
            torch.onnx.export(model, (torch.from_numpy(X),), str(path), input_names=["x"], dynamo=False,
                              opset_version=17)
    return request.param, path, model


def _torch_grads(model, **values):
    with torch.no_grad():
        for name, value in values.items():
            model.get_parameter(name).copy_(torch.tensor(value))
    model.zero_grad()
    y = model(torch.from_numpy(X))
    loss = (y * y).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _loss(mm, x):
    y = mm(x)
    return (y * y).mean()


def test_a_scalar_parameter_gets_the_gradient_torch_autograd_gives_it(exported):
    kind, path, model = exported
    module = op.import_onnx(path)
    params = dict(module.named_params())
    assert params["pre"].shape == () and params["pre"].require_grad
    assert params["blk.alpha"].require_grad
    want_loss, want = _torch_grads(model)
    loss, grads = grad(_loss, module, op.Tensor.from_numpy(X))
    got = grads.by_path()
    np.testing.assert_allclose(float(loss.to_numpy()), want_loss, rtol=1e-5)
    for name in ("pre", "blk.alpha", "fc.bias"):
        np.testing.assert_allclose(got[name].to_numpy(), want[name], rtol=1e-4, atol=1e-6, err_msg=f"{kind} {name}")
    assert got["pre"].to_numpy().shape == ()


def test_a_loaded_scalar_is_the_value_the_module_computes_with(exported):
    _, path, model = exported
    module = op.import_onnx(path).try_load_record({"pre": np.float32(0.5), "blk.alpha": np.float32(-0.25)},
                                             allow_partial=True)
    want_loss, _ = _torch_grads(_Scalars().eval(), pre=0.5, **{"blk.alpha": -0.25})
    np.testing.assert_allclose(float(_loss(module, op.Tensor.from_numpy(X)).to_numpy()), want_loss, rtol=1e-5)


def test_the_exporters_scalar_constants_are_frozen_and_listed_with_the_reason(exported):
    kind, path, _ = exported
    module = op.import_onnx(path)
    params = dict(module.named_params())
    tables = module.onnx_tables
    assert "pre" not in tables and "blk.alpha" not in tables
    source = onnx.load(str(path))
    scalars = [i.name for i in source.graph.initializer if not i.dims and i.data_type == TensorProto.FLOAT]
    literals = [n for n in source.graph.node if n.op_type == "Constant"]
    if kind == "dynamo":
        # the file marks torch's parameters / buffers (InputSpec metadata): its unmarked val_N
        # are literals of the graph, as the state dict says (no params); the buffer is frozen
        assert tables["temp"] == SCALAR_BUFFER and not params["temp"].require_grad
        made = [n for n in scalars if n.startswith("val_")]
        assert made, scalars
        assert sorted(module.onnx_names.values()) == sorted(["pre", "blk.alpha", "temp", "fc.weight", "fc.bias"])
        # frozen params get no gradient; unfreezing them gives one
        _, grads = grad(_loss, module, op.Tensor.from_numpy(X))
        assert not set(grads.by_path()) & set(tables)
        thawed = module.unfreeze_group(ParamGroup.from_paths(module.onnx_tables))
        _, grads = grad(_loss, thawed, op.Tensor.from_numpy(X))
        assert "temp" in grads.by_path()
    else:
        # TorchScript: literals are 0-d Constant nodes (not params); no marks tell a buffer from
        # a parameter, so a state-dict-named scalar is trainable
        assert literals and not any(n.output[0] in module.onnx_names.values() for n in literals)
        assert params["temp"].require_grad


def test_an_unmodified_import_exports_the_scalars_byte_for_byte(exported, tmp_path):
    _, path, _ = exported
    out = op.export_onnx(op.import_onnx(path), tmp_path / "again.onnx")
    src = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    back = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer}
    for name, value in src.items():
        if value.ndim == 0:
            assert back[name].dtype == value.dtype and back[name].tobytes() == value.tobytes(), name


def test_convert_writes_the_scalar_and_back_to_onnx_gives_its_bytes(exported, tmp_path):
    _, path, _ = exported
    res = run_main("convert", path, tmp_path / "m.bpk", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = run_main("convert", tmp_path / "m.bpk", tmp_path / "back.onnx", "--graph", path, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    want = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    got = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "back.onnx")).graph.initializer}
    for name in ("pre", "blk.alpha"):
        assert got[name].shape == () and got[name].tobytes() == want[name].tobytes()
    with op.burnpack.read(tmp_path / "m.bpk") as f:
        pre = f.tensors["pre"].to_numpy()
    assert pre.shape == () and pre.tobytes() == want["pre"].tobytes()


def _hand_model() -> onnx.ModelProto:
    """No exporter marks: ``scale`` (a state-dict name) is a weight; ``onnx::Mul_3`` (an
    exporter's name) and ``expo`` (only Pow's exponent) are frozen; ``k`` (int64) and the 0-d
    ``Constant`` stay in the graph."""
    f = lambda v, n: numpy_helper.from_array(np.array(v, np.float32), n)  # noqa: E731
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["a"]),
        helper.make_node("Mul", ["a", "onnx::Mul_3"], ["b"]),
        helper.make_node("Pow", ["b", "expo"], ["c"]),
        helper.make_node("Constant", [], ["lit"], value=f(0.25, "lit")),
        helper.make_node("Add", ["c", "lit"], ["d"]),
        helper.make_node("Add", ["n", "k"], ["m"]),
        helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["d", "mf"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                                           helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                              [f(1.5, "scale"), f(0.5, "onnx::Mul_3"), f(2.0, "expo"),
                               numpy_helper.from_array(np.array(3, np.int64), "k")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_without_exporter_marks_names_and_uses_decide_and_ints_stay_constants():
    module = op.import_onnx(_hand_model())
    params = dict(module.named_params())
    names = module.onnx_names
    assert sorted(names.values()) == ["expo", "onnx::Mul_3", "scale"]  # not k, not the Constant literal
    assert params["scale"].require_grad and module.path_of("scale") not in module.onnx_tables
    generated = module.path_of("onnx::Mul_3")
    assert not params[generated].require_grad and "exporter" in module.onnx_tables[generated]
    assert module.onnx_tables["expo"] == SCALAR_EXPONENT and not params["expo"].require_grad
    # the gradient of the one trainable scalar: d/dscale sum((x*scale*0.5)**2 + 0.25 + n + 3)
    x = np.array([1.0, -2.0, 0.5], np.float32)
    _, grads = grad(lambda mm, x, n: mm(x, n).sum(), module, op.Tensor.from_numpy(x),
                    op.Tensor.from_numpy(np.array(1, np.int64)))
    assert set(grads.by_path()) == {"scale"}
    np.testing.assert_allclose(grads.by_path()["scale"].to_numpy(), np.sum(2 * 1.5 * (0.5 * x) ** 2), rtol=1e-6)


def test_quantizing_even_at_min_rank_0_leaves_the_scalars_float(exported):
    from onnxparam.core.dtype import DType
    from onnxparam.quant import Quantizer

    _, path, _ = exported
    q = dict(op.import_onnx(path).quantize_weights(Quantizer(min_rank=0)).named_params())
    assert q["pre"].lazy_dtype() is DType.F32 and q["blk.alpha"].lazy_dtype() is DType.F32
    assert q["fc.weight"].lazy_dtype() is DType.QFloat


def test_a_torch_state_dict_loads_without_the_exporters_scalar_constants():
    from onnxparam.convert import LoadReport, load_pytorch

    report = LoadReport()
    module = load_pytorch(op.import_onnx(_hand_model()), {"scale": np.float32(3.0), "expo": np.float32(2.0)},
                          report=report)
    generated = module.path_of("onnx::Mul_3")
    assert any(generated in s for s in report.skipped) and generated not in report.missing
    x = np.array([1.0, -2.0, 0.5], np.float32)
    want = (x * 3.0 * 0.5) ** 2 + 0.25 + 1 + 3  # the graph's formula with the loaded scale
    np.testing.assert_allclose(module(x, np.array(1, np.int64)).to_numpy(), want, rtol=1e-6)


def test_in_a_marked_file_unmarked_scalars_are_literals_unless_folded_from_a_possible_parameter():
    import onnx_ir as ir

    from onnxparam.autodiff._tables import SCALAR_FOLDED

    f = lambda v, n: numpy_helper.from_array(np.array(v, np.float32), n)  # noqa: E731
    nodes = [helper.make_node("Mul", ["x", "w"], ["a"]), helper.make_node("Mul", ["a", "val_1"], ["b"]),
             helper.make_node("Mul", ["b", "val_2"], ["c"]), helper.make_node("Add", ["c", "val_3"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                              [f([1.0, 2.0, 3.0], "w"), f(0.5, "val_1"), f(0.25, "val_2"), f(2.0, "val_3")])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    inits = model.graph.initializers
    inits["w"].metadata_props["pkg.torch.export.graph_signature.InputSpec.kind"] = "PARAMETER"
    inits["val_2"].metadata_props["pkg.onnxscript.optimizer.folded_from"] = "['val_0']"  # from constants
    inits["val_3"].metadata_props["pkg.onnxscript.optimizer.folded_from"] = "['scale', 'val_9']"  # a doubt
    module = op.import_onnx(model)
    assert sorted(module.onnx_names.values()) == ["val_3", "w"]  # val_1, val_2: literals of the graph
    assert module.onnx_tables["val_3"] == SCALAR_FOLDED.format("['scale', 'val_9']")
    assert not module.param_of("val_3").require_grad
    x = np.array([1.0, -2.0, 0.5], np.float32)
    np.testing.assert_allclose(module(x).to_numpy(), x * [1, 2, 3] * 0.5 * 0.25 + 2.0, rtol=1e-6)
