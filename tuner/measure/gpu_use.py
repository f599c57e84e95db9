"""Is the engine really on the GPU? Checked before measuring and again from every trial's own output.

A GPU rig whose engine runs on the CPU measures fine and crowns a CPU config: a CPU build (nvcc was not found
at build time), a CUDA build whose runtime found no usable device (llama.cpp logs ``ggml_cuda_init: failed to
initialize CUDA: <reason>`` in ``ggml_cuda_init`` and goes on with the CPU backend alone), or
``CUDA_VISIBLE_DEVICES`` hiding the card. When NVML lists a GPU and the user did not ask for the CPU
(``--device none``, llama.cpp's own spelling), each of these stops the run in one line with its cause and fix.

What the engine used is read from its own output: llama-bench's JSON ``gpu_info`` (``get_gpu_info`` lists the
GPU devices the backend registry holds; empty when there are none) and llama-server's load log: a ``CUDA0 ...
buffer size`` line for each buffer placed on the card (``llama_model::load_tensors`` and the KV cache), or the
device rows of its ``fit_memory_breakdown`` records, which it writes with ``--log-jsonl``. On an H100, llama-server
with ``--log-jsonl`` at its default verbosity wrote the records and no buffer line at all
(results/benchmarks/gpu-lease-1/), so the buffer lines alone refused every GPU trial.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tuner.core.config import LaunchConfig
from tuner.core.errors import CpuFallbackError
from tuner.core.machine_spec import Hardware
from tuner.engine import breakdown, build, runner
from tuner.engine.kinds import kind_by_name
from tuner.machine import hardware

CPU_DEVICE = "none"  # --device none: the CPU on purpose
_CUDA_INIT = re.compile(r"failed to initialize CUDA:\s*(.+)")
_GPU_BUFFER = re.compile(r"\b(?:CUDA|ROCm|Vulkan|Metal|SYCL)\d+\b[^\n\"]*buffer size")
_GPU_DEVICE = re.compile(r"^(?:CUDA|ROCm|Vulkan|Metal|SYCL)\d+$")


@dataclass(frozen=True, slots=True)
class Expectation:
    """What the run was told to expect: the GPU by name, or None (no GPU, or ``--device none``)."""

    gpu_name: str | None


_current = Expectation(None)


def expect(exp: Expectation) -> None:
    """Set what every later trial of this process is checked against (a run sets it once, before measuring)."""
    global _current
    _current = exp


def _visible_devices_cause() -> str | None:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    if value.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={value!r} hides every card from the engine"
    return None


def _cause_of(log: str) -> tuple[str, str]:
    """(cause, fix) for a CUDA build that found no device, from the engine's own log and the environment."""
    hidden = _visible_devices_cause()
    if hidden:
        return hidden, "unset CUDA_VISIBLE_DEVICES (or name the card's index)"
    found = _CUDA_INIT.search(log)
    reason = found.group(1).strip() if found else ""
    if "insufficient" in reason or "driver" in reason.lower():
        return (f"the CUDA runtime found no usable driver (llama.cpp: {reason!r}; NVML reports driver {_driver()})",
                "update the NVIDIA driver to one that supports the CUDA version the engine was built with, "
                "or rebuild with the toolkit your driver supports (`moe-tune engine install --backend cuda --force`)")
    if reason:
        return (f"the CUDA runtime found no device (llama.cpp: {reason!r})",
                "check that the card is visible (`nvidia-smi`), that CUDA_VISIBLE_DEVICES names it, and that "
                "/dev/nvidia* is readable by this user")
    return ("the engine lists no GPU device although NVML lists one",
            "run `moe-tune doctor` to see what the engine found, then `moe-tune engine install --backend cuda "
            "--force`")


def _driver() -> str:
    gpus = hardware.probe_gpus().gpus
    return gpus[0].driver_version if gpus else "none"


def preflight(loc: build.EngineLocation, hw: Hardware, device: str | None) -> Hardware:
    """Check, before measuring, that the engine can use the GPU the machine has; return the machine to plan for
    (CPU only with ``--device none``). Raises :class:`CpuFallbackError` naming the cause and the fix."""
    if device == CPU_DEVICE or not hw.has_gpu:
        expect(Expectation(None))
        return hw.cpu_only() if device == CPU_DEVICE else hw
    caps = build.capabilities(loc)
    if caps.backend == "cpu":
        raise CpuFallbackError(
            f"the engine at {loc.bin_dir} is a CPU build and this machine has an {hw.gpu_name}",
            "build the CUDA engine with `moe-tune engine install --backend cuda` (it finds nvcc on PATH, in "
            "CUDA_HOME/CUDA_PATH or /usr/local/cuda/bin), or point --llama-cpp-dir at a CUDA build")
    # Devices change with the driver and CUDA_VISIBLE_DEVICES: asked now, never from the capability cache.
    res = runner.run_process([str(loc.tool("llama-server")), "--list-devices"], timeout_s=60,
                             what="llama-server --list-devices", fix="rebuild with `moe-tune engine install --force`",
                             check=False)
    text = res.stdout + "\n" + res.stderr_tail
    gpus = [d for d in build.parse_devices(text) if not d.upper().startswith(("CPU", "BLAS", "RPC"))]
    if not gpus:
        raise CpuFallbackError(*_cause_of(text))
    expect(Expectation(hw.gpu_name))
    return hw


def check_bench(gpu_info: str | None, stderr_tail: str, cfg: LaunchConfig | None = None) -> None:
    """Stop when llama-bench ran with no GPU device while one is expected: ``gpu_info`` is its first JSON row's
    (empty: no GPU device), None when it wrote no row (the caller reports that failed run)."""
    exp = _current
    if exp.gpu_name is None or (cfg is not None and cfg.device == CPU_DEVICE) or gpu_info is None or gpu_info:
        return
    cause, fix = _cause_of(stderr_tail)
    raise CpuFallbackError(f"llama-bench ran on the CPU although an {exp.gpu_name} is expected ({cause})", fix)


def check_server(log: str, cfg: LaunchConfig) -> None:
    """Stop when llama-server placed no buffer on a GPU while one is expected (``-ngl 0`` asks for that, and so does
    an engine's bare launch where it offloads nothing unless told: ik_llama.cpp's, ``offloads_by_default``)."""
    exp = _current
    if exp.gpu_name is None or cfg.device == CPU_DEVICE or cfg.n_gpu_layers == 0:
        return
    if cfg.n_gpu_layers is None and not kind_by_name(cfg.engine).offloads_by_default:
        return
    if placed_on_gpu(log):
        return
    cause, fix = _cause_of(log)
    raise CpuFallbackError(f"llama-server put nothing on the GPU although an {exp.gpu_name} is expected ({cause})",
                           fix)


def placed_on_gpu(log: str) -> bool:
    """Did this llama-server log place anything on a GPU: a GPU buffer line, or a GPU device row holding memory in
    its last ``fit_memory_breakdown`` record (the one at exit; a killed server's last projection)?"""
    if _GPU_BUFFER.search(log):
        return True
    found = breakdown.parse_log_jsonl(log)
    return bool(found) and any(_GPU_DEVICE.match(r.name) and r.self_mib > 0 for r in found[-1].devices)
