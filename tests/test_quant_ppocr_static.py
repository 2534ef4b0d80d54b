"""Static int8 on a real model, against ONNX Runtime's own quantization tool: the PP-OCRv4 text
detector (``tests/data/onnx/ppocr_v4_det.onnx``: Paddle2ONNX, opset 12, every weight a
``Constant`` node, reparameterized depthwise / 1x1 convs, hardswish blocks, a sigmoid map).

Its static int8 output cosine is about 0.93 per tensor: a wrong number with no error would be
the worst bug, so this pins that the loss is the model's, not ours. Oracle:
``onnxruntime.quantization.quantize_static`` on the same file (its Constant weights made
initializers, which that tool needs) with the same calibration data and settings (QDQ, uint8
asymmetric activations, int8 symmetric per-tensor weights, MinMax), both files run by plain ONNX
Runtime on held-out images against the float model; and the float model with every weight
rounded by numpy's symmetric int8 formula (the weights' share of the error, which the report
gives as ``weights_together``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import run_cli

MODEL = Path(__file__).parent / "data" / "onnx" / "ppocr_v4_det.onnx"
MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]


def text_images(n: int, seed: int, h: int = 96, w: int = 160) -> np.ndarray:
    """``[n, 3, h, w]`` float32 PP-OCR detector inputs (ImageNet-normalized): light backgrounds
    with one to three lines of dark random glyph blocks, so the float model finds text (the
    detector's map is near zero everywhere on noise, where a cosine says little)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = np.ones((3, h, w), np.float32) * rng.uniform(0.7, 1.0, size=(3, 1, 1)).astype(np.float32)
        ink = rng.uniform(0.0, 0.3, size=(3, 1, 1)).astype(np.float32)
        for _line in range(rng.integers(1, 4)):
            ch = int(rng.integers(8, 16))
            y0, x = int(rng.integers(2, h - ch - 2)), int(rng.integers(2, 30))
            end = int(rng.integers(x + 40, w - 2))
            while x < end - 6:
                cw = int(rng.integers(4, 9))
                glyph = rng.random((ch, cw)) < 0.45
                img[:, y0:y0 + ch, x:x + cw] = np.where(glyph, ink, img[:, y0:y0 + ch, x:x + cw])
                x += cw + int(rng.integers(1, 4))
        img += 0.03 * rng.normal(size=img.shape).astype(np.float32)
        out.append((np.clip(img, 0, 1) - MEAN) / STD)
    return np.stack(out).astype(np.float32)


def run(path, x) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def cosine(a, b) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def constants_as_initializers(src, dst):
    model = onnx.load(str(src))
    kept = []
    for n in model.graph.node:
        if n.op_type == "Constant" and [a.name for a in n.attribute] == ["value"]:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(n.attribute[0].t)
            tensor.name = n.output[0]
            model.graph.initializer.append(tensor)
        else:
            kept.append(n)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    onnx.save(model, str(dst))
    return model


@pytest.mark.slow
def test_ppocr_detector_static_int8_is_no_worse_than_onnx_runtimes_quantize_static(tmp_path):
    quantization = pytest.importorskip("onnxruntime.quantization")
    calibration, held_out = text_images(16, seed=0), text_images(8, seed=1)
    np.savez(tmp_path / "cal.npz", x=calibration)
    ours = tmp_path / "ours.onnx"
    code, stdout, err = run_cli("quantize", MODEL, ours, "--calibrate", tmp_path / "cal.npz", "--json", "-q")
    assert code == 0, err
    report = json.loads(stdout)["results"]["accuracy"]
    assert report["outputs"][0]["cosine"] < 0.99  # the premise: a loss worth explaining

    plain = constants_as_initializers(MODEL, tmp_path / "plain.onnx")

    class Reader(quantization.CalibrationDataReader):
        def __init__(self):
            self.rows = iter([{"x": calibration[i:i + 1]} for i in range(len(calibration))])

        def get_next(self):
            return next(self.rows, None)

    theirs = {}
    for ops in (["Conv"], ["Conv", "Add"]):
        path = tmp_path / f"ort-{'-'.join(ops)}.onnx"
        quantization.quantize_static(str(tmp_path / "plain.onnx"), str(path), Reader(),
                                     quant_format=quantization.QuantFormat.QDQ, op_types_to_quantize=ops,
                                     activation_type=quantization.QuantType.QUInt8,
                                     weight_type=quantization.QuantType.QInt8, per_channel=False,
                                     calibrate_method=quantization.CalibrationMethod.MinMax)
        theirs["+".join(ops)] = path
    reference = run(MODEL, held_out)
    assert (reference > 0.3).mean() > 0.02  # the premise: the float model finds text
    got = cosine(reference, run(ours, held_out))
    best_ort = max(cosine(reference, run(path, held_out)) for path in theirs.values())
    assert got >= best_ort - 0.01, (got, {k: cosine(reference, run(p, held_out)) for k, p in theirs.items()})

    # the weights' share, as the report states it: the float model with every weight the file
    # quantized rounded by numpy's symmetric int8 formula (one scale per tensor), on the report's inputs
    results = json.loads(stdout)["results"]
    rounded = {row["weight"] for row in results["ops"]}
    assert len(rounded) == results["quantized"]["params"]
    for t in plain.graph.initializer:
        if t.name in rounded:
            w = onnx.numpy_helper.to_array(t)
            scale = np.float32(np.abs(w).max() / np.float32(127))
            r = w / scale
            codes = np.sign(r) * np.floor(np.abs(r) + 0.5)
            t.CopyFrom(onnx.numpy_helper.from_array((codes * scale).astype(np.float32), t.name))
    onnx.save(plain, str(tmp_path / "rounded.onnx"))
    first = calibration[:8]
    assert report["inputs"] == "the first 8 calibration samples"
    together = cosine(run(MODEL, first), run(tmp_path / "rounded.onnx", first))
    assert report["weights_together"] == pytest.approx(together, abs=1e-4)
    assert report["outputs"][0]["cosine"] < together  # the activations' quantization adds the rest
