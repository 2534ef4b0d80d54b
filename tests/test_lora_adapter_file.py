"""``check_onnx_adapter``: an ``.onnx_adapter`` file is checked against the ``lora="inputs"``
export it is meant for, and a model exported before the scale-folding change is refused.

Oracles: the factor shapes ``apply_lora`` documents (``a`` ``(d_in, r)``, ``b`` ``(r, d_out)``),
the names ONNX Runtime reads back from the file, and plain ONNX Runtime on a hand-written model
of the old format (fixed-rank factor inputs, ``b`` scaled in the graph), which runs a file
written now at ``scale**2`` strength: the reason it is refused.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxparam import (
    LoraConfig,
    Module,
    OnnxFormatError,
    Param,
    RecordError,
    Tensor,
    check_onnx_adapter,
    export_onnx,
    write_onnx_adapter,
)
from onnxparam.nn import Linear

RANK, ALPHA = 2, 5.0


class Mlp(Module):
    def __init__(self):
        self.fc1 = Linear(4, 6)
        self.fc2 = Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    adapted = Mlp().apply_lora(LoraConfig(rank=RANK, alpha=ALPHA, seed=0)).map(
        lambda path, p: Param(p.id, value=Tensor.from_numpy(rng.normal(size=p.lazy_shape()).astype(np.float32)),
                              require_grad=True) if ".lora." in path else p)
    x = np.ones((2, 4), np.float32)
    model = export_onnx(adapted, tmp_path / "m.onnx", x, lora="inputs")
    adapter = write_onnx_adapter(adapted, tmp_path / "a.onnx_adapter")
    return adapted, model, adapter


def write_raw(path, params: dict):
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in params.items()})
    fmt.export_adapter(str(path))
    return path


def test_a_file_written_for_an_inputs_export_fits_it_with_the_documented_factor_shapes(files):
    _, model, adapter = files
    shapes = check_onnx_adapter(adapter, model)
    assert shapes == {"fc1.weight.lora.a": (4, RANK), "fc1.weight.lora.b": (RANK, 6),
                      "fc2.weight.lora.a": (6, RANK), "fc2.weight.lora.b": (RANK, 3)}
    assert set(shapes) == set(ort.AdapterFormat.read_adapter(str(adapter)).get_parameters())


def test_files_that_do_not_fit_the_model_are_refused_with_every_problem_named(files, tmp_path):
    _, model, _ = files
    bad = write_raw(tmp_path / "bad.onnx_adapter", {
        "fc1.weight.lora.a": np.zeros((4, 2), np.float32),
        "fc1.weight.lora.b": np.zeros((3, 6), np.float32),   # rank 3 beside a rank-2 a
        "fc2.weight.lora.a": np.zeros((5, 2), np.float32),   # d_in 5, the layer has 6
        "fc9.weight.lora.a": np.zeros((6, 2), np.float32),   # no such input
    })
    with pytest.raises(RecordError, match="bad.onnx_adapter") as info:
        check_onnx_adapter(bad, model)
    problems = "\n".join(info.value.problems)
    assert "'fc1.weight.lora.a' has rank 2 but 'fc1.weight.lora.b' has rank 3" in problems
    assert "'fc2.weight.lora.a' has shape [5, 2], the model needs (6, r)" in problems
    assert "'fc9.weight.lora.a' is not a LoRA factor input of 'm.onnx'" in problems
    assert len(info.value.problems) == 3


def test_a_model_without_factor_inputs_is_refused(files, tmp_path):
    adapted, _, adapter = files
    merged = export_onnx(adapted, tmp_path / "merged.onnx", np.ones((2, 4), np.float32), lora="merge")
    with pytest.raises(RecordError, match=r"merged.onnx' has no LoRA factor inputs"):
        check_onnx_adapter(adapter, merged)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07not a model")
    with pytest.raises(OnnxFormatError, match="garbage.onnx"):
        check_onnx_adapter(adapter, garbage)


def old_format_model(path, a0, b0, scale):
    """A model as ``lora="inputs"`` exported before the scale-folding change: fixed-rank factor
    inputs ``w.lora.a`` ``(4, 2)`` / ``w.lora.b`` ``(2, 3)`` with the exporting adapter's factors
    as defaults, and ``b * scale`` in the graph: ``y = (x @ a) @ (b * scale)``."""
    from onnx import TensorProto, helper, numpy_helper

    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
              helper.make_tensor_value_info("w.lora.a", TensorProto.FLOAT, [4, 2]),
              helper.make_tensor_value_info("w.lora.b", TensorProto.FLOAT, [2, 3])]
    nodes = [helper.make_node("Mul", ["w.lora.b", "scale"], ["sb"]),
             helper.make_node("MatMul", ["x", "w.lora.a"], ["xa"]),
             helper.make_node("MatMul", ["xa", "sb"], ["y"])]
    inits = [numpy_helper.from_array(a0, "w.lora.a"), numpy_helper.from_array(b0, "w.lora.b"),
             numpy_helper.from_array(np.array(scale, np.float32), "scale")]
    graph = helper.make_graph(nodes, "old", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def test_a_model_exported_before_the_scale_moved_into_the_files_is_refused_by_name(tmp_path):
    """The old format: fixed-rank factor inputs and ``b * scale`` in the graph (scale 2.5 =
    alpha 5 / r 2). A file written now holds ``scale * b``: on that model it runs at
    ``scale**2`` strength (plain ONNX Runtime shows it), so the check refuses the model."""
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 2)).astype(np.float32)
    b = rng.normal(size=(2, 3)).astype(np.float32)
    path = old_format_model(tmp_path / "old.onnx", a, b, 2.5)
    new_file = write_raw(tmp_path / "new.onnx_adapter", {"w.lora.a": a, "w.lora.b": 2.5 * b})
    x = rng.normal(size=(2, 4)).astype(np.float32)
    lora = ort.LoraAdapter()
    lora.Load(str(new_file))
    options = ort.RunOptions()
    options.add_active_adapter(lora)
    options_ = ort.SessionOptions()
    options_.log_severity_level = 3  # ORT warns that initializers in the inputs are not constant-folded
    got = ort.InferenceSession(str(path), options_, providers=["CPUExecutionProvider"]).run(None, {"x": x}, options)[0]
    np.testing.assert_allclose(got, 2.5 ** 2 * (x @ a @ b), rtol=1e-5)  # the silent error the check prevents
    with pytest.raises(RecordError, match=r"'.*old\.onnx' was exported with lora='inputs' before onnxparam folded "
                                          r"the LoRA scale .*'w\.lora\.a'.*export the model again"):
        check_onnx_adapter(new_file, path)


def test_missing_files_are_named(files, tmp_path):
    _, model, adapter = files
    with pytest.raises(FileNotFoundError, match="nope.onnx_adapter"):
        check_onnx_adapter(tmp_path / "nope.onnx_adapter", model)
