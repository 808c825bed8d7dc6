"""A stand-in for the ``pynvml`` module (nvidia-ml-py) at the names the pool uses (tests only).

The machines that run the suite have no NVIDIA GPU, so the real module can only say
``NVMLError_LibraryNotFound``. Tests put this module in ``sys.modules["pynvml"]`` with a
:class:`FakeMachine` (:func:`install`); everything above that boundary (``read_gpus``,
``process_tree``, ``GpuMonitor``, ``serve``) is the real code. ``pytest -p
tests.nvml_box`` runs any test as on a machine with two NVIDIA GPUs.

The shapes follow nvidia-ml-py 13.615.71 (``pynvml.py`` of the wheel, line numbers of
that version); the API the pool uses is unchanged across 12.x and 13.x:

- ``nvmlInit()`` (3161) loads ``libnvidia-ml.so.1``; when it is missing it raises
  ``NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)`` (3192), a driver that is not loaded
  answers ``NVML_ERROR_DRIVER_NOT_LOADED``. ``nvmlShutdown()`` (3199).
- ``nvmlDeviceGetCount()`` (3372) returns an int; ``nvmlDeviceGetHandleByIndex(index)``
  (3379) an opaque handle.
- ``nvmlDeviceGetMemoryInfo(handle, version=None)`` (3993) returns a ``c_nvmlMemory_t``
  (1386: ``total``, ``free``, ``used`` in bytes).
- ``nvmlDeviceGetName(handle)`` (3431) returns ``str`` (``convertStrBytes`` decodes).
- ``nvmlDeviceGetUtilizationRates(handle)`` (4079) returns a ``c_nvmlUtilization_t``
  (1500: ``gpu``, ``memory`` in percent); boards without it raise
  ``NVMLError_NotSupported``.
- ``nvmlDeviceGetComputeRunningProcesses(handle)`` (4228, the ``_v3`` call, 4193)
  returns ``nvmlFriendlyObject``s (1145) with the fields of ``c_nvmlProcessInfo_v2_t``
  (1438: ``pid``, ``usedGpuMemory`` in bytes or None where NVML cannot tell,
  ``gpuInstanceId``, ``computeInstanceId``); an empty list when none runs. The pids are
  those of NVML's PID namespace, so a container may see none of its own.
- ``NVMLError(value)`` (1037) maps the code to its subclass ``NVMLError_<CamelName>``
  (1082-1106, e.g. ``NVMLError_LibraryNotFound``), ``str()`` is the code's text (1041);
  ``NVMLLibraryMismatchError`` (1033) is not an ``NVMLError``.

``tests/actors/test_gpu.py::test_the_fake_follows_the_real_module`` checks these names,
signatures, structure fields, error classes and texts against the installed module.
"""

from __future__ import annotations

import ctypes
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

MIB = 1024 * 1024

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999


class NVMLLibraryMismatchError(Exception):
    pass


class NVMLError(Exception):
    _valClassMapping: dict[int, type[NVMLError]] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, value: int) -> type[NVMLError]:
    def new(cls: type[NVMLError], *args: Any) -> NVMLError:
        return NVMLError.__new__(cls, value)

    made = type(name, (NVMLError,), {"__new__": new, "__module__": __name__})
    NVMLError._valClassMapping[value] = made
    return made


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _error_class(
    "NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND
)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_Unknown = _error_class("NVMLError_Unknown", NVML_ERROR_UNKNOWN)


class c_nvmlMemory_t(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class c_nvmlUtilization_t(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class c_nvmlProcessInfo_v2_t(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class nvmlFriendlyObject:
    def __init__(self, dictionary: dict[str, Any]) -> None:
        for key, value in dictionary.items():
            setattr(self, key, value)


@dataclass
class FakeProcess:
    """A compute process on one GPU; ``used_mib`` None where NVML cannot tell (WDDM)."""

    pid: int
    used_mib: int | None


@dataclass
class FakeDevice:
    name: str
    total_mib: int
    # Memory no listed process accounts for (the driver, graphics processes).
    other_used_mib: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    # Busy share in percent; None: the board does not report it (NotSupported).
    utilization_percent: int | None = None

    @property
    def used_mib(self) -> int:
        return self.other_used_mib + sum(p.used_mib or 0 for p in self.processes)


@dataclass
class FakeMachine:
    """What NVML sees: the devices, or why it cannot be read.

    ``init_error``: the NVML code ``nvmlInit`` fails with (no library, no driver).
    ``device_error``: the code every device call fails with (a GPU lost mid-run).
    """

    devices: list[FakeDevice] = field(default_factory=list)
    init_error: int | None = None
    device_error: int | None = None
    initialized: int = 0  # nvmlInit calls not yet matched by nvmlShutdown


@dataclass(frozen=True)
class _Handle:
    index: int


machine = FakeMachine()


def _device(handle: _Handle) -> FakeDevice:
    if not machine.initialized:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if machine.device_error is not None:
        raise NVMLError(machine.device_error)
    return machine.devices[handle.index]


def nvmlInit() -> None:
    if machine.init_error is not None:
        raise NVMLError(machine.init_error)
    machine.initialized += 1


def nvmlShutdown() -> None:
    if not machine.initialized:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    machine.initialized -= 1


def nvmlDeviceGetCount() -> int:
    if not machine.initialized:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if machine.device_error is not None:
        raise NVMLError(machine.device_error)
    return len(machine.devices)


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(index)


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> c_nvmlMemory_t:
    device = _device(handle)
    used = device.used_mib * MIB
    total = device.total_mib * MIB
    return c_nvmlMemory_t(total=total, free=total - used, used=used)


def nvmlDeviceGetName(handle: _Handle) -> str:
    return _device(handle).name


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> c_nvmlUtilization_t:
    device = _device(handle)
    if device.utilization_percent is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return c_nvmlUtilization_t(gpu=device.utilization_percent, memory=0)


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[nvmlFriendlyObject]:
    return [
        nvmlFriendlyObject(
            {
                "pid": p.pid,
                "usedGpuMemory": None if p.used_mib is None else p.used_mib * MIB,
                "gpuInstanceId": 0xFFFFFFFF,
                "computeInstanceId": 0xFFFFFFFF,
            }
        )
        for p in _device(handle).processes
    ]


def this_module() -> types.ModuleType:
    return sys.modules[__name__]


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeMachine) -> FakeMachine:
    """Make ``import pynvml`` give this module, reading ``fake``, for one test."""
    monkeypatch.setitem(sys.modules, "pynvml", this_module())
    monkeypatch.setattr(this_module(), "machine", fake)
    return fake


def two_gpus() -> FakeMachine:
    """What NVML shows on a two-GPU box with nothing of ours on it."""
    return FakeMachine(
        [
            FakeDevice("NVIDIA H100 80GB HBM3", 81559, other_used_mib=500, utilization_percent=3),
            FakeDevice("NVIDIA L4", 23034, other_used_mib=300),
        ]
    )
