"""The quantized files we write let ONNX Runtime make the same fusions as the output of its own
``quantize_dynamic`` (onnxparam.quant._accuracy.settle_shapes, _shapes.settle_value_infos).

Oracle: ORT's optimized graph (``SessionOptions.optimized_model_filepath``) of
``onnxruntime.quantization.quantize_dynamic``'s output for the same float file.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging

import numpy as np
from quantized_files import optimized_ops

import onnxparam as op
from onnxparam import nn
from onnxparam.cli import main


def test_cli_int8_transformer_keeps_the_skip_layer_norm_fusions_of_ort_s_own_quantize_dynamic(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nn.seed(0)
    model = nn.TransformerEncoderConfig(64, 128, 4, 1, dropout=0.0).init()
    x = np.random.default_rng(0).normal(size=(2, 16, 64)).astype(np.float32)
    f32 = op.export_onnx(model, tmp_path / "f32.onnx", x[:1], dynamic_axes={0: {0: "batch"}})
    logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic's advice
    quantize_dynamic(str(f32), str(tmp_path / "ort.onnx"), weight_type=QuantType.QInt8)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["quantize", str(f32), str(tmp_path / "cli.onnx"), "-q"]) == 0

    theirs, ours = (collections.Counter(optimized_ops(tmp_path / name, tmp_path)) for name in ("ort.onnx", "cli.onnx"))
    assert theirs["SkipLayerNormalization"] == 2  # both residual Adds + LayerNorms fused
    for fused in ("SkipLayerNormalization", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "LayerNormalization"):
        assert ours[fused] == theirs[fused], fused
