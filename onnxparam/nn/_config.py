"""Helpers shared by the layer configs: ``with_*`` copies and argument normalization."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

__all__ = [
    "config", "derived_config", "layer_from_config", "pair", "positive", "spatial", "padding_2d", "check_float_dtype",
]

PaddingSpec = Union[str, int, tuple]


def config(cls):
    """Make ``cls`` a frozen dataclass and add a ``with_<field>(value)`` copy for every field.

    NOTE: generated rather than hand-written so that the one builder convention of the project
    (frozen config + ``with_*`` copies, Burn's ``#[derive(Config)]``) cannot drift field by field.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    for f in dataclasses.fields(cls):
        name = f"with_{f.name}"
        if name in cls.__dict__:
            continue

        def with_field(self, value, _name=f.name):
            return dataclasses.replace(self, **{_name: value})

        with_field.__name__ = name
        with_field.__qualname__ = f"{cls.__name__}.{name}"
        with_field.__doc__ = f"A copy of this config with ``{f.name} = value``."
        setattr(cls, name, with_field)
    return cls


def derived_config(name: str, base, module: str, doc: str, *, drop: tuple = (), insert_after: Optional[dict] = None,
                   methods: Optional[dict] = None):
    """A :func:`config` class ``name`` (defined in ``module``) whose fields are ``base``'s, in
    ``base``'s order and with its defaults, without those in ``drop``; ``insert_after`` maps a
    field of ``base`` to new fields ``[(name, type, default), ...]`` placed right after it;
    ``methods`` are added to the class (its ``init``).

    NOTE: for configs that Burn defines as another config's fields with one more or one fewer
    (``BiLstmConfig`` is ``LstmConfig`` without ``reverse``, ``DeformConv2dConfig`` is
    ``Conv2dConfig`` with two kinds of groups): the field lists cannot drift apart.
    """
    annotations: dict = {}
    namespace: dict = {}
    for f in dataclasses.fields(base):
        if f.name not in drop:
            annotations[f.name] = f.type
            if f.default is not dataclasses.MISSING:
                namespace[f.name] = f.default
        for new, kind, default in (insert_after or {}).get(f.name, ()):
            annotations[new] = kind
            namespace[new] = default
    namespace.update(methods or {}, __annotations__=annotations, __doc__=doc, __module__=module, __qualname__=name)
    return config(type(name, (), namespace))


def layer_from_config(config, layer_cls, **extra):
    """``layer_cls(**fields of config, **extra)``: a config's ``init`` when its layer takes
    exactly the config's fields (by name) plus ``extra`` (``device``, ``dtype``)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return layer_cls(**fields, **extra)


def positive(value, name: str) -> int:
    """``value`` as an int > 0, or ``ValueError`` naming the argument."""
    if isinstance(value, bool) or int(value) != value or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def pair(value, name: str, minimum: int = 1) -> tuple[int, int]:
    """An int or a 2-sequence of ints as a pair; each element must be >= ``minimum``."""
    items = (value, value) if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
    if len(items) != 2 or any(isinstance(v, bool) or int(v) != v or int(v) < minimum for v in items):
        raise ValueError(f"{name} must be an int or a pair of ints >= {minimum}; got {value!r}")
    return int(items[0]), int(items[1])


def spatial(value, name: str, rank: int, minimum: int = 1):
    """A size argument of a rank-``rank`` layer: an int for rank 1, else a ``rank``-tuple (an
    int means the same in every dim); each entry an int >= ``minimum`` (1 or 0).

    Raises:
        ValueError: naming ``name``, for a wrong count, a bool, a non-integer or a value below
            ``minimum``.
    """
    if rank == 1:
        if minimum == 1:
            return positive(value, name)
        if isinstance(value, bool) or int(value) != value or int(value) < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
        return int(value)
    if rank == 2:
        return pair(value, name, minimum)
    items = (value,) * rank if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
    if len(items) != rank or any(isinstance(v, bool) or int(v) != v or int(v) < minimum for v in items):
        raise ValueError(f"{name} must be an int or a triple of ints >= {minimum}; got {value!r}")
    return tuple(int(v) for v in items)


def padding_2d(padding: PaddingSpec, kernel_size: tuple, dilation: tuple, stride: tuple) -> tuple[int, int]:
    """Burn's ``PaddingConfig2d`` as explicit symmetric padding ``(pad_h, pad_w)``.

    ``"valid"`` is no padding; ``"same"`` is ``dilation * (kernel - 1) / 2`` per dim, which keeps
    the spatial size for stride 1 (Burn's ``PaddingConfig2d::Same``); an int or a pair is explicit.

    Raises:
        ValueError: for an unknown spelling, ``"same"`` with an even (dilated) kernel extent or a
            stride other than 1 (Burn supports symmetric padding only).
    """
    if isinstance(padding, str):
        kind = padding.lower()
        if kind == "valid":
            return 0, 0
        if kind == "same":
            spans = [d * (k - 1) for k, d in zip(kernel_size, dilation, strict=True)]
            if any(s % 2 for s in spans):
                raise ValueError(
                    f"'same' padding needs an odd kernel extent, got kernel_size={tuple(kernel_size)} with "
                    f"dilation={tuple(dilation)}: only symmetric padding is supported (as in Burn); "
                    "pass explicit padding instead"
                )
            if any(s != 1 for s in stride):
                raise ValueError(
                    f"'same' padding keeps the size only for stride 1, got stride={tuple(stride)}; "
                    "pass explicit padding instead"
                )
            return spans[0] // 2, spans[1] // 2
        raise ValueError(f"unknown padding {padding!r}: expected 'valid', 'same', an int or a pair of ints")
    return pair(padding, "padding", minimum=0)


def check_float_dtype(dtype, layer: str):
    """``dtype`` as a float :class:`~onnxparam.DType`, or ``ValueError``."""
    from ..core.dtype import DType

    dtype = dtype if isinstance(dtype, DType) else DType(dtype)
    if not dtype.is_float or dtype is DType.QFloat:
        raise ValueError(
            f"{layer} params must have a plain float dtype (F32, F16, BF16, F64); got {dtype.name}; "
            "quantize a module after building it with Module.quantize_weights"
        )
    return dtype
