"""``.onnx_adapter`` files: a module's LoRA factors in ONNX Runtime's adapter format, for graphs
exported with ``lora="inputs"`` (see :mod:`onnxparam.lora._graph`). Runtime layer: it writes
and reads through ONNX Runtime's adapter API.

Format change (scale folding). Files written now hold ``a`` and ``scale * b``, and
``"inputs"`` exports have symbolic-rank factor inputs and no scale in the graph. Before that
change, exports had fixed-rank factor inputs and multiplied ``b`` by the exporting module's
scale in the graph, and files held the unscaled ``b``. ONNX Runtime's adapter format has no
metadata besides two user-set version numbers, and every parameter in a file must be a graph
input, so a file cannot carry a marker: an old file cannot be told from a new one by its bytes.
An old *model* can (its factor inputs have fixed ranks): :func:`check_onnx_adapter` refuses
such a model, naming it, since a file written now would run on it at ``scale**2`` strength.
Files written before the change must be rewritten from their module (``write_onnx_adapter``),
or their ``b`` multiplied by the adapter's ``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA).
"""

from __future__ import annotations

import os
import re
from typing import Optional

import numpy as np

from ..core.errors import ExecutionError, LoraError, OnnxParamError

__all__ = ["adapter_params", "write_onnx_adapter", "check_onnx_adapter", "read_onnx_adapter"]


def adapter_params(module) -> dict:
    """``{"<path>.lora.a": array, "<path>.lora.b": array, ...}`` for every adapter of
    ``module`` (an imported model's weights by their ONNX names: ``onnx::MatMul_7.lora.a``):
    the graph-input names of its ``"inputs"`` export and the values they are fed:
    ``a`` ``(d_in, r)`` and ``scale * b`` ``(r, d_out)`` (the scale folded into ``b``, as Olive
    writes adapters: ``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA), at the base's float
    dtype (float32 for a quantized base)."""
    from ..core.module import named_params
    from ..trace.tracer import untraced
    from ._graph import fed_factor

    # NOTE: an imported model's export names its weights as its file does (onnx::MatMul_12),
    # and the factor inputs after them (onnx::MatMul_12.lora.a): the same names here
    onnx_names = getattr(module, "onnx_names", None) or {}
    params = {}
    with untraced():
        for path, param in named_params(module):
            if param.adapter() is None:
                continue
            dtype = param.lazy_dtype()
            name = onnx_names.get(path, path)
            params[f"{name}.lora.a"] = fed_factor(param, "a", dtype)
            params[f"{name}.lora.b"] = fed_factor(param, "b", dtype, path)
    return params


def write_onnx_adapter(module_or_params, path, *, adapter_version: int = 1, model_version: int = 1,
                       adapter_name=None):
    """Write an ONNX Runtime adapter file (``.onnx_adapter``, ``onnxruntime.AdapterFormat``).

    Args:
        module_or_params: a module with LoRA adapters (``a`` and ``scale * b`` are written
            under the factors' record paths, ``fc.weight.lora.a`` ..., the names of the
            ``lora="inputs"`` export's graph inputs: :func:`adapter_params`), or a mapping
            ``name -> array`` written as given (then ``b`` must already carry the scale).
        path: the file to write.
        adapter_version, model_version: the versions stored in the file's header.
        adapter_name: write this named adapter of the module (``Module.add_adapter``) instead
            of the active one (``KeyError`` for an unknown name).

    Returns:
        the ``pathlib.Path`` written.

    Load it with ``onnxruntime.LoraAdapter().Load(path)`` and activate it per run with
    ``RunOptions.add_active_adapter``. NOTE: ONNX Runtime ignores active adapters under IO
    binding; bind the factors as inputs there instead (module docstring). NOTE: ``RunOptions``
    does not keep its ``LoraAdapter`` alive (ONNX Runtime 1.32 crashes if the adapter object is
    collected first): hold a reference for as long as the options are used.

    Raises:
        LoraError: (a ``ValueError``) there is nothing to write (a module without adapters, an
            empty mapping).
        PermissionError: (``EACCES``) ``path`` is read-only (whatever the process's privileges),
            or its folder is not writable; nothing is written.
        FileNotFoundError: (``ENOENT``) ``path``'s folder does not exist.
    """
    import os
    from pathlib import Path

    from ..formats._scratch import check_replaceable, disk_full_error, preserve_mode, register, release, scratch_name
    from ..runtime._ort import import_onnxruntime
    from ._adapters import no_adapter_reason

    ort = import_onnxruntime()
    if adapter_name is not None and not isinstance(module_or_params, dict):
        module_or_params = module_or_params.set_adapter(adapter_name)
    params = module_or_params if isinstance(module_or_params, dict) else adapter_params(module_or_params)
    if not params:
        what = ("the mapping is empty (apply_lora or load_peft_adapter first)" if isinstance(module_or_params, dict)
                else no_adapter_reason(module_or_params))
        raise LoraError(f"no LoRA adapter to write to '{path}': {what}")
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
            needed = sum(int(np.asarray(v).nbytes) for v in params.values())
            raise _adapter_write_error(e, path, needed) from e
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


def _free_bytes(folder) -> "int | None":
    try:
        st = os.statvfs(os.fspath(folder) or ".")
    except (OSError, AttributeError):  # no statvfs (Windows) or the folder is gone
        return None
    return st.f_bavail * st.f_frsize


def _adapter_write_error(error: Exception, path, needed: int = 0) -> Exception:
    """ONNX Runtime's failure to write ``path`` as the library's error: the library's
    ``ENOSPC`` :class:`~onnxparam.core.errors.FileAccessError` when the disk is full — ONNX Runtime
    says so ("No space left"), or its message is generic but the folder has less free space than
    the ``needed`` bytes of tensor data — else an :class:`~onnxparam.core.errors.ExecutionError`
    naming the file (the C++ source location left out)."""
    import errno

    from ..formats._scratch import disk_full_error

    text = " ".join(_CXX_SOURCE.sub("", str(error)).split()) or type(error).__name__
    free = _free_bytes(os.path.dirname(os.path.abspath(os.fspath(path))))
    if "no space left" in text.lower() or (free is not None and free < needed + (64 << 10)):
        return disk_full_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), path)
    return ExecutionError(f"ONNX Runtime could not write the adapter file '{path}': {text}")


def _model_factor_inputs(model_path, weights: Optional[dict] = None) -> dict:
    """``{name: (dims, onnx elem type)}`` of the LoRA factor inputs (``<W>.lora.a`` / ``.b``) of
    the ONNX file ``model_path``; a dim is an int or a symbolic name (``None`` when unnamed).
    ``weights``: filled with ``{W: dims}`` of the adapted initializers of rank >= 3 (convolution
    weights)."""
    import onnx

    from ..core.errors import OnnxFormatError

    try:
        proto = onnx.load(os.fspath(model_path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError, onnx's ValueError (the caller checked the file exists)
        raise OnnxFormatError(f"'{model_path}' is not a readable ONNX model: {type(e).__name__}: {e}") from e
    found = {}
    for value in proto.graph.input:
        if value.name.endswith((".lora.a", ".lora.b")):
            tensor = value.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
            found[value.name] = (dims, tensor.elem_type)
    if weights is not None:
        for init in proto.graph.initializer:
            if len(init.dims) >= 3 and f"{init.name}.lora.a" in found:
                weights[init.name] = tuple(int(d) for d in init.dims)
    return found


def check_onnx_adapter(adapter_path, model_path) -> dict:
    """Check that the ``.onnx_adapter`` file ``adapter_path`` fits the ``lora="inputs"`` export
    ``model_path`` before a session activates it, and return ``{factor name: shape}``.

    Checked: the model is an ``"inputs"`` export of the current format (symbolic rank dims, the
    scale not in the graph; module docstring), every parameter of the file is one of its factor
    inputs, ``a`` and ``b`` come in pairs of one rank ``r``: ``a`` ``(d_in, r)``, ``b``
    ``(r, d_out)`` with the model's ``d_in`` / ``d_out``, at the input's dtype; a grouped
    convolution's ``b`` block-diagonal (PEFT's ``lora_B``:
    :func:`onnxparam.lora._conv_checks.grouped_b_problem`).

    Raises:
        RecordError: every problem listed, the adapter file named; a model exported before the
            scale-folding change (fixed-rank factor inputs) is refused naming the model file.
        OnnxFormatError: ``model_path`` is not a readable ONNX file.
        ExecutionError: ONNX Runtime cannot read ``adapter_path`` as an adapter file.
        FileMissingError / IsAFolderError: a file is missing, or a folder.
    """
    from pathlib import Path

    from ..core.errors import RecordError

    adapter_path, model_path = Path(adapter_path), Path(model_path)
    for path in (adapter_path, model_path):
        if not path.is_file():
            import errno

            from ..core.errors import file_error

            code = errno.EISDIR if path.is_dir() else errno.ENOENT
            raise file_error(code, f"'{path}' is {'a folder' if code == errno.EISDIR else 'missing'}", str(path))
    conv_weights: dict = {}
    inputs = _model_factor_inputs(model_path, conv_weights)
    if not inputs:
        raise RecordError(f"'{model_path}' has no LoRA factor inputs (<param>.lora.a / .lora.b): it is not an "
                          "export with lora='inputs', so no adapter file can be activated on it")
    fixed = sorted(name for name, (dims, _) in inputs.items()
                   if len(dims) == 2 and isinstance(dims[1 if name.endswith(".a") else 0], int))
    if fixed:
        raise RecordError(
            f"'{model_path}' was exported with lora='inputs' before onnxparam folded the LoRA scale into the "
            f"adapter files: its factor inputs have fixed ranks ({fixed[0]!r} ...) and the graph multiplies b by "
            "the exporting module's scale, so an adapter written now (b already scaled) would run at the wrong "
            "strength; export the model again (export_onnx(..., lora='inputs'))")
    params = read_onnx_adapter(adapter_path)["parameters"]
    problems, ranks = [], {}
    for name, value in sorted(params.items()):
        if name not in inputs:
            problems.append(f"{name!r} is not a LoRA factor input of '{model_path.name}'")
            continue
        dims, elem = inputs[name]
        which = name[-1]
        want_dtype = _onnx_numpy_dtype(elem)
        if want_dtype is not None and value.dtype != want_dtype:
            problems.append(f"{name!r} is {value.dtype}, the model's input is {want_dtype}")
        fixed_axis = 0 if which == "a" else 1
        if value.ndim != 2 or (isinstance(dims[fixed_axis], int) and value.shape[fixed_axis] != dims[fixed_axis]):
            want = f"({dims[0]}, r)" if which == "a" else f"(r, {dims[1]})"
            problems.append(f"{name!r} has shape {list(value.shape)}, the model needs {want}")
            continue
        ranks.setdefault(name[:-len(".lora.a")], {})[which] = int(value.shape[1 - fixed_axis])
    for base, found in sorted(ranks.items()):
        if set(found) != {"a", "b"}:
            have = next(iter(found))
            problems.append(f"'{base}.lora.{have}' has no '{base}.lora.{'b' if have == 'a' else 'a'}' beside it")
        elif found["a"] != found["b"]:
            problems.append(f"'{base}.lora.a' has rank {found['a']} but '{base}.lora.b' has rank {found['b']}")
        elif base in conv_weights:  # a grouped conv's b must be PEFT's block-diagonal lora_B
            from ._conv_checks import grouped_b_problem

            a_rows = params[f"{base}.lora.a"].shape[0]
            problem = grouped_b_problem(params[f"{base}.lora.b"], conv_weights[base], a_rows)
            if problem is not None:
                problems.append(f"the adapter of {base!r} {list(conv_weights[base])}: {problem}")
    if problems:
        raise RecordError(f"the adapter file '{adapter_path}' does not fit '{model_path}'", problems)
    return {name: tuple(value.shape) for name, value in params.items()}


def read_onnx_adapter(path) -> dict:
    """The content of the ``.onnx_adapter`` file ``path``, read by ONNX Runtime's
    ``AdapterFormat.read_adapter``: ``{"format_version": int, "adapter_version": int,
    "model_version": int, "parameters": {name: numpy array}}`` (the parameters in name order;
    for a file :func:`write_onnx_adapter` wrote, ``<W>.lora.a`` ``(d_in, r)`` and ``<W>.lora.b``
    ``(r, d_out)`` with the scale folded in, at the base's float dtype).

    Raises:
        ExecutionError: ONNX Runtime cannot read ``path`` as an adapter file (its message, the
            C++ source location left out).
        ImportError: ONNX Runtime is not installed (naming the extras that bring it).
    """
    from ..runtime._ort import import_onnxruntime

    ort = import_onnxruntime()
    try:
        fmt = ort.AdapterFormat.read_adapter(os.fspath(path))
        params = {name: value.numpy() for name, value in fmt.get_parameters().items()}
        versions = {"format_version": int(fmt.get_format_version()), "adapter_version": int(fmt.get_adapter_version()),
                    "model_version": int(fmt.get_model_version())}
    except Exception as e:
        raise ExecutionError(f"ONNX Runtime cannot read '{path}' as an .onnx_adapter file: "
                             f"{' '.join(_CXX_SOURCE.sub('', str(e)).split()) or type(e).__name__}") from e
    return {**versions, "parameters": dict(sorted(params.items()))}


def _onnx_numpy_dtype(elem: int):
    """The numpy dtype of an ONNX tensor element type (``None`` for one numpy lacks)."""
    import onnx

    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except (KeyError, TypeError, ValueError):
        return None
