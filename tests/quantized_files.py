"""Helpers shared by the tests of quantized ONNX files: a small model, a file's initializers read
with the ``onnx`` package, and ONNX Runtime computing a graph exactly as written."""

import onnx
import onnxruntime as ort
from onnx import numpy_helper

import onnxparam as op
from onnxparam import nn


class Mlp(op.Module):
    def __init__(self):
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(op.ops.relu(self.fc1(x)))


def initializers(path) -> dict:
    """Name -> numpy array of every initializer of the main graph of the file ``path``."""
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def exact_options() -> ort.SessionOptions:
    """ONNX Runtime computing the graph as written (its QDQ fusion would also quantize x)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def sklearn_mlp(path, sizes: tuple, rng, intercept_rows: bool = False) -> tuple:
    """Write what a scikit-learn ``MLPClassifier`` converts to at ``path``: per layer ``MatMul``
    on a ``coef_i`` weight ``[a, b]`` (N(0, 1/a), float32) + ``Add`` of an ``intercept_i``
    (N(0, 0.01); ``[b]``, or ``[1, b]`` with ``intercept_rows``), ``Relu`` between layers, then
    ``Softmax`` (axis 1) as output ``probabilities``; input ``x`` ``["n", sizes[0]]``, opset 17.
    Values drawn from the numpy generator ``rng`` in layer order. Returns ``(path, [(coef,
    intercept)])``."""
    import numpy as np
    from onnx import TensorProto, helper

    nodes, inits, h, weights = [], [], "x", []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        w = (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        c = (rng.normal(size=(1, b) if intercept_rows else (b,)) * 0.1).astype(np.float32)
        weights.append((w, c))
        inits += [numpy_helper.from_array(w, f"coef_{i}"), numpy_helper.from_array(c, f"intercept_{i}")]
        nodes += [helper.make_node("MatMul", [h, f"coef_{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"intercept_{i}"], [f"a{i}"])]
        h = f"a{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [h], [f"r{i}"]))
            h = f"r{i}"
    nodes.append(helper.make_node("Softmax", [h], ["probabilities"], axis=1))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", sizes[0]])],
                              [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["n", sizes[-1]])],
                              inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path, weights


def optimized_nodes(path, folder, entries=()) -> list:
    """The nodes of the graph ONNX Runtime's CPU session optimizes the file ``path`` into (all
    optimizations on, ``entries``: ``(key, value)`` session config entries), as ORT writes it to
    ``folder/optimized.onnx`` (``SessionOptions.optimized_model_filepath``): which fusions ran."""
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(folder / "optimized.onnx")
    so.log_severity_level = 3
    for key, value in entries:
        so.add_session_config_entry(key, value)
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return list(onnx.load(str(folder / "optimized.onnx")).graph.node)


def optimized_ops(path, folder) -> list:
    """The op types of :func:`optimized_nodes`, in graph order."""
    return [n.op_type for n in optimized_nodes(path, folder)]
