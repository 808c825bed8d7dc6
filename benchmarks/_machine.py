"""A description of the machine a result was measured on."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def describe() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]
        if Path("/proc/loadavg").exists()
        else None,
    }
