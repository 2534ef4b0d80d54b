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

import ast
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["FOLD_RULES", "RULE_TAG", "folded_norm_weights", "folded_norm_paths", "folded_reason"]

RULE_TAG = "pkg.onnxscript.rewriter.rule_name"
"""The metadata key onnxscript's rewriter writes on each node a rule produced."""

FOLD_RULES = frozenset({"FuseBatchNormIntoConv", "FuseBatchNormIntoConvTranspose", "FuseBatchNormIntoGemm"})
"""onnxscript's rules (``onnxscript.rewriter.rules.common._fuse_batchnorm``) that fold a
BatchNorm into the preceding node's weight and bias."""


def _scope_text(node) -> str:
    raw = node.metadata_props.get("pkg.torch.onnx.name_scopes", "")
    try:
        scopes = ast.literal_eval(raw) if raw else None
    except (ValueError, SyntaxError):
        scopes = None
    if isinstance(scopes, list) and len(scopes) >= 2 and isinstance(scopes[-2], str) and scopes[-2]:
        return f", name scope {scopes[-2]!r}"
    return ""


def folded_norm_weights(model: "ir.Model") -> dict:
    """``{ONNX weight name: evidence}`` of the weights (and biases) of the ``Conv`` /
    ``ConvTranspose`` / ``Gemm`` nodes of ``model`` (every graph) that onnxscript's rewriter
    produced by folding a BatchNorm into them (module docstring). The evidence names the node,
    its op, the rule and the BatchNorm's name scope where recorded:
    ``"node 'node_Conv_11' (Conv) carries pkg.onnxscript.rewriter.rule_name='FuseBatchNormIntoConv', name scope 'bn'"``.
    Only inputs after the first (the data) are listed; the caller keeps those that are weights."""
    import onnx_ir as ir

    found: dict = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        tag = node.metadata_props.get(RULE_TAG)
        # NOTE: a node several rules rewrote lists them all: 'FuseBatchNormIntoConv, RemoveOptionalBiasFromConv'
        if tag is None or not FOLD_RULES.intersection(rule.strip() for rule in tag.split(",")):
            continue
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
