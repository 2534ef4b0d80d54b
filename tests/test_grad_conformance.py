"""Gradients of ONNX's own node conformance cases against central finite differences on plain
ONNX Runtime (``tests/grad_conformance.py``: float inputs made params, float64 where ORT runs the
case in double, kinks / ties / non-finite points left out). The oracle is ORT running the case's
original one-node model with one entry perturbed; nothing of ``grad`` is used by it.

The default suite checks a small sample (one case per family below); the whole sweep (every
node case; about two minutes here) is ``slow``. In both, no gradient may be wrong and no
gradient may be missing without an error: a case either matches, or ``grad`` refuses it by
name with the library's error.
"""

from __future__ import annotations

import collections

import pytest

import onnx_cases
from grad_conformance import check_grad_case

SAMPLE = (
    "test_sin", "test_atan", "test_cosh", "test_mish", "test_sum_two_inputs", "test_mean_two_inputs",
    "test_reduce_l2_do_not_keepdims_example", "test_reduce_log_sum_exp_keepdims_example",
    "test_reduce_prod_default_axes_keepdims_example", "test_reduce_sum_square_keepdims_example",
    "test_tile", "test_depthtospace_crd_mode_example", "test_spacetodepth", "test_gathernd_example_float32",
    "test_scatter_elements_with_axis", "test_scatternd", "test_top_k", "test_cumsum_2d_axis_1", "test_einsum_batch_matmul",
    "test_constant_pad_axes", "test_instancenorm_example", "test_group_normalization_example",
    "test_rms_normalization_2d_axis1", "test_lpnormalization_default", "test_sce_mean_weight_ii_3d",
    "test_nllloss_NCd1d2_with_weight_reduction_mean", "test_gather_0", "test_gather_elements_1", "test_concat_2d_axis_0",
    "test_slice_neg_steps", "test_reshape_negative_extended_dims", "test_layer_normalization_4d_axis1",
    "test_resize_downsample_scales_linear_antialias", "test_resize_downsample_scales_cubic_align_corners",
    "test_conv_with_strides_padding", "test_matmul_4d",
    "test_cumprod_2d_axis_0", "test_det_nd", "test_lrn", "test_lppool_2d_pads", "test_maxunpool_export_with_output_shape",
    "test_col2im_pads", "test_mod_mixed_sign_float64", "test_maxpool_with_argmax_2d_precomputed_strides",
    "test_attention_4d_gqa_with_past_and_present", "test_attention_4d_softcap_neginf_mask",
    "test_attention_3d_diff_heads_sizes_attn_mask", "test_resize_downsample_sizes_linear_antialias",
    "test_resize_upsample_scales_cubic_asymmetric", "test_gridsample_border_padding",
    "test_tensorscatter_circular", "test_averagepool_2d_ceil_last_window_starts_on_pad",
    "test_dft_irfft", "test_rotary_embedding_with_interleaved_rotary_dim", "test_stft_with_window",
    "test_resize_tf_crop_and_resize_axes_3_2", "test_gridsample_bicubic", "test_gridsample_reflection_padding",
    "test_resize_upsample_sizes_nearest_not_smaller", "test_scatternd_max", "test_scatter_elements_with_reduction_mul",
    "test_gridsample_volumetric_bilinear_align_corners_1",
    "test_split_to_sequence_1", "test_unique_sorted_with_axis", "test_identity_opt", "test_causal_conv_with_state_silu",
    "test_linear_attention_gated_delta_gqa", "test_sequence_map_add_2_sequences",
    "test_batchnorm_example_training_mode", "test_training_dropout",
)


@pytest.fixture(scope="module")
def cases():
    return {c.name: c for c in onnx_cases.node_cases()}


def test_the_sampled_cases_match_finite_differences(cases):
    sample = [cases[name] for name in SAMPLE if name in cases]
    assert len(sample) >= 30
    results = {c.name: check_grad_case(c) for c in sample}
    bad = {n: r for n, r in results.items() if r[0] != "pass"}
    assert bad == {}


def test_a_wrong_gradient_would_be_caught(cases, monkeypatch):
    """The oracle is live: a rule made wrong (Sin's derivative doubled) fails the check."""
    from onnxparam.autodiff import RULES, _training

    real = RULES["Sin"]

    def doubled(e, node, gout, need):
        (d,) = real(e, node, gout, need)
        return [e.op("Add", d, d)]

    monkeypatch.setitem(RULES, "Sin", doubled)
    _training.clear_cache()
    try:
        assert check_grad_case(cases["test_sin"])[0] == "wrong"
    finally:
        _training.clear_cache()


@pytest.mark.slow
def test_every_node_case_matches_finite_differences_or_is_refused_by_name():
    results = {c.name: check_grad_case(c) for c in onnx_cases.node_cases()}
    counts = collections.Counter(r[0] for r in results.values())
    print("\n", dict(counts))
    wrong = {n: r[1] for n, r in results.items() if r[0] in ("wrong", "missing")}
    assert wrong == {}
    assert counts["pass"] >= 500
