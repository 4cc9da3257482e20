"""The layout keeps its promises (docs/architecture.md): the architecture document names exactly
the modules the tree has, no module imports another in a cycle or from inside a function, the
packages import one another only down the stages (a DAG, checked at package level too), and
only the modules of the ownership table capture, plan or lower."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fxpar": "fxpar", "passes": "fxpar.passes", "solvers": "fxpar.solvers"}


def _sources() -> dict[str, Path]:
    """Every module of the three source folders, by its installed name."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if package == "fxpar" and parts[0] in ("passes", "solvers"):
                continue  # not a folder of fxpar/, but be safe
            found[name] = path
    return found


def _imports(path: Path, inside_functions: bool, modules: set[str]) -> set[str]:
    """The fxpar modules (of ``modules``) that ``path`` imports at module level
    (``inside_functions``: only those it imports inside a function). ``from a import b`` reads
    submodule ``a.b`` when there is one, else ``a``; the root package ``fxpar`` (the public API,
    which imports everything) is not counted. Imports under ``if TYPE_CHECKING:`` run only for
    type checkers and are left out."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or (id(node) in nested) != inside_functions:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxpar"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fxpar"))
    return found - {"fxpar"}


def test_the_architecture_document_names_every_module_and_only_those() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:fxpar|passes|solvers)/[\w/]+\.py)`", text))
    tree = {str(path.relative_to(ROOT)) for path in _sources().values()}
    assert sorted(tree - named) == [], "modules docs/architecture.md does not place"
    assert sorted(named - tree) == [], "docs/architecture.md names modules that do not exist"


def test_no_module_imports_another_in_a_cycle() -> None:
    sources = _sources()
    graph = nx.DiGraph()
    for name, path in sources.items():
        graph.add_node(name)
        for imported in _imports(path, inside_functions=False, modules=set(sources)):
            if imported in sources and imported != name:
                graph.add_edge(name, imported)
    # A package's __init__ importing its own submodules is how it re-exports them; a cycle
    # through the package itself is one only if a submodule imports the package back.
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles[:3]}"


LAYERS: tuple[tuple[str, ...], ...] = (
    ("fxpar.errors", "fxpar.cluster"),
    ("fxpar.ir",),
    ("fxpar.sharding", "fxpar.rules"),
    ("fxpar.solvers",),
    ("fxpar.planning",),
    ("fxpar.passes",),
    ("fxpar.lowering",),
    (
        "fxpar.optim",
        "fxpar.checkpoint_objects",
        "fxpar.checkpoint_reader",
        "fxpar.checkpoint",
        "fxpar.runtime",
    ),
    ("fxpar.pipeline",),
    ("fxpar.driver", "fxpar.joint"),
    ("fxpar.compiler",),
    ("fxpar.models", "fxpar.testing", "fxpar.cli", "fxpar.__main__"),
)
"""The stages of docs/architecture.md, in order: a package may import its own layer's earlier
packages and any earlier layer's, never a later one (``fxpar`` itself, the public API, imports
everything)."""


def _package(module: str) -> str:
    """The package (or top-level module) of ``module``: ``fxpar.planning.cost`` is in
    ``fxpar.planning``, ``fxpar.driver`` is its own."""
    return ".".join(module.split(".")[:2])


def _package_imports() -> dict[tuple[str, str], list[str]]:
    """Every import between two packages, as (importer, imported): the module pairs."""
    sources = _sources()
    found: dict[tuple[str, str], list[str]] = {}
    for name, path in sources.items():
        if name == "fxpar":
            continue
        for imported in _imports(path, inside_functions=False, modules=set(sources)):
            edge = (_package(name), _package(imported))
            if imported in sources and edge[0] != edge[1]:
                found.setdefault(edge, []).append(f"{name} -> {imported}")
    return found


def test_no_package_imports_another_in_a_cycle() -> None:
    graph = nx.DiGraph(list(_package_imports()))
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"package cycles: {cycles[:3]}"


def test_packages_import_only_down_the_stages() -> None:
    order = [package for layer in LAYERS for package in layer]
    packages = {_package(name) for name in _sources()} - {"fxpar"}
    assert sorted(packages - set(order)) == [], "packages LAYERS does not place"
    rank = {package: index for index, package in enumerate(order)}
    upward = {
        edge: modules[:3]
        for edge, modules in _package_imports().items()
        if rank[edge[1]] > rank[edge[0]]
    }
    assert upward == {}, "imports of a later stage"


def test_no_import_hides_in_a_function() -> None:
    """A dependency is visible at the top of the module that has it: imports inside functions
    hid the cycles this layout removed. fxpar/__init__.py's lazy ``testing`` (it needs the
    test extra) is the exception, and it goes through importlib."""
    sources = _sources()
    hidden = {
        name: sorted(_imports(path, inside_functions=True, modules=set(sources)))
        for name, path in sources.items()
    }
    assert {name: found for name, found in hidden.items() if found} == {}


MAKERS: dict[str, str] = {
    "capture": "captures",
    "capture_repeated": "captures",
    "capture_microbatch": "captures",
    "microbatch_step": "captures",
    "plan_program": "plans",
    "plan_stages": "plans",
    "search_pipelines": "plans",
    "evaluate_split": "plans",
    "split_program": "lowers",
    "lower": "lowers",
    "lower_graph": "lowers",
    "conversion_program": "lowers",
    "Driver": "lowers",
}
"""The functions that capture a step, plan one (the pass list, the stage DP) or lower one (SPMD
lowering, cutting stages), and what importing each one makes a module do."""

OWNERS: dict[str, frozenset[str]] = {
    # Capture: a model to a Program.
    "fxpar.ir.repeat": frozenset({"captures"}),
    # The driver and the public entry points built on it.
    "fxpar.driver": frozenset({"captures", "plans", "lowers"}),
    "fxpar.compiler": frozenset({"captures", "plans", "lowers"}),
    "fxpar.cli": frozenset({"captures", "plans"}),
    "fxpar.joint": frozenset({"captures", "plans"}),
    # Choosing a pipeline (the stage DP over a captured step) and cutting and lowering stages.
    "fxpar.pipeline.stage_programs": frozenset({"captures", "plans", "lowers"}),
    "fxpar.pipeline.intra_op": frozenset({"lowers"}),
    # A runtime object that still captures and cuts the steps it runs: issue 60, item 3 moves
    # that into the driver, and then this row goes.
    "fxpar.pipeline.model": frozenset({"captures", "lowers"}),
}
"""Who may capture, plan and lower (docs/architecture.md, "Who owns what"): every other module
of the package only uses what those hand it. A package's ``__init__`` re-exporting a maker is
not counted (it runs nothing)."""


def test_only_the_owners_capture_plan_or_lower() -> None:
    """Over the whole package (pipeline/ included), a module that imports a maker of
    :data:`MAKERS` owns that role in :data:`OWNERS`; and every owner listed still does (a row
    left behind after a move would hide the next module that starts capturing)."""
    sources = _sources()
    done: dict[str, set[str]] = {}
    for name, path in sources.items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fxpar")
            for alias in node.names
        }
        roles = {MAKERS[maker] for maker in imported & set(MAKERS)}
        if roles:
            done[name.replace("fxpar.passes.", "passes.").replace("fxpar.solvers.", "solvers.")] = (
                roles
            )
    trespassing = {
        name: sorted(roles - OWNERS.get(name, frozenset()))
        for name, roles in done.items()
        if roles - OWNERS.get(name, frozenset())
    }
    assert trespassing == {}, "modules that capture, plan or lower without owning it"
    idle = {name: sorted(roles - done.get(name, set())) for name, roles in OWNERS.items()}
    assert {name: roles for name, roles in idle.items() if roles} == {}, "owners that no longer do"
    # fxpar/runtime/ and the pipeline's executor run what the driver hands them.
    runners = [
        name for name in OWNERS if name.startswith(("fxpar.runtime", "fxpar.pipeline.executor"))
    ]
    assert runners == []
