"""Packaged model data, installed as ``onnxparam._models`` (see ``pyproject.toml``).

The files live at the repository root (``models/``) so that they are visible and documented
(``models/README.md``: provenance and licences); they are located at run time with
``importlib.resources``, which works from a source checkout, an editable install and a wheel.
Use :mod:`onnxparam.zoo` rather than this package.
"""
