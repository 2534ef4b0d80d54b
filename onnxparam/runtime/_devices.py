"""Devices and execution providers; host and device ``OrtValue`` s."""

from __future__ import annotations

from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from ..core.device import CPU, Device
from ..core.dtype import DType
from ..core.errors import DeviceError
from ..core.tensor import Tensor
from ._config import SessionConfig
from ._ort import import_onnxruntime
from ._values import host_ortvalue, onnx_of_numpy, ortvalue_array

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


def ortvalue_host(array: np.ndarray):
    """A CPU ``OrtValue`` of ``array`` (sharing its memory, except packed sub-byte types), every
    ONNX element type included: bfloat16, float8, int4 ... through their raw bits (see
    :mod:`onnxparam.runtime._values`)."""
    return host_ortvalue(_c_contiguous(array), ort)


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
    onnx_type = onnx_of_numpy(array.dtype)
    if onnx_type is not None:
        # NOTE: float8 / int4 ...: built on the host from the raw bits, then copied by ORT's
        # IO binding; a CUDA OrtValue cannot be filled from numpy bits of these types
        raise DeviceError(f"a {array.dtype.name} tensor cannot be placed on {device} directly; keep it on the cpu "
                          "(ONNX Runtime copies it to the device when a session runs)")
    return ort.OrtValue.ortvalue_from_numpy(array, "cuda", device.index)


def ortvalue_to_numpy(value, dtype: Optional[DType] = None) -> np.ndarray:
    """A host array of a (CPU) ``OrtValue`` of its real element type: bfloat16, float8, int4 ...
    as ``ml_dtypes`` arrays read from the raw bits (ONNX Runtime's ``numpy()`` cannot return
    them, or returns float8 as ``uint8``). ``dtype`` is accepted for the callers that know it;
    the value's own element type decides."""
    return ortvalue_array(value)


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

