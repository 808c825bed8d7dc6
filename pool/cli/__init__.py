"""``llm-pool`` (and ``python -m pool``): serve the pool, run a tool, or steer a running pool."""

from pool.cli._args import Parser
from pool.cli._logs import JsonFormatter, configure_logging
from pool.cli._main import main, run_command

__all__ = ["JsonFormatter", "Parser", "configure_logging", "main", "run_command"]
