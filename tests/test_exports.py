"""Package boundaries: what each package exports, and who may import its private modules.

Like trio's own ``test_exports``: a package's implementation lives in private ``_name``
modules and is reached through the names its ``__init__`` re-exports. Only the package
itself (and its own tests, which mirror it) may import a private module; everyone else
imports the package. A test here fails naming the file and the import that crosses.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import pool

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(f"pool.{m.name}" for m in pkgutil.iter_modules(pool.__path__) if m.ispkg)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from pool.actors import _model` reaches a private module too.
            found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found


def _private_owner(module: str) -> str | None:
    """The package whose private module ``module`` is, if it names one."""
    parts = module.split(".")
    for depth in range(2, len(parts)):
        if parts[depth].startswith("_") and not parts[depth].startswith("__"):
            return ".".join(parts[:depth])
    return None


def _allowed_owner(path: Path) -> str | None:
    """The package a file may reach into: its own (``pool/x/...``, ``tests/x/...``)."""
    relative = path.relative_to(ROOT).parts
    if relative[0] in ("pool", "tests") and len(relative) > 2:
        return f"pool.{relative[1]}"
    return None  # top-level modules of pool/, benchmarks/: public names only


def test_no_file_imports_another_packages_private_module() -> None:
    crossings = []
    files = [*ROOT.glob("pool/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    for path in files:
        allowed = _allowed_owner(path)
        seen = set()
        for line, module in _imported_modules(path):
            owner = _private_owner(module) if module.startswith("pool.") else None
            if owner is None or (allowed and (owner + ".").startswith(allowed + ".")):
                continue
            if (line, owner) not in seen:
                seen.add((line, owner))
                crossings.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not crossings, "\n".join(crossings)


def _defined_privately(package: str, module: str) -> bool:
    """Whether ``module`` is one of ``package``'s private modules, those of its own
    sub-packages included (``pool.actors.models._model``), not another package's."""
    rest = module.removeprefix(f"{package}.")
    if rest == module:
        return False
    head = rest.split(".")[0]
    return head.startswith("_") or (f"{package}.{head}" not in PACKAGES and "._" in f".{rest}")


@pytest.mark.parametrize("name", ["pool", *PACKAGES])
def test_all_lists_what_the_package_exports(name: str) -> None:
    package = importlib.import_module(name)
    exported = getattr(package, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert sorted(set(exported)) == sorted(exported), f"{name}.__all__ repeats a name"
    for symbol in exported:
        assert hasattr(package, symbol), f"{name}.__all__ names {symbol!r}, which is missing"
    public = {
        symbol
        for symbol, value in vars(package).items()
        if not symbol.startswith("_") and _defined_privately(name, getattr(value, "__module__", ""))
    }
    assert public <= set(exported), f"{name} re-exports {sorted(public - set(exported))} unlisted"


def test_the_boundary_check_sees_a_crossing() -> None:
    # The rule itself: a private module of another package is refused, one's own is not.
    assert _private_owner("pool.actors._model") == "pool.actors"
    assert _private_owner("pool.actors") is None
    assert _private_owner("pool.actors.__init__") is None
    assert _allowed_owner(ROOT / "pool/http/_app.py") == "pool.http"
    assert _allowed_owner(ROOT / "tests/actors/test_scheduler.py") == "pool.actors"
    assert _allowed_owner(ROOT / "benchmarks/harness.py") is None


def test_wire_schemas_import_no_actor() -> None:
    """A wire shape knows no actor: nothing in pool/schemas imports from pool/actors."""
    crossings = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in ROOT.glob("pool/schemas/**/*.py")
        for line, module in _imported_modules(path)
        if module == "pool.actors" or module.startswith("pool.actors.")
    ]
    assert not crossings, "\n".join(crossings)
