"""Gradients through ONNX Runtime: reverse-mode autodiff built as an ONNX graph.

Layer: *runtime* (beside :mod:`onnxparam.trace.tracer` and :mod:`onnxparam.runtime`, which it uses);
the model layer knows nothing of it.

* :func:`grad` — ``loss, grads = grad(loss_fn, module, *inputs)``: traces
  ``loss_fn(module, *inputs)`` into an ONNX graph, appends its backward graph, and runs forward
  and backward as **one** cached ONNX Runtime session whose outputs are the loss and one
  gradient per trainable param (:mod:`._training`);
* :class:`Gradients` — ``ParamId -> Tensor`` (Burn's ``GradientsParams``), what the optimizers
  of :mod:`onnxparam.optim` take;
* :func:`cross_entropy`, :func:`mse` — losses as graph ops (:mod:`onnxparam.ops._losses`);
* :func:`recompute` — marks sub-modules whose activations the backward recomputes instead of
  keeping (activation checkpointing, :mod:`._recompute`): less memory, one more forward of them;
* :func:`check_gradients` — every node on a param -> loss path without a gradient rule, listed
  before anything runs (:func:`grad` raises with the same list); :data:`GRADIENT_OPS` (the
  operators with a rule) and :data:`NOT_DIFFERENTIABLE` (operators declared without a gradient,
  with the reason);
* :data:`RULES` — the gradient rule of each ONNX operator, each documented with its formula
  (:mod:`._rules`, :mod:`._rules_nn`, :mod:`._rules_layers`; control flow ``If`` / ``Loop`` /
  ``Scan`` and the params their subgraphs read: :mod:`._rules_control`, a ``Loop``'s sequence,
  optional and growing states: :mod:`._loop_states`; ``LSTM`` / ``GRU`` /
  ``RNN``: :mod:`._rules_rnn`; sequences, optionals and ``Unique``: :mod:`._rules_sequence`, ``SequenceMap``:
  :mod:`._rules_seqmap`; ``DFT`` / ``STFT`` / ``RotaryEmbedding``'s caches: :mod:`._rules_signal`;
  ``GridSample`` / ``Resize`` / ``MaxRoiPool`` / ``RoiAlign`` forms: :mod:`._rules_sampling`; the
  scatters' ``mul`` / ``max`` / ``min``: :mod:`._rules_scatter`; ``Einsum`` with an ellipsis or a
  diagonal: :mod:`._rules_einsum`);
  :func:`build_training_model` — the graph transformation
  (:mod:`._backward`).

The API is functional (JAX's ``value_and_grad`` shape, Burn's ``GradientsParams`` result);
there is no tape and no ``loss.backward()``.
"""

from ..ops._losses import cross_entropy, mse
from ._backward import GRAD_SUFFIX, build_training_model
from ._check import GRADIENT_OPS, MissingRule
from ._recompute import recompute
from ._rules import NON_DIFFERENTIABLE, NOT_DIFFERENTIABLE, RULES
from ._training import (
    MAX_CACHED_TRAINING,
    Gradients,
    check_gradients,
    clear_cache,
    grad,
    trainable_paths,
    training_model,
)

__all__ = [
    "grad",
    "check_gradients",
    "recompute",
    "Gradients",
    "GRADIENT_OPS",
    "NOT_DIFFERENTIABLE",
    "MissingRule",
    "cross_entropy",
    "mse",
    "training_model",
    "trainable_paths",
    "build_training_model",
    "clear_cache",
    "RULES",
    "NON_DIFFERENTIABLE",
    "GRAD_SUFFIX",
    "MAX_CACHED_TRAINING",
]
