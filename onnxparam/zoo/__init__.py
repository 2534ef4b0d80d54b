"""Ready-made models with packaged weights (``from onnxparam.zoo import mnist``).

* :mod:`onnxparam.zoo.mnist` — the model of Burn's MNIST example, its Burn-trained weights
  (``model.bpk``, written by Burn) and 1,797 real handwritten digits to classify.

The data files ship in the wheel as the package ``onnxparam._models`` (the repository's
``models/`` folder, with provenance and licences in ``models/README.md``).
"""

from . import mnist

__all__ = ["mnist"]
