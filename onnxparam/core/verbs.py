"""Where the features' verbs join the core's classes: empty bases the top layer fills.

``Module`` (:mod:`onnxparam.core.module`) and ``ModuleRecord`` (:mod:`onnxparam.core.record`)
derive from these. The top layer (:mod:`onnxparam._assembly`) sets the verbs that belong to a
feature on them at ``import onnxparam`` (``Module.load_file``, ``save_file``, ``apply_lora``,
``quantize_weights`` ..., ``ModuleRecord.load_file``), each a thin method doing a plain import of
its feature when called. This file imports nothing, so filling them costs nothing at import.
"""

__all__ = ["ModuleVerbs", "RecordVerbs"]


class ModuleVerbs:
    """The features' verbs of ``Module`` (set by :mod:`onnxparam._assembly`)."""


class RecordVerbs:
    """The features' verbs of ``ModuleRecord`` (set by :mod:`onnxparam._assembly`)."""
