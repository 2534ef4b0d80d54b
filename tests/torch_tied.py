"""A tied language model in small, shared by the tests of tied tables
(tests/test_grad_tied_import.py, tests/test_lora_peft_tied_table.py,
tests/test_lora_default_targets.py): ``Embedding -> Linear -> ReLU -> lm_head`` with
``lm_head.weight`` the embedding's own weight (GPT-2's ``wte`` / ``lm_head`` tie), and torch's two
exporters made quiet.

It imports ``torch``: import it after ``pytest.importorskip("torch")``, so that a test file skips
cleanly without it. Nothing here is an oracle by itself: the model is what the tests compare
against (torch autograd, PEFT in torch), and the assertion in :func:`tiny_lm` checks torch's own
tie, not this library.
"""

from __future__ import annotations

import warnings

import torch

VOCAB, DIM = 11, 6


class TinyLm(torch.nn.Module):
    """Embedding -> Linear -> ReLU -> tied lm_head (GPT-2's tie, in small)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(torch.relu(self.mlp(self.wte(ids))))


def tiny_lm(seed: int = 0, vocab: int = VOCAB, dim: int = DIM) -> TinyLm:
    """A :class:`TinyLm` in eval mode, torch's default init after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    model = TinyLm(vocab, dim).eval()
    assert model.lm_head.weight is model.wte.weight  # the oracle's own tie
    return model


def export_quietly(model, ids, path, exporter: str, dynamic_axes: dict | None = None) -> None:
    """``torch.onnx.export`` of ``model`` on ``(ids,)`` to ``path``, input ``ids``, output
    ``logits``: ``exporter`` ``"dynamo"`` (static shapes, its default optimizer, one file) or
    ``"torchscript"`` (opset 17, ``dynamic_axes``). torch's warnings (TorchScript is deprecated)
    are silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(model, (ids,), str(path), input_names=["ids"], output_names=["logits"], dynamo=True,
                              external_data=False)
        else:
            torch.onnx.export(model, (ids,), str(path), input_names=["ids"], output_names=["logits"], opset_version=17,
                              dynamo=False, dynamic_axes=dynamic_axes)
