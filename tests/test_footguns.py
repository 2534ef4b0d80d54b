"""The known pitfalls of moving weights between PyTorch, Burn and ONNX: one test each.

Each is checked against an oracle this project did not compute: a numpy formula in the other
framework's convention, the bytes written by ``safetensors`` itself, bit patterns written out by
hand from the IEEE-754 / bfloat16 definitions.

1. Linear layout: PyTorch stores ``weight`` as ``(out, in)`` and computes ``x @ W.T``; Burn
   stores ``(in, out)`` and computes ``x @ W``.
2. PEFT scaling: ``alpha / r``, but ``alpha / sqrt(r)`` with ``use_rslora``.
3. Tied weights: one param used twice is one tensor in every file, not two copies.
4. Name collisions: ONNX names that differ only in characters a module path cannot hold
   (``a.b``, ``a/b``, ``a:b``) must stay distinct params.
5. Per-channel quantization axis: a ``(in, out)`` Burn weight quantized per output channel has
   one scale per *column* (ONNX ``axis=1``), not per row.
6. fp16 rounding: f32 -> f16 rounds to nearest, ties to even (not truncation, not ties away).
7. bf16 decoding: the top 16 bits of an f32, NaN / inf / subnormals included.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import numpy_helper
from safetensors.numpy import save_file

from onnxparam import Module, Param, ParamId, RecordError, Tensor, import_onnx, load_peft_adapter
from onnxparam.convert import load_safetensors, save_safetensors
from onnxparam.core.module import named_params
from onnxparam.formats import read_safetensors
from onnxparam.nn import Linear

X = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], np.float32)
W_TORCH = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], np.float32)  # PyTorch Linear(3, 2).weight: (out, in)
B = np.array([0.25, -0.5], np.float32)


class Net(Module):
    def __init__(self):
        self.proj = Linear(3, 2)

    def forward(self, x):
        return self.proj(x)


def test_linear_layout_pytorch_out_in_is_transposed_into_burn_in_out(tmp_path):
    path = tmp_path / "torch.safetensors"
    save_file({"proj.weight": W_TORCH, "proj.bias": B}, str(path))  # as PyTorch's save_file writes it
    oracle = X @ W_TORCH.T + B  # torch.nn.functional.linear
    module = load_safetensors(Net(), path, adapter="pytorch")
    assert module.proj.weight.val().shape == (3, 2)
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), oracle, rtol=1e-6)
    with pytest.raises(RecordError, match=r"shape mismatch for 'proj.weight': the module expects \[3, 2\], the file "
                                          r"has \[2, 3\]; the file looks transposed.*use adapter='pytorch'"):
        load_safetensors(Net(), path)  # without the adapter: refused, never silently wrong


@pytest.mark.parametrize("rslora, scale", [(False, 4 / 4), (True, 4 / math.sqrt(4))])
def test_peft_scale_is_alpha_over_r_or_alpha_over_sqrt_r_with_rslora(tmp_path, rslora, scale):
    rng = np.random.default_rng(0)
    lora_a = rng.standard_normal((4, 3)).astype(np.float32)  # PEFT lora_A: (r, in)
    lora_b = rng.standard_normal((2, 4)).astype(np.float32)  # PEFT lora_B: (out, r)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "bias": "none", "r": 4, "lora_alpha": 4, "use_rslora": rslora}))
    save_file({"base_model.model.proj.lora_A.weight": lora_a, "base_model.model.proj.lora_B.weight": lora_b},
              str(folder / "adapter_model.safetensors"))
    base = Net().map(lambda p, param: param.map(lambda t: Tensor.from_numpy(W_TORCH.T.copy() if p == "proj.weight" else B)))
    module = load_peft_adapter(base, folder)
    oracle = X @ (W_TORCH + scale * lora_b @ lora_a).T + B  # peft/tuners/lora/layer.py
    np.testing.assert_allclose(module(Tensor.from_numpy(X)).to_numpy(), oracle, rtol=1e-5)


class Tied(Module):
    """An embedding matrix used as the output projection too (GPT-2's tied ``wte``)."""

    def __init__(self, weight: Param):
        self.embed = weight
        self.head = weight

    def forward(self, x):
        return x @ self.embed


def test_tied_weights_are_one_param_and_one_tensor_in_a_file(tmp_path):
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    module = Tied(Param.initialized(ParamId(42), Tensor.from_numpy(w)))
    paths = dict(named_params(module))
    assert list(paths) == ["embed"] and int(paths["embed"].id) == 42  # the traversal yields it once
    path = tmp_path / "tied.safetensors"
    save_safetensors(module, path)
    with read_safetensors(path) as f:
        assert list(f.tensors) == ["embed"]  # one tensor, not two copies that could drift apart
        np.testing.assert_array_equal(f.tensors["embed"].to_data().to_numpy(), w)
    zeros = Tied(Param.initialized(ParamId(42), Tensor.from_numpy(np.zeros((3, 2), np.float32))))
    loaded = load_safetensors(zeros, path)
    # both uses see the loaded value (the oracle: the array written)
    np.testing.assert_array_equal(loaded.embed.val().to_numpy(), w)
    np.testing.assert_array_equal(loaded.head.val().to_numpy(), w)


def test_onnx_names_that_differ_only_in_punctuation_stay_distinct_params(tmp_path):
    names = ["enc.w", "enc/w", "enc:w", "enc_w", "enc..w"]
    body = "\n".join(f"t{i} = Add({'x' if i == 0 else f't{i - 1}'}, w{i})" for i in range(len(names)))
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2] x) => (float[2] t{len(names) - 1}) <{", ".join(f"float[2] w{i} = {{0, 0}}" for i in range(len(names)))}> {{
    {body}
    }}""")
    arrays = {}
    for i, (init, name) in enumerate(zip(model.graph.initializer, names)):
        arrays[name] = np.array([i + 1.0, -(i + 1.0)], np.float32)
        init.CopyFrom(numpy_helper.from_array(arrays[name], name))
        for node in model.graph.node:
            node.input[:] = [name if v == f"w{i}" else v for v in node.input]
    path = tmp_path / "names.onnx"
    onnx.save(model, path)
    module = import_onnx(path)
    params = dict(named_params(module))
    assert len(params) == len(names)  # no two names collapsed into one path
    for name, array in arrays.items():
        np.testing.assert_array_equal(module.param_of(name).val().to_numpy(), array)
    x = np.array([0.5, 0.25], np.float32)
    np.testing.assert_array_equal(module(Tensor.from_numpy(x)).to_numpy(), x + sum(arrays.values()))


def test_per_channel_quantization_of_a_burn_linear_weight_scales_each_output_column():
    from onnxparam.quant import QuantScheme, QuantValue, quantize
    from onnxparam.quant._qdq import weight_layout

    w = np.array([[1.0, -8.0, 0.5], [2.0, 4.0, -0.25], [-3.0, 1.0, 0.125], [0.5, 2.0, 1.0]], np.float32)  # (in=4, out=3)
    qt = quantize(w, QuantScheme(QuantValue.Q8S, (4, 1)))  # one block per column
    oracle_scales = np.abs(w).max(axis=0) / 127  # symmetric int8, per output channel
    np.testing.assert_allclose(np.asarray(qt.scales).reshape(-1), oracle_scales, rtol=1e-7)
    assert not np.allclose(oracle_scales, np.abs(w).max(axis=1)[:3] / 127)  # the per-row mistake differs
    layout = weight_layout(qt, 21)
    assert layout.axis == 1  # ONNX DequantizeLinear axis: the output channels of an (in, out) weight


# f32 bit patterns and their f16 results under round-to-nearest-even (IEEE 754-2019, 4.3.1),
# written out by hand: f16 has 10 mantissa bits, so for values in [1, 2) the f16 step is 2^-10.
FP16_CASES = [
    (1.0 + 2**-11, 0x3C00),  # a tie between 1.0 and 1+2^-10: to even -> 1.0
    (1.0 + 3 * 2**-11, 0x3C02),  # a tie between 1+2^-10 and 1+2^-9: to even -> 1+2^-9
    (1.0 + 2**-11 + 2**-20, 0x3C01),  # just above the tie: up
    (65504.0, 0x7BFF),  # the largest finite f16
    (65519.0, 0x7BFF),  # below the midpoint to 65536: stays finite
    (2**-24, 0x0001),  # the smallest subnormal
    (2**-25, 0x0000),  # a tie between 0 and 2^-24: to even -> 0
    (-0.0, 0x8000),
]


def test_fp16_cast_rounds_to_nearest_even(tmp_path):
    values = np.array([v for v, _ in FP16_CASES], np.float32)

    class One(Module):
        def __init__(self):
            self.w = Param.from_tensor(Tensor.from_numpy(values))

        def forward(self, x):
            return x

    path = tmp_path / "half.safetensors"
    save_safetensors(One(), path, cast="f16")
    raw = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", raw)
    bits = struct.unpack_from(f"<{len(values)}H", raw, 8 + header_len)
    assert [hex(b) for b in bits] == [hex(b) for _, b in FP16_CASES]


# bf16 bit patterns and their values: bf16 is the top half of an f32 (1 sign, 8 exponent, 7 mantissa)
BF16_CASES = [
    (0x3F80, 1.0),
    (0xC000, -2.0),
    (0x7F80, math.inf),
    (0xFF80, -math.inf),
    (0x7FC0, math.nan),
    (0xFFC1, math.nan),  # a negative NaN with payload
    (0x0001, 2.0**-133),  # the smallest subnormal: 2^-126 * 2^-7
    (0x007F, 127 * 2.0**-133),  # the largest subnormal
    (0x0080, 2.0**-126),  # the smallest normal
    (0x7F7F, (2 - 2**-7) * 2.0**127),  # the largest finite
    (0x8000, -0.0),
]


def test_bf16_tensors_decode_from_their_bit_patterns(tmp_path):
    patterns = [p for p, _ in BF16_CASES]
    data = struct.pack(f"<{len(patterns)}H", *patterns)
    header = json.dumps({"t": {"dtype": "BF16", "shape": [len(patterns)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    with read_safetensors(path) as f:
        decoded = f.tensors["t"].to_data().to_numpy().astype(np.float32)
    for (pattern, expected), got in zip(BF16_CASES, decoded.tolist()):
        if math.isnan(expected):
            assert math.isnan(got), hex(pattern)
        else:
            assert got == expected and math.copysign(1, got) == math.copysign(1, expected), hex(pattern)
    # and bit-exact: widening to f32 is placing the 16 bits on top (NaN payloads kept)
    widened = decoded.view(np.uint32)
    assert [int(w) for w in widened] == [p << 16 for p in patterns]
