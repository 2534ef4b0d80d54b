"""Signals at several moments of ``onnxparam convert``: exit codes, one line, nothing left behind.

A real subprocess (``python -m onnxparam``) converts a 64 MiB ``.bpk`` into an ``.onnx`` with
external data over a previous conversion. SIGINT exits 130 and SIGTERM 143 (the shells'
``128 + signal``), each with one line on stderr and no traceback, whether the signal comes while
Python is still importing or while the save is half-written; the previous files stay byte for
byte and no scratch entry is left. After SIGKILL (which no handler sees) the scratch entry stays,
and the next save of *another* target in that folder removes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import onnxparam.burnpack as bp

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")


@pytest.fixture(scope="module")
def big_bpk(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "big.bpk"
    bp.write(path, [bp.TensorEntry.from_numpy(f"t{i}", np.full(4 * 1024 * 1024, i, np.float32)) for i in range(4)])
    return path


def start_convert(src: Path, dst: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "onnxparam", "convert", str(src), str(dst), "--external-data",
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                            preexec_fn=_default_signals)


def _default_signals() -> None:
    """In the child: SIGINT / SIGTERM as a terminal gives them. NOTE: a test runner started in
    the background inherits an ignored SIGINT, which the CLI (as any Unix tool) keeps ignoring."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def wait_for_scratch(folder: Path, proc: subprocess.Popen) -> str:
    """The name of the process's scratch entry, once it exists (the save has begun)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p.name for p in folder.iterdir() if p.name.startswith(".") and f".{proc.pid}-" in p.name]
        if found:
            return found[0]
        time.sleep(0.005)
    raise AssertionError(f"no scratch entry appeared (exit code {proc.poll()})")


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def previous(tmp_path, big_bpk) -> tuple:
    """A folder holding a finished conversion (of the same source) to overwrite."""
    from onnxparam.convert import convert

    dst = tmp_path / "out.onnx"
    convert(big_bpk, dst, external_data=True)
    return dst, snapshot(tmp_path)


@pytest.mark.parametrize("sig, code, words", [(signal.SIGINT, 130, "interrupted (SIGINT)"),
                                              (signal.SIGTERM, 143, "terminated (SIGTERM)")])
# NOTE: "while starting" races the signal against the interpreter's imports (a fixed 0.2 s): on a
# loaded machine the signal can land inside a C extension's initialisation, so it runs with -m slow.
@pytest.mark.parametrize("moment", [pytest.param("while starting", marks=pytest.mark.slow), "mid-save"])
def test_a_signal_exits_128_plus_its_number_with_one_line_and_leaves_the_previous_files(
        tmp_path, big_bpk, previous, sig, code, words, moment):
    dst, before = previous
    proc = start_convert(big_bpk, dst)
    if moment == "while starting":
        time.sleep(0.2)  # python is importing (numpy, onnx ...)
    else:
        wait_for_scratch(tmp_path, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    lines = err.decode().splitlines()
    assert proc.returncode == code, err.decode()
    assert len(lines) == 1 and lines[0].startswith(f"onnxparam: {words}"), lines
    assert "Traceback" not in err.decode()
    assert snapshot(tmp_path) == before  # the previous conversion, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # no scratch left


def test_after_sigkill_the_next_save_of_another_target_removes_the_scratch(tmp_path, big_bpk, previous):
    dst, before = previous
    proc = start_convert(big_bpk, dst)
    scratch = wait_for_scratch(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / scratch).exists()  # no handler ran
    assert snapshot(tmp_path) == before
    bp.write(tmp_path / "other.bpk", [bp.TensorEntry.from_numpy("x", np.ones(2, np.float32))])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "other.bpk"])


def test_a_signal_in_process_removes_the_scratch_files_of_unfinished_saves(tmp_path, monkeypatch):
    """main() called from Python: the handler raises through the writer, which removes its
    scratch file; the caller's handlers are restored."""
    from onnxparam.cli import main

    src = tmp_path / "a.bpk"
    bp.write(src, [bp.TensorEntry.from_numpy(f"t{i}", np.ones(4, np.float32)) for i in range(3)])
    import onnxparam.burnpack._writer as writer

    real = writer._stream

    def stream_then_signal(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the scratch file is complete

    monkeypatch.setattr(writer, "_stream", stream_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["convert", str(src), str(tmp_path / "b.bpk"), "--quiet"]) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bpk"]
