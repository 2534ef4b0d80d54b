"""The default ``LoraConfig`` on an imported graph adapts linear maps only, not tables ``Gather``
reads: neither at rows computed in the graph (GPT-2's / BERT's position table, indices
``Range(0, Shape(ids)[1])``) nor the embedding of the tokens fed: PEFT's defaults target linear
layers, embeddings only when asked. A param_group that names a table still adapts it.

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


def test_the_default_config_adapts_the_matmul_but_neither_the_token_nor_the_position_table(case):
    wte, wpe, w, _ = case
    imported = import_onnx(gpt2_like_embeddings(wte, wpe, w))
    assert adapted_paths(imported.apply_lora(LoraConfig(rank=2, alpha=4))) == ["w"]
    skips = imported.lora_default_skips()
    assert set(skips) == {"wpe", "wte"}
    assert "pos_gather" in skips["wpe"] and "read by position" in skips["wpe"]
    assert "tok_gather" in skips["wte"] and "embedding table of the model inputs" in skips["wte"]
    named = imported.apply_lora(LoraConfig(rank=2, alpha=4, param_group=ParamGroup.from_regex("^(wte|w)$")))
    assert adapted_paths(named) == ["w", "wte"]


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
    imported = import_onnx(model)
    assert adapted_paths(imported.apply_lora(LoraConfig(rank=2, alpha=4))) == ["w"]
    assert "embedding table of the model inputs" in imported.lora_default_skips()["wpe"]


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


def tied_head_model(wte, w, head, head_name="onnx::MatMul_9"):
    """``logits = (wte[ids] @ w) @ head``: ``head`` stored as a separate constant, as torch's
    TorchScript exporter leaves a tied ``lm_head`` (``wte`` transposed, folded, renamed
    ``onnx::MatMul_N``)."""
    init = [numpy_helper.from_array(wte, "wte"), numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(head, head_name)]
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["tok"], name="/wte/Gather"),
             helper.make_node("MatMul", ["tok", "w"], ["h"], name="/mlp/MatMul"),
             helper.make_node("MatMul", ["h", head_name], ["logits"], name="/lm_head/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, SEQ])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, SEQ, VOCAB])], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_head_equal_to_the_embedding_transposed_is_tied_and_left_out_by_default(case):
    wte, _, _, ids = case
    w = np.random.default_rng(3).normal(size=(DIM, DIM)).astype(np.float32)
    imported = import_onnx(tied_head_model(wte, w, np.ascontiguousarray(wte.T)))
    head = imported.path_of("onnx::MatMul_9")
    adapted = imported.apply_lora(LoraConfig(rank=2, alpha=4))
    assert adapted_paths(adapted) == ["w"]
    reason = imported.lora_default_skips()[head]
    assert "tied to the embedding table 'wte'" in reason and "transposed" in reason
    named = imported.apply_lora(LoraConfig(rank=2, alpha=4, param_group=ParamGroup.from_regex("MatMul_9")))
    assert adapted_paths(named) == [head]
    # the module still computes the graph: numpy on the test's matrices
    np.testing.assert_allclose(adapted(Tensor.from_numpy(ids)).to_numpy(), (wte[ids] @ w) @ wte.T, rtol=1e-5,
                               atol=1e-5)


def test_a_head_whose_values_differ_from_the_table_is_a_linear_map_and_adapted(case):
    wte, _, _, _ = case
    w = np.random.default_rng(3).normal(size=(DIM, DIM)).astype(np.float32)
    untied = np.ascontiguousarray(wte.T).copy()
    untied[0, 0] += 1.0  # one value off: no tie, whatever the shapes say
    imported = import_onnx(tied_head_model(wte, w, untied))
    head = imported.path_of("onnx::MatMul_9")
    assert adapted_paths(imported.apply_lora(LoraConfig(rank=2, alpha=4))) == sorted([head, "w"])


def test_torchs_exporter_folds_a_tied_lm_head_and_the_default_adapts_only_the_untied_linear(tmp_path):
    torch = pytest.importorskip("torch")
    from torch_tied import export_quietly, tiny_lm

    model = tiny_lm(seed=0, vocab=VOCAB, dim=DIM)
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()  # the oracle: torch's own tie
    path = tmp_path / "lm.onnx"
    export_quietly(model, torch.zeros(1, SEQ, dtype=torch.int64), path, "torchscript")
    imported = import_onnx(path)
    values = {imported.onnx_names[p]: q.val().to_numpy() for p, q in imported.named_params()}
    torch_t = {k: v.detach().numpy().T for k, v in model.state_dict().items() if v.ndim == 2}
    # which renamed constant is which torch weight, by torch's values (the exporter folded the
    # transposes of nn.Linear's (out, in) weights: onnx::MatMul_N == weight.T)
    head = next(n for n, v in values.items() if n.startswith("onnx::") and v.shape == torch_t["lm_head.weight"].shape
                and np.array_equal(v, torch_t["lm_head.weight"]))
    mlp = next(n for n, v in values.items() if n.startswith("onnx::") and v.shape == torch_t["mlp.weight"].shape
               and np.array_equal(v, torch_t["mlp.weight"]))
    path_of = imported.path_of
    assert adapted_paths(imported.apply_lora(LoraConfig(rank=2, alpha=4))) == [path_of(mlp)]  # the untied Linear
    skips = imported.lora_default_skips()
    assert set(skips) == {path_of(head), path_of("wte.weight")}
    assert "tied to the embedding table 'wte.weight'" in skips[path_of(head)]
    assert "embedding table of the model inputs" in skips[path_of("wte.weight")]
