"""``.onnx_adapter`` files: a module's LoRA factors in ONNX Runtime's adapter format, for graphs
exported with ``lora="inputs"`` (see :mod:`onnxparam._lora_graph`). Runtime layer: it writes
through ONNX Runtime's adapter API."""

from __future__ import annotations

import os
import re

import numpy as np

from .errors import ExecutionError, OnnxParamError

__all__ = ["adapter_params", "write_onnx_adapter"]


def adapter_params(module) -> dict:
    """``{"<path>.lora.a": array, "<path>.lora.b": array, ...}`` for every adapter of
    ``module``: the graph-input names of its ``"inputs"`` export and the values they are fed:
    ``a`` ``(d_in, r)`` and ``scale * b`` ``(r, d_out)`` (the scale folded into ``b``, as Olive
    writes adapters: ``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA), at the base's float
    dtype (float32 for a quantized base)."""
    from ._lora_graph import fed_factor
    from ._trace import untraced
    from .module import named_params

    params = {}
    with untraced():
        for path, param in named_params(module):
            if param.adapter() is None:
                continue
            dtype = param.lazy_dtype()
            params[f"{path}.lora.a"] = fed_factor(param, "a", dtype)
            params[f"{path}.lora.b"] = fed_factor(param, "b", dtype)
    return params


def write_onnx_adapter(module_or_params, path, *, adapter_version: int = 1, model_version: int = 1):
    """Write an ONNX Runtime adapter file (``.onnx_adapter``, ``onnxruntime.AdapterFormat``).

    Args:
        module_or_params: a module with LoRA adapters (``a`` and ``scale * b`` are written
            under the factors' record paths, ``fc.weight.lora.a`` ..., the names of the
            ``lora="inputs"`` export's graph inputs: :func:`adapter_params`), or a mapping
            ``name -> array`` written as given (then ``b`` must already carry the scale).
        path: the file to write.
        adapter_version, model_version: the versions stored in the file's header.

    Returns:
        the ``pathlib.Path`` written.

    Load it with ``onnxruntime.LoraAdapter().Load(path)`` and activate it per run with
    ``RunOptions.add_active_adapter``. NOTE: ONNX Runtime ignores active adapters under IO
    binding; bind the factors as inputs there instead (module docstring). NOTE: ``RunOptions``
    does not keep its ``LoraAdapter`` alive (ONNX Runtime 1.32 crashes if the adapter object is
    collected first): hold a reference for as long as the options are used.

    Raises:
        ValueError: when there is nothing to write (a module without adapters).
        PermissionError: (``EACCES``) ``path`` is read-only (whatever the process's privileges),
            or its folder is not writable; nothing is written.
        FileNotFoundError: (``ENOENT``) ``path``'s folder does not exist.
    """
    import os
    from pathlib import Path

    from ._ort import import_onnxruntime
    from ._scratch import check_replaceable, disk_full_error, preserve_mode, register, release, scratch_name

    ort = import_onnxruntime()
    params = module_or_params if isinstance(module_or_params, dict) else adapter_params(module_or_params)
    if not params:
        raise ValueError("no LoRA adapter to write: the module has no adapters (apply_lora first)")
    values = {str(k): ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(int(adapter_version))
    fmt.set_model_version(int(model_version))
    fmt.set_parameters(values)
    path = Path(path)
    # NOTE: ONNX Runtime writes straight to the path it is given; write beside it and rename,
    # so a failed save never destroys the previous adapter file. The rename would also replace
    # a read-only file that open(path, "w") refuses: check first, keep the old mode.
    mode = check_replaceable(path)
    scratch = path.with_name(scratch_name(path.name))
    register(scratch)
    try:
        try:
            fmt.export_adapter(str(scratch))
        except Exception as e:
            if isinstance(e, (OSError, OnnxParamError)):
                raise
            raise _adapter_write_error(e, path) from e
        preserve_mode(mode, scratch)
        os.replace(scratch, path)
    except BaseException as e:
        scratch.unlink(missing_ok=True)
        full = disk_full_error(e, path)
        if full is not None:
            raise full from e
        raise
    finally:
        release(scratch)
    return path


_CXX_SOURCE = re.compile(r"\S*onnxruntime\S*\.(?:cc|cpp|h):\d+\s+(?:(?:[\w:<>~*&]+\s+)?[\w:<>~]+\([^)]*\)\s*)?")
"""ONNX Runtime's C++ source location (``/onnxruntime_src/...cc:123 void f(...)``) in its messages."""


def _adapter_write_error(error: Exception, path) -> Exception:
    """ONNX Runtime's failure to write ``path`` as the library's error: ``OSError(ENOSPC)`` when
    the disk is full, else an :class:`~onnxparam.errors.ExecutionError` naming the file (the C++
    source location left out)."""
    import errno

    text = " ".join(_CXX_SOURCE.sub("", str(error)).split()) or type(error).__name__
    if "no space left" in text.lower():
        return OSError(errno.ENOSPC, text, os.fspath(path))
    return ExecutionError(f"ONNX Runtime could not write the adapter file '{path}': {text}")
