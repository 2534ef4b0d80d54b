"""The package's layering (see onnxparam/__init__.py) holds: each layer imports only those above it.

The oracle is the source itself: every import statement of a file, parsed with ``ast``.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "onnxparam"


def imported_modules(path: Path, top_level_only: bool) -> set:
    """Absolute names of the modules a file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1]  # the package a relative import starts from (also for __init__.py)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                if not node.module:
                    names.update(f"{module}.{alias.name}" for alias in node.names)
                    continue
            else:
                module = node.module
            names.add(module)
    return names


def files(*relative: str) -> list:
    out = []
    for rel in relative:
        target = PACKAGE / rel
        out.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    return out


def offending(paths, forbidden, top_level_only=False) -> list:
    bad = []
    for path in paths:
        for name in imported_modules(path, top_level_only):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return bad


def test_the_burnpack_format_knows_bytes_not_modules_graphs_or_runtimes():
    forbidden = ["onnxparam.module", "onnxparam.param", "onnxparam.record", "onnxparam.group", "onnxparam.lora",
                 "onnxparam.onnx_io", "onnxparam.trace", "onnxparam.runtime", "onnx", "onnxruntime", "onnx_ir"]
    assert offending(files("burnpack"), forbidden) == []


def test_the_quantized_value_layer_knows_no_files_and_no_modules():
    forbidden = ["onnxparam.burnpack", "onnxparam.module", "onnxparam.param", "onnxparam.record", "onnxruntime"]
    assert offending(files("quant/scheme.py", "quant/scales.py", "quant/layout.py", "quant/tensor.py",
                           "quant/calibration.py"), forbidden) == []


@pytest.mark.parametrize("model_file", ["param.py", "group.py", "lora.py", "module.py", "tensor.py", "dtype.py"])
def test_the_model_layer_imports_no_file_format_or_runtime_at_import_time(model_file):
    forbidden = ["onnxparam.burnpack", "onnxparam.onnx_io", "onnxparam.convert", "onnxparam.trace",
                 "onnxparam.runtime", "onnxruntime", "onnx_ir", "cbor2", "safetensors"]
    assert offending(files(model_file), forbidden, top_level_only=True) == []
