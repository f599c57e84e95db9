"""One error tree for the whole tool.

Every message names the fix. The CLI prints ``str(error)`` on one line and exits 1; set
``MOE_TUNE_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class TunerError(Exception):
    """Base of every error the tool raises on purpose."""

    exit_code = 1


class UsageError(TunerError, ValueError):
    """The user asked for something that cannot work as stated (bad option value, bad path)."""


class EngineError(TunerError):
    """Something about the llama.cpp engine: missing, unbuildable, or misbehaving."""


class EngineNotFoundError(EngineError, FileNotFoundError):
    def __init__(self, binary: str, searched: Sequence[str] = ()) -> None:
        self.binary = binary
        self.searched = list(searched)
        where = f" (looked in: {', '.join(self.searched)})" if self.searched else ""
        super().__init__(
            f"{binary} not found{where}: run `moe-tune engine install` or set LLAMA_CPP_DIR "
            "to the folder holding your llama.cpp binaries"
        )


class BuildToolMissingError(EngineError):
    """A tool needed to build llama.cpp (cmake, a C++ compiler, ninja/make) is absent."""


class BuildFailedError(EngineError):
    def __init__(self, step: str, argv: Sequence[str], returncode: int, stderr_tail: str, log_path: Path) -> None:
        self.step = step
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        self.log_path = log_path
        last = stderr_tail.strip().splitlines()[-1] if stderr_tail.strip() else "no output"
        super().__init__(
            f"llama.cpp build failed at '{step}' (exit {returncode}): {last} — full log in {log_path}; "
            "fix the cause or pass --backend cpu"
        )


class DiskSpaceError(EngineError, OSError):
    def __init__(self, path: Path, need_bytes: int, free_bytes: int) -> None:
        self.path = path
        self.need_bytes = need_bytes
        self.free_bytes = free_bytes
        super().__init__(
            f"not enough disk space in {path}: need {need_bytes / 2**20:.0f} MiB, "
            f"{free_bytes / 2**20:.0f} MiB free; free some space or set MOE_TUNE_CACHE to another disk"
        )


class ProcessFailedError(EngineError):
    """A llama.cpp process ended badly. Carries what is needed to reproduce it."""

    def __init__(self, what: str, argv: Sequence[str], returncode: int | None, stderr_tail: str, fix: str) -> None:
        self.what = what
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        last = _last_meaningful_line(stderr_tail)
        code = "timed out" if returncode is None else f"exit {returncode}"
        super().__init__(f"{what} failed ({code}): {last}; {fix}")


class ProcessTimeoutError(ProcessFailedError):
    pass


class GGUFFormatError(TunerError, ValueError):
    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is not a usable GGUF file ({reason}): check the path or download it again")


class HardwareError(TunerError):
    pass


class MachineBusyError(HardwareError):
    """Another measuring run or another program keeps the machine busy; measuring now would measure it."""

    def __init__(self, what: str, waited_s: float) -> None:
        self.what = what
        self.waited_s = waited_s
        super().__init__(f"the machine is busy ({what}; waited {waited_s:.0f} s): stop it or run again later, "
                         "or pass --allow-busy to measure anyway (rounds it disturbs decide no verdict)")


def _last_meaningful_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        low = line.lower()
        if "error" in low or "failed" in low or "abort" in low or "what()" in low:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
