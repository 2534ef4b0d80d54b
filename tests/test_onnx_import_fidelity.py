"""The graph of an imported model is the model: export(import(m)) is m, and public models with
control flow and fp16 weights import, run, export, quantize and take LoRA as plain ONNX Runtime
runs them.

Oracles: the original file's own structure (nodes, names, attributes, opsets, value types,
subgraphs, functions, weights byte for byte) and plain ONNX Runtime on the original file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_cases
import onnxparam as op
from onnxparam.runtime import sessions_built

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).parent / "data" / "onnx"
REPO_MODELS = sorted(DATA.glob("*.onnx"))
BACKEND_MODELS = [c.model_path for c in onnx_cases.model_cases()]
OWN_KEYS = ("onnxparam.",)


def _graph_structure(g: onnx.GraphProto) -> dict:
    def typed(values):
        return [(v.name, v.type.SerializeToString(deterministic=True)) for v in values]

    nodes = []
    for n in g.node:
        attrs = []
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                value = _graph_structure(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                value = [_graph_structure(x) for x in a.graphs]
            elif a.type == onnx.AttributeProto.TENSOR:
                value = (a.t.data_type, list(a.t.dims), numpy_helper.to_array(a.t).tobytes())
            else:
                value = a.SerializeToString(deterministic=True)
            attrs.append((a.name, a.type, value))
        nodes.append((n.op_type, n.domain, n.name, list(n.input), list(n.output), attrs))
    return {
        "name": g.name,
        "inputs": typed(g.input),
        "outputs": typed(g.output),
        # NOTE: onnx_ir writes a value_info for every initializer (its tensor's own type and
        # shape); those say how a weight is stored and are left out
        "value_info": typed(v for v in g.value_info if v.name not in {t.name for t in g.initializer}),
        "initializers": [(t.name, t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes()) for t in g.initializer],
        "sparse_initializers": [s.SerializeToString(deterministic=True) for s in g.sparse_initializer],
        "nodes": nodes,
    }


def structure(model: onnx.ModelProto) -> dict:
    """Everything of a model an export must keep, weights' bytes included (their storage and
    onnxparam's own metadata entries excluded)."""
    return {
        "ir_version": model.ir_version,
        "opsets": sorted((o.domain, o.version) for o in model.opset_import),
        "producer": (model.producer_name, model.producer_version, model.domain, model.model_version),
        "doc": model.doc_string,
        "metadata": sorted((p.key, p.value) for p in model.metadata_props if not p.key.startswith(OWN_KEYS)),
        "functions": [f.SerializeToString(deterministic=True) for f in model.functions],
        "graph": _graph_structure(model.graph),
    }


def _assert_same_structure(path: Path, tmp_path: Path) -> None:
    exported = op.export_onnx(op.import_onnx(path), tmp_path / "exported.onnx")
    original = onnx.load(str(path))
    written = onnx.load(str(exported))
    want, got = structure(original), structure(written)
    for key in want:
        if key == "graph":
            for part in want["graph"]:
                assert got["graph"][part] == want["graph"][part], f"{path.name}: graph {part} differs"
        else:
            assert got[key] == want[key], f"{path.name}: {key} differs"


@pytest.mark.parametrize("path", REPO_MODELS, ids=[p.name for p in REPO_MODELS])
def test_every_model_the_repository_holds_exports_as_the_same_graph(path, tmp_path):
    _assert_same_structure(path, tmp_path)


@pytest.mark.parametrize("path", BACKEND_MODELS, ids=[str(p.parent.relative_to(p.parents[2])) for p in BACKEND_MODELS])
def test_every_onnx_backend_model_exports_as_the_same_graph(path, tmp_path):
    _assert_same_structure(path, tmp_path)


# -- public models with control flow and fp16 weights (silero-vad, MIT; see data/onnx/README.md) ---


def _silero_feeds(path: Path, batch: int = 1, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"input": (rng.normal(size=(batch, 512)) * 0.1).astype(np.float32),
             "state": (rng.normal(size=(2, batch, 128)) * 0.1).astype(np.float32)}
    if "sr" in [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]:
        feeds["sr"] = np.array(16000, np.int64)
    return feeds


def _plain(path, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


SILERO = [DATA / "silero_vad.onnx", DATA / "silero_vad_half.onnx"]


@pytest.mark.parametrize("path", SILERO, ids=[p.name for p in SILERO])
def test_a_public_model_with_if_bodies_holding_lstms_runs_and_exports_as_plain_onnx_runtime(path, tmp_path):
    module = op.import_onnx(path)
    for batch in (1, 3):  # new input shapes: the same session
        feeds = _silero_feeds(path, batch)
        before = sessions_built()
        got = module(**feeds)
        assert sessions_built() - before <= (1 if batch == 1 else 0)
        for g, w in zip(got, _plain(path, feeds), strict=True):
            np.testing.assert_array_equal(g.to_numpy(), w)
    exported = op.export_onnx(module, tmp_path / "vad.onnx")
    feeds = _silero_feeds(path, 2, seed=1)
    for g, w in zip(_plain(exported, feeds), _plain(path, feeds), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("path", SILERO, ids=[p.name for p in SILERO])
def test_a_quantized_public_model_exports_dequantize_linear_weights_that_compute_as_its_call(path, tmp_path):
    quantized = op.import_onnx(path).quantize_weights(op.Quantizer(op.QuantScheme(value=op.QuantValue.Q8S)))
    feeds = _silero_feeds(path)
    got = quantized(**feeds)
    exported = op.export_onnx(quantized, tmp_path / "q.onnx")
    written = onnx.load(str(exported))
    ops = [n.op_type for g in _graphs(written.graph) for n in g.node]
    assert "DequantizeLinear" in ops and "MatMulInteger" not in ops
    for g, w in zip(_plain(exported, feeds), got, strict=True):
        np.testing.assert_allclose(g, w.to_numpy(), rtol=1e-5, atol=1e-5)
    # each DequantizeLinear holds its param's int8 values and scale: it computes the param's value
    checked = 0
    for graph in _graphs(written.graph):
        inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        for node in graph.node:
            if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
                continue
            q, scale = inits[node.input[0]].astype(np.float32), inits[node.input[1]]
            assert inits[node.input[0]].dtype == np.int8 and scale.size == 1  # Q8S, per tensor
            want = quantized.param_of(node.input[0]).val().to_numpy()
            np.testing.assert_array_equal(q * scale, want)
            checked += 1
    assert checked == sum(1 for _, p in quantized.named_params() if p.dtype is op.DType.QFloat)


@pytest.mark.parametrize("path", SILERO, ids=[p.name for p in SILERO])
def test_lora_on_a_public_model_starts_as_the_original_and_its_merged_export_computes_as_its_call(path, tmp_path):
    adapted = op.import_onnx(path).apply_lora(op.LoraConfig(rank=4, alpha=8))
    assert any(p.adapter() is not None for _, p in adapted.named_params())
    feeds = _silero_feeds(path)
    want = _plain(path, feeds)
    for g, w in zip(adapted(**feeds), want, strict=True):  # b = 0: the adapter adds nothing yet
        np.testing.assert_array_equal(g.to_numpy(), w)
    exported = op.export_onnx(adapted, tmp_path / "lora.onnx")
    for g, w in zip(_plain(exported, feeds), want, strict=True):
        np.testing.assert_array_equal(g, w)


def _graphs(g):
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g)
            for sub in a.graphs:
                yield from _graphs(sub)
