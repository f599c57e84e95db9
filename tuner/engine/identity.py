"""Which llama.cpp is which: the pin this version of moe-tune builds and replays, and the identity of the engine
that ran (its commit, build number, version, backend), spelled one way for every output that names it: the
bench header, the report, result.json's ``engine`` block, shared records, ``serve``, ``doctor`` and the
note a plan gives when its memory figures follow a commit other than the engine's.

A build made without git data (an sdist) reports ``commit unknown`` unless it was configured with
``-DLLAMA_BUILD_COMMIT``: then nothing ties its results to a source, and every output says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class EnginePin:
    package: str
    version: str
    commit: str
    sdist_sha256: str

    @property
    def sdist_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}.tar.gz"


# The one place the engine version is stated: the managed build compiles it, and the memory model's replay of the
# compute graph (tuner.plan.graph_arch) was read from its source.
PIN = EnginePin(
    package="llama-cpp-python",
    version="0.3.36",
    commit="0c1e57098",
    sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
)
REPLAY_COMMIT = PIN.commit


def same_commit(a: str | None, b: str | None) -> bool:
    """Whether two commit names are the same build: equal, or one hash a prefix of the other (llama.cpp prints 9
    hex digits, git 40); an unknown commit is never the same as anything."""
    if not a or not b or UNKNOWN in (a, b):
        return False
    a, b = a.lower(), b.lower()
    return a.startswith(b) or b.startswith(a) if min(len(a), len(b)) >= 7 else a == b


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What one engine build is, as its own tools report it (``llama-bench --version``, ``--list-devices``)."""

    commit: str
    version: str = UNKNOWN
    build_number: str = UNKNOWN
    backend: str = UNKNOWN
    fa_quants: str | None = None  # a CUDA build's flash-attention vector kernels (GGML_CUDA_FA_QUANTS), ";"-joined

    @property
    def known(self) -> bool:
        return bool(self.commit) and self.commit != UNKNOWN

    @property
    def pinned(self) -> bool:
        return same_commit(self.commit, PIN.commit)

    @property
    def name(self) -> str:
        """``llama.cpp b11434``; a build without a commit is named by its build number, or as unknown."""
        if self.known:
            return f"llama.cpp {self.commit}"
        if self.build_number not in (UNKNOWN, "", "0"):
            return f"llama.cpp build {self.build_number} (commit unknown)"
        return "llama.cpp of unknown commit"

    def describe(self) -> str:
        """``llama.cpp b11434 (cpu)``, with ``, the pinned build`` for the pin."""
        return f"{self.name} ({self.backend}{', the pinned build' if self.pinned else ''})"

    def to_dict(self) -> dict[str, Any]:
        """result.json's and the shared record's ``engine`` block."""
        return {"commit": self.commit, "version": self.version, "build_number": self.build_number,
                "backend": self.backend, "fa_quants": self.fa_quants}

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> EngineIdentity:
        """Back from an ``engine`` block (older results lack some keys; none at all reads as unknown)."""
        raw = raw or {}
        fa = raw.get("fa_quants")
        return cls(str(raw.get("commit") or UNKNOWN), str(raw.get("version") or UNKNOWN),
                   str(raw.get("build_number") or UNKNOWN), str(raw.get("backend") or UNKNOWN),
                   fa if isinstance(fa, str) else None)


def replay_note(engine: EngineIdentity | None) -> str | None:
    """One line where the memory model's replay follows another commit than the engine here (or there is none):
    None when the engine is the pinned build."""
    if engine is not None and engine.pinned:
        return None
    if engine is None:
        return (f"memory figures: a replay of llama.cpp {REPLAY_COMMIT}'s allocator (no engine found here to ask for "
                "its own projection)")
    whose = f"the engine here is {engine.name}" if engine.known else \
        f"the engine here reports no commit ({engine.name})"
    return f"memory figures: the replay follows llama.cpp {REPLAY_COMMIT}; {whose}"
