"""Issue 27: quantizing a model larger than memory streams its weights (onnxparam.quant._stream,
the export's spill, the streamed metadata rewrite, the accuracy report skipped with a reason).

The thresholds are lowered here so a small model takes the streaming path. Oracles: numpy's
symmetric int8 formula (``s = max|w| / 127``, codes rounded half away from zero: Burn's MinMax),
the bytes of the same export without streaming, ``onnx.load`` of the rewritten file, plain ONNX
Runtime on the written file vs numpy. Peak memory itself is measured by ``tools/bench.py quant``
(a benchmark, not a test: no timed or memory-sampled assertion here).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxparam.cli import main

RNG = np.random.default_rng(2728)
D = 256


def run_main(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def chain(path, n=3, external=True):
    """``x @ W0 + b0 @ W1 + b1 ...`` with float32 ``[D, D]`` weights (external data by default)."""
    nodes, inits, h, weights = [], [], "x", []
    for i in range(n):
        w = (RNG.normal(size=(D, D)) / 16).astype(np.float32)
        b = (RNG.normal(size=(D,)) * 0.1).astype(np.float32)
        weights.append((w, b))
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        h = f"a{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", D])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["n", D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=external, location=path.name + ".data", size_threshold=1024)
    return path, weights


def symmetric_int8(w: np.ndarray) -> tuple:
    scale = np.float32(np.abs(w).max() / np.float32(127))
    r = w / scale
    return (np.sign(r) * np.floor(np.abs(r) + 0.5)).astype(np.int8), scale


def file_mapped(array) -> bool:
    """Whether ``array``'s bytes are a memory map of a file (not anonymous memory)."""
    import mmap

    while array is not None:
        if isinstance(array, (mmap.mmap, np.memmap)):
            return True
        array = getattr(array, "base", None)
    return False


@pytest.fixture
def small_thresholds(monkeypatch):
    """Streaming for any quantized module, chunks of 10,000 elements (a [256, 256] weight is 7 chunks,
    the last one partial), every array of 1 KiB or more spilled."""
    from onnxparam.quant import _stream

    monkeypatch.setattr(_stream, "AUTO_STREAM_BYTES", 0)
    monkeypatch.setattr(_stream, "CHUNK_ELEMENTS", 10_000)
    monkeypatch.setattr(_stream, "SPILL_BYTES", 1024)
    return _stream


def test_chunked_quantization_gives_numpy_codes_and_spilled_codes_are_file_mapped(tmp_path, small_thresholds):
    from onnxparam.quant import Quantizer

    w = (RNG.normal(size=(D, D)) * 0.05).astype(np.float32)
    w[17, 3] = -0.9  # the max |w| in a middle chunk
    codes, scale = symmetric_int8(w)
    assert small_thresholds.quantize_chunked(w, Quantizer(), None) is not None
    with small_thresholds.streaming(tmp_path):
        qt = small_thresholds.quantize_chunked(w, Quantizer(), None)
    np.testing.assert_array_equal(np.asarray(qt.values), codes)
    assert np.asarray(qt.scales).reshape(()) == scale
    assert file_mapped(qt.values) and not qt.values.flags.writeable
    assert os.listdir(tmp_path) == []  # the scratch file is removed at once; the map keeps its bytes
    # F16 weights: read in chunks too; Burn computes the scale in the tensor's dtype
    # (2 * alpha / 254 in float16), then divides the float32 values by it
    h = w.astype(np.float16)
    qh = small_thresholds.quantize_chunked(h, Quantizer(), None)
    assert not file_mapped(qh.values)  # outside streaming(): in memory
    half_scale = np.float32((np.abs(h).max() * np.float16(2)) / np.float16(254))
    r = h.astype(np.float32) / half_scale
    np.testing.assert_array_equal(np.asarray(qh.values), (np.sign(r) * np.floor(np.abs(r) + 0.5)).astype(np.int8))
    # per-channel schemes: not chunked here (None: the caller quantizes whole; blocked ones: below)
    assert small_thresholds.quantize_chunked(w, Quantizer(per_channel=True), 1) is None
    bad = w.copy()
    bad[200, 0] = np.inf
    assert small_thresholds.quantize_chunked(bad, Quantizer(), None) is None


def test_a_streamed_export_writes_the_bytes_of_the_plain_one(tmp_path, monkeypatch):
    from onnxparam import export_onnx
    from onnxparam.onnx_io import import_onnx
    from onnxparam.quant import Quantizer, _stream

    src, weights = chain(tmp_path / "chain.onnx")
    plain = export_onnx(import_onnx(src).quantize_weights(Quantizer()), tmp_path / "plain" / "q.onnx")
    monkeypatch.setattr(_stream, "AUTO_STREAM_BYTES", 0)
    monkeypatch.setattr(_stream, "CHUNK_ELEMENTS", 10_000)
    monkeypatch.setattr(_stream, "SPILL_BYTES", 1024)
    module = import_onnx(src).quantize_weights(Quantizer())
    streamed = export_onnx(module, tmp_path / "streamed" / "q.onnx")
    assert sorted(os.listdir(tmp_path / "streamed")) == ["q.onnx"]  # no scratch file left
    a = {t.name: t for t in onnx.load(str(plain)).graph.initializer}
    b = {t.name: t for t in onnx.load(str(streamed)).graph.initializer}
    assert set(a) == set(b)
    for name in a:
        assert (a[name].data_type, a[name].raw_data) == (b[name].data_type, b[name].raw_data), name
    # the quantized module's codes live in file-backed maps, and are numpy's
    qt = dict(module.named_params())["w0"].base()._quant
    assert file_mapped(qt.values)
    np.testing.assert_array_equal(np.asarray(qt.values), symmetric_int8(weights[0][0])[0])
    # and the file computes the chain within int8 noise of numpy's float chain
    so = ort.SessionOptions()
    so.log_severity_level = 3
    x = RNG.normal(size=(4, D)).astype(np.float32)
    got = ort.InferenceSession(str(streamed), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = x.astype(np.float64)
    for w, b in weights:
        ref = ref @ w + b
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_the_cli_streams_rewrites_metadata_in_place_and_skips_accuracy_with_a_reason(tmp_path, capsys, monkeypatch,
                                                                                     small_thresholds):
    from onnxparam.quant import _accuracy

    src, _ = chain(tmp_path / "chain.onnx")
    monkeypatch.setattr(_accuracy, "STREAMED_REWRITE_BYTES", 0)  # the streamed metadata rewrite
    monkeypatch.setattr(_accuracy, "available_memory", lambda: 100_000)  # the two models do not fit
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    code, stdout, err = run_main(capsys, "quantize", src, out, "--json")
    assert code == 0, err
    doc = json.loads(stdout)["results"]
    reason = doc["accuracy"]["skipped"]
    assert "GiB of memory is available" in reason and f"accuracy not measured: {reason}" in err
    assert sorted(os.listdir(out.parent)) == ["q.onnx"]
    model = onnx.load(str(out))
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["onnxparam.quant.accuracy"]) == {"skipped": reason}
    assert json.loads(props["onnxparam.quant.kept_float"]) == doc["kept_float"]
    assert json.loads(props["onnxparam.quant.ops"]) == doc["ops"] and len(doc["ops"]) == 3
    assert {t.name: t.data_type for t in model.graph.initializer}["w0"] == TensorProto.UINT8
    assert all(t.data_location == TensorProto.DEFAULT for t in model.graph.initializer)  # inline again
    # --strict refuses what it cannot measure, and leaves nothing
    os.remove(out)
    code, _, err = run_main(capsys, "quantize", src, out, "--strict")
    assert code == 1 and "--strict: the accuracy could not be measured" in err and not out.exists()
    # --no-accuracy: skipped on purpose, no warning
    code, stdout, err = run_main(capsys, "quantize", src, out, "--no-accuracy")
    assert code == 0 and "accuracy:  not measured: --no-accuracy" in stdout and "accuracy not measured" not in err
    code, stdout, _ = run_main(capsys, "inspect", out)
    assert code == 0 and "accuracy:  not measured: --no-accuracy" in stdout


def test_rewrite_metadata_keeps_every_tensor_of_an_inline_file(tmp_path):
    from onnxparam.onnx_io._save import rewrite_metadata

    src, _ = chain(tmp_path / "inline.onnx", external=False)
    before = onnx.load(str(src))
    rewrite_metadata(src, {"k": "v", "other": "w"})
    after = onnx.load(str(src))
    assert {p.key: p.value for p in after.metadata_props} == {"k": "v", "other": "w"}
    assert [t.SerializeToString() for t in after.graph.initializer] == [
        t.SerializeToString() for t in before.graph.initializer]
    assert after.graph.node == before.graph.node
    assert sorted(os.listdir(tmp_path)) == ["inline.onnx"]


def test_a_streamed_bpk_output_holds_numpy_codes(tmp_path, capsys, small_thresholds):
    """``onnxparam quantize`` to ``.bpk`` streams too: the stored codes dequantize to numpy's
    symmetric int8 values of each weight (read back through the burnpack reader)."""
    from onnxparam.convert import read_record
    from onnxparam.quant import QuantizedTensor

    src, weights = chain(tmp_path / "chain.onnx")
    out = tmp_path / "out" / "q.bpk"
    out.parent.mkdir()
    code, _, err = run_main(capsys, "quantize", src, out, "--no-accuracy")
    assert code == 0, err
    assert sorted(os.listdir(out.parent)) == ["q.bpk"]
    record = read_record(out)
    for i, (w, b) in enumerate(weights):
        codes, scale = symmetric_int8(w)
        snap = record[f"w{i}"]
        assert snap.dtype.name == "QFloat"
        np.testing.assert_array_equal(QuantizedTensor.from_data(snap.to_data()).dequantize(),
                                      codes.astype(np.float32) * scale)
        assert record[f"b{i}"].to_data().to_numpy().tobytes() == b.tobytes()



def test_blocked_4bit_weights_are_quantized_in_slabs_of_whole_blocks_as_numpy_does(tmp_path, small_thresholds):
    """Q4S with blocks of 32 rows (what MatMulNBits takes): each ``[32, 1]`` block its own scale
    ``max|block| / 7``, codes rounded half away from zero and clipped to [-7, 7]; read in slabs."""
    from onnxparam.quant import Quantizer, QuantScheme, QuantValue

    w = (RNG.normal(size=(512, 64)) * 0.05).astype(np.float32)
    w[100, 5] = 1.5
    quantizer = Quantizer(QuantScheme(QuantValue.Q4S, block_size=(32, 1)))
    with small_thresholds.streaming(tmp_path):
        qt = small_thresholds.quantize_chunked(w, quantizer, None)
    assert qt is not None and file_mapped(qt.values)
    blocks = w.reshape(16, 32, 64)
    scale = (np.abs(blocks).max(axis=1) * np.float32(2) / np.float32(14)).astype(np.float32)  # [16, 64]
    r = blocks / scale[:, None, :]
    codes = np.clip(np.sign(r) * np.floor(np.abs(r) + 0.5), -7, 7).astype(np.int8).reshape(512, 64)
    np.testing.assert_array_equal(np.asarray(qt.values), codes)
    np.testing.assert_array_equal(np.asarray(qt.scales, np.float32).reshape(16, 64), scale)
    # blocks that do not divide the shape: not chunked (the caller's whole quantize raises)
    assert small_thresholds.quantize_chunked(w[:500], quantizer, None) is None


def test_below_min_cosine_the_sensitivity_search_is_skipped_with_a_reason_when_it_would_not_fit(
        tmp_path, capsys, monkeypatch):
    """The accuracy report fits, the one-at-a-time search (the float model once per weight) does
    not: the warning and the report say so instead of naming weights."""
    from onnxparam.quant import _accuracy

    src, _ = chain(tmp_path / "chain.onnx", external=False)
    calls = []

    def fits(model_bytes):
        calls.append(model_bytes)
        return (True, "") if len(calls) == 1 else (False, "too big for this test")

    monkeypatch.setattr(_accuracy, "fits_in_memory", fits)
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--min-cosine", "1", "--json")
    assert code == 0, err
    report = json.loads(stdout)["results"]["accuracy"]
    assert report["sensitivity_skipped"] == "too big for this test" and report["sensitivity"] == []
    assert "the quantized weights that move the outputs most: not searched: too big for this test" in err
    assert "integer kernels do" not in err
    assert len(calls) == 2 and calls[1] > calls[0]  # the search is asked for more memory than the two runs
