"""Shared oracle for gradient-rule tests: central finite differences of a loss computed from
plain ONNX Runtime runs of the ORIGINAL model file with one initializer entry perturbed,
against ``onnxparam.autodiff.grad`` on the imported model (its float initializers are params).

The loss is ``sum(w * y)`` over the model's first output ``y`` with fixed pseudo-random ``w``
(drawn per shape, so every output element weighs differently)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import onnxparam as op
from onnxparam.autodiff import grad


def _weights(shape, dtype):
    rng = np.random.default_rng(abs(hash(tuple(shape))) % (2 ** 32))
    return rng.uniform(-1.0, 1.0, size=shape).astype(dtype)


def ort_loss(model_bytes: bytes, feeds: dict, w: np.ndarray) -> float:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    y = session.run(None, feeds)[0]
    return float((y.astype(np.float64) * w.astype(np.float64)).sum())


def _with_initializer(model, name: str, array: np.ndarray) -> bytes:
    from onnx import numpy_helper

    copy = type(model)()
    copy.CopyFrom(model)
    for init in copy.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(array, name))
    return copy.SerializeToString()


def check_model_grads(model, feeds_list: list, *, eps: float = 1e-4, rtol: float = 1e-4, atol: float = 1e-6,
                      entries: int = 4, module=None) -> dict:
    """For each feeds dict in ``feeds_list`` (shapes may differ), ``grad`` of ``sum(w * y)``
    against central differences of the same loss on plain ORT, ``entries`` entries per param.

    Returns ``{"sessions": ..., "graphs": ...}`` counted over the calls (the training cache)."""
    from onnx import numpy_helper

    from onnxparam.autodiff import _training

    _training.clear_cache()
    data = model.SerializeToString()
    module = op.import_onnx(model) if module is None else module
    out_name = model.graph.output[0].name
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}

    names = list(feeds_list[0])

    def loss_fn(m, w, *xs):  # one function object: one training graph family
        out = m(**dict(zip(names, xs)))
        out = out[0] if isinstance(out, (tuple, list)) else out
        return (out * w).sum()

    for feeds in feeds_list:
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        y = session.run(None, feeds)[0]
        w = _weights(y.shape, y.dtype)
        loss, grads = grad(loss_fn, module, op.Tensor.from_numpy(w), *[op.Tensor.from_numpy(feeds[n]) for n in names])
        np.testing.assert_allclose(float(loss.to_numpy()), ort_loss(data, feeds, w), rtol=1e-5, atol=1e-6)
        by_path = grads.by_path()
        rng = np.random.default_rng(0)
        weights = set(module.onnx_names.values())
        for name, value in inits.items():
            if not np.issubdtype(value.dtype, np.floating) or name not in weights:
                continue  # (an initializer the importer keeps constant: bounds, scales, roi ...)
            path = _path(module, name)
            assert path in by_path, f"no gradient for {name!r} ({sorted(by_path)})"
            g = by_path[path].to_numpy()
            assert g.shape == value.shape
            for _ in range(entries):
                idx = tuple(int(rng.integers(0, d)) for d in value.shape)
                plus, minus = value.copy(), value.copy()
                plus[idx] += eps
                minus[idx] -= eps
                fd = (ort_loss(_with_initializer(model, name, plus), feeds, w)
                      - ort_loss(_with_initializer(model, name, minus), feeds, w)) / (2 * eps)
                np.testing.assert_allclose(g[idx], fd, rtol=rtol, atol=atol, err_msg=f"{name}{list(idx)}")
    return {"sessions": len(_training._sessions), "graphs": len(_training._graphs)}


def _path(module, name: str) -> str:
    return module.path_of(name)
