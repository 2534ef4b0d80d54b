"""What every weight-file reader refuses and every writer refuses to write: one rule for all.

A tensor's *name* must be non-empty text that UTF-8 can encode (a lone surrogate such as
``"\\ud800"`` cannot be written to any of the formats, nor become an ONNX initializer name); its
*shape* must have at most :data:`MAX_RANK` dims (numpy's limit), and an empty shape (a 0 dim)
must not declare other dims spanning more than :data:`MAX_EMPTY_SPAN_BYTES` (numpy refuses
``float32 [0, 2**62]`` with "array is too big"; burnpack's reader refuses spans over its 10 GiB
tensor limit). Readers (burnpack, safetensors, PyTorch checkpoints) and writers (burnpack,
safetensors) call :func:`tensor_problem`, so a file one of them writes is a file they all read.
"""

from __future__ import annotations

__all__ = ["MAX_RANK", "MAX_EMPTY_SPAN_BYTES", "is_utf8_text", "name_problem", "shape_problem", "tensor_problem"]

MAX_RANK = 64
"""numpy's largest number of dims (``NPY_MAXDIMS`` of numpy 2); Burn's tensors have fewer."""

MAX_EMPTY_SPAN_BYTES = 10 * 1024**3
"""For a shape holding a 0 dim: the most bytes its other dims may span (burnpack's
``MAX_TENSOR_BYTES``, 10 GiB). NOTE: such a tensor holds no bytes, but numpy cannot always build
it, and burnpack's reader refuses it: refusing it everywhere keeps the formats interchangeable."""


def is_utf8_text(text) -> bool:
    """``text`` is a ``str`` that UTF-8 can encode (no lone surrogate); metadata keys and values
    must be, though they may be empty."""
    try:
        text.encode("utf-8")
    except (UnicodeEncodeError, AttributeError):
        return False
    return True


def name_problem(name) -> "str | None":
    """Why ``name`` cannot name a tensor in a file, or ``None``."""
    if not isinstance(name, str):
        return f"the tensor name {name!r} is not text"
    if not name:
        return "a tensor has an empty name"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"the tensor name {name!r} is not valid Unicode ({e.reason}: a lone surrogate)"
    return None


def shape_problem(shape, itemsize: int = 1) -> "str | None":
    """Why ``shape`` (non-negative ints, checked by the caller) cannot be a tensor's, or ``None``."""
    if len(shape) > MAX_RANK:
        return f"shape has {len(shape)} dims, more than the {MAX_RANK} numpy supports"
    if 0 in shape:
        span = max(1, itemsize)
        for dim in shape:
            span *= dim or 1
        if span > MAX_EMPTY_SPAN_BYTES:
            return (f"shape {list(shape)} is empty, but its other dims span {span} bytes, more than the "
                    f"{MAX_EMPTY_SPAN_BYTES}-byte limit (no array can have that shape)")
    return None


def tensor_problem(name, shape, itemsize: int = 1) -> "str | None":
    """:func:`name_problem`, then :func:`shape_problem`, as one line naming the tensor."""
    problem = name_problem(name)
    if problem is not None:
        return problem
    problem = shape_problem(shape, itemsize)
    return None if problem is None else f"tensor {name!r}: {problem}"
