"""The package's layering holds: folders are the layers, no file imports a higher layer, and no two
files import each other in a cycle.

The layers are read from one place, the numbered list in the docstring of
``onnxparam/__init__.py`` (``1. ``core/``: ...``), bottom to top; a folder is one layer, the files
at the package root are the top layer. There is no per-file table and no allowlist.

The oracle is the source itself, parsed with ``ast``. An edge from a file is:

* every import statement, at module level and inside functions; importing ``a.b.c`` runs the
  package ``__init__`` files of ``a`` and ``a.b`` too, so those count as imported as well;
* a name imported from a package facade (``from ..quant import QuantScheme``) also counts as an
  edge to the module that defines it (the facade's ``from .x import`` lines and lazy tables are
  followed);
* ``importlib.import_module`` / ``__import__`` with a constant name; with a computed name it is a
  lookup by name, refused outside the top layer (whose lazy facade resolves ``_LAZY``: each
  entry counts as an edge);
* the core's two extension points (:mod:`onnxparam.core.extension`): the top layer's
  ``extension.install(...)`` names each point's loader; the module a loader imports provides the
  point, and counts as an edge to ``core/extension.py`` (it implements that interface), the
  loader as an edge from the top layer to it.
"""

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "onnxparam"
ROOT = "onnxparam/"
"""How the layer list names the package root (the top layer: ``__init__``, ``__main__``, ``_assembly``)."""

LAYER_LINE = re.compile(r"^(\d+)\. ``([\w]+/)``: (.+)$")


def read_layers(docstring: str) -> dict:
    """``folder -> (rank, concept)`` from the numbered list of the package docstring; a folder
    named ``onnxparam/`` is the package root."""
    layers = {}
    for line in docstring.splitlines():
        m = LAYER_LINE.match(line.strip())
        if m:
            folder = m.group(2)
            layers["" if folder == ROOT else folder.rstrip("/")] = (int(m.group(1)), m.group(3))
    return layers


LAYERS = read_layers(ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())))


def folder_of(rel: str) -> str:
    """The folder (layer) of a file relative to onnxparam/; ``""`` for the package root."""
    return rel.split("/")[0] if "/" in rel else ""


def rank_of(rel: str, layers=LAYERS) -> int:
    folder = folder_of(rel)
    assert folder in layers, f"onnxparam/{rel}: folder {folder or ROOT!r} is not in the package docstring's layers"
    return layers[folder][0]


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


def module_name(rel: str) -> str:
    parts = ["onnxparam"] + list(Path(rel).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def with_packages(name: str) -> list:
    """``name`` and every package above it (their ``__init__`` files run on import)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def absolute(module, level: int, package: list) -> str:
    if not level:
        return module
    base = package[: len(package) - level + 1]
    return ".".join(base + ([module] if module else []))


@functools.lru_cache(maxsize=None)  # NOTE: the package does not change during a run; do not mutate the dict
def facade_names(init_rel: str) -> dict:
    """``name -> defining module`` of a package ``__init__``: its ``from X import name`` lines and
    the string tables of its lazy ``__getattr__`` (``_LAZY`` / ``_NAMES`` / ``_UPPER_LAYERS``)."""
    tree = ast.parse((PACKAGE / init_rel).read_text())
    package = module_name(init_rel).split(".")
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            module = absolute(node.module, node.level, package)
            for alias in node.names:
                out[alias.asname or alias.name] = module
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if any(isinstance(t, ast.Name) and t.id in ("_LAZY", "_NAMES", "_UPPER_LAYERS") for t in node.targets):
                for key, value in zip(node.value.keys, node.value.values):
                    owner = value.value
                    if owner is None:
                        continue
                    dots = len(owner) - len(owner.lstrip("."))
                    out[key.value] = absolute(owner.lstrip("."), dots or 1, package)
    return out


def defining_module(module: str, name: str, depth: int = 0) -> str:
    """The module that defines ``name`` imported from ``module`` (facades followed)."""
    rel = module_file(module)
    if rel is None or not rel.endswith("__init__.py") or depth > 8:
        return module
    owner = facade_names(rel).get(name)
    if owner is None or owner == module:
        return module
    if module_file(f"{owner}.{name}") and not module_file(owner).endswith("__init__.py"):
        return owner
    return defining_module(owner, name, depth + 1)


def _lookup_calls(tree):
    """``(call, name or None)`` for each ``importlib.import_module`` / ``import_module`` /
    ``__import__`` call: the constant module name it looks up, ``None`` when computed."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if called not in ("import_module", "__import__"):
            continue
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            pkg = node.args[1] if len(node.args) > 1 else None
            yield node, (arg.value, pkg.value if isinstance(pkg, ast.Constant) else None)
        else:
            yield node, None


def edges_of(rel: str, source: str = None, lookups: list = None) -> set:
    """Package files (relative to onnxparam/) that file ``rel`` depends on: see the module
    docstring. ``lookups`` collects the computed lookups by name found outside the top layer.

    The ``__init__`` of a package above ``rel`` counts only when named explicitly (``from .. import
    x``): Python has run it before ``rel`` whatever ``rel`` imports.
    """
    tree = ast.parse((PACKAGE / rel).read_text() if source is None else source)
    package = module_name(rel).split(".") if rel.endswith("__init__.py") else module_name(rel).split(".")[:-1]
    explicit, implicit = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                explicit.add(alias.name)
                implicit.update(with_packages(alias.name))
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node.module, node.level, package)
            implicit.update(with_packages(module))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                submodule = f"{module}.{alias.name}"
                if module_file(submodule):
                    explicit.add(submodule)
                else:
                    explicit.add(module)
                    explicit.add(defining_module(module, alias.name))
    for node, target in _lookup_calls(tree):
        if target is not None:
            name, pkg = target
            if name.startswith("."):
                dots = len(name) - len(name.lstrip("."))
                name = absolute(name.lstrip("."), dots, pkg.split(".") if pkg else package)
            explicit.add(name)
            implicit.update(with_packages(name))
        elif folder_of(rel) == "" and rel == "__init__.py":
            # the top layer's lazy facade: each name of _LAZY is imported from its owner
            for name, owner in facade_names(rel).items():
                explicit.add(owner)
        elif lookups is not None:
            lookups.append(f"onnxparam/{rel}:{node.lineno}: a lookup by a computed name")
    ancestors = {".".join(package[:i]) for i in range(1, len(package) + 1)}
    names = explicit | (implicit - ancestors)
    return {module_file(n) for n in names} - {None, rel}


def extension_points() -> dict:
    """``point -> providing file``, from the top layer's ``extension.install(point=loader)``: the
    loader's import names the provider."""
    tree = ast.parse((PACKAGE / "_assembly.py").read_text())
    loaders = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    points = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "install":
            for kw in node.keywords:
                loader = loaders[kw.value.id]
                provided = {f for f in edges_of("_assembly.py", ast.unparse(loader)) if not f.endswith("__init__.py")}
                points[kw.arg] = sorted(provided)
    return points


def all_files() -> list:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


@functools.lru_cache(maxsize=None)
def _package_graph() -> tuple:
    """``(graph, lookups)`` of the package as it is on disk, read once a run (several tests ask)."""
    lookups: list = []
    graph = {rel: frozenset(edges_of(rel, lookups=lookups)) for rel in all_files()}
    for providers in extension_points().values():
        for provider in providers:  # the provider implements the core's interface
            graph[provider] = graph[provider] | {"core/extension.py"}
    return graph, tuple(lookups)


def import_graph(lookups: list = None) -> dict:
    """``file -> set of files it depends on`` for every file of the package (a fresh copy to
    change); ``lookups`` collects the computed lookups by name found outside the top layer."""
    graph, found = _package_graph()
    if lookups is not None:
        lookups.extend(found)
    return {rel: set(targets) for rel, targets in graph.items()}


def upward_edges(graph, layers=LAYERS) -> list:
    bad = []
    for rel, targets in graph.items():
        for target in sorted(targets):
            if rank_of(target, layers) > rank_of(rel, layers):
                bad.append(f"{rel} ({folder_of(rel) or ROOT}) -> {target} ({folder_of(target) or ROOT})")
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


# -- the checker ------------------------------------------------------------------------------


def test_the_layers_are_the_folders_of_the_package_in_one_list():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert set(LAYERS) == folders | {""}, "every folder is a layer, every layer a folder"
    assert sorted(rank for rank, _ in LAYERS.values())[0] == 1 and LAYERS["core"][0] == 1
    assert LAYERS[""][0] == max(rank for rank, _ in LAYERS.values())
    assert {f for f in all_files() if "/" not in f} == {"__init__.py", "__main__.py", "_assembly.py"}
    for folder, (rank, concept) in sorted(LAYERS.items(), key=lambda kv: kv[1][0]):
        print(f"{rank:>2}  {folder or 'onnxparam'}/  {concept}")


def test_the_checker_sees_imports_inside_functions_facades_and_the_package_inits_they_run():
    source = "import os\n\ndef f():\n    from ..ops import add\n    from ..core import record\n"
    assert edges_of("nn/x.py", source) == {"ops/__init__.py", "ops/_elementwise.py", "core/__init__.py",
                                           "core/record.py"}
    assert edges_of("autodiff/_x.py", "from ..quant import QuantScheme\n") == {
        "quant/__init__.py", "core/quant_scheme.py"}
    assert edges_of("cli/x.py", "def f():\n    from .. import __version__\n") == {"__init__.py", "core/version.py"}


@pytest.mark.parametrize("planted", [
    "def f():\n    import importlib\n\n    return importlib.import_module('onnxparam.runtime')\n",
    "from importlib import import_module\n\nexecutor = import_module('..runtime._executor', __package__)\n",
    "def f():\n    from ..runtime import call_module\n",
])
def test_the_checker_catches_a_planted_upward_lookup_in_the_core(planted):
    graph = import_graph()
    graph["core/planted.py"] = edges_of("core/planted.py", planted)
    found = upward_edges(graph)
    assert found and all(line.startswith("core/planted.py (core) -> runtime/") for line in found), found


def test_the_checker_refuses_a_lookup_by_a_computed_name_below_the_top_layer():
    lookups = []
    edges_of("core/planted.py", "import importlib\n\ndef f(name):\n    return importlib.import_module(name)\n",
             lookups=lookups)
    assert lookups == ["onnxparam/core/planted.py:4: a lookup by a computed name"]


def test_the_checker_finds_a_cycle_and_an_upward_edge():
    graph = {"core/tensor.py": {"ops/__init__.py"}, "ops/__init__.py": {"core/tensor.py"}, "core/dtype.py": set()}
    assert cycles(graph) == [["core/tensor.py", "ops/__init__.py"]]
    assert upward_edges(graph) == ["core/tensor.py (core) -> ops/__init__.py (ops)"]


# -- the package ------------------------------------------------------------------------------


def test_the_two_extension_points_are_provided_by_ops_and_runtime_through_the_top_layer():
    points = extension_points()
    assert points == {"tensor_ops": ["ops/_tensor_ops.py"], "executor": ["quant/_passes.py", "runtime/_executor.py"]}
    tree = ast.parse((PACKAGE / "core" / "extension.py").read_text())
    protocols = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert protocols == ["TensorOps", "Executor"]


def test_no_edge_goes_up_and_no_files_import_each_other_in_a_cycle():
    lookups = []
    graph = import_graph(lookups)
    up, found = upward_edges(graph), cycles(graph)
    for folder, (rank, _) in sorted(LAYERS.items(), key=lambda kv: kv[1][0]):
        print(f"layer {rank:>2}: {folder or 'onnxparam'}/")
    print(f"{sum(len(t) for t in graph.values())} edges between {len(graph)} files: "
          f"{len(found)} cycles / {len(up)} upward edges")
    assert lookups == []
    assert up == []
    assert found == [], "\n".join(" -> ".join(c) for c in found)


def test_the_file_formats_know_bytes_and_snapshots_not_modules():
    graph = import_graph()
    for rel, targets in graph.items():
        if folder_of(rel) in ("formats", "burnpack"):
            assert not {t for t in targets if t in ("core/module.py", "core/group.py") or t.startswith("nn/")}, rel


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
        module = importlib.import_module(f"{'.' if not owner or owner[0] != '.' else ''}{owner or name}", facade)
        expected = module if owner is None else getattr(module, name)
        assert getattr(package, name) is expected, (facade, name)
        assert name in dir(package)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        package.not_a_name


def test_the_features_verbs_are_methods_of_the_core_module():
    import onnxparam  # noqa: F401  (installs them)
    from onnxparam import _assembly
    from onnxparam.core.module import Module
    from onnxparam.core.record import ModuleRecord

    for name in _assembly.MODULE_VERBS:
        assert getattr(Module, name) is getattr(_assembly, name), name
        assert name not in vars(Module), f"{name}: the core class's body defines no feature verb"
    assert ModuleRecord.load_file.__qualname__ == "ModuleRecord.load_file"
