"""``onnxparam inspect`` refuses a writer's scratch entry and reads an inline ``.onnx`` without
parsing its tensors' bytes.

Oracles: a real unfinished atomic save (its scratch file exists while the block runs), the
``onnx`` package's reading of the same file, and the byte counts handed to protobuf's parser
(counted by wrapping ``onnx.ModelProto``'s parse methods).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxparam import OnnxParamError
from onnxparam.cli import inspect_file, main
from onnxparam.formats._scratch import atomic_output


def _inline_model(path, weights: int = 4, side: int = 256) -> None:
    """``weights`` float32 [side, side] initializers inside the protobuf (about 1 MB together for
    the default), each used by a MatMul."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(side, side)).astype(np.float32), f"layer{i}.weight")
             for i in range(weights)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"layer{i}.weight"], [f"h{i}"], name=f"mm{i}")
             for i in range(weights)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", side])],
                              [helper.make_tensor_value_info(f"h{weights - 1}", TensorProto.FLOAT, ["n", side])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_inspect_refuses_the_scratch_file_of_an_unfinished_save(tmp_path, capsys):
    target = tmp_path / "m.onnx"
    _inline_model(target)
    with atomic_output(target) as handle:
        handle.write(target.read_bytes())
        handle.flush()
        scratch = [tmp_path / n for n in os.listdir(tmp_path) if n != "m.onnx"]
        assert len(scratch) == 1 and scratch[0].name.startswith(".m.onnx.")
        with pytest.raises(OnnxParamError, match="scratch file of an unfinished save of") as info:
            inspect_file(scratch[0])
        assert str(target) in str(info.value)
        assert main(["inspect", str(scratch[0]), "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert "unfinished save" in doc["error"] and doc["exit_code"] == 1


def test_inspect_refuses_a_file_inside_a_scratch_folder(tmp_path):
    folder = tmp_path / f".model.onnx.{os.getpid()}-0123456789ab.tmp"  # a writer's scratch folder's name
    folder.mkdir()
    _inline_model(folder / "model.onnx")
    assert onnx.load(folder / "model.onnx").graph.initializer  # a readable model, all the same
    with pytest.raises(OnnxParamError, match="is inside the scratch folder of an unfinished save of"):
        inspect_file(folder / "model.onnx")


def test_inspect_of_an_inline_model_parses_only_its_structure(tmp_path, monkeypatch):
    path = tmp_path / "inline.onnx"
    _inline_model(path)
    expected = {i.name: list(i.dims) for i in onnx.load(path).graph.initializer}
    weight_bytes = sum(int(np.prod(d)) * 4 for d in expected.values())
    parsed: list = []
    parse, from_string = onnx.ModelProto.ParseFromString, onnx.ModelProto.FromString

    def counting_parse(self, data):
        parsed.append(len(data))
        return parse(self, data)

    def counting_from_string(data):
        parsed.append(len(data))
        return from_string(data)

    monkeypatch.setattr(onnx.ModelProto, "ParseFromString", counting_parse)
    monkeypatch.setattr(onnx.ModelProto, "FromString", staticmethod(counting_from_string))
    doc = inspect_file(path)
    assert {t["name"]: t["shape"] for t in doc["tensors"]} == expected
    assert doc["totals"]["nan"] == 0 and doc["totals"]["bytes"] == weight_bytes
    # protobuf parsed the structure only: never a message holding the weights' bytes
    assert parsed and max(parsed) < weight_bytes // 20
