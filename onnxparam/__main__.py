"""``python -m onnxparam``: the ``onnxparam`` command line (:mod:`onnxparam.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
