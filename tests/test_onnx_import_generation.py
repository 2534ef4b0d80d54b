"""Generation models with ONNX Runtime's contrib ``GreedySearch`` / ``BeamSearch``
(``com.microsoft``): a GPT-2-like ``decoder`` graph attribute holding the weights. Imported,
called, given new weights and exported, they compute as plain ONNX Runtime on the file.

ONNX has no schema for these operators; ONNX Runtime checks the decoder's signature (inputs
``input_ids``, ``position_ids``, ``attention_mask``, ``past_<i>`` of shape
``(2, batch, num_heads, past, head_size)``; outputs ``logits``, ``present_<i>``; ``model_type=0``
is GPT-2). The decoder here is tiny: one layer, one head, an embedding and a logits matrix.

Oracles: plain ONNX Runtime on the original file, and on a file built with the new weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.convert import load_safetensors, save_safetensors

ort = pytest.importorskip("onnxruntime")

VOCAB, HIDDEN = 6, 4  # hidden = num_heads (1) * head_size (4)
EOS, PAD = 5, 0


def _decoder(seed: int) -> onnx.GraphProto:
    """logits = (E[ids] + mean(present)) @ W + head.bias; present = past ++ (E[ids], E[ids]) on the
    seq axis."""
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(VOCAB, HIDDEN)).astype(np.float32)
    head = rng.normal(size=(HIDDEN, VOCAB)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["emb.weight", "input_ids"], ["hid"]),  # (B, S, D)
        helper.make_node("Unsqueeze", ["hid", "axes_0_2"], ["kv1"]),  # (1, B, 1, S, D)
        helper.make_node("Concat", ["kv1", "kv1"], ["kv"], axis=0),  # (2, B, 1, S, D)
        helper.make_node("Concat", ["past_0", "kv"], ["present_0"], axis=3),  # (2, B, 1, P + S, D)
        helper.make_node("ReduceMean", ["present_0", "axes_0_2_3"], ["ctx"], keepdims=0),  # (B, D)
        helper.make_node("Unsqueeze", ["ctx", "axes_1"], ["ctx3"]),  # (B, 1, D)
        helper.make_node("Add", ["hid", "ctx3"], ["mix"]),
        helper.make_node("MatMul", ["mix", "head.weight"], ["scores"]),
        helper.make_node("Add", ["scores", "head.bias"], ["logits"]),  # (B, S, V)
    ]
    inits = [numpy_helper.from_array(emb, "emb.weight"), numpy_helper.from_array(head, "head.weight"),
             numpy_helper.from_array(np.array([0, 2], np.int64), "axes_0_2"),
             numpy_helper.from_array(np.array([0, 2, 3], np.int64), "axes_0_2_3"),
             numpy_helper.from_array(np.array([1], np.int64), "axes_1"),
             # NOTE: the pad and EOS tokens never win, so no sequence ends early: ONNX Runtime
             # leaves the positions after an early end unwritten (their values vary run to run)
             numpy_helper.from_array(np.where(np.isin(np.arange(VOCAB), [PAD, EOS]), -1e4, 0).astype(np.float32),
                                     "head.bias")]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT32, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT32, ["batch", "total"]),
              helper.make_tensor_value_info("past_0", TensorProto.FLOAT, [2, "batch", 1, "past", HIDDEN])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB]),
               helper.make_tensor_value_info("present_0", TensorProto.FLOAT, [2, "batch", 1, "total", HIDDEN])]
    return helper.make_graph(nodes, "decoder", inputs, outputs, inits)


def _i32(name, dims):
    return helper.make_tensor_value_info(name, TensorProto.INT32, dims)


def _f32(name, dims):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _model(op_type: str, seed: int) -> onnx.ModelProto:
    if op_type == "GreedySearch":
        inputs = [_i32("input_ids", ["batch", "seq"]), _i32("max_length", [1]), _i32("min_length", [1]),
                  _f32("repetition_penalty", [1])]
        outputs = [_i32("sequences", ["batch", "len"])]
    else:
        inputs = [_i32("input_ids", ["batch", "seq"]), _i32("max_length", [1]), _i32("min_length", [1]),
                  _i32("num_beams", [1]), _i32("num_return_sequences", [1]), _f32("length_penalty", [1]),
                  _f32("repetition_penalty", [1])]
        outputs = [_i32("sequences", ["batch", "n", "len"]), _f32("sequences_scores", ["batch", "n"])]
    node = helper.make_node(op_type, [v.name for v in inputs], [v.name for v in outputs], domain="com.microsoft",
                            decoder=_decoder(seed), eos_token_id=EOS, pad_token_id=PAD, model_type=0)
    graph = helper.make_graph([node], op_type.lower(), inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _feeds(op_type: str) -> dict:
    feeds = {"input_ids": np.array([[1, 2], [3, 4]], np.int32), "max_length": np.array([7], np.int32),
             "min_length": np.array([1], np.int32)}
    if op_type == "BeamSearch":
        feeds.update(num_beams=np.array([3], np.int32), num_return_sequences=np.array([2], np.int32),
                     length_penalty=np.array([1.0], np.float32))
    feeds["repetition_penalty"] = np.array([1.0], np.float32)
    return feeds


def _plain(model, feeds):
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = g.to_numpy() if isinstance(g, op.Tensor) else g
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("op_type", ["GreedySearch", "BeamSearch"])
def test_a_generation_model_with_a_decoder_subgraph_imports_runs_takes_new_weights_and_exports(op_type, tmp_path):
    model, other = _model(op_type, seed=0), _model(op_type, seed=1)
    feeds = _feeds(op_type)
    want = _plain(model, feeds)
    assert not np.array_equal(want[0], _plain(other, feeds)[0])  # the weights decide the tokens

    module = op.import_onnx(model)
    assert sorted(p for p, _ in module.named_params()) == ["emb.weight", "head.bias", "head.weight"]  # the decoder's weights
    _assert_same(module(**feeds), want)
    exported = op.export_onnx(module, tmp_path / "exported.onnx")
    _assert_same(tuple(_plain(exported, feeds)), want)

    # the other model's weights, through a safetensors file, into the first model's graph
    save_safetensors(op.import_onnx(other), tmp_path / "other.safetensors")
    loaded = load_safetensors(op.import_onnx(model), tmp_path / "other.safetensors")
    want_other = _plain(other, feeds)
    _assert_same(loaded(**feeds), want_other)
    _assert_same(tuple(_plain(op.export_onnx(loaded, tmp_path / "loaded.onnx"), feeds)), want_other)


def test_greedy_search_inside_a_traced_forward_computes_as_plain_onnx_runtime():
    model = _model("GreedySearch", seed=0)
    feeds = _feeds("GreedySearch")

    class Shifted(op.Module):
        onnx_opset_imports = {"": 18, "com.microsoft": 1}

        def __init__(self, search):
            self.search = search

        def forward(self, ids, max_length, min_length, penalty):
            return self.search(ids, max_length, min_length, penalty) + np.int32(100)

    got = Shifted(op.import_onnx(model))(*(op.Tensor.from_numpy(v) for v in feeds.values()))
    np.testing.assert_array_equal(got.to_numpy(), _plain(model, feeds)[0] + 100)
