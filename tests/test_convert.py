"""File-to-file conversion between .bpk, .safetensors and .onnx.

Oracles: the Burn-written MNIST burnpack file (byte-for-byte round trips), ONNX Runtime running
the converted models (it reads the weights itself, zero-copy from the .bpk), the digit labels,
files written by ``safetensors.numpy.save_file``, and numpy transposes / casts.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from safetensors.numpy import save_file

import onnxparam as op
from onnxparam import burnpack
from onnxparam.convert import convert, read_safetensors
from onnxparam.convert._converter import OUTPUT_SUFFIX

MNIST_DIR = Path(__file__).resolve().parents[1] / "models" / "mnist"
MNIST_BPK = MNIST_DIR / "model.bpk"
RNG = np.random.default_rng(3)


@pytest.fixture
def mnist_bpk(tmp_path) -> Path:
    path = tmp_path / "model.bpk"
    path.write_bytes(MNIST_BPK.read_bytes())
    return path


def _session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _burn_values(path) -> dict:
    with burnpack.read(path) as f:
        return {name: np.array(entry.to_numpy()) for name, entry in f.tensors.items()}


# -- lossless round trips of the Burn-written file ----------------------------------------------


def test_burn_file_round_trips_through_safetensors_byte_for_byte(mnist_bpk, tmp_path):
    st = tmp_path / "model.safetensors"
    report = convert(mnist_bpk, st)
    assert report.tensors[:3] == ["conv1.conv.weight", "conv1.conv.bias", "conv1.norm.gamma"]
    assert report.bytes_written == st.stat().st_size
    values = _burn_values(mnist_bpk)
    for name, snap in read_safetensors(st).tensors.items():
        assert np.array_equal(snap.to_data().to_numpy(), values[name])
    back = tmp_path / "back.bpk"
    convert(st, back)
    assert back.read_bytes() == MNIST_BPK.read_bytes()


def test_burn_file_round_trips_through_onnx_byte_for_byte(mnist_bpk, tmp_path):
    model = tmp_path / "weights.onnx"
    convert(mnist_bpk, model)
    onnx.checker.check_model(str(model))
    proto = onnx.load(str(model))
    assert [i.name for i in proto.graph.initializer] == list(_burn_values(mnist_bpk))
    # ONNX Runtime reads the initializers itself and hands them back through Identity outputs.
    values = _burn_values(mnist_bpk)
    outputs = _session(model).run(None, {})
    assert [o.name for o in proto.graph.output] == [n + OUTPUT_SUFFIX for n in values]
    for got, expected in zip(outputs, values.values()):
        assert np.array_equal(got, expected)
    back = tmp_path / "back.bpk"
    convert(model, back)
    assert back.read_bytes() == MNIST_BPK.read_bytes()


def test_zero_copy_onnx_reads_the_weights_from_the_bpk(mnist_bpk, tmp_path):
    model = tmp_path / "weights.onnx"
    report = convert(mnist_bpk, model, zero_copy=True)
    # It adds no weight bytes: only the small protobuf is new in the folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bpk", "weights.onnx"]
    assert model.stat().st_size < 16 * 1024 < mnist_bpk.stat().st_size
    assert report.bytes_written == model.stat().st_size
    assert "zero-copy: the weights stay in" in str(report)
    proto = onnx.load(str(model), load_external_data=False)
    header = burnpack.read(mnist_bpk)
    for init in proto.graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        entry = header.tensors[init.name]
        assert info == {"location": "model.bpk", "offset": str(header.data_offset + entry.data_offsets[0]),
                        "length": str(entry.nbytes)}
        assert int(info["offset"]) % burnpack.ALIGNMENT == 0
    values = _burn_values(mnist_bpk)
    for got, expected in zip(_session(model).run(None, {}), values.values()):
        assert np.array_equal(got, expected)
    back = tmp_path / "back.bpk"
    convert(model, back)
    assert back.read_bytes() == MNIST_BPK.read_bytes()


def test_a_zero_copy_model_refuses_a_replaced_weight_file(mnist_bpk, tmp_path):
    model = tmp_path / "weights.onnx"
    convert(mnist_bpk, model, zero_copy=True)
    assert op.import_onnx(model).num_params() == 260_810  # the file it was written against: fine
    # Same size, other bytes in the header (a tensor renamed): plain ORT would read stale slices.
    raw = bytearray(mnist_bpk.read_bytes())
    at = raw.index(b"fc1.weight")
    raw[at:at + 10] = b"fc9.weight"
    mnist_bpk.write_bytes(bytes(raw))
    with pytest.raises(op.OnnxFormatError, match=r"its weight file 'model.bpk' changed after the model was "
                                                 r"written \(its header differs\).*convert the weights again"):
        op.import_onnx(model)
    mnist_bpk.write_bytes(bytes(raw) + b"\0" * 256)
    with pytest.raises(op.OnnxFormatError, match=r"\(1044776 bytes then, 1045032 now\)"):
        convert(model, tmp_path / "back.bpk")
    assert not (tmp_path / "back.bpk").exists()


def test_zero_copy_needs_the_source_in_the_model_folder(mnist_bpk, tmp_path):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="zero_copy needs '.*model.bpk' inside the ONNX model's folder"):
        convert(mnist_bpk, tmp_path / "sub" / "w.onnx", zero_copy=True)
    with pytest.raises(ValueError, match="zero_copy references the source's bytes as they are: no cast or transpose"):
        convert(mnist_bpk, tmp_path / "w.onnx", zero_copy=True, cast="f16")
    with pytest.raises(ValueError, match="zero_copy makes an .onnx model that reads its weights from a .bpk or .safetensors"):
        convert(mnist_bpk, tmp_path / "w.safetensors", zero_copy=True)


# -- weights into an existing graph -------------------------------------------------------------


def _mnist_graph(path: Path) -> None:
    """The MNIST forward as an ONNX graph (built here, independent of the exporter) whose
    initializers are zeros of the Burn tensors' shapes."""
    shapes = {name: v.shape for name, v in _burn_values(MNIST_BPK).items()}
    nodes, inits = [], [helper.make_tensor(n, TensorProto.FLOAT, s, np.zeros(s, np.float32).reshape(-1).tolist())
                        for n, s in shapes.items()]

    def const(name, value, dtype=TensorProto.FLOAT, dims=()):
        nodes.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, dims, value)))

    const("c255", [255.0])
    const("mean", [0.1307])
    const("std", [0.3081])
    const("axes", [1], TensorProto.INT64, [1])
    nodes += [helper.make_node("Div", ["x", "c255"], ["x1"]), helper.make_node("Sub", ["x1", "mean"], ["x2"]),
              helper.make_node("Div", ["x2", "std"], ["x3"]), helper.make_node("Unsqueeze", ["x3", "axes"], ["h0"])]
    h = "h0"
    for block in ("conv1", "conv2"):
        p = f"{block}."
        nodes += [
            helper.make_node("Conv", [h, p + "conv.weight", p + "conv.bias"], [p + "c"]),
            helper.make_node("BatchNormalization", [p + "c", p + "norm.gamma", p + "norm.beta", p + "norm.running_mean",
                                                    p + "norm.running_var"], [p + "n"], epsilon=1e-5),
            helper.make_node("Relu", [p + "n"], [p + "r"]),
            helper.make_node("MaxPool", [p + "r"], [p + "out"], kernel_shape=[2, 2], strides=[2, 2]),
        ]
        h = p + "out"
    nodes.append(helper.make_node("Flatten", [h], ["flat"], axis=1))
    h = "flat"
    for i, fc in enumerate(("fc1", "fc2", "fc3")):
        nodes += [helper.make_node("MatMul", [h, fc + ".weight"], [fc + ".mm"]),
                  helper.make_node("Add", [fc + ".mm", fc + ".bias"], [fc + ".out"])]
        h = fc + ".out"
        if i < 2:
            nodes.append(helper.make_node("Gelu", [h], [fc + ".act"]))
            h = fc + ".act"
    graph = helper.make_graph(nodes, "mnist", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 28, 28])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["N", 10])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))


def _accuracy(model: Path) -> tuple[float, np.ndarray]:
    with np.load(MNIST_DIR / "digits28.npz") as data:
        images, labels = data["images"], data["labels"]
    logits = _session(model).run(None, {"x": images.astype(np.float32)})[0]
    return float((logits.argmax(axis=1) == labels).mean()), logits


def test_burn_weights_into_an_existing_graph_classify_digits(mnist_bpk, tmp_path):
    graph = tmp_path / "graph.onnx"
    _mnist_graph(graph)
    blank, _ = _accuracy(graph)
    assert blank < 0.2  # zeros: one class for every digit

    copied = tmp_path / "copied.onnx"
    convert(mnist_bpk, copied, graph=graph)
    accuracy, logits = _accuracy(copied)
    assert accuracy > 0.9

    linked = tmp_path / "linked.onnx"
    convert(mnist_bpk, linked, graph=graph, zero_copy=True)
    assert linked.stat().st_size < 16 * 1024
    zc_accuracy, zc_logits = _accuracy(linked)
    assert zc_accuracy == accuracy and np.array_equal(zc_logits, logits)
    # The graph keeps its nodes; the weights and their ids come back out.
    assert [n.op_type for n in onnx.load(str(linked), load_external_data=False).graph.node] == \
           [n.op_type for n in onnx.load(str(graph)).graph.node]
    back = tmp_path / "back.bpk"
    convert(linked, back)
    assert back.read_bytes() == MNIST_BPK.read_bytes()


GRAPH_TEXT = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N, 3] x) => (float[N, 2] y)
<float[3, 2] weight = {1, 2, 3, 4, 5, 6}, float[2] bias = {0, 0}, float[2] scale = {1, 1}> {
  h = MatMul(x, weight)
  hb = Add(h, bias)
  y = Mul(hb, scale)
}
"""


def test_graph_mismatches_are_all_reported_before_writing(tmp_path):
    graph = tmp_path / "g.onnx"
    onnx.save(onnx.parser.parse_model(GRAPH_TEXT), str(graph))
    src = tmp_path / "w.safetensors"
    save_file({"weight": np.zeros((2, 3), np.float32), "bias": np.zeros(2, np.float16),
               "extra": np.zeros(1, np.float32)}, str(src))
    out = tmp_path / "out.onnx"
    for zero_copy in (False, True):
        with pytest.raises(op.RecordError) as info:
            convert(src, out, graph=graph, zero_copy=zero_copy)
        message = str(info.value)
        assert "4 problem(s)" in message
        assert "missing tensor 'scale' (ONNX 'scale'): the graph expects F32 [2]" in message
        assert "shape mismatch for 'weight' (ONNX 'weight'): the graph expects [3, 2]" in message
        assert "dtype mismatch for 'bias' (ONNX 'bias'): the graph expects F32" in message
        assert "unexpected tensor 'extra': the graph has no weight at this path" in message
        assert not out.exists()
    convert(src, out, graph=graph, allow_partial=True, include="bias|weight", cast={"f16": "f32"},
            transpose="^weight$")
    sess = _session(out)
    assert np.array_equal(sess.run(None, {"x": np.ones((1, 3), np.float32)})[0], np.zeros((1, 2), np.float32))


def test_onnx_initializer_names_and_order_are_kept(tmp_path):
    text = """
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[2] x) => (float[2] y) <float[2] zeta = {1, 2}, float[2] alpha = {3, 4}> {
      a = Add(x, zeta)
      y = Add(a, alpha)
    }
    """
    model = tmp_path / "m.onnx"
    onnx.save(onnx.parser.parse_model(text), str(model))
    out = tmp_path / "m.bpk"
    convert(model, out)
    values = _burn_values(out)
    assert list(values) == ["zeta", "alpha"]
    assert values["alpha"].tolist() == [3.0, 4.0]


# -- everything a burnpack file can hold --------------------------------------------------------


def _rich_bpk(path: Path) -> None:
    from onnxparam.quant import QuantizedTensor, QuantScheme

    q = QuantizedTensor.quantize(RNG.standard_normal((4, 8)).astype(np.float32), QuantScheme())
    entries = [
        burnpack.TensorEntry("enc.weight", op.DType.BF16, (3, 4), RNG.standard_normal((3, 4)).astype(ml_dtypes.bfloat16), 11),
        burnpack.TensorEntry("enc.weight.lora.a", op.DType.F32, (3, 2), RNG.standard_normal((3, 2)).astype(np.float32), 12),
        burnpack.TensorEntry("enc.weight.lora.b", op.DType.F32, (2, 4), np.zeros((2, 4), np.float32), 13),
        burnpack.TensorEntry("flex", op.DType.Flex32, (2,), np.array([1.5, -2.0], np.float32), 14),
        burnpack.TensorEntry("half", op.DType.F16, (5,), RNG.standard_normal(5).astype(np.float16)),
        burnpack.TensorEntry("mask", op.DType.Bool, (3,), np.array([True, False, True]), 15, bool_store="U32"),
        burnpack.TensorEntry("steps", op.DType.I64, (), np.array(7, np.int64), 16),
        burnpack.TensorEntry.from_quantized("quant", q, 17),
    ]
    burnpack.write(path, entries, metadata={"format": "burnpack", "producer": "test"},
                   scalars={"epoch": 3, "lr": 0.25, "big": 2**64 - 1, "done": False})


def test_everything_burnpack_holds_survives_safetensors(tmp_path):
    src = tmp_path / "rich.bpk"
    _rich_bpk(src)
    st = tmp_path / "rich.safetensors"
    convert(src, st)
    back = tmp_path / "back.bpk"
    convert(st, back)
    assert back.read_bytes() == src.read_bytes()


def test_onnx_target_refuses_quantized_tensors_by_name(tmp_path):
    src = tmp_path / "rich.bpk"
    _rich_bpk(src)
    with pytest.raises(op.RecordError, match="tensor 'quant' is quantized \\(QFloat\\): ONNX holds quantized weights as DequantizeLinear"):
        convert(src, tmp_path / "rich.onnx")
    out = tmp_path / "plain.onnx"
    convert(src, out, exclude="^quant$")
    back = tmp_path / "back.bpk"
    convert(out, back)
    with burnpack.read(src) as a, burnpack.read(back) as b:
        assert list(b.tensors) == [n for n in a.tensors if n != "quant"]
        assert dict(b.metadata) == dict(a.metadata) and dict(b.scalars) == dict(a.scalars)
        for name, entry in b.tensors.items():
            assert entry.param_id == a.tensors[name].param_id
            assert np.array_equal(entry.to_numpy(), a.tensors[name].to_numpy())
        # NOTE: ONNX has no Flex32 and one-byte bools only: those come back as F32 / Native.
        assert b.tensors["flex"].dtype is op.DType.F32 and b.tensors["mask"].bool_store == "Native"


# -- renaming, layouts, casts, streaming --------------------------------------------------------


def test_pytorch_safetensors_to_burnpack_with_remap_transpose_and_cast(tmp_path):
    sd = {"model.fc.weight": RNG.standard_normal((4, 3)).astype(np.float32),
          "model.fc.bias": RNG.standard_normal(4).astype(np.float32),
          "model.ln.weight": RNG.standard_normal(4).astype(np.float32)}
    src = tmp_path / "pt.safetensors"
    save_file(sd, str(src), metadata={"format": "pt"})
    out = tmp_path / "burn.bpk"
    seen = []
    report = convert(src, out, remap=[(r"^model\.", ""), (r"^ln\.weight$", "ln.gamma")], transpose=r"^fc\.weight$",
                     cast="f16", progress=lambda name, n: seen.append((name, n)))
    values = _burn_values(out)
    assert np.array_equal(values["fc.weight"].view(np.uint16), sd["model.fc.weight"].T.astype(np.float16).view(np.uint16))
    assert np.array_equal(values["ln.gamma"], sd["model.ln.weight"].astype(np.float16))
    assert report.transposed == [("fc.weight", [4, 3], [3, 4])]
    assert ("model.ln.weight", "ln.gamma") in report.renamed and len(report.cast) == 3
    assert sorted(seen) == sorted([("fc.weight", 24), ("fc.bias", 8), ("ln.gamma", 8)])
    with burnpack.read(out) as f:
        assert dict(f.metadata) == {"format": "pt"}


def test_conversion_memory_is_bounded_by_the_largest_tensor(tmp_path):
    count, shape = 8, (1024, 1024)  # 4 MiB per f32 tensor, 32 MiB in all
    src = tmp_path / "big.safetensors"
    save_file({f"t{i}": np.full(shape, i, np.float32) for i in range(count)}, str(src))
    out = tmp_path / "big.bpk"
    tracemalloc.start()
    try:
        convert(src, out, cast="f16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tensor_bytes = 4 * shape[0] * shape[1]
    assert peak < 1.5 * tensor_bytes, f"peak {peak} bytes for {count} tensors of {tensor_bytes}"
    assert _burn_values(out)["t5"][0, 0] == 5


def test_failed_conversion_leaves_the_target_as_it_was(mnist_bpk, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    with pytest.raises(op.RecordError, match="name clash: tensors 'fc1.weight' and 'fc2.weight' are both renamed to 'fc.weight'"):
        convert(mnist_bpk, out, remap=[(r"^fc\d", "fc")])
    assert out.read_bytes() == b"old"


def test_unknown_formats_and_missing_files(tmp_path):
    (tmp_path / "model.tflite").write_bytes(b"\x1c\x00\x00\x00TFL3" + bytes(24))
    with pytest.raises(ValueError, match=r"'.*model.tflite' is not a weights file this library reads: found 32 bytes starting with 1c 00"):
        convert(tmp_path / "model.tflite", tmp_path / "model.bpk")
    with pytest.raises(ValueError, match=r"cannot tell the format of '.*model.tflite' from its extension '.tflite'; use one of .bpk, .safetensors, .onnx, .pt, .pth"):
        convert(tmp_path / "model.bpk", tmp_path / "model.tflite")
    with pytest.raises(ValueError, match=r"cannot write '.*model.pt': pytorch files are read, not written"):
        convert(tmp_path / "model.bpk", tmp_path / "model.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        convert(tmp_path / "none.bpk", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="graph= applies to .onnx targets only"):
        convert(tmp_path / "none.bpk", tmp_path / "model.safetensors", graph="g.onnx")


def test_zero_copy_from_safetensors_keeps_bf16_bits(tmp_path):
    bits = RNG.integers(0, 2**16, size=(3, 5), dtype=np.uint16)
    src = tmp_path / "w.safetensors"
    save_file({"emb.weight": bits.view(ml_dtypes.bfloat16), "head.bias": np.arange(4, dtype=np.float16)}, str(src))
    model = tmp_path / "w.onnx"
    convert(src, model, zero_copy=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.onnx", "w.safetensors"]
    # ONNX Runtime reads the slices (its Python API cannot return bf16 arrays: ask for the f16).
    f16 = _session(model).run(["head.bias" + OUTPUT_SUFFIX], {})[0]
    assert np.array_equal(f16, np.arange(4, dtype=np.float16))
    # The onnx package resolves the external data itself: the bf16 bits are the file's.
    loaded = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    assert np.array_equal(np.asarray(loaded["emb.weight"]).view(np.uint16), bits)
