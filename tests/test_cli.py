"""The ``onnxparam`` command line, run as a user runs it (``python -m onnxparam`` in a subprocess)."""

import re
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from cli_run import run_main

from onnxparam.cli import main
from onnxparam.zoo import mnist


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``python -m onnxparam <args>`` in a subprocess: the entry point as a user runs it."""
    return subprocess.run([sys.executable, "-m", "onnxparam", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "out"
    return run_main("export", "mnist", "--out", str(out), "--batch-size", "512"), out


def test_export_mnist_classifies_the_digits_and_reports_accuracy_and_latency(exported):
    result, _ = exported
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"^accuracy: (\d\.\d+) \((\d+)/1797\)", result.stdout, re.M).group(1))
    assert accuracy > 0.90
    assert re.search(r"^latency: .* ms/batch .* images/s", result.stdout, re.M)
    check = re.search(r"max \|logits - module logits\| = (\S+), same label for 1797/1797", result.stdout)
    assert check and float(check.group(1)) < 1e-4


def test_exported_mnist_onnx_runs_in_plain_onnxruntime(exported):
    result, out = exported
    assert result.returncode == 0, result.stderr
    session = ort.InferenceSession(str(out / "mnist.onnx"), providers=["CPUExecutionProvider"])
    images, labels = mnist.load_digits()
    (inp,) = session.get_inputs()
    logits = session.run(None, {inp.name: images[:500].astype(np.float32)})[0]
    assert logits.shape == (500, 10)
    assert (logits.argmax(axis=1) == labels[:500]).mean() > 0.90


@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "mnist", "--batch-size", "0"], "onnxparam export: error: argument --batch-size: expected a "
                                                   "positive integer, got '0'"),
        (["export", "lenet"], "onnxparam export: error: argument model: invalid choice: 'lenet'"),
        (["frobnicate"], "onnxparam: error: argument COMMAND: invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_with_one_clear_line(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert result.stdout == ""


def test_failures_exit_1_with_one_line(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert main(["export", "mnist", "--out", str(not_a_folder)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"onnxparam: error: --out {not_a_folder} exists and is not a folder"]


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "export" in capsys.readouterr().out


def test_export_mnist_tour_prints_a_table_of_every_variant(exported):
    result, out = exported
    assert result.returncode == 0, result.stderr
    text = result.stdout
    table = text[text.index("\nvariant "):].strip().split("\n\n")[0].splitlines()
    rows = {line[:18].strip(): line for line in table[1:]}
    assert set(rows) == {"float32 module", "float32 ONNX", "burnpack", "int8 QDQ ONNX", "LoRA merged ONNX",
                         "LoRA kept ONNX"}
    for variant in ("float32 ONNX", "burnpack", "LoRA merged ONNX", "LoRA kept ONNX"):
        accuracy = float(re.search(r"\s(0\.\d{4})\s", rows[variant]).group(1))
        assert accuracy > 0.90, rows[variant]
    assert (out / "mnist-lora-kept.onnx").stat().st_size > (out / "mnist-lora-merged.onnx").stat().st_size
    check = re.search(r"LoRA merged vs kept: max \|logits difference\| = (\S+)", text)
    assert check and float(check.group(1)) < 1e-4
    assert "skipped" not in text
    accuracy = float(re.search(r"\s(0\.\d{4})\s", rows["int8 QDQ ONNX"]).group(1))
    assert accuracy > 0.85, rows["int8 QDQ ONNX"]


def test_export_mnist_burnpack_round_trip_matches_burns_file_tensor_by_tensor(exported):
    result, out = exported
    assert re.search(r"^burnpack: wrote .*mnist\.bpk .*18/18 tensors byte-identical to model\.bpk", result.stdout, re.M)
    # An independent check of the claim: the tensor bytes of both files, found through their CBOR headers.
    import struct

    import cbor2

    def tensors(path):
        raw = path.read_bytes()
        size = struct.unpack_from("<I", raw, 6)[0]
        meta = cbor2.loads(raw[10:10 + size])
        start = -(-(10 + size) // 256) * 256
        return {n: (d["shape"], d["param_id"], raw[start + d["data_offsets"][0]:start + d["data_offsets"][1]])
                for n, d in meta["tensors"].items()}

    assert tensors(out / "mnist.bpk") == tensors(mnist.weights_path())


def test_export_mnist_tour_latency_columns_share_one_basis_and_notes_explain_them(exported):
    result, _ = exported
    assert result.returncode == 0, result.stderr
    text = result.stdout
    table = text[text.index("\nvariant "):].strip().split("\n\n")[0].splitlines()
    header = table[0]
    ms_end, ips_end = header.index("ms/batch") + len("ms/batch"), header.index("images/s") + len("images/s")
    for line in table[1:]:
        ms, ips = line[:ms_end].split()[-1], line[:ips_end].split()[-1]
        if ms == "-":
            continue
        # images/s = batch size / median batch time: recomputed here from the printed ms/batch.
        expected = 512 / (float(ms) / 1e3)
        assert abs(float(ips.replace(",", "")) - expected) <= expected * 0.01 + 1, line
    assert re.search(r"^note: +ms/batch is the median time of one full batch .*images/s = batch size / that median",
                     text, re.MULTILINE)
    assert re.search(r"^note: +the LoRA rows use rank-4 adapters .*b factors are small random values", text,
                     re.MULTILINE)
