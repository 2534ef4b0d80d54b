"""ONNX's own conformance cases, built from the installed ``onnx`` package and cached on disk.

The node cases come from ``onnx.backend.test.case.node.collect_testcases`` (each a one-node
model with input and expected output arrays); the model cases (``simple``, ``pytorch-converted``,
``pytorch-operator``, ``light``) are read from ``onnx/backend/test/data``. Building the node cases
takes seconds, so each case is written once, as ONNX's own test-data layout
(``model.onnx`` + ``test_data_set_N/{input,output}_K.pb``), into a cache folder keyed by the onnx
version; nothing of it is committed.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import numpy_helper

CACHE_ENV = "ONNXPARAM_CONFORMANCE_CACHE"
"""Environment variable naming the cache folder (default ``~/.cache/onnxparam/onnx-cases``)."""

MODEL_DIRS = ("simple", "pytorch-converted", "pytorch-operator", "light")


@dataclass(frozen=True)
class Case:
    name: str
    folder: Path
    rtol: float = 1e-3
    atol: float = 1e-7
    """ONNX's default tolerances for node cases (``onnx.backend.test.case.base``)."""

    @property
    def model_path(self) -> Path:
        return self.folder / "model.onnx"

    def data_sets(self):
        """``[(inputs, outputs)]``, each a list of values in graph order: numpy arrays for tensors,
        lists for sequences, ``None`` / a value for optionals, dicts for maps."""
        graph = onnx.load(self.model_path, load_external_data=False).graph
        out = []
        for ds in sorted(self.folder.glob("test_data_set_*")):
            ins = [_read_value(p, graph.input[_index(p)].type) for p in sorted(ds.glob("input_*.pb"), key=_index)]
            outs = [_read_value(p, graph.output[_index(p)].type) for p in sorted(ds.glob("output_*.pb"), key=_index)]
            out.append((ins, outs))
        return out


def _index(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def _read_value(path: Path, type_proto: onnx.TypeProto):
    """The value in ``path``, parsed as the proto its graph type says (ONNX's test-data layout)."""
    which = type_proto.WhichOneof("value")
    proto, convert = {
        "sequence_type": (onnx.SequenceProto, numpy_helper.to_list),
        "optional_type": (onnx.OptionalProto, numpy_helper.to_optional),
        "map_type": (onnx.MapProto, numpy_helper.to_dict),
    }.get(which, (onnx.TensorProto, numpy_helper.to_array))
    message = proto()
    message.ParseFromString(path.read_bytes())
    return convert(message)


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "onnxparam", "onnx-cases")
    return Path(base) / f"onnx-{onnx.__version__}"


def node_cases() -> list[Case]:
    """Every node case of the installed onnx package, written once into the cache by onnx's own
    writer of test data (``onnx.backend.test.cmd_tools.generate_data``, which handles tensors,
    sequences, maps and optionals), fed with the node cases instead of the model cases."""
    root = cache_dir()
    done = root / ".complete"
    if not done.exists():
        import argparse
        from unittest import mock

        from onnx.backend.test import cmd_tools
        from onnx.backend.test.case import node

        with warnings.catch_warnings(), mock.patch.object(
            cmd_tools.model_test, "collect_testcases", lambda: node.collect_testcases(None)
        ):
            warnings.simplefilter("ignore")
            cmd_tools.generate_data(argparse.Namespace(output=str(root)))
        done.write_text("ok")
    return [Case(folder.name, folder) for folder in sorted(p for p in (root / "node").iterdir() if p.is_dir())]


def model_cases(dirs=MODEL_DIRS) -> list[Case]:
    """The model cases shipped in ``onnx/backend/test/data/<dir>`` (read in place)."""
    data = Path(onnx.__file__).parent / "backend" / "test" / "data"
    out = []
    for d in dirs:
        for folder in sorted((data / d).glob("*")):
            if (folder / "model.onnx").exists():
                out.append(Case(f"{d}/{folder.name}", folder))
    return out
