"""Which tensor of a PyTorch state dict is which weight of an imported ONNX model whose exporter
renamed it, decided by evidence only (used by :func:`~onnxparam.convert.load_pytorch`).

torch's TorchScript exporter folds ``nn.Linear``'s weight transpose (a ``Linear`` without a
bias, or applied to a 3-d input) and a tied ``lm_head``'s into a new initializer
``onnx::MatMul_N``; the dynamo exporter names such a folded weight ``val_N``. The checkpoint
still calls it ``<module>.weight``, ``(out, in)``. The graph says which module it belongs to:

* the node consuming it is named ``/<module path>/MatMul`` (TorchScript), or carries dynamo's
  ``name_scopes`` of an ``aten.linear`` node, or its output gets ``<module>.bias`` added
  (:func:`onnxparam.lora._peft.linear_alias_pairs`, the evidence PEFT loading reads too);
* else the checkpoint tensor whose values equal the weight's, as stored or transposed (the
  checkpoint the model was exported from);
* else, for an output projection the file ties to an embedding table (its values are the
  table's transposed: :func:`onnxparam.lora._tables.tied_output_pairs`), the tensor
  the table loads, transposed (a checkpoint that stores a tied ``lm_head`` once, as
  ``save_model`` of ``safetensors`` and Hugging Face's ``model.safetensors`` do).

A candidate must fit the weight's shape, as stored or transposed. The orientation comes from the
shapes when they differ, else from equal values; a square weight whose values match neither way
is not decided (a fine-tuned checkpoint of a square ``Linear``: nothing says which axis is
which). Everything not decided (no candidate, several, a square weight without values to tell)
is reported with its reason and left to the caller; nothing is guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

__all__ = ["RenamedMatch", "match_renamed_weights"]


@dataclass(frozen=True)
class RenamedMatch:
    """A renamed weight's checkpoint tensor: ``source`` (the state-dict name) loads into the
    param at ``path`` transposed or not; ``why`` says what decided it."""

    path: str
    source: str
    transpose: bool
    why: str
    tie: bool = False
    """The file ties ``path`` to another weight that takes ``source`` too (it is shared)."""


def _imported_parts(module):
    """``(prefix, sub)`` of every imported graph in ``module`` (a module with ``ir_model`` and
    ``onnx_names``: an :class:`~onnxparam.OnnxModule`)."""
    from ..core.module import named_modules

    for prefix, sub in named_modules(module):
        if hasattr(type(sub), "ir_model") and hasattr(type(sub), "onnx_names"):
            yield prefix, sub


def graph_constant_paths(module) -> dict:
    """``{path: ONNX name}`` of the params of ``module``'s imported graphs whose data is a
    ``Constant`` node's tensor, not an initializer: torch's exporters write every module weight
    as an initializer, so no checkpoint holds these (the exporter's own constants:
    ``/attn/Constant_6_output_0``), nor the exporter's own 0-d constants frozen at import
    (``onnx::Mul_12``, dynamo's folded ``val_N``: :func:`onnxparam.autodiff._tables.find_scalar_constants`)."""
    from ..autodiff._tables import SCALAR_FOLDED, SCALAR_GENERATED

    made = (SCALAR_GENERATED.split("{}")[0], SCALAR_FOLDED.split("{}")[0])
    found = {}
    for prefix, sub in _imported_parts(module):
        initializers = set(sub.ir_model.graph.initializers)
        tables = sub.onnx_tables
        for path, name in sub.onnx_names.items():
            if name not in initializers or tables.get(path, "").startswith(made):
                found[f"{prefix}.{path}" if prefix else path] = name
    return found


def match_renamed_weights(module, shapes: Mapping[str, tuple], values: Callable[[str], np.ndarray],
                          loaded_by_name: Mapping[str, str], constants=()) -> tuple:
    """Match the renamed weights of ``module``'s imported graphs to checkpoint tensors.

    Args:
        module: the target module (its imported parts are searched).
        shapes: ``{checkpoint name: shape}`` of every tensor of the checkpoint.
        values: reads a checkpoint tensor's values (called only to compare candidates).
        loaded_by_name: ``{module path: checkpoint name}`` of the params the checkpoint has a
            tensor for by name (they are not renamed).
        constants: module paths that are graph constants (no checkpoint holds them).

    Returns:
        ``(matches, unmatched)``: a list of :class:`RenamedMatch`, and ``{path: why}`` for every
        renamed 2-d weight left undecided (its reason names the candidates).
    """
    from ..core.module import named_params
    from ..lora._peft import linear_alias_pairs

    params = dict(named_params(module))
    taken = set(loaded_by_name.values())
    free = {name for name in shapes if name not in taken}
    matches, unmatched, claimed = [], {}, {}
    for prefix, sub in _imported_parts(module):
        join = (lambda p, _pre=prefix: f"{_pre}.{p}" if _pre else p)
        by_name = {name: join(path) for path, name in sub.onnx_names.items()}
        aliases: dict = {}
        for alias, name in linear_alias_pairs(sub.ir_model):
            aliases.setdefault(name, [])
            # the checkpoint of the exported model itself, or of a module holding it at ``prefix``
            for candidate in (alias, join(alias)):
                if candidate in free and candidate not in aliases[name]:
                    aliases[name].append(candidate)
        open_paths = []
        for name, path in by_name.items():
            if path in loaded_by_name or path in constants or path not in params:
                continue
            shape = tuple(int(d) for d in params[path].lazy_shape())
            if len(shape) != 2 or not params[path].lazy_dtype().is_float:
                continue
            open_paths.append(path)
            if not _renamed(name):
                continue  # a torch name the checkpoint lacks: simply missing (unless tied, below)
            found = _decide(path, shape, params[path], aliases.get(name, []), free, shapes, values)
            if isinstance(found, RenamedMatch):
                matches.append(found)
            elif found is not None:
                unmatched[path] = found
        decided = {m.path: m for m in matches}
        if any(p not in decided for p in open_paths):
            for tie in _tie_matches(sub.ir_model, by_name, params, shapes, loaded_by_name, decided):
                matches.append(tie)
                unmatched.pop(tie.path, None)
    for m in matches:
        if not m.tie:  # a tie shares its tensor with the weight it is tied to, by design
            claimed.setdefault(m.source, []).append(m.path)
    for source, paths in claimed.items():
        if len(paths) > 1:  # one checkpoint tensor for two weights: no evidence says which
            for m in [m for m in matches if m.source == source]:
                matches.remove(m)
                unmatched[m.path] = (f"the checkpoint tensor {source!r} fits {len(paths)} renamed weights "
                                     f"({', '.join(repr(p) for p in paths)}); nothing tells which")
    return matches, unmatched


def _renamed(name: str) -> bool:
    """Whether ``name`` is one torch's exporters make up for a folded weight: ``onnx::<Op>_N``
    (TorchScript) or ``val_N`` (dynamo)."""
    return name.startswith("onnx::") or bool(re.fullmatch(r"val_\d+", name))


def _tie_matches(model, by_name: Mapping, params: Mapping, shapes: Mapping, loaded_by_name: Mapping,
                 decided: Mapping) -> list:
    """:class:`RenamedMatch` es from the ties of ``model``'s file (an output projection whose
    values are an embedding table's transposed: :func:`~onnxparam.lora._tables.tied_output_pairs`):
    when one side of a tie has no checkpoint tensor and the other has one (by name, or matched),
    the missing side takes that tensor, transposed relative to it (a checkpoint storing a tied
    pair once)."""
    from ..lora._tables import tied_output_pairs

    def source_of(path):
        if path in loaded_by_name:
            return loaded_by_name[path], False
        if path in decided:
            return decided[path].source, decided[path].transpose
        return None

    found = []
    for head_name, (table_name, transposed) in tied_output_pairs(model).items():
        head, table = by_name.get(head_name), by_name.get(table_name)
        if not transposed or head is None or table is None:
            continue
        for missing, other in ((head, table), (table, head)):
            known = source_of(other)
            if source_of(missing) is not None or known is None or missing not in params:
                continue
            source, other_transposed = known
            transpose = not other_transposed  # the two sides are each other's transpose in the file
            shape = tuple(int(d) for d in params[missing].lazy_shape())
            if (tuple(shapes[source])[::-1] if transpose else tuple(shapes[source])) == shape:
                found.append(RenamedMatch(missing, source, transpose, f"the file ties it to {other!r} (its values "
                                                                      f"are {other!r}'s transposed)", tie=True))
    return found


def _fits(shape: tuple, source_shape: tuple) -> bool:
    return source_shape in (shape, shape[::-1])


def _equal(mine: np.ndarray, theirs: np.ndarray, transpose: bool) -> bool:
    other = theirs.T if transpose else theirs
    return other.shape == mine.shape and np.array_equal(mine, other, equal_nan=mine.dtype.kind == "f")


def _decide(path: str, shape: tuple, param, named: list, free: set, shapes: Mapping, values: Callable):
    """A :class:`RenamedMatch` for the param at ``path``, a reason it is undecided, or ``None``
    when the checkpoint has nothing of its shape (then it is simply missing)."""
    named = [n for n in named if _fits(shape, tuple(shapes[n]))]
    mine = None

    def own():
        nonlocal mine
        if mine is None:
            mine = np.asarray(param.val().to_numpy())
        return mine

    if len(named) == 1:
        source = named[0]
        orientation = _orientation(shape, tuple(shapes[source]), own, lambda: values(source))
        if isinstance(orientation, bool):
            return RenamedMatch(path, source, orientation, "the graph names its module"
                                + (" and the shapes are transposed" if orientation else ""))
        return f"the graph names {source!r} for it, but {orientation}"
    pool = named if named else [n for n in sorted(free) if _fits(shape, tuple(shapes[n]))]
    if not pool:
        return None
    equal = []
    for source in pool:
        theirs = np.asarray(values(source))
        for transpose in ((False, True) if shape[0] == shape[1] else (tuple(shapes[source]) != shape,)):
            if theirs.dtype == own().dtype and _equal(own(), theirs, transpose):
                equal.append((source, transpose))
    if len(equal) == 1:
        source, transpose = equal[0]
        return RenamedMatch(path, source, transpose, "its values equal the checkpoint tensor's"
                            + (" transposed" if transpose else ""))
    listed = ", ".join(repr(n) for n in pool[:4]) + (f" and {len(pool) - 4} more" if len(pool) > 4 else "")
    if len(equal) > 1:
        return f"its values equal several checkpoint tensors ({', '.join(repr(s) for s, _ in equal)}); nothing tells which"
    if named:
        return f"the graph names several checkpoint tensors for it ({listed}) and no values tell which"
    return (f"renamed by the exporter ({shape[0]}x{shape[1]}); no node names its module and no checkpoint tensor of "
            f"its shape has its values ({listed} fit the shape)")


def _orientation(shape: tuple, source_shape: tuple, mine: Callable, theirs: Callable):
    """``True`` (transpose the checkpoint tensor), ``False`` (as stored), or why neither is known."""
    if shape != shape[::-1]:
        return source_shape != shape
    a, b = mine(), np.asarray(theirs())
    if a.dtype == b.dtype and _equal(a, b, False):
        return False  # (a symmetric matrix equals it both ways: either is right)
    if a.dtype == b.dtype and _equal(a, b, True):
        return True
    return (f"it is square ({shape[0]}x{shape[1]}) and the checkpoint's values equal it neither as stored nor "
            "transposed, so nothing tells its orientation; load it with the orientation you know (a dict entry: "
            "state[name].T for nn.Linear's (out, in) weight)")
