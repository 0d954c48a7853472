"""trainer/megatron/cpu_patches.py: without CUDA, megatron-core's CUDA calls on the backend's paths
are answered on the CPU, each logged once; a call from megatron-core that the patches do not
cover fails naming the API and the line (a made-up call proves it); code outside megatron-core
keeps torch's own behaviour; with a CUDA device nothing is touched. Each case runs in a fresh
interpreter: the patches are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = """
import logging, sys, types
import torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
from trainer.megatron import cpu_patches

def megatron_function(source):
    # A function whose module is under megatron, as megatron-core's own code is.
    namespace = {"__name__": "megatron.core.made_up", "torch": torch}
    exec(compile(source, "megatron/core/made_up.py", "exec"), namespace)
    return namespace["call"]
"""


def run(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_covered_calls_are_answered_on_the_cpu_and_logged_once():
    proc = run("""
        patched = cpu_patches.apply()
        assert "torch.cuda.current_device" in patched and "torch.cuda.synchronize" in patched, patched
        call = megatron_function("def call():\\n    torch.cuda.synchronize()\\n    return torch.cuda.current_device()")
        assert call() == torch.device("cpu") and call() == torch.device("cpu")
        import megatron.core.pipeline_parallel.schedules as schedules
        assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
        print("OK")
    """)
    assert "Apex" not in proc.stderr, "megatron-core's warnings about GPU-only packages are silenced"
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("torch.cuda.current_device (first at megatron/core/made_up.py:3)") == 1, proc.stdout
    assert proc.stdout.count("torch.cuda.synchronize (first at") == 1, proc.stdout


def test_a_cuda_call_the_patches_do_not_cover_fails_naming_the_api_and_line():
    proc = run("""
        cpu_patches.apply()
        call = megatron_function("def call():\\n    return torch.cuda.memory_allocated()")
        try:
            call()
        except cpu_patches.UncoveredCudaCall as e:
            print("REFUSED", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED megatron-core called torch.cuda.memory_allocated at megatron/core/made_up.py:2" in proc.stdout
    assert "cpu_patches.py" in proc.stdout, "the message names where an answer goes"


def test_code_outside_megatron_keeps_torchs_own_behaviour():
    """The same call from outside megatron-core, in a fresh interpreter without and with the
    patches, fails the same way (torch's own error: "not compiled with CUDA" on the CPU build, "no
    NVIDIA driver" on a CUDA build without a GPU)."""
    call = """
        try:
            torch.cuda.current_device()
        except cpu_patches.UncoveredCudaCall:
            print("WRONG")
        except (AssertionError, RuntimeError) as e:
            print("TORCH", type(e).__name__, e)
        else:
            print("ANSWERED")
    """
    torchs = [line for line in run(call).stdout.splitlines() if line.startswith("TORCH ")]
    assert torchs, "torch itself refuses the call on a machine without CUDA"
    patched = run("cpu_patches.apply()\n" + textwrap.dedent(call))
    assert [
        line for line in patched.stdout.splitlines() if line.startswith(("TORCH ", "WRONG", "ANSWERED"))
    ] == torchs, patched.stdout + patched.stderr


def test_with_a_cuda_device_nothing_is_patched():
    proc = run("""
        original = torch.cuda.current_device
        torch.cuda.is_available = lambda: True  # as on a GPU machine
        assert cpu_patches.apply() == []
        assert torch.cuda.current_device is original
        import megatron.core.pipeline_parallel.schedules as schedules
        assert schedules.torch is torch
        print("UNTOUCHED")
    """)
    assert "UNTOUCHED" in proc.stdout, proc.stdout + proc.stderr
