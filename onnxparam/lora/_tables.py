"""Which PyTorch module owns an embedding table of an imported graph, for PEFT's names.

PEFT puts an ``Embedding`` LoRA (``lora_embedding_A`` / ``_B``) on an ``nn.Embedding`` module.
When a table is tied to an output projection (GPT-2's ``wte`` / ``lm_head``), torch's exporters
may name the table's initializer after either module: dynamo writes it as ``lm_head.weight``
(an ``nn.Linear``, which PEFT wraps as a Linear LoRA, silently dropping embedding factors),
TorchScript as ``wte.weight``. The graph's evidence of the owner is the ``Gather`` reading the
table: dynamo's ``pkg.torch.onnx.name_scopes`` metadata (``['', 'transformer', 'transformer.wte',
'embedding']`` -> ``transformer.wte``), or TorchScript's node name (``/transformer/wte/Gather`` ->
``transformer.wte``). :func:`table_owners` reads it; :func:`owner_name` decides a table's PEFT
module name from it, refusing (a problem string) where the evidence is missing for a tied
table or names several modules.
"""

from __future__ import annotations

import ast
import re
from typing import Optional, Sequence

import numpy as np

__all__ = ["gather_module", "matmul_weights", "owner_name", "table_owners"]


def _collapse(segments: list) -> str:
    """TorchScript's scope segments as a module path: ``['b', 'b.0', 'qkv']`` -> ``b.0.qkv``
    (a segment with a dot repeats the path so far; module names have no dots)."""
    path = ""
    for seg in segments:
        path = seg if path and seg.startswith(path + ".") else (f"{path}.{seg}" if path else seg)
    return path


def matmul_weights(model):
    """``(node, weight value)`` for each ``MatMul`` / ``Gemm`` of ``model`` (default domain, any
    graph) in node order: its B, or the input of the ``Transpose`` producing B (torch's
    exporters' ``nn.Linear``)."""
    for node in model.graph.all_nodes():
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        weight = node.inputs[1]
        producer = weight.producer() if weight is not None else None
        if producer is not None and producer.op_type == "Transpose":
            weight = producer.inputs[0]
        if weight is not None:
            yield node, weight


def gather_module(node) -> Optional[str]:
    """The PyTorch module path a ``Gather`` node belongs to, from dynamo's ``name_scopes``
    metadata (the scope before the op's own) or a TorchScript node name ``/<a>/<b>/Gather``;
    ``None`` without such evidence (or for the root module)."""
    raw = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if raw:
        try:
            scopes = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            scopes = None
        if isinstance(scopes, list) and len(scopes) >= 2 and all(isinstance(s, str) for s in scopes):
            return scopes[-2] or None
    name = node.name or ""
    if name.startswith("/") and name.count("/") >= 2:
        return _collapse(name[1:].split("/")[:-1]) or None
    return None


def _stored(value):
    from ..trace.evidence import stored_tensor

    return stored_tensor(value) if value is not None else None


def table_owners(model) -> dict:
    """``{table name: (modules, tied)}`` for each 2-d weight a ``Gather`` (``axis=0``) of
    ``model`` (an ``onnx_ir.Model``) reads as its data: ``modules`` the set of PyTorch module
    paths its ``Gather`` s name (:func:`gather_module`), ``tied`` whether a ``MatMul`` / ``Gemm``
    weight (directly or through a ``Transpose``) is the table itself or holds its values, as
    is or transposed (an output projection tied to it)."""
    from ._graph import _attr_int

    owners: dict = {}
    tensors: dict = {}
    for node in model.graph.all_nodes():
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.inputs \
                and node.inputs[0] is not None and _attr_int(node, "axis", 0) == 0:
            tensor = _stored(node.inputs[0])
            if tensor is None or len(tensor.shape) != 2:
                continue
            name = node.inputs[0].name
            tensors.setdefault(name, tensor)
            module = gather_module(node)
            owners.setdefault(name, set())
            if module:
                owners[name].add(module)
    if not owners:
        return {}
    tied = set()
    shapes = {name: tuple(int(d) for d in t.shape) for name, t in tensors.items()}
    arrays: dict = {}
    for node, weight in matmul_weights(model):
        if weight.name in owners:
            tied.add(weight.name)
            continue
        tensor = _stored(weight)
        if tensor is None or len(tensor.shape) != 2:
            continue
        shape = tuple(int(d) for d in tensor.shape)
        for name, table_shape in shapes.items():
            if name in tied or table_shape not in (shape, shape[::-1]) or tensors[name].dtype != tensor.dtype:
                continue
            if name not in arrays:
                arrays[name] = np.asarray(tensors[name].numpy())
            mine = np.asarray(tensor.numpy())
            if (shape == table_shape and np.array_equal(mine, arrays[name])) or \
                    (shape == table_shape[::-1] and np.array_equal(mine, arrays[name].T)):
                tied.add(name)
    return {name: (modules, name in tied) for name, modules in owners.items()}


def _mapped(name: str, rules: Sequence) -> str:
    for pattern, repl in rules:
        name = re.sub(pattern, repl, name)
    return name


def owner_name(table: str, fallback: str, entry, rules: Sequence) -> tuple:
    """``(PEFT module name, None)`` of the embedding table ``table`` (its ONNX name) or
    ``(None, problem)``: the one module its ``Gather`` s name (``entry`` from
    :func:`table_owners`), ``key_map`` ``rules`` applied; without such evidence ``fallback``
    (the module its param path names) with the rules applied, unless the table is tied to an
    output projection and no rule matches it (the path may name the projection's
    ``nn.Linear``, whose PEFT LoRA drops embedding factors)."""
    modules, tied = entry
    mapped = sorted({_mapped(m, rules) for m in modules})
    if len(mapped) == 1:
        return mapped[0], None
    if len(mapped) > 1:
        return None, (f"embedding table {table!r}: the Gathers reading it belong to several PyTorch modules "
                      f"{sorted(modules)}; pass a key_map rule (regex, module name) that maps them to the one "
                      "nn.Embedding owning the table")
    name = _mapped(fallback, rules)
    if tied and not any(re.search(pattern, fallback) for pattern, _ in rules):
        return None, (f"embedding table {table!r} is tied to an output projection (a MatMul weight holds its "
                      f"values) and the graph does not say which PyTorch module owns it (no Gather name_scopes or "
                      f"module-named Gather node); written under {fallback!r} PEFT may wrap an nn.Linear there and "
                      "silently drop the embedding factors: pass a key_map rule (regex, module name) naming the "
                      "nn.Embedding (e.g. 'transformer.wte')")
    return name, None
