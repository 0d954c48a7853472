"""megatron-core on a machine without CUDA: the few CUDA calls it makes on the paths the Megatron
backend runs, answered on the CPU, and a tripwire for any other (docs/trainer.md#megatron).

megatron-core assumes a GPU in a handful of places (the device of new tensors, its RNG tracker,
a synchronize after p2p, `device="cuda"` literals in two modules). Where `torch.cuda` has no
device, `apply()` answers those calls on the CPU, each logged once with its call site, and wraps
every other function of `torch.cuda` so that a call from megatron-core's code raises
`UncoveredCudaCall` naming the API and the line: a new CUDA assumption upstream fails loudly
instead of as torch's "not compiled with CUDA". With a CUDA device `apply()` does nothing.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

OWNER = "megatron"
"""Calls from modules under this package are the ones the patches answer or refuse."""
PASS_THROUGH = frozenset(
    {"is_available", "device_count", "is_initialized", "manual_seed", "manual_seed_all", "is_bf16_supported"}
)
"""torch.cuda functions whose CPU-only answers are already right (False, 0) or lazy and harmless."""


class UncoveredCudaCall(RuntimeError):
    """megatron-core called a CUDA API that the CPU patches do not answer."""


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_op(*_: Any, **__: Any) -> None:
    return None


def _cpu_rng_state(*_: Any, **__: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *_: Any, **__: Any) -> None:
    torch.set_rng_state(state)


ANSWERS: dict[str, Callable[..., Any]] = {
    "current_device": _cpu_device,
    "synchronize": _no_op,
    "empty_cache": _no_op,
    "get_rng_state": _cpu_rng_state,
    "set_rng_state": _set_cpu_rng_state,
}
"""torch.cuda functions megatron-core calls on the CPU paths, and their CPU answers."""
RNG_ANSWERS: dict[str, Callable[..., Any]] = {
    "_get_cuda_rng_state": _cpu_rng_state,
    "_set_cuda_rng_state": _set_cpu_rng_state,
}
"""megatron.core.tensor_parallel.random's own CUDA RNG helpers (they read torch.cuda's generators directly)."""
CUDA_LITERAL_MODULES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.transformer.utils")
"""The modules that make tensors with a `device="cuda"` literal (the schedules' token count, the
default causal mask)."""

GPU_PACKAGE_WARNINGS = (
    r"(Transformer Engine and )?Apex (is|are) not installed",
    r".*CUDA_DEVICE_MAX_CONNECTIONS",
)
"""megatron-core's warnings that a GPU-only package or setting is absent: on the CPU, not news."""

_applied: list[str] | None = None
_logged: set[str] = set()


def _caller_site(depth: int) -> tuple[str, str]:
    """The module name and `file:line` of the frame `depth` levels above the caller."""
    frame = sys._getframe(depth + 1)
    where = frame.f_code.co_filename.split("site-packages/")[-1]
    return frame.f_globals.get("__name__", ""), f"{where}:{frame.f_lineno}"


def _from_owner(module: str) -> bool:
    return module == OWNER or module.startswith(OWNER + ".")


def _answered(name: str, answer: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        module, site = _caller_site(1)
        if not _from_owner(module):
            return original(*args, **kwargs)
        if name not in _logged:
            _logged.add(name)
            log.info("no CUDA device: megatron-core's torch.cuda.%s (first at %s) answered on the CPU", name, site)
        return answer(*args, **kwargs)

    return call


def _refused(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        module, site = _caller_site(1)
        if not _from_owner(module):
            return original(*args, **kwargs)
        raise UncoveredCudaCall(
            f"megatron-core called torch.cuda.{name} at {site}, which the Megatron backend's CPU patches "
            "do not answer (there is no CUDA device here). This megatron-core version takes a CUDA path the "
            "pinned one did not: use the pinned megatron-core, or add an answer for it in "
            "trainer/megatron/cpu_patches.py"
        )

    return call


class _CpuFactories(types.ModuleType):
    """`torch` as one megatron module sees it: tensor factories given `device="cuda"` make CPU tensors."""

    FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange"})

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name not in self.FACTORIES:
            return value

        @functools.wraps(value)
        def make(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
                kwargs["device"] = "cpu"
                if (key := f"{name}(device='cuda')") not in _logged:
                    _logged.add(key)
                    log.info("no CUDA device: megatron-core's torch.%s(device='cuda') made on the CPU", name)
            return value(*args, **kwargs)

        return make


def apply() -> list[str]:
    """Patch the process for megatron-core without CUDA (idempotent); returns what was patched,
    [] where a CUDA device is present (nothing is touched there). Call it before importing
    megatron.core: the schedules' torch and the RNG helpers are replaced in their modules."""
    global _applied
    if _applied is not None:
        return _applied
    if torch.cuda.is_available():
        _applied = []
        return _applied
    for message in GPU_PACKAGE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    patched = []
    for name in dir(torch.cuda):
        original = getattr(torch.cuda, name)
        if name.startswith("_") or name in PASS_THROUGH or not isinstance(original, types.FunctionType):
            continue
        answer = ANSWERS.get(name)
        setattr(torch.cuda, name, _answered(name, answer, original) if answer else _refused(name, original))
        if answer:
            patched.append(f"torch.cuda.{name}")
    import megatron.core.tensor_parallel.random as tp_random

    for name, answer in RNG_ANSWERS.items():
        setattr(tp_random, name, answer)
        patched.append(f"{tp_random.__name__}.{name}")
    for name in CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = _CpuFactories()  # type: ignore[attr-defined]
        patched.append(f"{name}.torch")
    log.info("no CUDA device: megatron-core runs on the CPU with %d patches (%s)", len(patched), ", ".join(patched))
    _applied = patched
    return patched
