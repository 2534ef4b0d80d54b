"""The model of Burn's MNIST example, its Burn-trained weights and a set of real digits.

Architecture (Burn's ``examples/mnist/src/model.rs``; shapes for a ``[N, 28, 28]`` input)::

    x: [N, 28, 28] float32 raw pixels 0..255
    ((x / 255) - 0.1307) / 0.3081, reshaped to [N, 1, 28, 28]
    conv1: Conv2d 1->64, 3x3 valid -> BatchNorm -> ReLU -> MaxPool 2x2/2     [N, 64, 13, 13]
    conv2: Conv2d 64->64, 3x3 valid -> BatchNorm -> ReLU -> MaxPool 2x2/2    [N, 64, 5, 5]
    flatten                                                                   [N, 1600]
    fc1: Linear 1600->128 -> GELU -> dropout(0.25)                           [N, 128]
    fc2: Linear 128->128 -> GELU -> dropout(0.25)                            [N, 128]
    fc3: Linear 128->10                                                       [N, 10] logits

Attribute names and order are the Burn module's, so the tensor names of Burn's ``model.bpk``
(``conv1.conv.weight`` ... ``fc3.bias``) are this module's param paths and the file's data
order is this module's traversal order. Dropout is the identity at inference.

Data (packaged as ``onnxparam._models``; provenance and licences in ``models/README.md``):
:func:`weights_path` (Burn-written ``model.bpk``), :func:`load_digits` (1,797 handwritten
digits from the UCI / scikit-learn digits set, resized to MNIST's 28x28 layout).
"""

from __future__ import annotations

import errno
import importlib.resources
from pathlib import Path

import numpy as np

from ..core.device import Device
from ..core.errors import file_error
from ..core.module import Module
from ..core.tensor import Tensor
from ..nn import (
    BatchNormConfig,
    Conv2dConfig,
    DropoutConfig,
    Gelu,
    LinearConfig,
    MaxPool2dConfig,
    Relu,
)

__all__ = [
    "Mnist",
    "ConvBlock",
    "weights_path",
    "digits_path",
    "load_digits",
    "load_pretrained",
    "IMAGE_SIZE",
    "NUM_CLASSES",
    "PIXEL_MAX",
    "MNIST_MEAN",
    "MNIST_STD",
]

IMAGE_SIZE = 28
"""MNIST images are 28x28 pixels."""

NUM_CLASSES = 10
"""The digits 0..9."""

PIXEL_MAX = 255.0
"""Raw pixel values run 0..255 (0 = background, 255 = ink)."""

MNIST_MEAN = 0.1307
"""Mean of MNIST's training pixels scaled to 0..1; the normalization Burn's example trains with."""

MNIST_STD = 0.3081
"""Standard deviation of MNIST's training pixels scaled to 0..1."""

HIDDEN_SIZE = 64 * 5 * 5
"""Features after the two conv blocks: 64 channels of 5x5 (28 -conv-> 26 -pool-> 13 -conv-> 11 -pool-> 5)."""

DROPOUT_PROB = 0.25
"""Burn's example trains with dropout 0.25 (kept as configuration; identity at inference)."""

_DATA_PACKAGE = "onnxparam._models"
_WEIGHTS_FILE = ("mnist", "model.bpk")
_DIGITS_FILE = ("mnist", "digits28.npz")


class ConvBlock(Module):
    """Conv2d (valid padding) -> BatchNorm -> ReLU -> optional MaxPool 2x2 stride 2
    (Burn's example ``ConvBlock``; fields ``conv``, ``norm``, ``pool``, ``activation``).

    Args:
        channels: ``(C_in, C_out)``.
        kernel_size: ``(k_h, k_w)``.
        device: where the (lazy) params live.
        pool: whether the block ends with the max pool.
    """

    def __init__(self, channels: tuple, kernel_size: tuple, device: "Device | str" = "cpu", pool: bool = True):
        self.conv = Conv2dConfig(tuple(channels), tuple(kernel_size)).with_padding("valid").init(device)
        self.norm = BatchNormConfig(channels[1]).init(device)
        self.pool = MaxPool2dConfig((2, 2)).with_strides((2, 2)).init() if pool else None
        self.activation = Relu()

    def forward(self, x: Tensor) -> Tensor:
        x = self.activation(self.norm(self.conv(x)))
        return x if self.pool is None else self.pool(x)


class Mnist(Module):
    """The model of Burn's MNIST example (architecture in the module docstring).

    Args:
        device: where the params live; they are lazy, so ``Mnist(device).load_file(path)``
            never draws random weights.

    ``forward(x)``: ``x`` ``[N, 28, 28]`` float32 raw pixel values 0..255 -> logits ``[N, 10]``
    float32. The normalization is part of the forward, so the exported ONNX graph takes raw
    pixels. ``module(x)`` traces this forward and runs it through ONNX Runtime.
    """

    def __init__(self, device: "Device | str" = "cpu"):
        self.conv1 = ConvBlock((1, 64), (3, 3), device, pool=True)
        self.conv2 = ConvBlock((64, 64), (3, 3), device, pool=True)
        self.dropout = DropoutConfig(DROPOUT_PROB).init()
        self.fc1 = LinearConfig(HIDDEN_SIZE, 128).init(device)
        self.fc2 = LinearConfig(128, 128).init(device)
        self.fc3 = LinearConfig(128, NUM_CLASSES).init(device)
        self.activation = Gelu()

    def forward(self, x: Tensor) -> Tensor:
        x = ((x / PIXEL_MAX) - MNIST_MEAN) / MNIST_STD
        x = x.unsqueeze([1])  # [N, 28, 28] -> [N, 1, 28, 28] (Burn reshapes; same values)
        x = self.conv1(x)
        x = self.conv2(x)
        x = x.flatten(1)  # [N, 64, 5, 5] -> [N, 1600], row-major as Burn's reshape
        x = self.dropout(self.activation(self.fc1(x)))
        x = self.dropout(self.activation(self.fc2(x)))
        return self.fc3(x)


def _data_file(parts: tuple) -> Path:
    """A packaged data file as a filesystem path.

    Raises:
        FileMissingError: (a ``FileNotFoundError``) when the data package or file is missing (an install that predates
            the data mapping, or a broken one), with the fix.
    """
    try:
        root = importlib.resources.files(_DATA_PACKAGE)
    except ModuleNotFoundError as e:
        raise file_error(
            errno.ENOENT,
            f"the packaged model data ({_DATA_PACKAGE}) is not installed; reinstall onnxparam "
            "(from a checkout: pip install -e .)",
        ) from e
    resource = root.joinpath(*parts)
    # NOTE: wheels are installed unzipped, so the resource is a real file; a zipped install
    # (zipimport) would need importlib.resources.as_file, which callers holding paths cannot use.
    path = Path(str(resource))
    if not path.is_file():
        raise file_error(errno.ENOENT, f"packaged data file {'/'.join(parts)} not found at {path}; reinstall onnxparam",
                         str(path))
    return path


def weights_path() -> Path:
    """The Burn-written ``model.bpk`` of the MNIST example (18 f32 tensors, 260,810 params)."""
    return _data_file(_WEIGHTS_FILE)


def digits_path() -> Path:
    """The packaged ``digits28.npz`` (``images`` uint8 ``[1797, 28, 28]``, ``labels`` uint8 ``[1797]``)."""
    return _data_file(_DIGITS_FILE)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """1,797 real handwritten digits in MNIST's layout.

    Returns:
        ``(images, labels)``: ``images`` uint8 ``[1797, 28, 28]`` (0 = background, 255 = ink,
        centred by centre of mass as MNIST is), ``labels`` uint8 ``[1797]`` in 0..9.
    """
    with np.load(digits_path()) as data:
        return data["images"], data["labels"]


def load_pretrained(device: "Device | str" = "cpu") -> Mnist:
    """:class:`Mnist` holding Burn's trained weights (lazy, memory-mapped reads).

    Raises:
        RecordError: when the packaged file does not fit the module (a broken install).
    """
    return Mnist(device).load_file(weights_path())
