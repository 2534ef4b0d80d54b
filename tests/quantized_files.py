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
