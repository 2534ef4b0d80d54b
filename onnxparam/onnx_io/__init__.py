"""ONNX import and export: ONNX models as modules, modules as ONNX models.

A bridge between the model layer (:mod:`onnxparam.module`, :mod:`onnxparam.param`) and ONNX
files; it uses the tracer (:mod:`onnxparam.trace`) to emit graphs and ``onnx_ir`` to read and
write them. Parts, each its own module:

* :mod:`~onnxparam.onnx_io.naming`: ONNX names <-> module paths (a reversible escaping).
* :mod:`~onnxparam.onnx_io.metadata`: the ``metadata_props`` keys that keep param ids,
  trainable flags and LoRA scales.
* :mod:`~onnxparam.onnx_io.source`: reading a model, with every problem an ``OnnxFormatError``.
* :mod:`~onnxparam.onnx_io.weights`: which tensors of a graph are weights (params).
* :mod:`~onnxparam.onnx_io.importer`: :func:`import_onnx` -> :class:`OnnxModule`.
* :mod:`~onnxparam.onnx_io.exporter`: :func:`export_onnx`.
* :mod:`~onnxparam.onnx_io.records`: ONNX weights <-> :class:`~onnxparam.ModuleRecord`
  (:func:`read_onnx_record`, :func:`write_record_to_onnx`), for the converters.
* :mod:`~onnxparam.onnx_io.save`: writing a model (external data, sharding, atomic rename).
"""

from .exporter import export_onnx
from .importer import OnnxModule, OnnxScope, import_onnx
from .naming import onnx_name_to_path, path_to_onnx_name
from .records import read_onnx_record, write_record_to_onnx
from .save import save_model

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
