"""Structure-aware mutations of every file format the library reads.

Byte flips (``tools/fuzz.py``) mostly break a file's framing and stop at the first parser. The
mutations here keep the framing valid and change one *structural* thing the readers must check:

* ``onnx``         the protobuf of a small model with an ``If`` (subgraphs), a ``Constant`` and
                   two initializers: attribute types set to UNDEFINED or swapped, dangling node
                   inputs, duplicate names, cycles, huge / negative dims, ``raw_data`` of the
                   wrong length, external data outside the folder, with NUL in its location or
                   past the end of its file, unknown element types, bad opsets and domains,
                   missing subgraph attributes, ``If`` nested 1,000 deep, ``ref_attr_name``
                   outside a function, ``Constant`` nodes with wrong or missing values.
* ``burnpack``     the CBOR metadata of a small ``.bpk`` (re-encoded, header re-written): shapes
                   of more than 64 dims, ``[0, 2**62]``, names empty / invalid UTF-8, offsets
                   past the end, unknown dtypes, bad metadata and scalar values.
* ``safetensors``  the JSON header: the same shape / name / offset / dtype changes, lone
                   surrogates (``"\\ud800"``), bad ``__metadata__``.
* ``peft``         PEFT adapter folders: ``adapter_config.json`` values and options (DoRA,
                   lora_bias, trainable tokens ...), factor names, shapes and dtypes.
* ``onnx_adapter`` ONNX Runtime adapter files that fit a ``lora="inputs"`` export or not, and
                   valid ones cut short or with changed header bytes.
* ``pt``           ``torch.save`` checkpoints assembled opcode by opcode, in each of torch's
                   three containers (zip archive, legacy stream, legacy tar): sizes, strides,
                   offsets, storage classes and keys, names, element counts, storage views.

A *case* passes when the reader either accepts the file (every value is then read, and an
accepted weights file is converted into the other weight formats, which must read back) or
raises the library's error of its format, with a non-empty message naming the file. Any other
exception, or a message that does not name the file, is a *finding*.

``tests/test_fuzz_structured.py`` runs 1,000 seeded cases per format; ``tools/fuzz.py --targets
onnx-structured,...`` runs as many as asked (``--cases``; 10,000 per format by default there).
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
import struct
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["FORMATS", "Finding", "run_format"]


# -- ONNX ----------------------------------------------------------------------------------------

_ONNX_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 4] x, bool c) => (float[2, 4] y) <float[4] w = {1, 2, 3, 4}, float[4] b = {0, 0, 0, 1}> {
    t = Mul(x, w)
    k = Constant<value_float = 2.0>()
    u = Mul(t, k)
    v = Add(u, b)
    y = If(c) <then_branch = g1 () => (float[2, 4] z) { z = Identity(v) },
               else_branch = g2 () => (float[2, 4] z2) { z2 = Neg(v) }>
}"""

_ONNX_BASE: list = []


def _onnx_base():
    import onnx
    import onnx.parser

    if not _ONNX_BASE:
        _ONNX_BASE.append(onnx.parser.parse_model(_ONNX_TEXT).SerializeToString())
    model = onnx.ModelProto()
    model.ParseFromString(_ONNX_BASE[0])
    return model


def _nodes(model):
    """Every node of the model, subgraphs included."""
    out = []

    def walk(graph):
        for node in graph.node:
            out.append(node)
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    return out


def _ld(field_number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)

    return varint(field_number << 3 | 2) + varint(len(payload)) + payload


def _nested_if(depth: int) -> bytes:
    """The base model whose output ``y`` comes from ``If`` nested ``depth`` deep in ``then_branch``.

    NOTE: assembled as bytes (protobuf messages concatenate): the Python protobuf runtime refuses
    to build messages nested deeper than 100, but a file can hold any depth."""
    from onnx import AttributeProto, TensorProto, helper

    leaf = helper.make_graph([helper.make_node("Identity", ["x"], ["o0"])], "leaf", [],
                             [helper.make_tensor_value_info("o0", TensorProto.FLOAT, [2, 4])])

    def if_node(output: str, then_bytes: bytes) -> bytes:
        node = helper.make_node("If", ["c"], [output], else_branch=leaf).SerializeToString()
        attr = AttributeProto(name="then_branch", type=AttributeProto.GRAPH).SerializeToString() + _ld(6, then_bytes)
        return node + _ld(5, attr)  # NodeProto.attribute

    inner = leaf.SerializeToString()
    for level in range(1, depth):
        graph = helper.make_graph([], f"l{level}", [], [helper.make_tensor_value_info(f"o{level}", TensorProto.FLOAT,
                                                                                    [2, 4])])
        inner = graph.SerializeToString() + _ld(1, if_node(f"o{level}", inner))  # GraphProto.node
    model = _onnx_base()
    model.graph.ClearField("node")
    model.graph.ClearField("initializer")
    graph = model.graph.SerializeToString() + _ld(1, if_node("y", inner))
    model.ClearField("graph")
    return model.SerializeToString() + _ld(7, graph)  # ModelProto.graph


def _mutate_onnx(rng: random.Random, folder: Path):
    """One structural change to the base model; returns the model (or raw bytes)."""
    from onnx import AttributeProto, TensorProto, helper

    model = _onnx_base()
    g = model.graph
    init = g.initializer[rng.randrange(len(g.initializer))]
    nodes = _nodes(model)
    kind = rng.randrange(26)
    if kind == 0:  # attribute type UNDEFINED or another kind than its value
        attrs = [a for n in nodes for a in n.attribute]
        attr = rng.choice(attrs)
        attr.type = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14])
    elif kind == 1:  # a dangling input
        node = rng.choice(nodes)
        if node.input:
            node.input[rng.randrange(len(node.input))] = rng.choice(["nowhere", "", "z", "o9"])
        else:
            node.input.append("nowhere")
    elif kind == 2:  # duplicate names: two producers of one value, an input named like an initializer
        choice = rng.randrange(4)
        if choice == 0:
            g.node[1].output[0] = "t"
        elif choice == 1:
            g.input[0].name = init.name
        elif choice == 2:
            g.initializer.add().CopyFrom(init)
        else:
            g.node.add().CopyFrom(g.node[0])
    elif kind == 3:  # a cycle
        if rng.random() < 0.5:
            g.node[0].input[0] = "v"  # t = Mul(v, w) while v depends on t
        else:
            g.node[0].input[0] = "t"  # t = Mul(t, w)
    elif kind == 4:  # huge / negative dims of an initializer
        init.dims[:] = rng.choice([[2**40], [2**62], [-1], [-4], [2, -2], [2**31, 2**31], [0], [4, 0, 2**62]])
    elif kind == 5:  # huge / negative / zero dims of a graph input or output
        value = rng.choice([g.input[0], g.output[0]])
        dims = value.type.tensor_type.shape.dim
        dims[rng.randrange(len(dims))].dim_value = rng.choice([-1, -7, 0, 2**62, 2**63 - 1])
    elif kind == 6:  # raw_data of the wrong length
        init.raw_data = np.arange(rng.choice([0, 1, 3, 5, 8]), dtype=np.float32).tobytes()[: rng.choice([3, 4, 12, 20])]
        init.ClearField("float_data")
    elif kind == 7:  # typed data of the wrong length
        del init.float_data[:]
        init.float_data.extend([1.0] * rng.choice([0, 1, 3, 5, 100]))
    elif kind in (8, 9, 10):  # external data: outside the folder, NUL, past EOF, bad keys
        data = folder / "w.data"
        data.write_bytes(np.arange(rng.choice([0, 2, 4, 64]), dtype=np.float32).tobytes())
        del init.float_data[:]
        init.ClearField("raw_data")
        init.data_location = TensorProto.EXTERNAL
        location = "w.data"
        if kind == 8:
            location = rng.choice(["../w.data", "/etc/hostname", "sub/../../w.data", "w\x00.data", "w.data\x00../x",
                                   "", ".", "..", "missing.data", "/", "w.data/"])
        keys = [("location", location)]
        if kind == 9 or rng.random() < 0.3:
            keys.append(("offset", str(rng.choice([0, 16, 256, 2**62, -8, 2**64]))))
            keys.append(("length", str(rng.choice([16, 8, 2**50, 0, -1]))))
        if kind == 10:
            keys.append((rng.choice(["checksum", "offset", "length", "bogus"]), rng.choice(["x", "1.5", "", "0x10"])))
        for key, value in keys:
            entry = init.external_data.add()
            entry.key, entry.value = key, value
    elif kind == 11:  # unknown element types
        target = rng.choice(["init", "input", "output", "cast"])
        bad = rng.choice([0, 8, 14, 15, 23, 27, 99, -1, 2**31 - 1])
        if target == "init":
            init.data_type = bad
        elif target == "input":
            g.input[0].type.tensor_type.elem_type = bad
        elif target == "output":
            g.output[0].type.tensor_type.elem_type = bad
        else:
            g.node.insert(0, helper.make_node("Cast", ["x"], ["xc"], to=bad))
    elif kind == 12:  # bad opsets
        model.opset_import[0].version = rng.choice([0, -3, 2**62, 1, 5, 10**6])
    elif kind == 13:  # bad domains
        choice = rng.randrange(3)
        if choice == 0:
            rng.choice(nodes).domain = rng.choice(["com.unknown", "ai.onnx.ml", "\x00", "x" * 300])
        elif choice == 1:
            model.opset_import[0].domain = "com.unknown"
        else:
            entry = model.opset_import.add()
            entry.domain, entry.version = "", rng.choice([1, 17, 22])
    elif kind == 14:  # missing subgraph attributes
        node = g.node[-1]
        names = [a.name for a in node.attribute]
        drop = rng.choice([names[:1], names[1:], names])
        keep = [a for a in node.attribute if a.name not in drop]
        del node.attribute[:]
        node.attribute.extend(keep)
    elif kind == 15:  # deeply nested If
        return _nested_if(rng.choice([50, 200, 1000]))
    elif kind == 16:  # ref_attr_name outside a function
        node = rng.choice([g.node[-1], g.node[1]])
        attr = node.attribute[0]
        attr.ref_attr_name = rng.choice(["then_branch", "x", ""]) or "r"
        if rng.random() < 0.5:
            attr.ClearField("g")
            attr.ClearField("f")
    elif kind == 17:  # Constant with a wrong, missing or doubled value
        const = g.node[1]
        del const.attribute[:]
        choice = rng.randrange(6)
        if choice == 1:
            const.attribute.append(helper.make_attribute("value_float", 2.0))
            const.attribute.append(helper.make_attribute("value_int", 3))
        elif choice == 2:
            const.attribute.append(helper.make_attribute("value_floats", [], attr_type=AttributeProto.FLOATS))
        elif choice == 3:
            t = helper.make_tensor("k", TensorProto.FLOAT, [2], [1.0, 2.0])
            t.dims[:] = [rng.choice([3, 2**40, -2])]  # dims the data does not fill
            const.attribute.append(helper.make_attribute("value", t))
        elif choice == 4:
            const.attribute.append(helper.make_attribute("value_string", b"\xff\xfe"))
        elif choice == 5:
            a = AttributeProto(name="value", type=AttributeProto.TENSOR)
            const.attribute.append(a)
    elif kind == 18:  # a node with no op_type, or an op that does not exist
        rng.choice(nodes).op_type = rng.choice(["", "NoSuchOp", "mul", "If"])
    elif kind == 19:  # IR version
        model.ir_version = rng.choice([0, -1, 1, 3, 99, 2**62])
    elif kind == 20:  # value_info with a bad type / names
        vi = g.value_info.add()
        vi.name = rng.choice(["t", "", "nowhere", "x"])
        vi.type.tensor_type.elem_type = rng.choice([0, 1, 99])
        vi.type.tensor_type.shape.dim.add().dim_value = rng.choice([-1, 2**62, 3])
    elif kind == 22:  # a sparse initializer, consistent or not (issue 28)
        _sparse_initializer(rng, g, init)
    elif kind == 23:  # raw_data and a typed data field both set
        init.raw_data = np.arange(len(init.dims) and init.dims[0] or 1, dtype=np.float32).tobytes()
        init.float_data.extend([1.0] * rng.choice([1, 4]))
    elif kind == 24:  # external data reached through a symbolic link or a hard link (issue 28)
        return _linked_external_data(rng, model, init, folder)
    elif kind == 25:  # If nested deep, with a sparse initializer in the main graph
        from onnx import GraphProto

        sparse = GraphProto()
        _sparse_initializer(rng, sparse, init)
        return _nested_if(rng.choice([20, 150, 1000])) + _ld(7, sparse.SerializeToString())
    else:  # attribute values of the right type and absurd content
        attr = rng.choice([a for n in nodes for a in n.attribute])
        attr.name = rng.choice(["", "then_branch", "value", "\x00"])
    return model


def _sparse_initializer(rng: random.Random, graph, init) -> None:
    """Replace ``init`` by a sparse initializer of the same name: indices linear or coordinates,
    in range or not, of the right count or not, values with raw and typed data or not."""
    from onnx import helper, numpy_helper

    name = init.name
    keep = [i for i in graph.initializer if i.name != name]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    dims = rng.choice([[4], [4], [2, 2], [2**40], [-1], [0], [4, 1]])
    nnz = rng.choice([0, 1, 2, 3])
    values = numpy_helper.from_array(np.arange(1, nnz + 1, dtype=np.float32), name)
    if rng.random() < 0.15:
        values.float_data.extend([9.0] * rng.choice([1, nnz or 1]))
    if rng.random() < 0.5:
        indices = [rng.choice([0, 1, 2, 3, -1, 4, 99, 2**40]) for _ in range(rng.choice([nnz, nnz, nnz + 1]))]
    else:
        rank = rng.choice([len(dims), len(dims), len(dims) + 1])
        indices = [[rng.choice([0, 1, -1, 2, 5]) for _ in range(rank)] for _ in range(nnz)]
    dtype = rng.choice([np.int64, np.int64, np.int32, np.float32])
    index_tensor = numpy_helper.from_array(np.array(indices, dtype=np.int64).astype(dtype), "")
    graph.sparse_initializer.append(helper.make_sparse_tensor(values, index_tensor, dims))


def _linked_external_data(rng: random.Random, model, init, folder: Path):
    import os

    from onnx import TensorProto

    data = np.arange(4, dtype=np.float32).tobytes()
    outside = folder.parent / f"{folder.name}-outside.data"
    outside.write_bytes(data)
    (folder / "real.data").write_bytes(data)
    link = folder / "w.data"
    choice = rng.randrange(6)
    if choice == 0:
        os.symlink("real.data", link)  # inside the folder: fine
    elif choice == 1:
        os.symlink(outside, link)  # leaves the folder
    elif choice == 2:
        os.symlink("nowhere.data", link)  # dangling
    elif choice == 3:
        os.symlink(".", link)  # a folder
    elif choice == 4:
        os.symlink("w.data", link)  # a loop
    else:
        os.link(folder / "real.data", link)  # a hard link
    del init.float_data[:]
    init.ClearField("raw_data")
    init.data_location = TensorProto.EXTERNAL
    entry = init.external_data.add()
    entry.key, entry.value = "location", rng.choice(["w.data", "w.data", "./w.data"])
    return model


def _make_onnx(rng: random.Random, folder: Path) -> Path:
    out = _mutate_onnx(rng, folder)
    path = folder / "case.onnx"
    path.write_bytes(out if isinstance(out, bytes) else out.SerializeToString())
    return path


def _read_onnx(rng: random.Random, path: Path) -> None:
    from onnxparam.core.module import named_params
    from onnxparam.onnx_io import import_onnx, read_onnx_record

    module = import_onnx(path)
    for _, param in named_params(module):
        param.val().to_numpy()
    for snap in read_onnx_record(path).values():
        snap.to_data()
    if rng.random() < 0.15:  # an accepted model exports (issue 28: a symlinked data file failed here)
        from onnxparam.onnx_io import export_onnx

        out = export_onnx(module, path.with_name("exported.onnx"), external_data=rng.random() < 0.5)
        for snap in read_onnx_record(out).values():
            snap.to_data()
    if rng.random() < 0.1:  # a session per call is slow: call a tenth of the accepted models
        from onnxparam.core.errors import OnnxParamError

        try:
            module(np.ones((2, 4), np.float32), np.array(rng.random() < 0.5))
        except OnnxParamError as e:
            # NOTE: a run refused by the tracer or ONNX Runtime names the node, not the file
            raise RefusedWhenRun(e) from e


_FED: dict = {}
"""``label``: what an in-memory case fed the reader (``<onnx.ModelProto>`` ...), for the runner's check
that the error names it."""


def _read_onnx_in_memory(rng: random.Random, path: Path) -> None:
    """The mutated model fed without a file: as an ``onnx_ir.Model`` (when ``onnx_ir`` can
    deserialize it), an ``onnx.ModelProto``, or bytes when protobuf cannot parse it."""
    import onnx
    import onnx_ir as ir

    from onnxparam.core.module import named_params
    from onnxparam.onnx_io import import_onnx, read_onnx_record

    data = path.read_bytes()
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception:  # noqa: BLE001 - an unparsable protobuf is fed as bytes
        model, _FED["label"] = data, "<bytes>"
    else:
        model, _FED["label"] = proto, "<onnx.ModelProto>"
        if rng.random() < 0.6:
            logger = logging.getLogger("onnx_ir")
            level = logger.level
            logger.setLevel(logging.CRITICAL)  # it logs the dangling names the reader then refuses
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model, _FED["label"] = ir.serde.deserialize_model(proto), "<onnx_ir.Model>"
            except Exception:  # noqa: BLE001 - what onnx_ir cannot build stays a ModelProto
                pass
            finally:
                logger.setLevel(level)
    module = import_onnx(model)
    for _, param in named_params(module):
        param.val().to_numpy()
    for snap in read_onnx_record(model).values():
        snap.to_data()
    if rng.random() < 0.1:
        from onnxparam.core.errors import OnnxParamError

        try:
            module(np.ones((2, 4), np.float32), np.array(rng.random() < 0.5))
        except OnnxParamError as e:
            raise RefusedWhenRun(e) from e


class RefusedWhenRun(Exception):
    """A model the reader accepted and a run refused with the library's error ``args[0]``."""


# -- shared tensor-level mutations ---------------------------------------------------------------

_BAD_SHAPES = ([1] * 65, [1] * 200, [0, 2**62], [2**62, 0], [0, 2**64 - 1], [2**62, 2**62, 0], [-1], [2**31, 2**31],
               [2, 2.0], [True], "4", None, [[4]])
_BAD_NAMES = ("", "\ud800", "a\udfffb", "\x00", "a\x00b", " ", "." * 3, "x" * 70_000)


# -- burnpack ------------------------------------------------------------------------------------

_BPK_BASE: list = []
_SURROGATE_MARK = "QZQ"  # 3 ASCII bytes; replaced by b"\xed\xa0\x80" (UTF-8 of a lone surrogate)


def _bpk_base(folder: Path) -> bytes:
    import onnxparam.burnpack as bp

    if not _BPK_BASE:
        path = folder / "base.bpk"
        bp.write(path, [bp.TensorEntry.from_numpy("fc.weight", np.arange(12, dtype=np.float32).reshape(3, 4)),
                        bp.TensorEntry.from_numpy("fc.bias", np.ones(4, np.float16)),
                        bp.TensorEntry.from_numpy("mask", np.array([True, False]))],
                 metadata={"producer": "fuzz"}, scalars={"step": 3})
        _BPK_BASE.append(path.read_bytes())
        path.unlink()
    return _BPK_BASE[0]


def _mutate_bpk(rng: random.Random, folder: Path) -> bytes:
    from onnxparam.burnpack import _cbor as cbor
    from onnxparam.burnpack._header import data_section_start, pack_header

    raw = _bpk_base(folder)
    meta_len = struct.unpack_from("<I", raw, 6)[0]
    data = raw[data_section_start(meta_len):]
    meta = cbor.loads(raw[10: 10 + meta_len])
    tensors = meta["tensors"]
    name = rng.choice(sorted(tensors))
    desc = tensors[name]
    surrogate = False
    kind = rng.randrange(9)
    if kind == 0:
        desc["shape"] = rng.choice(_BAD_SHAPES[:8] + ([1] * 64,))
    elif kind == 1:
        bad = rng.choice(_BAD_NAMES)
        if bad.encode("utf-8", "surrogatepass") != bad.encode("utf-8", "replace"):
            bad, surrogate = _SURROGATE_MARK, True
        tensors[bad] = tensors.pop(name)
    elif kind == 2:
        desc["data_offsets"] = rng.choice([[0, 2**40], [len(data), len(data) + 48], [256, 0], [0, 47], [0, 2**64 - 1],
                                           [2**63, 2**63 + 48], [0]])
    elif kind == 3:
        desc["dtype"] = rng.choice(["F33", "f32", "", 5, None, ["F32"], {"Bool": "U64"}, {"QFloat": {}}, "QFloat"])
    elif kind == 4:
        desc["param_id"] = rng.choice([-1, 2**64, 1.5, "7", [1], None])
    elif kind == 5:
        meta["metadata"] = rng.choice([{"a": 1}, ["x"], {"": ""}, {1: "x"}, None])
    elif kind == 6:
        meta["scalars"] = rng.choice([{"s": 1}, {"s": {"Int": 1.5}}, {"s": {"F64": "x"}}, {"": {"I64": 2**70}}, [1]])
    elif kind == 7:
        shape = rng.choice([[1] * 64, [3, 4, 1, 1], [12], [2, 6]])
        desc["shape"] = shape  # valid reshapes (same byte count) and the 64-dim limit itself
    else:
        desc[rng.choice(["extra", "shape", "data_offsets"])] = rng.choice([1, "x", [], {}])
    body = cbor.dumps(meta)
    if surrogate:
        mark = _SURROGATE_MARK.encode()
        body = body.replace(mark, b"\xed\xa0\x80", 1)
    start = data_section_start(len(body))
    return pack_header(len(body)) + body + bytes(start - 10 - len(body)) + data


def _make_bpk(rng: random.Random, folder: Path) -> Path:
    path = folder / "case.bpk"
    path.write_bytes(_mutate_bpk(rng, folder))
    return path


def _read_bpk(rng: random.Random, path: Path) -> None:
    import onnxparam.burnpack as bp

    with bp.read(path) as f:
        for entry in f.tensors.values():
            entry.to_numpy()
        dict(f.metadata), dict(f.scalars)
    _convert_onward(rng, path)


# -- safetensors ---------------------------------------------------------------------------------


def _st(header, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _mutate_st(rng: random.Random) -> bytes:
    def t(dtype="F32", shape=(3, 4), offsets=(0, 48)):
        return {"dtype": dtype, "shape": list(shape) if isinstance(shape, (list, tuple)) else shape,
                "data_offsets": list(offsets)}

    header = {"__metadata__": {"producer": "fuzz"}, "fc.weight": t(), "fc.bias": t("F16", (4,), (48, 56)),
              "mask": t("BOOL", (2,), (56, 58))}
    data = np.arange(12, dtype=np.float32).tobytes() + np.ones(4, np.float16).tobytes() + b"\x01\x00"
    name = rng.choice(["fc.weight", "fc.bias", "mask"])
    kind = rng.randrange(8)
    if kind == 0:
        header[name]["shape"] = rng.choice(_BAD_SHAPES)
    elif kind == 1:
        header[rng.choice(_BAD_NAMES)] = header.pop(name)
    elif kind == 2:
        header[name]["data_offsets"] = rng.choice([[0, 2**40], [58, 106], [48, 0], [0, 47], [0, 2**64], [-8, 40], [0]])
    elif kind == 3:
        header[name]["dtype"] = rng.choice(["F33", "f32", "", "U4", "F8_E8M0", 5, None, ["F32"]])
    elif kind == 4:
        header["__metadata__"] = rng.choice([{"a": 1}, ["x"], None, {"onnxparam.order": '["fc.bias"]'},
                                             {"onnxparam.order": '["\\ud800"]'}, {"onnxparam.param_ids": '{"mask": 2}'},
                                             {"\ud800": "x"}, {"a": "\ud800"}])
    elif kind == 5:
        header[name]["shape"] = rng.choice([[1] * 64, [3, 4, 1], [12], [6, 2], [0, 4], [1] * 65])
        if header[name]["shape"] == [0, 4]:
            header[name]["data_offsets"] = [header[name]["data_offsets"][0]] * 2
    elif kind == 6:  # a U8 [2**62, 0] empty tensor, the burnpack writer's example
        header["empty"] = t("U8", rng.choice([(2**62, 0), (0, 2**62), (2**31, 2**31, 0), (0,)]), (58, 58))
    else:
        header[name]["extra"] = rng.choice([1, "x", None])
    return _st(header, data)


def _make_st(rng: random.Random, folder: Path) -> Path:
    path = folder / "case.safetensors"
    path.write_bytes(_mutate_st(rng))
    return path


def _read_st(rng: random.Random, path: Path) -> None:
    from onnxparam.formats import read_safetensors

    with read_safetensors(path) as f:
        for snap in f.tensors.values():
            snap.to_data()
        f.to_record()
    _convert_onward(rng, path)


# -- PyTorch checkpoints -------------------------------------------------------------------------


def _op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _op_value(obj) -> bytes:
    return pickle.dumps(obj, protocol=2)[2:-1]


def _op_tensor(numel, size, stride, offset=0, key="0", storage="FloatStorage", legacy=False) -> bytes:
    pid = b"(" + _op_value("storage") + _op_global("torch", storage) + _op_value(key) + _op_value("cpu") \
        + _op_value(numel) + (b"N" if legacy else b"") + b"tQ"
    hooks = _op_global("collections", "OrderedDict") + b")R"
    args = b"(" + pid + _op_value(offset) + _op_value(size) + _op_value(stride) + _op_value(False) + hooks + b"t"
    return _op_global("torch._utils", "_rebuild_tensor_v2") + args + b"R"


def _mutate_pt(rng: random.Random) -> tuple:
    """``(pickle bytes, storages)`` of a checkpoint with one structural change."""
    tensors = {"fc.weight": dict(numel=12, size=(3, 4), stride=(4, 1), offset=0, key="0", storage="FloatStorage"),
               "fc.bias": dict(numel=4, size=(4,), stride=(1,), offset=0, key="1", storage="HalfStorage")}
    storages = {"0": np.arange(12, dtype=np.float32).tobytes(), "1": np.ones(4, np.float16).tobytes()}
    name = rng.choice(sorted(tensors))
    t = tensors[name]
    kind = rng.randrange(8)
    if kind == 0:
        t["size"] = rng.choice([(1,) * 65, (0, 2**62), (2**62, 0), (-1,), (2**31, 2**31), (1,) * 64, (2, 2.0), (12,)])
        t["stride"] = (1,) * len(t["size"]) if rng.random() < 0.7 and isinstance(t["size"], tuple) else t["stride"]
    elif kind == 1:
        t["stride"] = rng.choice([(0, 0), (-1, 1), (2**62, 1), (4,), (1, 3), (4, 1, 1)])
    elif kind == 2:
        t["offset"] = rng.choice([-1, 11, 12, 2**62, 1.5])
    elif kind == 3:
        t["numel"] = rng.choice([0, 2**62, -1, 13])
    elif kind == 4:
        t["storage"] = rng.choice(["NoStorage", "ByteStorage", "BFloat16Storage", "ComplexFloatStorage", "QInt8Storage"])
    elif kind == 5:
        t["key"] = rng.choice(["9", "", "../0", "0\x00"])
    elif kind == 6:
        tensors[rng.choice(_BAD_NAMES[:7])] = tensors.pop(name)
    else:
        storages[t["key"]] = storages[t["key"]][: rng.choice([0, 3, 8])]
    return tensors, storages


_ITEMSIZE = {"FloatStorage": 4, "HalfStorage": 2, "ByteStorage": 1, "BFloat16Storage": 2, "ComplexFloatStorage": 8}


def _pt_stream(tensors: dict, storages: dict) -> bytes:
    """The legacy stream (``_use_new_zipfile_serialization=False``): five pickles, then each
    storage's element count and bytes."""
    from onnxparam.formats._torch_archive import MAGIC_NUMBER, PROTOCOL_VERSION

    body = b"".join(_op_value(k) + _op_tensor(**v, legacy=True) for k, v in tensors.items())
    out = pickle.dumps(MAGIC_NUMBER, protocol=2) + pickle.dumps(PROTOCOL_VERSION, protocol=2)
    out += pickle.dumps({"protocol_version": PROTOCOL_VERSION, "little_endian": True,
                         "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2)
    out += b"\x80\x02}(" + body + b"u."
    out += pickle.dumps(list(storages), protocol=2)
    for key, data in storages.items():
        declared = next((t for t in tensors.values() if t["key"] == key), None)
        count = declared["numel"] if declared and isinstance(declared["numel"], int) else len(data)
        out += struct.pack("<q", count if -2**63 <= count < 2**63 else -1) + data
    return out


def _pt_tar(rng: random.Random, tensors: dict, storages: dict) -> "bytes | None":
    """The legacy tar of torch < 0.4 (members sys_info, storages, tensors, pickle); ``None`` when
    a mutation cannot be laid out in it (a float size)."""
    import io
    import tarfile

    skeys = {key: i + 1 for i, key in enumerate(storages)}
    sto = pickle.dumps(len(storages), protocol=2)
    for key, data in storages.items():
        declared = next((t for t in tensors.values() if t["key"] == key), {"storage": "FloatStorage"})
        item = _ITEMSIZE.get(declared["storage"], 4)
        sto += b"\x80\x02(" + _op_value(skeys[key]) + _op_value("cpu") + _op_global("torch", declared["storage"])
        sto += b"t." + struct.pack("<q", len(data) // item if rng.random() < 0.8 else rng.choice([-1, 2**40])) + data
    sto += pickle.dumps(rng.choice([[], [], [(99, 1, 0, 1)], [(98, 1, 2**40, 1)], "x"]), protocol=2)
    ten = pickle.dumps(len(tensors), protocol=2)
    main = b""
    for i, (name, t) in enumerate(tensors.items()):
        if not all(isinstance(v, int) for v in (*t["size"], *t["stride"], t["offset"])):
            return None
        if len(t["size"]) != len(t["stride"]) or not all(-2**63 <= v < 2**63 for v in (*t["size"], *t["stride"])):
            return None
        skey = skeys.get(t["key"], 77)
        ten += b"\x80\x02(" + _op_value(1000 + i) + _op_value(skey) + _op_global("torch", "FloatTensor") + b"t."
        ten += struct.pack("<i", len(t["size"])) + b"\0\0\0\0" + struct.pack(f"<{len(t['size'])}q", *t["size"])
        ten += struct.pack(f"<{len(t['stride'])}q", *t["stride"]) + struct.pack("<q", t["offset"])
        main += _op_value(name) + _op_value(str(1000 + i)) + b"Q"
    info = pickle.dumps({"protocol_version": 1001, "little_endian": True, "type_sizes": {}}, protocol=2)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for member, data in (("sys_info", info), ("storages", sto), ("tensors", ten),
                             ("pickle", b"\x80\x02}(" + main + b"u.")):
            if rng.random() < 0.03:
                continue  # a member missing
            entry = tarfile.TarInfo(member)
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))
    return buf.getvalue()


def _make_pt(rng: random.Random, folder: Path) -> Path:
    """A checkpoint in one of torch's three containers: zip (torch >= 1.6), legacy stream and
    legacy tar (torch < 0.4), with one structural change."""
    tensors, storages = _mutate_pt(rng)
    path = folder / "case.pt"
    container = rng.choice(["zip", "zip", "stream", "tar"])
    if container == "stream":
        path.write_bytes(_pt_stream(tensors, storages))
        return path
    if container == "tar":
        data = _pt_tar(rng, tensors, storages)
        if data is not None:
            path.write_bytes(data)
            return path
    body = b"".join(_op_value(k) + _op_tensor(**v) for k, v in tensors.items())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}(" + body + b"u.")
        z.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
    return path


def _read_pt(rng: random.Random, path: Path) -> None:
    from onnxparam.formats import pytorch_record, read_pytorch

    checkpoint = read_pytorch(path)
    for array in checkpoint.tensors.values():
        np.asarray(array).sum()
    record = pytorch_record(checkpoint)
    if rng.random() < 0.3 and record:
        import onnxparam.burnpack as bp

        out = path.with_name("onward.bpk")
        bp.write(out, [bp.TensorEntry.from_numpy(name, np.ascontiguousarray(a)) for name, a in record.items()])
        with bp.read(out) as f:
            for entry in f.tensors.values():
                entry.to_numpy()


def _convert_onward(rng: random.Random, path: Path) -> None:
    """An accepted weights file converts into the other weight formats, and they read back
    (a writer must refuse what its reader refuses)."""
    if rng.random() >= 0.3:
        return
    import onnxparam.burnpack as bp
    from onnxparam.convert import convert, read_safetensors
    from onnxparam.onnx_io import read_onnx_record

    target = rng.choice([".bpk", ".safetensors", ".onnx"])
    if target == path.suffix:
        return
    out = path.with_name("onward" + target)
    convert(path, out)
    if target == ".bpk":
        with bp.read(out) as f:
            for entry in f.tensors.values():
                entry.to_numpy()
    elif target == ".safetensors":
        with read_safetensors(out) as f:
            for snap in f.tensors.values():
                snap.to_data()
    else:
        for snap in read_onnx_record(out).values():
            snap.to_data()


# -- PEFT adapter folders ------------------------------------------------------------------------


def _peft_net():
    from onnxparam import Module
    from onnxparam.nn import Embedding, Linear

    class Net(Module):
        def __init__(self):
            self.emb = Embedding(5, 3)
            self.proj = Linear(3, 2)
            self.head = Linear(2, 2, bias=False)

        def forward(self, idx):
            return self.head(self.proj(self.emb(idx)))

    return Net()


def _make_peft(rng: random.Random, folder: Path) -> Path:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) for a small
    net (Embedding, Linear with and without bias) with one or two structural changes: config
    values of the wrong type or range, unknown / unsupported options (DoRA, lora_bias, trained
    biases, modules_to_save, trainable_token_indices), factor names, shapes and dtypes."""
    from safetensors.numpy import save_file

    path = folder / "case_adapter"
    path.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none",
              "target_modules": ["proj", "head", "emb"]}
    f32 = np.float32
    tensors = {"base_model.model.proj.lora_A.weight": np.ones((2, 3), f32),
               "base_model.model.proj.lora_B.weight": np.ones((2, 2), f32),
               "base_model.model.head.lora_A.weight": np.ones((2, 2), f32),
               "base_model.model.head.lora_B.weight": np.ones((2, 2), f32),
               "base_model.model.emb.lora_embedding_A": np.ones((2, 5), f32),
               "base_model.model.emb.lora_embedding_B": np.ones((3, 2), f32)}
    raw_config = None
    for _ in range(rng.choice([1, 1, 2])):
        kind = rng.randrange(12)
        if kind == 0:
            config[rng.choice(["r", "lora_alpha"])] = rng.choice([0, -1, 2.5, True, None, "2", float("inf"), 2**70, 8])
        elif kind == 1:
            config.pop(rng.choice(["r", "lora_alpha", "peft_type", "bias", "target_modules"]), None)
        elif kind == 2:
            config[rng.choice(["use_dora", "use_rslora", "lora_bias", "fan_in_fan_out", "use_qalora"])] = \
                rng.choice([True, False, 1, "yes", None])
        elif kind == 3:
            config[rng.choice(["rank_pattern", "alpha_pattern"])] = rng.choice(
                [{"proj": 4}, {"(": 2}, {"proj": "x"}, [1], "proj", {"": 1}, {"head": 0}, {"emb": 2**62}])
        elif kind == 4:
            config[rng.choice(["modules_to_save", "trainable_token_indices", "layers_to_transform"])] = rng.choice(
                [["proj"], {"emb": [0, 1]}, [0, 1], "emb", {"emb": [99]}, None])
        elif kind == 5:
            config["bias"] = rng.choice(["all", "lora_only", 3, None])
            if rng.random() < 0.5:
                tensors["base_model.model.proj.bias"] = np.zeros(2, f32)
        elif kind == 6:  # factor shapes
            key = rng.choice(sorted(tensors))
            tensors[key] = np.ones(rng.choice([(2, 5), (3, 3), (0, 3), (2,), (1, 1, 1), (2, 2)]), f32)
        elif kind == 7:  # factor dtypes
            key = rng.choice(sorted(tensors))
            tensors[key] = tensors[key].astype(rng.choice([np.float16, np.float64, np.int32, np.uint8, np.bool_]))
        elif kind == 8:  # names: missing pair, unknown module, extra kinds of keys
            key = rng.choice(sorted(tensors))
            value = tensors.pop(key)
            if rng.random() < 0.6:
                tensors[rng.choice(["base_model.model.nowhere.lora_A.weight", "base_model.model.proj.lora_C.weight",
                                    "base_model.model.proj.lora_magnitude_vector", "base_model.model.proj.lora_B.bias",
                                    "base_model.model.head.lora_B.bias", "proj.lora_A.weight",
                                    "base_model.model.emb.token_adapter.trainable_tokens_delta",
                                    "base_model.model.proj.modules_to_save.default.weight",
                                    "base_model.model.proj.lora_A.default.weight", ".lora_A.weight"])] = value
        elif kind == 9:  # lora_bias on a layer with and without a bias
            config["lora_bias"] = True
            tensors[rng.choice(["base_model.model.proj.lora_B.bias", "base_model.model.head.lora_B.bias"])] = \
                np.ones(rng.choice([2, 3]), f32)
        elif kind == 10:
            raw_config = rng.choice([b"{", b"[]", b"\xff", b"null", b"{\"r\": 1e999}", b"[" * 5000])
        else:
            config["target_modules"] = rng.choice(["proj", ".*", "(", 7, ["nowhere"]])
    (path / "adapter_config.json").write_bytes(raw_config if raw_config is not None else json.dumps(config).encode())
    if rng.random() < 0.03:
        return path  # no weights file
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _read_peft(rng: random.Random, path: Path) -> None:
    from onnxparam import load_peft_adapter

    module = load_peft_adapter(_peft_net(), path, allow_partial=rng.random() < 0.3)
    for _, param in module.named_params():
        param.val().to_numpy()
    if rng.random() < 0.02:  # a session per call is slow: call a fiftieth of the accepted adapters
        np.asarray(module(np.array([0, 4, 2], dtype=np.int64)).to_numpy()).sum()


# -- .onnx_adapter files (ONNX Runtime's adapter format) ------------------------------------------

_ADAPTER_MODEL: dict = {}


def _adapter_model(folder: Path) -> Path:
    """A ``lora="inputs"`` export of a small net (made once per process, in ``folder``'s parent)."""
    found = _ADAPTER_MODEL.get("path")
    if found is not None and found.exists():
        return found
    from onnxparam import LoraConfig, Module
    from onnxparam.nn import Linear
    from onnxparam.onnx_io import export_onnx

    class Net(Module):
        def __init__(self):
            self.fc = Linear(4, 3)

        def forward(self, x):
            return self.fc(x)

    net = Net().apply_lora(LoraConfig(rank=2, alpha=4.0, seed=0))
    path = folder.parent / "adapter-model" / "m.onnx"
    path.parent.mkdir(exist_ok=True)
    export_onnx(net, path, np.ones((2, 4), np.float32), lora="inputs")
    _ADAPTER_MODEL["path"] = path
    return path


def _make_onnx_adapter(rng: random.Random, folder: Path) -> Path:
    """An ``.onnx_adapter`` file written by ONNX Runtime's own writer with parameters that fit
    the model or not (names, ranks, dims, dtypes, a missing factor), or a valid file whose
    bytes were cut or changed in its header / tables."""
    import onnxruntime as ort

    _adapter_model(folder)
    f32 = np.float32
    params = {"fc.weight.lora.a": np.ones((4, 2), f32), "fc.weight.lora.b": np.ones((2, 3), f32)}
    if rng.random() < 0.3:  # another rank: still fits
        params = {"fc.weight.lora.a": np.ones((4, 5), f32), "fc.weight.lora.b": np.ones((5, 3), f32)}
    kind = rng.randrange(7)  # 6: unchanged
    if kind == 0:
        key = rng.choice(sorted(params))
        params[key] = np.ones(rng.choice([(4, 3), (3, 2), (2, 2), (4,), (1, 4, 2), (0, 2), (4, 0)]), f32)
    elif kind == 1:
        key = rng.choice(sorted(params))
        params[key] = params[key].astype(rng.choice([np.float16, np.float64, np.int32, np.int8]))
    elif kind == 2:
        params.pop(rng.choice(sorted(params)))
    elif kind == 3:
        params[rng.choice(["fc.bias.lora.a", "nowhere", "", "fc.weight.lora.c", "fc.weight"])] = np.ones((4, 2), f32)
    values = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(rng.choice([1, 1, 0, 2**31 - 1]))
    fmt.set_model_version(1)
    fmt.set_parameters(values)
    path = folder / "case.onnx_adapter"
    fmt.export_adapter(str(path))
    if kind in (4, 5):
        data = bytearray(path.read_bytes())
        if kind == 4:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.choice([1, 2, 4])):
                data[rng.randrange(min(len(data), 96))] = rng.randrange(256)
        path.write_bytes(bytes(data))
    return path


def _read_onnx_adapter(rng: random.Random, path: Path) -> None:
    from onnxparam.lora._adapter_file import check_onnx_adapter

    shapes = check_onnx_adapter(path, _ADAPTER_MODEL["path"])
    assert all(len(s) == 2 for s in shapes.values())


# -- the runner ----------------------------------------------------------------------------------


@dataclass
class Format:
    name: str
    error: str  # the name of the error class in onnxparam.core.errors the format's readers raise
    make: Callable[[random.Random, Path], Path]
    read: Callable[[random.Random, Path], None]


FORMATS = {
    "onnx": Format("onnx", "OnnxParamError", _make_onnx, _read_onnx),
    "onnx-in-memory": Format("onnx-in-memory", "OnnxParamError", _make_onnx, _read_onnx_in_memory),
    "burnpack": Format("burnpack", "OnnxParamError", _make_bpk, _read_bpk),
    "safetensors": Format("safetensors", "OnnxParamError", _make_st, _read_st),
    "pt": Format("pt", "OnnxParamError", _make_pt, _read_pt),
    "peft": Format("peft", "OnnxParamError", _make_peft, _read_peft),
    "onnx_adapter": Format("onnx_adapter", "OnnxParamError", _make_onnx_adapter, _read_onnx_adapter),
}


@dataclass
class Finding:
    case: int
    problem: str


@dataclass
class Outcome:
    name: str
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    findings: list = field(default_factory=list)


def run_format(name: str, cases: int, seed: int, folder: Path) -> Outcome:
    """Run ``cases`` seeded cases of format ``name`` in ``folder``; never raises for a case."""
    import traceback

    import onnxparam.core.errors as errors

    fmt = FORMATS[name]
    error_type = getattr(errors, fmt.error)
    rng = random.Random(f"{name}:{seed}")
    out = Outcome(name)
    for case in range(cases):
        case_dir = folder / f"{name}-{case % 2}"
        shutil.rmtree(case_dir, ignore_errors=True)
        case_dir.mkdir(parents=True)
        path = fmt.make(rng, case_dir)
        out.tried += 1
        problem = None
        _FED.clear()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a reader may warn (NaN payloads); not a finding
                fmt.read(rng, path)
            out.accepted += 1
        except RefusedWhenRun as e:
            out.refused += 1
            message = str(e.args[0])
            if not message.strip():
                problem = f"{type(e.args[0]).__name__} with an empty message when run"
            elif _FED.get("label", path.name) not in message:
                problem = f"{type(e.args[0]).__name__} when run not naming the source: {message[:300]}"
        except error_type as e:
            out.refused += 1
            message = str(e)
            if not message.strip():
                problem = f"{type(e).__name__} with an empty message"
            elif _FED.get("label", path.name) not in message:
                problem = f"{type(e).__name__} not naming the file: {message[:300]}"
        except Exception as e:  # noqa: BLE001 - any other exception is the finding
            frame = traceback.extract_tb(e.__traceback__)[-1]
            problem = f"{type(e).__name__}: {str(e)[:300]} (at {Path(frame.filename).name}:{frame.lineno})"
        if problem is not None:
            out.findings.append(Finding(case, problem))
    return out

