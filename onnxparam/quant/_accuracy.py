"""How much quantization moved a model's outputs: float and quantized ``.onnx`` files run in
plain ONNX Runtime on the same sample inputs (``onnxparam quantize``'s accuracy report).

* :func:`sample_inputs`: the calibration arrays when given (their first :data:`SAMPLES` rows),
  else inputs drawn from the graph's declared types and shapes (seeded): float ``N(0, 1)``,
  integer indices of an embedding ``Gather`` (directly or through shape-only ops such as a
  ``Reshape``: :data:`SHAPE_ONLY_OPS`) uniform in ``[0, rows)``, integer inputs named
  ``*mask*`` ``1``, other integers uniform in ``[0, INTEGER_RANGE)`` (byte values, token ids:
  the samples differ), booleans ``True``; declared static dims as declared, a symbolic leading dim
  :data:`SAMPLES`, other symbolic dims :data:`SYMBOLIC_DIM`.
* :func:`compare`: per output, ``cosine`` (of the flattened outputs in float64; 1.0 when both
  are all zeros) and ``max_abs_error`` (``max |float - quantized|``).
* :func:`sensitivity`: one-at-a-time, the float model with **one** weight replaced by its
  dequantized values; the weights whose replacement lowers the smallest output cosine most.
* :func:`weights_together`: the float model with **every** quantized weight replaced by its
  dequantized values at once (activations stay float): how much of the quantized file's error
  the weights' rounding explains, the rest being the integer kernels'.

A weight is found in the float file as an initializer of its main graph or as the ``value`` of a
``Constant`` node there (exporters such as Paddle2ONNX store every weight that way), by name.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np

__all__ = ["ACCURACY_KEY", "KEPT_FLOAT_KEY", "MIN_COSINE", "compare", "first_sample_only", "sample_inputs",
           "sensitivity", "weights_together"]

ACCURACY_KEY = "onnxparam.quant.accuracy"
"""Model ``metadata_props`` key: JSON ``{"inputs", "min_cosine", "outputs": [{"output", "cosine",
"max_abs_error"}]}`` of the accuracy report; below ``min_cosine`` also ``"sensitivity": [{"weight",
"cosine"}]`` (:func:`sensitivity`), ``"weights_together"`` (:func:`weights_together`; absent when
the float file holds none of the weights) or ``"sensitivity_skipped"`` (why it was not run)."""

KEPT_FLOAT_KEY = "onnxparam.quant.kept_float"
"""Model ``metadata_props`` key: JSON list of ``{"weight", "reason"}``: params left float."""

MIN_COSINE = {8: 0.999, 4: 0.99}
"""Default ``--min-cosine`` by bits of the scheme (int8: 0.999)."""

SAMPLES = 8
INTEGER_RANGE = 256
"""Drawn integer inputs that index no embedding table and are no mask: uniform in ``[0, 256)``."""
SYMBOLIC_DIM = 8
SENSITIVITY_LIMIT = 48
"""At most this many weights (the largest) are tried one at a time by :func:`sensitivity`."""


def _session(model, exact_dequantize: bool = False):
    """A plain CPU session of ``model``; ``exact_dequantize``: ORT's QDQ fusions off, so each
    ``DequantizeLinear`` gives its float weight and the float op runs on it (a ``.bpk`` output's
    ONNX rendering: what Burn computes with the dequantized values, not ORT's integer kernels)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if exact_dequantize:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    source = model if isinstance(model, (bytes, str)) else str(model)
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


_NP = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
       "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
       "tensor(int16)": np.int16, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
       "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_}


SHAPE_ONLY_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Transpose", "Cast", "Expand"})
"""Ops that move or retype an index tensor's values without changing them: a graph input reaching
an embedding ``Gather``'s indices through them (dynamo's ``view`` of the token ids) is drawn in
the table's rows."""


def _gather_rows(path) -> dict:
    """``{graph input name: rows}`` of inputs used, directly or through :data:`SHAPE_ONLY_OPS`
    (their first input), as indices of a ``Gather`` on an initializer: the smallest table's rows."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    inputs = {i.name for i in model.graph.input} - set(dims)
    producer = {out: node for node in model.graph.node for out in node.output}
    rows = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in dims and dims[node.input[0]]:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            n = dims[node.input[0]][axis]
            name, seen = node.input[1], set()
            while name not in inputs and name in producer and name not in seen:
                seen.add(name)
                source = producer[name]
                if source.op_type not in SHAPE_ONLY_OPS or not source.input:
                    break
                name = source.input[0]
            if name in inputs:
                rows[name] = min(rows.get(name, n), n)
    return rows


def first_sample_only(path, feeds: dict):
    """``feeds`` cut to their first row along the leading dim for the inputs whose leading dim
    the graph declares symbolic (those drawn :data:`SAMPLES` long), for a model that takes one
    sample at a time; ``None`` when no input has a symbolic leading dim with more than one row
    (a declared static dim is kept: the model could not take another)."""
    session = _session(path)
    cut, changed = dict(feeds), False
    for i in session.get_inputs():
        shape = i.shape or []
        value = feeds.get(i.name)
        if shape and not (isinstance(shape[0], int) and shape[0] >= 0) and getattr(value, "ndim", 0) and len(value) > 1:
            cut[i.name] = value[:1]
            changed = True
    return cut if changed else None


def sample_inputs(path, arrays: list | None = None, seed: int = 0) -> tuple:
    """``(feeds, description)``: the inputs the report runs on (module docstring).

    Args:
        path: the float ``.onnx`` file (its declared inputs).
        arrays: the calibration arrays, in graph input order, or ``None``.
        seed: the generator's seed for drawn inputs.
    """
    session = _session(path)
    inputs = session.get_inputs()
    if arrays is not None:
        n = min(SAMPLES, min(len(a) for a in arrays))
        feeds = {i.name: np.ascontiguousarray(a[:n]) for i, a in zip(inputs, arrays)}
        return feeds, f"the first {n} calibration samples"
    rng = np.random.default_rng(seed)
    rows = _gather_rows(path)
    feeds = {}
    for i in inputs:
        shape = [d if isinstance(d, int) and d >= 0 else (SAMPLES if k == 0 else SYMBOLIC_DIM)
                 for k, d in enumerate(i.shape or [])]
        dtype = _NP.get(i.type)
        if dtype is None:
            raise ValueError(f"graph input {i.name!r} has type {i.type}: no sample inputs can be drawn for it")
        if np.issubdtype(dtype, np.floating):
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            feeds[i.name] = np.ones(shape, np.bool_)
        elif i.name in rows:
            feeds[i.name] = rng.integers(0, max(1, rows[i.name]), size=shape).astype(dtype)
        elif "mask" in i.name.lower():
            feeds[i.name] = np.ones(shape, dtype)
        else:
            high = min(INTEGER_RANGE, int(np.iinfo(dtype).max) + 1)
            feeds[i.name] = rng.integers(0, high, size=shape).astype(dtype)
    leading = {v.shape[0] for v in feeds.values() if v.ndim}
    count = f"{leading.pop()} " if len(leading) == 1 else ""  # a declared static batch is what was drawn
    return feeds, f"{count}inputs drawn from the declared types and shapes (seed {seed})"


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0 or not (np.isfinite(na) and np.isfinite(nb)):
        return 0.0 if na == 0.0 or nb == 0.0 else float("nan")
    return float(np.dot(a, b) / (na * nb))


def _metrics(names: list, ref: list, got: list) -> list:
    rows = []
    for name, a, b in zip(names, ref, got):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = float(np.max(np.abs(a64 - b64))) if a64.size else 0.0
        rows.append({"output": name, "cosine": _cosine(a64, b64), "max_abs_error": err})
    return rows


def run(model, feeds: dict, exact_dequantize: bool = False) -> tuple:
    """``(output names, outputs)`` of ``model`` (a path or serialized bytes) on ``feeds``
    (``exact_dequantize``: :func:`_session`)."""
    session = _session(model, exact_dequantize)
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})


def compare(float_path, quant_path, feeds: dict, exact_dequantize: bool = False) -> list:
    """Per output of the float model: ``{"output", "cosine", "max_abs_error"}`` of the
    quantized model's output against the float one's, both run in plain ONNX Runtime
    (``exact_dequantize``: the quantized model without ORT's QDQ fusions, :func:`_session`)."""
    names, ref = run(float_path, feeds)
    _, got = run(quant_path, feeds, exact_dequantize)
    return _metrics(names, ref, got)


def _weight_tensors(model) -> dict:
    """``{name: onnx.TensorProto}`` of the main graph of ``model`` (an ``onnx.ModelProto``): its
    initializers, and the ``value`` tensor of each ``Constant`` node under the node's output name
    (the protos themselves: replacing one in place changes ``model``)."""
    tensors = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1:
            for a in n.attribute:
                if a.name == "value" and a.HasField("t"):
                    tensors.setdefault(n.output[0], a.t)
    return tensors


@contextlib.contextmanager
def _replaced(tensors: dict, values: dict):
    """``tensors`` (:func:`_weight_tensors`) holding ``values`` (``{name: array}``, cast to each
    tensor's dtype) inside the block, their original contents after it."""
    from onnx import numpy_helper

    originals = {}
    try:
        for name, value in values.items():
            tensor = tensors[name]
            originals[name] = type(tensor)()
            originals[name].CopyFrom(tensor)
            tensor.CopyFrom(numpy_helper.from_array(np.asarray(value).astype(numpy_helper.to_array(tensor).dtype),
                                                    tensor.name))
        yield
    finally:
        for name, original in originals.items():
            tensors[name].CopyFrom(original)


def sensitivity(float_path, dequantized: dict, feeds: dict, top: int = 5) -> list:
    """One quantized weight at a time: the float model with the weight ``name`` (an initializer
    or a ``Constant`` node's output of its main graph) replaced by ``dequantized[name]`` (the
    weight's dequantized values), run on ``feeds``. Returns up to ``top`` ``(name, smallest
    output cosine)``, the lowest first (at most :data:`SENSITIVITY_LIMIT` weights are tried, the
    largest; names the file does not hold are not tried)."""
    import onnx

    model = onnx.load(str(float_path))
    names, ref = run(float_path, feeds)
    tensors = _weight_tensors(model)
    tried = sorted((n for n in dequantized if n in tensors), key=lambda n: -np.asarray(dequantized[n]).size)
    found = []
    for name in tried[:SENSITIVITY_LIMIT]:
        with _replaced(tensors, {name: dequantized[name]}):
            _, got = run(model.SerializeToString(), feeds)
        found.append((name, min(r["cosine"] for r in _metrics(names, ref, got))))
    found.sort(key=lambda item: item[1])
    return found[:top]


def weights_together(float_path, dequantized: dict, feeds: dict) -> "float | None":
    """The smallest output cosine of the float model with every weight of ``dequantized``
    (``{name: dequantized values}``, found as :func:`sensitivity` finds them) replaced at once, run
    on ``feeds`` against the float model: the part of the quantized file's error that the
    weights' rounding explains (activations stay float). ``None`` when the file holds none of
    the names."""
    import onnx

    model = onnx.load(str(float_path))
    tensors = _weight_tensors(model)
    present = {n: v for n, v in dequantized.items() if n in tensors}
    if not present:
        return None
    names, ref = run(float_path, feeds)
    with _replaced(tensors, present):
        _, got = run(model.SerializeToString(), feeds)
    return min(r["cosine"] for r in _metrics(names, ref, got))


def settle_shapes(model, structure_only: bool = False):
    """``model`` (an ``onnx.ModelProto``) with value infos whose dims are all known or named:
    entries with an unknown dim are dropped and ONNX shape inference (with data propagation:
    ``Shape -> Concat -> Reshape`` keeps named dims) fills them with shared symbols (``unk__N``)
    where no name is known, as ``onnxruntime.quantization`` does before writing. ONNX Runtime's
    fusions that need two inputs of provably equal shape (``SkipLayerNormalization`` after an
    int8 ``MatMul``) then apply. A model inference fails on is returned with only the drop.
    ``structure_only``: the model's large tensors are external placeholders without data
    (:func:`onnxparam.quant._shapes.settle_value_infos`); inference reads only their types and
    shapes."""
    import onnx

    known = [v for v in model.graph.value_info
             if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
             and all(d.HasField("dim_value") or d.HasField("dim_param") for d in v.type.tensor_type.shape.dim)]
    del model.graph.value_info[:]
    model.graph.value_info.extend(known)
    if not structure_only and any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return model  # NOTE: a > 2 GiB model: inference would need its data in memory
    # NOTE: data_prop: a Reshape whose shape is Concat(Shape(x)[0], 64, ...) (an exported attention)
    # keeps x's named batch dim instead of fresh unk__ symbols, so SkipLayerNormalization still sees
    # the residual Add's two inputs as the same shape (the nn transformer block of tools/bench.py quant)
    for data_prop in (True, False):
        try:
            return onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
        except Exception:  # noqa: BLE001 - shape inference is an optimisation here
            continue
    return model


RUN_MEMORY_FACTOR = 3
"""The accuracy report runs when this many times the float and quantized models' bytes fit in
the memory available (ONNX Runtime holds both models' weights, prepacked copies and the
activations); :func:`fits_in_memory`."""

SENSITIVITY_MEMORY_FACTOR = 4
"""The one-at-a-time sensitivity runs when this many times the models' bytes fit in memory (the
float model is parsed, serialized and run once per weight)."""

STREAMED_REWRITE_BYTES = 16 << 20
"""An ``.onnx`` file larger than this gets its metadata by a streamed rewrite
(``onnxparam quantize``: :func:`onnxparam.onnx_io._save.rewrite_metadata`)."""


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``; the cgroup limit
    less its usage when lower), or ``None`` where it cannot be read."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max" and found is not None:
            found = min(found, int(limit) - used)
    except (OSError, ValueError):
        pass
    return found


def fits_in_memory(model_bytes: int) -> tuple:
    """``(fits, reason)``: whether running models of ``model_bytes`` weights in total in ONNX
    Runtime fits the memory available (:data:`RUN_MEMORY_FACTOR`); ``reason`` says why not."""
    available = available_memory()
    if available is None or RUN_MEMORY_FACTOR * model_bytes <= available:
        return True, ""
    return False, (f"running the float and quantized models ({model_bytes / 2**30:.2f} GiB of weights) in ONNX "
                   f"Runtime needs about {RUN_MEMORY_FACTOR * model_bytes / 2**30:.1f} GiB, {available / 2**30:.1f} "
                   "GiB of memory is available")


def read_structure(path):
    """The ``onnx.ModelProto`` of the ``.onnx`` at ``path`` without its tensors' bytes: inline
    tensors of more than 1 KiB become references into the file, unread
    (:func:`onnxparam.formats._onnx_nested.read_onnx_mapped`); external ones stay references."""
    from ..formats._onnx_nested import read_onnx_mapped

    return read_onnx_mapped(path, min_bytes=1024)


def write_metadata(path, props: dict) -> None:
    """Add ``props`` (``{key: JSON-able}``) to the ``metadata_props`` of the ``.onnx`` at
    ``path`` (rewritten in place; external data files stay as they are), its value infos settled
    (:func:`settle_shapes`). A file with its weights inline is parsed whole: above
    :data:`STREAMED_REWRITE_BYTES` use :func:`onnxparam.onnx_io._save.rewrite_metadata`."""
    import onnx

    model = settle_shapes(onnx.load(str(path), load_external_data=False))
    existing = {p.key: p for p in model.metadata_props}
    for key, value in props.items():
        text = json.dumps(value, separators=(",", ":"))
        if key in existing:
            existing[key].value = text
        else:
            model.metadata_props.add(key=key, value=text)
    onnx.save(model, str(path))
