"""Building the training graph: the traced forward plus its reverse-mode backward, in ONNX.

:func:`build_training_model` takes a freshly traced forward whose first output is a scalar
loss and extends *the same graph*:

1. the params to differentiate (those with ``require_grad``) stop being initializers and
   become graph inputs named by their path, so one ONNX Runtime session serves every training
   step (new values are fed, nothing is rebuilt); frozen params stay injected initializers;
2. the values that depend on a differentiated param are found in one forward pass over the
   (topologically sorted) nodes; only nodes between those params and the loss get backward
   nodes (everything else, e.g. a frozen backbone, is pruned);
3. walking the nodes in reverse, each node's gradient rule (:mod:`._rules`) turns the gradients
   of its outputs into gradients of its inputs; a value used several times sums them;
4. the outputs become ``[loss, <path>.grad ...]``, one per differentiated param the loss
   depends on (a param the loss does not reach has no gradient, as in Burn).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from ..core.errors import TraceError
from ..trace.tracer import TracedModel
from . import _rules_deform, _rules_layers, _rules_nn, _rules_shape  # noqa: F401  (register the shape, conv / pool / norm, nn_layers and nn_deform rules)
from . import _rules_more  # noqa: F401  (register the rules imported models need)
from . import _rules_algebra, _rules_attention, _rules_spatial  # noqa: F401  (CumProd, Det ...; Attention; LRN ...)
from . import _rules_signal  # noqa: F401  (DFT, STFT, RotaryEmbedding's caches: after _rules_more)
from . import _rules_sampling  # noqa: F401  (Resize crop, GridSample, MaxRoiPool, RoiAlign max: after _rules_layers, _rules_spatial)
from . import _rules_scatter  # noqa: F401  (ScatterND / ScatterElements mul, max, min: after _rules_more)
from . import _rules_einsum  # noqa: F401  (Einsum with an ellipsis or a diagonal: after _rules_more)
from . import _rules_rnn  # noqa: F401  (register LSTM / GRU / RNN)
from ._rules_sequence import accumulate  # (and register the sequence / optional / Unique rules)
from . import _rules_seqmap  # noqa: F401  (register SequenceMap)
from ._rules_control import MULTI_OUTPUT, missing_in_bodies, node_inputs, specialize_control_flow
from ._emitter import Emitter, dims, np_dtype
from ._check import MissingRule, format_missing, missing_rules, reaching, rule_for, rule_key, source_name, unserved
from ._recompute import apply_recompute
from ._rules import NON_DIFFERENTIABLE

__all__ = ["build_training_model", "GRAD_SUFFIX"]

GRAD_SUFFIX = ".grad"
"""Output name of a param's gradient: ``<path>.grad`` (``fc1.weight.grad``)."""


def _is_float(value: ir.Value) -> bool:
    return value.dtype is not None and np.issubdtype(np_dtype(value), np.floating)


def _fill_dynamic_dims(model: ir.Model) -> None:
    """Give static dims to the values traced with dynamic ones (e.g. the nodes of an imported
    model, typed from its file) when the graph inputs are static: ONNX shape inference (with data
    propagation) runs on the graph and only dims that were not ints are taken from it. Rules
    that need static dims (``MatMul``, ``Reshape`` ...) then see the concrete shapes."""
    graph = model.graph
    values = [out for node in graph.all_nodes() for out in node.outputs]
    if all(v.shape is None or all(isinstance(d, int) for d in v.shape) for v in values):
        return
    if not all(v.shape is not None and all(isinstance(d, int) for d in v.shape) for v in graph.inputs):
        return  # symbolic inputs (InputSpecs): nothing concrete to propagate
    try:
        from onnx_ir.passes.common import _c_api_utils

        inferred = _c_api_utils.call_onnx_api(
            lambda proto: onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True),
            model)
    except Exception:  # noqa: BLE001 - best effort: the rules name the value whose dims they lack
        return
    shapes = {}
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None
                                 for d in info.type.tensor_type.shape.dim]
    for v in values:
        known = shapes.get(v.name)
        if v.shape is None or known is None or len(known) != len(v.shape):
            continue
        dims_now = list(v.shape)
        merged = [d if isinstance(d, int) else (k if k is not None else d) for d, k in zip(dims_now, known)]
        if merged != dims_now:
            v.shape = ir.Shape(merged)


def _rule_failure(node: ir.Node, why: str, opset: int, traced: TracedModel) -> str:
    """A gradient rule's failure, naming the node, the params that feed it, and where the
    graph's opset comes from when the rule needs a newer one."""
    params = [v.name for v in node.inputs if v is not None and v.name in traced.params]
    src = source_name(node)
    text = f"gradient of node {src!r} (traced as {node.name!r}, {node.op_type}" if src else \
        f"gradient of node {node.name!r} ({node.op_type}"
    text += f", fed by {', '.join(map(repr, params))})" if params else ")"
    text += f": {why}"
    if "opset" in why:
        text += (f". The graph's ai.onnx opset is {opset}: an imported model keeps its file's opset, and the "
                 "loss's ops are emitted at it; use ops that are differentiable there in the loss (e.g. "
                 "cross_entropy's one-hot form instead of gather / gather_elements), freeze the params "
                 "before this node, or convert the model to a newer opset")
    return text


def build_training_model(traced: TracedModel, wrt: Sequence[str], recompute: Sequence[str] = ()) -> tuple[TracedModel, tuple]:
    """Extend ``traced`` (consumed: its graph is changed in place) with the gradients of its
    first output with respect to the params at paths ``wrt``.

    Args:
        traced: a forward traced for this purpose, whose first output is the loss: a float
            tensor with one element.
        wrt: param paths (initializer names) to differentiate; each becomes a graph input.
        recompute: sub-module paths whose activations the backward recomputes instead of
            keeping (:func:`~onnxparam.autodiff.recompute`; :func:`._recompute.apply_recompute`).

    Returns:
        ``(model, grad_paths)``: the training :class:`~onnxparam.trace.tracer.TracedModel` (inputs:
        the forward's inputs then the ``wrt`` params; outputs: the loss then the gradients;
        ``param_paths``: the frozen params, still initializers) and the paths that have a
        gradient output, in output order.

    Raises:
        TraceError: for a loss that is not a one-element float, a path that is not a param of
            the trace, or an operator on the path from a param to the loss without a rule.
    """
    graph = traced.graph
    if not graph.outputs:
        raise TraceError("the loss function returned nothing")
    loss = graph.outputs[0]
    # NOTE: a loss of unknown rank (e.g. summed from an imported output ONNX cannot type under
    # symbolic dims) is taken as one element; ONNX Runtime computes whatever it is
    loss_dims = dims(loss) if loss.shape is not None else ()
    if not _is_float(loss) or any(d != 1 for d in loss_dims):
        shape = [d for d in loss_dims]
        raise TraceError(f"the loss must be a float tensor with one element (e.g. ops.mean(...)); got "
                         f"{loss.dtype.name if loss.dtype is not None else '?'}{shape}")
    wrt = [str(p) for p in wrt]
    unknown = [p for p in wrt if p not in traced.params]
    if unknown:
        raise TraceError(f"not params of this trace: {', '.join(map(repr, unknown))}")
    opset = graph.opset_imports.get("", 1)
    graph.sort()
    specialize_control_flow(traced.model, traced.params)  # (only for graphs holding subgraphs)
    _fill_dynamic_dims(traced.model)

    # 1. differentiated params -> graph inputs
    wrt_values = {}
    for path in wrt:
        value = graph.initializers.pop(path)
        value.const_value = None
        graph.inputs.append(value)
        wrt_values[path] = value

    # 2. which values depend on a differentiated param
    requires: set = set(wrt_values.values())
    for node in graph:
        if rule_key(node) in NON_DIFFERENTIABLE:
            continue  # (other domains' operators propagate: without a rule, the check names them)
        if any(v is not None and v in requires for v in node_inputs(node)):  # (with values captured by subgraphs)
            requires.update(out for out in node.outputs if _is_float(out))

    # every node without a rule on a param -> loss path, listed at once before anything is built
    missing = missing_rules(graph, requires, loss, traced.params, node_inputs)
    missing += missing_in_bodies(graph, requires, reaching(graph, loss), traced.params)  # (If / Loop / Scan bodies)
    if missing:
        err = TraceError(format_missing(missing))
        err.missing = missing  # (check_gradients returns it)
        raise err

    # 3. reverse sweep
    e = Emitter(graph, opset)
    grads: dict = {}
    failed: list = []  # (MissingRule, message): rules that failed for a reason known from the graph

    def fail(node, why):
        fed = tuple(v.name for v in node_inputs(node) if v is not None and v.name in traced.params)
        failed.append((MissingRule(node.name, rule_key(node), fed, why, source_name(node)),
                       _rule_failure(node, why, opset, traced)))

    if loss in requires:
        grads[loss] = e.const(np.ones(loss_dims, dtype=np_dtype(loss)), np_dtype(loss))
    for node in reversed(list(graph)):
        if node.name.startswith("/grad/"):
            continue
        gout = [grads.get(out) for out in node.outputs]
        if all(g is None for g in gout):
            continue
        inputs = node_inputs(node)  # node.inputs, then the outer values its subgraphs read
        need = [v is not None and v in requires and _is_float(v) for v in inputs]
        if not any(need):
            continue
        fn = rule_for(node)
        if fn is None:
            params = [v.name for v in inputs if v is not None and v.name in traced.params]
            raise TraceError(f"no gradient rule for node {node.name!r} ({node.domain + ':' if node.domain else ''}"
                             f"{node.op_type}) on the path from the trainable params to the loss"
                             + (f" (fed by {', '.join(map(repr, params))})" if params else "")
                             + "; freeze the params before it (freeze_group / no_grad) or add a rule to "
                               "onnxparam.autodiff._rules.RULES")
        if len(node.outputs) > 1 and node.op_type not in MULTI_OUTPUT and not getattr(fn, "multi_output", False) \
                and any(g is not None for g in gout[1:]):
            fail(node, "only its first output can carry a gradient")
            results = None
        else:
            try:
                results = fn(e, node, gout, need)
            except TraceError as err:  # every failing rule is listed at once, after the sweep
                fail(node, str(err))
                results = None
            except Exception:  # noqa: BLE001 - after a failure, rules are fed stand-ins: report what was found
                if not failed:
                    raise
                break
        if results is not None:
            dropped = unserved(node, inputs, need, results, opset)
            if dropped:
                fail(node, "its rule gives no gradient for input(s) " + ", ".join(
                    f"{j} ({name!r})" for j, name in dropped) + "; freeze the params that feed them")
                results = None
        if results is None:
            # NOTE: the sweep goes on to list the failures further up; each input stands in for
            # its own gradient (the same type and shape) in a graph that is never built
            results = list(inputs)
        for value, n, g in zip(inputs, need, results):
            if not n or g is None:
                continue
            have = grads.get(value)
            grads[value] = g if have is None else accumulate(e, value, have, g)

    if failed:
        if len(failed) == 1:
            err = TraceError(failed[0][1])
        else:
            err = TraceError(f"the gradient rules of {len(failed)} node(s) failed:\n"
                             + "\n".join(f"  - {text}" for _, text in failed))
        err.missing = [m for m, _ in failed]  # (check_gradients returns it)
        raise err

    # 4. the marked sub-modules' values the backward reads: recomputed there, not kept
    apply_recompute(graph, recompute, e.unique, grads)

    # 5. outputs
    del graph.outputs[1:]
    grad_paths = []
    for path in wrt:
        value = wrt_values[path]
        g = grads.get(value)
        if g is None:
            continue
        out = e.op("Identity", g)
        out.name = e.unique(path + GRAD_SUFFIX)
        e.typed(out, np_dtype(value), dims(value))
        graph.outputs.append(out)
        grad_paths.append(path)
    frozen = tuple(p for p in traced.param_paths if p not in wrt_values)
    model = ir.Model(graph, ir_version=traced.model.ir_version, producer_name="onnxparam",
                     producer_version=traced.model.producer_version)
    data_inputs = tuple(n for n in traced.input_names)
    training = TracedModel(
        model=model,
        input_names=data_inputs + tuple(wrt),
        output_names=tuple(v.name for v in graph.outputs),
        param_paths=frozen,
        params={p: traced.params[p] for p in traced.param_paths},
        mode=traced.mode,
        single_output=False,
    )
    return training, tuple(grad_paths)


def check_model(training: TracedModel) -> Optional[str]:
    """ONNX's checker on the training model (without param data); the error text or ``None``.
    For debugging rules."""
    try:
        onnx.checker.check_model(training.to_proto())
    except Exception as err:
        return str(err)
    return None
