"""Components outside Python that the test command installs (scripts/test), and what a
test does when one is missing.

Under CI (``CI=true``) a missing component fails the test that needs it, naming it: a run
that could not install redis-server or chromium must not pass with the cluster or the
dashboard untested. Elsewhere (a developer's machine without root, say) the test skips,
and pytest's summary (``-ra``) says which component and how to get it.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"true", "1"}


def missing(component: str, provided_by: str) -> NoReturn:
    """Fail (under CI) or skip the current test: ``component`` is not there."""
    message = f"{component} is missing ({provided_by})"
    if in_ci():
        pytest.fail(f"{message}; CI=true requires it", pytrace=False)
    pytest.skip(message)
