"""The embedded MNIST model: Burn's names and data order, Burn's weights loaded lazily, accuracy
on real digits through ONNX Runtime, and logits against an independent numpy implementation
that reads the weights straight from the .bpk bytes (no project code)."""

import math
import struct

import cbor2
import numpy as np
import pytest

from onnxparam import Tensor
from onnxparam.nn import _initializer as initializer_module
from onnxparam.zoo import mnist

BURNPACK_HEADER = struct.Struct("<IHI")  # magic u32, format version u16, metadata size u32
BURNPACK_MAGIC = 0x4255524E
BURNPACK_ALIGNMENT = 256


# -- an independent reader and network, written from the format and Burn's example ---------------


def read_bpk(path) -> tuple[dict, list, dict]:
    """``({name: float32 array}, [names in data order], {name: descriptor})`` from the bytes."""
    data = path.read_bytes()
    magic, version, size = BURNPACK_HEADER.unpack_from(data)
    assert (magic, version) == (BURNPACK_MAGIC, 1)
    tensors = cbor2.loads(data[BURNPACK_HEADER.size:BURNPACK_HEADER.size + size])["tensors"]
    base = -(-(BURNPACK_HEADER.size + size) // BURNPACK_ALIGNMENT) * BURNPACK_ALIGNMENT
    arrays = {}
    for name, d in tensors.items():
        assert d["dtype"] == "F32"
        start, end = d["data_offsets"]
        arrays[name] = np.frombuffer(data[base + start:base + end], dtype="<f4").reshape(d["shape"])
    order = sorted(tensors, key=lambda k: tensors[k]["data_offsets"][0])
    return arrays, order, tensors


def np_forward(w: dict, pixels: np.ndarray) -> np.ndarray:
    """Burn's MNIST example network in float64 numpy."""
    erf = np.frompyfunc(math.erf, 1, 1)

    def conv_valid(x, weight, bias):
        kh, kw = weight.shape[2:]
        windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))  # n c h w kh kw
        return np.einsum("nchwij,ocij->nohw", windows, weight, optimize=True) + bias[None, :, None, None]

    def batch_norm(x, p):
        g, b, m, v = (w[p + k][None, :, None, None] for k in ("gamma", "beta", "running_mean", "running_var"))
        return (x - m) / np.sqrt(v + 1e-5) * g + b

    def max_pool_2x2(x):
        n, c, h, wd = x.shape
        return x[:, :, :h // 2 * 2, :wd // 2 * 2].reshape(n, c, h // 2, 2, wd // 2, 2).max(axis=(3, 5))

    def gelu(x):
        return 0.5 * x * (1 + erf(x / math.sqrt(2)).astype(np.float64))

    x = ((pixels.astype(np.float64) / 255) - 0.1307) / 0.3081
    x = x[:, None]
    for block in ("conv1.", "conv2."):
        x = conv_valid(x, w[block + "conv.weight"], w[block + "conv.bias"])
        x = max_pool_2x2(np.maximum(batch_norm(x, block + "norm."), 0))
    x = x.reshape(len(x), -1)
    x = gelu(x @ w["fc1.weight"] + w["fc1.bias"])
    x = gelu(x @ w["fc2.weight"] + w["fc2.bias"])
    return x @ w["fc3.weight"] + w["fc3.bias"]


@pytest.fixture(scope="module")
def burn_file():
    return read_bpk(mnist.weights_path())


@pytest.fixture(scope="module")
def digits():
    return mnist.load_digits()


@pytest.fixture(scope="module")
def pretrained():
    return mnist.load_pretrained()


# -- structure and data -------------------------------------------------------------------------


def test_packaged_files_exist_and_digits_have_mnist_layout(digits):
    assert mnist.weights_path().name == "model.bpk" and mnist.weights_path().is_file()
    images, labels = digits
    assert images.dtype == np.uint8 and images.shape == (1797, 28, 28)
    assert labels.dtype == np.uint8 and labels.shape == (1797,) and set(labels.tolist()) == set(range(10))


def test_mnist_param_paths_and_order_are_the_burn_files(burn_file):
    arrays, order, _ = burn_file
    model = mnist.Mnist()
    assert [(path, p.lazy_shape()) for path, p in model.named_params()] == [
        (name, arrays[name].shape) for name in order
    ]
    assert model.num_params() == 260_810


def test_building_and_loading_never_draws_random_weights(monkeypatch, burn_file):
    def fail(*args, **kwargs):
        raise AssertionError("an initializer drew random values")

    monkeypatch.setattr(initializer_module, "_draw", fail)
    arrays, _, tensors = burn_file
    model = mnist.load_pretrained()
    for path, param in model.named_params():
        np.testing.assert_array_equal(param.val().to_numpy(), arrays[path])
        assert int(param.id) == tensors[path]["param_id"]


def test_module_tree_matches_burns_example():
    text = repr(mnist.Mnist())
    for expected in ("conv1: ConvBlock", "conv: Conv2d(ch_in=1, ch_out=64", "padding='valid'",
                     "norm: BatchNorm(num_features=64", "pool: MaxPool2d(kernel_size=[2, 2], stride=[2, 2]",
                     "dropout: Dropout(prob=0.25)", "fc1: Linear(d_input=1600, d_output=128, bias=True)",
                     "fc3: Linear(d_input=128, d_output=10, bias=True)", "activation: Gelu"):
        assert expected in text


# -- through ONNX Runtime -----------------------------------------------------------------------


def test_digits_accuracy_through_onnx_runtime_is_above_90_percent(pretrained, digits):
    images, labels = digits
    pixels = images.astype(np.float32)
    logits = np.concatenate([pretrained(Tensor.from_numpy(pixels[s:s + 600])).to_numpy()
                             for s in range(0, len(pixels), 600)])
    assert logits.shape == (1797, 10) and logits.dtype == np.float32
    accuracy = float((logits.argmax(axis=1) == labels).mean())
    assert accuracy > 0.90


def test_logits_equal_an_independent_numpy_network(pretrained, digits, burn_file):
    arrays, _, _ = burn_file
    images, _ = digits
    subset = images[::37][:48].astype(np.float32)  # every digit class, a few ms of numpy
    expected = np_forward(arrays, subset)
    got = pretrained(Tensor.from_numpy(subset)).to_numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_batch_size_one_and_reuse_give_the_same_logits(pretrained, digits):
    images, _ = digits
    pixels = images[:3].astype(np.float32)
    whole = pretrained(Tensor.from_numpy(pixels)).to_numpy()
    single = np.concatenate([pretrained(Tensor.from_numpy(pixels[i:i + 1])).to_numpy() for i in range(3)])
    np.testing.assert_allclose(single, whole, rtol=1e-5, atol=1e-5)
