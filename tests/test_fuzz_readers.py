"""Fuzzing every reader: a bad file gives an OnnxParamError, in bounded memory and time.

The mutations live in ``tools/fuzz.py`` (which runs a longer campaign); here each reader gets a
few hundred seeded cases, and each bug the fuzzer found is pinned by a test with its message.
Burnpack's own fuzz test is ``tests/test_burnpack_malformed.py``; it is not repeated here.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import TensorProto, numpy_helper
from safetensors.numpy import save_file

from onnxparam import Module, OnnxFormatError, OnnxParamError, RecordError, load_peft_adapter
from onnxparam.core.module import named_params
from onnxparam.formats import read_safetensors
from onnxparam.nn import Linear
from onnxparam.onnx_io import export_onnx, import_onnx

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("onnxparam_tools_fuzz", ROOT / "tools" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fuzz  # dataclasses look their module up there
_spec.loader.exec_module(fuzz)

MiB = 1024**2


def peak_bytes(fn) -> tuple:
    """``(exception or None, tracemalloc peak)`` of ``fn()``."""
    tracemalloc.start()
    try:
        fn()
        error = None
    except Exception as e:  # noqa: BLE001 - returned to the test
        error = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return error, peak


# -- the seeded campaign, short -----------------------------------------------------------------


@pytest.mark.parametrize("target, cases", [("onnx", 250), ("safetensors", 400), ("peft", 250)])
def test_fuzzed_inputs_raise_only_onnxparam_errors(tmp_path, target, cases):
    # NOTE: the per-case time bound only catches a reader that hangs (no timed assertions: a
    # 5 s bound failed at 5.3 s on the loaded 2-core machine under coverage)
    out = fuzz.run_target(target, cases, seed=20260901, folder=tmp_path, case_seconds=120.0)
    assert out.failures == [], out.failures
    assert out.tried == cases and out.refused > cases // 4 and out.accepted > 0


def test_mutated_exported_model_raises_only_onnx_format_errors(tmp_path):
    class Net(Module):
        def __init__(self):
            self.fc = Linear(8, 4)

        def forward(self, x):
            return self.fc(x)

    good = export_onnx(Net(), tmp_path / "net.onnx", np.zeros((2, 8), np.float32)).read_bytes()
    rng = random.Random(9)
    path = tmp_path / "case.onnx"
    refused = 0
    for _ in range(200):
        path.write_bytes(fuzz.mutate_bytes(rng, good))
        try:
            module = import_onnx(path)
            for _, param in named_params(module):
                param.val()
        except OnnxFormatError:
            refused += 1
    assert refused > 50


# -- ONNX: what the fuzzer found ----------------------------------------------------------------


def small_model() -> onnx.ModelProto:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[64] x) => (float[64] y) <float[64] w = {0}> { y = Add(x, w) }""")
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.arange(64, dtype=np.float32), "w"))
    return model


def write(tmp_path, model) -> Path:
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("dims", [2**40, 2**62])
def test_onnx_initializer_declaring_huge_dims_is_refused_at_import_without_allocating(tmp_path, dims):
    model = small_model()
    model.graph.initializer[0].dims[:] = [dims]
    path = write(tmp_path, model)
    error, peak = peak_bytes(lambda: import_onnx(path))
    assert isinstance(error, OnnxFormatError)
    assert str(error) == (f"{path}: initializer 'w' is FLOAT [{dims}], which takes {dims * 4} bytes, but its "
                          "raw_data has 256; the file is corrupt")
    assert peak < 2 * MiB


def test_onnx_initializer_with_another_type_than_its_bytes_is_refused(tmp_path):
    model = small_model()
    model.graph.initializer[0].data_type = TensorProto.FLOAT16
    with pytest.raises(OnnxFormatError, match=r"initializer 'w' is FLOAT16 \[64\], which takes 128 bytes, but its "
                                              r"raw_data has 256"):
        import_onnx(write(tmp_path, model))


def test_onnx_initializer_with_negative_dims_is_refused(tmp_path):
    model = small_model()
    model.graph.initializer[0].dims[:] = [-1]
    with pytest.raises(OnnxFormatError, match=r"initializer 'w' has negative dims \[-1\]$"):
        import_onnx(write(tmp_path, model))


def test_onnx_typed_data_shorter_than_its_dims_is_refused_at_import(tmp_path):
    model = small_model()
    model.graph.initializer[0].ClearField("raw_data")
    model.graph.initializer[0].float_data[:] = [1.0, 2.0, 3.0]
    path = write(tmp_path, model)
    with pytest.raises(OnnxFormatError, match=rf"^{path}: initializer 'w' is FLOAT \[64\] \(64 values\) but its "
                                              r"float_data holds 3; the file is corrupt$"):
        import_onnx(path)


@pytest.mark.parametrize("location", ["../outside.data", "/etc/hostname"])
def test_onnx_external_data_outside_the_model_folder_is_refused_at_import(tmp_path, location):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.data").write_bytes(bytes(256))
    model = small_model()
    init = model.graph.initializer[0]
    init.ClearField("raw_data")
    init.data_location = TensorProto.EXTERNAL
    entry = init.external_data.add()
    entry.key, entry.value = "location", location
    with pytest.raises(OnnxFormatError, match=rf"the external data location '{location}' of initializer 'w' points "
                                              r"outside the model's folder .*; external data files must sit beside"):
        import_onnx(write(folder, model))


def test_onnx_external_data_shorter_than_the_tensor_is_refused_even_with_a_short_length_key(tmp_path):
    (tmp_path / "w.data").write_bytes(bytes(8))
    model = small_model()
    init = model.graph.initializer[0]
    init.ClearField("raw_data")
    init.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.data"), ("length", "8")):
        entry = init.external_data.add()
        entry.key, entry.value = key, value
    with pytest.raises(OnnxFormatError, match=r"'w.data' is too short for initializer 'w': it needs bytes 0..256, "
                                              r"the file has 8"):
        import_onnx(write(tmp_path, model))


def test_onnx_duplicate_initializer_names_are_refused(tmp_path):
    model = small_model()
    other = numpy_helper.from_array(np.zeros(64, np.float32), "w")
    model.graph.initializer.add().CopyFrom(other)
    with pytest.raises(OnnxFormatError, match=r"two initializers are named 'w'; ONNX names are unique in a graph$"):
        import_onnx(write(tmp_path, model))


# -- safetensors: limits and what the fuzzer found ------------------------------------------------


def st_file(tmp_path, header, data: bytes = b"", header_len=None) -> Path:
    path = tmp_path / "t.safetensors"
    path.write_bytes(fuzz._st_bytes(header, data, header_len))
    return path


def refuse_st(path: Path, message: str) -> RecordError:
    with pytest.raises(RecordError, match=message) as info:
        read_safetensors(path)
    assert str(info.value).startswith(f"not a valid safetensors file '{path}': ")
    return info.value


def test_safetensors_huge_header_length_is_refused_before_allocating(tmp_path):
    path = st_file(tmp_path, {}, header_len=2**63)
    error, peak = peak_bytes(lambda: read_safetensors(path))
    assert isinstance(error, RecordError) and "header claims 9223372036854775808 bytes, over the 100000000" in str(error)
    path = st_file(tmp_path, {}, header_len=99_999_992)
    error, peak2 = peak_bytes(lambda: read_safetensors(path))
    assert isinstance(error, RecordError) and "but the file has only" in str(error)
    assert max(peak, peak2) < MiB


def test_safetensors_huge_declared_tensor_is_refused_without_allocating(tmp_path):
    path = st_file(tmp_path, {"a": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}, bytes(8))
    error, peak = peak_bytes(lambda: read_safetensors(path))
    assert isinstance(error, RecordError)
    assert str(error).endswith("the tensors end at data offset 4398046511104, but the data section has 8 bytes")
    assert peak < MiB


def test_safetensors_overlapping_offsets_are_refused(tmp_path):
    t = {"dtype": "F32", "shape": [2]}
    refuse_st(st_file(tmp_path, {"a": {**t, "data_offsets": [0, 8]}, "b": {**t, "data_offsets": [4, 12]}}, bytes(12)),
              "tensor 'b' starts at data offset 4: it overlaps the tensor before it$")


@pytest.mark.parametrize("dtype", ["F33", "f32", 5, ["F32"], {"F32": 1}, None])
def test_safetensors_bad_dtype_is_refused(tmp_path, dtype):
    path = st_file(tmp_path, {"a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    refuse_st(path, rf"tensor 'a' has dtype {repr(dtype).replace('[', '.').replace(']', '.')}, which Burn has no dtype for")


def test_safetensors_truncated_data_is_refused(tmp_path):
    path = st_file(tmp_path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    refuse_st(path, "the tensors end at data offset 16, but the data section has 8 bytes$")


def test_safetensors_duplicate_names_are_refused(tmp_path):
    t = {"dtype": "F32", "shape": [2]}
    text = '{"a":%s,"a":%s}' % (json.dumps({**t, "data_offsets": [0, 8]}), json.dumps({**t, "data_offsets": [8, 16]}))
    refuse_st(st_file(tmp_path, text, bytes(16)), "the header names 'a' twice")


def test_safetensors_deeply_nested_json_is_refused(tmp_path):
    refuse_st(st_file(tmp_path, "[" * 100_000 + "]" * 100_000), "the header nests JSON arrays or objects too deeply$")
    meta = {"__metadata__": {"onnxparam.dtypes": "[" * 100_000}}
    refuse_st(st_file(tmp_path, meta), "__metadata__ key 'onnxparam.dtypes' nests JSON too deeply$")


def test_safetensors_order_key_with_non_text_names_is_refused(tmp_path):
    header = {"__metadata__": {"onnxparam.order": '[1, "a"]'}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    refuse_st(st_file(tmp_path, header, bytes(8)), "'onnxparam.order' does not list exactly the file's tensors$")


def test_safetensors_param_id_that_is_not_an_integer_is_refused(tmp_path):
    header = {"__metadata__": {"onnxparam.param_ids": '{"a": 1.5}'}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    refuse_st(st_file(tmp_path, header, bytes(8)), r"'onnxparam.param_ids' has 1.5 for 'a', not a u64$")


def test_safetensors_nan_and_inf_payloads_are_read_bit_exactly(tmp_path):
    values = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    path = st_file(tmp_path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, values.tobytes())
    with read_safetensors(path) as f:
        assert f.tensors["a"].to_data().to_numpy().tobytes() == values.tobytes()


# -- PEFT: what the fuzzer found --------------------------------------------------------------------


class Net(Module):
    def __init__(self):
        self.proj = Linear(3, 2)

    def forward(self, x):
        return self.proj(x)


def peft_folder(tmp_path, config=None, raw_config: bytes | None = None, a=None) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    body = raw_config if raw_config is not None else json.dumps(
        {"peft_type": "LORA", "bias": "none", "r": 2, "lora_alpha": 4, **(config or {})}).encode()
    (folder / "adapter_config.json").write_bytes(body)
    save_file({"base_model.model.proj.lora_A.weight": np.ones((2, 3), np.float32) if a is None else a,
               "base_model.model.proj.lora_B.weight": np.ones((2, 2), np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("raw, message", [
    (b"{not json", r"cannot read the PEFT config .*adapter_config.json: Expecting property name"),
    (b"\xff\xfe{}", r"cannot read the PEFT config .*: 'utf-8' codec can't decode byte 0xff"),
    (b"[" * 100_000, r"cannot read the PEFT config .*: JSON nested too deeply$"),
    (b"[1]", r"adapter_config.json: a PEFT adapter_config.json holds a JSON object$"),
])
def test_peft_unreadable_config_is_a_record_error(tmp_path, raw, message):
    with pytest.raises(RecordError, match=message):
        load_peft_adapter(Net(), peft_folder(tmp_path, raw_config=raw))


def test_peft_missing_weights_file_is_a_record_error(tmp_path):
    folder = peft_folder(tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(RecordError, match=r"the PEFT adapter weights .*adapter_model.safetensors are missing; a PEFT "
                                          r"adapter folder holds adapter_config.json and adapter_model.safetensors"):
        load_peft_adapter(Net(), folder)


def test_peft_missing_config_file_is_a_record_error(tmp_path):
    folder = peft_folder(tmp_path)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(RecordError, match=r"cannot read the PEFT config .*No such file"):
        load_peft_adapter(Net(), folder)


@pytest.mark.parametrize("config, message", [
    ({"r": 0}, r"needs an integer 'r' >= 1 and a finite number 'lora_alpha' \(ValueError: a rank is an integer >= 1, found 0\)"),
    ({"r": 2.5}, r"found 2.5\)"),
    ({"r": True}, r"found True\)"),
    ({"lora_alpha": float("nan")}, r"lora_alpha is a finite number, found nan"),
    ({"rank_pattern": [1, 2]}, r"rank_pattern maps module-name regexes to values; found \[1, 2\]$"),
    ({"rank_pattern": {"(": 2}}, r"rank_pattern entry '\(': 2 is not usable \(missing \), unterminated subpattern"),
    ({"rank_pattern": {"proj": "x"}}, r"rank_pattern entry 'proj': 'x' is not usable"),
    ({"alpha_pattern": {"proj": "x"}}, r"alpha_pattern entry 'proj': 'x' is not usable"),
    ({"alpha_pattern": "proj"}, r"alpha_pattern maps module-name regexes to values; found 'proj'$"),
])
def test_peft_bad_config_values_are_record_errors_naming_the_key(tmp_path, config, message):
    with pytest.raises(RecordError, match=message):
        load_peft_adapter(Net(), peft_folder(tmp_path, config))


def test_peft_factors_of_the_wrong_shape_are_refused(tmp_path):
    from onnxparam import ShapeMismatchError

    with pytest.raises(ShapeMismatchError, match=r"PEFT module 'base_model.model.proj' -> 'proj.weight': the factors "
                                                 r"make a \(2, 5\) PyTorch weight \(in 5 -> out 2\), the param is \[3, 2\]"):
        load_peft_adapter(Net(), peft_folder(tmp_path, a=np.ones((2, 5), np.float32)))


def test_every_reader_answers_hostile_files_with_the_librarys_errors(tmp_path):
    """Each seeded hostile file is either refused with an OnnxParamError or read; nothing else
    leaves the reader (the fuzzer's hang guard is generous: this test times nothing)."""
    for name in ("onnx", "safetensors", "peft"):
        out = fuzz.run_target(name, 30, seed=3, folder=tmp_path, case_seconds=60.0)
        assert out.failures == []
        assert out.tried == 30 and out.refused > 0  # the hostile files were really tried and refused
    assert issubclass(RecordError, OnnxParamError)
