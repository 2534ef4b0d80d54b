"""PyTorch <-> Burn layouts, key remapping, filters, casts and load reports.

Oracles: PyTorch-layout files written in the test with ``safetensors.numpy.save_file`` from
known arrays, numpy's own transpose / ``astype``, and the Burn-written MNIST burnpack file.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import onnxparam as op
from onnxparam.convert import (
    KeyRemapper,
    LoadReport,
    PathFilter,
    PyTorchAdapter,
    apply_record,
    cast_spec,
    collect_record,
    load_safetensors,
    map_indices_contiguous,
    read_safetensors,
    save_safetensors,
)

RNG = np.random.default_rng(7)
MNIST_BPK = Path(__file__).resolve().parents[1] / "models" / "mnist" / "model.bpk"


def _never(device, require_grad):
    raise AssertionError("a lazy param was initialized: loading must never run init")


def _lazy(*shape, dtype=op.DType.F32, require_grad=True) -> op.Param:
    return op.Param.uninitialized(op.ParamId(), _never, "cpu", require_grad, shape, dtype)


# Modules shaped like Burn's layers, made of plain params; the adapter recognizes them by class
# name, exactly as Burn's adapter recognizes its modules by their container type.
class Linear(op.Module):
    def __init__(self, d_input, d_output, dtype=op.DType.F32):
        self.weight = _lazy(d_input, d_output, dtype=dtype)
        self.bias = _lazy(d_output, dtype=dtype)


class BatchNorm(op.Module):
    def __init__(self, n):
        self.gamma = _lazy(n)
        self.beta = _lazy(n)
        self.running_mean = _lazy(n, require_grad=False)
        self.running_var = _lazy(n, require_grad=False)


class Net(op.Module):
    def __init__(self, dtype=op.DType.F32):
        self.fc1 = Linear(3, 4, dtype)
        self.norm = BatchNorm(4)
        self.fc2 = Linear(4, 2, dtype)


def _pytorch_state_dict(dtype=np.float32) -> dict:
    """A PyTorch state dict of ``Net`` (Linear weights (out, in), norm weight/bias)."""
    return {
        "fc1.weight": RNG.standard_normal((4, 3)).astype(dtype),
        "fc1.bias": RNG.standard_normal(4).astype(dtype),
        "norm.weight": RNG.standard_normal(4).astype(np.float32),
        "norm.bias": RNG.standard_normal(4).astype(np.float32),
        "norm.running_mean": RNG.standard_normal(4).astype(np.float32),
        "norm.running_var": RNG.random(4).astype(np.float32),
        "fc2.weight": RNG.standard_normal((2, 4)).astype(dtype),
        "fc2.bias": RNG.standard_normal(2).astype(dtype),
    }


def _value(param: op.Param) -> np.ndarray:
    return param.val().to_numpy()


def test_pytorch_checkpoint_loads_transposed_and_renamed(tmp_path):
    sd = _pytorch_state_dict()
    path = tmp_path / "model.safetensors"
    save_file({**sd, "norm.num_batches_tracked": np.array(12, np.int64)}, str(path), metadata={"format": "pt"})

    report = LoadReport()

    module = load_safetensors(Net(), path, adapter="pytorch", report=report)

    assert np.array_equal(_value(module.fc1.weight), sd["fc1.weight"].T)
    assert np.array_equal(_value(module.fc2.weight), sd["fc2.weight"].T)
    assert np.array_equal(_value(module.fc1.bias), sd["fc1.bias"])
    assert np.array_equal(_value(module.norm.gamma), sd["norm.weight"])
    assert np.array_equal(_value(module.norm.beta), sd["norm.bias"])
    assert np.array_equal(_value(module.norm.running_var), sd["norm.running_var"])
    assert module.norm.running_mean.require_grad is False
    assert report.applied == ["fc1.weight", "fc1.bias", "norm.gamma", "norm.beta", "norm.running_mean",
                              "norm.running_var", "fc2.weight", "fc2.bias"]
    assert report.transposed == [("fc1.weight", [4, 3], [3, 4]), ("fc2.weight", [2, 4], [4, 2])]
    assert report.renamed == [("norm.weight", "norm.gamma"), ("norm.bias", "norm.beta")]
    assert report.ignored == ["norm.num_batches_tracked"]
    assert report.missing == report.unused == report.errors == report.cast == []
    assert report.ok


def test_loading_is_lazy_until_a_value_is_read(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_pytorch_state_dict(), str(path))
    module = load_safetensors(Net(), path, adapter="pytorch")
    assert not module.fc1.weight.is_initialized()
    assert module.fc1.weight.lazy_shape() == (3, 4)
    _value(module.fc1.weight)
    assert module.fc1.weight.is_initialized() and not module.fc2.weight.is_initialized()


def test_save_in_pytorch_layout_is_byte_identical_to_the_original(tmp_path):
    sd = _pytorch_state_dict()
    original = tmp_path / "original.safetensors"
    save_file(sd, str(original), metadata={"format": "pt"})
    module = load_safetensors(Net(), original, adapter="pytorch")

    again = tmp_path / "again.safetensors"
    report = save_safetensors(module, again, adapter="pytorch", metadata={"format": "pt"}, lossless=False)

    assert again.read_bytes() == original.read_bytes()
    assert report.path == str(again)
    assert report.transposed == [("fc1.weight", [3, 4], [4, 3]), ("fc2.weight", [4, 2], [2, 4])]
    assert report.renamed == [("norm.gamma", "norm.weight"), ("norm.beta", "norm.bias")]
    assert report.saved == ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "norm.running_mean",
                            "norm.running_var", "fc2.weight", "fc2.bias"]


def test_nn_layers_take_pytorch_weights(tmp_path):
    nn = pytest.importorskip("onnxparam.nn", exc_type=ImportError)

    class Block(op.Module):
        def __init__(self):
            self.linear = nn.Linear(3, 4)
            self.norm = nn.LayerNorm(4)

    sd = {"linear.weight": RNG.standard_normal((4, 3)).astype(np.float32),
          "linear.bias": RNG.standard_normal(4).astype(np.float32),
          "norm.weight": RNG.standard_normal(4).astype(np.float32),
          "norm.bias": RNG.standard_normal(4).astype(np.float32)}
    path = tmp_path / "block.safetensors"
    save_file(sd, str(path))
    report = LoadReport()
    block = load_safetensors(Block(), path, adapter="pytorch", report=report)
    assert np.array_equal(_value(block.linear.weight), sd["linear.weight"].T)
    assert np.array_equal(_value(block.norm.gamma), sd["norm.weight"])
    assert report.renamed == [("norm.weight", "norm.gamma"), ("norm.bias", "norm.beta")]


def test_burn_mnist_through_pytorch_layout_and_back_is_byte_identical(tmp_path):
    mnist = pytest.importorskip("onnxparam.zoo.mnist", exc_type=ImportError)
    from onnxparam import burnpack
    from onnxparam.burnpack._module_file import record_entries

    model = mnist.Mnist().load_file(MNIST_BPK)
    pt_path = tmp_path / "mnist_pt.safetensors"
    save_safetensors(model, pt_path, adapter="pytorch")

    burn = burnpack.read(MNIST_BPK)
    pt = read_safetensors(pt_path).tensors
    # Oracle: the Burn-written values, transposed / renamed by numpy and by hand.
    assert np.array_equal(pt["fc1.weight"].to_data().to_numpy(), burn.tensors["fc1.weight"].to_numpy().T)
    assert pt["fc1.weight"].shape == (128, 1600)
    assert np.array_equal(pt["conv1.norm.weight"].to_data().to_numpy(), burn.tensors["conv1.norm.gamma"].to_numpy())
    assert np.array_equal(pt["conv2.conv.weight"].to_data().to_numpy(), burn.tensors["conv2.conv.weight"].to_numpy())
    assert int(pt["conv1.norm.weight"].param_id) == burn.tensors["conv1.norm.gamma"].param_id

    report = LoadReport()

    back = load_safetensors(mnist.Mnist(), pt_path, adapter="pytorch", report=report)
    assert len(report.applied) == 18 and len(report.transposed) == 3 and report.ok
    out = tmp_path / "back.bpk"
    burnpack.write(out, record_entries(back.into_record()))
    assert out.read_bytes() == MNIST_BPK.read_bytes()


# -- remapping and filters ----------------------------------------------------------------------


def test_key_remapper_applies_rules_in_order_with_both_group_syntaxes():
    remapper = KeyRemapper([(r"^model\.", ""), (r"\.ln_(\d)\.", r".norm$1."), (r"layers\.(\d+)", r"blocks.\1")])
    assert remapper("model.layers.3.ln_2.weight") == "blocks.3.norm2.weight"
    assert remapper("other") == "other"
    assert KeyRemapper([(r"(?P<x>a)", "${x}$$")]).apply("a") == "a$"
    assert remapper.add("weight$", "w")("model.fc.weight") == "fc.w"
    assert KeyRemapper.of({"^a": "b"}).rules == (("^a", "b"),)


def test_map_indices_contiguous_renumbers_each_position():
    names = ["fc.0.weight", "fc.2.weight", "fc.4.bias", "enc.1.sub.3.w", "enc.1.sub.7.w", "enc.5.sub.3.w"]
    assert map_indices_contiguous(names) == {
        "fc.0.weight": "fc.0.weight", "fc.2.weight": "fc.1.weight", "fc.4.bias": "fc.2.bias",
        "enc.1.sub.3.w": "enc.0.sub.0.w", "enc.1.sub.7.w": "enc.0.sub.1.w", "enc.5.sub.3.w": "enc.1.sub.0.w",
    }


def test_remap_and_contiguous_indices_load_a_sequential_checkpoint(tmp_path):
    class Seq(op.Module):
        def __init__(self):
            self.layers = [Linear(2, 2), Linear(2, 2)]

    sd = {"backbone.seq.0.weight": np.eye(2, dtype=np.float32), "backbone.seq.0.bias": np.zeros(2, np.float32),
          "backbone.seq.2.weight": np.arange(4, dtype=np.float32).reshape(2, 2),
          "backbone.seq.2.bias": np.ones(2, np.float32)}
    path = tmp_path / "seq.safetensors"
    save_file(sd, str(path))
    report = LoadReport()
    module = load_safetensors(Seq(), path, adapter="pytorch", remap=[(r"^backbone\.seq\.", "layers.")],
                                      contiguous_indices=True, report=report)
    assert np.array_equal(_value(module.layers[1].weight), sd["backbone.seq.2.weight"].T)
    assert ("backbone.seq.2.weight", "layers.1.weight") in report.renamed


def test_filters_skip_params_and_keep_their_values(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_pytorch_state_dict(), str(path))
    base = Net()
    report = LoadReport()
    module = load_safetensors(base, path, adapter="pytorch", exclude=r"^fc2\.", report=report)
    assert report.skipped == ["fc2.weight", "fc2.bias"] and report.unused == []
    assert module.fc2.weight is base.fc2.weight  # untouched (still lazy, never initialized)
    report = LoadReport()
    module = load_safetensors(Net(), path, adapter="pytorch", exclude=r"gamma$", report=report)
    assert report.skipped == ["norm.gamma"] and report.unused == [] and len(report.applied) == 7
    report = LoadReport()
    module = load_safetensors(Net(), path, adapter="pytorch", include=[r"^fc1\.", r"^norm\."], report=report)
    assert report.skipped == ["fc2.weight", "fc2.bias"] and len(report.applied) == 6 and report.ok
    flt = PathFilter(include="^a", exclude=["b$"])
    assert flt("ax") and not flt("ab") and not flt("xa")


def test_allow_partial_reports_missing_and_unused(tmp_path):
    sd = _pytorch_state_dict()
    del sd["fc2.bias"]
    path = tmp_path / "partial.safetensors"
    save_file({**sd, "head.extra": np.zeros(3, np.float32)}, str(path))
    with pytest.raises(op.RecordError) as info:
        load_safetensors(Net(), path, adapter="pytorch")
    assert "missing tensor 'fc2.bias': the module expects F32 [2], the file has none" in str(info.value)
    assert ("unexpected tensor 'head.extra': the module has no param at this path; rename it with "
            "remap=[(pattern, replacement)], or pass allow_partial=True") in str(info.value)
    assert info.value.report.missing == ["fc2.bias"]

    base = Net()
    report = LoadReport()
    module = load_safetensors(base, path, adapter="pytorch", allow_partial=True, report=report)
    assert report.missing == ["fc2.bias"] and report.unused == ["head.extra"] and not report.ok
    assert module.fc2.bias is base.fc2.bias


# -- errors -------------------------------------------------------------------------------------


def test_every_problem_is_reported_at_once_with_expected_and_found(tmp_path):
    sd = _pytorch_state_dict()
    sd["fc1.bias"] = np.zeros(5, np.float32)
    sd["norm.running_mean"] = sd["norm.running_mean"].astype(np.float16)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    with pytest.raises(op.RecordError) as info:
        load_safetensors(Net(), path, adapter="pytorch")
    message = str(info.value)
    assert message.startswith(f"cannot load '{path}' into Net: 2 problem(s)")
    assert "shape mismatch for 'fc1.bias': the module expects [4], the file has [5]" in message
    assert "dtype mismatch for 'norm.running_mean': the module expects F32, the file has F16; " in message
    assert "cast='module'" in message
    assert info.value.problems == info.value.report.errors


def test_transposed_file_without_adapter_suggests_it(tmp_path):
    path = tmp_path / "pt.safetensors"
    save_file(_pytorch_state_dict(), str(path))
    with pytest.raises(op.RecordError) as info:
        load_safetensors(Net(), path)
    message = str(info.value)
    assert ("shape mismatch for 'fc1.weight': the module expects [3, 4], the file has [4, 3]; the file looks "
            "transposed: PyTorch stores Linear weights as (out, in), Burn as (in, out); use adapter='pytorch'") in message
    assert "missing tensor 'norm.gamma': the module expects F32 [4], the file has none; PyTorch names norm params weight/bias: use adapter='pytorch'" in message


def test_two_tensors_remapped_to_one_name_is_an_error(tmp_path):
    path = tmp_path / "clash.safetensors"
    save_file({"a.weight": np.zeros(2, np.float32), "b.weight": np.zeros(2, np.float32)}, str(path))
    with pytest.raises(op.RecordError, match=r"name clash: tensors 'a.weight' and 'b.weight' are both renamed to 'x.weight'"):
        load_safetensors(Net(), path, remap=[(r"^[ab]\.", "x.")], allow_partial=True)


def test_explicit_transpose_rule_for_non_linear_modules(tmp_path):
    class Proj(op.Module):
        def __init__(self):
            self.kernel = _lazy(3, 2)

    array = RNG.standard_normal((2, 3)).astype(np.float32)
    path = tmp_path / "proj.safetensors"
    save_file({"kernel": array}, str(path))
    report = LoadReport()
    module = load_safetensors(Proj(), path, adapter=PyTorchAdapter(transpose=r"^kernel$"), report=report)
    assert np.array_equal(_value(module.kernel), array.T)
    assert report.transposed == [("kernel", [2, 3], [3, 2])]


# -- casts --------------------------------------------------------------------------------------


def test_cast_to_the_module_dtype_rounds_like_numpy(tmp_path):
    sd = _pytorch_state_dict()
    path = tmp_path / "f32.safetensors"
    save_file(sd, str(path))
    report = LoadReport()
    module = load_safetensors(Net(op.DType.F16), path, adapter="pytorch", cast="module", report=report)
    got = _value(module.fc1.weight)
    assert got.dtype == np.float16
    assert np.array_equal(got.view(np.uint16), sd["fc1.weight"].T.astype(np.float16).view(np.uint16))
    assert ("fc1.weight", op.DType.F32, op.DType.F16) in report.cast
    assert all(p.startswith("fc") for p, _, _ in report.cast)  # the norm stays F32 as the module is


def test_cast_on_save_to_bf16_matches_ml_dtypes(tmp_path):
    sd = _pytorch_state_dict()
    path = tmp_path / "f32.safetensors"
    save_file(sd, str(path))
    module = load_safetensors(Net(), path, adapter="pytorch")
    out = tmp_path / "bf16.safetensors"
    report = save_safetensors(module, out, adapter="pytorch", cast="bf16")
    saved = read_safetensors(out).tensors
    assert saved["fc1.weight"].dtype is op.DType.BF16
    expected = sd["fc1.weight"].astype(ml_dtypes.bfloat16)
    assert np.array_equal(saved["fc1.weight"].to_data().to_numpy().view(np.uint16), expected.view(np.uint16))
    assert len(report.cast) == 8
    back = load_safetensors(Net(), out, adapter="pytorch", cast="f32")
    assert np.array_equal(_value(back.fc1.weight), expected.astype(np.float32).T)


def test_cast_spec_accepts_names_and_mappings_and_refuses_ints():
    assert cast_spec("f16")[op.DType.F32] is op.DType.F16
    assert cast_spec({"f32": "bf16"}) == {op.DType.F32: op.DType.BF16}
    assert cast_spec(None) is None
    with pytest.raises(ValueError, match="'i8' is not a float dtype"):
        cast_spec("i8")
    with pytest.raises(ValueError, match="only float tensors are cast; I64 is not a float dtype"):
        cast_spec({op.DType.I64: op.DType.F32})


# -- records, ids and reports -------------------------------------------------------------------


def test_ids_come_from_the_file_when_it_has_them(tmp_path):
    from onnxparam.core.record import ModuleRecord, TensorSnapshot
    from onnxparam.core.tensor import TensorData

    record, _ = collect_record(Net())  # names and shapes only: nothing is read
    items = {}
    for i, (name, snap) in enumerate(record.items()):
        array = np.full(snap.shape, i, np.float32)
        items[name] = TensorSnapshot(op.DType.F32, snap.shape, op.ParamId(1000 + i),
                                     lambda a=array: TensorData(a, op.DType.F32, a.shape))
    loaded = apply_record(Net(), ModuleRecord(items))
    assert [int(p.id) for _, p in loaded.named_params()] == [1000 + i for i in range(len(items))]

    path = tmp_path / "plain.safetensors"  # a PyTorch file has no ids: the module keeps its own
    save_file(_pytorch_state_dict(), str(path))
    target = Net()
    loaded = load_safetensors(target, path, adapter="pytorch")
    assert [p.id for _, p in loaded.named_params()] == [p.id for _, p in target.named_params()]


def test_report_prints_every_section():
    report = LoadReport(source="m.safetensors", applied=["a.weight"], missing=["b"], unused=["c"],
                        ignored=["n.num_batches_tracked"], renamed=[("x.weight", "x.gamma")],
                        transposed=[("a.weight", [4, 3], [3, 4])], cast=[("a.weight", op.DType.F32, op.DType.F16)])
    text = str(report)
    assert text.splitlines()[0] == ("LoadReport from 'm.safetensors': 1 applied, 1 missing, 1 unused, 1 ignored, "
                                    "0 skipped, 1 renamed, 1 transposed, 1 cast, 0 errors")
    for line in ["  missing (1):", "    b", "    x.weight -> x.gamma", "    a.weight [4, 3] -> [3, 4]",
                 "    a.weight F32 -> F16", "  ignored (1):"]:
        assert line in text.splitlines()


def test_unknown_adapter_name():
    with pytest.raises(ValueError, match="unknown adapter 'tf'; use 'pytorch', None, or a ModuleAdapter"):
        apply_record(Net(), {}, adapter="tf")
