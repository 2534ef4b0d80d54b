"""Shared test settings: hypothesis keeps no example database (it would write ``.hypothesis/``
into the repository; tests write only to their tmp_path)."""

try:
    from hypothesis import settings
except ImportError:  # pragma: no cover - hypothesis is a test extra
    pass
else:
    settings.register_profile("onnxparam", database=None)
    settings.load_profile("onnxparam")
