"""The ``quant`` section of ``tools/bench.py``: quantized exports vs float32 and vs ONNX Runtime's
own quantization tool, measured in one process.

Three models built with ``onnxparam.nn`` (no PyTorch): a ResNet-like conv net (:class:`ConvNet`),
one transformer encoder block (``nn.TransformerEncoderConfig``) and the MNIST zoo model with its
trained weights. Each is exported as

* ``float32``: the float export (the baseline of every latency ratio);
* ``default``: ``quantize_weights(Quantizer())`` exported with the default options (per op the
  fastest form: dynamic int8 MatMul, float Conv without calibration);
* ``static``: ``Quantizer(per_channel=True)`` + ``quantize_activations`` on calibration inputs
  (QLinearConv / QLinearMatMul; BatchNorms after convs folded in, pairs after a Relu, so ORT
  chains the integer convs in NHWC: ``onnxparam.quant._qdq_static``);
* ``4-bit``: ``Quantizer(QuantScheme(Q4S, block_size=(32, 1)))`` (``MatMulNBits`` written directly,
  ``accuracy_level`` 0 as ``MatMulNBitsQuantizer`` writes; conv weights whose shape is not whole
  blocks stay float);
* ``per-channel``: ``Quantizer(per_channel=True)`` exported with the default options (dynamic int8
  MatMul with one scale per column, applied after ``MatMulInteger``);
* ``pc-int8`` / ``static-int8``: ``per-channel`` / ``static`` exported with
  ``qdq_options(kernel_weights="int8")``, the opt-in for CPUs with VNNI (ORT's own int8 weight layout;
  on an AVX2 CPU without VNNI its cosine shows the saturation): the same graph as ORT's tool, so
  these lines against ``ort-dynamic-pc`` / ``ort-static`` isolate the uint8 layout's cost;
* ``cli``: ``onnxparam quantize`` of the float32 file (the imported graph: only weights
  quantized, value infos settled, accuracy report) and ``cli-pc``: the same with ``--per-channel``;
* ``ort-dynamic-pc``: ``quantize_dynamic(per_channel=True)`` of the float32 file;
* ``ort-dynamic``: ``onnxruntime.quantization.quantize_dynamic`` of the float32 file (QInt8);
* ``ort-static``: ``onnxruntime.quantization.quantize_static`` of it (QDQ, same calibration inputs);
* ``ort-4bit``: ``MatMulNBitsQuantizer`` of it (block 32, symmetric), where available.

All run in plain ``InferenceSession`` s with the same options, timed interleaved (the order
rotates every repetition), ratio of medians vs float32; with ``--threads 1`` the clock is the
calling thread's CPU time (ORT computes on it; wall time on a loaded machine inflates long runs
more than short ones), else wall time. Printed per variant: latency ratio, file
size ratio, cosine similarity of the outputs vs float32 and (MNIST) digit accuracy. Targets:
``default`` <= 1.0 on every model, ``static`` <= 0.5 on the conv net, and every onnxparam variant
no slower than the matching ONNX Runtime tool (default vs ort-dynamic, static vs ort-static,
4-bit vs ort-4bit).
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

CONV_BATCHES = (1, 8)
TRANSFORMER_BATCHES = (1, 8)
MNIST_BATCHES = (1, 256)
DEFAULT_TARGET = 1.0
STATIC_CONV_TARGET = 0.5
VS_ORT_TARGET = 1.0


def _models():
    import onnxparam as op
    from onnxparam import nn, ops

    class Block(op.Module):
        """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, + the (1x1 projected) input, ReLU."""

        def __init__(self, c_in, c_out, stride):
            self.conv1 = nn.Conv2dConfig((c_in, c_out), (3, 3), stride=(stride, stride), padding=1).init()
            self.bn1 = nn.BatchNormConfig(c_out).init()
            self.conv2 = nn.Conv2dConfig((c_out, c_out), (3, 3), padding=1).init()
            self.bn2 = nn.BatchNormConfig(c_out).init()
            self.proj = (nn.Conv2dConfig((c_in, c_out), (1, 1), stride=(stride, stride)).init()
                         if stride != 1 or c_in != c_out else None)

        def forward(self, x):
            y = ops.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return ops.relu(ops.add(y, x if self.proj is None else self.proj(x)))

    class ConvNet(op.Module):
        """A ResNet-like net: stem conv, 4 residual blocks (64 -> 256 channels), global average
        pool, Linear to 100 classes; input ``[N, 3, 64, 64]``."""

        def __init__(self):
            self.stem = nn.Conv2dConfig((3, 64), (3, 3), stride=(2, 2), padding=1).init()
            self.blocks = [Block(64, 64, 1), Block(64, 128, 2), Block(128, 256, 2), Block(256, 256, 1)]
            self.head = nn.LinearConfig(256, 100).init()

        def forward(self, x):
            x = ops.relu(self.stem(x))
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(dim=[2, 3]))

    return ConvNet


def _variants(name, model, example, calib, tmp: Path, axes) -> dict:
    """``{variant: path}`` for one model (module docstring)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    import onnxparam as op
    from onnxparam.quant import Quantizer, QuantScheme, QuantValue, qdq_options, quantize_activations

    files = {"float32": op.export_onnx(model, tmp / f"{name}-f32.onnx", example, dynamic_axes=axes)}
    files["default"] = op.export_onnx(model.quantize_weights(Quantizer()), tmp / f"{name}-default.onnx", example,
                                      dynamic_axes=axes)
    per_channel = model.quantize_weights(Quantizer(per_channel=True))
    static = quantize_activations(per_channel, calib, batch_size=32)
    files["static"] = op.export_onnx(static, tmp / f"{name}-static.onnx", example, dynamic_axes=axes)
    four = model.quantize_weights(Quantizer(QuantScheme(QuantValue.Q4S, block_size=(32, 1))))
    files["4-bit"] = op.export_onnx(four, tmp / f"{name}-4bit.onnx", example, dynamic_axes=axes)
    files["per-channel"] = op.export_onnx(per_channel, tmp / f"{name}-pc.onnx", example, dynamic_axes=axes)
    with qdq_options(kernel_weights="int8"):  # the opt-in for VNNI CPUs (module docstring)
        files["pc-int8"] = op.export_onnx(per_channel, tmp / f"{name}-pc-int8.onnx", example, dynamic_axes=axes)
        files["static-int8"] = op.export_onnx(static, tmp / f"{name}-static-int8.onnx", example, dynamic_axes=axes)
    f32 = str(files["float32"])
    input_name = onnx.load(f32, load_external_data=False).graph.input[0].name
    quantize_dynamic(f32, str(tmp / f"{name}-ort-dyn.onnx"), weight_type=QuantType.QInt8)
    files["ort-dynamic"] = tmp / f"{name}-ort-dyn.onnx"
    quantize_dynamic(f32, str(tmp / f"{name}-ort-dyn-pc.onnx"), weight_type=QuantType.QInt8, per_channel=True)
    files["ort-dynamic-pc"] = tmp / f"{name}-ort-dyn-pc.onnx"
    import contextlib
    import io

    from onnxparam.cli import main

    for variant, extra in (("cli", []), ("cli-pc", ["--per-channel"])):
        path = tmp / f"{name}-{variant}.onnx"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(["quantize", f32, str(path), "-q", *extra])
        if code != 0:
            print(f"quant: {name}: onnxparam quantize {' '.join(extra)} failed: {err.getvalue().strip()}")
        else:
            files[variant] = path

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{input_name: calib[i:i + 32]} for i in range(0, len(calib), 32)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(f32, str(tmp / f"{name}-ort-static.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    files["ort-static"] = tmp / f"{name}-ort-static.onnx"
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(onnx.load(f32), block_size=32, is_symmetric=True)
        quantizer.process()
        quantizer.model.save_model_to_file(str(tmp / f"{name}-ort-4bit.onnx"), False)
        files["ort-4bit"] = tmp / f"{name}-ort-4bit.onnx"
    except Exception as e:  # noqa: BLE001 - an optional comparison
        print(f"quant: {name}: ORT's MatMulNBitsQuantizer is not available ({type(e).__name__}: {e})")
    return files


def _time(runs: dict, repeats: int, warmup: int = 3, clock=time.perf_counter) -> dict:
    """Median seconds per variant by ``clock``, interleaved (the order rotates every repetition)."""
    names = list(runs)
    for _ in range(warmup):
        for n in names:
            runs[n]()
    times = {n: [] for n in names}
    for i in range(repeats):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            t0 = clock()
            runs[n]()
            times[n].append(clock() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def bench_quant(args, result_cls) -> list:
    """The section (module docstring); returns ``result_cls`` rows for bench.py's table."""
    import onnxruntime as ort

    from onnxparam import nn
    from onnxparam.zoo import mnist

    logging.getLogger().setLevel(logging.ERROR)  # ORT's quantization tools' advice
    warnings.simplefilter("ignore")  # "left float": conv kernels that are not whole 4-bit blocks
    rng = np.random.default_rng(0)
    ConvNet = _models()
    nn.seed(0)
    images, labels = mnist.load_digits()
    images = images.astype(np.float32)
    models = [
        ("convnet", ConvNet(), rng.normal(size=(64, 3, 64, 64)).astype(np.float32), CONV_BATCHES),
        ("transformer", nn.TransformerEncoderConfig(256, 1024, 4, 1, dropout=0.0).init(),
         rng.normal(size=(64, 64, 256)).astype(np.float32), TRANSFORMER_BATCHES),
        ("mnist", mnist.load_pretrained(), images, MNIST_BATCHES),
    ]
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.log_severity_level = 3
    results = []
    repeats = max(args.repeats // 10, 20)
    # NOTE: with one intra-op thread ORT computes on the calling thread, so its CPU time is the run's
    # latency on an idle machine; wall time on a loaded one inflates every run longer than a scheduler
    # slice (float32 transformer at batch 1: 9.7 ms wall vs 2.2 ms CPU at load 10 on 2 cores), which
    # biases ratios between variants of different lengths. More threads: wall time.
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"quant: timing by {'thread CPU time (1 intra-op thread)' if args.threads == 1 else 'wall time'}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, model, data, batches in models:
            files = _variants(name, model, data[:1], data[::max(len(data) // 64, 1)][:64], tmp, {0: {0: "batch"}})
            sessions = {v: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
                        for v, p in files.items()}
            feed_name = sessions["float32"].get_inputs()[0].name
            sizes = {v: Path(p).stat().st_size for v, p in files.items()}
            whole = data[:256]
            outs = {v: s.run(None, {feed_name: whole})[0] for v, s in sessions.items()}
            print(f"quant: {name}: variant, file size vs float32, cosine vs float32"
                  + (", digit accuracy" if name == "mnist" else ""))
            for v in files:
                line = f"quant:   {v:<12} size {sizes[v] / sizes['float32']:6.3f}  cosine {_cosine(outs[v], outs['float32']):.5f}"
                if name == "mnist":
                    acc = float((sessions[v].run(None, {feed_name: images})[0].argmax(1) == labels).mean())
                    line += f"  accuracy {acc:.4f}"
                print(line)
            for batch in batches:
                x = data[:batch]
                runs = {v: (lambda _s=s, _x=x: _s.run(None, {feed_name: _x})) for v, s in sessions.items()}
                med = _time(runs, repeats, clock=clock)
                print(f"quant: {name} batch {batch}: latency / float32: "
                      + ", ".join(f"{v} {med[v] / med['float32']:.3f}" for v in files if v != "float32"))
                case = f"{name}[{batch}]"
                results.append(result_cls("quant", f"{case} default", med["default"], med["float32"], DEFAULT_TARGET))
                if "cli" in med:
                    results.append(result_cls("quant", f"{case} cli", med["cli"], med["float32"], DEFAULT_TARGET))
                static_target = STATIC_CONV_TARGET if name == "convnet" else DEFAULT_TARGET
                results.append(result_cls("quant", f"{case} static", med["static"], med["float32"], static_target))
                for ours, theirs in (("default", "ort-dynamic"), ("static", "ort-static"), ("4-bit", "ort-4bit"),
                                     ("per-channel", "ort-dynamic-pc"), ("cli", "ort-dynamic"),
                                     ("cli-pc", "ort-dynamic-pc"), ("pc-int8", "ort-dynamic-pc"),
                                     ("static-int8", "ort-static")):
                    if theirs in med and ours in med:
                        results.append(result_cls("quant", f"{case} {ours}/{theirs}", med[ours], med[theirs],
                                                  VS_ORT_TARGET))
    return results
