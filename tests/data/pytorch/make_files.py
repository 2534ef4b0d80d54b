"""Writes the small committed PyTorch checkpoints of this folder (see README.md).

Run from the repository root with torch installed: ``python tests/data/pytorch/make_files.py``.
Every value is a formula of ``arange``; tests/test_pytorch_reader.py checks the files against the
same formulas without torch.
"""

import collections
import io
import pickle
import zipfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def state_dict():
    emb = torch.arange(10, dtype=torch.float16).reshape(5, 2)
    sd = collections.OrderedDict()
    sd["fc.weight"] = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    sd["fc.bias"] = torch.arange(3, dtype=torch.float32) - 1
    sd["emb.weight"] = emb
    sd["head.weight"] = emb  # tied: one tensor under two names
    sd["bn.num_batches_tracked"] = torch.tensor(7)
    sd["mask"] = torch.arange(6) % 2 == 0
    sd["half_steps"] = torch.arange(4, dtype=torch.bfloat16) * 0.5
    sd["transposed"] = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()
    sd["strided"] = torch.arange(10, dtype=torch.int16)[2:8:2]
    sd["wide"] = torch.arange(3, dtype=torch.float64).expand(2, 3)
    for i in (0, 2, 5):
        sd[f"layers.{i}.w"] = torch.full((2,), i, dtype=torch.int8)
    return sd


def checkpoint():
    return {"epoch": 3, "model": state_dict(), "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}}


def big_endian_copy(src: Path, dst: Path) -> None:
    """Re-pack a zip checkpoint as a big-endian machine writes it: byteswapped storages, 'big'."""
    itemsizes = {}  # storage key -> element size, from the storage classes of the persistent ids

    class Probe(pickle.Unpickler):
        def persistent_load(self, pid):
            storage = pid[1](pid[4])  # e.g. torch.FloatStorage(numel)
            itemsizes[pid[2]] = storage.element_size()
            return storage

    with zipfile.ZipFile(src) as zin:
        prefix = next(n for n in zin.namelist() if n.endswith("/data.pkl"))[: -len("data.pkl")]
        Probe(io.BytesIO(zin.read(prefix + "data.pkl"))).load()
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = zin.read(info.filename)
                if info.filename == prefix + "byteorder":
                    data = b"big"
                elif info.filename.startswith(prefix + "data/"):
                    size = itemsizes[info.filename[len(prefix + "data/") :]]
                    data = b"".join(data[i : i + size][::-1] for i in range(0, len(data), size))
                zout.writestr(info.filename, data)
    before, after = torch.load(src, weights_only=True), torch.load(dst, weights_only=True)
    for name, value in before.items():  # torch swaps the bytes back: the copy is a valid file
        assert torch.equal(value, after[name]), name


if __name__ == "__main__":
    torch.save(state_dict(), HERE / "state_dict_zip.pt")
    torch.save(state_dict(), HERE / "state_dict_legacy.pt", _use_new_zipfile_serialization=False)
    torch.save(checkpoint(), HERE / "checkpoint_zip.pt")
    big_endian_copy(HERE / "state_dict_zip.pt", HERE / "state_dict_big_endian.pt")
    for p in sorted(HERE.glob("*.pt")):
        print(p.name, p.stat().st_size)
