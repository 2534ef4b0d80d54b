"""Gradient rules of ``DFT``, ``STFT``, ``RotaryEmbedding``'s caches (:mod:`onnxparam.autodiff._rules_signal`),
the scatters' ``mul`` / ``max`` / ``min`` reductions and the old ``Scatter`` (:mod:`onnxparam.autodiff._rules_scatter`),
``Einsum`` with an ellipsis or a diagonal (:mod:`onnxparam.autodiff._rules_einsum`)
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
    """The caches are params (``rotary_embedding_dim / 2`` wide: a partial rotation; tables
    frozen at import, unfrozen here), positions repeat (their gradients add); batch and sequence
    change between the shapes."""
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
    # the caches as initializers: import freezes them (tables); unfrozen, they train
    import onnxparam as op
    from grad_check import check_model_grads
    from onnxparam.autodiff._tables import ROTARY_CACHE
    from test_grad_more_rules import _model

    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("RotaryEmbedding", ["xs", "cos", "sin", "pos"], ["y"], interleaved=interleaved,
                              num_heads=2, rotary_embedding_dim=4)]
    inits = {"s": RNG.uniform(0.5, 1.5, (12,)), "cos": RNG.uniform(-1, 1, (7, 2)), "sin": RNG.uniform(-1, 1, (7, 2))}
    inits = {k: v.astype(np.float32) for k, v in inits.items()}  # (ORT has no double RotaryEmbedding)
    pos = helper.make_tensor_value_info("pos", I64, ["N", "S"])
    model = _model(nodes, ["N", "S", 12], inits, 23, F, [pos])
    module = op.import_onnx(model)
    assert module.onnx_tables == {module.path_of("cos"): ROTARY_CACHE, module.path_of("sin"): ROTARY_CACHE}
    module = module.unfreeze_group(op.ParamGroup.from_paths(module.onnx_tables))
    feeds = [{"x": RNG.uniform(-1, 1, (n, s, 12)).astype(np.float32), "pos": RNG.integers(0, 7, (n, s))}
             for n, s in [(2, 3), (3, 5)]]
    counts = check_model_grads(model, feeds, eps=1e-2, rtol=2e-3, atol=2e-4, module=module)
    assert counts["graphs"] == counts["sessions"] <= 2, counts


@pytest.mark.parametrize("offset", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_contrib_rotary_embedding_cache_gradients(offset):
    """ONNX Runtime's ``com.microsoft`` ``RotaryEmbedding`` (caches after ``position_ids``): with
    ``[B, S]`` positions and ``num_heads``, or a one-element start offset and heads of twice the
    caches' width; the caches unfrozen; batch and sequence change; float32."""
    import onnxparam as op
    from onnx import numpy_helper
    from grad_check import check_model_grads

    attrs = {} if offset else {"num_heads": 2}
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("RotaryEmbedding", ["xs", "pos", "cos", "sin"], ["y"], domain="com.microsoft",
                              **attrs)]
    inits = {"s": RNG.uniform(0.5, 1.5, (8,)), "cos": RNG.uniform(-1, 1, (9, 2)), "sin": RNG.uniform(-1, 1, (9, 2))}
    pos = helper.make_tensor_value_info("pos", I64, [1] if offset else ["N", "S"])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", "S", 8]), pos],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    module = op.import_onnx(model)
    module = module.unfreeze_group(op.ParamGroup.from_paths(module.onnx_tables))

    def feed(n, s):
        p = np.array([2], np.int64) if offset else RNG.integers(0, 9, (n, s)).astype(np.int64)
        return {"x": RNG.uniform(-1, 1, (n, s, 8)).astype(np.float32), "pos": p}

    check_model_grads(model, [feed(2, 3), feed(3, 5)], eps=1e-2, rtol=2e-3, atol=2e-4, module=module)


def test_contrib_rotary_embedding_cache_gradients_with_packed_batching():
    """``is_packed_batching=1``: ragged sequences packed into one sequence axis longer than the
    caches (8, then 13 tokens; 6 cache rows), each token's position restarting per sequence in
    ``position_ids`` ``[1, T]``; a partial rotation (``rotary_embedding_dim=2`` of two heads of
    4); the caches unfrozen; the packed length changes; float32. ONNX Runtime runs the unpacked
    form of the same shapes only up to the caches' length."""
    import onnxparam as op
    import onnxruntime as ort
    from onnx import numpy_helper
    from grad_check import check_model_grads

    def build(packed):
        nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
                 helper.make_node("RotaryEmbedding", ["xs", "pos", "cos", "sin"], ["y"], domain="com.microsoft",
                                  num_heads=2, rotary_embedding_dim=2, is_packed_batching=packed)]
        inits = {"s": RNG.uniform(0.5, 1.5, (8,)), "cos": RNG.uniform(-1, 1, (6, 1)), "sin": RNG.uniform(-1, 1, (6, 1))}
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, "T", 8]),
                                               helper.make_tensor_value_info("pos", I64, [1, "T"])],
                                  [helper.make_tensor_value_info("y", F, None)],
                                  [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(graph, opset_imports=opsets)

    def feed(lengths):
        pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)[None]
        return {"x": RNG.uniform(-1, 1, (1, pos.shape[1], 8)).astype(np.float32), "pos": pos}

    feeds = [feed([3, 5]), feed([4, 6, 3])]
    with pytest.raises(Exception, match="not currently supported"):  # (unpacked: T <= the caches' rows)
        ort.InferenceSession(build(0).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds[0])
    model = build(1)
    module = op.import_onnx(model)
    module = module.unfreeze_group(op.ParamGroup.from_paths(module.onnx_tables))
    check_model_grads(model, feeds, eps=1e-2, rtol=2e-3, atol=2e-4, module=module)


# -- DFT ------------------------------------------------------------------------------------------


def _dft_case(opset, attrs, x_dims, shapes, *, axis=None, length=None, fed_axis=False, torch_fn=None):
    """``y = DFT(x * s)`` (``s`` scales the real / imaginary parts: shape ``[c]``); ``axis`` an
    attribute below opset 20, else a constant input or a fed one."""
    inputs = ["xs", "L" if length is not None else ""]
    inits = {"s": RNG.uniform(0.5, 1.5, (x_dims[-1],))}
    extra_inputs, extra = [], None
    if length is not None:
        inits["L"] = np.array(length, np.int64)
    if opset >= 20:
        inputs.append("axis")
        if fed_axis:
            extra_inputs = [helper.make_tensor_value_info("axis", I64, [])]
            extra = lambda shape: {"axis": np.array(axis, np.int64)}  # noqa: E731
        else:
            inits["axis"] = np.array(axis, np.int64)
    else:
        attrs = dict(attrs, axis=axis)
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("DFT", inputs, ["y"], **attrs)]
    check_op(nodes, x_dims, shapes, inits, opset, torch_fn=torch_fn, extra_inputs=extra_inputs, extra=extra)


def _complex(t):
    import torch

    return torch.view_as_complex(t.contiguous())


def test_dft_of_a_complex_signal_of_run_time_length():
    import_torch = pytest.importorskip("torch")

    def torch_fn(x, s, axis):
        return import_torch.view_as_real(import_torch.fft.fft(_complex(x * s), dim=1))

    _dft_case(20, {}, ["N", "T", 2], [(2, 5, 2), (3, 7, 2)], axis=1, torch_fn=torch_fn)


def test_rfft_of_a_real_signal_padded_to_dft_length_at_opset_17():
    """``onesided`` real-to-complex, the signal (5 then 6 long) zero-padded to ``dft_length=8``."""
    torch = pytest.importorskip("torch")

    def torch_fn(x, s, L):
        return torch.view_as_real(torch.fft.rfft((x * s)[..., 0], n=8, dim=1))

    _dft_case(17, {"onesided": 1}, ["N", "T", 1], [(2, 5, 1), (1, 6, 1)], axis=1, length=8, torch_fn=torch_fn)


def test_irfft_weights_the_mirrored_bins():
    """``inverse`` + ``onesided`` (complex half-spectrum to a real signal of length ``2 (K - 1)``):
    the bins between 0 and ``L / 2`` stand for two each."""
    torch = pytest.importorskip("torch")

    def torch_fn(x, s, axis):
        return torch.fft.irfft(_complex(x * s), dim=1)[..., None]

    _dft_case(20, {"inverse": 1, "onesided": 1}, ["N", "K", 2], [(2, 5, 2), (1, 4, 2)], axis=1, torch_fn=torch_fn)


@pytest.mark.slow
@pytest.mark.parametrize("length", [None, 5])
def test_inverse_dft_along_an_axis_fed_at_run_time(length):
    """The axis is a graph input (-3: the middle dim of ``[N, T, C, 2]``); ``dft_length`` 5 cuts
    or pads the 4- then 6-long signal."""
    torch = pytest.importorskip("torch")

    def torch_fn(x, s, axis, **_):
        return torch.view_as_real(torch.fft.ifft(_complex(x * s), n=length, dim=1))

    _dft_case(20, {"inverse": 1}, ["N", "T", 3, 2], [(2, 4, 3, 2), (1, 6, 3, 2)], axis=-3, length=length,
              fed_axis=True, torch_fn=torch_fn)


@pytest.mark.slow
def test_rfft_irfft_of_odd_length_at_opset_19():
    """An odd ``dft_length`` (no Nyquist bin) of the irfft at opset 19 (axis an attribute); 5 bins
    first (more than ``7 // 2 + 1``: ONNX Runtime uses the extra one as given, numpy would drop
    it; finite differences only), then 4 (torch's ``irfft`` too)."""
    torch = pytest.importorskip("torch")

    def torch_fn(x, s, L):
        return torch.fft.irfft(_complex(x * s), n=7, dim=1)[..., None]

    _dft_case(19, {"inverse": 1, "onesided": 1}, ["N", "K", 2], [(2, 5, 2), (1, 4, 2)], axis=1, length=7,
              torch_fn=torch_fn)


# -- STFT -----------------------------------------------------------------------------------------


def test_stft_signal_and_window_gradients_on_a_run_time_signal_length():
    """Real signal, a Hann window times a param (so the window's gradient is checked), step 3,
    onesided; the batch and the signal length (so the frame count) change."""
    torch = pytest.importorskip("torch")
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Mul", ["win", "ws"], ["w"]),
             helper.make_node("STFT", ["xs", "step", "w"], ["y"], onesided=1)]
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(8) / 8)
    inits = {"s": RNG.uniform(0.5, 1.5, (1,)), "ws": RNG.uniform(0.5, 1.5, (8,)), "step": np.array(3, np.int64)}
    win = helper.make_tensor_value_info("win", D, [8])

    def torch_fn(x, win, s, ws, step):
        out = torch.stft((x * s)[..., 0], 8, 3, window=win * ws, center=False, onesided=True, return_complex=True)
        return torch.view_as_real(out.transpose(1, 2))

    check_op(nodes, ["N", "L", 1], [(2, 20, 1), (1, 15, 1)], inits, 17, torch_fn=torch_fn, extra_inputs=[win],
             extra=lambda shape: {"win": hann})


@pytest.mark.slow
def test_stft_of_a_complex_signal_two_sided_without_window():
    """Complex signal, ``frame_length`` 6 and no window (rectangular), both sides, overlapping
    frames (step 2)."""
    torch = pytest.importorskip("torch")
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("STFT", ["xs", "step", "", "flen"], ["y"], onesided=0)]
    inits = {"s": RNG.uniform(0.5, 1.5, (2,)), "step": np.array(2, np.int64), "flen": np.array(6, np.int64)}

    def torch_fn(x, s, step, flen):
        out = torch.stft(_complex(x * s), 6, 2, window=torch.ones(6, dtype=torch.float64), center=False,
                         onesided=False, return_complex=True)
        return torch.view_as_real(out.transpose(1, 2))

    check_op(nodes, ["N", "L", 2], [(2, 13, 2), (1, 10, 2)], inits, 17, torch_fn=torch_fn)


def test_an_stft_window_initializer_imports_frozen_as_a_table():
    import onnxparam as op
    from onnxparam.autodiff._tables import WINDOW
    from test_grad_more_rules import _model

    nodes = [helper.make_node("STFT", ["x", "step", "w"], ["y"])]
    model = _model(nodes, ["N", "L", 1], {"step": np.array(2, np.int64), "w": np.hanning(6)}, 17, D)
    module = op.import_onnx(model)
    assert module.onnx_tables == {module.path_of("w"): WINDOW}


# -- Resize, tf_crop_and_resize ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["linear", pytest.param("cubic", marks=pytest.mark.slow)])
def test_resize_tf_crop_and_resize_on_a_dynamic_image(mode):
    """A crop reaching past the image (extrapolated cells: no gradient) resized by constant
    scales; batch and image size change. Finite differences only (no torch op)."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "roi", "scales"], ["y"], mode=mode,
                              coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=7.0)]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2, 1, 1)),
             "roi": np.array([0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], np.float32),
             "scales": np.array([1, 1, 1.5, 0.8], np.float32)}
    check_op(nodes, ["N", 2, "H", "W"], [(2, 2, 4, 5), (1, 2, 6, 7)], inits, 19)


@pytest.mark.slow
def test_resize_tf_crop_and_resize_with_axes_and_run_time_sizes():
    """``axes=[3, 2]`` (roi and sizes in that order), sizes fed at run time."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "roi", "", "sizes"], ["y"], axes=[3, 2],
                              coordinate_transformation_mode="tf_crop_and_resize")]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2, 1, 1)), "roi": np.array([0.1, 0.3, 0.8, 1.0], np.float32)}
    sizes = helper.make_tensor_value_info("sizes", I64, [2])
    check_op(nodes, ["N", 2, "H", "W"], [(2, 2, 4, 5), (1, 2, 6, 7)], inits, 19, extra_inputs=[sizes],
             extra=lambda shape: {"sizes": np.array([shape[3] + 1, shape[2] - 1], np.int64)})


# -- GridSample: bicubic, reflection, 3-D -------------------------------------------------------------


def _grid_sample_case(mode, padding, align, k_dims, *, torch_check=True, reach=1.1, opset=20):
    """``GridSample(x * s, grid * sg)`` (so the grid's gradient is checked too), the grid reaching
    ``reach`` past the image's normalized edge; batch, image and grid sizes change. Below opset
    20 the modes are ``bilinear`` / ``bicubic`` and ORT runs float32 only."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("Mul", ["grid", "sg"], ["gs"]),
             helper.make_node("GridSample", ["xs", "gs"], ["y"], mode=mode, padding_mode=padding, align_corners=align)]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2) + (1,) * k_dims), "sg": RNG.uniform(0.8, 1.2, (k_dims,))}
    out_dims = ["N"] + [f"O{j}" for j in range(k_dims)] + [k_dims]
    grid = helper.make_tensor_value_info("grid", D if opset >= 20 else F, out_dims)
    if k_dims == 2:
        shapes = [(2, 2, 4, 5), (1, 2, 5, 3)]
    else:
        shapes = [(2, 2, 3, 4, 3), (1, 2, 4, 3, 2)]

    def extra(shape):
        out = tuple(d + (1 if j % 2 else -1) for j, d in enumerate(shape[2:]))
        return {"grid": RNG.uniform(-reach, reach, size=(shape[0],) + out + (k_dims,))}

    def torch_fn(x, grid, s, sg):
        import torch

        names = {"linear": "bilinear", "cubic": "bicubic", "nearest": "nearest", "bicubic": "bicubic"}
        return torch.nn.functional.grid_sample(x * s, grid * sg, mode=names[mode], padding_mode=padding,
                                               align_corners=bool(align))

    check_op(nodes, ["N", 2] + [f"S{j}" for j in range(k_dims)], shapes, inits, opset,
             torch_fn=torch_fn if torch_check else None, extra_inputs=[grid], extra=extra)


@pytest.mark.parametrize("mode,padding,align", [
    ("cubic", "zeros", 0), ("linear", "reflection", 0),
    pytest.param("cubic", "zeros", 1, marks=pytest.mark.slow),
    pytest.param("nearest", "reflection", 1, marks=pytest.mark.slow),
    pytest.param("linear", "reflection", 1, marks=pytest.mark.slow)])
def test_grid_sample_2d_bicubic_and_reflection(mode, padding, align):
    _grid_sample_case(mode, padding, align, 2, reach=1.6 if padding == "reflection" else 1.1)


@pytest.mark.slow
@pytest.mark.parametrize("padding,align", [("border", 0), ("border", 1), ("reflection", 1), ("reflection", 0)])
def test_grid_sample_2d_bicubic_border_and_reflection(padding, align):
    """Bicubic with border / reflection padding: ONNX Runtime (as PyTorch) pads each tap, not the
    sample point (ONNX's reference pads both: a different function near the edges)."""
    _grid_sample_case("cubic", padding, align, 2, reach=1.6)


@pytest.mark.slow
def test_grid_sample_bicubic_at_opset_16():
    """Opset 16's mode names; float32 (ORT's only GridSample-16 kernel), so zeros padding: no
    reflection kinks within the finite-difference step."""
    _grid_sample_case("bicubic", "zeros", 1, 2, opset=16)


@pytest.mark.parametrize("mode,padding,align", [
    ("linear", "border", 0),
    pytest.param("linear", "zeros", 1, marks=pytest.mark.slow),
    pytest.param("linear", "reflection", 0, marks=pytest.mark.slow),
    pytest.param("nearest", "zeros", 0, marks=pytest.mark.slow)])
def test_grid_sample_3d(mode, padding, align):
    _grid_sample_case(mode, padding, align, 3, reach=1.6 if padding == "reflection" else 1.1)


# -- MaxRoiPool -----------------------------------------------------------------------------------------


def test_max_roi_pool_input_gradient_on_a_dynamic_feature_map():
    """Rois on both images (one twice, one reaching past the image, one tiny: empty and
    overlapping bins); the batch and the height change. ``x * s + b`` with ``b`` per column, so
    per-pixel routes are checked, not only channel sums. Finite differences, float32 (ORT's only
    kernel; torchvision is not a dependency), on values far from ties."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xm"]), helper.make_node("Add", ["xm", "b"], ["xs"]),
             helper.make_node("MaxRoiPool", ["xs", "rois"], ["y"], pooled_shape=[2, 3], spatial_scale=0.5)]
    rois = helper.make_tensor_value_info("rois", F, ["R", 5])

    def extra(shape):
        n, _, h, w = shape
        return {"rois": np.array([[0, 1.0, 2.0, 2 * w - 3, 2 * h - 2], [n - 1, 2.4, 0.0, 2 * w + 4, h],
                                  [0, 3.0, 3.0, 3.4, 3.6], [n - 1, 0.0, 1.0, w, 2 * h - 1]])}

    def distinct(x):  # values 0.1 apart (shuffled): no two within a finite-difference step of a tie
        return RNG.permutation(np.arange(x.size) * 0.1).reshape(x.shape).astype(x.dtype)

    inits = {"s": RNG.uniform(0.9, 1.1, (1, 3, 1, 1)), "b": np.arange(6).reshape(1, 1, 1, 6) * 0.013}
    check_op(nodes, ["N", 3, "H", 6], [(2, 3, 5, 6), (3, 3, 7, 6)], inits, 21, extra_inputs=[rois], extra=extra,
             feed_map=distinct)


# -- RoiAlign, max mode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling_ratio,mode", [(2, "half_pixel"),
                                                  pytest.param(0, "output_half_pixel", marks=pytest.mark.slow)])
def test_roi_align_max_input_gradient_on_a_dynamic_feature_map(sampling_ratio, mode):
    """Rois on both images, one partly outside (samples reading 0 compete for the maximum); the
    batch and the height change; ``x * s + b`` with ``b`` per column. Finite differences on ORT
    (ONNX Runtime's max mode is its own: the largest weighted corner, not torchvision's)."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xm"]), helper.make_node("Add", ["xm", "b"], ["xs"]),
             helper.make_node("RoiAlign", ["xs", "rois", "bi"], ["y"], output_height=2, output_width=3, mode="max",
                              sampling_ratio=sampling_ratio, spatial_scale=0.5, coordinate_transformation_mode=mode)]
    rois = helper.make_tensor_value_info("rois", D, ["R", 4])
    bi = helper.make_tensor_value_info("bi", I64, ["R"])

    def extra(shape):
        n, _, h, w = shape
        boxes = np.array([[0.5, 1.0, 2 * w - 3, 2 * h - 2], [2.0, 0.0, 2 * w - 1, h], [1.0, 1.5, w, 2 * h - 1.5],
                          [-3.0, -4.0, 2.0, 3.0]])
        return {"rois": boxes, "bi": np.array([0, n - 1, 0, n - 1], np.int64)}

    inits = {"s": RNG.uniform(0.5, 1.5, (1, 3, 1, 1)), "b": RNG.uniform(-0.5, 0.5, (1, 1, 1, 6))}
    check_op(nodes, ["N", 3, "H", 6], [(2, 3, 5, 6), (3, 3, 7, 6)], inits, 16, extra_inputs=[rois, bi], extra=extra)


@pytest.mark.parametrize("policy,mode,dynamic", [("not_larger", "linear", True), ("not_smaller", "cubic", False),
                                                 pytest.param("not_smaller", "nearest", True, marks=pytest.mark.slow)])
def test_resize_keep_aspect_ratio_policy(policy, mode, dynamic):
    """``keep_aspect_ratio_policy``: one scale for both axes from the limiting one, ``round(s n)``
    outputs; sizes fed at run time on a dynamic image, or constant on a static one."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "", "", "sizes"], ["y"], mode=mode, axes=[2, 3],
                              keep_aspect_ratio_policy=policy)]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2, 1, 1))}
    if dynamic:
        sizes = helper.make_tensor_value_info("sizes", I64, [2])
        check_op(nodes, ["N", 2, "H", "W"], [(2, 2, 4, 5), (1, 2, 7, 6)], inits, 19, extra_inputs=[sizes],
                 extra=lambda shape: {"sizes": np.array([shape[2] + 3, shape[3] - 2], np.int64)})
    else:
        inits["sizes"] = np.array([7, 4], np.int64)
        check_op(nodes, ["N", 2, 5, 6], [(2, 2, 5, 6), (1, 2, 5, 6)], inits, 19)


# -- ScatterND / ScatterElements with mul / max / min ------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mul", "max", pytest.param("min", marks=pytest.mark.slow)])
def test_scatter_elements_reductions_with_duplicate_indices(reduction):
    """``data = x * s`` gets ``updates = u + b`` along axis 1, two updates per row at one index;
    for ``mul`` one update is exactly 0 (the product of the others then carries the gradient).
    The batch changes; torch's ``scatter_reduce`` (``include_self=True``) autograd too."""
    torch = pytest.importorskip("torch")
    nodes = [helper.make_node("Mul", ["x", "s"], ["data"]), helper.make_node("Add", ["u", "b"], ["upd"]),
             helper.make_node("ScatterElements", ["data", "idx", "upd"], ["y"], axis=1, reduction=reduction)]
    b = RNG.uniform(-0.5, 0.5, (3,))
    inits = {"s": RNG.uniform(0.5, 1.5, (5,)), "b": b}
    extra_inputs = [helper.make_tensor_value_info("idx", I64, ["N", 3]),
                    helper.make_tensor_value_info("u", D, ["N", 3])]

    def extra(shape):
        n = shape[0]
        u = RNG.uniform(-2, 2, (n, 3))
        if reduction == "mul":
            u[0, 1] = -b[1]
        idx = np.stack([RNG.permutation(5)[:2] for _ in range(n)])
        return {"idx": np.concatenate([idx, idx[:, 1:]], axis=1).astype(np.int64), "u": u}

    def torch_fn(x, idx, u, s, b):
        names = {"mul": "prod", "max": "amax", "min": "amin"}
        return (x * s).scatter_reduce(1, idx, u + b, names[reduction], include_self=True)

    check_op(nodes, ["N", 5], [(2, 5), (4, 5)], inits, 18, torch_fn=torch_fn, extra_inputs=extra_inputs, extra=extra)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mul", "max"])
def test_scatternd_reductions_of_rows(reduction):
    """Whole rows (indices ``[M, 1]``, one row twice) into ``[N, 4]``; finite differences."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["data"]), helper.make_node("Mul", ["u", "b"], ["upd"]),
             helper.make_node("ScatterND", ["data", "idx", "upd"], ["y"], reduction=reduction)]
    inits = {"s": RNG.uniform(0.5, 1.5, (4,)), "b": RNG.uniform(0.5, 1.5, (4,))}
    extra_inputs = [helper.make_tensor_value_info("idx", I64, ["M", 1]),
                    helper.make_tensor_value_info("u", D, ["M", 4])]

    def extra(shape):
        n = shape[0]
        return {"idx": np.array([[0], [n - 1], [0]], np.int64), "u": RNG.uniform(-2, 2, (3, 4))}

    check_op(nodes, ["N", 4], [(2, 4), (3, 4)], inits, 18, extra_inputs=extra_inputs, extra=extra)


def test_old_scatter_at_opset_10():
    """The deprecated ``Scatter`` at opset 10 (no GatherElements there), axis 1, distinct indices
    per row; the batch changes; torch's ``scatter`` autograd too."""
    torch = pytest.importorskip("torch")
    nodes = [helper.make_node("Mul", ["x", "s"], ["data"]), helper.make_node("Mul", ["u", "b"], ["upd"]),
             helper.make_node("Scatter", ["data", "idx", "upd"], ["y"], axis=1)]
    inits = {"s": RNG.uniform(0.5, 1.5, (5,)), "b": RNG.uniform(0.5, 1.5, (2,))}
    extra_inputs = [helper.make_tensor_value_info("idx", I64, ["N", 2]),
                    helper.make_tensor_value_info("u", D, ["N", 2])]

    def extra(shape):
        n = shape[0]
        idx = np.stack([RNG.permutation(5)[:2] for _ in range(n)]).astype(np.int64)
        return {"idx": idx, "u": RNG.uniform(-2, 2, (n, 2))}

    def torch_fn(x, idx, u, s, b):
        return (x * s).scatter(1, idx, u * b)

    check_op(nodes, ["N", 5], [(2, 5), (4, 5)], inits, 10, torch_fn=torch_fn, extra_inputs=extra_inputs, extra=extra)


# -- Einsum with an ellipsis or a diagonal ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["batch_diagonal", "broadcast_ellipsis",
                                  pytest.param("param_diagonal", marks=pytest.mark.slow)])
def test_einsum_with_ellipsis_and_repeated_letters(case):
    """``...ii->...i`` of ``x * s``; ``...ij,...jk->...ik`` with a param ``A [1, 3, 4]`` broadcast
    over the batch (its gradient summed back); ``ij,jj->ij`` with a param's diagonal. The batch
    changes; torch's ``einsum`` autograd too."""
    torch = pytest.importorskip("torch")
    if case == "batch_diagonal":
        nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
                 helper.make_node("Einsum", ["xs"], ["y"], equation="...ii->...i")]
        inits, x_dims, shapes = {"s": RNG.uniform(0.5, 1.5, (3, 3))}, ["N", 2, 3, 3], [(2, 2, 3, 3), (1, 2, 3, 3)]

        def torch_fn(x, s):
            return torch.einsum("...ii->...i", x * s)
    elif case == "broadcast_ellipsis":
        # (A first: ONNX's Einsum inference typed the result with A's ellipsis dim 1, and the
        # gradient trusting that type was silently summed over the batch; trace/values.py fixes it)
        nodes = [helper.make_node("Einsum", ["A", "x"], ["y"], equation="...ij,...jk->...ik")]
        inits, x_dims, shapes = {"A": RNG.uniform(-1, 1, (1, 3, 4))}, ["N", 4, "K"], [(2, 4, 2), (3, 4, 5)]

        def torch_fn(x, A):
            return torch.einsum("...ij,...jk->...ik", A, x)
    else:
        nodes = [helper.make_node("Einsum", ["x", "W"], ["y"], equation="ij,jj->ij")]
        inits, x_dims, shapes = {"W": RNG.uniform(-1, 1, (4, 4))}, ["N", 4], [(2, 4), (3, 4)]

        def torch_fn(x, W):
            return torch.einsum("ij,jj->ij", x, W)

    check_op(nodes, x_dims, shapes, inits, 17, torch_fn=torch_fn)
