"""The boundary between the model actor and the residency owner (issue #43): the actor
reports facts and carries out loads and unloads; every residency number lives in the
owner's record of the model (``_residence.py``), so the actor imports none of its
modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pool.actors

ACTORS = Path(pool.actors.__file__).parent
# The residency side: the owner, its record per model, the planner and its arithmetic.
RESIDENCY_MODULES = {
    "_residency",
    "_residence",
    "_gate",
    "_planner",
    "_eviction",
    "_estimate",
    "_footprints",
    "_plan",
    "_vram",
    "_keep_alive",
    "_sleep",
    "_decisions",
    "_ledger",
}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_model_actor_imports_no_residency_module() -> None:
    crossing = sorted(
        module
        for module in _imports(ACTORS / "models" / "_model.py")
        if module.startswith("pool.actors.")
        and set(module.split(".")) & (RESIDENCY_MODULES | {"residency"})
    )
    assert crossing == []
