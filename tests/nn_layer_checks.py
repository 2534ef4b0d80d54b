"""Checks shared by the tests of the wider layer set (``test_nn_conv_transpose.py``,
``test_nn_norm_extra.py``, ``test_nn_activation_ext.py``, ``test_nn_loss.py``).

Not a test module: helpers only. The oracle of :func:`assert_export_runs_in_plain_ort` is a
plain ``onnxruntime.InferenceSession`` on the exported file (this library's session cache and
runners play no part in it).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import onnxparam as op
from onnxparam import Tensor


def tensor(a) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a))


def assert_export_runs_in_plain_ort(module, x: np.ndarray, tmp_path, rtol=1e-5, atol=1e-6, name="layer"):
    """``export_onnx(module)`` run by a fresh plain ORT session equals ``module(x)``."""
    path = tmp_path / f"{name}.onnx"
    op.export_onnx(module, path, tensor(x))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    want = module(tensor(x)).to_numpy()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    return got


def param_table(module) -> dict:
    """``path -> shape`` of every param, in traversal order."""
    return {path: tuple(p.lazy_shape()) for path, p in module.named_params()}
