"""Session options: :class:`SessionConfig`, set globally or per module (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..core.errors import LoraError
from ..trace.passes import LORA_MODES
from ._ort import import_onnxruntime

ort = import_onnxruntime()

__all__ = ["SessionConfig", "session_config", "CONFIG_ATTR", "DEFAULTS", "DYNAMIC_SHAPE_POLICIES"]

CONFIG_ATTR = "_onnxparam_session_config"
"""The private attribute a module keeps its own :class:`SessionConfig` in (copied with it)."""

GRAPH_OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
QDQ_ACCURACY_LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"
"""ONNX Runtime's session config entry for the ``accuracy_level`` of fused ``MatMulNBits``."""

EXECUTION_MODES = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}


DYNAMIC_SHAPE_POLICIES = ("auto", "static")
"""Values of :attr:`SessionConfig.dynamic_shapes`."""


def _freeze_provider(p):
    if isinstance(p, str):
        return p
    name, options = p
    return (str(name), tuple(sorted((str(k), str(v)) for k, v in dict(options).items())))


@dataclass(frozen=True)
class SessionConfig:
    """Options of the ``InferenceSession`` s built for a module (or globally).

    Args:
        intra_op_num_threads: threads inside one operator; ``0`` = ONNX Runtime's default.
        inter_op_num_threads: threads across operators (parallel mode); ``0`` = default.
        graph_optimization_level: ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"``.
        execution_mode: ``"sequential"`` or ``"parallel"``.
        providers: execution providers to use instead of the ones the device picks: names or
            ``(name, {option: value})`` pairs (a CUDA entry without ``device_id`` gets the
            device's). Each must be available.
        config_entries: ``(key, value)`` session config entries
            (``SessionOptions.add_session_config_entry``).
        log_severity_level: ONNX Runtime's log level for the session (4 = fatal only: its errors
            reach the caller as ExecutionError instead of being printed).
        qdq_accuracy_level: the ``accuracy_level`` ONNX Runtime gives the ``MatMulNBits`` it fuses
            from a quantized weight's ``DequantizeLinear -> MatMul`` (session config entry
            ``session.qdq_matmulnbits_accuracy_level``): 1 = float32 activations, so ``module(x)``
            computes with exactly the dequantized weights (the default here); 4 = int8
            activations, faster and approximate (ONNX Runtime's own default); 0 = ORT's default.
        lora_mode: how ``module(x)`` runs LoRA adapters (:data:`onnxparam.trace.passes.LORA_MODES`):
            ``"merge"`` (the effective weights, no overhead; a module holding an adapter no weight
            can hold, a grouped convolution's, runs in ``"keep"``), ``"keep"`` (the adapter as graph
            nodes) or ``"inputs"`` (as ``"keep"``, the factors fed as inputs on every call: one
            session serves every adapter of the same rank, and switching adapters builds none).
        dynamic_shapes: how ``module(x)`` treats input shapes (:data:`DYNAMIC_SHAPE_POLICIES`).
            ``"auto"`` (default; PyTorch ``torch.compile``'s "automatic dynamic"): the first call
            traces with concrete shapes; when a later call differs in some dims, the forward is
            traced once more with those dims symbolic (:mod:`onnxparam.trace.symint`; sizes >= 1, a
            size 0 gets a concrete trace), and that trace and its one session serve every later
            size. A forward that needs ``x.shape[0] == 1`` decided (or ``squeeze()``) is retraced
            with sizes 0 and 1 specialized as in PyTorch (those dims concrete, the others
            symbolic, symbolic sizes >= 2); one that needs concrete sizes (Python control flow
            on a size, ``int(x.shape[0])``) falls back to a trace per
            shape. ``"static"``: a trace and a session per distinct input shape.

    Raises:
        ValueError: for an unknown optimization level, execution mode or shape policy.
        LoraError: an unknown LoRA mode (a ``ValueError`` too).
    """

    intra_op_num_threads: int = 0
    inter_op_num_threads: int = 0
    graph_optimization_level: str = "all"
    execution_mode: str = "sequential"
    providers: Optional[tuple] = None
    config_entries: tuple = ()
    log_severity_level: int = 4
    qdq_accuracy_level: int = 1
    lora_mode: str = "merge"
    dynamic_shapes: str = "auto"

    def __post_init__(self):
        if self.dynamic_shapes not in DYNAMIC_SHAPE_POLICIES:
            raise ValueError(f"dynamic_shapes must be one of {', '.join(DYNAMIC_SHAPE_POLICIES)}; "
                             f"got {self.dynamic_shapes!r}")
        if self.lora_mode not in LORA_MODES:
            raise LoraError(f"lora_mode must be one of {', '.join(LORA_MODES)}; got {self.lora_mode!r}")
        if self.graph_optimization_level not in GRAPH_OPTIMIZATION_LEVELS:
            raise ValueError(f"graph_optimization_level must be one of {', '.join(GRAPH_OPTIMIZATION_LEVELS)}; "
                             f"got {self.graph_optimization_level!r}")
        if self.execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {', '.join(EXECUTION_MODES)}; got {self.execution_mode!r}")
        if self.providers is not None:
            object.__setattr__(self, "providers", tuple(_freeze_provider(p) for p in self.providers))
        entries = self.config_entries.items() if isinstance(self.config_entries, dict) else self.config_entries
        object.__setattr__(self, "config_entries", tuple((str(k), str(v)) for k, v in entries))
        if int(self.qdq_accuracy_level) not in range(5):
            raise ValueError(f"qdq_accuracy_level is 0..4 (0 ORT's default, 1 fp32, 2 fp16, 3 bf16, 4 int8); "
                             f"got {self.qdq_accuracy_level!r}")

    def with_threads(self, intra_op_num_threads: int, inter_op_num_threads: Optional[int] = None) -> "SessionConfig":
        inter = self.inter_op_num_threads if inter_op_num_threads is None else inter_op_num_threads
        return replace(self, intra_op_num_threads=intra_op_num_threads, inter_op_num_threads=inter)

    def with_graph_optimization_level(self, level: str) -> "SessionConfig":
        return replace(self, graph_optimization_level=level)

    def with_execution_mode(self, mode: str) -> "SessionConfig":
        return replace(self, execution_mode=mode)

    def with_providers(self, providers: Optional[Sequence]) -> "SessionConfig":
        return replace(self, providers=None if providers is None else tuple(providers))

    def with_lora_mode(self, mode: str) -> "SessionConfig":
        return replace(self, lora_mode=mode)

    def with_dynamic_shapes(self, policy: str) -> "SessionConfig":
        return replace(self, dynamic_shapes=policy)

    def with_qdq_accuracy_level(self, level: int) -> "SessionConfig":
        return replace(self, qdq_accuracy_level=int(level))

    def with_config_entry(self, key: str, value: str) -> "SessionConfig":
        return replace(self, config_entries=self.config_entries + ((str(key), str(value)),))

    def session_options(self):
        """A fresh ``onnxruntime.SessionOptions`` with these settings."""
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(self.intra_op_num_threads)
        so.inter_op_num_threads = int(self.inter_op_num_threads)
        so.graph_optimization_level = GRAPH_OPTIMIZATION_LEVELS[self.graph_optimization_level]
        so.execution_mode = EXECUTION_MODES[self.execution_mode]
        so.log_severity_level = int(self.log_severity_level)
        for key, value in self.config_entries:
            so.add_session_config_entry(key, value)
        if self.qdq_accuracy_level and QDQ_ACCURACY_LEVEL_KEY not in dict(self.config_entries):
            so.add_session_config_entry(QDQ_ACCURACY_LEVEL_KEY, str(int(self.qdq_accuracy_level)))
        return so



class _Defaults:
    """The configs used when a module has none (``module``) and for eager ops (``eager``:
    one intra-op thread, as those graphs are one op)."""

    module = SessionConfig()
    eager = SessionConfig(intra_op_num_threads=1)


DEFAULTS = _Defaults()


def session_config(module=None) -> SessionConfig:
    """The config sessions of ``module`` are built with (the global one when it has none)."""
    if module is not None:
        config = module.__dict__.get(CONFIG_ATTR)
        if config is not None:
            return config
    return DEFAULTS.module
