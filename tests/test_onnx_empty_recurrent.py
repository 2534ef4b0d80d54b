"""An empty batch into an imported ``LSTM`` / ``GRU`` (fresh6 F5): ONNX Runtime's CPU kernels end
the whole process on it (``std::terminate``, exit 134) in plain ONNX Runtime too, so ``module(x)``
and ``grad`` refuse it with a ``CallArgumentError`` naming the input and the node, before the run.

Everything runs in a child Python (a regression would kill it, not the test session). Oracles:
plain ONNX Runtime on the same file in that child (the same feeds give each valid call's output;
an empty batch is shown to end a child process: the reason for the refusal), and the
process's own exit status.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnx.helper as h
import pytest
from onnx import TensorProto, numpy_helper

H, I = 3, 4


def recurrent_model(path, op: str, batch_first: bool):
    """One ``op`` node (``LSTM`` / ``GRU`` / ``RNN``, layout 0); ``batch_first``: the input is
    ``[batch, seq, input]``, transposed to ``X`` by a ``Transpose`` node first."""
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(1, gates * H, I)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(size=(1, gates * H, H)).astype(np.float32), "R")]
    nodes = []
    x = "x"
    if batch_first:
        nodes.append(h.make_node("Transpose", ["x"], ["xt"], name="to_seq_first", perm=[1, 0, 2]))
        x = "xt"
    nodes.append(h.make_node(op, [x, "W", "R"], ["y"], name=f"the_{op.lower()}", hidden_size=H))
    dims = ["batch", "seq", I] if batch_first else ["seq", "batch", I]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 14)], ir_version=8), path)
    return path


CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, onnxruntime as ort, onnxparam as op
    from onnxparam.autodiff import grad
    for path, shape in json.loads(sys.argv[1]):
        module = op.import_onnx(path)
        x = np.random.default_rng(1).normal(size=tuple(shape)).astype(np.float32)
        out = {}
        try:
            out["module"] = np.asarray(module(op.Tensor.from_numpy(x)).to_numpy()).tolist()
        except op.OnnxParamError as e:
            out["module_error"] = [type(e).__name__, str(e)]
        try:
            grad(lambda m, x: (m(x) ** 2).mean(), module, op.Tensor.from_numpy(x))
            out["grad"] = "ran"
        except op.OnnxParamError as e:
            out["grad_error"] = [type(e).__name__, str(e)]
        if "module_error" not in out:  # only a call the library runs: the oracle, plain ONNX Runtime
            sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            out["ort"] = sess.run(None, {"x": x})[0].tolist()
        print(json.dumps(out), flush=True)
""")

REFUSED = [  # (op, batch_first, shape, what the message says of the dim)
    ("LSTM", False, (5, 0, I), r"a batch of 0 \(dim 1 of X"),
    ("GRU", False, (0, 2, I), r"a sequence of 0 \(dim 0 of X"),
    ("LSTM", True, (0, 5, I), r"a 0-sized dim 0, which reaches its X"),
]
RUN = [  # (op, batch_first, shape)
    ("LSTM", False, (3, 2, I)), ("GRU", True, (2, 3, I)),
    ("LSTM", False, (0, 2, I)),  # an empty sequence: ONNX Runtime's LSTM returns an empty output
    ("RNN", False, (2, 0, I)),  # RNN takes an empty batch
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case in one child Python: ``(exit status, [per-case dict])``."""
    folder = tmp_path_factory.mktemp("recurrent")
    cases = []
    for k, (op, batch_first, shape, *_) in enumerate(REFUSED + RUN):
        cases.append([str(recurrent_model(folder / f"r{k}.onnx", op, batch_first)), list(shape)])
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    outs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, outs, proc.stderr[-2000:]


@pytest.mark.parametrize("k", range(len(REFUSED)))
def test_an_empty_batch_into_an_lstm_or_gru_is_refused_and_the_process_lives(results, k):
    rc, outs, stderr = results
    assert rc == 0 and len(outs) == len(REFUSED + RUN), stderr
    op, _, shape, dim_text = REFUSED[k]
    for key in ("module_error", "grad_error"):
        kind, message = outs[k][key]
        assert kind == "CallArgumentError", outs[k]
        assert f"graph input 'x' of shape {list(shape)} gives {op} node 'the_{op.lower()}' " in message
        assert re.search(dim_text, message), message
        assert "ends the whole process" in message and f"r{k}.onnx" in message


@pytest.mark.parametrize("k", range(len(RUN)))
def test_calls_onnx_runtime_survives_still_run_and_equal_plain_onnx_runtime(results, k):
    rc, outs, stderr = results
    assert rc == 0 and len(outs) == len(REFUSED + RUN), stderr
    out = outs[len(REFUSED) + k]
    assert "module" in out, out
    got, want = np.asarray(out["module"], np.float32), np.asarray(out["ort"], np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_plain_onnx_runtime_ends_the_process_on_an_empty_lstm_batch(tmp_path):
    """The reason for the refusal (if a later ONNX Runtime fixes it, the refusal can go)."""
    path = recurrent_model(tmp_path / "r.onnx", "LSTM", False)
    code = ("import sys, numpy as np, onnxruntime as ort; s = ort.InferenceSession(sys.argv[1], "
            "providers=['CPUExecutionProvider']); s.run(None, {'x': np.zeros((5, 0, 4), np.float32)}); print('ran')")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        pytest.skip("this ONNX Runtime survives an empty LSTM batch: the refusal in onnx_io/_empty_batch.py can go")
    assert "ran" not in proc.stdout
