"""formats.pytorch: torch.save files read without torch, checked against torch or arange formulas."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from onnxparam.core.errors import RecordError
from onnxparam.formats import PytorchCheckpoint, pytorch_record, read_pytorch

DATA = Path(__file__).parent / "data" / "pytorch"
STATE_DICT_FILES = ["state_dict_zip.pt", "state_dict_legacy.pt", "state_dict_big_endian.pt"]


def expected_state_dict() -> dict[str, np.ndarray]:
    """The formulas of tests/data/pytorch/README.md, in numpy."""
    emb = np.arange(10, dtype=np.float16).reshape(5, 2)
    out = {
        "fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 4,
        "fc.bias": np.arange(3, dtype=np.float32) - 1,
        "emb.weight": emb,
        "head.weight": emb,
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
        "mask": np.arange(6) % 2 == 0,
        "half_steps": (np.arange(4) * 0.5).astype(ml_dtypes.bfloat16),
        "transposed": np.arange(6, dtype=np.int32).reshape(2, 3).T,
        "strided": np.arange(10, dtype=np.int16)[2:8:2],
        "wide": np.broadcast_to(np.arange(3, dtype=np.float64), (2, 3)),
    }
    for i in (0, 2, 5):
        out[f"layers.{i}.w"] = np.full((2,), i, dtype=np.int8)
    return out


def assert_same_tensors(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(want).tobytes(), name


# -- committed files, no torch ---------------------------------------------------------------


@pytest.mark.parametrize("file", STATE_DICT_FILES)
def test_committed_state_dict_holds_the_arange_formulas(file):
    ck = read_pytorch(DATA / file)
    assert_same_tensors(ck.tensors, expected_state_dict())
    assert ck.skipped == [] and ck.excluded == [] and ck.shared == []


def test_big_endian_byteorder_record_is_reported_and_values_come_back_native():
    ck = read_pytorch(DATA / "state_dict_big_endian.pt")
    assert ck.byteorder == "big"
    assert ck.tensors["fc.weight"].dtype.isnative and ck.tensors["fc.weight"][1, 2] == 1.5


@pytest.mark.parametrize("file", STATE_DICT_FILES)
def test_tied_weights_are_one_array_under_both_names(file):
    ck = read_pytorch(DATA / file)
    assert ck.tied == [("emb.weight", "head.weight")]
    assert ck.tensors["emb.weight"] is ck.tensors["head.weight"]


def test_arrays_are_read_only():
    ck = read_pytorch(DATA / "state_dict_zip.pt")
    for name, array in ck.tensors.items():
        with pytest.raises(ValueError):
            array[...] = 0
        assert array.flags.c_contiguous, name


def test_checkpoint_dict_reports_epoch_and_optimizer_hyperparameters_as_skipped():
    ck = read_pytorch(DATA / "checkpoint_zip.pt")
    assert ck.skipped == ["epoch", "optimizer"]
    expected = {f"model.{k}": v for k, v in expected_state_dict().items()}
    assert_same_tensors(ck.tensors, expected)


def test_top_level_key_selects_the_state_dict():
    ck = read_pytorch(DATA / "checkpoint_zip.pt", top_level_key="model")
    assert_same_tensors(ck.tensors, expected_state_dict())
    assert ck.skipped == []


def test_missing_top_level_key_names_the_keys_the_file_has():
    with pytest.raises(RecordError, match=r"top_level_key 'state_dict' not found.*\['epoch', 'model', 'optimizer'\]"):
        read_pytorch(DATA / "checkpoint_zip.pt", top_level_key="state_dict")


def test_key_remap_rules_apply_in_order_each_seeing_the_previous_output():
    rules = [(r"^fc\.", "linear."), (r"^linear\.(weight|bias)$", r"proj.\1"), (r"^layers\.(\d+)\.w$", r"blocks.\1")]
    ck = read_pytorch(DATA / "state_dict_zip.pt", key_remap=rules)
    assert list(ck.tensors)[:2] == ["proj.weight", "proj.bias"]
    assert [n for n in ck.tensors if n.startswith("blocks.")] == ["blocks.0", "blocks.2", "blocks.5"]
    assert ck.tensors["proj.bias"].tolist() == [-1.0, 0.0, 1.0]


def test_key_remap_collisions_name_both_sources():
    with pytest.raises(RecordError, match=r"'fc.weight' and 'fc.bias' both become 'fc'"):
        read_pytorch(DATA / "state_dict_zip.pt", key_remap=[(r"\.(weight|bias)$", "")])


def test_invalid_regex_is_a_record_error_naming_the_pattern():
    with pytest.raises(RecordError, match=r"key_remap regex '\(' is invalid"):
        read_pytorch(DATA / "state_dict_zip.pt", key_remap=[("(", "")])


def test_renumber_makes_gappy_indices_contiguous():
    ck = read_pytorch(DATA / "state_dict_zip.pt", renumber=True)
    layers = {n: a.tolist() for n, a in ck.tensors.items() if n.startswith("layers.")}
    assert layers == {"layers.0.w": [0, 0], "layers.1.w": [2, 2], "layers.2.w": [5, 5]}


def test_include_loads_only_matching_names_and_lists_the_rest():
    ck = read_pytorch(DATA / "state_dict_legacy.pt", include=[r"^fc\.", r"^layers\.[25]\."], renumber=True)
    assert list(ck.tensors) == ["fc.weight", "fc.bias", "layers.0.w", "layers.1.w"]
    assert ck.tensors["layers.1.w"].tolist() == [5, 5]
    assert "emb.weight" in ck.excluded and "layers.0.w" in ck.excluded and len(ck.excluded) == 9


def test_pytorch_record_drops_num_batches_tracked_and_keeps_ties():
    record = pytorch_record(read_pytorch(DATA / "state_dict_zip.pt"))
    assert "bn.num_batches_tracked" not in record and "fc.weight" in record
    assert record["emb.weight"] is record["head.weight"]
    assert "bn.num_batches_tracked" in pytorch_record(read_pytorch(DATA / "state_dict_zip.pt"), drop=None)


def test_result_type_is_a_frozen_dataclass():
    ck = read_pytorch(DATA / "state_dict_zip.pt")
    assert isinstance(ck, PytorchCheckpoint)
    with pytest.raises(AttributeError):
        ck.skipped = []


# -- files made by torch in the test ---------------------------------------------------------

ALL_DTYPES = [
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip
SAVE_MODES = {
    "zip": {},
    "legacy": {"_use_new_zipfile_serialization": False},
    "zip-pickle-protocol-5": {"pickle_protocol": 5},  # STACK_GLOBAL, FRAME, MEMOIZE opcodes
}


def torch_bytes(t) -> bytes:
    """The tensor's logical values as contiguous bytes, computed by torch."""
    torch = pytest.importorskip("torch")
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().tobytes()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy().tobytes()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.to(torch.int64).numpy().astype({2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()]).tobytes()
    return t.numpy().tobytes()


def assert_matches_torch(got: dict, saved: dict) -> None:
    assert list(got) == list(saved)
    for name, t in saved.items():
        assert got[name].shape == tuple(t.shape), name
        assert got[name].tobytes() == torch_bytes(t), name


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_every_dtype_has_torchs_bytes(tmp_path, mode):
    torch = pytest.importorskip("torch")
    base = torch.arange(-6, 6, dtype=torch.float64).reshape(3, 4) * 1.5
    saved = {name: base.to(getattr(torch, name)) if "int" not in name else base.to(torch.int64).to(getattr(torch, name)) for name in ALL_DTYPES}
    torch.save(saved, tmp_path / "d.pt", **SAVE_MODES[mode])
    ck = read_pytorch(tmp_path / "d.pt")
    assert_matches_torch(ck.tensors, saved)
    assert ck.tensors["bfloat16"].dtype == ml_dtypes.bfloat16 and ck.tensors["bool"].dtype == np.bool_


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_views_offsets_strides_and_zero_strides_are_copied_out_as_torch_sees_them(tmp_path, mode):
    torch = pytest.importorskip("torch")
    a = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    saved = {
        "whole": a,
        "slice": a[1:, 1:3, ::2],
        "transposed": a.permute(2, 0, 1),
        "narrow": a.reshape(-1).narrow(0, 7, 9),
        "expanded": torch.arange(4.0).reshape(4, 1).expand(4, 6),
        "as_strided": torch.as_strided(a, (2, 3), (7, 0), 5),
        "scalar": a[2, 3, 4],
        "empty": a[:, :0],
        "conj": torch.complex(torch.arange(3.0), torch.ones(3)).conj(),
        "neg": torch._neg_view(torch.arange(3.0)),
    }
    torch.save(saved, tmp_path / "v.pt", **SAVE_MODES[mode])
    ck = read_pytorch(tmp_path / "v.pt")
    assert_matches_torch(ck.tensors, saved)
    assert ck.shared == [("as_strided", "empty", "narrow", "scalar", "slice", "transposed", "whole")]


def test_tied_module_weights_stay_tied_and_views_of_one_storage_are_reported(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    model["head"].weight = model["emb"].weight
    fused = torch.arange(12.0).reshape(3, 4)
    torch.save({**model.state_dict(), "q": fused[0], "k": fused[1]}, tmp_path / "t.pt")
    ck = read_pytorch(tmp_path / "t.pt")
    assert ck.tied == [("emb.weight", "head.weight")]
    assert ck.tensors["emb.weight"] is ck.tensors["head.weight"]
    assert ck.shared == [("k", "q")]
    assert ck.tensors["k"].tolist() == [4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_parameters_and_nested_dicts_become_dotted_names(tmp_path, mode):
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.arange(4.0))
    saved = {"outer": {"inner": {"p": p}, "list": [torch.ones(2), "text"]}, "n": None}
    torch.save(saved, tmp_path / "n.pt", **SAVE_MODES[mode])
    ck = read_pytorch(tmp_path / "n.pt")
    assert list(ck.tensors) == ["outer.inner.p", "outer.list.0"]
    assert ck.tensors["outer.inner.p"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ck.skipped == ["outer.list.1", "n"]


def test_training_checkpoint_keeps_model_and_optimizer_tensors_and_skips_the_rest(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.save({"epoch": 7, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    ck = read_pytorch(tmp_path / "c.pt", key_remap=[(r"^model\.", "")])
    assert "epoch" in ck.skipped and "optimizer.param_groups" in ck.skipped
    assert ck.tensors["0.weight"].tobytes() == model[0].weight.detach().numpy().tobytes()
    assert ck.tensors["1.num_batches_tracked"].tolist() == 1
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    assert ck.tensors["optimizer.state.0.exp_avg"].tobytes() == exp_avg.numpy().tobytes()
    only_model = read_pytorch(tmp_path / "c.pt", top_level_key="model")
    assert list(only_model.tensors) == list(model.state_dict())


def test_any_inner_archive_folder_name_is_accepted(tmp_path):
    torch = pytest.importorskip("torch")
    import zipfile

    torch.save({"w": torch.arange(3.0)}, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as src, zipfile.ZipFile(tmp_path / "b.pt", "w") as dst:
        for info in src.infolist():
            dst.writestr("my_model/" + info.filename.split("/", 1)[1], src.read(info.filename))
    assert read_pytorch(tmp_path / "b.pt").tensors["w"].tolist() == [0.0, 1.0, 2.0]


def test_a_whole_pickled_module_is_refused_naming_its_class(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "m.pt")
    with pytest.raises(RecordError, match=r"m\.pt: refused .*global 'torch\.nn\.modules\.linear\.Linear' is not allowed"):
        read_pytorch(tmp_path / "m.pt")


def test_storage_class_and_dtype_tables_match_torch_entry_by_entry():
    torch = pytest.importorskip("torch")
    from onnxparam.formats._torch_pickle import STORAGE_DTYPES, TORCH_DTYPES

    for torch_dtype, storage_name in torch.storage._dtype_to_storage_type_map().items():
        if storage_name.startswith(("QInt", "QUInt")):
            assert storage_name not in STORAGE_DTYPES  # quantized storages are refused
            continue
        assert STORAGE_DTYPES[storage_name] == TORCH_DTYPES[str(torch_dtype).removeprefix("torch.")], storage_name
    for name, np_dtype in TORCH_DTYPES.items():
        assert getattr(torch, name).itemsize == np_dtype.itemsize, name
        assert getattr(torch, name).is_floating_point == (np_dtype.kind == "f" or "float" in str(np_dtype)), name


def test_excluded_tensors_storages_are_never_read(tmp_path):
    torch = pytest.importorskip("torch")
    import zipfile

    torch.save({"keep": torch.arange(3.0), "drop": torch.ones(2)}, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as src, zipfile.ZipFile(tmp_path / "b.pt", "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("/data/1"):  # the storage of "drop"
                dst.writestr(info.filename, src.read(info.filename))
    ck = read_pytorch(tmp_path / "b.pt", include=r"^keep$")
    assert ck.tensors["keep"].tolist() == [0.0, 1.0, 2.0] and ck.excluded == ["drop"]
    with pytest.raises(RecordError, match=r"b\.pt: storage '1' has no record 'a/data/1' in the zip"):
        read_pytorch(tmp_path / "b.pt")


def test_a_torch_state_dict_loads_into_the_onnxparam_module_and_gives_torchs_outputs(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    import onnxparam as op
    from onnxparam import nn

    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    torch.save(linear.state_dict(), tmp_path / "lin.pt")
    record = pytorch_record(read_pytorch(tmp_path / "lin.pt"))
    # NOTE: PyTorch's Linear stores (out, in), Burn's (in, out): the PyTorch adapter's job, done by hand here.
    module = nn.Linear(4, 3).load_record({"weight": record["weight"].T.copy(), "bias": record["bias"]})
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 7
    expected = linear(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(module(op.Tensor.from_numpy(x)).to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_key_remap_accepts_a_remapper_object_with_apply():
    class Prefix:
        def apply(self, name: str) -> str:
            return "model." + name

    ck = read_pytorch(DATA / "state_dict_zip.pt", key_remap=Prefix(), include=r"^model\.fc\.")
    assert list(ck.tensors) == ["model.fc.weight", "model.fc.bias"]
