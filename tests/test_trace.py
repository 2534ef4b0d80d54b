"""Tracing a forward into an ONNX graph: names, laziness, dynamic dims, subgraphs, errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest
from onnx.reference import ReferenceEvaluator

import onnxparam as op
from onnxparam import DType, LoraAdapter, Param, ParamId, Tensor, ops
from onnxparam.core.errors import TraceError
from onnxparam.quant._passes import trace_module
from onnxparam.trace.tracer import InputSpec, TracedModel

RNG = np.random.default_rng(3)


def array(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def param(values):
    return Param.from_tensor(Tensor.from_numpy(values))


class Dense(op.Module):
    def __init__(self, d_in, d_out):
        self.weight = param(array(d_in, d_out))
        self.bias = param(array(d_out))

    def forward(self, x):
        return ops.linear(x, self.weight.val(), self.bias.val())


class Net(op.Module):
    def __init__(self):
        self.fc1 = Dense(4, 8)
        self.fc2 = Dense(8, 3)
        self.spare = param(array(5))

    def forward(self, x):
        return self.fc2(ops.gelu(self.fc1(x)))


def numpy_net(m, x):
    from math import erf

    h = x @ m.fc1.weight.val().to_numpy() + m.fc1.bias.val().to_numpy()
    h = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
    return h @ m.fc2.weight.val().to_numpy() + m.fc2.bias.val().to_numpy()


def test_initializers_are_named_by_module_path_in_traversal_order():
    traced = trace_module(Net(), InputSpec((2, 4)))
    assert isinstance(traced, TracedModel)
    assert traced.param_paths == ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    assert list(traced.graph.initializers) == list(traced.param_paths)  # 'spare' is unused: absent
    assert traced.input_names == ("x",) and traced.output_names == ("output",)


def test_nodes_are_named_after_the_module_that_emitted_them():
    traced = trace_module(Net(), InputSpec((2, 4)))
    names = [(n.name, n.op_type) for n in traced.graph]
    assert names == [("/fc1/MatMul", "MatMul"), ("/fc1/Add", "Add"), ("/Gelu", "Gelu"),
                     ("/fc2/MatMul", "MatMul"), ("/fc2/Add", "Add")]


def test_traced_model_is_a_valid_onnx_model_equal_to_numpy(tmp_path):
    m = Net()
    x = array(3, 4)
    traced = trace_module(m, x)
    proto = traced.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    expected = numpy_net(m, x.astype(np.float64))
    np.testing.assert_allclose(ReferenceEvaluator(proto).run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)
    path = tmp_path / "net.onnx"
    ir.save(traced.model, path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_tracing_never_initializes_lazy_params_and_serializing_does_once():
    calls = []

    def init(device, require_grad):
        calls.append(1)
        return Tensor.from_numpy(np.ones((4, 8), np.float32))

    m = Net()
    m.fc1.weight = Param.uninitialized(ParamId(), init, "cpu", True, (4, 8), DType.F32)
    traced = trace_module(m, InputSpec(("batch", 4)))
    assert calls == [] and not m.fc1.weight.is_initialized()
    assert isinstance(traced.graph.initializers["fc1.weight"].const_value, ir.LazyTensor)
    traced.to_proto()
    traced.to_proto()
    assert calls == [1]


def test_symbolic_dims_stay_symbolic():
    traced = trace_module(Net(), InputSpec(("batch", 4)))
    assert traced.input_types() == [("x", DType.F32, ("batch", 4))]
    assert traced.output_types() == [("output", DType.F32, ("batch", 3))]
    x = array(5, 4)
    traced2 = trace_module(Net(), x, dynamic_axes={"x": {0: "n"}, "output": {0: "n"}})
    assert traced2.input_types() == [("x", DType.F32, ("n", 4))]
    assert traced2.output_types() == [("output", DType.F32, ("n", 3))]


def test_flatten_with_dynamic_dims():
    class Flat(op.Module):
        def forward(self, x):
            return ops.flatten(x, 0, 1), ops.flatten(x, 1)

    traced = trace_module(Flat(), InputSpec(("b", 3, "t")))
    assert [t[2] for t in traced.output_types()] == [("b*3", "t"), ("b", "3*t")]
    x = array(2, 3, 5)
    outs = ReferenceEvaluator(traced.to_proto()).run(None, {"x": x})
    np.testing.assert_array_equal(outs[0], x.reshape(6, 5))
    np.testing.assert_array_equal(outs[1], x.reshape(2, 15))


def test_tied_params_are_one_initializer():
    m = Net()
    m.fc2 = Dense(8, 4)
    m.fc2.weight = m.fc1.weight

    class Tied(op.Module):
        def __init__(self, inner):
            self.inner = inner

        def forward(self, x):
            h = self.inner.fc1(x)
            return h @ ops.transpose(self.inner.fc2.weight.val(), 0, 1)

    traced = trace_module(Tied(m), InputSpec((1, 4)))
    assert traced.param_paths == ("inner.fc1.weight", "inner.fc1.bias")


def test_concrete_tensors_in_forward_become_constants():
    table = Tensor.from_numpy(np.arange(3, dtype=np.float32))

    class AddTable(op.Module):
        def forward(self, x):
            return x + table + 1.0

    traced = trace_module(AddTable(), InputSpec((2, 3)))
    assert traced.param_paths == ()
    x = array(2, 3)
    np.testing.assert_allclose(ReferenceEvaluator(traced.to_proto()).run(None, {"x": x})[0], x + np.arange(3) + 1.0)


def test_several_outputs_and_output_names():
    class Two(op.Module):
        def forward(self, x):
            return x.relu(), x

    traced = trace_module(Two(), InputSpec((2,)), output_names=["pos", "same"])
    assert traced.output_names == ("pos", "same") and not traced.single_output
    x = np.array([-1.0, 2.0], np.float32)
    pos, same = ReferenceEvaluator(traced.to_proto()).run(None, {"x": x})
    np.testing.assert_array_equal(pos, [0.0, 2.0])
    np.testing.assert_array_equal(same, x)


def test_opset_is_configurable():
    traced = trace_module(Net(), InputSpec((1, 4)), opset=17)
    assert traced.opset_imports[""] == 17
    assert "Gelu" not in [n.op_type for n in traced.graph]
    onnx.checker.check_model(traced.to_proto(), full_check=True)
    with pytest.raises(ValueError, match="opset 0 is not supported: onnxparam emits opset 1 or newer"):
        trace_module(Net(), InputSpec((1, 4)), opset=0)


def test_adapted_params_trace_their_merged_value():
    m = Dense(4, 3)
    a, b = param(array(4, 2)), param(array(2, 3))
    m.weight = m.weight.with_adapter(LoraAdapter(a, b, 2.0))
    traced = trace_module(m, InputSpec((1, 4)))
    assert traced.param_paths == ("weight", "bias")  # the factors are merged in, not initializers
    symbol = None

    class Probe(op.Module):
        def __init__(self, inner):
            self.inner = inner

        def forward(self, x):
            nonlocal symbol
            w = self.inner.weight.val()
            symbol = w._symbol
            return x @ w

    trace_module(Probe(m), InputSpec((1, 4)))
    assert symbol.param is m.weight and symbol.tracer.mode == "merge"  # the hook for lora="keep"
    merged = traced.graph.initializers["weight"].const_value.numpy()
    np.testing.assert_allclose(merged, m.weight.base().to_numpy() + 2.0 * a.val().to_numpy() @ b.val().to_numpy(),
                               rtol=1e-6)


def test_unknown_lora_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown LoRA mode 'keep2': expected one of 'merge'"):
        trace_module(Net(), InputSpec((1, 4)), lora="keep2")


def test_if_with_subgraphs_using_outer_scope_values_and_params():
    class Gate(op.Module):
        def __init__(self):
            self.scale = param(np.array([2.0, 3.0, 4.0], np.float32))

        def forward(self, x, flag):
            then_branch = ops.subgraph(lambda: x * self.scale.val(), name="then")
            else_branch = ops.subgraph(lambda: x - 1.0, name="else")
            return ops.custom("If", flag, then_branch=then_branch, else_branch=else_branch)

    m = Gate()
    traced = trace_module(m, (InputSpec(("b", 3)), InputSpec((), DType.Bool)))
    assert traced.output_types() == [("output", DType.F32, ("b", 3))]
    proto = traced.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    x = array(2, 3)
    ref = ReferenceEvaluator(proto)
    np.testing.assert_allclose(ref.run(None, {"x": x, "flag": np.array(True)})[0], x * [2.0, 3.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(m(x, np.array(False)).to_numpy(), x - 1.0, rtol=1e-6)
    np.testing.assert_allclose(m(x, np.array(True)).to_numpy(), x * [2.0, 3.0, 4.0], rtol=1e-6)


def test_loop_body_subgraph_with_inputs():
    class Repeat(op.Module):
        def forward(self, x):
            body = ops.subgraph(lambda i, cond, acc: (cond, acc * 2.0),
                                [InputSpec((), DType.I64), InputSpec((), DType.Bool), InputSpec(x.shape, x.dtype)],
                                name="body")
            # ONNX's Loop inference drops loop-carried shapes: the shape is given, the dtype inferred
            return ops.custom("Loop", np.array(3, np.int64), np.array(True), x, body=body, output_shapes=[x.shape])

    x = array(2, 2)
    np.testing.assert_allclose(Repeat()(x).to_numpy(), x * 8.0, rtol=1e-6)


def test_a_value_of_unknown_rank_flows_on_and_only_reading_its_shape_raises_naming_it():
    seen = {}

    class Loop(op.Module):
        def forward(self, x):
            body = ops.subgraph(lambda i, cond, acc: (cond, acc * 2.0),
                                [InputSpec((), DType.I64), InputSpec((), DType.Bool), InputSpec(x.shape, x.dtype)])
            # no output_shapes: ONNX's Loop inference leaves the state's rank unknown
            y = ops.custom("Loop", np.array(3, np.int64), np.array(True), x, body=body) + 1.0
            y = y.relu()  # a shape-preserving op keeps the rank unknown, and does not ask
            seen["repr"] = repr(y)
            for read in (lambda: y.shape, lambda: y.ndim, lambda: len(y)):
                with pytest.raises(TraceError, match=r"the rank of traced value '/Relu_output_0' \(output of Relu node "
                                                     r"'/Relu'\) is unknown: ONNX shape inference does not give it"):
                    read()
            return y

    x = array(2, 2)
    np.testing.assert_allclose(Loop()(x).to_numpy(), np.maximum(x * 8.0 + 1.0, 0.0), rtol=1e-6)
    assert seen["repr"] == "Tensor(symbolic, shape=?, dtype=F32)"


def test_reading_values_inside_forward_is_a_trace_error():
    class Peek(op.Module):
        def forward(self, x):
            return Tensor.from_numpy(x.to_numpy() * 2)

    with pytest.raises(TraceError, match="a symbolic tensor has no values: it exists only while a forward is "
                                         "being traced"):
        trace_module(Peek(), InputSpec((2,)))


def test_forward_must_return_tensors():
    class Bad(op.Module):
        def forward(self, x):
            return 3

    with pytest.raises(TraceError, match="a traced graph can only return tensors; got int"):
        trace_module(Bad(), InputSpec((2,)))


def test_tensors_leaking_from_a_trace_are_rejected():
    kept = []

    class Leak(op.Module):
        def forward(self, x):
            kept.append(x)
            return x + 1.0

    trace_module(Leak(), InputSpec((2,)))
    with pytest.raises(TraceError, match="is symbolic: it belongs to a trace that has ended, so ops on it cannot run"):
        ops.relu(kept[0])


def test_input_names_and_clashes_with_param_paths():
    class Shadow(op.Module):
        def __init__(self):
            self.x = param(array(2))

        def forward(self, x):
            return x * self.x.val()

    traced = trace_module(Shadow(), InputSpec((2,)))
    assert traced.input_names == ("x_input",) and traced.param_paths == ("x",)
    with pytest.raises(TraceError, match="graph input name 'x' is already used"):
        trace_module(Shadow(), InputSpec((2,)), input_names=["x"])
    traced = trace_module(Net(), InputSpec((1, 4), name="pixels"))
    assert traced.input_names == ("pixels",)


def test_modules_called_outside_the_tree_get_type_names():
    helper = Dense(4, 2)

    class UsesHelper(op.Module):
        def forward(self, x):
            return helper(x)

    traced = trace_module(UsesHelper(), InputSpec((1, 4)))
    assert traced.param_paths == ("Dense.weight", "Dense.bias")
    assert [n.name for n in traced.graph] == ["/Dense/MatMul", "/Dense/Add"]


def test_calling_a_module_with_a_wrong_dtype_raises_the_librarys_error_naming_the_module():
    import numpy as np

    import onnxparam as op

    class Lin(op.Module):
        def __init__(self):
            self.weight = op.Param.initialized(op.ParamId(1), op.Tensor.from_numpy(np.ones((3, 2), np.float32)))

        def forward(self, x):
            return x @ self.weight.val()

    ints = op.Tensor.from_numpy(np.ones((4, 3), np.int64))
    with pytest.raises(op.TraceTypeError, match=r"tracing Lin.forward: matmul: operand dtypes differ") as info:
        Lin()(ints)
    assert isinstance(info.value, op.OnnxParamError) and isinstance(info.value, TypeError)


def test_string_tensors_flow_through_a_traced_forward_and_come_out_as_onnx_runtime_gives_them():
    class Strings(op.Module):
        def forward(self, x):
            s = ops.custom("Cast", x, to=DType.String)  # ONNX-only element type: DType.String
            assert s.dtype is DType.String and s.shape == x.shape
            return s, ops.custom("Cast", s, to=DType.F32) * 2.0

    x = np.array([[1.5, -2.25], [3.0, 0.125]], np.float32)
    text, twice = Strings()(Tensor.from_numpy(x))
    assert text.dtype is DType.String
    ort = pytest.importorskip("onnxruntime")
    cast = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Cast", ["x"], ["s"], to=onnx.TensorProto.STRING)], "cast",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])],
        [onnx.helper.make_tensor_value_info("s", onnx.TensorProto.STRING, [2, 2])]))
    want = ort.InferenceSession(cast.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert text.to_numpy().tolist() == want.tolist()  # plain ONNX Runtime's Cast to string
    np.testing.assert_array_equal(twice.to_numpy(), x * 2.0)
