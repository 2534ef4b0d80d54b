"""ONNX map types (``map(K, V)``) in ``onnx_ir``, which reads and writes no map type.

``onnx_ir`` 1.x raises ``NotImplementedError("Map types are not supported yet")`` for a value
whose declared type holds a ``map_type`` (the ONNX-ML ``ZipMap``, ``DictVectorizer`` and
``CastMap`` operators make or take ``map(int64, float)`` / ``seq(map(string, float))``; the
ONNX IR spec, "Types"), so such a model would not load at all. :func:`install` teaches its
serde one more type: :class:`MapType` (key: a ``DataType``; value: any ``onnx_ir`` type)
is read from, and written back to, the same ``TypeProto`` fields (verbatim), so the graph exports
as it came in and ONNX Runtime gets the declared type. A map has no shape (``deserialize_type_proto_for_shape``
gives ``None`` for it). ONNX Runtime hands a map output over as a Python ``dict`` and a sequence
of maps as a ``list`` of them.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir import serde

__all__ = ["MapType", "install"]


class MapType:
    """The ONNX type ``map(key_type, value_type)`` (ONNX IR spec: MapProto / TypeProto.Map).

    Attributes:
        key_type: the key's element type (an integer type or ``STRING``).
        value_type: the value's type (a ``TensorType``, ``SequenceType``, :class:`MapType` ...).
        denotation: the type denotation, or ``None``.
        source: the ``TypeProto.Map`` it was read from, written back verbatim (``onnx_ir``'s types
            hold no shape, and a map's value type may declare one); ``None`` for a new type.
    """

    __slots__ = ("key_type", "value_type", "denotation", "source")

    def __init__(self, key_type: ir.DataType, value_type, *, denotation=None, source=None) -> None:
        self.key_type = key_type
        self.value_type = value_type
        self.denotation = denotation
        self.source = source

    @property
    def elem_type(self):
        return self.value_type

    @property
    def dtype(self) -> ir.DataType:
        """The value type's element type (as ``onnx_ir``'s sequence types give their element's)."""
        return self.value_type.dtype

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MapType) and self.key_type == other.key_type
                and self.value_type == other.value_type)

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        return f"Map({self.key_type.name}, {self.value_type!r})"


def install() -> None:
    """Make ``onnx_ir.serde`` read and write :class:`MapType` (idempotent).

    NOTE: the three serde functions are replaced on the module, where ``onnx_ir`` looks them up
    at each call (its sequence and optional types recurse through the module global), so a map
    nested in a sequence or an optional is handled too. Every other type goes to the original.
    """
    if getattr(serde, "_onnxparam_map_type", False):
        return
    read_type = serde.deserialize_type_proto_for_type
    read_shape = serde.deserialize_type_proto_for_shape
    write_type = serde.serialize_type_into

    def deserialize_type_proto_for_type(proto):
        if proto.HasField("map_type"):
            value = serde.deserialize_type_proto_for_type(proto.map_type.value_type)
            if value is None:
                raise ValueError(f"a map type must declare its value type: {proto}")
            denotation = proto.denotation if proto.HasField("denotation") else None
            source = type(proto.map_type)()
            source.CopyFrom(proto.map_type)
            return MapType(ir.DataType(proto.map_type.key_type), value, denotation=denotation, source=source)
        return read_type(proto)

    def deserialize_type_proto_for_shape(proto):
        if proto.HasField("map_type"):
            return None
        return read_shape(proto)

    def serialize_type_into(type_proto, from_) -> None:
        if isinstance(from_, MapType):
            if from_.denotation:
                type_proto.denotation = from_.denotation
            if from_.source is not None:
                type_proto.map_type.CopyFrom(from_.source)
            else:
                type_proto.map_type.key_type = from_.key_type.value
                serde.serialize_type_into(type_proto.map_type.value_type, from_.value_type)
            return
        write_type(type_proto, from_)

    serde.deserialize_type_proto_for_type = deserialize_type_proto_for_type
    serde.deserialize_type_proto_for_shape = deserialize_type_proto_for_shape
    serde.serialize_type_into = serialize_type_into
    serde._onnxparam_map_type = True
