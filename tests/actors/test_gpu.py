"""The NVML monitor at its boundary: the real reading code over a fake ``pynvml``.

``tests/actors/fake_pynvml.py`` plays NVML (two GPUs, processes, errors); ``read_gpus``,
``process_tree`` and ``GpuMonitor`` are the real ones, and the pool's processes are real
processes of this test. The last tests hold the fake to the installed nvidia-ml-py and
read the real NVML of this machine.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from pool.actors import GpuMonitor
from pool.actors.residency._gpu import NO_NVIDIA_GPU, process_tree, read_gpus
from tests.actors import fake_pynvml as fake
from tests.actors.fake_pynvml import FakeDevice, FakeMachine, FakeProcess

GPU_SOURCE = Path(__file__).resolve().parents[2] / "pool" / "actors" / "residency" / "_gpu.py"
# A pid no process can have (above the kernel's largest pid_max, 2**22): NVML of the
# host shows it to a container that cannot see it.
UNSEEN_PID = 2**22 + 1


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> FakeMachine:
    return fake.install(monkeypatch, fake.two_gpus())


@pytest.fixture
async def server_under_a_guard() -> AsyncIterator[tuple[trio.Process, int]]:
    """A child of the test that starts a grandchild and prints its pid: the shape of a
    managed server (the pool starts a guard, the guard starts the server)."""
    script = (
        "import subprocess, sys\n"
        "server = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
        " stdin=subprocess.PIPE)\n"
        "print(server.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "server.kill(); server.wait()\n"
    )
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        output = b""
        with trio.fail_after(30):
            while not output.endswith(b"\n"):
                chunk = await process.stdout.receive_some()
                assert chunk, "the guard exited before it started its server"
                output += chunk
        yield process, int(output)
    finally:
        with trio.move_on_after(10, shield=True):
            await process.stdin.aclose()
            await process.wait()
        if process.returncode is None:
            process.kill()


async def test_two_gpus_with_the_pools_processes_and_another_users(
    machine: FakeMachine, server_under_a_guard: tuple[trio.Process, int]
) -> None:
    guard, server = server_under_a_guard
    assert {guard.pid, server} <= process_tree(os.getpid())
    h100, l4 = machine.devices
    h100.processes = [
        FakeProcess(os.getpid(), 1000),  # the pool itself (an in-process runtime)
        FakeProcess(server, 6000),  # its managed server, a grandchild
        FakeProcess(1, 3000),  # another user's process
    ]
    l4.processes = [FakeProcess(UNSEEN_PID, 2000)]  # someone else's, pid not in our view
    readings = await trio.to_thread.run_sync(read_gpus)
    assert [(g.index, g.name, g.total_mib) for g in readings] == [
        (0, "NVIDIA H100 80GB HBM3", 81559),
        (1, "NVIDIA L4", 23034),
    ]
    assert readings[0].used_mib == 500 + 1000 + 6000 + 3000
    assert readings[0].pool_used_mib == 1000 + 6000  # ours only, other users' not
    assert readings[0].utilization == pytest.approx(0.03)
    assert readings[1].used_mib == 300 + 2000
    assert readings[1].pool_used_mib is None  # none of ours: unknown, not zero
    assert readings[1].utilization is None  # NotSupported on this board
    assert machine.initialized == 0  # every nvmlInit was shut down


async def test_a_process_whose_memory_nvml_cannot_tell_counts_nothing(
    machine: FakeMachine,
) -> None:
    machine.devices[0].processes = [FakeProcess(os.getpid(), None), FakeProcess(1, 700)]
    readings = await trio.to_thread.run_sync(read_gpus)
    assert readings[0].pool_used_mib == 0 and readings[0].used_mib == 500 + 700


async def test_an_nvml_error_mid_run_empties_the_view_until_nvml_answers_again(
    machine: FakeMachine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pool.gpu")
    async with trio.open_nursery() as nursery:
        monitor: GpuMonitor = await nursery.start(GpuMonitor(interval_s=0.05).run)
        assert [g.name for g in monitor.view().gpus] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
        assert monitor.view().error is None

        machine.device_error = fake.NVML_ERROR_GPU_IS_LOST
        await monitor.refresh()  # what the pool does around a load
        view = monitor.view()
        assert view.gpus == () and view.error == "no GPU information (NVML: GPU is lost)"
        assert machine.initialized == 0
        lost = [r for r in caplog.records if "GPU is lost" in r.getMessage()]
        assert [r.levelno for r in lost] == [logging.WARNING]

        # The polling loop goes on through the error and finds the GPUs again.
        machine.device_error = None
        with trio.fail_after(10):
            while not monitor.view().gpus:
                await trio.sleep(0.02)
        assert monitor.view().error is None and len(monitor.view().gpus) == 2
        assert any("reading 2 GPU(s) again" in r.getMessage() for r in caplog.records)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("init_error", "devices", "said"),
    [
        (fake.NVML_ERROR_LIBRARY_NOT_FOUND, None, "(NVML: NVML Shared Library Not Found)"),
        (fake.NVML_ERROR_DRIVER_NOT_LOADED, None, "(NVML: Driver Not Loaded)"),
        (None, [], "(NVML lists no device)"),
    ],
)
async def test_a_machine_without_an_nvidia_gpu_is_said_plainly(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    init_error: int | None,
    devices: list[FakeDevice] | None,
    said: str,
) -> None:
    fake.install(monkeypatch, FakeMachine(devices or [], init_error=init_error))
    caplog.set_level(logging.INFO, logger="pool.gpu")
    async with trio.open_nursery() as nursery:
        monitor: GpuMonitor = await nursery.start(GpuMonitor().run)
    # run() returned: nothing to poll on this machine.
    assert monitor.view().gpus == ()
    assert monitor.view().error == f"no NVIDIA GPU found: models run on the CPU {said}"
    # A CPU machine is normal: said once, not as a warning.
    assert [r.levelno for r in caplog.records if said in r.getMessage()] == [logging.INFO]


async def test_other_nvml_errors_say_there_is_no_gpu_information(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A container that was not given the GPU devices.
    fake.install(monkeypatch, FakeMachine(init_error=fake.NVML_ERROR_NO_PERMISSION))
    monitor = GpuMonitor()
    await monitor.refresh()
    said = "no GPU information (NVML: Insufficient Permissions)"
    assert monitor.view().gpus == () and monitor.view().error == said
    assert [r.levelno for r in caplog.records if said in r.getMessage()] == [logging.WARNING]


def _count_as_text() -> str:
    return "2"


@pytest.mark.parametrize(
    ("name", "replacement", "kind"),
    [
        # An API change: a function renamed away, a return type changed.
        ("nvmlDeviceGetUtilizationRates", None, "AttributeError"),
        ("nvmlDeviceGetCount", _count_as_text, "TypeError"),
    ],
)
async def test_an_api_change_is_a_loud_failure_not_a_machine_without_gpus(
    machine: FakeMachine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    name: str,
    replacement: object,
    kind: str,
) -> None:
    if replacement is None:
        monkeypatch.delattr(fake, name)
    else:
        monkeypatch.setattr(fake, name, replacement)
    monitor = GpuMonitor()
    for _ in range(2):
        await monitor.refresh()
    error = monitor.view().error
    assert error is not None and error.startswith(f"GPU monitor failed: {kind}: ")
    assert "no GPU information" not in error and NO_NVIDIA_GPU not in error
    assert monitor.view().gpus == ()
    # Logged as an error with its traceback, once while it repeats.
    (record,) = [r for r in caplog.records if r.name == "pool.gpu"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.exc_info[0] is not None and record.exc_info[0].__name__ == kind


def _real_pynvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The installed nvidia-ml-py, loaded from its file even where the fake stands in."""
    spec = importlib.machinery.PathFinder.find_spec("pynvml")
    assert spec is not None and spec.origin, "nvidia-ml-py is a dependency of the pool"
    spec = importlib.util.spec_from_file_location("real_pynvml", spec.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # The module registers its error classes on sys.modules[__name__] while it loads.
    monkeypatch.setitem(sys.modules, "real_pynvml", module)
    spec.loader.exec_module(module)
    return module


def _fields(structure: type[ctypes.Structure]) -> list[tuple[str, object]]:
    return [(entry[0], entry[1]) for entry in structure._fields_]


def test_the_fake_follows_the_real_module(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _real_pynvml(monkeypatch)
    # Every name the pool's reading code uses is in both.
    used = set(re.findall(r"pynvml\.(\w+)", GPU_SOURCE.read_text()))
    assert used and not {n for n in used if not hasattr(fake, n)}
    assert not {n for n in used if not hasattr(real, n)}
    # The functions, with the same parameters.
    for name in [n for n in vars(fake) if n.startswith("nvml") and callable(getattr(fake, n))]:
        if name == "nvmlFriendlyObject":
            continue
        ours = list(inspect.signature(getattr(fake, name)).parameters)
        theirs = list(inspect.signature(getattr(real, name)).parameters)
        assert ours == theirs, name
    # The error codes, their classes and their texts.
    for name in [n for n in vars(fake) if n.startswith("NVML_ERROR_")]:
        code = getattr(fake, name)
        assert getattr(real, name) == code, name
        error = real.NVMLError(code)
        assert type(error).__name__ == type(fake.NVMLError(code)).__name__
        assert isinstance(error, getattr(real, type(error).__name__))
        assert str(error) == str(fake.NVMLError(code))
    assert issubclass(real.NVMLError_LibraryNotFound, real.NVMLError)
    assert not issubclass(real.NVMLLibraryMismatchError, real.NVMLError)
    # The structures the calls return.
    assert _fields(fake.c_nvmlMemory_t) == _fields(real.c_nvmlMemory_t)
    assert _fields(fake.c_nvmlUtilization_t) == _fields(real.c_nvmlUtilization_t)
    # nvmlDeviceGetComputeRunningProcesses reads c_nvmlProcessInfo_v3_t into friendly objects.
    assert _fields(fake.c_nvmlProcessInfo_v2_t) == _fields(real.c_nvmlProcessInfo_v3_t)
    made = real.nvmlStructToFriendlyObject(real.c_nvmlProcessInfo_v3_t(pid=7))
    fake.install(monkeypatch, FakeMachine([FakeDevice("x", 10, processes=[FakeProcess(7, 1)])]))
    fake.nvmlInit()
    (listed,) = fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(0))
    fake.nvmlShutdown()
    assert set(vars(listed)) == set(vars(made))
    assert type(made).__name__ == type(listed).__name__ == "nvmlFriendlyObject"


def _nvml_library_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


async def test_the_real_nvml_of_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed nvidia-ml-py, no fake: GPUs, or the plain reason for none."""
    monkeypatch.setitem(sys.modules, "pynvml", _real_pynvml(monkeypatch))
    monitor = GpuMonitor()
    await monitor.refresh()
    view = monitor.view()
    if _nvml_library_loads():
        assert bool(view.gpus) != bool(view.error), view.error
        assert view.error is None or not view.error.startswith("GPU monitor failed"), view.error
    else:
        assert view.gpus == ()
        assert view.error == f"{NO_NVIDIA_GPU} (NVML: NVML Shared Library Not Found)"
