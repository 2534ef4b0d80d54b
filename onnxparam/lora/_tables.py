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

The tables themselves, read from the graph for import and ``apply_lora``'s default targets:
position tables, embeddings of the inputs, and output projections tied to a table
(:func:`tied_output_pairs`: the one tie detection, which import's ``OnnxModule.onnx_ties``, the
PyTorch loader's tie matches and :func:`table_owners` all use).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ..trace.evidence import DataDependence, stored_tensor
from ._graph import _attr_int
from ._ir import dynamo_scope
from ._layouts import IN_OUT, OUT_IN, weight_layouts

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["gather_module", "matmul_weights", "owner_name", "table_owners", "position_tables", "embedding_tables",
           "tied_output_tables", "tied_output_pairs", "default_lora_skips"]


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
    scope = dynamo_scope(node)
    if scope is not None:
        return scope
    name = node.name or ""
    if name.startswith("/") and name.count("/") >= 2:
        return _collapse(name[1:].split("/")[:-1]) or None
    return None


def _stored(value):
    return stored_tensor(value) if value is not None else None


def table_owners(model) -> dict:
    """``{table name: (modules, tied)}`` for each 2-d weight a ``Gather`` (``axis=0``) of
    ``model`` (an ``onnx_ir.Model``) reads as its data: ``modules`` the set of PyTorch module
    paths its ``Gather`` s name (:func:`gather_module`), ``tied`` whether a ``MatMul`` / ``Gemm``
    weight (directly or through a ``Transpose``) is the table itself, or holds its values (an
    output projection tied to it: :func:`tied_output_pairs`)."""
    owners: dict = {}
    for node in model.graph.all_nodes():
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.inputs \
                and node.inputs[0] is not None and _attr_int(node, "axis", 0) == 0:
            tensor = _stored(node.inputs[0])
            if tensor is None or len(tensor.shape) != 2:
                continue
            name = node.inputs[0].name
            module = gather_module(node)
            owners.setdefault(name, set())
            if module:
                owners[name].add(module)
    if not owners:
        return {}
    tied = {weight.name for _, weight in matmul_weights(model) if weight.name in owners}  # one initializer
    tied.update(table for table, _ in tied_output_pairs(model).values())  # a copy of its values
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


def _gather_tables(model: ir.Model) -> tuple:
    """``({name: first Gather}, {name: any Gather's indices depend on the inputs})`` of the 2-d
    weights of ``model`` that only main-graph ``Gather`` s (``axis=0``, as ``data``) read."""
    graph = model.graph
    depends = DataDependence(graph)
    tables: dict = {}
    fed: dict = {}
    others: set = set()
    for node in graph.all_nodes():
        for index, value in enumerate(node.inputs):
            tensor = stored_tensor(value)
            if tensor is None or len(tensor.shape) != 2:
                continue
            if (node.graph is graph and node.op_type == "Gather" and node.domain in ("", "ai.onnx")
                    and index == 0 and _attr_int(node, "axis", 0) == 0 and len(node.inputs) > 1):
                tables.setdefault(value.name, node)
                fed[value.name] = fed.get(value.name, False) or bool(depends(node.inputs[1]))
            else:
                others.add(value.name)
    return ({n: g for n, g in tables.items() if n not in others},
            {n: f for n, f in fed.items() if n not in others})


def _where(node) -> str:
    return f"Gather {node.name!r}" if node.name else "a Gather"


def position_tables(model: ir.Model) -> dict:
    """``{name: reason}`` of the 2-d weights of ``model`` that only main-graph ``Gather`` s
    (``axis=0``, as ``data``) read, all with indices that do not depend on the model inputs'
    values (:class:`~onnxparam.trace.evidence.DataDependence`): position tables
    (GPT-2's ``wpe``, indices ``Range(Shape(x))``) and tables read at constant rows, not
    embeddings of the tokens fed. :func:`~onnxparam.lora.apply_lora`'s default group leaves them
    without an adapter, as PEFT's defaults target linear layers (embeddings only when asked);
    a group that names one adapts it (its layout stays ``IN_OUT``, :func:`weight_layouts`).
    A table that some other node also uses (a tied ``MatMul``), or that a subgraph reads, is
    not listed."""
    tables, fed = _gather_tables(model)
    return {name: (f"a table read by position ({_where(node)}: its indices are computed in the graph, not taken "
                   "from the model inputs), not an embedding of the inputs; name it in the param_group to adapt it")
            for name, node in tables.items() if not fed[name]}


def embedding_tables(model: ir.Model) -> dict:
    """``{name: reason}`` of the 2-d weights of ``model`` that only main-graph ``Gather`` s
    (``axis=0``, as ``data``) read, at least one with indices that depend on the model inputs'
    values (token ids): the embeddings of the inputs. PEFT adapts embeddings only when
    ``target_modules`` names them, so :func:`~onnxparam.lora.apply_lora`'s default group leaves
    them out too; a group that names one adapts it (layout ``IN_OUT``)."""
    tables, fed = _gather_tables(model)
    return {name: (f"an embedding table of the model inputs ({_where(node)} reads it at the fed ids); PEFT adapts "
                   "embeddings only when target_modules names them: name it in the param_group to adapt it")
            for name, node in tables.items() if fed[name]}


def tied_output_tables(model: ir.Model) -> dict:
    """``{name: reason}`` of the 2-d weights of ``model`` that are an embedding table's values
    tied to an output projection (:func:`tied_output_pairs`). PEFT leaves a tied output layer
    alone unless asked (adapting it would adapt the embedding it is tied to), so the default
    group does too."""
    return {name: (f"the output projection tied to the embedding table {table!r} (its values are the "
                   f"table's{' transposed' if transposed else ''}); PEFT leaves a tied output layer "
                   "alone unless asked: name it in the param_group to adapt it")
            for name, (table, transposed) in tied_output_pairs(model).items()}


def tied_output_pairs(model: ir.Model) -> dict:
    """``{name: (table name, transposed)}``: each ``MatMul`` / ``Gemm`` weight of ``model``
    (layout from :func:`weight_layouts`, never read by a ``Gather``) whose values equal, bit for
    bit, those of a table only ``Gather`` s read (:func:`_gather_tables`), transposed for an
    ``IN_OUT`` use (torch's exporter folds a tied ``lm_head``'s transpose of ``wte`` into a
    constant ``onnx::MatMul_N``)."""
    tables, _ = _gather_tables(model)
    if not tables:
        return {}
    values = {}
    for value in model.graph.initializers.values():
        values.setdefault(value.name, value)
    for node in model.graph.all_nodes():
        for value in node.outputs:
            if value.name and stored_tensor(value) is not None:
                values.setdefault(value.name, value)
    shapes = {}
    for name in tables:
        tensor = stored_tensor(values[name]) if name in values else None
        if tensor is not None:
            shapes.setdefault(tuple(int(d) for d in tensor.shape), []).append((name, tensor))
    out = {}
    for name, layout in weight_layouts(model).items():
        if layout not in (IN_OUT, OUT_IN) or name in tables or name not in values:
            continue
        tensor = stored_tensor(values[name])
        shape = tuple(int(d) for d in tensor.shape)
        want = shape[::-1] if layout == IN_OUT else shape
        for table, table_tensor in shapes.get(want, ()):
            if table_tensor.dtype != tensor.dtype:
                continue
            mine, theirs = tensor.numpy(), table_tensor.numpy()
            if np.array_equal(mine, theirs.T if layout == IN_OUT else theirs, equal_nan=mine.dtype.kind == "f"):
                out[name] = (table, layout == IN_OUT)
                break
    return out


def default_lora_skips(model: ir.Model) -> dict:
    """``{name: reason}`` of the 2-d weights :func:`~onnxparam.lora.apply_lora`'s default
    (every-param) group leaves without an adapter although their graph gives them a layout, as
    PEFT's defaults target linear layers only: position tables (:func:`position_tables`),
    embeddings of the inputs (:func:`embedding_tables`) and output projections tied to an
    embedding (:func:`tied_output_tables`)."""
    return {**position_tables(model), **embedding_tables(model), **tied_output_tables(model)}
