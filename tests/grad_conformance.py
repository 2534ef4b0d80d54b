"""Gradients on ONNX's node conformance cases (built by ``tests/onnx_cases.py``, cached, not
committed): each case's float tensor inputs become initializers (params of the imported
model), the loss is ``sum(w * y)`` over the first output with fixed pseudo-random ``w``, and
``grad``'s gradient of every param is compared entry by entry with central finite differences
of the same loss computed by plain ONNX Runtime on the case's model with that entry perturbed.

Float64 where ONNX Runtime runs the case in double (inputs, outputs and float initializers
retyped); else the case's float32 with a larger step and tolerance. Points where the loss is
not smooth (the one-sided differences disagree: kinks, ties, rounding steps) or not finite are
left out, as are cases ORT itself cannot run.

Outcomes: ``pass`` (every checked entry matches), ``wrong`` (an entry differs: a wrong
gradient), ``missing`` (a param the loss depends on got no gradient without an error),
``refused`` (``grad`` raised the library's error: no rule / an unsupported form, named),
``skip`` (nothing to check: no float input, all points non-smooth, ORT cannot run it).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper

ENTRIES = 3
"""Entries checked per param."""

_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE)


def _run(model: onnx.ModelProto, feeds: dict):
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _as_params(case):
    """``(model, feeds, float64)``: the case's model with its float tensor inputs turned into
    initializers, the remaining feeds, and whether it was retyped to float64; ``None`` when
    there is nothing to check."""
    model = onnx.load(str(case.model_path))
    data = case.data_sets()
    if not data:
        return None
    inputs, outputs = data[0]
    graph = model.graph
    if len(graph.node) != 1 or graph.node[0].domain not in ("", "ai.onnx") or len(graph.output) == 0:
        return None
    if not _tensor_output(graph, outputs[0] if outputs else None):
        return None
    if graph.output[0].type.tensor_type.elem_type not in _FLOATS:
        return None
    inputs = _tensor_inputs(graph, inputs)
    float_inputs = [(vi, x) for vi, x in zip(graph.input, inputs)
                    if isinstance(x, np.ndarray) and vi.type.tensor_type.elem_type in _FLOATS and x.size > 0]
    if not float_inputs:
        return None
    feeds = {vi.name: x for vi, x in zip(graph.input, inputs)
             if not any(vi.name == f.name for f, _ in float_inputs) and x is not None}
    for vi, x in float_inputs:
        graph.initializer.append(numpy_helper.from_array(np.asarray(x), vi.name))
    keep = [vi for vi in graph.input if not any(vi.name == f.name for f, _ in float_inputs)]
    del graph.input[:]
    graph.input.extend(keep)
    del graph.output[1:]
    model64 = _retyped(model)
    try:
        y32 = _run(model, feeds)[0]
        y64 = _run(model64, feeds)[0]
        if y64.dtype == np.float64 and np.allclose(y64, y32, rtol=1e-3, atol=1e-4):
            return model64, feeds, True
    except Exception:  # noqa: BLE001 - ORT has no double kernel: the case's own dtype
        pass
    try:
        _run(model, feeds)
    except Exception:  # noqa: BLE001 - ORT itself cannot run the case
        return None
    return model, feeds, False


def _float_elements(tp: onnx.TypeProto, x) -> bool:
    """Whether ``x`` is a non-empty sequence of non-empty float tensors of type ``tp``."""
    return (tp.HasField("sequence_type") and tp.sequence_type.elem_type.HasField("tensor_type")
            and tp.sequence_type.elem_type.tensor_type.elem_type in _FLOATS and isinstance(x, list) and len(x) > 0
            and all(isinstance(a, np.ndarray) and a.size > 0 for a in x))


def _tensor_inputs(graph, inputs: list) -> list:
    """Sequence and optional inputs holding float tensors become tensor inputs (each element
    one, named ``<input>_<k>``) put together by ``SequenceConstruct`` / ``Optional`` nodes in
    front of the case's node, so their elements can be made params; the new inputs' values
    in graph order."""
    new_inputs, values, front = [], [], []
    for vi, x in zip(list(graph.input), inputs):
        tp, name, wrap = vi.type, vi.name, False
        if tp.HasField("optional_type") and x is not None:
            tp, wrap = tp.optional_type.elem_type, True
            name = f"{vi.name}_value"
        if _float_elements(tp, x):
            elems = [f"{vi.name}_{k}" for k in range(len(x))]
            elem_type = tp.sequence_type.elem_type.tensor_type.elem_type
            new_inputs += [onnx.helper.make_tensor_value_info(n, elem_type, None) for n in elems]
            values += list(x)
            front.append(onnx.helper.make_node("SequenceConstruct", elems, [name]))
        elif wrap and tp.HasField("tensor_type") and isinstance(x, np.ndarray):
            new_inputs.append(onnx.helper.make_tensor_value_info(name, tp.tensor_type.elem_type, None))
            values.append(x)
        else:
            new_inputs.append(vi)
            values.append(x)
            continue
        if wrap:
            front.append(onnx.helper.make_node("Optional", [name], [vi.name]))
    if front:
        nodes = front + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
        del graph.input[:]
        graph.input.extend(new_inputs)
    return values


def _tensor_output(graph, expected) -> bool:
    """A first output that is a sequence (or an optional) of float tensors becomes one tensor:
    its ``expected`` number of elements, each flattened, concatenated (``SequenceAt`` /
    ``OptionalGetElement`` nodes after the case's node); ``False`` when it holds nothing to
    check. A tensor output is left as it is."""
    out = graph.output[0]
    tp, name, nodes = out.type, out.name, []
    if tp.HasField("optional_type"):
        if expected is None:
            return False
        tp = tp.optional_type.elem_type
        nodes.append(onnx.helper.make_node("OptionalGetElement", [name], [f"{name}_value"]))
        name = f"{name}_value"
    if tp.HasField("sequence_type"):
        if not _float_elements(tp, expected):
            return False
        flat = []
        for k in range(len(expected)):
            pos, shape = f"{out.name}_at_{k}", f"{out.name}_flat_shape"
            graph.initializer.append(numpy_helper.from_array(np.array(k, np.int64), pos))
            nodes.append(onnx.helper.make_node("SequenceAt", [name, pos], [f"{pos}_elem"]))
            nodes.append(onnx.helper.make_node("Reshape", [f"{pos}_elem", shape], [f"{pos}_flat"]))
            flat.append(f"{pos}_flat")
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), shape))
        nodes.append(onnx.helper.make_node("Concat", flat, [f"{out.name}_flat"], axis=0))
        name, tp = f"{out.name}_flat", tp.sequence_type.elem_type
    if not nodes:
        return True
    graph.node.extend(nodes)
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info(name, tp.tensor_type.elem_type, None))
    return True


def _retyped(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for vi in list(g.input) + list(g.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for i, init in enumerate(g.initializer):
        if init.data_type == TensorProto.FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    del g.value_info[:]
    return out


def _loss(model, feeds, w) -> float:
    y = _run(model, feeds)[0]
    return float((np.asarray(y, np.float64) * w).sum())


def _perturbed(model, name, idx, delta):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name == name:
            a = numpy_helper.to_array(init).copy()
            a[idx] += delta
            init.CopyFrom(numpy_helper.from_array(a, name))
    return out


def check_grad_case(case) -> tuple:
    """``(outcome, detail)`` for one node case (see the module docstring)."""
    import onnxparam as op
    from onnxparam.autodiff import grad
    from onnxparam.core.errors import OnnxParamError

    built = _as_params(case)
    if built is None:
        return "skip", "no float input / output, or ORT cannot run it"
    model, feeds, f64 = built
    try:
        y = _run(model, feeds)[0]
    except Exception as err:  # noqa: BLE001
        return "skip", f"ORT: {err}"
    if not np.all(np.isfinite(y)):
        return "skip", "non-finite output"
    rng = np.random.default_rng(0)
    w = rng.uniform(-1.0, 1.0, size=np.shape(y))
    base = _loss(model, feeds, w)
    try:
        module = op.import_onnx(model)
    except OnnxParamError as err:
        return "skip", f"import: {err}"
    if module.onnx_tables:  # every float input is a param here: the tables import freezes (BatchNorm's
        # running statistics) are trained too, so each rule is checked for every input
        module = module.unfreeze_group(op.ParamGroup.from_paths(module.onnx_tables))
    names = list(feeds)

    def loss_fn(m, wt, *xs):
        out = m(**dict(zip(names, xs)))
        out = out[0] if isinstance(out, (tuple, list)) else out
        return (out * wt).sum()

    dtype = np.float64 if f64 else np.float32
    try:
        loss, grads = grad(loss_fn, module, op.Tensor.from_numpy(w.astype(dtype)),
                           *[op.Tensor.from_numpy(np.asarray(feeds[n])) for n in names])
    except OnnxParamError as err:
        return "refused", str(err).splitlines()[0][:300]
    if not np.isclose(float(loss.to_numpy()), base, rtol=1e-4, atol=1e-5):
        return "skip", f"the imported model's loss {float(loss.to_numpy())} differs from ORT's {base}"
    by_path = grads.by_path()
    eps = 1e-5 if f64 else 1e-2
    rtol, atol = (1e-4, 1e-6) if f64 else (3e-2, 3e-3)
    checked = 0
    for init in model.graph.initializer:
        if init.data_type not in _FLOATS:
            continue
        value = numpy_helper.to_array(init)
        try:
            path = module.path_of(init.name)
        except KeyError:  # the importer keeps it a constant (a non-differentiable input: bounds, scales ...)
            continue
        g = by_path[path].to_numpy() if path in by_path else None
        picks = [tuple(int(rng.integers(0, d)) for d in value.shape) for _ in range(ENTRIES)] if value.ndim else [()]
        for idx in dict.fromkeys(picks):
            try:
                up = _loss(_perturbed(model, init.name, idx, eps), feeds, w)
                down = _loss(_perturbed(model, init.name, idx, -eps), feeds, w)
                up2 = _loss(_perturbed(model, init.name, idx, eps / 2), feeds, w)
                down2 = _loss(_perturbed(model, init.name, idx, -eps / 2), feeds, w)
            except Exception:  # noqa: BLE001 - ORT refuses the perturbed value (e.g. outside a domain)
                continue
            if not all(np.isfinite(v) for v in (up, down, up2, down2)):
                continue
            right, left = (up - base) / eps, (base - down) / eps
            right2, left2 = (up2 - base) / (eps / 2), (base - down2) / (eps / 2)
            scale = max(abs(right), abs(left), 1.0)
            if abs(right - left) > 1e-2 * scale or abs(right - right2) > 1e-2 * scale or abs(left - left2) > 1e-2 * scale:
                continue  # not smooth here
            fd = (up - down) / (2 * eps)
            if g is None:
                if abs(fd) > atol * 10:
                    return "missing", f"{init.name}: no gradient, finite difference {fd:.6g}"
                continue
            if not np.isclose(g[idx], fd, rtol=rtol, atol=atol):
                try:  # a kernel computing below float64 makes the small step noisy: a larger one
                    big = 100 * eps if f64 else 3 * eps
                    fd_big = (_loss(_perturbed(model, init.name, idx, big), feeds, w)
                              - _loss(_perturbed(model, init.name, idx, -big), feeds, w)) / (2 * big)
                except Exception:  # noqa: BLE001
                    fd_big = fd
                if np.isclose(g[idx], fd_big, rtol=rtol, atol=atol):
                    checked += 1
                    continue
                return "wrong", f"{init.name}{list(idx)}: gradient {g[idx]:.6g}, finite difference {fd:.6g}"
            checked += 1
    return ("pass", f"{checked} entries") if checked else ("skip", "no smooth point checked")
