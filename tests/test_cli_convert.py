"""``onnxparam inspect / convert / quantize / lora`` run as processes (``python -m onnxparam``).

Every command of the module runs once (in parallel, in two stages) in a module-scoped fixture;
the tests read its outputs. Oracles are independent of the code under test: Burn's
``model.bpk`` decoded here straight from its bytes with ``cbor2``, safetensors files written
and read by the ``safetensors`` package, numpy formulas, plain ONNX Runtime sessions.
"""

import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import cbor2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_run import CliResult, run_main
from safetensors.numpy import load_file as st_load
from safetensors.numpy import save_file as st_save

import onnxparam.quant
from onnxparam.cli import export_mnist_onnx
from onnxparam.zoo import mnist

BURN_BPK = mnist.weights_path()
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


def start(*args, cwd) -> CliResult:
    """Run one command now, in this process."""
    return run_main(*args, cwd=cwd)


def finish(results: dict) -> dict:
    return dict(results)


ERRORS = {
    # key -> (arguments, exit code, the one stderr line starts with)
    "missing file": (["inspect", "nope.bpk"], 1, "onnxparam: error: input file 'nope.bpk' does not exist"),
    "wrong extension": (["convert", "model.bpk", "out.txt"], 1,
                        "onnxparam: error: output file 'out.txt': cannot tell the format from the extension '.txt'"),
    "mismatched shapes": (["convert", "wrong.safetensors", "out.onnx", "--graph", "graph.onnx"], 1,
                          "onnxparam: error: cannot write the record into"),
    "graph for a bpk": (["convert", "model.bpk", "out.bpk", "--graph", "graph.onnx"], 2,
                        "onnxparam convert: error: --graph applies to an .onnx output; the output is 'out.bpk'"),
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
    "overwrite external data": (["convert", "own.onnx", "own.bpk", "--cast", "f16"], 1,
                                ("onnxparam: error: the target 'own.bpk' holds the external data (weights) of "
                                 "'own.onnx': replacing it would destroy those weights; write to another file")),
    "adapter without factors": (["lora", "merge", "model.bpk", "l.onnx", "--zoo", "mnist", "--alpha", "4", "--rank",
                                 "2", "--adapter", "torch.safetensors"], 1,
                                "onnxparam: error: the --adapter file 'torch.safetensors' has no LoRA factors"),
    "nothing included": (["convert", "model.bpk", "none.bpk", "--include", "zzz"], 1,
                         ("onnxparam: error: no tensor of 'model.bpk' matched --include/--exclude (its 18 tensors: "
                          "'conv1.conv.weight'")),
    "rank above every weight": (["lora", "keep", "model.bpk", "big.bpk", "--zoo", "mnist", "--rank", "100000",
                                 "--alpha", "16"], 1,
                                ("onnxparam: error: --rank 100000 is above min(d_in, d_out) of every adapted weight "
                                 "(fc1.weight [1600, 128], fc2.weight [128, 128], fc3.weight [128, 10])")),
}
ERRORS["block size divides nothing"] = (
    ["quantize", "model.bpk", "q7.onnx", "--scheme", "q8s", "--zoo", "mnist", "--block-size", "7"], 1,
    "onnxparam: error: no param could be quantized with --block-size 7: no weight's last dim is divisible by 7")
ERRORS_WRITE_NOTHING = {"nothing included": "none.bpk",
                        "rank above every weight": "big.bpk", "block size divides nothing": "q7.onnx"}
"""Errors that must leave no output file (the name checked)."""
ODD_NAMES = {"a..b": np.arange(6, dtype=np.float32).reshape(2, 3), "ünï/cödé:0 😀": np.ones(3, np.float16),
             "fc.weight": np.full((2, 2), -1.5, np.float32)}
"""Tensor names a burnpack file may hold that are not module paths."""
MAGIKA = Path(__file__).parent / "data" / "onnx" / "magika_standard_v3_3.onnx"


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
    shutil.copyfile(BURN_BPK, work / "own.bpk")  # the only copy of weights an .onnx will reference
    onnxparam.burnpack.write(work / "odd.bpk", [onnxparam.burnpack.TensorEntry.from_numpy(name, array, 1000 + i)
                                                for i, (name, array) in enumerate(ODD_NAMES.items())])

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
        # fresh adapters (no factors anywhere): the base weights must be MODEL's
        "fresh keep bpk": start("lora", "keep", "model.bpk", "fresh-kept.bpk", "--zoo", "mnist", "--rank", 16,
                                "--alpha", 16, cwd=work),  # 16 > 10 = min(d_in, d_out) of fc3: a warning
        "fresh merge onnx": start("lora", "merge", "model.bpk", "fresh-merged.onnx", "--zoo", "mnist", "--rank", 8,
                                  "--alpha", 16, cwd=work),
        "to safetensors": start("convert", "model.bpk", "model.safetensors", "--quiet", cwd=work),
        "zero copy own": start("convert", "own.bpk", "own.onnx", "--zero-copy", cwd=work),
        "odd names to onnx": start("convert", "odd.bpk", "odd.onnx", cwd=work),
        "inspect magika": start("inspect", MAGIKA, "--json", "--no-count", cwd=work),
    }
    stage1["quantize onnx"] = start("quantize", "model.bpk", "q8.onnx", "--scheme", "q8s", "--zoo", "mnist", cwd=work)
    stage1["quantize bpk"] = start("quantize", "model.bpk", "q4.bpk", "--scheme", "q4s", "--zoo", "mnist", cwd=work)
    stage1["quantize block 32"] = start("quantize", "model.bpk", "q32.onnx", "--scheme", "q8s", "--zoo", "mnist",
                                        "--block-size", 32, cwd=work)
    export_mnist_onnx(mnist.load_pretrained(), work / "graph.onnx")  # in this process, while stage 1 runs
    results = finish(stage1)
    stage2 = {
        "back to bpk": start("convert", "model.onnx", "back.bpk", cwd=work),
        "inspect onnx": start("inspect", "model.onnx", "--json", cwd=work),
        "to torch": start("convert", "torch.bpk", "torch-again.safetensors", "--pytorch", "--plain", cwd=work),
        "into graph": start("convert", "model.bpk", "filled.onnx", "--graph", "graph.onnx", cwd=work),
        "lora merge from kept": start("lora", "merge", "kept.bpk", "merged-again.bpk", "--zoo", "mnist", "--alpha",
                                      LORA_ALPHA, cwd=work),
        "fresh keep onnx": start("lora", "keep", "model.safetensors", "fresh-kept.onnx", "--zoo", "mnist", "--rank",
                                 8, "--alpha", 16, cwd=work),
        "fresh merge bpk": start("lora", "merge", "model.safetensors", "fresh-merged.bpk", "--zoo", "mnist",
                                 "--rank", 8, "--alpha", 16, cwd=work),
        "odd names back": start("convert", "odd.onnx", "odd-back.bpk", cwd=work),
        "quantize reblock": start("quantize", "model.bpk", "q32k.onnx", "--scheme", "q8s", "--zoo", "mnist",
                                  "--block-size", 32, "--reblock", cwd=work),
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


def test_quantize_q8s_onnx_stores_int8_weights_and_classifies(cli):
    work, results, _ = cli
    ok(results, "quantize onnx")
    images, labels = mnist.load_digits()
    session = ort.InferenceSession(str(work / "q8.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: images[:500].astype(np.float32)})[0]
    assert (logits.argmax(axis=1) == labels[:500]).mean() > 0.85
    # the default (--prefer speed) writes the fc weights as 8-bit codes for the dynamic integer MatMul
    # (uint8 with zero point 128, the layout ORT's u8 x u8 kernels compute exactly) and keeps the
    # uncalibrated conv weights float (issue 17: never slower than float32)
    model = onnx.load(str(work / "q8.onnx"))
    uint8 = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.UINT8}
    assert {"fc1.weight", "fc2.weight", "fc3.weight"} <= uint8, "the Linear weights are stored as 8-bit codes"
    zero_points = {n.input[3] for n in model.graph.node if n.op_type == "MatMulInteger" and n.input[1] in uint8}
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert zero_points and all(np.all(values[z] == 128) for z in zero_points)


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


@pytest.mark.parametrize("key", [k for k in ERRORS_WRITE_NOTHING if k in ERRORS])
def test_failed_commands_write_no_output(cli, key):
    work, results, _ = cli
    assert results[f"error: {key}"].returncode == 1
    assert not (work / ERRORS_WRITE_NOTHING[key]).exists()


def test_convert_refuses_to_overwrite_the_external_data_its_input_reads(cli):
    work, results, inputs = cli
    ok(results, "zero copy own")
    assert results["error: overwrite external data"].returncode == 1
    # The .bpk the zero-copy .onnx reads is intact, and the .onnx still gives Burn's weights.
    assert (work / "own.bpk").read_bytes() == BURN_BPK.read_bytes()
    session = ort.InferenceSession(str(work / "own.onnx"), providers=["CPUExecutionProvider"])
    for out, value in zip(session.get_outputs(), session.run(None, {})):
        np.testing.assert_array_equal(value, inputs["burn"][out.name[: -len(":value")]][2])


# -- fresh LoRA adapters keep MODEL's weights -----------------------------------------------------


def _onnx_tensors(path) -> dict:
    """``initializer name -> (param id or None, array)`` read with the ``onnx`` package."""
    out = {}
    for init in onnx.load(str(path)).graph.initializer:
        props = {p.key: p.value for p in init.metadata_props}
        pid = props.get("onnxparam.param_id")
        out[init.name] = (None if pid is None else int(pid), onnx.numpy_helper.to_array(init))
    return out


@pytest.mark.parametrize("key, out", [("fresh keep bpk", "fresh-kept.bpk"), ("fresh merge onnx", "fresh-merged.onnx"),
                                      ("fresh keep onnx", "fresh-kept.onnx"), ("fresh merge bpk", "fresh-merged.bpk")])
def test_lora_with_fresh_adapters_keeps_models_base_weights_and_ids(cli, key, out):
    work, results, inputs = cli
    assert re.search(r"^lora: +3 adapted weights, rank (8|16)", ok(results, key).stdout, re.MULTILINE)
    if out.endswith(".bpk"):
        with onnxparam.burnpack.read(work / out) as f:
            got = {name: (e.param_id, e.to_numpy()) for name, e in f.tensors.items()}
    else:
        got = _onnx_tensors(work / out)
    # b = 0: the merged weight and the kept model's base are MODEL's, bit for bit, with MODEL's ids.
    for name, (_, param_id, array) in inputs["burn"].items():
        assert got[name][0] == param_id, name
        assert got[name][1].tobytes() == array.tobytes(), name
    factors = {name for name in got if re.search(r"\.lora\.[ab]$", name)}
    assert factors == ({f"{fc}.weight.lora.{f}" for fc in LINEARS for f in "ab"} if "keep" in key else set())
    for name in factors:
        if name.endswith(".lora.b"):
            assert not got[name][1].any(), name


def test_lora_warns_when_the_rank_is_above_a_weights_smaller_dim(cli):
    _, results, inputs = cli
    result = ok(results, "fresh keep bpk")
    small = [f"{fc}.weight {list(inputs['burn'][f'{fc}.weight'][0])}" for fc in LINEARS
             if min(inputs["burn"][f"{fc}.weight"][0]) < 16]
    assert small == ["fc3.weight [128, 10]"]
    assert result.stderr.strip().splitlines() == [
        (f"onnxparam: warning: --rank 16 is above min(d_in, d_out) of 1 adapted weight(s) ({small[0]}): their "
         "adapters only add parameters; leave them out with --targets, or use a smaller --rank")]


def test_lora_keep_with_fresh_adapters_classifies_as_the_base_model(cli):
    work, results, _ = cli
    ok(results, "fresh keep onnx")
    images, _ = mnist.load_digits()
    x = images[:300].astype(np.float32)
    logits = []
    for name in ("graph.onnx", "fresh-kept.onnx"):  # graph.onnx: Burn's weights, exported in this process
        session = ort.InferenceSession(str(work / name), providers=["CPUExecutionProvider"])
        logits.append(session.run(None, {session.get_inputs()[0].name: x})[0])
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)


# -- names that are not module paths --------------------------------------------------------------


def test_convert_keeps_names_that_are_not_module_paths_through_onnx_byte_for_byte(cli):
    work, results, _ = cli
    ok(results, "odd names to onnx")
    ok(results, "odd names back")
    assert (work / "odd-back.bpk").read_bytes() == (work / "odd.bpk").read_bytes()
    tensors = _onnx_tensors(work / "odd.onnx")
    assert list(tensors) == list(ODD_NAMES)  # the source names are the initializer names
    for i, (name, array) in enumerate(ODD_NAMES.items()):
        assert tensors[name][0] == 1000 + i
        np.testing.assert_array_equal(tensors[name][1], array)


# -- inspect: initializers that are not weights ---------------------------------------------------


def test_inspect_onnx_counts_the_initializers_it_does_not_list(cli):
    _, results, _ = cli
    result = ok(results, "inspect magika")
    doc = json.loads(result.stdout)
    inits = onnx.load(str(MAGIKA)).graph.initializer
    # The weights are the float tensors (numpy's view of each initializer): 11 of rank >= 1 and
    # 8 jax2tf scalar constants (0-d float initializers are weights; these import frozen).
    weights = [i for i in inits if onnx.numpy_helper.to_array(i).dtype.kind == "f"]
    assert doc["info"]["initializers"] == len(inits) == 36
    assert len(doc["tensors"]) == len(weights) == 19
    assert sum(1 for i in weights if not i.dims) == 8
    assert doc["info"]["non_weight_initializers"] == len(inits) - len(weights) == 17


# -- warnings --------------------------------------------------------------------------------------


def test_warnings_are_one_line_each_and_name_command_line_options(cli):
    _, results, inputs = cli
    result = ok(results, "quantize block 32")
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("onnxparam: warning: ") for line in lines), result.stderr
    assert ".py:" not in result.stderr and "warnings.warn" not in result.stderr
    # Left float: exactly the rank >= 2 weights whose last dim 32 does not divide.
    left = [f"{name} {list(shape)}" for name, (shape, _, _) in inputs["burn"].items()
            if len(shape) >= 2 and shape[-1] % 32]
    assert lines[0] == (f"onnxparam: warning: left float: {', '.join(left)}: not a whole number of [32] blocks "
                        "(Burn's MinMax needs every axis to divide evenly; Burn would panic)")
    along_n = [line for line in lines if "blocked along N" in line]
    assert along_n and all(line.endswith("quantize with --block-size N,1 or export with --reblock")
                           for line in along_n)


def test_quantize_reblock_puts_the_blocks_along_k_and_still_classifies(cli):
    work, results, _ = cli
    result = ok(results, "quantize reblock")
    requantized = re.findall(r"^onnxparam: warning: '(fc\d\.weight)' was re-quantized with blocks of 32 along K",
                             result.stderr, re.MULTILINE)
    assert requantized == ["fc1.weight", "fc2.weight"]
    assert "blocked along N" not in result.stderr
    images, labels = mnist.load_digits()
    session = ort.InferenceSession(str(work / "q32k.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: images[:500].astype(np.float32)})[0]
    assert (logits.argmax(axis=1) == labels[:500]).mean() > 0.85
