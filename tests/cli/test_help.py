"""Every ``--help`` of ``llm-pool`` reads as plain text: no reStructuredText markup
(double backquotes) from docstrings reaches the user."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pool.cli import main
from pool.cli._main import _parser

ROOT = Path(__file__).resolve().parents[2]


def command_paths(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """The argv prefix of every command and sub-command of ``parser``, itself first."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias is the same parser
                    seen.add(id(sub))
                    yield from command_paths(sub, (*path, name))


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main([*argv, "--help"])
    except SystemExit as exc:  # pool.convert's own parser exits itself
        code = exc.code
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    return out


def test_no_help_shows_double_backquotes(capsys: pytest.CaptureFixture[str]) -> None:
    paths = list(command_paths(_parser()))
    # Not vacuous: the walk found the top level, the server commands, the client
    # commands and the lease actions.
    assert {(), ("serve",), ("convert",), ("ps",), ("lease",), ("lease", "acquire")} <= set(paths)
    texts = {" ".join(path) or "llm-pool": help_of(list(path), capsys) for path in paths}
    assert "exit codes" in texts["llm-pool"].lower()
    # convert's help is its own parser's, not a pointer back to itself.
    assert "--quantization" in texts["convert"]
    marked = {name: [line for line in text.splitlines() if "``" in line]
              for name, text in texts.items()}  # fmt: skip
    assert {name: found for name, found in marked.items() if found} == {}


def test_convert_help_of_its_own_parser_is_plain() -> None:
    # ``llm-pool convert`` hands its arguments to pool.convert's own parser; run it as
    # the user does, through the real entry point.
    ran = subprocess.run(
        [sys.executable, "-m", "pool", "convert", "ct2", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert "--quantization" in ran.stdout
    assert "``" not in ran.stdout
