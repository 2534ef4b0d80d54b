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


# -- plain ONNX Runtime, every element type ---------------------------------------------------------
#
# The oracle runner of the conformance tests: ONNX Runtime's numpy binding cannot carry bfloat16,
# float8, float4, int4/uint4, int2/uint2 ("Numpy_type 256 can't be converted to MLDataType"), so
# those inputs go in as OrtValues holding the bytes ONNX itself writes for them
# (``onnx.numpy_helper.from_array(...).raw_data``, ONNX's packing) and such outputs are read back
# through ``onnx.numpy_helper.to_array`` of a TensorProto holding their bytes. Written apart from
# onnxparam's own boundary (onnxparam.runtime._values), which it checks.

_NUMPY_NATIVE = {"float", "float16", "double", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "bool", "string"}


def _onnx_elem(type_string: str):
    if not type_string.startswith("tensor("):
        return None
    name = type_string[7:-1]
    if name in _NUMPY_NATIVE:
        return None
    return {"float8e4m3fn": "FLOAT8E4M3FN", "float8e4m3fnuz": "FLOAT8E4M3FNUZ", "float8e5m2": "FLOAT8E5M2",
            "float8e5m2fnuz": "FLOAT8E5M2FNUZ", "float8e8m0": "FLOAT8E8M0", "float4e2m1": "FLOAT4E2M1"}.get(
        name, name.upper())


def _to_ortvalue(array, ort):
    import ctypes

    import numpy as np

    proto = numpy_helper.from_array(np.asarray(array))
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(np.shape(array)), int(proto.data_type))
    data = proto.raw_data
    if data:
        ctypes.memmove(value.data_ptr(), data, len(data))
    return value


def _from_ortvalue(value):
    import ctypes

    type_name = _onnx_elem(value.data_type())
    if type_name is None:
        return value.numpy()
    proto = onnx.TensorProto()
    proto.data_type = getattr(onnx.TensorProto, type_name)
    proto.dims.extend(value.shape())
    n = value.tensor_size_in_bytes()
    proto.raw_data = ctypes.string_at(value.data_ptr(), n) if n else b""
    return numpy_helper.to_array(proto)


def _raw_numpy(x) -> bool:
    import numpy as np

    return isinstance(x, np.ndarray) and x.dtype.kind not in "OUS" and str(x.dtype) not in (
        "float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "bool")


def run_plain_ort(model, inputs, session_options=None):
    """Plain ONNX Runtime (CPU) on ``model`` (a path or bytes) with ``inputs`` in graph input
    order; outputs of every element type (see above)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model if isinstance(model, bytes) else str(model), session_options,
                                   providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    raw_out = any(_onnx_elem(o.type) is not None for o in session.get_outputs())
    if not raw_out and not any(_raw_numpy(x) for x in inputs):
        return session.run(None, dict(zip(names, inputs)))
    feed = {n: _to_ortvalue(x, ort) if _raw_numpy(x) else x for n, x in zip(names, inputs)}
    if not raw_out:
        return session.run(None, feed)
    feed = {n: x if isinstance(x, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(x) for n, x in feed.items()}
    return [_from_ortvalue(v) for v in session.run_with_ort_values([o.name for o in session.get_outputs()], feed)]


def library_value(x):
    """A case input as a user hands it over: a :class:`onnxparam.Tensor` where onnxparam has a
    dtype for it (bfloat16 included), the numpy array otherwise (strings, float8, int4 ...)."""
    import numpy as np

    import onnxparam as op

    if isinstance(x, np.ndarray) and x.dtype.kind not in "OUS":
        try:
            op.DType.from_numpy(x.dtype)
        except Exception:  # noqa: BLE001 - no Burn dtype: numpy it stays
            return x
        return op.Tensor.from_numpy(x)
    return x
