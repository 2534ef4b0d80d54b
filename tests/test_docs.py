"""Every document a docstring cites is in the repository, and every section it cites exists.

The oracle is the file tree and the headings of the cited documents (``## 2.`` / ``### 2.3``).
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "onnxparam"
DOC_REF = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.md)\b")
SECTION = re.compile(r"§(\d+(?:\.\d+)?)")


def docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield text


def cited(pattern):
    for path in sorted(PACKAGE.rglob("*.py")):
        for text in docstrings(path):
            for match in pattern.finditer(text):
                yield path.relative_to(ROOT), match.group(1)
        for match in pattern.finditer(path.read_text()):  # comments too
            yield path.relative_to(ROOT), match.group(1)


def test_every_markdown_file_a_docstring_cites_is_in_the_repository():
    refs = set(cited(DOC_REF))
    assert any(ref == "docs/burnpack.md" for _, ref in refs)  # the checker sees the citations
    missing = sorted(f"{path}: {ref}" for path, ref in refs if not (ROOT / ref).is_file())
    assert missing == []


def sections(note: Path) -> set:
    """``"2"``, ``"2.3"`` for headings ``## 2.`` / ``### 2.3``, and ``"4.5"`` for the numbered
    item ``5.`` of section 4."""
    found, current = set(), None
    for line in note.read_text().splitlines():
        heading = re.match(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", line)
        if heading:
            found.add(heading.group(1))
            current = heading.group(1).split(".")[0]
        item = re.match(r"^(\d+)\. ", line)
        if item and current is not None:
            found.add(f"{current}.{item.group(1)}")
    return found


def test_every_cited_burnpack_section_is_in_the_note():
    found = sections(ROOT / "docs" / "burnpack.md")
    assert {"0", "1.3", "2.4", "4.4", "6.4", "7"} <= found
    missing = sorted(f"{path}: §{number}" for path, number in set(cited(SECTION)) if number not in found)
    assert missing == []


def test_the_checker_finds_a_reference_that_does_not_resolve():
    assert DOC_REF.findall("see ``notes/ops_contract.md`` and BURNPACK.md §2") == ["notes/ops_contract.md",
                                                                                  "BURNPACK.md"]
    assert not (ROOT / "notes" / "ops_contract.md").is_file()


XREF = re.compile(r":(?:mod|func|class|meth|data|attr|exc):`~?(\.*[\w.]+)`")
"""A Sphinx cross-reference (``:func:`onnxparam.ops.conv2d``, ``:mod:`._rules_nn``)."""


def absolute(ref: str, module: str, is_package: bool) -> str:
    """``ref`` as a dotted name: a leading ``.`` is the module's package, each further ``.`` one
    package up (Python's relative import rule)."""
    dots = len(ref) - len(ref.lstrip("."))
    if not dots:
        return ref
    base = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(base[: len(base) - (dots - 1)] + [ref[dots:]])


def resolves(name: str) -> bool:
    """Whether ``name`` is a module of the package or an attribute reached from one."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def package_refs():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parent.parts if is_package else rel.parts)
        for ref in XREF.findall(path.read_text()):
            name = absolute(ref, module, is_package)
            if name.startswith("onnxparam"):
                yield path.relative_to(ROOT), ref, name


def test_every_cross_reference_of_the_package_names_one_of_its_modules_or_objects():
    refs = list(package_refs())
    assert len(refs) > 500 and any(name == "onnxparam.autodiff._rules_nn" for _, _, name in refs)
    unresolved = sorted(f"{path}: {ref}" for path, ref, name in refs if not resolves(name))
    assert unresolved == []


def test_the_cross_reference_checker_reads_relative_names_and_refuses_missing_ones():
    assert absolute(".._trace.Tracer", "onnxparam.autodiff._training", False) == "onnxparam._trace.Tracer"
    assert absolute("._rules_nn", "onnxparam.autodiff", True) == "onnxparam.autodiff._rules_nn"
    assert resolves("onnxparam.nn.Conv2d.forward") and resolves("onnxparam.autodiff._rules_nn")
    assert not resolves("onnxparam.autodiff.losses.mse") and not resolves("onnxparam.quant.quantize_weights")
