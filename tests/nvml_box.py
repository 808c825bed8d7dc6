"""``pytest -p tests.nvml_box``: run tests as on a machine with two NVIDIA GPUs.

For the whole session ``import pynvml`` gives the fake of ``tests/actors/fake_pynvml.py``
reading :func:`~tests.actors.fake_pynvml.two_gpus`, so ``serve()`` finds GPUs the way it
would on a GPU box. A test that passes here and without the plugin does not depend on
the machine's GPUs. In-process only: a pool started as a subprocess reads the real NVML.
(Backends that probe NVML themselves, such as vLLM's platform detection, would believe it
too: run the tests of the pool's own GPU handling with it, not the real-engine ones.)
"""

from __future__ import annotations

import sys

import pytest

from tests.actors import fake_pynvml


def pytest_configure(config: pytest.Config) -> None:
    fake_pynvml.machine = fake_pynvml.two_gpus()
    sys.modules["pynvml"] = fake_pynvml.this_module()
