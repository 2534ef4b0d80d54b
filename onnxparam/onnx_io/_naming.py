"""ONNX names <-> module paths: a stable, reversible escaping.

A module path is ``.``-separated segments, each segment made of ``[A-Za-z0-9_]`` only, never
empty and never starting with ``_`` (attributes starting with ``_`` are private to a
:class:`~onnxparam.Module` and never traversed). ONNX names are free-form strings: PyTorch writes
``layer1.0.conv1.weight``, TensorFlow and JAX ``dense/kernel:0``, Caffe2 ``gpu_0/conv1_w_0``,
PyTorch's TorchScript exporter ``onnx::Conv_123``. :func:`onnx_name_to_path` maps every string to
a path and :func:`path_to_onnx_name` maps it back; the pair is a bijection, a pure function of
the one name (no table, no dependence on the other names of the model), so a burnpack or
safetensors file written from an imported module can be put back into the original graph by
name alone.

The scheme, in order:

1. **Scope separator.** A name without ``/`` is split on ``.``, so PyTorch names and every name
   this library exports (``conv1.weight``) map to themselves. A name with ``/`` is split on
   ``/`` instead (its ``.`` characters are escaped as in step 2), and its last segment ends with
   the *slash mark* ``_x_`` so the decoder knows which separator to restore::

       layer1.0.conv1.weight          ->  layer1.0.conv1.weight
       gpu_0/conv1_w_0                ->  gpu_0.conv1_w_0_x_
       MagikaV2/Dense_0/Reshape:0     ->  MagikaV2.Dense_0.Reshape_x3a_0_x_

2. **Characters.** Inside a segment, ASCII letters and digits are kept; ``_`` is kept unless the
   next character is ``x``; every other character (and a ``_`` before ``x``) is written as
   ``_x<hex>_``, the lowercase hexadecimal Unicode code point without leading zeros:
   ``:`` -> ``_x3a_``, ``-`` -> ``_x2d_``, ``.`` (in a ``/`` name) -> ``_x2e_``,
   ``box_x`` -> ``box_x5f_x``. As a literal ``_x`` never survives step 2, ``_x`` always starts an
   escape, and ``_x_`` (an escape with no digits) is free to be the slash mark of step 1.

3. **Segment guard.** A segment (with its slash mark, if any) that would be empty, start with
   ``_`` or with ``x_``, or equal one of :data:`RESERVED_SEGMENTS` (the public attribute names of ``Module`` and
   ``OnnxModule``, which a child attribute must not shadow) gets the prefix ``x_``:
   ``_orig`` -> ``x__orig``, ``map`` -> ``x_map``, ``x_y`` -> ``x_x_y``, ``a//b`` ->
   ``a.x_.b_x_``, ``a/x`` -> ``a.x_x_x_``. The decoder strips one leading ``x_``.

Decoding parses left to right; :func:`path_to_onnx_name` accepts only the canonical path of some
name (it re-encodes its result and compares), so the two functions stay exact inverses.

NOTE: :data:`RESERVED_SEGMENTS` is a frozen list, written out here, not computed from the
classes: names must not change when a method is added to ``Module``. A test checks that every
public attribute of ``Module`` and ``OnnxModule`` is listed, so additions are noticed; adding a
word changes the path of names equal to that word only.
"""

from __future__ import annotations

import re

__all__ = [
    "PATH_SEPARATOR",
    "ONNX_SCOPE_SEPARATOR",
    "ESCAPE_PREFIX",
    "ESCAPE_SUFFIX",
    "SLASH_MARK",
    "GUARD_PREFIX",
    "RESERVED_SEGMENTS",
    "onnx_name_to_path",
    "path_to_onnx_name",
    "is_valid_path",
    "tree_order",
]

PATH_SEPARATOR = "."
"""Separator of module path segments (and of PyTorch-style ONNX names, kept as they are)."""

ONNX_SCOPE_SEPARATOR = "/"
"""Scope separator of TensorFlow / JAX / Caffe2 / Paddle ONNX names."""

ESCAPE_PREFIX = "_x"
"""Starts an escaped character: ``_x<lowercase hex code point>_``."""

ESCAPE_SUFFIX = "_"
"""Ends an escaped character."""

SLASH_MARK = ESCAPE_PREFIX + ESCAPE_SUFFIX
"""``_x_``: ends the last segment of a path whose name was split on ``/``."""

GUARD_PREFIX = "x_"
"""Prefixed to a segment that is empty, starts with ``_`` / ``x_`` or is reserved."""

RESERVED_SEGMENTS = frozenset({
    # Module (onnxparam/core/module.py, the verbs installed by onnxparam/_assembly.py)
    "forward", "named_params", "named_modules", "visit", "map", "num_params", "to_device", "fork",
    "collect_devices", "devices", "no_grad", "freeze_group", "unfreeze_group", "train", "valid",
    "from_inner", "training", "into_record", "try_load_record", "load_record", "save_file",
    "try_load_file", "load_file", "apply_lora", "merge_lora", "quantize_weights",
    "quantize_weights_group", "apply_qlora", "extra_repr",
    # named LoRA adapters on Module (onnxparam/lora/_adapters.py)
    "add_adapter", "set_adapter", "disable_adapter", "delete_adapter", "lora_adapters", "active_adapter",
    # OnnxModule / OnnxScope (onnxparam/onnx_io/_importer.py)
    "onnx_opset_imports", "onnx_names", "path_of", "param_of", "input_names", "output_names",
    "override_names", "input_specs", "ir_model", "source_path", "lora_transposed_paths",
    "lora_weight_layouts", "lora_default_skips", "onnx_tables", "onnx_ties", "onnx_folded_norms",
})
"""Segments that get the ``x_`` guard because a child attribute of that name would shadow a
method or property of the module classes (see the module docstring's NOTE)."""

_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_]+$")


def _is_plain(ch: str) -> bool:
    return ch.isascii() and ch.isalnum()


def _encode_segment(raw: str, slash_mark: bool = False) -> str:
    out = []
    for i, ch in enumerate(raw):
        if _is_plain(ch):
            out.append(ch)
        elif ch == "_" and raw[i + 1:i + 2] != "x":
            out.append("_")
        else:
            out.append(f"{ESCAPE_PREFIX}{ord(ch):x}{ESCAPE_SUFFIX}")
    if slash_mark:
        out.append(SLASH_MARK)
    encoded = "".join(out)
    # NOTE: the guard looks at the segment with its slash mark: "x" + "_x_" starts with "x_".
    if not encoded or encoded.startswith("_") or encoded.startswith(GUARD_PREFIX) or encoded in RESERVED_SEGMENTS:
        encoded = GUARD_PREFIX + encoded
    return encoded


def onnx_name_to_path(name: str) -> str:
    """The module path of an ONNX name (see the module docstring for the scheme).

    Args:
        name: any ONNX initializer / value name.

    Returns:
        a path of ``[A-Za-z0-9_]`` segments joined by ``.``; ``name`` itself when it already is
        a path whose segments need no escape (``conv1.weight``, ``layers.0.bias``).
    """
    slash = ONNX_SCOPE_SEPARATOR in name
    parts = name.split(ONNX_SCOPE_SEPARATOR if slash else PATH_SEPARATOR)
    last = len(parts) - 1
    return PATH_SEPARATOR.join(_encode_segment(part, slash and i == last) for i, part in enumerate(parts))


def _decode_segment(segment: str, path: str) -> tuple[str, bool]:
    """``(raw text, ends with the slash mark)`` of one encoded segment."""
    if not _SEGMENT_RE.match(segment):
        raise ValueError(f"{path!r} is not a module path: segment {segment!r} has characters outside [A-Za-z0-9_]")
    if segment.startswith(GUARD_PREFIX):
        segment = segment[len(GUARD_PREFIX):]
    out = []
    i = 0
    n = len(segment)
    while i < n:
        if segment.startswith(ESCAPE_PREFIX, i):
            end = segment.find(ESCAPE_SUFFIX, i + len(ESCAPE_PREFIX))
            if end < 0:
                raise ValueError(f"{path!r} is not a module path made by onnx_name_to_path: unterminated escape in {segment!r}")
            digits = segment[i + len(ESCAPE_PREFIX):end]
            if not digits:
                if end + 1 != n:
                    raise ValueError(f"{path!r} is not a module path made by onnx_name_to_path: "
                                     f"the slash mark {SLASH_MARK!r} may only end a path")
                return "".join(out), True
            try:
                out.append(chr(int(digits, 16)))
            except ValueError:
                raise ValueError(f"{path!r} is not a module path made by onnx_name_to_path: "
                                 f"bad escape {segment[i:end + 1]!r}") from None
            i = end + 1
        else:
            out.append(segment[i])
            i += 1
    return "".join(out), False


def path_to_onnx_name(path: str) -> str:
    """The ONNX name whose module path is ``path`` (the inverse of :func:`onnx_name_to_path`).

    Raises:
        ValueError: when ``path`` is not the path of any name (bad characters, an empty
            segment, a malformed escape, or a non-canonical spelling such as ``_x3A_``).
    """
    segments = path.split(PATH_SEPARATOR)
    decoded = [_decode_segment(seg, path) for seg in segments]
    marks = [mark for _, mark in decoded]
    if any(marks[:-1]):
        raise ValueError(f"{path!r} is not a module path made by onnx_name_to_path: "
                         f"the slash mark {SLASH_MARK!r} may only end the last segment")
    slash = marks[-1]
    name = (ONNX_SCOPE_SEPARATOR if slash else PATH_SEPARATOR).join(raw for raw, _ in decoded)
    if onnx_name_to_path(name) != path:
        raise ValueError(f"{path!r} is not the canonical module path of any ONNX name "
                         f"(the canonical path of {name!r} is {onnx_name_to_path(name)!r})")
    return name


def is_valid_path(path: str) -> bool:
    """True when ``path`` is ``.``-joined non-empty ``[A-Za-z0-9_]`` segments, none starting with ``_``."""
    return all(seg and _SEGMENT_RE.match(seg) and not seg.startswith("_") for seg in path.split(PATH_SEPARATOR))


def tree_order(paths) -> list:
    """``paths`` in the order a module tree built from them visits its params.

    The tree has one scope per path prefix, children in first-seen order (as
    ``OnnxModule`` builds it); a path that is also the prefix of another path is a param, and
    the longer path stays whole at that level (a dotted attribute), after the prefix's siblings
    seen before it. Depth first, like :func:`onnxparam.core.module.named_params`.
    """
    paths = list(paths)
    is_param = set(paths)
    root: dict = {}
    for path in paths:
        segments = path.split(PATH_SEPARATOR)
        node = root
        i = 0
        while i < len(segments) - 1:
            if PATH_SEPARATOR.join(segments[:i + 1]) in is_param:
                break
            node = node.setdefault(segments[i], {})
            i += 1
        node[PATH_SEPARATOR.join(segments[i:])] = path
    order: list = []

    def walk(node: dict) -> None:
        for child in node.values():
            if isinstance(child, dict):
                walk(child)
            else:
                order.append(child)

    walk(root)
    return order
