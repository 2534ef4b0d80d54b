"""Numerical guards: NaN / Inf weights load and are reported; narrowing casts warn with the path.

Oracles: the NaN / Inf counts and overflow counts are computed here with numpy on the arrays
the test writes; the f16 values are IEEE-754 half precision as numpy computes them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import onnxparam.burnpack as bp
from onnxparam import Module, PrecisionWarning, Tensor
from onnxparam.cli import inspect_file
from onnxparam.convert import convert, load_safetensors, save_safetensors
from onnxparam.formats import read_safetensors
from onnxparam.nn import Linear

WEIGHT = np.array([[1.0, np.nan, -np.inf], [np.inf, 2.0, np.nan]], np.float32)  # 2 NaN, 2 inf
BIAS = np.array([np.nan, 0.5, 1.0], np.float32)  # 1 NaN


class Net(Module):
    def __init__(self):
        self.fc = Linear(2, 3)

    def forward(self, x):
        return self.fc(x)


def with_values(module: Module, values: dict) -> Module:
    return module.map(lambda path, p: p.map(lambda t: Tensor.from_numpy(values[path])))


def test_weights_with_nan_and_inf_load_bit_exactly(tmp_path):
    path = with_values(Net(), {"fc.weight": WEIGHT, "fc.bias": BIAS}).save_file(tmp_path / "nan.bpk")
    loaded = Net().load_file(path)
    assert loaded.fc.weight.val().to_numpy().tobytes() == WEIGHT.tobytes()
    assert loaded.fc.bias.val().to_numpy().tobytes() == BIAS.tobytes()


@pytest.mark.parametrize("fmt", ["bpk", "safetensors"])
def test_inspect_counts_nan_and_inf_per_tensor(tmp_path, fmt):
    module = with_values(Net(), {"fc.weight": WEIGHT, "fc.bias": BIAS})
    if fmt == "bpk":
        path = module.save_file(tmp_path / "nan.bpk")
    else:
        path = tmp_path / "nan.safetensors"
        save_safetensors(module, path)
    doc = inspect_file(path)
    rows = {t["name"]: (t["nan"], t["inf"]) for t in doc["tensors"]}
    oracle = {name: (int(np.isnan(a).sum()), int(np.isinf(a).sum())) for name, a in
              (("fc.weight", WEIGHT), ("fc.bias", BIAS))}
    assert rows == oracle
    assert (doc["totals"]["nan"], doc["totals"]["inf"]) == (3, 2)


BIG = np.array([[1.0, 70000.0, -1e6], [65504.0, 65520.0, 3.0]], np.float32)
"""f16's largest finite value is 65504; 65520 is the first value that rounds to inf."""
with np.errstate(over="ignore"):
    BIG_F16 = BIG.astype(np.float16)  # the oracle: numpy's IEEE half cast


def test_casting_f32_to_f16_with_overflow_warns_naming_the_path(tmp_path):
    module = with_values(Net(), {"fc.weight": BIG, "fc.bias": np.ones(3, np.float32)})
    path = tmp_path / "half.safetensors"
    with pytest.warns(PrecisionWarning) as record:
        save_safetensors(module, path, cast="f16")
    messages = [str(w.message) for w in record]
    expected_count = int((np.isinf(BIG_F16) & np.isfinite(BIG)).sum())
    assert expected_count == 3
    assert messages == [
        f"casting 'fc.weight' from F32 to F16: {expected_count} of 6 finite values overflow to inf (largest "
        "magnitude 1e+06, F16 max 65504); keep F32 for this tensor or rescale it"]
    with read_safetensors(path) as f:
        np.testing.assert_array_equal(f.tensors["fc.weight"].to_data().to_numpy(), BIG_F16)


def test_casting_without_overflow_does_not_warn(tmp_path):
    module = with_values(Net(), {"fc.weight": np.clip(BIG, -60000, 60000), "fc.bias": np.array([np.nan, 1, 2], np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN already in the source is not an overflow
        save_safetensors(module, tmp_path / "half.safetensors", cast="f16")


def test_convert_with_a_narrowing_cast_warns_naming_every_affected_path(tmp_path):
    src = tmp_path / "src.bpk"
    bp.write(src, [bp.TensorEntry.from_numpy("a.weight", BIG), bp.TensorEntry.from_numpy("b.weight", BIG * 2),
                   bp.TensorEntry.from_numpy("c.weight", np.ones(4, np.float32))])
    with pytest.warns(PrecisionWarning) as record:
        convert(src, tmp_path / "dst.safetensors", cast="f16")
    assert sorted(str(w.message).split("'")[1] for w in record) == ["a.weight", "b.weight"]


def test_loading_with_a_narrowing_cast_warns_naming_the_path(tmp_path):
    src = with_values(Net(), {"fc.weight": BIG, "fc.bias": np.ones(3, np.float32)})
    path = tmp_path / "f32.safetensors"
    save_safetensors(src, path)
    half = Net().map(lambda p, param: param.map(lambda t: Tensor.from_numpy(np.zeros(t.shape, np.float16))))
    with pytest.warns(PrecisionWarning, match=r"^casting 'fc.weight' from F32 to F16: 3 of 6 finite values"):
        module = load_safetensors(half, path, cast="module")
        module.fc.weight.val()
