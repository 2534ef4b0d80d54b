"""ONNX export: initializer names = module paths, ids and flags in metadata, lazy and streamed
values, external data (automatic, sharded, aligned), atomic writes, imported models written back
as they were, and the ONNX <-> record bridge.

Oracles: ONNX's checker and shape inference, plain ONNX Runtime on the written file, numpy
formulas, a Burn-written burnpack file's names / bytes / ids, and the original ONNX file.
"""

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import onnxparam as op
from onnxparam import (
    DType,
    Module,
    ModuleRecord,
    OnnxFormatError,
    Param,
    ParamGroup,
    ParamId,
    RecordError,
    Tensor,
)
from onnxparam.nn import Linear
from onnxparam.onnx_io import _save as save_module
from onnxparam.onnx_io import (
    export_onnx,
    import_onnx,
    read_onnx_record,
    write_record_to_onnx,
)
from onnxparam.onnx_io._exporter import trace_for_export
from onnxparam.zoo import mnist

DATA = __import__("pathlib").Path(__file__).parent / "data" / "onnx"


def session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check(path):
    """The file passes ONNX's full check and its shape inference."""
    onnx.checker.check_model(str(path), full_check=True)
    onnx.shape_inference.infer_shapes_path(str(path), str(path) + ".inferred.onnx", strict_mode=True)
    os.remove(str(path) + ".inferred.onnx")


def t(array) -> Tensor:
    return Tensor.from_numpy(np.asarray(array))


class Mlp(Module):
    def __init__(self):
        self.fc1 = Linear(4, 3)
        self.fc2 = Linear(3, 2)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def with_ids(module, first: int):
    ids = iter(range(first, first + 1000))
    return module.map(lambda path, p: Param(ParamId(next(ids)), value=p.val()))


# -- any module -----------------------------------------------------------------------------------


def test_a_module_exports_with_initializers_named_by_path_and_runs_in_onnx_runtime(tmp_path):
    model = with_ids(Mlp(), 100)
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    path = export_onnx(model, tmp_path / "mlp.onnx", t(x), input_names=["x"], output_names=["y"],
                       dynamic_axes={"x": {0: "batch"}})
    check(path)
    proto = onnx.load(str(path))
    assert {i.name for i in proto.graph.initializer} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    w = {name: p.val().to_numpy() for name, p in model.named_params()}
    expected = np.maximum(x @ w["fc1.weight"] + w["fc1.bias"], 0) @ w["fc2.weight"] + w["fc2.bias"]
    got = session(path).run(None, {"x": np.concatenate([x, x])})[0]
    np.testing.assert_allclose(got, np.concatenate([expected, expected]), rtol=1e-5, atol=1e-6)


def test_param_ids_and_trainable_flags_are_in_initializer_and_model_metadata(tmp_path):
    model = with_ids(Mlp(), 2**64 - 10).freeze_group(ParamGroup.from_path("fc1"))
    path = export_onnx(model, tmp_path / "mlp.onnx", t(np.zeros((1, 4), np.float32)))
    proto = onnx.load(str(path))
    props = {i.name: {p.key: p.value for p in i.metadata_props} for i in proto.graph.initializer}
    ids = {name: int(p.id) for name, p in model.named_params()}
    for name, pid in ids.items():
        assert props[name]["onnxparam.param_id"] == str(pid)
    assert props["fc1.weight"]["onnxparam.require_grad"] == "false"
    assert props["fc2.bias"]["onnxparam.require_grad"] == "true"
    table = json.loads({p.key: p.value for p in proto.metadata_props}["onnxparam.params"])
    assert table["fc1.bias"] == {"param_id": str(ids["fc1.bias"]), "require_grad": False}
    model_props = {p.key: p.value for p in proto.metadata_props}
    assert model_props["onnxparam.module"].endswith("test_onnx_export.Mlp")
    assert model_props["onnxparam.version"] == op.__version__
    imported = import_onnx(path)
    assert {p: (int(v.id), v.require_grad) for p, v in imported.named_params()} == {
        p: (int(v.id), v.require_grad) for p, v in model.named_params()}


def test_mnist_burnpack_to_onnx_to_burnpack_keeps_names_bytes_and_ids(tmp_path):
    burn = ModuleRecord.load_file(mnist.weights_path())  # written by Burn, with Burn's ids
    model = mnist.Mnist().load_file(mnist.weights_path())
    images, _ = mnist.load_digits()
    x = t(images[:4].astype(np.float32))
    path = export_onnx(model, tmp_path / "mnist.onnx", x, dynamic_axes={0: {0: "batch"}})
    check(path)
    record = read_onnx_record(path)
    imported = import_onnx(path)
    assert list(record) == list(burn) == [p for p, _ in imported.named_params()]
    for name, snap in burn.items():
        assert record[name].param_id == snap.param_id
        np.testing.assert_array_equal(record[name].to_data().to_numpy(), snap.to_data().to_numpy())
    back = op.burnpack.read(imported.save_file(tmp_path / "again.bpk"))
    for name, snap in burn.items():
        assert back.tensors[name].param_id == int(snap.param_id)
        np.testing.assert_array_equal(back.tensors[name].to_numpy(), snap.to_data().to_numpy())
    np.testing.assert_array_equal(imported(x).to_numpy(), session(path).run(None, {"x": images[:4].astype(np.float32)})[0])


def test_lora_adapters_are_merged_into_the_exported_weight(tmp_path):
    model = Mlp().apply_lora(op.LoraConfig(rank=2, alpha=4.0, seed=0))
    model = model.map(lambda path, p: p.map(lambda v: t(np.full(v.shape, 0.1, np.float32)))
                      if path.endswith(".lora.b") else p)
    path = export_onnx(model, tmp_path / "lora.onnx", t(np.zeros((1, 4), np.float32)))
    proto = onnx.load(str(path))
    weights = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    assert not any(".lora." in name for name in weights)
    params = dict(model.named_params())
    base = params["fc1.weight"].base().to_numpy()
    a, b = (params[f"fc1.weight{s}"].val().to_numpy() for s in (".lora.a", ".lora.b"))
    np.testing.assert_allclose(weights["fc1.weight"], base + 2.0 * (a @ b), rtol=1e-6)


def test_export_writes_lazy_params_through_lazy_tensors_one_at_a_time(tmp_path):
    calls = []

    class Lazy(Module):
        def __init__(self):
            def init(name, shape):
                def run(device, require_grad):
                    calls.append(name)
                    return t(np.full(shape, len(calls), np.float32))
                return run

            self.a = Param.uninitialized(ParamId(1), init("a", (2, 2)), "cpu", True, (2, 2))
            self.b = Param.uninitialized(ParamId(2), init("b", (2, 2)), "cpu", True, (2, 2))

        def forward(self, x):
            return (x @ self.a.val()) @ self.b.val()

    module = Lazy()
    model = trace_for_export(module, t(np.ones((1, 2), np.float32)))
    assert all(isinstance(v.const_value, ir.LazyTensor) for v in model.graph.initializers.values())
    assert calls == []
    save_module.save_model(model, tmp_path / "lazy.onnx", external_data=True, external_data_min_tensor_bytes=0)
    assert calls == ["a", "b"]
    check(tmp_path / "lazy.onnx")


# -- external data and atomic writes --------------------------------------------------------------


class Big(Module):
    """Two weights above the alignment threshold (1 MiB) and one small one."""

    def __init__(self):
        rng = np.random.default_rng(3)
        self.w1 = Param.initialized(ParamId(11), t(rng.normal(size=(512, 640)).astype(np.float32)))
        self.w2 = Param.initialized(ParamId(12), t(rng.normal(size=(640, 512)).astype(np.float32)))
        self.b = Param.initialized(ParamId(13), t(np.arange(512, dtype=np.float32)))

    def forward(self, x):
        return (x @ self.w1.val()) @ self.w2.val() + self.b.val()


def test_external_data_on_request_is_sharded_aligned_and_keeps_metadata(tmp_path):
    model = Big()
    x = np.random.default_rng(4).normal(size=(2, 512)).astype(np.float32)
    path = export_onnx(model, tmp_path / "big.onnx", t(x), input_names=["x"], external_data=True,
                       max_shard_size_bytes=1_500_000)
    shards = sorted(p.name for p in tmp_path.iterdir() if p.name != "big.onnx")
    assert shards == ["big-00001-of-00002.onnx.data", "big-00002-of-00002.onnx.data"]
    check(path)
    proto = onnx.load(str(path), load_external_data=False)
    for init in proto.graph.initializer:
        props = {p.key: p.value for p in init.metadata_props}
        assert props["onnxparam.param_id"] == str(int(getattr(model, init.name).id))
        if init.name in ("w1", "w2"):
            location = {e.key: e.value for e in init.external_data}
            assert int(location.get("offset", 0)) % 65536 == 0
    w = {n: p.val().to_numpy() for n, p in model.named_params()}
    expected = (x.astype(np.float64) @ w["w1"] @ w["w2"] + w["b"]).astype(np.float32)
    np.testing.assert_allclose(session(path).run(None, {"x": x})[0], expected, rtol=1e-4, atol=5e-3)
    record = read_onnx_record(path)
    assert [int(s.param_id) for s in record.values()] == [11, 12, 13]


def test_external_data_is_chosen_automatically_above_the_protobuf_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "AUTO_EXTERNAL_DATA_BYTES", 1_000_000)
    path = export_onnx(Big(), tmp_path / "auto.onnx", t(np.zeros((1, 512), np.float32)))
    assert (tmp_path / "auto.onnx.data").is_file()
    check(path)
    with pytest.raises(OnnxFormatError, match=r"auto2.onnx: the model's tensors take 2623488 bytes, more than one "
                                              r"protobuf can hold \(2 GiB\); save with external_data=True"):
        export_onnx(Big(), tmp_path / "auto2.onnx", t(np.zeros((1, 512), np.float32)), external_data=False)
    assert not (tmp_path / "auto2.onnx").exists()


def test_a_failed_export_leaves_the_old_file_and_no_temporaries(tmp_path):
    path = export_onnx(Mlp(), tmp_path / "m.onnx", t(np.zeros((1, 4), np.float32)))
    before = path.read_bytes()

    def boom(device, require_grad):
        raise RuntimeError("disk full while drawing weights")

    broken = Mlp().map(lambda p, prm: Param.uninitialized(prm.id, boom, "cpu", True, prm.shape) if p == "fc2.bias" else prm)
    with pytest.raises(RuntimeError, match="disk full"):
        export_onnx(broken, path, t(np.zeros((1, 4), np.float32)))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_reexporting_an_external_data_model_over_itself_reads_before_it_replaces(tmp_path):
    path = export_onnx(Big(), tmp_path / "big.onnx", t(np.zeros((1, 512), np.float32)), input_names=["x"],
                       external_data=True)
    x = np.random.default_rng(5).normal(size=(1, 512)).astype(np.float32)
    expected = session(path).run(None, {"x": x})[0]
    imported = import_onnx(path)
    changed = imported.map(lambda p, prm: prm.map(lambda v: t(v.to_numpy() * 2)) if p == "b" else prm)
    export_onnx(changed, path, external_data=True)
    check(path)
    np.testing.assert_allclose(session(path).run(None, {"x": x})[0], expected + np.arange(512, dtype=np.float32),
                               rtol=1e-5, atol=1e-4)


# -- imported models ------------------------------------------------------------------------------


def test_an_imported_model_is_written_back_as_it_was(tmp_path):
    source = DATA / "magika_standard_v3_3.onnx"
    path = export_onnx(import_onnx(source), tmp_path / "magika.onnx")
    check(path)
    original, written = onnx.load(str(source)), onnx.load(str(path))
    assert [i.name for i in written.graph.input] == [i.name for i in original.graph.input]
    assert [o.name for o in written.graph.output] == [o.name for o in original.graph.output]
    assert [(n.op_type, n.name, list(n.input), list(n.output)) for n in written.graph.node] == [
        (n.op_type, n.name, list(n.input), list(n.output)) for n in original.graph.node]
    assert {(o.domain, o.version) for o in written.opset_import} == {("", 15), ("ai.onnx.ml", 2)}
    arrays = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    for init in written.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(init), arrays[init.name])
    assert set(arrays) == {i.name for i in written.graph.initializer}
    x = np.random.default_rng(6).integers(0, 257, size=(3, 2048)).astype(np.int32)
    np.testing.assert_array_equal(session(path).run(None, {"bytes": x})[0], session(source).run(None, {"bytes": x})[0])


def test_weights_changed_in_an_imported_module_are_in_the_exported_file(tmp_path):
    source = DATA / "magika_standard_v3_3.onnx"
    name = "jax2tf_get_logits_/Const_24:0"
    module = import_onnx(source)
    path = module.path_of(name)
    new = (module.param_of(name).val().to_numpy() * -0.5).astype(np.float32)
    changed = module.map(lambda p, prm: prm.map(lambda v: t(new)) if p == path else prm)
    written = export_onnx(changed, tmp_path / "changed.onnx")
    edited = onnx.load(str(source))
    for init in edited.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(new, name))
    x = np.random.default_rng(7).integers(0, 257, size=(2, 2048)).astype(np.int32)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    expected = ort.InferenceSession(edited.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"bytes": x})[0]
    np.testing.assert_array_equal(session(written).run(None, {"bytes": x})[0], expected)


def test_overridable_initializers_stay_graph_inputs_and_constant_weights_stay_constants(tmp_path):
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[3] x, float[3] bias) => (float[3] y) <float[3] bias = {1, 2, 3}> {
        scale = Constant<value = float[3] {2, 2, 2}>()
        s = Mul(x, scale)
        y = Add(s, bias)
    }""")
    path = export_onnx(import_onnx(model), tmp_path / "o.onnx")
    check(path)
    written = onnx.load(str(path))
    assert [i.name for i in written.graph.input] == ["x", "bias"]
    assert sorted(i.name for i in written.graph.initializer) == ["bias"]
    assert [n.op_type for n in written.graph.node] == ["Constant", "Mul", "Add"]
    x, other = np.ones(3, np.float32), np.array([5, 6, 7], np.float32)
    np.testing.assert_array_equal(session(path).run(None, {"x": x, "bias": other})[0], x * 2 + other)


def test_an_imported_model_exports_for_example_inputs_with_named_dynamic_axes(tmp_path):
    module = import_onnx(DATA / "ppocr_mobile_v2_cls.onnx")
    x = np.random.default_rng(9).normal(size=(2, 3, 48, 192)).astype(np.float32)
    out_name = module.output_names[0]
    path = export_onnx(module, tmp_path / "cls.onnx", t(x), input_names=["image"],
                       dynamic_axes={"image": {0: "batch"}, out_name: {0: "batch"}})
    check(path)
    written = onnx.load(str(path))
    dims = [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in (written.graph.input[0],
                                                                                         written.graph.output[0])]
    assert dims == [["batch", 3, 48, 192], ["batch", 2]]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    original = ort.InferenceSession(str(DATA / "ppocr_mobile_v2_cls.onnx"), options, providers=["CPUExecutionProvider"])
    x3 = np.concatenate([x, x[:1]])
    # static H, W (the example's) let ONNX Runtime pick other kernels than for the file's "?" dims
    np.testing.assert_allclose(session(path).run(None, {"image": x3})[0], original.run(None, {"x": x3})[0],
                               rtol=1e-5, atol=1e-6)


def test_an_imported_graph_keeps_its_opset(tmp_path):
    module = import_onnx(DATA / "ppocr_mobile_v2_cls.onnx")
    with pytest.raises(ValueError, match=r"an imported ONNX graph keeps its own opset \(11\); it cannot be exported "
                                         r"at opset 17"):
        export_onnx(module, tmp_path / "x.onnx", opset=17)


# -- the record bridge ----------------------------------------------------------------------------


def test_a_record_written_into_a_graph_replaces_its_weights_and_ids(tmp_path):
    source = DATA / "ppocr_mobile_v2_cls.onnx"
    record = read_onnx_record(source)
    rng = np.random.default_rng(8)
    new = {k: (s.to_data().to_numpy() * rng.uniform(0.5, 1.5)).astype(np.float32) for k, s in record.items()}
    changed = ModuleRecord({k: op.TensorSnapshot(s.dtype, s.shape, ParamId(i + 1), lambda a=new[k]: t(a).into_data())
                            for i, (k, s) in enumerate(record.items())})
    path = write_record_to_onnx(changed, source, tmp_path / "cls.onnx")
    check(path)
    edited = onnx.load(str(source))
    for node in edited.graph.node:
        if node.op_type == "Constant" and node.output[0] in new:
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(new[node.output[0]]))
    x = rng.normal(size=(1, 3, 48, 192)).astype(np.float32)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    expected = ort.InferenceSession(edited.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(session(path).run(None, {"x": x})[0], expected)
    back = read_onnx_record(path)
    assert [int(s.param_id) for s in back.values()] == list(range(1, len(record) + 1))


def test_writing_a_record_that_does_not_fit_lists_every_problem(tmp_path):
    source = DATA / "ppocr_mobile_v2_cls.onnx"
    record = dict(read_onnx_record(source))
    del record["fc_0.b_0"]
    w = record["fc_0.w_0"]
    record["fc_0.w_0"] = op.TensorSnapshot(w.dtype, (2, 200), None, w.loader)
    b = record["conv1_weights"]
    record["conv1_weights"] = op.TensorSnapshot(DType.F16, b.shape, None, b.loader)
    record["extra.weight"] = w
    with pytest.raises(RecordError) as info:
        write_record_to_onnx(record, source, tmp_path / "bad.onnx")
    message = str(info.value)
    assert message.startswith(f"cannot write the record into {source}: 4 problem(s)")
    assert "missing tensor 'fc_0.b_0' (ONNX 'fc_0.b_0'): the graph expects F32 [2], the record has none" in message
    assert "shape mismatch for 'fc_0.w_0' (ONNX 'fc_0.w_0'): the graph expects [200, 2], the record has [2, 200]" in message
    assert "dtype mismatch for 'conv1_weights' (ONNX 'conv1_weights'): the graph expects F32, the record has F16" in message
    assert "unexpected tensor 'extra.weight': the graph has no weight at this path" in message
    assert not (tmp_path / "bad.onnx").exists()


def test_reading_a_record_reads_no_tensor_data(tmp_path, monkeypatch):
    path = export_onnx(Big(), tmp_path / "big.onnx", t(np.zeros((1, 512), np.float32)), external_data=True)
    loads = []
    original = ir.ExternalTensor.numpy

    def spy(self):
        loads.append(self.name)
        return original(self)

    monkeypatch.setattr(ir.ExternalTensor, "numpy", spy)
    record = read_onnx_record(path)
    assert list(record) == ["w1", "w2", "b"] and loads == []
    record["w2"].to_data()
    assert loads == ["w2"]


CONTROL_FLOW = """
<ir_version: 8, opset_import: ["" : 13]>
g (bool[1] cond, float[2] x, int64[1] trip) => (float[2] y, float[2] acc) <float[2] outer_w = {10, 20}> {
    y = If(cond) <
        then_branch = then_g () => (float[2] t_out) <float[2] then_w = {1, 2}> { t_out = Add(x, then_w) },
        else_branch = else_g () => (float[2] e_out) {
            e_w = Constant<value = float[2] {3, 4}>()
            e_mid = Mul(x, e_w)
            e_out = Add(e_mid, outer_w)
        }
    >
    true_ = Constant<value = bool {1}>()
    acc = Loop(trip, true_, x) <
        body = loop_g (int64 i, bool c_in, float[2] a_in) => (bool c_out, float[2] a_out) {
            c_out = Identity(c_in)
            step = Constant<value = float[2] {0.5, 0.25}>()
            scaled = Mul(a_in, step)
            a_out = Add(scaled, outer_w)
        }
    >
}
"""


@pytest.mark.parametrize("cond", [True, False])
def test_control_flow_exports_with_subgraph_weights_where_they_were(tmp_path, cond):
    model = onnx.parser.parse_model(CONTROL_FLOW)
    path = export_onnx(import_onnx(model), tmp_path / "cf.onnx")
    check(path)
    written = onnx.load(str(path))
    assert sorted(i.name for i in written.graph.initializer) == ["outer_w"]
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in model.graph.node]
    bodies = [[(n.op_type, list(n.output)) for a in n.attribute for n in a.g.node] for n in written.graph.node]
    assert bodies == [[(n.op_type, list(n.output)) for a in n.attribute for n in a.g.node] for n in model.graph.node]
    feeds = {"cond": np.array([cond]), "x": np.array([1.5, -2.0], np.float32), "trip": np.array([3], np.int64)}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    expected = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, want in zip(session(path).run(None, feeds), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_model_local_functions_are_kept_and_run_as_the_original(tmp_path):
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13, "local" : 1]>
    g (float[2] x) => (float[2] y) <float[2] w = {1, 3}> { y = local.scaled_twice(x, w) }
    <domain: "local", opset_import: ["" : 13]>
    scaled_twice (a, s) => (b) { c = Add(a, a)  b = Mul(c, s) }
    """)
    module = import_onnx(model)
    x = np.array([0.5, -1.0], np.float32)
    np.testing.assert_array_equal(module(t(x)).to_numpy(), (x + x) * np.array([1, 3], np.float32))
    path = export_onnx(module, tmp_path / "f.onnx")
    check(path)
    written = onnx.load(str(path))
    assert [n.op_type for n in written.graph.node] == ["scaled_twice"]
    assert [(f.domain, f.name, [n.op_type for n in f.node]) for f in written.functions] == \
        [("local", "scaled_twice", ["Add", "Mul"])]
    np.testing.assert_array_equal(session(path).run(None, {"x": x})[0], (x + x) * np.array([1, 3], np.float32))


def test_reexporting_an_imported_model_with_example_inputs_keeps_its_dynamic_dims(tmp_path):
    import numpy as np
    import onnx

    import onnxparam as op

    source = Path(__file__).parent / "data" / "onnx" / "magika_standard_v3_3.onnx"
    original = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in onnx.load(source).graph.input]
    module = op.import_onnx(source)
    op.export_onnx(module, tmp_path / "again.onnx", op.Tensor.from_numpy(np.zeros((3, 2048), np.int32)))
    again = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
             for i in onnx.load(tmp_path / "again.onnx").graph.input]
    assert again == original == [["unk__214", 2048]]
