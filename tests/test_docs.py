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
