"""Gradient rules of ``DFT``, ``STFT``, ``RotaryEmbedding``'s caches (:mod:`onnxparam.autodiff._rules_signal`)
and of the sampling forms ``GridSample`` (bicubic, reflection, 3-D), ``Resize``
(``tf_crop_and_resize``), ``MaxRoiPool`` and ``RoiAlign`` (max) (:mod:`onnxparam.autodiff._rules_sampling`).

Each case is a small ONNX model ``y = op(x * s, ...)`` (``s`` and the op's float weights are
initializers, so params of the imported model) with symbolic dims that change between two
input shapes, one training session serving both. Oracles (``check_op`` of
``tests/test_grad_more_rules.py``): central finite differences of the same loss on plain ONNX
Runtime runs of the original file with one initializer entry perturbed (float64 where ORT has
the op's double kernel), and torch autograd in float64 where PyTorch has the op
(``torch.fft``, ``torch.stft``, ``grid_sample``). Further variants are ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from test_grad_more_rules import RNG, check_op

D, F, I64 = TensorProto.DOUBLE, TensorProto.FLOAT, TensorProto.INT64


# -- RotaryEmbedding's cos / sin caches ------------------------------------------------------------


@pytest.mark.parametrize("interleaved,four_d", [(0, False), pytest.param(1, True, marks=pytest.mark.slow)])
def test_rotary_embedding_cache_gradients_on_dynamic_batch_and_sequence(interleaved, four_d):
    """The caches are params (``rotary_embedding_dim / 2`` wide: a partial rotation),
    positions repeat (their gradients add); batch and sequence change between the shapes."""
    if four_d:  # [B, H, S, D], no position ids: caches [B, S, D / 2] fed times a param (float32: ORT has no
        # double RotaryEmbedding)
        nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Mul", ["c", "sc"], ["cs"]),
                 helper.make_node("RotaryEmbedding", ["xs", "cs", "sin"], ["y"], interleaved=interleaved)]
        extra_inputs = [helper.make_tensor_value_info("c", F, ["N", "S", 3]),
                        helper.make_tensor_value_info("sin", F, ["N", "S", 3])]

        def extra(shape):
            n, _, s, _ = shape
            return {"c": RNG.uniform(-1, 1, (n, s, 3)), "sin": RNG.uniform(-1, 1, (n, s, 3))}

        check_op(nodes, ["N", 2, "S", 6], [(2, 2, 3, 6), (1, 2, 5, 6)],
                 {"s": RNG.uniform(0.5, 1.5, (6,)), "sc": RNG.uniform(0.5, 1.5, (3,))}, 23,
                 extra_inputs=extra_inputs, extra=extra)
        return
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("RotaryEmbedding", ["xs", "cos", "sin", "pos"], ["y"], interleaved=interleaved,
                              num_heads=2, rotary_embedding_dim=4)]
    inits = {"s": RNG.uniform(0.5, 1.5, (12,)), "cos": RNG.uniform(-1, 1, (7, 2)), "sin": RNG.uniform(-1, 1, (7, 2))}
    pos = helper.make_tensor_value_info("pos", I64, ["N", "S"])
    check_op(nodes, ["N", "S", 12], [(2, 3, 12), (3, 5, 12)], inits, 23, extra_inputs=[pos],
             extra=lambda shape: {"pos": RNG.integers(0, 7, shape[:2]).astype(np.int64)})
