"""Writers of PyTorch's oldest checkpoint container, the legacy tar (torch < 0.4), for tests.

``save_legacy_tar`` lays a state dict out as torch/serialization.py's ``_load`` tar branch
reads it (members ``sys_info``, ``storages``, ``tensors``, ``pickle``); the tests check each
file with ``torch.load(weights_only=False)`` first, so torch itself is the oracle that the
layout is right.
"""

import io
import pickle
import struct
import sys
import tarfile


def _storage_class(torch, dtype):
    return {torch.float32: torch.FloatStorage, torch.float64: torch.DoubleStorage, torch.float16: torch.HalfStorage,
            torch.int64: torch.LongStorage, torch.int32: torch.IntStorage, torch.int16: torch.ShortStorage,
            torch.int8: torch.CharStorage, torch.uint8: torch.ByteStorage, torch.bool: torch.BoolStorage,
            torch.bfloat16: torch.BFloat16Storage}[dtype]


def _tensor_class(torch, dtype):
    return {torch.float32: torch.FloatTensor, torch.float64: torch.DoubleTensor, torch.float16: torch.HalfTensor,
            torch.int64: torch.LongTensor, torch.int32: torch.IntTensor, torch.int16: torch.ShortTensor,
            torch.int8: torch.CharTensor, torch.uint8: torch.ByteTensor, torch.bool: torch.BoolTensor,
            torch.bfloat16: torch.BFloat16Tensor}[dtype]


def save_legacy_tar(torch, tree, path, *, views=()) -> None:
    """Write ``tree`` (nested dicts / lists of tensors) as a legacy torch tar at ``path``.

    Tensors sharing an untyped storage share one storage entry (ties and slices survive).
    ``views``: tensor names whose storage is written as a *storage view* of a larger root
    (the tar's ``storage_views`` list), the root holding 3 extra leading elements.
    """
    storages = {}  # data_ptr -> (key, storage bytes, dtype)
    tensors = {}  # key -> (storage key, tensor)
    ids = {}
    view_list = []

    def key_of(t, name):
        if id(t) in ids:
            return ids[id(t)]
        base = t.untyped_storage()
        ptr = base.data_ptr()
        if name in views:
            root_key = 10_000 + len(storages)
            root = torch.cat([torch.zeros(3, dtype=t.dtype), t.detach().reshape(-1)])
            storages[("root", root_key)] = (root_key, bytes(root.numpy().tobytes() if t.dtype != torch.bfloat16
                                                                else root.view(torch.int16).numpy().tobytes()),
                                            t.dtype)
            skey = 20_000 + len(storages)
            view_list.append((skey, root_key, 3, t.numel()))
            tkey = 30_000 + len(tensors)
            tensors[tkey] = (skey, torch.empty_strided(t.shape, t.stride()), t.dtype, 0)
            ids[id(t)] = tkey
            return tkey
        if ptr not in storages:
            raw = bytes(base.cpu())
            storages[ptr] = (len(storages) + 1, raw, t.dtype)
        tkey = 30_000 + len(tensors)
        tensors[tkey] = (storages[ptr][0], t, t.dtype, t.storage_offset())
        ids[id(t)] = tkey
        return tkey

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, torch.Tensor):
                return str(key_of(obj, names.get(id(obj))))
            return None

    names = {}

    def walk(node, prefix):
        if isinstance(node, torch.Tensor):
            names[id(node)] = prefix
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))

    walk(tree, "")
    main = io.BytesIO()
    P(main, protocol=2).dump(tree)

    sto = io.BytesIO()
    pickle.dump(len(storages), sto, protocol=2)
    for key, raw, dtype in storages.values():
        itemsize = torch.empty((), dtype=dtype).element_size()
        pickle.dump((key, "cpu", _storage_class(torch, dtype)), sto, protocol=2)
        sto.write(struct.pack("<q", len(raw) // itemsize))
        sto.write(raw)
    pickle.dump(view_list, sto, protocol=2)

    ten = io.BytesIO()
    pickle.dump(len(tensors), ten, protocol=2)
    for tkey, (skey, t, dtype, offset) in tensors.items():
        pickle.dump((tkey, skey, _tensor_class(torch, dtype)), ten, protocol=2)
        ten.write(struct.pack("<i", t.dim()) + b"\0\0\0\0")
        ten.write(struct.pack(f"<{t.dim()}q", *t.shape))
        ten.write(struct.pack(f"<{t.dim()}q", *t.stride()))
        ten.write(struct.pack("<q", offset))

    info = io.BytesIO()
    pickle.dump({"protocol_version": 1001, "little_endian": sys.byteorder == "little",
                 "type_sizes": {"short": 2, "int": 4, "long": 4}}, info, protocol=2)
    with tarfile.open(path, "w:", format=tarfile.PAX_FORMAT) as tar:
        for name, buf in (("sys_info", info), ("pickle", main), ("tensors", ten), ("storages", sto)):
            member = tarfile.TarInfo(name)
            member.size = len(buf.getvalue())
            tar.addfile(member, io.BytesIO(buf.getvalue()))
