"""Test support: a CPU device platform for verl 0.9.1, registered through verl's own registry.

verl resolves its device through `verl.plugin.platform.get_platform()`: the class registered
under the name in env `VERL_PLATFORM`. This module registers `CpuTestPlatform` as
`PLATFORM_NAME` ("cpu_test") when it is imported. Nothing of verl is copied or patched: it goes
through verl's public registry.

How it reaches every process: verl imports each module named in env `VERL_USE_EXTERNAL_MODULES`
at the end of `verl/__init__.py`, before any of its modules resolves the platform, so with

    PYTHONPATH=<repo>/tests
    VERL_USE_EXTERNAL_MODULES=support.verl.cpu_platform
    VERL_PLATFORM=cpu_test
    VERL_ENGINE_DEVICE=cuda

in the driver's environment before a local `ray.init`, every Ray worker that imports verl
registers the platform before using it. `VERL_ENGINE_DEVICE=cuda` is needed because verl registers
its FSDP engine for devices "cuda"/"npu" only (verl/workers/engine/fsdp/transformer_impl.py:1143);
`EngineRegistry.get_engine_cls` honours that variable when it picks an engine class and nothing
else in verl reads it.

The platform alone does not get verl's workers through `init_model`: verl's
`initialize_global_process_group_ray` asks torch for the backend "cpu:gloo,cpu:gloo", which torch
rejects. `VERL_CPU_TEST_PREINIT_GLOO=1` makes this module create the gloo group first inside verl's
Ray workers (see `maybe_preinit_gloo`); verl then skips its own initialisation.

`tests/support/verl/verl_run.py` runs verl's trainers on this platform.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu_test"
"""The name this module registers its platform under; set `VERL_PLATFORM` to it."""

DEVICE_NAME = "cpu"


# --------------------------------------------------------------------------------------------
# The device module: what verl calls on `get_torch_device()`
# --------------------------------------------------------------------------------------------


class CpuDeviceModule(types.ModuleType):
    """verl's device module on the cpu_test platform: `torch.cpu` where it has the function, and
    CPU answers for the rest of what verl calls on `get_torch_device()`.

    What verl 0.9.1 calls on it (grep for `get_torch_device()` and the modules that keep it in a
    local): empty_cache, synchronize, is_available, current_stream, stream, Stream, Event,
    set_device, device_count, mem_get_info, get_rng_state, set_rng_state,
    set_per_process_memory_fraction, ipc_collect, memory_allocated, memory_reserved,
    max_memory_allocated, max_memory_reserved, reset_peak_memory_stats,
    reset_accumulated_memory_stats, get_device_properties, get_device_name. It is a module of its
    own, not `torch.cpu`, because `torch.cpu` has no empty_cache, mem_get_info or memory counters;
    so verl's two `device == torch.cpu` special cases (utils/profiler/performance.py,
    utils/flops_counter.py) are not taken and the functions below answer for them. Not provided:
    `memory._record_memory_history` and friends, used only by verl's torch_memory profiler.
    """

    # Straight from torch.cpu: real CPU semantics (one device, synchronous execution).
    is_available = staticmethod(torch.cpu.is_available)  # True: the CPU is always there.
    is_initialized = staticmethod(torch.cpu.is_initialized)
    device_count = staticmethod(torch.cpu.device_count)  # 1.
    current_device = staticmethod(torch.cpu.current_device)  # "cpu": usable in .to(), torch.device().
    set_device = staticmethod(torch.cpu.set_device)  # No-op: there is one CPU device.
    synchronize = staticmethod(torch.cpu.synchronize)  # No-op: CPU ops finish before they return.
    Stream = torch.cpu.Stream
    Event = torch.cpu.Event
    StreamContext = torch.cpu.StreamContext
    current_stream = staticmethod(torch.cpu.current_stream)
    stream = staticmethod(torch.cpu.stream)

    # RNG: the CPU generator is the device's generator.
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)

    # Caching-allocator API: no cache to empty, no per-process fraction, no IPC handles to
    # collect, no peak statistics to reset.
    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def reset_accumulated_memory_stats(device: Any = None) -> None:
        return None

    # The caching allocator's byte counters: zero, CPU tensors do not go through one.
    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return 0

    # Device description: the host.
    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) like `torch.cuda.mem_get_info`, from the host's memory, so the "device
        memory used/total" that verl logs is the host's real usage and never negative."""
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        """The properties verl reads (`total_memory`, `name`), from the host."""
        return types.SimpleNamespace(name="CPU", total_memory=int(psutil.virtual_memory().total))

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        """What verl's own torch.cpu branch uses; verl's FLOPS table has a "CPU" entry (448e9), so
        its MFU metric stays finite."""
        return "CPU"

    @staticmethod
    def get_device_capability(device: Any = None) -> tuple[int | None, int | None]:
        return None, None


DEVICE_MODULE = CpuDeviceModule("support.verl.cpu_platform.device_module")


# --------------------------------------------------------------------------------------------
# The platform
# --------------------------------------------------------------------------------------------


@PlatformRegistry.register(platform=PLATFORM_NAME)
class CpuTestPlatform(PlatformBase):
    """verl's `PlatformBase` for plain CPU, for tests only.

    Each answer and why:

    * `device_name` "cpu": tensors, device meshes and autocast use the CPU device type.
    * `current_device()` "cpu" (a string, as `torch.cpu.current_device()` returns): verl uses it
      as `get_device_id()` in `.to(...)`, `torch.device(...)` and FSDP's `device_id`; an integer
      index would mean the current accelerator, and a CPU build of torch has none
      ("Cannot access accelerator device when none is available").
    * `communication_backend_name()` "gloo": torch's CPU backend. verl joins it into
      f"cpu:gloo,{device_name}:{backend}" = "cpu:gloo,cpu:gloo", which torch rejects as a duplicate
      device type; see `maybe_preinit_gloo`.
    * `ray_resource_name()` "GPU": verl's resource pools reserve `{"GPU": 1}` per worker, so they
      use the logical GPUs declared with `ray.init(num_gpus=...)`; no GPU is touched.
    * `visible_devices_envvar()` "CUDA_VISIBLE_DEVICES": Ray sets it for actors holding logical
      GPUs and verl only copies/reports it; a CPU build of torch ignores it.
    * `ray_noset_envvars()`: the CUDA one, matching the "GPU" resource (rollout servers only).
    * `is_ipc_supported()` False, `cudart()` None, `get_collective_module()` None: no CUDA.
    * Profiling hooks (`nvtx_range`, `profiler_start/stop`) are no-ops: there is no device
      profiler; the torch profiler records CPU ops without them.
    * `vendor_name` "cpu": with `VERL_ENGINE_DEVICE=cuda` the engine lookup tries ("cuda", "cpu"),
      finds nothing vendor-specific and falls back to the plain "cuda" registration.
    """

    @property
    def device_name(self) -> str:
        return DEVICE_NAME

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only chosen explicitly with VERL_PLATFORM.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        return DEVICE_NAME

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


# --------------------------------------------------------------------------------------------
# Opt-in: the default process group, initialised before verl tries to
# --------------------------------------------------------------------------------------------

PREINIT_GLOO_ENV = "VERL_CPU_TEST_PREINIT_GLOO"
"""Set to "1" to initialise the gloo process group at import in verl's Ray workers."""


def maybe_preinit_gloo() -> bool:
    """Initialise torch.distributed's default group on gloo in a verl worker process, if asked.

    verl's `initialize_global_process_group_ray` (verl/utils/distributed.py:89) builds the backend
    string `f"cpu:gloo,{device_name}:{backend}"`; with device "cpu" that is "cpu:gloo,cpu:gloo",
    which torch rejects ("Duplicate device type cpu"). It skips initialisation when a default group
    exists, so a group made here first (same RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT that verl's
    RayWorkerGroup puts in each worker's environment) lets verl go on. Runs only when
    `PREINIT_GLOO_ENV` is "1" and the process is a verl Ray worker (WG_BACKEND=ray with rank
    variables), so the driver and other actors are untouched. Returns whether it initialised.
    """
    if os.environ.get(PREINIT_GLOO_ENV) != "1" or os.environ.get("WG_BACKEND") != "ray":
        return False
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if any(k not in os.environ for k in needed):
        return False
    import datetime

    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    dist.init_process_group(
        backend="gloo",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=600),
        init_method=os.environ.get("DIST_INIT_METHOD"),
    )
    return True


PREINITIALISED_GLOO = maybe_preinit_gloo()
