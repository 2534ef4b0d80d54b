"""Tracing a module's ``forward`` into an ONNX graph (layer 2).

* :mod:`.tracer`: ``Tracer``, ``trace_module`` (the public home of the trace's names);
* :mod:`.values`: the active tracer, input specs, symbols, ONNX types and attributes, node type
  inference;
* :mod:`.model`: the ``TracedModel``, and closing a trace into it (outputs, dynamic dims, the passes);
* :mod:`.symint`: symbolic dims;
* :mod:`.passes`: the graph-pass interface (``GraphPasses``) the tracer and the runtime use;
  the passes themselves (LoRA, QDQ) live above, in :mod:`onnxparam.quant._passes`.

This package imports nothing at import time.
"""
