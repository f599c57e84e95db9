"""Why a trial did not produce a measurement, in five kinds — never a 0.0 score.

A failure keeps the argv and the stderr tail so it can be reproduced. Classification reads the engine's own
messages (allocation failures, context-creation errors), the exit status and the signal.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tuner.core.errors import (
    WRONG_CPU_FIX,
    EngineError,
    EngineNotFoundError,
    ProcessFailedError,
    ProcessTimeoutError,
    RequestRejectedError,
    TrialFailedError,
    TunerError,
    UsageError,
    _last_meaningful_line,
    illegal_instruction,
    wrong_cpu_reason,
)


class FailureKind(str, Enum):
    OUT_OF_MEMORY = "out_of_memory"
    REJECTED_CONFIG = "rejected_config"
    CRASHED = "crashed"
    TIMED_OUT = "timed_out"
    ENGINE_MISSING = "engine_missing"
    UNSUPPORTED_MODEL = "unsupported_model"  # the engine does not know the model's architecture
    WRONG_CPU = "wrong_cpu"  # the build died of an illegal instruction: it was made for another CPU


# Allocation failures as llama.cpp/ggml print them (CUDA, Vulkan, CPU, KV cache, compute buffers).
_OOM = re.compile(
    r"cudaMalloc failed|out of memory|failed to allocate|unable to allocate|cannot allocate memory"
    r"|std::bad_alloc|ErrorOutOfDeviceMemory|CUBLAS_STATUS_ALLOC_FAILED|insufficient memory",
    re.IGNORECASE,
)
# The engine refused the settings or the file before running (bad flag value, context creation, model load).
_REJECTED = re.compile(
    r"invalid argument|unknown argument|requires flash|failed to create context|failed to load model"
    r"|error loading model|not supported|unsupported|error: |invalid value|failed to initialize",
    re.IGNORECASE,
)

_FIX = {
    FailureKind.OUT_OF_MEMORY: "offload more experts (--n-cpu-moe), shrink -c/-ub or quantize the KV cache",
    FailureKind.REJECTED_CONFIG: "change the flags named above",
    FailureKind.CRASHED: "rerun with MOE_TUNE_DEBUG=1 and report the stderr tail",
    FailureKind.TIMED_OUT: "raise the time limit or measure fewer tokens",
    FailureKind.ENGINE_MISSING: "run `moe-tune engine install` or set LLAMA_CPP_DIR",
    FailureKind.UNSUPPORTED_MODEL: "run this model with an engine that knows its architecture (llama.cpp), or a "
                                   "newer build of this one",
    FailureKind.WRONG_CPU: WRONG_CPU_FIX,
}
# The loader's own words (llama-model-loader / llama.cpp's llm_arch_from_string): "error loading model architecture:
# unknown model architecture: 'olmoe'" (ik_llama.cpp 0.1.5 on OLMoE).
_UNKNOWN_ARCH = re.compile(r"unknown model architecture: '([^']+)'")


@dataclass(frozen=True, slots=True)
class Failure:
    kind: FailureKind
    reason: str
    argv: tuple[str, ...] = ()
    returncode: int | None = None
    signal_name: str | None = None
    stderr_tail: str = ""

    @property
    def fix(self) -> str:
        return _FIX[self.kind]

    def summary(self) -> str:
        return f"{self.kind.value.replace('_', ' ')}: {self.reason}; {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value, "reason": self.reason, "argv": list(self.argv), "returncode": self.returncode,
            "signal": self.signal_name, "stderr_tail": self.stderr_tail,
        }


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify_exit(argv: tuple[str, ...] | list[str], returncode: int | None, stderr_tail: str,
                  *, timed_out: bool = False) -> Failure:
    """Classify a process that ended badly from its exit status and its own messages."""
    argv = tuple(argv)
    sig = _signal_name(returncode)
    if timed_out:
        return Failure(FailureKind.TIMED_OUT, "it did not finish in time", argv, returncode, sig, stderr_tail)
    if illegal_instruction(returncode):  # no config of this build runs here: said as such, never as a crash
        return Failure(FailureKind.WRONG_CPU, wrong_cpu_reason(argv), argv, returncode, sig or "SIGILL", stderr_tail)
    oom = _matching_line(_OOM, stderr_tail)
    if oom:
        return Failure(FailureKind.OUT_OF_MEMORY, oom, argv, returncode, sig, stderr_tail)
    if sig is not None:
        hint = " (the kernel's OOM killer sends SIGKILL)" if sig == "SIGKILL" else ""
        last = _last_meaningful_line(stderr_tail)
        return Failure(FailureKind.CRASHED, f"killed by {sig}{hint}; last output: {last}", argv, returncode, sig,
                       stderr_tail)
    arch = _UNKNOWN_ARCH.search(stderr_tail)
    if arch and returncode not in (0, None):
        return Failure(FailureKind.UNSUPPORTED_MODEL, f"this engine does not know the model's architecture "
                       f"'{arch.group(1)}'", argv, returncode, sig, stderr_tail)
    rejected = _matching_line(_REJECTED, stderr_tail)
    if rejected and returncode not in (0, None):
        return Failure(FailureKind.REJECTED_CONFIG, rejected, argv, returncode, sig, stderr_tail)
    last = _last_meaningful_line(stderr_tail)
    return Failure(FailureKind.CRASHED, f"exit code {returncode}; last output: {last}", argv, returncode, sig,
                   stderr_tail)


def from_error(exc: TunerError) -> Failure:
    """The failure an error raised by the runner or the renderer stands for."""
    if isinstance(exc, TrialFailedError):
        return exc.failure
    if isinstance(exc, EngineNotFoundError):
        return Failure(FailureKind.ENGINE_MISSING, str(exc))
    if isinstance(exc, RequestRejectedError):
        return Failure(FailureKind.REJECTED_CONFIG, exc.stderr_tail, tuple(exc.argv), None, None, exc.stderr_tail)
    if isinstance(exc, ProcessTimeoutError):
        return classify_exit(exc.argv, exc.returncode, exc.stderr_tail, timed_out=True)
    if isinstance(exc, ProcessFailedError):
        return classify_exit(exc.argv, exc.returncode, exc.stderr_tail)
    if isinstance(exc, UsageError):
        return Failure(FailureKind.REJECTED_CONFIG, str(exc))
    if isinstance(exc, EngineError) and "could not be started" in str(exc):
        return Failure(FailureKind.ENGINE_MISSING, str(exc))
    raise exc


def _matching_line(pattern: re.Pattern[str], text: str) -> str | None:
    for line in reversed(text.splitlines()):
        if pattern.search(line):
            return line.strip()[:300]
    return None
