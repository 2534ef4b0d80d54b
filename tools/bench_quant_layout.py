"""Integer-kernel weight layouts compared on one CPU: onnxparam's uint8 codes + 128 with zero point
128 (what it writes) vs the int8 codes it wrote before (saturating ``VPMADDUBSW`` on x86 without
VNNI), float32, and ONNX Runtime's ``quantize_dynamic`` (int8, int8 ``reduce_range``, uint8
weights) and ``quantize_static`` (int8, uint8 weights). See ``onnxparam.quant._qdq_forms``.

Usage: ``python tools/bench_quant_layout.py [mnist] [transformer] [convnet] [--threads N]``
(the models of ``tools/bench.py quant``). Prints per variant: file size / float32, output cosine
vs float32, ``max |default session - unoptimized session| / max |out|`` (how far ORT's fused
QLinear kernels are from the graph as written; an unoptimized session runs ``MatMulInteger`` with
the same kernel, so this column cannot show a dynamic form's saturation: the cosine does), MNIST
digit accuracy; then per batch the latency ratio to
float32 (interleaved, ratio of medians) and the uint8 / int8 layout ratios.

The int8 variants are written by switching the uint8 pass off for that export (a private hook):
they show what the layout fixed and what it costs, they are not an export option.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import bench_quant as bq
    import onnxruntime as ort
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    import onnxparam as op
    from onnxparam import nn
    from onnxparam.quant import Quantizer, _qdq_forms, quantize_activations
    from onnxparam.zoo import mnist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["mnist", "transformer", "convnet"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    conv_net = bq._models()
    nn.seed(0)
    images, labels = mnist.load_digits()
    images = images.astype(np.float32)
    models = {"convnet": (conv_net, rng.normal(size=(64, 3, 64, 64)).astype(np.float32), (1, 8)),
              "transformer": (lambda: nn.TransformerEncoderConfig(256, 1024, 4, 1, dropout=0.0).init(),
                              rng.normal(size=(64, 64, 256)).astype(np.float32), (1, 8)),
              "mnist": (mnist.load_pretrained, images, (1, 256))}
    uint8_pass = _qdq_forms.unsigned_for_integer_kernels
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.log_severity_level = 3
    unoptimized = ort.SessionOptions()
    unoptimized.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    unoptimized.log_severity_level = 3
    tmp = Path(tempfile.mkdtemp())
    for name in args.models:
        make, data, batches = models[name]
        model, axes, example = make(), {0: {0: "batch"}}, data[:1]
        calib = data[::max(len(data) // 64, 1)][:64]
        files = {"float32": op.export_onnx(model, tmp / f"{name}-f32.onnx", example, dynamic_axes=axes)}
        default = model.quantize_weights(Quantizer())
        per_channel = model.quantize_weights(Quantizer(per_channel=True))
        static = quantize_activations(per_channel, calib, batch_size=32)
        try:
            for tag, hook in (("u8", uint8_pass), ("s8", lambda *a: None)):
                _qdq_forms.unsigned_for_integer_kernels = hook
                for variant, module in (("default", default), ("pc-dyn", per_channel), ("static", static)):
                    files[f"{variant}-{tag}"] = op.export_onnx(module, tmp / f"{name}-{variant}-{tag}.onnx", example,
                                                               dynamic_axes=axes)
        finally:
            _qdq_forms.unsigned_for_integer_kernels = uint8_pass
        f32 = str(files["float32"])
        input_name = ort.InferenceSession(f32).get_inputs()[0].name
        for tag, kw in (("ort-dyn-s8", dict(weight_type=QuantType.QInt8)),
                        ("ort-dyn-s8-rr", dict(weight_type=QuantType.QInt8, reduce_range=True)),
                        ("ort-dyn-u8", dict(weight_type=QuantType.QUInt8))):
            quantize_dynamic(f32, str(tmp / f"{name}-{tag}.onnx"), **kw)
            files[tag] = tmp / f"{name}-{tag}.onnx"

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.batches = iter([{input_name: calib[i:i + 32]} for i in range(0, len(calib), 32)])

            def get_next(self):
                return next(self.batches, None)

        for tag, weight_type in (("ort-static-s8", QuantType.QInt8), ("ort-static-u8", QuantType.QUInt8)):
            quantize_static(f32, str(tmp / f"{name}-{tag}.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, weight_type=weight_type)
            files[tag] = tmp / f"{name}-{tag}.onnx"
        sessions = {v: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]) for v, p in files.items()}
        whole = data[:256]
        outs = {v: s.run(None, {input_name: whole})[0] for v, s in sessions.items()}
        print(f"== {name}: variant, size / float32, cosine vs float32, fused vs unoptimized"
              + (", accuracy" if name == "mnist" else ""), flush=True)
        for v, path in files.items():
            plain = ort.InferenceSession(str(path), unoptimized, providers=["CPUExecutionProvider"])
            as_written = plain.run(None, {input_name: whole})[0]
            line = (f"{v:<15} size {Path(path).stat().st_size / Path(f32).stat().st_size:6.3f}"
                    f"  cosine {bq._cosine(outs[v], outs['float32']):.5f}"
                    f"  fused-vs-unoptimized {np.abs(outs[v] - as_written).max() / np.abs(as_written).max():.2e}")
            if name == "mnist":
                line += f"  accuracy {float((sessions[v].run(None, {input_name: images})[0].argmax(1) == labels).mean()):.4f}"
            print(line, flush=True)
        for batch in batches:
            x = data[:batch]
            runs = {v: (lambda _s=s, _x=x: _s.run(None, {input_name: _x})) for v, s in sessions.items()}
            med = bq._time(runs, args.repeats)
            print(f"{name} batch {batch}: latency / float32: "
                  + ", ".join(f"{v} {med[v] / med['float32']:.3f}" for v in files if v != "float32"), flush=True)
            print(f"{name} batch {batch}: uint8 / int8 layout: "
                  + ", ".join(f"{v} {med[v + '-u8'] / med[v + '-s8']:.3f}" for v in ("default", "pc-dyn", "static"))
                  + f"; static-u8 / ort-static-s8 {med['static-u8'] / med['ort-static-s8']:.3f}"
                  + f", default-u8 / ort-dyn-s8 {med['default-u8'] / med['ort-dyn-s8']:.3f}", flush=True)


if __name__ == "__main__":
    main()
