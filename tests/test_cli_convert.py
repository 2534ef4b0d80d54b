"""``onnxparam inspect / convert / quantize / lora`` run as processes (``python -m onnxparam``).

Every command of the module runs once (in parallel, in two stages) in a module-scoped fixture;
the tests read its outputs. Oracles are independent of the code under test: Burn's
``model.bpk`` decoded here straight from its bytes with ``cbor2``, safetensors files written
and read by the ``safetensors`` package, numpy formulas, plain ONNX Runtime sessions.
"""

import json
import shutil
import struct
import subprocess
import sys

import cbor2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file as st_load, save_file as st_save

import onnxparam.quant
from onnxparam.cli import export_mnist_onnx
from onnxparam.zoo import mnist

BURN_BPK = mnist.weights_path()
HAS_QUANTIZER = hasattr(onnxparam.quant, "Quantizer")
LORA_RANK, LORA_ALPHA = 2, 4.0
LINEARS = ("fc1", "fc2", "fc3")


def burn_file() -> dict:
    """Burn's MNIST ``model.bpk`` decoded from its bytes: ``name -> (shape, param_id, array)`` in data order."""
    raw = BURN_BPK.read_bytes()
    magic, version, size = struct.unpack_from("<IHI", raw, 0)
    assert (magic, version) == (0x4255524E, 1)
    meta = cbor2.loads(raw[10:10 + size])
    data_start = -(-(10 + size) // 256) * 256
    out = {}
    for name, d in sorted(meta["tensors"].items(), key=lambda kv: kv[1]["data_offsets"][0]):
        assert d["dtype"] == "F32"
        begin, end = d["data_offsets"]
        array = np.frombuffer(raw, np.float32, (end - begin) // 4, data_start + begin).reshape(d["shape"])
        out[name] = (tuple(d["shape"]), d["param_id"], array)
    return out


def start(*args, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "onnxparam", *map(str, args)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(procs: dict) -> dict:
    results = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


ERRORS = {
    # key -> (arguments, exit code, the one stderr line starts with)
    "missing file": (["inspect", "nope.bpk"], 1, "onnxparam: error: FILE 'nope.bpk' does not exist"),
    "wrong extension": (["convert", "model.bpk", "out.txt"], 1,
                        "onnxparam: error: OUT 'out.txt': cannot tell the format from the extension '.txt'"),
    "mismatched shapes": (["convert", "wrong.safetensors", "out.onnx", "--graph", "graph.onnx"], 1,
                          "onnxparam: error: cannot write the record into"),
    "graph for a bpk": (["convert", "model.bpk", "out.bpk", "--graph", "graph.onnx"], 2,
                        "onnxparam convert: error: --graph applies to an .onnx OUT"),
    "bad remap": (["convert", "model.bpk", "out.bpk", "--remap", "fc1"], 2,
                  "onnxparam convert: error: argument --remap: expected PATTERN=REPLACEMENT, got 'fc1'"),
    "bad scheme": (["quantize", "model.bpk", "q.bpk", "--scheme", "q3s", "--zoo", "mnist"], 2,
                   "onnxparam quantize: error: argument --scheme: invalid choice: 'q3s'"),
    "weights without graph": (["lora", "merge", "model.bpk", "l.onnx", "--alpha", "4", "--rank", "2"], 2,
                              "onnxparam lora: error: a .bpk file holds weights, not a graph"),
    "lora without factors": (["lora", "merge", "model.bpk", "l.onnx", "--zoo", "mnist", "--alpha", "4"], 2,
                             "onnxparam lora: error: 'model.bpk' has no LoRA factors"),
    "lora rank mismatch": (["lora", "merge", "model.bpk", "l.onnx", "--zoo", "mnist", "--alpha", "4",
                            "--adapter", "adapter.safetensors", "--rank", "3"], 1,
                           "onnxparam: error: --rank 3 does not match the factors in 'adapter.safetensors' (rank 2)"),
}
if not HAS_QUANTIZER:
    ERRORS["quantizer missing"] = (["quantize", "model.bpk", "q.onnx", "--scheme", "q8s", "--zoo", "mnist"], 1,
                                   "onnxparam: error: quantizing a model needs onnxparam.quant.Quantizer")


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Inputs written here, every command run once: ``(folder, {key: CompletedProcess}, inputs)``."""
    work = tmp_path_factory.mktemp("cli_convert")
    shutil.copyfile(BURN_BPK, work / "model.bpk")
    burn = burn_file()
    rng = np.random.default_rng(7)
    # A safetensors file in PyTorch's layout: Linear weights (out, in), norm weight/bias.
    torch_layout = {"fc1.weight": rng.standard_normal((4, 3)).astype(np.float32),
                    "fc1.bias": rng.standard_normal(4).astype(np.float32),
                    "norm.weight": rng.standard_normal(4).astype(np.float32),
                    "norm.bias": rng.standard_normal(4).astype(np.float32),
                    "conv.weight": rng.standard_normal((2, 1, 3, 3)).astype(np.float32)}
    st_save(torch_layout, str(work / "torch.safetensors"))
    # NaN / Inf counts to find.
    special = {"clean": np.ones((3, 3), np.float32),
               "f32": np.array([np.nan, 1.0, np.inf, -np.inf, np.nan, np.nan], np.float32),
               "f16": np.array([np.inf, 0.5, np.nan], np.float16),
               "ints": np.arange(4, dtype=np.int64)}
    st_save(special, str(work / "special.safetensors"), metadata={"origin": "test"})
    # LoRA factors with known values, Burn layout: a (d_in, r), b (r, d_out).
    factors = {}
    for fc in LINEARS:
        d_in, d_out = burn[f"{fc}.weight"][0]
        factors[f"{fc}.weight.lora.a"] = rng.standard_normal((d_in, LORA_RANK)).astype(np.float32) * 0.05
        factors[f"{fc}.weight.lora.b"] = rng.standard_normal((LORA_RANK, d_out)).astype(np.float32) * 0.05
    st_save(factors, str(work / "adapter.safetensors"))
    # A safetensors whose fc1.weight does not fit the MNIST graph.
    wrong = {name: array for name, (_, _, array) in burn.items()}
    wrong["fc1.weight"] = np.zeros((128, 1600), np.float32)
    st_save(wrong, str(work / "wrong.safetensors"))

    stage1 = {
        "inspect bpk": start("inspect", "model.bpk", "--json", cwd=work),
        "inspect bpk table": start("inspect", "model.bpk", cwd=work),
        "inspect special": start("inspect", "special.safetensors", "--json", cwd=work),
        "to onnx": start("convert", "model.bpk", "model.onnx", "--quiet", cwd=work),
        "zero copy": start("convert", "model.bpk", "zero.onnx", "--zero-copy", cwd=work),
        "from torch": start("convert", "torch.safetensors", "torch.bpk", "--pytorch", cwd=work),
        "lora merge onnx": start("lora", "merge", "model.bpk", "merged.onnx", "--zoo", "mnist", "--alpha", LORA_ALPHA,
                                 "--adapter", "adapter.safetensors", cwd=work),
        "lora keep onnx": start("lora", "keep", "model.bpk", "kept.onnx", "--zoo", "mnist", "--alpha", LORA_ALPHA,
                                "--adapter", "adapter.safetensors", cwd=work),
        "lora keep bpk": start("lora", "keep", "model.bpk", "kept.bpk", "--zoo", "mnist", "--alpha", LORA_ALPHA,
                               "--adapter", "adapter.safetensors", cwd=work),
        "lora adapter": start("lora", "adapter", "model.bpk", "lora.onnx_adapter", "--zoo", "mnist", "--alpha",
                              LORA_ALPHA, "--adapter", "adapter.safetensors", cwd=work),
    }
    if HAS_QUANTIZER:
        stage1["quantize onnx"] = start("quantize", "model.bpk", "q8.onnx", "--scheme", "q8s", "--zoo", "mnist", cwd=work)
        stage1["quantize bpk"] = start("quantize", "model.bpk", "q4.bpk", "--scheme", "q4s",
                                       "--zoo", "mnist", cwd=work)
    export_mnist_onnx(mnist.load_pretrained(), work / "graph.onnx")  # in this process, while stage 1 runs
    results = finish(stage1)
    stage2 = {
        "back to bpk": start("convert", "model.onnx", "back.bpk", cwd=work),
        "inspect onnx": start("inspect", "model.onnx", "--json", cwd=work),
        "to torch": start("convert", "torch.bpk", "torch-again.safetensors", "--pytorch", "--plain", cwd=work),
        "into graph": start("convert", "model.bpk", "filled.onnx", "--graph", "graph.onnx", cwd=work),
        "lora merge from kept": start("lora", "merge", "kept.bpk", "merged-again.bpk", "--zoo", "mnist", "--alpha",
                                      LORA_ALPHA, cwd=work),
        **{f"error: {key}": start(*args, cwd=work) for key, (args, _, _) in ERRORS.items()},
    }
    results.update(finish(stage2))
    return work, results, {"burn": burn, "torch": torch_layout, "special": special, "factors": factors}


def ok(results, key) -> subprocess.CompletedProcess:
    result = results[key]
    assert result.returncode == 0, f"{key}: {result.stderr}"
    return result


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_json_lists_burns_18_tensors_with_shapes_ids_and_bytes(cli):
    _, results, inputs = cli
    doc = json.loads(ok(results, "inspect bpk").stdout)
    burn = inputs["burn"]
    assert doc["format"] == "burnpack" and doc["info"]["version"] == 1
    assert doc["file_bytes"] == BURN_BPK.stat().st_size
    assert [t["name"] for t in doc["tensors"]] == list(burn)  # data order
    assert len(doc["tensors"]) == 18
    for t in doc["tensors"]:
        shape, param_id, array = burn[t["name"]]
        assert (t["dtype"], tuple(t["shape"]), t["param_id"], t["bytes"]) == ("F32", shape, param_id, array.nbytes)
        assert (t["nan"], t["inf"], t["scheme"]) == (0, 0, None)
    totals = doc["totals"]
    assert totals["tensors"] == 18
    assert totals["elements"] == sum(a.size for _, _, a in burn.values()) == 260_810
    assert totals["largest_tensor_bytes"] == 1600 * 128 * 4
    assert doc["metadata"] == {} and doc["scalars"] == {}


def test_inspect_table_shows_a_row_per_tensor_and_totals(cli):
    _, results, inputs = cli
    out = ok(results, "inspect bpk table").stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name "))
    assert lines[header].split() == ["name", "dtype", "shape", "bytes", "param", "id", "nan", "inf"]
    rows = lines[header + 1:header + 19]
    shape, param_id, _ = inputs["burn"]["fc1.weight"]
    assert any(r.split()[0] == "fc1.weight" and "[1600, 128]" in r and "819,200" in r and str(param_id) in r
               for r in rows)
    assert lines[-1].startswith("total:     18 tensors, 260,810 elements")


def test_inspect_counts_nan_and_inf_per_float_tensor_and_shows_safetensors_metadata(cli):
    _, results, inputs = cli
    doc = json.loads(ok(results, "inspect special").stdout)
    by_name = {t["name"]: t for t in doc["tensors"]}
    for name, array in inputs["special"].items():
        t = by_name[name]
        if array.dtype.kind == "f":
            assert (t["nan"], t["inf"]) == (int(np.isnan(array).sum()), int(np.isinf(array).sum())), name
        else:
            assert (t["nan"], t["inf"]) == (None, None)
        assert (t["dtype"], t["shape"]) == ({"float32": "F32", "float16": "F16", "int64": "I64"}[str(array.dtype)],
                                            list(array.shape))
    assert (doc["totals"]["nan"], doc["totals"]["inf"]) == (4, 3)
    assert doc["metadata"] == {"origin": "test"} and doc["info"]["header_metadata"] == {"origin": "test"}


def test_inspect_onnx_reports_opset_producer_metadata_props_and_the_weights(cli):
    work, results, inputs = cli
    doc = json.loads(ok(results, "inspect onnx").stdout)
    proto = onnx.load(str(work / "model.onnx"))
    info = doc["info"]
    assert info["opset_imports"] == {imp.domain: imp.version for imp in proto.opset_import}
    assert (info["producer_name"], info["ir_version"]) == (proto.producer_name, proto.ir_version)
    assert info["metadata_props"] == {p.key: p.value for p in proto.metadata_props}
    assert [t["name"] for t in doc["tensors"]] == list(inputs["burn"])
    assert [t["param_id"] for t in doc["tensors"]] == [pid for _, pid, _ in inputs["burn"].values()]


# -- convert -------------------------------------------------------------------------------------


def test_convert_bpk_to_onnx_and_back_gives_burns_file_byte_for_byte(cli):
    work, results, _ = cli
    assert "18 tensors" in ok(results, "to onnx").stdout
    ok(results, "back to bpk")
    assert (work / "back.bpk").read_bytes() == BURN_BPK.read_bytes()


def test_convert_into_an_existing_graph_runs_in_onnxruntime(cli):
    work, results, _ = cli
    ok(results, "into graph")
    images, labels = mnist.load_digits()
    session = ort.InferenceSession(str(work / "filled.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: images[:300].astype(np.float32)})[0]
    assert (logits.argmax(axis=1) == labels[:300]).mean() > 0.9


def test_zero_copy_onnx_reads_the_bpk_bytes_in_onnxruntime_and_adds_no_weight_bytes(cli):
    work, results, inputs = cli
    assert "zero-copy" in ok(results, "zero copy").stdout
    assert (work / "zero.onnx").stat().st_size < 20_000  # names and metadata only
    session = ort.InferenceSession(str(work / "zero.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for name, value in zip(names, session.run(None, {})):
        np.testing.assert_array_equal(value, inputs["burn"][name[: -len(":value")]][2])


def test_convert_pytorch_layout_transposes_linear_and_renames_norms_and_back_is_identical(cli):
    work, results, inputs = cli
    out = ok(results, "from torch").stdout
    assert "2 renamed, 1 transposed" in out
    torch = inputs["torch"]
    with onnxparam.burnpack.read(work / "torch.bpk") as f:
        got = {name: e.to_numpy() for name, e in f.tensors.items()}
    assert set(got) == {"fc1.weight", "fc1.bias", "norm.gamma", "norm.beta", "conv.weight"}
    np.testing.assert_array_equal(got["fc1.weight"], torch["fc1.weight"].T)  # Burn's Linear: (in, out)
    np.testing.assert_array_equal(got["norm.gamma"], torch["norm.weight"])
    np.testing.assert_array_equal(got["norm.beta"], torch["norm.bias"])
    np.testing.assert_array_equal(got["conv.weight"], torch["conv.weight"])
    # Burn layout -> PyTorch layout again: the same tensors, names and values.
    ok(results, "to torch")
    again = st_load(str(work / "torch-again.safetensors"))
    assert set(again) == set(torch)
    for name, array in torch.items():
        np.testing.assert_array_equal(again[name], array)


# -- lora ----------------------------------------------------------------------------------------


def test_lora_merge_writes_base_plus_scaled_factor_product(cli):
    work, results, inputs = cli
    assert "3 adapted weights, rank 2, alpha 4 (scale 2)" in ok(results, "lora merge onnx").stdout
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(work / "merged.onnx")).graph.initializer}
    factors = inputs["factors"]
    for fc in LINEARS:
        base = inputs["burn"][f"{fc}.weight"][2]
        expected = base + (LORA_ALPHA / LORA_RANK) * (factors[f"{fc}.weight.lora.a"] @ factors[f"{fc}.weight.lora.b"])
        np.testing.assert_allclose(weights[f"{fc}.weight"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(weights["conv1.conv.weight"], inputs["burn"]["conv1.conv.weight"][2])


def test_lora_keep_graph_computes_what_the_merged_one_does(cli):
    work, results, inputs = cli
    ok(results, "lora keep onnx")
    kept = onnx.load(str(work / "kept.onnx"))
    names = {i.name for i in kept.graph.initializer}
    assert {f"{fc}.weight.lora.{f}" for fc in LINEARS for f in "ab"} <= names
    images, _ = mnist.load_digits()
    x = images[:200].astype(np.float32)
    outs = []
    for name in ("merged.onnx", "kept.onnx"):
        session = ort.InferenceSession(str(work / name), providers=["CPUExecutionProvider"])
        outs.append(session.run(None, {session.get_inputs()[0].name: x})[0])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_lora_keep_bpk_holds_the_factors_and_merging_it_later_matches(cli):
    work, results, inputs = cli
    ok(results, "lora keep bpk")
    with onnxparam.burnpack.read(work / "kept.bpk") as f:
        for name, array in inputs["factors"].items():
            np.testing.assert_array_equal(f.tensors[name].to_numpy(), array)
    ok(results, "lora merge from kept")
    with onnxparam.burnpack.read(work / "merged-again.bpk") as f:
        assert not any(".lora." in name for name in f.tensors)
        merged = f.tensors["fc2.weight"].to_numpy()
    factors = inputs["factors"]
    expected = inputs["burn"]["fc2.weight"][2] + 2.0 * (factors["fc2.weight.lora.a"] @ factors["fc2.weight.lora.b"])
    np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-6)


def test_lora_adapter_file_loads_in_onnxruntime(cli):
    work, results, _ = cli
    ok(results, "lora adapter")
    adapter = ort.LoraAdapter()
    adapter.Load(str(work / "lora.onnx_adapter"))


# -- quantize ------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_QUANTIZER, reason="onnxparam.quant.Quantizer has not landed")
def test_quantize_q8s_onnx_is_a_qdq_model_that_classifies(cli):
    work, results, _ = cli
    ok(results, "quantize onnx")
    images, labels = mnist.load_digits()
    session = ort.InferenceSession(str(work / "q8.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: images[:500].astype(np.float32)})[0]
    assert (logits.argmax(axis=1) == labels[:500]).mean() > 0.85
    quant_dqs = [n for n in onnx.load(str(work / "q8.onnx")).graph.node if n.op_type == "DequantizeLinear"]
    assert quant_dqs, "a QDQ model dequantizes its int8 weights"


@pytest.mark.skipif(not HAS_QUANTIZER, reason="onnxparam.quant.Quantizer has not landed")
def test_quantize_q4s_bpk_holds_qfloat_tensors(cli):
    work, results, _ = cli
    ok(results, "quantize bpk")
    with onnxparam.burnpack.read(work / "q4.bpk") as f:
        assert f.tensors["fc1.weight"].dtype.name == "QFloat"


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(ERRORS))
def test_errors_are_one_line_with_exit_code_1_or_2(cli, key):
    _, results, _ = cli
    _, code, message = ERRORS[key]
    result = results[f"error: {key}"]
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert "Traceback" not in result.stderr


def test_mismatched_shapes_name_the_tensor_and_both_shapes(cli):
    _, results, _ = cli
    line = results["error: mismatched shapes"].stderr.strip()
    assert "shape mismatch for 'fc1.weight'" in line and "[1600, 128]" in line and "[128, 1600]" in line
    assert not (cli[0] / "out.onnx").exists()
