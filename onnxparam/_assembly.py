"""The top layer's assembly: the features' verbs on ``Module``, and the core's extension points.

The core (:mod:`onnxparam.core`) imports nothing above it. What the public classes do with the
features above it is installed here, at ``import onnxparam``, by :func:`install`:

* the verbs of :class:`onnxparam.Module` that belong to a feature (set on its base
  :class:`onnxparam.core.verbs.ModuleVerbs`, which imports nothing), each a thin method doing a
  plain import of that feature when called: records and burnpack files (``into_record``,
  ``load_record`` / ``try_load_record``, ``load_file`` / ``try_load_file``, ``save_file``:
  :mod:`onnxparam.convert`, :mod:`onnxparam.burnpack`), LoRA (``apply_lora``, ``merge_lora``,
  ``valid``, ``add_adapter`` / ``set_adapter`` / ``disable_adapter`` / ``delete_adapter``,
  ``lora_adapters``, ``active_adapter``: :mod:`onnxparam.lora`), quantization
  (``quantize_weights``, ``apply_qlora``: :mod:`onnxparam.quant`); and
  ``ModuleRecord.load_file`` (:mod:`onnxparam.burnpack`);
* the loaders of the core's two extension points (:mod:`onnxparam.core.extension`): the tensor
  operator table (:mod:`onnxparam.ops`) and the executor (:mod:`onnxparam.runtime`, given the
  standard graph passes of :mod:`onnxparam.quant._passes`).

It also installs the command line's first signal handlers (:func:`install_if_command_line`).
Nothing here imports numpy, ONNX or ONNX Runtime at ``import onnxparam``: every import of a
feature runs inside a function, on first use.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

from .core import extension
from .core.errors import RecordError
from .core.verbs import ModuleVerbs, RecordVerbs

if TYPE_CHECKING:
    from .core.module import Module

__all__ = ["install", "MODULE_VERBS", "install_if_command_line", "is_command_line"]


def _tensor_ops():
    from .ops import _tensor_ops

    return _tensor_ops


def _executor():
    from .quant._passes import STANDARD_PASSES
    from .runtime._executor import RuntimeExecutor

    return RuntimeExecutor(STANDARD_PASSES)


def _load_record_file(path):
    """The record of a burnpack file; tensor data stays in the memory-mapped file.

    Raises:
        RecordError: for a missing or malformed file (``BurnpackFormatError``); for a
            ``.onnx`` or ``.safetensors`` file that is not a burnpack, the message names the
            function that reads that format.
    """
    from .burnpack._module_file import load_module_record

    return load_module_record(path)


# -- the command line's first moments --------------------------------------------------------
#
# Signal handlers installed before any heavy import.
#
# ``onnxparam ...`` (the console script) and ``python -m onnxparam ...`` import the package before
# :func:`onnxparam.cli.main` runs, and importing numpy / onnx / ONNX Runtime takes a while; a
# Ctrl-C or SIGTERM meanwhile would print a ``KeyboardInterrupt`` traceback (or die silently). When
# the process *is* the command line (and only then: a library user's handlers are never touched),
# :func:`install_if_command_line` installs handlers that print one line and exit ``128 + signal``
# (130, 143); nothing has been written yet, so there is nothing to clean. ``main()`` replaces them
# with handlers that unwind the running command (:mod:`onnxparam.cli._common`).
#
# This file imports only the standard library and small core modules at import time (it runs
# before everything else).

_WORDS = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}


def is_command_line() -> bool:
    """This process runs the ``onnxparam`` console script or ``python -m onnxparam``."""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    if argv0 in ("onnxparam", "onnxparam.exe"):
        return True
    orig = list(getattr(sys, "orig_argv", []))
    return "-m" in orig and orig.index("-m") + 1 < len(orig) and orig[orig.index("-m") + 1] == "onnxparam"


def _exit_now(signum, frame) -> None:  # pragma: no cover - runs in a subprocess
    try:
        os.write(2, f"onnxparam: {_WORDS.get(signum, f'signal {signum}')}\n".encode())
    finally:
        os._exit(128 + int(signum))


def install_if_command_line() -> None:
    """Install the start-up handlers when :func:`is_command_line` (main thread only)."""
    if not is_command_line():
        return
    for signum in _WORDS:
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup / background jobs keep theirs
                signal.signal(signum, _exit_now)
        except (ValueError, OSError):  # not the main thread
            return


# -- Module's verbs ---------------------------------------------------------------------------


def valid(self) -> "Module":
    """The inference module (Burn's ``AutodiffModule::valid``): training mode off, and LoRA
    adapters merged into plain weights as Burn's ``valid`` folds them (named adapters
    dropped: they were for the unmerged base)."""
    from .core.module import rebuild
    from .lora import _adapters as lora

    return lora._owning(rebuild(self, lambda path, p: lora.merge_param(p, path),
                                lambda path, m: object.__setattr__(m, "_training", False)),
                        lora.LoraAdapterSet(), None)



def into_record(self):
    """The module's :class:`~onnxparam.ModuleRecord` (lazy: no param is initialized). A module
    owning named adapters records every one of them by name, ``<W>.lora.<name>.a`` / ``.b``, and
    describes them in the record's metadata (:mod:`onnxparam.lora._records`)."""
    from .lora._records import module_record

    return module_record(self)



def try_load_record(self, record, allow_partial: bool = False, *, report=None, source: str = "") -> "Module":
    """A copy holding ``record``'s tensors, through the one record application
    (:func:`onnxparam.convert.apply_record`, no layout adapter). Named adapters load by name, as
    in :meth:`try_load_file`.

    Args:
        record: path -> ``TensorSnapshot`` / numpy array / ``Tensor`` / torch tensor.
        report: a :class:`onnxparam.convert.LoadReport` to fill in, or ``None``.
        source: the file named in messages and the report.

    Raises:
        RecordError: listing every missing, unexpected, mis-shaped and mis-typed tensor; or
            ``record`` is not a mapping (the message names the type it got; a path names
            ``load_file``).
        FileMissingError / IsAFolderError: ``record`` is the path of a missing file / a folder.
    """
    if not isinstance(record, Mapping):
        if isinstance(record, (str, os.PathLike)):
            from .formats._extensions import check_readable

            check_readable(record)  # a missing path / a folder says so, as every reader does
        what = "None" if record is None else f"a {type(record).__name__}"
        raise RecordError(
            f"a record maps param paths to tensors (a dict, a ModuleRecord); got {what}"
            + (" (load a file with try_load_file / load_file)" if isinstance(record, (str, os.PathLike)) else "")
        )
    from .convert._store import apply_record

    return apply_record(self, record, allow_partial=allow_partial, report=report, source=source)



def load_record(self, record, *, report=None) -> "Module":
    """As :meth:`try_load_record` with every tensor required (Python has no panic)."""
    return self.try_load_record(record, report=report)



def save_file(self, path, metadata: Optional[dict] = None):
    """Write the module's record as a burnpack file (``.bpk`` appended when missing), atomically.

    A module owning named adapters (``add_adapter``) writes every one of them, the active one
    too, as ``<W>.lora.<name>.a`` / ``.b`` with their scales, layouts and the active name in the
    file's metadata; :meth:`load_file` puts each back into the adapter of its name
    (:mod:`onnxparam.lora._records`). Other modules' files are Burn's, unchanged.

    For ONNX use :func:`onnxparam.export_onnx`, for safetensors
    :func:`onnxparam.convert.save_safetensors`. A replaced file keeps its permission bits.

    Returns:
        the ``pathlib.Path`` written.

    Raises:
        RecordError: ``path`` ends in ``.onnx`` or ``.safetensors``.
        PermissionError: the file is read-only (even for root), or its folder is not
            writable; nothing is written.
        FileNotFoundError: the folder does not exist (it is not created).
    """
    from .burnpack._module_file import save_module_file
    from .lora._records import module_record

    return save_module_file(self, path, metadata, record=module_record(self))



def try_load_file(self, path, allow_partial: bool = False, *, report=None) -> "Module":
    """A copy holding the tensors of a burnpack file (lazy, zero-copy reads), through the
    one record application (:func:`onnxparam.convert.apply_record`); ``report`` as there.

    Named adapters (:mod:`onnxparam.lora._records`): each ``<W>.lora.<name>.a`` / ``.b`` of the
    file loads into the adapter of that name (one the module lacks is added); the module's active
    adapter stays active (with none active, the file's becomes active). A file's unnamed
    ``<W>.lora.a`` / ``.b`` goes to the named adapter whose param ids it carries, else to the
    module's only named adapter; else ``RecordError`` naming the file, tensors and adapters.

    For safetensors use :func:`onnxparam.convert.load_safetensors`, for ``.pt``
    :func:`onnxparam.convert.load_pytorch`, for ONNX weights
    :func:`onnxparam.convert.load_onnx` (:func:`onnxparam.import_onnx` builds a new module
    from a graph).

    Raises:
        FileMissingError: no such file (also a ``FileNotFoundError``). IsAFolderError: a folder
            (also an ``IsADirectoryError``).
        RecordError: for a malformed file (a safetensors / ONNX / PyTorch file names the
            function that reads it), or tensors that do not fit (all listed).
    """
    from .burnpack._module_file import load_module_record

    return self.try_load_record(load_module_record(path), allow_partial=allow_partial, report=report,
                                source=str(path))



def load_file(self, path, *, report=None) -> "Module":
    """Same as :meth:`try_load_file` with ``allow_partial=False``."""
    return self.try_load_file(path, report=report)



def apply_lora(self, config, *, allow_empty: bool = False) -> "Module":
    """A copy with LoRA adapters; see :func:`onnxparam.lora.apply_lora` (``LoraError`` when
    no param gets one, unless ``allow_empty``)."""
    from .lora._adapters import apply_lora

    return apply_lora(self, config, allow_empty=allow_empty)



def merge_lora(self) -> "Module":
    """A copy whose adapted weights are ``base + scale * (a @ b)`` with no adapters (and no
    named adapters: they were for the unmerged base)."""
    from .core.module import rebuild
    from .lora import _adapters as lora

    return lora._owning(rebuild(self, lambda path, p: lora.merge_param(p, path)), lora.LoraAdapterSet(), None)



def add_adapter(self, name: str, source) -> "Module":
    """A copy owning one more named adapter; see :func:`onnxparam.lora.add_adapter`. The first
    adapter freezes the base as :meth:`apply_lora` does (only LoRA factors train, as PEFT's);
    ``unfreeze_group(ParamGroup.all())`` afterwards for full fine-tuning."""
    from .lora._adapters import add_adapter

    return add_adapter(self, name, source)



def set_adapter(self, name: Optional[str]) -> "Module":
    """A copy with named adapter ``name`` active; see :func:`onnxparam.lora.set_adapter`
    (``require_grad`` flags unchanged: the base stays as :meth:`add_adapter` left it)."""
    from .lora._adapters import set_adapter

    return set_adapter(self, name)



def disable_adapter(self) -> "Module":
    """A copy with no adapter active, the named ones kept (the base model)."""
    from .lora._adapters import disable_adapter

    return disable_adapter(self)



def delete_adapter(self, name: str) -> "Module":
    """A copy without named adapter ``name``; see :func:`onnxparam.lora.delete_adapter`."""
    from .lora._adapters import delete_adapter

    return delete_adapter(self, name)



@property
def lora_adapters(self):
    """The named adapters this module owns (:class:`onnxparam.LoraAdapterSet`)."""
    from .lora._adapters import adapter_set

    return adapter_set(self)



@property
def active_adapter(self) -> Optional[str]:
    """The active named adapter's name, or ``None``."""
    from .lora._adapters import active_adapter

    return active_adapter(self)



def quantize_weights(self, quantizer) -> "Module":
    """A copy whose float weights are quantized by ``quantizer``; see :mod:`onnxparam.quant`.

    In an imported ONNX graph only the weights of ops with an integer or weight-only kernel
    (MatMul / Gemm ``B``, Conv / ConvTranspose ``W``, embedding ``Gather`` tables) are quantized;
    constants feeding arithmetic, biases, norm scales, position embeddings and class tokens keep
    their values (:mod:`onnxparam.quant._roles`; why each stayed float:
    ``onnxparam.quant._module.kept_float(result)``). :meth:`quantize_weights_group` quantizes
    exactly the params its group names."""
    from .quant._module import quantize_weights

    return quantize_weights(self, quantizer)



def quantize_weights_group(self, quantizer, group) -> "Module":
    """A copy whose float params (rank >= ``quantizer.min_rank``) that ``group`` matches are
    quantized, weights or not (the group names them)."""
    from .quant._module import quantize_weights

    return quantize_weights(self, quantizer, group)



def apply_qlora(self, config, quantizer) -> "Module":
    """A QLoRA copy: the weights ``config.param_group`` matches are quantized with
    ``quantizer`` (:func:`onnxparam.quant._module.quantize_weights` with that group), then float LoRA
    adapters are attached to them (:func:`onnxparam.lora.apply_lora`).

    Every base param ends frozen (``require_grad=False``): the quantized weights hold integer
    values and scales, the other float params are frozen by ``apply_lora``; only the adapter
    factors (``<path>.lora.a`` / ``.lora.b``, float: ``config.dtype``, else F32 for a quantized
    base) are trainable. ``module(x)`` and ``autodiff.grad`` compute with the dequantized base
    plus ``scale * (x @ a) @ b``.

    Args:
        config: the :class:`~onnxparam.LoraConfig` (rank, alpha, which params).
        quantizer: the :class:`~onnxparam.quant.Quantizer` (scheme, min rank).

    Returns:
        The new module (this one is unchanged).

    Raises:
        TypeError: when ``config`` is not a ``LoraConfig`` or ``quantizer`` not a
            ``Quantizer`` (e.g. the two swapped).
        QuantizationError: when a matched weight cannot be quantized with the scheme, or is
            already quantized.
        ValueError: when a matched weight already has a LoRA adapter.
    """
    from .lora._adapters import LoraConfig
    from .quant._module import Quantizer

    if not isinstance(config, LoraConfig) or not isinstance(quantizer, Quantizer):
        swapped = isinstance(config, Quantizer) and isinstance(quantizer, LoraConfig)
        raise TypeError(
            f"apply_qlora(config, quantizer) takes a LoraConfig then a Quantizer; got "
            f"{type(config).__name__} and {type(quantizer).__name__}" + (" (swapped?)" if swapped else ""))
    return self.quantize_weights_group(quantizer, config.param_group).apply_lora(config)


MODULE_VERBS = ('valid', 'into_record', 'try_load_record', 'load_record', 'save_file', 'try_load_file', 'load_file', 'apply_lora', 'merge_lora', 'add_adapter', 'set_adapter', 'disable_adapter', 'delete_adapter', 'lora_adapters', 'active_adapter', 'quantize_weights', 'quantize_weights_group', 'apply_qlora')
"""The methods :func:`install` gives :class:`onnxparam.core.module.Module` (through its base
:class:`onnxparam.core.verbs.ModuleVerbs`)."""


def install() -> None:
    """Install the verbs on ``Module`` / ``ModuleRecord`` and the extension-point loaders (once,
    from ``onnxparam/__init__.py``)."""
    namespace = globals()
    for name in MODULE_VERBS:
        verb = namespace[name]
        for function in (verb.fget,) if isinstance(verb, property) else (verb,):
            function.__qualname__ = f"Module.{name}"
        setattr(ModuleVerbs, name, verb)
    _load_record_file.__qualname__ = "ModuleRecord.load_file"
    RecordVerbs.load_file = staticmethod(_load_record_file)
    extension.install(tensor_ops=_tensor_ops, executor=_executor)
