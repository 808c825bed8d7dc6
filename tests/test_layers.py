"""The layering rules of docs/architecture.md, kept: each is an import-linter contract in
pyproject.toml ``[tool.importlinter]`` (issue #43), run here by the environment's own
``lint-imports``. A broken contract fails the test named after it, and the message holds
import-linter's report: the import chain that crosses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.api import read_configuration

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"
CONTRACTS = {c["id"]: c["name"] for c in read_configuration(str(CONFIG))["contracts_options"]}

# The rules the issue names; dropping one from pyproject.toml is a test failure too.
RULES = {
    "actor-floors",  # serving > residency | accounting > models > values, no circles
    "models-residency",
    "wire-actors",
    "backends-serving",
    "config-backends",
    "runtime-http",
}


def test_every_rule_is_a_contract() -> None:
    assert not RULES - set(CONTRACTS), f"contracts missing: {sorted(RULES - set(CONTRACTS))}"


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
def test_contract_is_kept(contract: str) -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run(
        [str(lint_imports), "--config", str(CONFIG), "--contract", contract, "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        # The report wraps long lines at the terminal's width; a wide one keeps each whole.
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    # The report's part that names the crossing imports (the banner before it is noise).
    report = run.stdout[run.stdout.find("Broken contracts") :] or run.stdout
    assert run.returncode == 0, f"broken: {CONTRACTS[contract]}\n{report}{run.stderr}"
