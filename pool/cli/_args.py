"""What every ``llm-pool`` parser shares: a usage error in one line, numbers above 0."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from pool.cli._client import EXIT_USAGE


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (argparse's own prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see: {self.prog} --help)\n")


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number above 0 (``-n 0`` would report on no request at all)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse
