"""ONNX import and export: ONNX models as modules, modules as ONNX models.

The layer between the module tree (:mod:`onnxparam.core.module`, :mod:`onnxparam.core.param`) and ONNX
files; it uses the tracer (:mod:`onnxparam.trace.tracer`) to emit graphs and ``onnx_ir`` to read and
write them. Parts, each its own module:

* :mod:`~onnxparam.onnx_io._naming`: ONNX names <-> module paths (a reversible escaping).
* :mod:`~onnxparam.onnx_io._metadata`: the ``metadata_props`` keys that keep param ids,
  trainable flags and LoRA scales.
* :mod:`~onnxparam.onnx_io._source`: reading a model, with every problem an ``OnnxFormatError``.
* :mod:`~onnxparam.onnx_io._weights`: which tensors of a graph are weights (params).
* :mod:`~onnxparam.onnx_io._importer`: :func:`import_onnx` -> :class:`OnnxModule`.
* :mod:`~onnxparam.onnx_io._exporter`: :func:`export_onnx`.
* :mod:`~onnxparam.onnx_io._records`: ONNX weights <-> :class:`~onnxparam.ModuleRecord`
  (:func:`read_onnx_record`, :func:`write_record_to_onnx`), for the converters.
* :mod:`~onnxparam.onnx_io._save`: writing a model (external data, sharding, atomic rename).

This facade imports nothing at import time; each name is imported on first use.
"""

_NAMES = {
    "export_onnx": "._exporter",
    "import_onnx": "._importer", "OnnxModule": "._importer", "OnnxScope": "._importer",
    "onnx_name_to_path": "._naming", "path_to_onnx_name": "._naming",
    "read_onnx_record": "._records", "write_record_to_onnx": "._records",
    "save_model": "._save",
}


def __getattr__(name):
    owner = _NAMES.get(name)
    if owner == "._exporter":
        from . import _exporter as module
    elif owner == "._importer":
        from . import _importer as module
    elif owner == "._naming":
        from . import _naming as module
    elif owner == "._records":
        from . import _records as module
    elif owner == "._save":
        from . import _save as module
    else:
        raise AttributeError(f"module 'onnxparam.onnx_io' has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))


__all__ = [
    "import_onnx",
    "export_onnx",
    "OnnxModule",
    "OnnxScope",
    "read_onnx_record",
    "write_record_to_onnx",
    "onnx_name_to_path",
    "path_to_onnx_name",
    "save_model",
]
