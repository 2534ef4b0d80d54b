"""Devices and execution providers; host and device ``OrtValue`` s."""

from __future__ import annotations

import ctypes
import math
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from ..core.device import CPU, Device
from ..core.dtype import DType
from ..core.errors import DeviceError
from ..core.tensor import Tensor
from ._config import SessionConfig
from ._ort import import_onnxruntime

ort = import_onnxruntime()

__all__ = ["providers_for", "ortvalue_from_numpy", "pick_device", "ortvalue_host", "ortvalue_to_numpy"]

_CUDA_PROVIDER = "CUDAExecutionProvider"
_CPU_PROVIDER = "CPUExecutionProvider"


def _available_providers() -> list:
    return list(ort.get_available_providers())


def _no_cuda(device: Device) -> DeviceError:
    return DeviceError(
        f"device {device} needs ONNX Runtime's {_CUDA_PROVIDER}, which is not available; available "
        f"providers: {', '.join(_available_providers())}. Install onnxruntime-gpu ('onnxparam[gpu]') "
        "with a matching CUDA, or use Device('cpu')"
    )


def providers_for(device: "Device | str", config: Optional[SessionConfig] = None) -> list:
    """The ``providers`` argument of an ``InferenceSession`` for ``device``.

    Raises:
        DeviceError: when the provider the device (or ``config.providers``) needs is not
            available; the message lists the available ones.
    """
    device = Device(device)
    available = _available_providers()
    if config is not None and config.providers is not None:
        providers = []
        for p in config.providers:
            name, options = (p, {}) if isinstance(p, str) else (p[0], dict(p[1]))
            if name not in available:
                raise DeviceError(f"execution provider {name} is not available; available providers: "
                                  f"{', '.join(available)}")
            if name == _CUDA_PROVIDER and "device_id" not in options:
                options["device_id"] = str(device.index)
            providers.append((name, options) if options else name)
        return providers
    if device.is_cuda:
        if _CUDA_PROVIDER not in available:
            raise _no_cuda(device)
        return [(_CUDA_PROVIDER, {"device_id": str(device.index)}), _CPU_PROVIDER]
    return [_CPU_PROVIDER]


def _c_contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` in C order; unlike ``np.ascontiguousarray`` a 0-d array stays 0-d."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(array.shape)


_FLOAT8_ONNX_TYPES = {d.to_numpy().name: d.to_onnx() for d in (DType.F8E4M3FN, DType.F8E4M3FNUZ, DType.F8E5M2,
                                                                 DType.F8E5M2FNUZ, DType.F8E8M0FNU)}
"""``ml_dtypes`` float8 type name -> ONNX element type (see :mod:`onnxparam.core.dtype`)."""


def ortvalue_host(array: np.ndarray):
    """A CPU ``OrtValue`` sharing ``array``'s memory (bfloat16 through its raw uint16 bits, the
    one-byte float8 types of ``ml_dtypes`` through their raw bytes)."""
    array = _c_contiguous(array)
    if array.dtype == ml_dtypes.bfloat16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), DType.BF16.to_onnx())
    if array.dtype.itemsize == 1 and array.dtype.kind in "Vf":
        onnx_type = _FLOAT8_ONNX_TYPES.get(array.dtype.name)  # NOTE: ml_dtypes gives some kind "f", some "V"
        if onnx_type is not None:
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint8), onnx_type)
    return ort.OrtValue.ortvalue_from_numpy(array)


def ortvalue_from_numpy(array, device: "Device | str"):
    """An ``onnxruntime.OrtValue`` holding ``array`` on ``device`` (a copy on CUDA).

    Raises:
        DeviceError: when ``device`` is CUDA and the CUDA execution provider is unavailable.
    """
    device = Device(device)
    providers_for(device)
    array = _c_contiguous(np.asarray(array))
    if not device.is_cuda:
        return ortvalue_host(array)
    if array.dtype == ml_dtypes.bfloat16:
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), np.uint16, "cuda", device.index)
        value.update_inplace(array.view(np.uint16))
        return value
    return ort.OrtValue.ortvalue_from_numpy(array, "cuda", device.index)


def ortvalue_to_numpy(value, dtype: DType) -> np.ndarray:
    """A host array of a (CPU) ``OrtValue``; bfloat16 is copied through its raw bits, which
    ONNX Runtime's ``numpy()`` cannot return."""
    if dtype is not DType.BF16:
        return value.numpy()
    shape = tuple(value.shape())
    n = math.prod(shape)
    if n == 0:
        return np.zeros(shape, dtype=ml_dtypes.bfloat16)
    raw = (ctypes.c_uint16 * n).from_address(value.data_ptr())
    return np.frombuffer(raw, dtype=np.uint16).copy().view(ml_dtypes.bfloat16).reshape(shape)


def pick_device(owner: str, params: Sequence[tuple], tensors: Sequence[Tensor]) -> Device:
    """The device a call runs on: the used params' device, else the inputs' CUDA device, else cpu.

    Raises:
        DeviceError: for params on several devices, or a CUDA input on another device than
            the params.
    """
    by_device: dict = {}
    for path, param in params:
        by_device.setdefault(param.lazy_device(), []).append(path)
    if len(by_device) > 1:
        where = "; ".join(f"{d}: {', '.join(repr(p) for p in paths[:4])}" for d, paths in by_device.items())
        raise DeviceError(f"{owner} has params on several devices ({where}); move it with module.to_device(...)")
    input_devices = {t.device for t in tensors if t.device.is_cuda}
    if by_device:
        device = next(iter(by_device))
        stray = [d for d in input_devices if d != device]
        if stray:
            raise DeviceError(f"{owner} lives on {device} but an input is on {stray[0]}; move the input with "
                              f"tensor.to_device({str(device)!r})")
        return device
    if len(input_devices) > 1:
        raise DeviceError(f"{owner}: inputs on several devices ({', '.join(sorted(map(str, input_devices)))})")
    return next(iter(input_devices)) if input_devices else CPU

