"""Weights of an imported graph that hold a BatchNorm folded into them by the exporter.

torch's dynamo exporter runs onnxscript's rewriter, whose rules ``FuseBatchNormIntoConv``,
``FuseBatchNormIntoConvTranspose`` and ``FuseBatchNormIntoGemm`` replace ``BatchNorm(Conv(x; W, b))``
by one ``Conv(x; W * s, (b - mean) * s + beta)`` with ``s = gamma / sqrt(var + eps)`` per output
channel, and keep the weight's name (``conv.weight``, ``fc1.weight``; a bias-free conv gets a new
``conv.weight_bias``). The rewriter tags the node it writes: its ``metadata_props`` hold
``pkg.onnxscript.rewriter.rule_name`` = the rule's name (a comma-separated list when several
rules rewrote the node: ``'FuseBatchNormIntoConv, RemoveOptionalBiasFromConv'``; and the BatchNorm's
``pkg.torch.onnx.name_scopes``, ``['', 'bn', ...]``). That tag is the only evidence used here:
never values or shapes.

Such a weight is not torch's ``conv.weight``: the per-channel scale ``s`` is not in the file, so
neither a PEFT adapter trained on torch's weight (PEFT computes ``BN(conv(x; W + dW))`` =
``conv(x; (W + dW) * s)``) nor a torch checkpoint's unfolded ``conv.weight`` can be placed in it.
:func:`folded_norm_weights` finds them; ``OnnxModule.onnx_folded_norms`` lists them by path;
``load_peft_adapter`` and the PyTorch / safetensors loaders refuse them (``apply_lora``'s fresh
adapters, trained on the import, are fine: the folded weight's own delta is well defined).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._ir import dynamo_scope

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["FOLD_RULES", "RULE_TAG", "folded_norm_weights", "folded_norm_paths", "folded_norm_scopes",
           "folded_reason", "holds_folded_norms"]

RULE_TAG = "pkg.onnxscript.rewriter.rule_name"
"""The metadata key onnxscript's rewriter writes on each node a rule produced."""

FOLD_RULES = frozenset({"FuseBatchNormIntoConv", "FuseBatchNormIntoConvTranspose", "FuseBatchNormIntoGemm"})
"""onnxscript's rules (``onnxscript.rewriter.rules.common._fuse_batchnorm``) that fold a
BatchNorm into the preceding node's weight and bias."""


def _scope_text(node) -> str:
    scope = dynamo_scope(node)
    return f", name scope {scope!r}" if scope else ""


def _folding_nodes(model: "ir.Model"):
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        tag = node.metadata_props.get(RULE_TAG)
        # NOTE: a node several rules rewrote lists them all: 'FuseBatchNormIntoConv, RemoveOptionalBiasFromConv'
        if tag is not None and FOLD_RULES.intersection(rule.strip() for rule in tag.split(",")):
            yield node, tag


def folded_norm_weights(model: "ir.Model") -> dict:
    """``{ONNX weight name: evidence}`` of the weights (and biases) of the ``Conv`` /
    ``ConvTranspose`` / ``Gemm`` nodes of ``model`` (every graph) that onnxscript's rewriter
    produced by folding a BatchNorm into them (module docstring). The evidence names the node,
    its op, the rule and the BatchNorm's name scope where recorded:
    ``"node 'node_Conv_11' (Conv) carries pkg.onnxscript.rewriter.rule_name='FuseBatchNormIntoConv', name scope 'bn'"``.
    Only inputs after the first (the data) are listed; the caller keeps those that are weights."""
    found: dict = {}
    for node, tag in _folding_nodes(model):
        label = f"node {node.name!r} ({node.op_type}) carries {RULE_TAG}={tag!r}{_scope_text(node)}"
        for value in list(node.inputs)[1:]:
            if value is not None and value.name:
                found.setdefault(value.name, label)
    return found


def folded_norm_paths(module) -> dict:
    """``{module path: (ONNX name, evidence)}`` of the params of ``module``'s imported graphs
    (sub-modules with ``ir_model`` and ``onnx_names``: :class:`~onnxparam.OnnxModule`) that hold
    a folded BatchNorm (:func:`folded_norm_weights`)."""
    from ..core.module import named_modules

    found: dict = {}
    for prefix, sub in named_modules(module):
        if not (hasattr(type(sub), "ir_model") and hasattr(type(sub), "onnx_names")):
            continue
        cached = getattr(sub, "onnx_folded_norms", None)  # OnnxModule's (cached) path -> evidence
        if cached is None:
            by_name = folded_norm_weights(sub.ir_model)
            cached = {path: by_name[name] for path, name in sub.onnx_names.items() if name in by_name}
        if not cached:
            continue
        names = sub.onnx_names
        for path, evidence in cached.items():
            found[f"{prefix}.{path}" if prefix else path] = (names.get(path, path), evidence)
    return found


def folded_reason(path: str, name: str, evidence: str) -> str:
    """The sentence naming why ``path`` cannot take torch's (unfolded) tensor."""
    shown = f"{path!r}" + (f" (ONNX {name!r})" if name != path else "")
    return (f"{shown} holds a BatchNorm the exporter folded into it ({evidence}): its values are torch's "
            "weight times the BatchNorm's per-channel scale gamma / sqrt(var + eps) (the bias: shifted too), "
            "and the file does not hold that scale, so torch's unfolded tensor or a delta trained on it cannot be "
            "placed here; export the model with the BatchNorm kept (dynamo: optimize=False; TorchScript: "
            "do_constant_folding=False)")


def folded_norm_scopes(module) -> set:
    """The module paths (in torch's model) of the BatchNorms folded into ``module``'s imported
    graphs, from dynamo's ``name_scopes`` metadata on the tagged nodes (``{'bn', 'layer1.0.bn1'}``)."""
    from ..core.module import named_modules

    scopes: set = set()
    for _, sub in named_modules(module):
        if hasattr(type(sub), "ir_model") and hasattr(type(sub), "onnx_names"):
            scopes.update(_model_scopes(sub.ir_model))
    return scopes


def _model_scopes(model: "ir.Model") -> set:
    return {s for s in (dynamo_scope(node) for node, _ in _folding_nodes(model)) if s}


def holds_folded_norms(module, names) -> bool:
    """Whether a checkpoint with tensor ``names`` holds a BatchNorm that the exporter folded into
    ``module``'s imported weights (its ``<scope>.running_mean`` / ``.running_var``, under any
    prefix): then it is torch's state dict, with the weights unfolded. Names only, no values.
    ``module`` may also be an ``onnx_ir.Model`` (a template graph)."""
    import onnx_ir as ir

    scopes = _model_scopes(module) if isinstance(module, ir.Model) else folded_norm_scopes(module)
    if not scopes:
        return False
    leaves = {f"{scope}.{stat}" for scope in scopes for stat in ("running_mean", "running_var")}
    return any(name in leaves or any(name.endswith("." + leaf) for leaf in leaves) for name in names)
