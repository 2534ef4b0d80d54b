"""Torch / PEFT setup shared by the tests whose oracle is Hugging Face PEFT in torch
(tests/test_peft_torch.py, tests/test_peft_training.py, tests/test_lora_batched_*.py): torch
models with random weights, PEFT LoRA models with random factors saved to folders, PEFT models
holding several named adapters, torch's two ONNX exporters made quiet, and plain ONNX Runtime
sessions with an ``.onnx_adapter`` active.

It imports ``torch`` and ``peft``: import it after ``pytest.importorskip("torch")`` and
``pytest.importorskip("peft")``, so that a test file skips cleanly without them. Nothing here is
an oracle by itself: the helpers only build what the tests compare against.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import numpy as np
import onnxruntime as ort
import peft
import pytest
import torch

EXPORTERS = ["torchscript", "dynamo"]


@contextlib.contextmanager
def quiet():
    """Expected warnings: torch's TorchScript exporter says it is deprecated, PEFT's
    ``save_pretrained`` that a 1-d ``lora_B.bias`` (``lora_bias=True``) looks like an unsharded
    ZeRO-3 tensor, PEFT's loaders about their own settings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def randomize(model, seed: int, std: float = 0.3):
    """Every param of the torch ``model`` drawn from N(0, std) (``torch.Generator`` seeded with
    ``seed``, in ``model.parameters()`` order; no zero biases: torch's exporter would dedupe equal
    initializers). Returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def peft_lora(base, targets, r: int, alpha, *, rslora: bool = False, lora_bias: bool = False, seed: int,
              folder=None, rank_pattern: dict | None = None):
    """A ``peft`` LoRA model (eval mode) on a deep copy of the torch module ``base``: rank ``r``
    (``rank_pattern``: PEFT's per-module ranks), ``lora_alpha=alpha``, on
    ``target_modules=targets``; every ``lora_`` param (A, B and the ``lora_bias`` of B) drawn
    from N(0, 0.3) by a generator seeded with ``seed``, so the adapter changes the output. Saved
    with ``save_pretrained`` to ``folder`` when given."""
    config = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, lora_bias=lora_bias, target_modules=targets,
                             rank_pattern=rank_pattern or {}, init_lora_weights=False)
    with quiet():  # PEFT warns that a grouped conv's adapter cannot be merged
        model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if folder is not None:
        with quiet():
            model.save_pretrained(str(folder))
    return model


def peft_with_adapters(base, folders: dict):
    """``peft.PeftModel`` (eval mode) on a deep copy of ``base`` holding the saved adapters
    ``{adapter name: folder}``: the first by ``from_pretrained``, the others by ``load_adapter``;
    the first is active."""
    (first, folder), *others = folders.items()
    with quiet():
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder), adapter_name=first).eval()
        for name, folder in others:
            model.load_adapter(str(folder), adapter_name=name)
    return model


def import_with_adapters(path, folders: dict, **load_options):
    """The import of the ONNX file ``path`` with each PEFT folder of ``{adapter name: folder}`` added
    as a named adapter (``load_peft_adapter`` on the import, then ``add_adapter``), none active: the
    library's side of :func:`peft_with_adapters`. ``load_options``: ``load_peft_adapter``'s."""
    from onnxparam import import_onnx, load_peft_adapter

    imported = import_onnx(path)
    module = imported
    for name, folder in folders.items():
        module = module.add_adapter(name, load_peft_adapter(imported, folder, **load_options))
    return module


def peft_rows(model, ids, rows) -> np.ndarray:
    """PEFT's mixed-batch forward: row ``i`` of ``ids`` through the adapter named ``rows[i]``
    (``"__base__"``: none), ``model(ids, adapter_names=rows)`` without gradients, as numpy."""
    with torch.no_grad():
        return model(ids, adapter_names=list(rows)).numpy()


def ids_for(rows: int, seq: int, vocab: int = 40) -> torch.Tensor:
    """``[rows, seq]`` int64 token ids uniform in ``[0, vocab)``, seeded by the shape."""
    return torch.from_numpy(np.random.default_rng(rows * 100 + seq).integers(0, vocab, size=(rows, seq)))


class Hidden(torch.nn.Module):
    """The last hidden state of a ``transformers`` model (input ids only; an all-ones attention
    mask, so the LLaMA mask code exports with TorchScript)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state


def export(model, args, path, exporter: str, *, dynamic: dict | None = None, **kwargs):
    """``model`` written to ``path`` by torch's ``"torchscript"`` or ``"dynamo"`` exporter, quietly
    (the dynamo exporter is skipped without ``onnxscript``). ``dynamic``: ``{axis: dim name}`` of
    the first input, named in both exporters (TorchScript needs ``input_names`` then). Returns
    ``path``."""
    dynamo = exporter == "dynamo"
    if dynamo:
        pytest.importorskip("onnxscript")
        kwargs["verbose"] = False
        if dynamic:
            kwargs["dynamic_shapes"] = ({axis: torch.export.Dim(name) for axis, name in dynamic.items()},)
    elif dynamic:
        kwargs["dynamic_axes"] = {kwargs["input_names"][0]: dict(dynamic)}
    with quiet(), contextlib.redirect_stdout(None):
        torch.onnx.export(model, args, str(path), dynamo=dynamo, **kwargs)
    return path


def session(path) -> ort.InferenceSession:
    """Plain ONNX Runtime on the file ``path`` (CPU, errors-only log)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_options(adapter_file):
    """``(ort.RunOptions, LoraAdapter)`` with the ``.onnx_adapter`` file ``adapter_file`` active
    (``None``: no adapter, ``(options, None)``). Keep the ``LoraAdapter`` alive while the options
    are used."""
    options = ort.RunOptions()
    if adapter_file is None:
        return options, None
    lora = ort.LoraAdapter()
    lora.Load(str(adapter_file))
    options.add_active_adapter(lora)
    return options, lora


def with_torch_weights(module, torch_model, transposed=lambda path, value: value.ndim == 2):
    """The onnxparam ``module`` with every param replaced by the torch ``state_dict`` value of the
    same path (``float32``), transposed where ``transposed(path, value)`` (default: 2-d, the
    ``nn.Linear`` weights, ``[out, in]`` in torch, ``[in, out]`` here)."""
    from onnxparam import Param, Tensor

    weights = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}

    def value(path):
        w = weights[path]
        return Tensor.from_numpy(np.ascontiguousarray(w.T if transposed(path, w) else w))

    return module.map(lambda path, p: Param(p.id, value=value(path)))


class ConvNet(torch.nn.Module):
    """``Conv2d(2, 4, 3, padding=1)`` -> relu -> flatten -> ``Linear(100, 3)`` on ``[N, 2, 5, 5]``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
