"""What a load or save did, tensor by tensor: :class:`LoadReport` and :class:`SaveReport`.

``str(report)`` prints a summary line and one section per non-empty category (long sections
are cut after :data:`MAX_LISTED` lines); the lists themselves are complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["LoadReport", "SaveReport", "ConvertReport", "MAX_LISTED"]

MAX_LISTED = 20
"""Lines printed per section by ``str(report)`` before "... and N more"."""


def _section(title: str, lines: list[str]) -> list[str]:
    if not lines:
        return []
    out = [f"  {title} ({len(lines)}):"]
    out += [f"    {line}" for line in lines[:MAX_LISTED]]
    if len(lines) > MAX_LISTED:
        out.append(f"    ... and {len(lines) - MAX_LISTED} more")
    return out


def _change_sections(report) -> list[str]:
    """The renamed / transposed / cast sections every report prints the same way."""
    return (_section("renamed", [f"{a} -> {b}" for a, b in report.renamed])
            + _section("transposed", [f"{p} {_shape(a)} -> {_shape(b)}" for p, a, b in report.transposed])
            + _section("cast", [f"{p} {a.name} -> {b.name}" for p, a, b in report.cast]))


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass
class LoadReport:
    """The outcome of loading tensors into a module (Burn's ``ApplyResult``, plus layout info).

    Attributes:
        source: the file (or record) the tensors came from.
        applied: module paths that received a tensor, in traversal order.
        missing: module paths the source had no tensor for (kept as they were).
        unused: source tensor names no param took (their original names).
        ignored: source tensors the adapter knows have no module counterpart
            (PyTorch's ``num_batches_tracked``); never an error.
        skipped: module paths (and source names) left out by ``include``/``exclude``.
        renamed: ``(source name, module path)`` for every tensor loaded under another name
            (key remapping, index renumbering, the adapter's ``weight -> gamma``).
        transposed: ``(module path, source shape, module shape)`` for every transposed tensor.
        cast: ``(module path, source dtype, module dtype)`` for every cast tensor.
        errors: one line per tensor that could not be loaded (shape / dtype mismatch, name
            clash); non-empty only on the report attached to a raised ``RecordError``.
        undecided: ``(module path, why)`` for each weight of an imported model that its exporter
            renamed (``onnx::MatMul_N``) and that :func:`~onnxparam.convert.load_pytorch` could
            not match to one checkpoint tensor by evidence (it is then also ``missing``).
    """

    source: str = ""
    applied: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    unused: list = field(default_factory=list)
    ignored: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    renamed: list = field(default_factory=list)
    transposed: list = field(default_factory=list)
    cast: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    undecided: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is missing, unused or in error."""
        return not (self.missing or self.unused or self.errors)

    def __str__(self) -> str:
        head = (f"LoadReport{f' from {self.source!r}' if self.source else ''}: {len(self.applied)} applied, "
                f"{len(self.missing)} missing, {len(self.unused)} unused, {len(self.ignored)} ignored, "
                f"{len(self.skipped)} skipped, {len(self.renamed)} renamed, {len(self.transposed)} transposed, "
                f"{len(self.cast)} cast, {len(self.errors)} errors")
        lines = [head]
        lines += _section("errors", list(self.errors))
        lines += _section("missing", list(self.missing))
        lines += _section("undecided", [f"{p}: {why}" for p, why in self.undecided])
        lines += _section("unused", list(self.unused))
        lines += _section("ignored", list(self.ignored))
        lines += _section("skipped", list(self.skipped))
        lines += _change_sections(self)
        lines += _section("applied", list(self.applied))
        return "\n".join(lines)


@dataclass
class SaveReport:
    """The outcome of saving a module's tensors to a file.

    Attributes:
        path: the file written (``None`` before writing).
        saved: file tensor names written, in the module's traversal order.
        skipped: module paths left out by ``include``/``exclude``.
        renamed: ``(module path, file name)`` for every tensor saved under another name.
        transposed: ``(file name, module shape, file shape)`` for every transposed tensor.
        cast: ``(file name, module dtype, file dtype)`` for every cast tensor.
    """

    path: Optional[str] = None
    saved: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    renamed: list = field(default_factory=list)
    transposed: list = field(default_factory=list)
    cast: list = field(default_factory=list)

    def __str__(self) -> str:
        head = (f"SaveReport{f' to {self.path!r}' if self.path else ''}: {len(self.saved)} saved, "
                f"{len(self.skipped)} skipped, {len(self.renamed)} renamed, {len(self.transposed)} transposed, "
                f"{len(self.cast)} cast")
        lines = [head]
        lines += _section("skipped", list(self.skipped))
        lines += _change_sections(self)
        lines += _section("saved", list(self.saved))
        return "\n".join(lines)


@dataclass
class ConvertReport:
    """The outcome of :func:`onnxparam.convert.convert`.

    Attributes:
        source, target: the two files.
        tensors: names written, in data order.
        skipped: source names left out by ``include``/``exclude``.
        renamed: ``(source name, written name)``.
        transposed: ``(written name, source shape, written shape)``.
        cast: ``(written name, source dtype, written dtype)``.
        ignored: source names left out because the target has no counterpart by design
            (``num_batches_tracked`` under ``pytorch=True``, as the PyTorch adapter ignores it
            when loading into a module).
        untouched: ``(source name, why)`` for tensors ``pytorch=True`` could not decide from
            names and shapes (a rank-2 ``weight`` without a bias: Linear or Embedding); settle
            them with ``transpose`` / ``no_transpose`` (``--transpose RE`` / ``--no-transpose RE``).
        kept: ``(source name, why)`` for rank-2 weights ``pytorch=True`` left as they are because
            the file's evidence shows them already in the target's layout (Hugging Face's GPT-2
            ``Conv1D`` stores ``(in, out)``, Burn's layout).
        unused: names (after renaming) of source tensors NOT written because the ``graph``
            template has no weight at that path (``allow_partial=True``; otherwise an error).
            Never counted in ``tensors``. (An ONNX exporter that folds a BatchNorm into the
            preceding Conv leaves the source's ``conv``/``bn`` tensors here.)
        missing: ``(module path, ONNX name)`` of the ``graph`` template's weights that no
            source tensor replaced: they keep the template's own values (``allow_partial=True``; otherwise
            an error).
        bytes_written: size of the target file (for zero-copy ONNX: the model file only).
        notes: anything else worth telling (e.g. "weights stay in model.bpk (zero-copy)").
    """

    source: str = ""
    target: str = ""
    tensors: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    renamed: list = field(default_factory=list)
    transposed: list = field(default_factory=list)
    cast: list = field(default_factory=list)
    ignored: list = field(default_factory=list)
    untouched: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    unused: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    bytes_written: int = 0
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        head = (f"ConvertReport: {self.source!r} -> {self.target!r}: {len(self.tensors)} tensors written, "
                f"{self.bytes_written} bytes written, {len(self.skipped)} skipped, {len(self.renamed)} renamed, "
                f"{len(self.transposed)} transposed, {len(self.cast)} cast, {len(self.ignored)} ignored, "
                f"{len(self.untouched)} untouched")
        if self.unused or self.missing:
            head += (f", {len(self.unused)} NOT written (the graph has no weight for them), {len(self.missing)} "
                     "graph weights NOT replaced (they keep the graph's old values)")
        lines = [head]
        lines += _section("NOT written: the graph has no weight at these paths", list(self.unused))
        lines += _section("NOT replaced: these graph weights keep the graph's old values", [p if p == n else f"{p} (ONNX {n!r})" for p, n in self.missing])
        lines += [f"  note: {n}" for n in self.notes]
        lines += _section("untouched (decide with --transpose RE / --no-transpose RE, or load into a module)",
                          [f"{n}: {why}" for n, why in self.untouched])
        lines += _section("kept in place (the file shows them already in the target's layout)",
                          [f"{n}: {why}" for n, why in self.kept])
        lines += _section("ignored", list(self.ignored))
        lines += _section("skipped", list(self.skipped))
        lines += _change_sections(self)
        return "\n".join(lines)
