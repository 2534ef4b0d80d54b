"""A seeded fuzzing campaign over every reader of the library.

Each *target* reads a (mutated) file the way a user would and touches every value it yields:

* ``burnpack``     ``onnxparam.burnpack.read`` on Burn's MNIST ``model.bpk`` (the mutations of
                   ``tests/test_burnpack_malformed.py``: truncation, bit flips, random bytes, a
                   new metadata size, inserted / deleted bytes);
* ``onnx``         ``import_onnx`` + every param's value + ``read_onnx_record``, on the models of
                   ``tests/data/onnx`` (those under 1 MB), a small model written here and one
                   exported by this library (with its metadata keys): byte mutations and
                   protobuf-level ones (huge / negative dims, wrong data types, short raw data,
                   external data past the end of its file or outside the folder, duplicate
                   initializers);
* ``safetensors``  ``read_safetensors`` + every tensor's data: byte mutations and header-level
                   ones (huge header length, overlapping offsets, bad dtype strings, truncated
                   data, duplicate names, deep JSON nesting, bad ``onnxparam.*`` keys);
* ``peft``         ``load_peft_adapter`` onto a ``Linear``: bad JSON, missing files, bad ranks /
                   alphas / patterns, wrong factor shapes and dtypes.

A case *fails* when the reader raises anything but an :class:`~onnxparam.OnnxParamError`, or
when it takes longer than ``--case-seconds``; memory is bounded by the reader's own limits (the
tests check tracemalloc peaks for huge declared sizes). ``.onnx_adapter`` files are not read by
this library (ONNX Runtime reads them), so they have no target.

Usage: ``python tools/fuzz.py [--cases 2000] [--seed 1] [--targets onnx,safetensors,...]
[--structured-cases 10000]``. After the byte-level targets it runs the structure-aware campaign of
``tools/fuzz_structured.py`` (ONNX from files and in memory, burnpack, safetensors, ``.pt``, PEFT folders, ``.onnx_adapter``), 10,000 cases
per format.
Prints cases tried / refused / accepted / failures per target and exits 1 on any failure; each
failure is printed with its seed and case number, and ``--save DIR`` keeps the failing inputs.

The tests (``tests/test_fuzz_readers.py``) import this file and run a few hundred cases.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ONNX_DATA = ROOT / "tests" / "data" / "onnx"
MNIST_BPK = ROOT / "models" / "mnist" / "model.bpk"

__all__ = ["TARGETS", "Outcome", "run_target", "mutate_bytes", "main"]


# -- generic byte mutations -----------------------------------------------------------------------


def mutate_bytes(rng: random.Random, raw: bytes, hot: int | None = None) -> bytes:
    """One of: empty file, truncation, bit flips, random bytes, an inserted or a deleted byte.
    Positions favour the first ``hot`` bytes (headers), where parsing decisions are made."""
    if not raw or rng.random() < 0.02:
        return b""
    hot = min(hot or len(raw), len(raw))

    def pos() -> int:
        return rng.randrange(hot) if rng.random() < 0.8 else rng.randrange(len(raw))

    b = bytearray(raw)
    kind = rng.randrange(5)
    if kind == 0:
        return bytes(b[: rng.randrange(len(b))])
    if kind in (1, 2):
        for _ in range(rng.randint(1, 6)):
            i = pos()
            b[i] = b[i] ^ (1 << rng.randrange(8)) if kind == 1 else rng.randrange(256)
        return bytes(b)
    i = pos()
    if kind == 3:
        return bytes(b[:i] + bytes([rng.randrange(256)]) + b[i:])
    return bytes(b[:i] + b[i + 1 :])


# -- targets --------------------------------------------------------------------------------------


@dataclass
class Target:
    """``make(rng, folder) -> path`` writes one case under ``folder``; ``read(path)`` reads it."""

    name: str
    make: Callable[[random.Random, Path], Path]
    read: Callable[[Path], None]


def _read_burnpack(path: Path) -> None:
    import onnxparam.burnpack as bp

    with bp.read(path) as f:
        for entry in f.tensors.values():
            entry.to_numpy()
        dict(f.metadata), dict(f.scalars)


_BURNPACK_RAW: list = []


def _make_burnpack(rng: random.Random, folder: Path) -> Path:
    if not _BURNPACK_RAW:
        _BURNPACK_RAW.append(MNIST_BPK.read_bytes())
    raw = _BURNPACK_RAW[0]
    hot = struct.unpack_from("<I", raw, 6)[0] + 10
    out = bytearray(mutate_bytes(rng, raw, hot))
    if len(out) >= 10 and rng.random() < 0.15:  # a huge or off-by-some declared metadata size
        out[6:10] = struct.pack("<I", rng.choice([0, 2**32 - 1, rng.randrange(2**32), len(out) - 10]))
    path = folder / "case.bpk"
    path.write_bytes(bytes(out))
    return path


# ONNX: real models plus a tiny one that a mutation can change field by field.

def _small_onnx():
    import onnx.parser
    from onnx import numpy_helper

    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2, 64] x) => (float[2, 64] y) <float[64] w = {0}, float[64] b = {0}> {
        t = Mul(x, w)
        y = Add(t, b)
    }""")
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.arange(64, dtype=np.float32), "w"))
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones(64, dtype=np.float32), "b"))
    return model


_ONNX_RAW: dict = {}


def _exported_onnx() -> bytes:
    """A model written by this library's exporter: it carries the onnxparam metadata keys."""
    from onnxparam import Module
    from onnxparam.nn import Linear
    from onnxparam.onnx_io import export_onnx

    class Net(Module):
        def __init__(self):
            self.fc = Linear(8, 4)

        def forward(self, x):
            return self.fc(x)

    folder = Path(tempfile.mkdtemp())
    try:
        return export_onnx(Net(), folder / "net.onnx", np.zeros((2, 8), np.float32)).read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _onnx_sources() -> dict:
    if not _ONNX_RAW:
        _ONNX_RAW["small"] = _small_onnx().SerializeToString()
        _ONNX_RAW["exported"] = _exported_onnx()
        for p in sorted(ONNX_DATA.glob("*.onnx")):
            if p.stat().st_size < 1_000_000:  # the larger models make each case slow
                _ONNX_RAW[p.name] = p.read_bytes()
    return _ONNX_RAW


def _structured_onnx(rng: random.Random, folder: Path) -> bytes:
    """A protobuf-level change to the small model: sizes, types and external data."""
    from onnx import TensorProto

    model = _small_onnx()
    init = model.graph.initializer[rng.randrange(2)]
    kind = rng.randrange(9)
    if kind == 0:
        init.dims[:] = [rng.choice([2**40, 2**62, -1, 0, 10, 65, rng.randrange(2**31)])]
    elif kind == 1:
        init.data_type = rng.choice([0, 2, 7, 8, 10, 14, 16, 999, rng.randrange(-5, 40)])
    elif kind == 2:
        init.raw_data = init.raw_data[: rng.randrange(len(init.raw_data))]
    elif kind == 3:
        init.ClearField("raw_data")
        init.float_data[:] = [1.0] * rng.randrange(80)
    elif kind in (4, 5):
        data = folder / "w.data"
        data.write_bytes(bytes(rng.choice([0, 8, 255, 256, 1024])))
        init.ClearField("raw_data")
        init.data_location = TensorProto.EXTERNAL
        location = "w.data" if kind == 4 else rng.choice(["../w.data", "/etc/hostname", "sub/../../w.data", ""])
        for key, value in (("location", location), ("offset", str(rng.choice([0, 1, 2**62, -8]))),
                           ("length", str(rng.choice([256, 8, 2**50, 0])))):
            entry = init.external_data.add()
            entry.key, entry.value = key, value
    elif kind == 6:
        model.graph.initializer.add().CopyFrom(init)
    elif kind == 7:
        init.name = rng.choice(["", "x", "y", "t", "w", "b", "a.b", "a/b", "onnx::w"])
    else:
        model.opset_import[0].version = rng.choice([0, 1, 10**6, -1])
    return model.SerializeToString()


def _make_onnx(rng: random.Random, folder: Path) -> Path:
    sources = _onnx_sources()
    if rng.random() < 0.4:
        raw = _structured_onnx(rng, folder)
    else:
        name = rng.choice(sorted(sources))
        raw = mutate_bytes(rng, sources[name], hot=20_000)
    path = folder / "case.onnx"
    path.write_bytes(raw)
    return path


def _read_onnx(path: Path) -> None:
    from onnxparam.core.module import named_params
    from onnxparam.onnx_io import import_onnx, read_onnx_record

    module = import_onnx(path)
    for _, param in named_params(module):
        param.val()
    for snap in read_onnx_record(path).values():
        snap.to_data()


# safetensors

def _st_bytes(header, data: bytes = b"", header_len: int | None = None) -> bytes:
    text = header if isinstance(header, (bytes, str)) else json.dumps(header)
    raw = text.encode() if isinstance(text, str) else text
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def _good_safetensors() -> bytes:
    from onnxparam.core.record import TensorSnapshot
    from onnxparam.core.tensor import TensorData
    from onnxparam.formats import write_safetensors

    folder = Path(tempfile.mkdtemp())
    try:
        arrays = {"fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "fc.bias": np.ones(4, np.float16),
                  "emb": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False])}

        def snap(a):
            from onnxparam.core.dtype import dtype_from_numpy

            return TensorSnapshot(dtype_from_numpy(a.dtype), a.shape, None, lambda _a=a: TensorData.from_numpy(_a))

        path = write_safetensors(folder / "g.safetensors", {k: snap(v) for k, v in arrays.items()},
                                 metadata={"producer": "fuzz"}, scalars={"step": 3})
        return path.read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_ST_RAW: list = []


def _structured_safetensors(rng: random.Random) -> bytes:
    def t(dtype="F32", shape=(2,), offsets=(0, 8)):
        return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}

    kind = rng.randrange(10)
    data = bytes(rng.choice([0, 8, 12, 16]))
    if kind == 0:
        return _st_bytes({"a": t()}, bytes(8), header_len=rng.choice([2**63, 2**64 - 1, 100_000_001, 99_999_999, 5000]))
    if kind == 1:
        return _st_bytes({"a": t(), "b": t(offsets=(rng.choice([0, 4, 7]), rng.choice([8, 12])))}, data)
    if kind == 2:
        return _st_bytes({"a": t(dtype=rng.choice(["F33", "f32", "", "F8_E4M3", "C64", 5, None, ["F32"], {"x": 1}]))}, data)
    if kind == 3:
        return _st_bytes({"a": t(shape=(rng.choice([4, 2**40, 2**62]),), offsets=(0, rng.choice([16, 2**42, 2**64])))}, data)
    if kind == 4:  # duplicate names, as raw JSON text
        return _st_bytes('{"a":%s,"a":%s}' % (json.dumps(t()), json.dumps(t(offsets=(8, 16)))), bytes(16))
    if kind == 5:
        depth = rng.choice([100, 5000, 100_000])
        return _st_bytes("[" * depth + "]" * depth)
    if kind == 6:
        key = rng.choice(["onnxparam.param_ids", "onnxparam.order", "onnxparam.dtypes", "onnxparam.scalars"])
        value = rng.choice(['{"a": -1}', '{"a": 1.5}', '["a", "a"]', '[1, "a"]', '{"a": {"dtype": "QFloat"}}',
                            '{"a": [1]}', "[" * 10000, "not json", '{"zz": 1}', '{"a": "Flex32"}', '{"s": {"Int": 1e400}}'])
        return _st_bytes({"__metadata__": {key: value}, "a": t()}, bytes(8))
    if kind == 7:
        return _st_bytes({"__metadata__": rng.choice([[1], {"a": 1}, None, "x"]), "a": t()}, bytes(8))
    if kind == 8:
        return _st_bytes({"a": t(shape=rng.choice([[2.0], [True, True], [-2], "2", [[2]]]))}, bytes(8))
    nan = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32).tobytes()
    return _st_bytes({"a": t(shape=(4,), offsets=(0, 16))}, nan)


def _make_safetensors(rng: random.Random, folder: Path) -> Path:
    if not _ST_RAW:
        _ST_RAW.append(_good_safetensors())
    raw = _ST_RAW[0]
    if rng.random() < 0.4:
        out = _structured_safetensors(rng)
    else:
        hot = struct.unpack_from("<Q", raw)[0] + 8
        out = mutate_bytes(rng, raw, hot)
    path = folder / "case.safetensors"
    path.write_bytes(out)
    return path


def _read_safetensors(path: Path) -> None:
    from onnxparam.formats import read_safetensors

    with read_safetensors(path) as f:
        for snap in f.tensors.values():
            snap.to_data()
        f.to_record()


# PEFT

def _make_peft(rng: random.Random, folder: Path) -> Path:
    from safetensors.numpy import save_file

    adapter = folder / "adapter"
    shutil.rmtree(adapter, ignore_errors=True)
    adapter.mkdir()
    config: dict = {"peft_type": "LORA", "bias": "none", "r": 2, "lora_alpha": 4}
    a = np.ones((2, 3), np.float32)
    b = np.ones((2, 2), np.float32)
    kind = rng.randrange(8)
    raw_config = None
    if kind == 0:
        raw_config = rng.choice([b"{not json", b"\xff\xfe{}", b"[" * 100_000, b"[1]", b"", b"null", b'"x"'])
    elif kind == 1:
        config[rng.choice(["r", "lora_alpha"])] = rng.choice([0, -1, 2.5, "x", None, [2], True, float("nan"), 1e308])
    elif kind == 2:
        key = rng.choice(["rank_pattern", "alpha_pattern"])
        config[key] = rng.choice([[1, 2], "proj", {"(": 2}, {"proj": "x"}, {"proj": 0}, {"proj": None}, {"proj": 2}])
    elif kind == 3:
        config[rng.choice(["use_dora", "use_rslora", "bias", "peft_type", "fan_in_fan_out"])] = rng.choice(
            [True, [1], "all", "LOHA", None, 0])
    elif kind == 4:
        a = np.ones(rng.choice([(2, 5), (3, 3), (6,), (2, 3, 1), (0, 3)]), np.float32)
    elif kind == 5:
        a = a.astype(rng.choice([np.int32, np.bool_, np.float16, np.float64]))
    raw_config = raw_config if raw_config is not None else json.dumps(config).encode()
    (adapter / "adapter_config.json").write_bytes(raw_config)
    tensors = {"base_model.model.proj.lora_A.weight": a, "base_model.model.proj.lora_B.weight": b}
    if kind == 6:
        tensors.pop(rng.choice(sorted(tensors)))
        tensors[rng.choice(["base_model.model.proj.bias", "base_model.model.x.lora_A.weight", "junk"])] = b
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    if kind == 7:
        victim = rng.choice(["adapter_config.json", "adapter_model.safetensors"])
        if rng.random() < 0.5:
            (adapter / victim).unlink()
        else:
            data = (adapter / victim).read_bytes()
            (adapter / victim).write_bytes(mutate_bytes(rng, data))
    return adapter


def _read_peft(folder: Path) -> None:
    from onnxparam import Module, load_peft_adapter
    from onnxparam.nn import Linear

    class Net(Module):
        def __init__(self):
            self.proj = Linear(3, 2)

        def forward(self, x):
            return self.proj(x)

    module = load_peft_adapter(Net(), folder)
    module.proj.weight.val().to_numpy()


TARGETS: dict = {
    "burnpack": Target("burnpack", _make_burnpack, _read_burnpack),
    "onnx": Target("onnx", _make_onnx, _read_onnx),
    "safetensors": Target("safetensors", _make_safetensors, _read_safetensors),
    "peft": Target("peft", _make_peft, _read_peft),
}


# -- the campaign ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    """Counts of one target's run and its failures as ``(case, description)``."""

    target: str
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    failures: list = field(default_factory=list)
    slowest_s: float = 0.0


def run_target(name: str, cases: int, seed: int, folder: Path, case_seconds: float = 5.0,
               save: Path | None = None) -> Outcome:
    """Run ``cases`` seeded cases of target ``name`` in ``folder``; never raises for a case."""
    from onnxparam.core.errors import OnnxParamError

    target = TARGETS[name]
    rng = random.Random(f"{name}:{seed}")
    out = Outcome(name)
    for case in range(cases):
        case_dir = folder / f"{name}-case"
        shutil.rmtree(case_dir, ignore_errors=True)
        case_dir.mkdir(parents=True)
        path = target.make(rng, case_dir)
        out.tried += 1
        start = time.perf_counter()
        problem = None
        try:
            with warnings.catch_warnings():
                # NOTE: a reader may warn (e.g. NaN payloads); warnings are not failures here
                warnings.simplefilter("ignore")
                target.read(path)
            out.accepted += 1
        except OnnxParamError:
            out.refused += 1
        except Exception as e:  # noqa: BLE001 - any other exception is the finding
            frame = traceback.extract_tb(e.__traceback__)[-1]
            problem = f"{type(e).__name__}: {str(e)[:200]} (at {Path(frame.filename).name}:{frame.lineno})"
        elapsed = time.perf_counter() - start
        out.slowest_s = max(out.slowest_s, elapsed)
        if problem is None and elapsed > case_seconds:
            problem = f"took {elapsed:.1f} s (limit {case_seconds} s)"
        if problem is not None:
            out.failures.append((case, problem))
            if save is not None:
                dest = save / f"{name}-seed{seed}-case{case}"
                if path.is_dir():
                    shutil.copytree(path, dest, dirs_exist_ok=True)
                else:
                    dest.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, dest / path.name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases per target (default 2000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--case-seconds", type=float, default=5.0, help="a slower case is a failure")
    parser.add_argument("--save", type=Path, help="copy failing inputs into this folder")
    parser.add_argument("--structured-cases", type=int, default=10_000,
                        help="cases per format of the structure-aware campaign (tools/fuzz_structured.py; default "
                             "10,000, ten times the test suite's); 0 skips it")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    total_failures = 0
    print(f"{'target':<12} {'tried':>7} {'refused':>8} {'accepted':>9} {'failures':>9} {'slowest':>9} {'time':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            start = time.perf_counter()
            out = run_target(name, args.cases, args.seed, Path(tmp), args.case_seconds, args.save)
            took = time.perf_counter() - start
            total_failures += len(out.failures)
            print(f"{name:<12} {out.tried:>7} {out.refused:>8} {out.accepted:>9} {len(out.failures):>9} "
                  f"{out.slowest_s:>8.2f}s {took:>6.1f}s")
            seen = set()
            for case, problem in out.failures:
                if problem not in seen:  # one line per distinct failure
                    seen.add(problem)
                    print(f"    case {case} (seed {args.seed}): {problem}")
    if args.structured_cases:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import fuzz_structured

        with tempfile.TemporaryDirectory() as tmp:
            for name in fuzz_structured.FORMATS:
                start = time.perf_counter()
                out = fuzz_structured.run_format(name, args.structured_cases, args.seed, Path(tmp))
                total_failures += len(out.findings)
                print(f"{name + '*':<12} {out.tried:>7} {out.refused:>8} {out.accepted:>9} {len(out.findings):>9} "
                      f"{'':>9} {time.perf_counter() - start:>6.1f}s")
                for problem in sorted({f.problem for f in out.findings}):
                    print(f"    (seed {args.seed}): {problem}")
        print("(* structure-aware: tools/fuzz_structured.py)")
    print(f"failures: {total_failures}")
    return 1 if total_failures else 0


if __name__ == "__main__":
    sys.exit(main())
