"""A warning from the PEFT writers for a convolution adapter PEFT's unmerged forward runs
differently (fresh7 F3).

Here a ``groups=1`` convolution adapter is a weight delta: every mode applies the merged weight
``W + delta`` with the node's own attributes (PEFT's ``merge_and_unload`` gives the same numbers).
PEFT's *unmerged* forward instead runs ``lora_A`` as a conv with the base's stride and padding but
**no dilation** and on the **unpadded** input (zeros where torch's ``padding_mode`` reflects,
replicates or wraps): on a dilated conv (a kernel longer than 1 on a dilated axis) or a conv whose
input a ``reflect`` / ``edge`` / ``wrap`` ``Pad`` or a circular ``Slice`` / ``Concat`` fills
(:func:`onnxparam.lora._conv_checks.conv_node_problem`),
a PEFT folder written by :func:`onnxparam.save_peft_adapter` or :func:`onnxparam.write_batched_peft`
gives other numbers in PEFT until merged. The writers still write it (the factors are right) and
emit a :class:`~onnxparam.core.errors.LoraWarning` naming the weight and the node.
"""

from __future__ import annotations

import warnings

__all__ = ["warn_unmerged_convs", "module_conv_problems", "export_conv_problems"]


def _dilation_problem(dilation, kernel) -> "str | None":
    dilation = tuple(dilation) if isinstance(dilation, (tuple, list)) else (dilation,) * len(kernel)
    if any(int(d) != 1 and int(k) != 1 for d, k in zip(dilation, kernel)):
        return f"dilation={list(dilation)} with a {list(kernel)} kernel"
    return None


def module_conv_problems(module, conv_paths: dict) -> dict:
    """``{path: (node or module label, why)}`` for the convolution weights ``conv_paths``
    (``{path: shape}``) of ``module`` whose conv PEFT's unmerged forward does not follow: from the
    ``Conv`` nodes of its imported parts' graphs, and from native ``ConvNd`` modules' ``dilation``."""
    from ..core.module import named_modules
    from ._conv_checks import conv_node_problem, node_label

    found = {}
    for prefix, sub in named_modules(module):
        join = (lambda p, _pre=prefix: f"{_pre}.{p}" if _pre else p)
        if hasattr(type(sub), "ir_model") and hasattr(type(sub), "onnx_names"):
            by_name = {name: join(path) for path, name in sub.onnx_names.items()}
            for node in sub.ir_model.graph.all_nodes():
                if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
                    continue
                w = node.inputs[1]
                path = by_name.get(w.name) if w is not None else None
                if path in conv_paths:
                    problem = conv_node_problem(node, tuple(conv_paths[path]))
                    if problem is not None:
                        found.setdefault(path, (node_label(node), problem))
            continue
        path = join("weight")
        if path in conv_paths and hasattr(sub, "dilation"):
            problem = _dilation_problem(getattr(sub, "dilation"), tuple(conv_paths[path])[2:])
            if problem is not None:
                found.setdefault(path, (f"{type(sub).__name__} {prefix!r}", problem))
    return found


def export_conv_problems(ir_model, targets: list) -> dict:
    """:func:`module_conv_problems` for the ``"conv"`` targets of a batched export (its metadata's
    ``targets``), from the export's own ``Conv`` nodes (the weight read directly or through one
    ``DequantizeLinear``)."""
    from ._batched import STACK_SUFFIXES
    from ._conv_checks import conv_node_problem, node_label

    weights = {t["a"][: -len(STACK_SUFFIXES[0])]: t for t in targets if t.get("kind") == "conv"}
    found = {}
    if not weights:
        return found
    for node in ir_model.graph.all_nodes():
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 \
                or node.inputs[1] is None:
            continue
        w = node.inputs[1]
        producer = w.producer()
        if w.name not in weights and producer is not None and producer.op_type == "DequantizeLinear":
            w = producer.inputs[0]
        t = weights.get(w.name) if w is not None else None
        if t is not None:
            problem = conv_node_problem(node, tuple(t["shape"]))
            if problem is not None:
                found.setdefault(t["path"], (node_label(node), problem))
    return found


def warn_unmerged_convs(found: dict, writer: str) -> None:
    """One :class:`~onnxparam.core.errors.LoraWarning` naming every weight of ``found``."""
    if not found:
        return
    from ..core.errors import LoraWarning

    items = "; ".join(f"{path!r} ({label}: {why})" for path, (label, why) in sorted(found.items()))
    warnings.warn(
        f"{writer}: convolution adapters on {items}: here each is the merged weight delta (as PEFT's "
        "merge_and_unload), but PEFT's unmerged forward runs lora_A without the dilation and on the unpadded input, "
        "so the written PEFT folder gives other numbers in PEFT until merged (model.merge_and_unload())",
        LoraWarning, stacklevel=3)
