"""File formats other than burnpack (:mod:`onnxparam.burnpack`): bytes in, lazy tensors out.

These modules know bytes and tensor snapshots, not modules (the loaders in
:mod:`onnxparam.convert` load them into modules).

* :mod:`._safetensors`: Hugging Face safetensors files (lazy zero-copy reads, streaming writes).
* :mod:`._pytorch`: PyTorch ``torch.save`` checkpoints (zip and legacy), read without torch
  through a restricted unpickler (``docs/pytorch_checkpoint.md``).
* :mod:`._onnx_stream`: ``.onnx`` files with inline initializers written and read field by
  field, so peak memory stays near one tensor.
* ``._names``: tensor-name rewriting (``KeyRemapper``, ``map_indices_contiguous``), the one
  implementation the ``.pt`` reader, the loaders and the converter share.
* ``._onnx_nested``: the tensors of every graph of a serialized model (subgraphs, ``Constant``
  values) rewritten in place: placeholders given their bytes, inline bytes mapped
  (:func:`read_onnx_mapped`).
* ``._scalars``: Burn's typed metadata scalars and bool stores, shared with the burnpack format.
* ``._scratch``: atomic writes through a scratch file (read-only targets refused, modes kept).
* ``._file_range``: tensor bytes copied file to file by the kernel when a conversion leaves them
  unchanged.
* ``._mapped``: the memory map + in-place-change watch shared with the burnpack reader.
"""

_NAMES = {
    "SafetensorsFile": "._safetensors", "SafetensorsTensor": "._safetensors",
    "read_safetensors": "._safetensors", "write_safetensors": "._safetensors",
    "PytorchCheckpoint": "._pytorch", "CheckpointTensors": "._pytorch", "read_pytorch": "._pytorch",
    "pytorch_record": "._pytorch",
    "StreamedTensor": "._onnx_stream", "write_onnx_streamed": "._onnx_stream",
    "read_onnx_streamed": "._onnx_stream", "read_onnx_mapped": "._onnx_nested",
    "KeyRemapper": "._names", "map_indices_contiguous": "._names",
}
"""Each public name and its module, imported on first use: the burnpack reader imports
``._mapped``, and importing this package must not pull in every format."""

__all__ = sorted(_NAMES)


def __getattr__(name):
    owner = _NAMES.get(name)
    if owner == "._safetensors":
        from . import _safetensors as module
    elif owner == "._pytorch":
        from . import _pytorch as module
    elif owner == "._onnx_stream":
        from . import _onnx_stream as module
    elif owner == "._onnx_nested":
        from . import _onnx_nested as module
    elif owner == "._names":
        from . import _names as module
    else:
        raise AttributeError(f"module 'onnxparam.formats' has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
