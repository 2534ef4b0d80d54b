"""``onnxparam inspect`` lists an ONNX Runtime ``.onnx_adapter`` file's tensors (names, dtypes,
shapes, bytes), its versions and the rank of each factor pair, as text and JSON.

Oracles: a file written with ONNX Runtime's own ``AdapterFormat`` API from arrays the test makes
(their names, shapes, dtypes and byte counts are numpy's), and a file ``write_onnx_adapter``
writes for a LoRA module, read back by ``onnxruntime.AdapterFormat.read_adapter``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnxparam import ExecutionError
from onnxparam.cli import inspect_file, main

ort = pytest.importorskip("onnxruntime")


def _write_with_ort(path, params: dict, adapter_version: int = 3, model_version: int = 7) -> None:
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(adapter_version)
    fmt.set_model_version(model_version)
    fmt.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in params.items()})
    fmt.export_adapter(str(path))


@pytest.fixture
def factors() -> dict:
    rng = np.random.default_rng(0)
    return {
        "fc1.weight.lora.a": rng.normal(size=(16, 4)).astype(np.float32),
        "fc1.weight.lora.b": rng.normal(size=(4, 32)).astype(np.float32),
        "onnx::MatMul_7.lora.a": rng.normal(size=(32, 2)).astype(np.float16),
        "onnx::MatMul_7.lora.b": rng.normal(size=(2, 8)).astype(np.float16),
    }


def test_inspect_json_lists_every_factor_with_its_dtype_shape_and_bytes(tmp_path, factors, capsys):
    path = tmp_path / "lora.onnx_adapter"
    _write_with_ort(path, factors)
    assert main(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "onnx_adapter"
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(factors)
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    for name, array in factors.items():
        assert rows[name]["shape"] == list(array.shape)
        assert rows[name]["dtype"] == names[array.dtype]
        assert rows[name]["bytes"] == array.nbytes
        assert rows[name]["nan"] == 0 and rows[name]["inf"] == 0
    assert doc["info"]["adapter_version"] == 3 and doc["info"]["model_version"] == 7
    assert doc["info"]["ranks"] == {"fc1.weight": 4, "onnx::MatMul_7": 2}
    assert doc["totals"]["tensors"] == 4
    assert doc["totals"]["bytes"] == sum(a.nbytes for a in factors.values())


def test_inspect_text_names_each_tensor_and_counts_a_nan(tmp_path, factors, capsys):
    factors["fc1.weight.lora.b"][0, 0] = np.nan
    path = tmp_path / "lora.onnx_adapter"
    _write_with_ort(path, factors)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ONNX Runtime LoRA adapter" in out and "adapter version 3, model version 7" in out
    assert "2 adapted weight(s), rank 2, 4" in out
    for name, array in factors.items():
        line = next(row for row in out.splitlines() if row.startswith(name + " "))
        assert "[" + ", ".join(map(str, array.shape)) + "]" in line
    assert "1 NaN, 0 Inf" in out


def test_inspect_lists_what_write_onnx_adapter_wrote_for_a_module(tmp_path):
    import onnxparam as op
    from onnxparam import nn

    class Mlp(op.Module):
        def __init__(self):
            self.fc1 = nn.Linear(6, 5)
            self.fc2 = nn.Linear(5, 3)

        def forward(self, x):
            return self.fc2(self.fc1(x))

    adapted = Mlp().apply_lora(op.LoraConfig(rank=2, alpha=4, seed=0))
    path = op.write_onnx_adapter(adapted, tmp_path / "m.onnx_adapter")
    truth = {k: v.numpy() for k, v in ort.AdapterFormat.read_adapter(str(path)).get_parameters().items()}
    doc = inspect_file(path)
    assert {t["name"]: tuple(t["shape"]) for t in doc["tensors"]} == {k: v.shape for k, v in truth.items()}
    assert doc["info"]["ranks"] == {"fc1.weight": 2, "fc2.weight": 2}


def test_a_damaged_adapter_file_is_the_librarys_error_naming_it(tmp_path, factors, capsys):
    path = tmp_path / "bad.onnx_adapter"
    _write_with_ort(path, factors)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # the identifier survives, the tables do not
    with pytest.raises(ExecutionError, match="bad.onnx_adapter"):
        inspect_file(path)
    assert main(["inspect", str(path), "--json"]) == 1
    assert "bad.onnx_adapter" in json.loads(capsys.readouterr().out)["error"]
