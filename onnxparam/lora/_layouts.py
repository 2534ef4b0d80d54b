"""The layout of an imported graph's 2-d weights, read from the nodes that consume them (never
from shapes): which axis is the input, so that a LoRA adapter, a PEFT factor or a checkpoint
tensor goes on the right way round. An imported module's ``lora_weight_layouts`` /
``lora_transposed_paths`` (what :func:`~onnxparam.lora.apply_lora` and the PEFT readers and
writers ask) come from :func:`weight_layouts`; :func:`onnxparam.lora._tables.tied_output_pairs`
uses it to orient a tied projection."""

from __future__ import annotations

import onnx_ir as ir

from ..trace.evidence import stored_tensor
from ._graph import _attr_int, _transpose_to_matmul

__all__ = ["IN_OUT", "OUT_IN", "CONV", "weight_layouts", "transposed_weight_names"]

IN_OUT = "in_out"
OUT_IN = "out_in"
CONV = "conv"
"""Weight layouts: ``(d_in, d_out)`` (ONNX ``MatMul`` B, ``Gemm`` B with ``transB=0``, Burn's
``Linear``; a ``Gather``-ed embedding table ``(num_embeddings, dim)`` reads as one too) and
``(d_out, d_in)`` (``Gemm`` B with ``transB=1``, ``Transpose -> MatMul``: PyTorch's ``Linear``);
``CONV``: a ``Conv`` weight ``(out, in / groups, *kernel)``."""


def weight_layouts(model: ir.Model) -> dict:
    """The layout of each 2-d weight of ``model`` (an initializer, or a ``Constant`` node's
    output: :func:`~onnxparam.trace.evidence.stored_tensor`), decided by its consumers: ``name
    -> IN_OUT | OUT_IN``, or a sentence saying why the graph does not decide it (its uses
    disagree, or no use tells which axis is the input). Never from shapes.

    ======================================  =========
    use of the weight ``W``                 layout
    ======================================  =========
    ``MatMul`` B                            IN_OUT
    ``Gemm`` B, ``transB=0`` / ``1``        IN_OUT / OUT_IN
    ``Transpose(perm=[1, 0]) -> MatMul`` B  OUT_IN
    ``Gather`` data (an embedding table)    IN_OUT (rows are the looked-up axis)
    ``Conv`` W                              CONV
    ======================================  =========
    """
    claims: dict = {}
    others: dict = {}
    for node in model.graph.all_nodes():
        if node.domain not in ("", "ai.onnx"):
            continue
        for index, value in enumerate(node.inputs):
            tensor = stored_tensor(value)  # an initializer or a Constant node's output (Paddle's weights)
            if tensor is None:
                continue
            rank = len(tensor.shape)
            if node.op_type == "Conv" and index == 1 and rank >= 3:
                claims.setdefault(value.name, set()).add(f"{CONV}:Conv")
                continue
            if rank != 2:
                continue
            layout = None
            if node.op_type == "MatMul" and index == 1:
                layout = IN_OUT
            elif node.op_type == "Gemm" and index == 1:
                layout = OUT_IN if _attr_int(node, "transB", 0) == 1 else IN_OUT
            elif node.op_type == "Gather" and index == 0 and _attr_int(node, "axis", 0) == 0:
                layout = IN_OUT
            elif node.op_type == "Transpose" and index == 0 and _transpose_to_matmul(node) is not None:
                layout = OUT_IN
            if layout is None:
                others.setdefault(value.name, set()).add(f"{node.op_type} input {index}")
            else:
                claims.setdefault(value.name, set()).add(f"{layout}:{node.op_type}")
    out = {}
    for name in set(claims) | set(others):
        layouts = {c.split(":")[0] for c in claims.get(name, ())}
        if len(layouts) == 1:
            out[name] = next(iter(layouts))
        elif len(layouts) > 1:
            out[name] = f"its uses disagree on its layout ({', '.join(sorted(claims[name]))})"
        else:
            out[name] = f"no use says which axis is the input (used by {', '.join(sorted(others[name]))})"
    return out


def transposed_weight_names(model: ir.Model) -> set:
    """Names of the weights whose graph says they are stored ``(d_out, d_in)``
    (:func:`weight_layouts`): their adapters are transposed."""
    return {name for name, layout in weight_layouts(model).items() if layout == OUT_IN}
