"""The package's layering (see the docstring of onnxparam/__init__.py) holds, and no two files import each other.

The oracle is the source itself: every import statement of every file under ``onnxparam/``, at
module level and inside functions, parsed with ``ast``. Importing ``a.b.c`` runs the package
``__init__`` files of ``a`` and ``a.b`` too, so those count as imported as well.

Each file belongs to one layer (``LAYERS``, matched by the longest path prefix); an import may
go to the same layer or a lower one. ``ALLOWED`` lists the few upward imports that stay, each
with its reason. Services an upper layer provides to a lower one go through
``onnxparam/_services.py`` (registered in ``onnxparam/__init__.py``), not through imports.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "onnxparam"

ORDER = ["values", "model", "formats", "graph", "runtime", "bridges", "top"]

LAYERS = {
    # values: numbers, dtypes, devices, errors, quantized values; no files, no modules
    "_version.py": "values", "_services.py": "values", "_ort.py": "values", "_scratch.py": "values",
    "_cli_start.py": "values",
    "dtype.py": "values", "device.py": "values", "errors.py": "values", "tensor.py": "values",
    "quant/__init__.py": "values", "quant/_scheme.py": "values", "quant/_scales.py": "values",
    "quant/_layout.py": "values", "quant/_tensor.py": "values", "quant/_calibration.py": "values",
    # model: params, groups, the module tree, LoRA adapters, quantized weights, layers
    "param.py": "model", "group.py": "model", "module.py": "model", "lora.py": "model",
    "quant/_module.py": "model", "_snapshot.py": "model",
    # formats: bytes of files (burnpack, safetensors, ONNX protobuf); no modules
    "burnpack": "formats", "formats": "formats", "onnx_io/_source.py": "formats", "onnx_io/_save.py": "formats",
    "onnx_io/_weights.py": "formats", "onnx_io/_metadata.py": "formats", "onnx_io/_naming.py": "formats",
    "onnx_io/_validate.py": "formats", "onnx_io/_value_info.py": "formats",
    "onnx_io/_map_type.py": "formats", "onnx_io/_data_watch.py": "formats",
    "onnx_io/_source_errors.py": "graph",  # the imported file named in run-time errors (runtime uses it)
    "onnx_io/__init__.py": "formats",  # a lazy facade: it imports no module at import time
    # graph: the tracer, ops, the layers built from ops, graph passes (LoRA, QDQ), backward graphs
    "_trace.py": "graph", "_trace_types.py": "graph", "_trace_finish.py": "graph", "nn/_conv_common.py": "graph", "_symint.py": "graph", "_lora_import.py": "graph", "_lora_batched.py": "graph", "_passes.py": "graph", "ops": "graph", "nn": "graph", "_lora_graph": "graph",
    "quant/_qdq.py": "graph", "quant/_qdq_options.py": "graph", "quant/_qdq_layout.py": "graph",
    "quant/_qdq_import.py": "graph", "quant/_qdq_forms.py": "graph", "quant/_nbits.py": "graph", "quant/_nbits_import.py": "graph", "quant/_qdq_static.py": "graph",
    "autodiff": "graph", "autodiff/_rules_shape.py": "graph",
    # runtime: ONNX Runtime sessions and calls; training steps run on it
    "runtime": "runtime", "quant/_activations.py": "runtime", "_lora_adapter_file.py": "runtime", "_lora_batched_run.py": "runtime", "autodiff/__init__.py": "runtime", "autodiff/_training.py": "runtime", "optim": "runtime",
    # bridges: module <-> records <-> files, ONNX import/export, converters, PEFT
    "record.py": "bridges", "onnx_io": "bridges", "convert": "bridges",
    # top: the CLI, the model zoo, the package facade
    "cli": "top", "zoo": "top", "__init__.py": "top", "__main__.py": "top",
}

ALLOWED = {
    # (importing file, imported file): why this upward import stays
}


def module_file(name: str):
    """The file under onnxparam/ that module ``name`` is, relative to the package, or None."""
    if name != "onnxparam" and not name.startswith("onnxparam."):
        return None
    rel = Path(*name.split(".")[1:])
    if (PACKAGE / rel / "__init__.py").is_file():
        return (rel / "__init__.py").as_posix()
    if (PACKAGE / rel.with_suffix(".py")).is_file():
        return rel.with_suffix(".py").as_posix()
    return None


def with_packages(name: str) -> list:
    """``name`` and every package above it (their ``__init__`` files run on import)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imported_files(rel: str, source: str = None) -> set:
    """Package files (relative to onnxparam/) that the file ``rel`` imports, anywhere in it.

    The ``__init__`` of a package above ``rel`` counts only when named explicitly (``from .. import
    x``): Python has run it before ``rel`` whatever ``rel`` imports.
    """
    tree = ast.parse((PACKAGE / rel).read_text() if source is None else source)
    package = ["onnxparam"] + list(Path(rel).parent.parts)
    explicit, implicit = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                explicit.add(alias.name)
                implicit.update(with_packages(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            implicit.update(with_packages(module))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                submodule = f"{module}.{alias.name}"
                explicit.add(submodule if module_file(submodule) else module)
    ancestors = {".".join(package[:i]) for i in range(1, len(package) + 1)}
    names = explicit | (implicit - ancestors)
    return {module_file(n) for n in names} - {None, rel}


def layer_of(rel: str) -> str:
    """The layer of a file: its own entry, else that of the longest folder or stem prefix."""
    best = max((key for key in LAYERS if rel == key or rel == key + ".py" or rel.startswith(key + "/")),
               key=len, default=None)
    assert best is not None, f"onnxparam/{rel} is in no layer: add it to LAYERS"
    return LAYERS[best]


def all_files() -> list:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def import_graph() -> dict:
    return {rel: imported_files(rel) for rel in all_files()}


def upward_imports(graph) -> list:
    bad = []
    for rel, targets in graph.items():
        for target in sorted(targets):
            if ORDER.index(layer_of(target)) > ORDER.index(layer_of(rel)) and (rel, target) not in ALLOWED:
                bad.append(f"{rel} ({layer_of(rel)}) imports {target} ({layer_of(target)})")
    return bad


def cycles(graph) -> list:
    """The strongly connected components of more than one file (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_imports_inside_functions_and_the_package_inits_they_run():
    source = "import os\n\ndef f():\n    from ..ops import add\n    from .. import record\n"
    assert imported_files("nn/x.py", source) == {"ops/__init__.py", "record.py"}
    assert imported_files("autodiff/_x.py", "from ..quant._scheme import QuantScheme\n") == {
        "quant/__init__.py", "quant/_scheme.py"}
    assert imported_files("cli/x.py", "def f():\n    from .. import __version__\n") == {"__init__.py"}


def test_the_checker_finds_a_cycle_and_an_upward_import():
    graph = {"tensor.py": {"ops/__init__.py"}, "ops/__init__.py": {"tensor.py"}, "dtype.py": set()}
    assert cycles(graph) == [["ops/__init__.py", "tensor.py"]]
    assert upward_imports(graph) == ["tensor.py (values) imports ops/__init__.py (graph)"]


def test_every_file_is_in_a_layer():
    for rel in all_files():
        assert layer_of(rel) in ORDER


def test_no_file_imports_a_higher_layer_except_the_written_allowlist():
    bad = upward_imports(import_graph())
    print(f"{len(bad)} upward imports")
    assert bad == []


def test_no_import_cycle_between_files():
    found = cycles(import_graph())
    print(f"{len(found)} import cycles")
    assert found == [], "\n".join(" -> ".join(c) for c in found)


def test_every_allowlisted_import_still_exists_and_goes_upward():
    graph = import_graph()
    for (rel, target), why in ALLOWED.items():
        assert why, (rel, target)
        assert target in graph[rel], f"stale allowlist entry {rel} -> {target}"
        assert ORDER.index(layer_of(target)) > ORDER.index(layer_of(rel))


@pytest.mark.parametrize("fmt", ["burnpack", "formats"])
def test_the_file_formats_know_bytes_and_snapshots_not_modules(fmt):
    module_code = {"module.py", "lora.py", "group.py", "quant/_module.py"}
    graph = import_graph()
    for rel, targets in graph.items():
        if rel.startswith(fmt + "/"):
            assert not {t for t in targets if t in module_code or t.startswith("nn/")}, rel
            assert all(layer_of(t) in ("values", "model", "formats") for t in targets), rel


@pytest.mark.parametrize("statement", ["import onnxparam", "import onnxparam.cli",
                                       "import onnxparam.burnpack as bp; bp.read"])
def test_importing_the_package_the_cli_or_the_burnpack_reader_loads_no_heavy_dependency(statement):
    import subprocess
    import sys

    heavy = ("onnx", "onnx_ir", "ml_dtypes", "onnxruntime", "torch")
    code = f"{statement}\nimport sys\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("statement", ["import onnxparam", "import onnxparam.cli"])
def test_importing_the_package_or_the_cli_loads_no_numpy(statement):
    """``onnxparam --help`` / ``--version`` import only the CLI: numpy (tens of ms) waits for
    the first command that reads or computes tensors."""
    import subprocess
    import sys

    code = f"{statement}\nimport sys\nprint('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("facade, table", [("onnxparam", "_LAZY"), ("onnxparam.quant", "_UPPER_LAYERS"),
                                           ("onnxparam.onnx_io", "_NAMES"), ("onnxparam.formats", "_NAMES")])
def test_every_lazy_name_of_a_facade_is_the_object_its_module_defines(facade, table):
    import importlib

    package = importlib.import_module(facade)
    for name, owner in getattr(package, table).items():
        module = importlib.import_module(f"{facade}.{(owner or name).lstrip('.')}")
        expected = module if owner is None else getattr(module, name)
        assert getattr(package, name) is expected, (facade, name)
        assert name in dir(package)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        package.not_a_name


def test_every_registered_service_resolves_to_the_object_it_names():
    import importlib

    import onnxparam  # noqa: F401  (registers the services)
    from onnxparam import _services

    for name, target in _services._TARGETS.items():
        module_name, _, attribute = target.partition(":")
        module = importlib.import_module(module_name)
        assert _services.service(name) is (getattr(module, attribute) if attribute else module), name
    with pytest.raises(LookupError, match="no onnxparam service 'missing'"):
        _services.service("missing")
