"""Shared test settings: hypothesis writes nothing into the repository (tests write only to
temporary folders): no example database, and its storage folder (where it caches the constants
it collects from the source) is a temporary one, removed at exit."""

import atexit
import shutil
import tempfile

try:
    from hypothesis import settings
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # pragma: no cover - hypothesis is a test extra
    pass
else:
    _storage = tempfile.mkdtemp(prefix="onnxparam-hypothesis-")
    atexit.register(shutil.rmtree, _storage, ignore_errors=True)
    set_hypothesis_home_dir(_storage)
    settings.register_profile("onnxparam", database=None)
    settings.load_profile("onnxparam")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (long sweeps, races that need an idle machine) run only when the
    marker expression asks for them (``-m slow``); otherwise they are reported as skipped."""
    import pytest

    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
