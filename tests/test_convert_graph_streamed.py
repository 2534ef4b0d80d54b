"""convert(graph=template) and inline saves stream every tensor, subgraphs' (If branches) and
Constant values included: the file equals what protobuf's own serializer writes, onnx reads the
source's values, ONNX Runtime computes the numpy formula, and no whole-model protobuf is built."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

from onnxparam.convert import convert
from onnxparam.formats import _file_range, _onnx_nested
from onnxparam.onnx_io import _ir_stream

K, N = 512, 256  # fc.weight 1 MiB, each branch weight 512 KiB: above the kernel-copy threshold


def if_template(path, values: dict | None = None) -> None:
    """``y = If(cond, then: (x @ fc.weight) @ then.weight, else: (x @ fc.weight) @ else.weight)``;
    the branch weights are initializers of the If's subgraphs; zeros unless ``values``."""
    def init(name, shape):
        array = np.zeros(shape, np.float32) if values is None else values[name]
        return numpy_helper.from_array(array, name)

    def branch(which):
        return helper.make_graph([helper.make_node("MatMul", ["h", f"{which}.weight"], [f"{which}_out"])],
                                 f"{which}_branch", [],
                                 [helper.make_tensor_value_info(f"{which}_out", TensorProto.FLOAT, [1, N])],
                                 initializer=[init(f"{which}.weight", (K, N))])

    nodes = [helper.make_node("MatMul", ["x", "fc.weight"], ["h"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=branch("then"), else_branch=branch("else"))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
                              initializer=[init("fc.weight", (K, K))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    path.write_bytes(model.SerializeToString())  # (onnx.save is refused in some tests)


def source_values() -> dict:
    rng = np.random.default_rng(3)
    return {"fc.weight": rng.standard_normal((K, K), dtype=np.float32) / 16,
            "then.weight": rng.standard_normal((K, N), dtype=np.float32),
            "else.weight": rng.standard_normal((K, N), dtype=np.float32)}


def all_initializers(model: onnx.ModelProto) -> dict:
    """Every initializer of the main graph and of the If's branches, as onnx reads them."""
    out = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                out.update({i.name: numpy_helper.to_array(i) for i in attr.g.initializer})
    return out


@pytest.fixture
def no_whole_model_save(monkeypatch):
    """The whole-model protobuf writer must not run; counts the streamed writes and kernel copies."""
    def refuse(*args, **kwargs):
        raise AssertionError("onnx.save of the whole model was called")

    monkeypatch.setattr(onnx, "save", refuse)
    monkeypatch.setattr(onnx, "save_model", refuse)
    calls = {"streamed": 0, "copied": []}
    real_write, real_copy = _onnx_nested.write_with_tensors, _file_range._copy

    def streamed(*args, **kwargs):
        calls["streamed"] += 1
        return real_write(*args, **kwargs)

    def copied(src, dst, offset, count):
        calls["copied"].append(count)
        return real_copy(src, dst, offset, count)

    monkeypatch.setattr(_onnx_nested, "write_with_tensors", streamed)
    monkeypatch.setattr(_file_range, "_copy", copied)
    return calls


def test_if_branch_weights_from_a_template_take_the_sources_values_streamed(tmp_path, no_whole_model_save):
    values = source_values()
    if_template(tmp_path / "template.onnx")
    save_file(values, str(tmp_path / "w.safetensors"))
    expected_structure = onnx.load(str(tmp_path / "template.onnx"))
    convert(tmp_path / "w.safetensors", tmp_path / "out.onnx", graph=tmp_path / "template.onnx")

    calls = no_whole_model_save
    assert calls["streamed"] == 1
    assert sorted(calls["copied"]) == sorted(v.nbytes for v in values.values())  # every weight: kernel copy
    model = onnx.load(str(tmp_path / "out.onnx"))
    got = all_initializers(model)
    assert set(got) == set(values)
    for name, array in values.items():
        assert got[name].tobytes() == array.tobytes(), name
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in expected_structure.graph.node]
    session = ort.InferenceSession(str(tmp_path / "out.onnx"))
    x = np.linspace(-1, 1, K, dtype=np.float32)[None]
    for cond, branch in ((True, "then"), (False, "else")):
        y = session.run(None, {"x": x, "cond": np.array(cond)})[0]
        np.testing.assert_allclose(y, (x @ values["fc.weight"]) @ values[f"{branch}.weight"], rtol=1e-4, atol=1e-3)


def test_template_weights_left_by_allow_partial_are_copied_from_the_template(tmp_path):
    values = source_values()
    kept = {"then.weight": np.full((K, N), 0.5, np.float32)}
    if_template(tmp_path / "template.onnx", {**values, **kept})
    save_file({k: v for k, v in values.items() if k != "then.weight"}, str(tmp_path / "w.safetensors"))
    convert(tmp_path / "w.safetensors", tmp_path / "out.onnx", graph=tmp_path / "template.onnx", allow_partial=True)
    got = all_initializers(onnx.load(str(tmp_path / "out.onnx")))
    assert got["then.weight"].tobytes() == kept["then.weight"].tobytes()
    assert got["else.weight"].tobytes() == values["else.weight"].tobytes()


def test_a_template_is_read_through_a_map_not_into_memory(tmp_path):
    values = source_values()
    if_template(tmp_path / "template.onnx", values)  # 2 MiB of weights in the template
    save_file(values, str(tmp_path / "w.safetensors"))
    tracemalloc.start()
    try:
        convert(tmp_path / "w.safetensors", tmp_path / "out.onnx", graph=tmp_path / "template.onnx")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < values["else.weight"].nbytes  # less than one branch weight: no tensor went through Python


def cast_source(tmp_path) -> dict:
    """Float16 sources cast to float32 on the way: computed, one tensor at a time."""
    values = source_values()
    save_file({k: v.astype(np.float16) for k, v in values.items()}, str(tmp_path / "w16.safetensors"))
    return {k: v.astype(np.float16).astype(np.float32) for k, v in values.items()}


def test_computed_tensors_stream_into_branches_too(tmp_path, no_whole_model_save):
    want = cast_source(tmp_path)
    if_template(tmp_path / "template.onnx")
    convert(tmp_path / "w16.safetensors", tmp_path / "out.onnx", graph=tmp_path / "template.onnx", cast="f32")
    assert no_whole_model_save["streamed"] == 1 and no_whole_model_save["copied"] == []
    got = all_initializers(onnx.load(str(tmp_path / "out.onnx")))
    for name, array in want.items():
        assert got[name].tobytes() == array.tobytes(), name


def test_save_inline_equals_protobufs_serializer_with_subgraphs_constants_and_external_tensors(tmp_path):
    values = source_values()
    if_template(tmp_path / "template.onnx")
    model = ir.load(str(tmp_path / "template.onnx"))
    # numpy-backed tensors in the main graph and both branches, lazily computed in one branch
    model.graph.initializers["fc.weight"].const_value = ir.Tensor(values["fc.weight"], name="fc.weight")
    branches = {a.value.name: a.value for n in model.graph for a in n.attributes.values()
                if a.type == ir.AttributeType.GRAPH}
    then_value = branches["then_branch"].initializers["then.weight"]
    then_value.const_value = ir.LazyTensor(lambda: ir.Tensor(values["then.weight"], name="then.weight"),
                                           dtype=ir.DataType.FLOAT, shape=ir.Shape((K, N)), name="then.weight",
                                           metadata_props={"onnxparam.param_id": "7"})
    # an external tensor: its bytes in another file
    (tmp_path / "else.bin").write_bytes(b"\0" * 64 + values["else.weight"].tobytes())
    else_value = branches["else_branch"].initializers["else.weight"]
    else_value.const_value = ir.ExternalTensor("else.bin", 64, values["else.weight"].nbytes, ir.DataType.FLOAT,
                                               shape=ir.Shape((K, N)), name="else.weight", base_dir=str(tmp_path))
    # a Constant node's value, bfloat16 and 4-bit (packed) initializers
    const = ir.node("Constant", [], attributes={"value": ir.Tensor(np.arange(70_000, dtype=np.int64), name="c")})
    model.graph.append(const)
    model.graph.outputs.append(const.outputs[0])
    const.outputs[0].name = "c_out"
    model.graph.initializers["q"] = ir.Value(name="q", const_value=ir.Tensor(
        np.array([1, -2, 3, 7, -8], dtype=np.int8), dtype=ir.DataType.INT4, name="q"))

    _ir_stream.save_inline(model, tmp_path / "streamed.onnx")

    else_value.const_value = ir.Tensor(values["else.weight"], name="else.weight")  # read in, for the oracle
    (tmp_path / "protobuf.onnx").write_bytes(ir.serde.serialize_model(model).SerializeToString())
    assert (tmp_path / "streamed.onnx").read_bytes() == (tmp_path / "protobuf.onnx").read_bytes()
    assert isinstance(model.graph.initializers["fc.weight"].const_value, ir.Tensor)  # the model is unchanged
    assert isinstance(then_value.const_value, ir.LazyTensor)


def test_an_imported_model_with_shapes_between_its_weights_exports_streamed(tmp_path, no_whole_model_save):
    # NOTE: torch's exporter puts small int64 shape initializers between the weights; the writer
    # used to fall back to serializing the whole model then (2x the weights in memory).
    import onnxparam as op

    rng = np.random.default_rng(5)
    weights = [rng.standard_normal((K, K), dtype=np.float32) for _ in range(2)]
    inits, nodes, x = [], [], "x"
    for i, w in enumerate(weights):
        inits += [numpy_helper.from_array(w, f"layers.{i}.weight"), numpy_helper.from_array(np.array([1, K]), f"s{i}")]
        nodes += [helper.make_node("MatMul", [x, f"layers.{i}.weight"], [f"h{i}"]),
                  helper.make_node("Reshape", [f"h{i}", f"s{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, K])], initializer=inits)
    source = tmp_path / "in.onnx"
    source.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString())
    op.export_onnx(op.import_onnx(source), tmp_path / "out.onnx")
    assert no_whole_model_save["streamed"] == 1
    out = onnx.load(str(tmp_path / "out.onnx"))
    assert [i.name for i in out.graph.initializer] == [i.name for i in inits]
    for init in inits:
        got = numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == init.name))
        assert got.tobytes() == numpy_helper.to_array(init).tobytes(), init.name
    v = np.linspace(-1, 1, K, dtype=np.float32)[None]
    y = ort.InferenceSession(str(tmp_path / "out.onnx")).run(None, {"x": v})[0]
    np.testing.assert_allclose(y, v @ weights[0] @ weights[1], rtol=1e-4, atol=1e-2)


def test_a_graph_models_weights_branches_included_convert_out_by_kernel_copy(tmp_path, no_whole_model_save):
    from safetensors.numpy import load_file

    values = source_values()
    if_template(tmp_path / "model.onnx", values)
    convert(tmp_path / "model.onnx", tmp_path / "w.safetensors")
    got = load_file(str(tmp_path / "w.safetensors"))
    assert set(got) == set(values)
    for name, array in values.items():
        assert got[name].tobytes() == array.tobytes(), name
    assert sorted(no_whole_model_save["copied"]) == sorted(v.nbytes for v in values.values())
