"""A wheel of this checkout holds all of fxpar and nothing else, and works on its own.

pyproject.toml maps passes/ to ``fxpar.passes`` and solvers/ to ``fxpar.solvers``, and lists
every package by hand: a package left out of that list is left out of the wheel. The editable
install (``pip install -e .``) cannot show such a gap: its finder, which a ``.pth`` file in
site-packages installs at startup, serves every ``fxpar`` module straight from the checkout it
was made from. So the installed wheel is imported by an interpreter started with ``-I -S``: no
``.pth`` file runs, no ``PYTHONPATH`` or user site is read, and ``sys.path`` is the install,
then the standard library, then this interpreter's site-packages directories (for torch, highspy
and the other dependencies, which the wheel does not bring).

The wheel is built from a copy of the checkout: an in-tree build writes build/ and *.egg-info
into the source tree.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Where each source directory's files go in the wheel (pyproject's package-dir).
PACKAGE_OF_SOURCE = {"fxpar": "fxpar", "passes": "fxpar/passes", "solvers": "fxpar/solvers"}

# Every package of fxpar, the two mapped ones first.
PARTS = (
    "fxpar", "fxpar.passes", "fxpar.solvers", "fxpar.testing", "fxpar.ir", "fxpar.planning",
    "fxpar.lowering", "fxpar.sharding", "fxpar.runtime", "fxpar.pipeline", "fxpar.rules",
    "fxpar.models",
)  # fmt: skip

# Not part of a checkout's sources: git's store, build outputs and tool caches.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".benchmarks"
)

# Run by an interpreter started with -I -S, given the parts (comma-separated), the install and
# the dependency directories as arguments: imports every part, uses the passes and the solvers,
# and checks that every fxpar module it loaded comes from the install.
CHECK = """
import sys

part_names, install, *dependencies = sys.argv[1:]
sys.path.insert(0, install)
sys.path.extend(dependencies)

import importlib

for name in part_names.split(","):
    importlib.import_module(name)

from fxpar.passes import default_passes
from fxpar.solvers import Edge, ExhaustiveSolver, ILPSolver, IntraOpProblem

assert "annotate-cost" in default_passes().names, default_passes().names
tiny = IntraOpProblem(
    node_costs=((1.0, 2.0), (3.0, 1.0)),
    node_memory=((0.0, 0.0), (0.0, 0.0)),
    edges=(Edge(0, 1, ((0.0, 5.0), (5.0, 0.0))),),
)
for solver in (ExhaustiveSolver(), ILPSolver()):
    assert solver.solve(tiny).choice == (1, 1), solver

finders = [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path]
assert not any("Editable" in name for name in finders), finders
assert not any(name.startswith("__editable__") for name in sys.modules)
loaded = {
    name: getattr(module, "__file__", None)
    for name, module in sys.modules.items()
    if name == "fxpar" or name.startswith("fxpar.")
}
elsewhere = {n: f for n, f in loaded.items() if not (f or "").startswith(install + "/")}
assert not elsewhere, f"fxpar modules not from {install}: {elsewhere}"
print(len(loaded), "fxpar modules, all from the install")
"""


def copy_of_checkout(destination: Path) -> Path:
    shutil.copytree(ROOT, destination, ignore=NOT_SOURCES)
    return destination


def build_wheel(source: Path, out: Path) -> Path:
    """The wheel pip builds from ``source``, without the network or build isolation (the
    build uses this environment's setuptools)."""
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--no-index", "--quiet", "--wheel-dir", str(out), str(source)]  # fmt: skip
    run = subprocess.run(pip_wheel, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = out.glob("fxpar-*.whl")
    return wheel


def install_wheel(wheel: Path, target: Path) -> Path:
    pip_install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                   "--target", str(target), str(wheel)]  # fmt: skip
    run = subprocess.run(pip_install, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return target


def expected_modules(source: Path) -> set[str]:
    """Where every .py file of the checkout's three source directories belongs in a wheel."""
    return {
        f"{package}/{path.relative_to(source / directory).as_posix()}"
        for directory, package in PACKAGE_OF_SOURCE.items()
        for path in (source / directory).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def wheel_modules(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if name.endswith(".py")}


def top_level_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name.split("/")[0] for name in archive.namelist()}


def dependency_directories() -> list[str]:
    """This interpreter's site-packages directories, where the dependencies are installed."""
    return [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")]


def run_check(install: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """CHECK in an interpreter that sees only ``install`` and the dependencies: -I ignores
    PYTHONPATH and the user site, -S runs no .pth file (so no editable install's finder)."""
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", CHECK, ",".join(PARTS),
         str(install), *dependency_directories()],
        capture_output=True, text=True, cwd=cwd, timeout=300, check=False,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A copy of the checkout, and the wheel built from it."""
    source = copy_of_checkout(tmp_path_factory.mktemp("checkout") / "fxpar")
    return source, build_wheel(source, tmp_path_factory.mktemp("wheel"))


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_checkout_under_fxpar(
    built: tuple[Path, Path],
) -> None:
    """Every .py file under fxpar/, passes/ and solvers/ is in the wheel, under fxpar/, and the
    wheel holds no other module and nothing at the top level but fxpar and its metadata."""
    source, wheel = built
    expected, found = expected_modules(source), wheel_modules(wheel)
    assert expected - found == set(), "missing from the wheel: list their packages in pyproject"
    assert found - expected == set(), "in the wheel but not in the checkout"
    assert {f"fxpar/{part}/__init__.py" for part in ("passes", "solvers")} <= found
    metadata = {
        name for name in top_level_names(wheel) if re.fullmatch(r"fxpar-.+\.dist-info", name)
    }
    assert top_level_names(wheel) - metadata == {"fxpar"} and len(metadata) == 1


@pytest.mark.slow
def test_the_installed_wheel_works_without_the_checkout(
    built: tuple[Path, Path], tmp_path: Path
) -> None:
    """Installed into a bare directory, the wheel gives every part of fxpar (and no top-level
    passes or solvers), and the passes and the solvers work, with no module coming from this
    checkout or its editable install."""
    target = install_wheel(built[1], tmp_path / "site")
    installed = {path.name for path in target.iterdir()} - {"bin"}  # bin/: the fxpar script
    assert {name for name in installed if not name.endswith(".dist-info")} == {"fxpar"}
    run = run_check(target, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("fxpar modules, all from the install"), run.stdout


@pytest.mark.slow
def test_a_package_left_out_of_pyproject_fails_both_checks(tmp_path: Path) -> None:
    """The two checks above can fail: with ``fxpar.ir`` taken out of a copy's package list,
    the wheel lacks fxpar/ir/ and its install does not import (while an editable install of
    this checkout, if the check could see it, would serve fxpar.ir from here)."""
    source = copy_of_checkout(tmp_path / "checkout")
    pyproject = source / "pyproject.toml"
    text, count = re.subn(r'"fxpar\.ir",\s*', "", pyproject.read_text())
    assert count == 1, "pyproject's package list no longer names fxpar.ir as this test expects"
    pyproject.write_text(text)
    wheel = build_wheel(source, tmp_path / "wheel")
    missing = expected_modules(source) - wheel_modules(wheel)
    assert missing and all(name.startswith("fxpar/ir/") for name in missing), missing
    run = run_check(install_wheel(wheel, tmp_path / "site"), tmp_path)
    assert run.returncode != 0
    # ModuleNotFoundError, or ImportError for a ``from fxpar import ir``.
    assert re.search(r"No module named 'fxpar\.ir'|cannot import name 'ir'", run.stderr), run.stderr
