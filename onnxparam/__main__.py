"""``python -m onnxparam``: the ``onnxparam`` command line (:mod:`onnxparam.cli`).

The start-up signal handlers were installed by the package's ``__init__`` already
(:func:`onnxparam._assembly.install_if_command_line`), before anything heavy was imported.
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
