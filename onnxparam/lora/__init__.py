"""LoRA: low-rank adapters on a module's weights (layer 8), as Burn's ``LoraConfig`` and PEFT do.

* :mod:`._adapters`: ``LoraConfig``, ``LoraAdapter``, ``apply_lora``, the named adapters
  (``add_adapter`` / ``set_adapter`` ...), merging;
* :mod:`._graph`: the LoRA graph pass (adapters as ONNX nodes in modes ``"keep"`` /
  ``"inputs"``);
* :mod:`._adapter_file`: ONNX Runtime ``.onnx_adapter`` files;
* :mod:`._peft`, :mod:`._peft_save`: PEFT adapters (``adapter_model.safetensors`` +
  ``adapter_config.json``) in and out;
* :mod:`._batched_peft`: a batched export's stacked adapter set as PEFT's multi-adapter folder;
* :mod:`._layouts`, :mod:`._tables`: what an imported graph says of its weights: each one's
  layout, its embedding and position tables, the output projections tied to a table, and the
  PyTorch module owning a table.
"""

from ._adapters import (
    DEFAULT_ADAPTER_NAME,
    LORA_LAYOUT_METHOD,
    LORA_MODES,
    LORA_TARGETS_METHOD,
    LoraAdapter,
    LoraAdapterSet,
    LoraConfig,
    active_adapter,
    adapter_set,
    add_adapter,
    apply_lora,
    delete_adapter,
    disable_adapter,
    merge_param,
    set_adapter,
    transposed_paths,
    untargetable_paths,
    with_every_named_target,
)

__all__ = [
    "LoraConfig",
    "LoraAdapter",
    "LoraAdapterSet",
    "apply_lora",
    "merge_param",
    "transposed_paths",
    "untargetable_paths",
    "LORA_LAYOUT_METHOD",
    "LORA_TARGETS_METHOD",
    "adapter_set",
    "active_adapter",
    "add_adapter",
    "set_adapter",
    "disable_adapter",
    "delete_adapter",
    "DEFAULT_ADAPTER_NAME",
    "with_every_named_target",
    "LORA_MODES",
]
