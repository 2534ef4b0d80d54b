"""The default ``LoraConfig`` on an imported graph adapts linear maps and the embedding of the
tokens fed, not tables ``Gather`` reads at rows computed in the graph (GPT-2's / BERT's position
table, indices ``Range(0, Shape(ids)[1])``): PEFT's defaults target linear layers, embeddings
only when asked. A param_group that names the position table still adapts it.

Oracles: which tensors the graph reads with indices from the model inputs (written by the test),
and numpy on the matrices the test writes: ``(wte[ids] + (wpe + scale * a @ b)[pos]) @ w``.
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam import LoraConfig, Param, ParamGroup, Tensor, import_onnx

VOCAB, POSITIONS, DIM, OUT, SEQ = 11, 8, 4, 3, 5


def gpt2_like_embeddings(wte, wpe, w):
    """``y = (wte[ids] + wpe[range(seq)]) @ w``; the positions come from ``Shape(ids)``, as
    torch's GPT-2 export makes them when ``position_ids`` is not given."""
    init = [numpy_helper.from_array(wte, "wte"), numpy_helper.from_array(wpe, "wpe"), numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array([1], np.int64), "one_idx"),
            numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")]
    nodes = [
        helper.make_node("Gather", ["wte", "ids"], ["tok"], name="tok_gather"),
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one_idx"], ["seq1"]),
        helper.make_node("Squeeze", ["seq1"], ["seq"]),
        helper.make_node("Range", ["zero", "seq", "one"], ["pos"]),
        helper.make_node("Gather", ["wpe", "pos"], ["posemb"], name="pos_gather"),
        helper.make_node("Add", ["tok", "posemb"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, SEQ])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, OUT])], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def case():
    rng = np.random.default_rng(5)
    wte = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
    wpe = rng.normal(size=(POSITIONS, DIM)).astype(np.float32)
    w = rng.normal(size=(DIM, OUT)).astype(np.float32)
    ids = rng.integers(0, VOCAB, size=(1, SEQ)).astype(np.int64)
    return wte, wpe, w, ids


def adapted_paths(module):
    return sorted(p for p, q in module.named_params() if q.adapter() is not None)


def test_the_default_config_adapts_the_token_table_and_the_matmul_but_not_the_position_table(case):
    wte, wpe, w, _ = case
    imported = import_onnx(gpt2_like_embeddings(wte, wpe, w))
    assert adapted_paths(imported.apply_lora(LoraConfig(rank=2, alpha=4))) == ["w", "wte"]
    assert set(imported.lora_default_skips()) == {"wpe"}
    assert "pos_gather" in imported.lora_default_skips()["wpe"]


def test_quantization_reads_the_same_evidence_for_the_position_table(case):
    from onnxparam.quant._roles import graph_roles

    wte, wpe, w, _ = case
    imported = import_onnx(gpt2_like_embeddings(wte, wpe, w))
    roles = graph_roles(imported.ir_model.graph, imported.onnx_names)
    assert set(roles) == {"wpe"} and "read by position" in roles["wpe"]


def test_a_group_naming_the_position_table_adapts_it_and_equals_numpy(case):
    wte, wpe, w, ids = case
    imported = import_onnx(gpt2_like_embeddings(wte, wpe, w))
    adapted = imported.apply_lora(LoraConfig(rank=2, alpha=4, param_group=ParamGroup.from_regex("^wpe$")))
    assert adapted_paths(adapted) == ["wpe"]
    rng = np.random.default_rng(9)

    def fill(path, param):
        if path.endswith(".lora.b"):
            value = rng.normal(size=param.lazy_shape()).astype(np.float32)
            return Param(param.id, value=Tensor.from_numpy(value), require_grad=param.require_grad)
        return param

    adapted = adapted.map(fill)
    v = {p: q.val().to_numpy() for p, q in adapted.named_params()}
    table = wpe + 2.0 * v["wpe.lora.a"] @ v["wpe.lora.b"]  # scale = alpha / rank = 2
    expected = (wte[ids] + table[np.arange(SEQ)][None]) @ w
    np.testing.assert_allclose(adapted(Tensor.from_numpy(ids)).to_numpy(), expected, atol=1e-5)


def test_position_ids_fed_as_a_model_input_make_the_table_an_embedding(case):
    wte, wpe, w, _ = case
    model = gpt2_like_embeddings(wte, wpe, w)
    graph = model.graph
    for node in list(graph.node):
        if node.output[0] in ("shape", "seq1", "seq", "pos"):
            graph.node.remove(node)
    graph.input.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [SEQ]))
    assert adapted_paths(import_onnx(model).apply_lora(LoraConfig(rank=2, alpha=4))) == ["w", "wpe", "wte"]


def test_nothing_adapted_names_the_position_table_left_out_by_default():
    rng = np.random.default_rng(0)
    wpe = numpy_helper.from_array(rng.normal(size=(POSITIONS, DIM)).astype(np.float32), "wpe")
    pos = numpy_helper.from_array(np.arange(SEQ, dtype=np.int64), "pos")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["wpe", "pos"], ["p"]), helper.make_node("Add", ["x", "p"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SEQ, DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SEQ, DIM])], [wpe, pos])
    imported = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(op.LoraError, match=r"left out by the default param_group.*'wpe' \(8, 4\): a table read by "
                                           r"position"):
        imported.apply_lora(LoraConfig(rank=2, alpha=4))
