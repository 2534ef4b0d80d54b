"""The core: values and the module tree, with no verb of a feature (layer 1, imports nothing above).

* :mod:`.dtype`, :mod:`.device`, :mod:`.errors`, :mod:`.version`: Burn's dtypes, devices, the
  library's errors, the version.
* :mod:`.tensor`: ``Tensor`` (host, device or symbolic), ``TensorData``, ``QuantizedTensor`` and
  Burn's MinMax quantizer; :mod:`.quant_scheme`, :mod:`.quant_layout`, :mod:`.quant_scales`: the
  quantization schemes and their byte layouts (``docs/burnpack.md``).
* :mod:`.param`, :mod:`.group`, :mod:`.module`, :mod:`.snapshot`, :mod:`.record`: ``Param``,
  ``ParamGroup``, ``Module`` (the one traversal), ``TensorSnapshot`` and ``ModuleRecord`` as data.
* :mod:`.extension`: the two extension points (the tensor operator table, the executor);
  :mod:`.verbs`: the bases the top layer gives the features' verbs.

This package imports nothing at import time.
"""
