"""Which engine is which: the pin this version of moe-tune builds and replays, and the identity of the engine
that ran (llama.cpp or ik_llama.cpp; its commit, build number, version, backend), spelled one way for every
output that names it: the bench header, the report, result.json's ``engine`` block, shared records, ``serve``,
``doctor`` and the note a plan gives when its memory figures follow a commit other than the engine's.

A build made without git data (an sdist) reports ``commit unknown`` unless it was configured with
``-DLLAMA_BUILD_COMMIT``: then nothing ties its results to a source, and every output says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner.engine.kinds import LLAMA_CPP, PIN, EnginePin, kind_by_name  # noqa: F401 - identity.PIN, as before

UNKNOWN = "unknown"


# The pins live with the kinds of engine (tuner.engine.kinds); the memory model's replay follows llama.cpp's.
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
    engine: str = LLAMA_CPP.name  # which kind of engine (tuner.engine.kinds): "llama.cpp" or "ik_llama.cpp"

    @property
    def known(self) -> bool:
        return bool(self.commit) and self.commit != UNKNOWN

    @property
    def pinned(self) -> bool:
        """The build this version of moe-tune pins for its kind (llama.cpp's commit, or ik's sdist)."""
        return same_commit(self.commit, kind_by_name(self.engine).pin.commit)

    @property
    def name(self) -> str:
        """``llama.cpp b11434``, ``ik_llama.cpp ik-llama-cpp-python-0.1.5``; a build without a commit is named by
        its build number, or as unknown."""
        if self.known:
            return f"{self.engine} {self.commit}"
        if self.build_number not in (UNKNOWN, "", "0"):
            return f"{self.engine} build {self.build_number} (commit unknown)"
        return f"{self.engine} of unknown commit"

    def describe(self) -> str:
        """``llama.cpp b11434 (cpu)``, with ``, the pinned build`` for the pin."""
        return f"{self.name} ({self.backend}{', the pinned build' if self.pinned else ''})"

    def to_dict(self) -> dict[str, Any]:
        """result.json's and the shared record's ``engine`` block."""
        return {"commit": self.commit, "version": self.version, "build_number": self.build_number,
                "backend": self.backend, "fa_quants": self.fa_quants, "engine": self.engine}

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> EngineIdentity:
        """Back from an ``engine`` block (older results lack some keys; none at all reads as unknown; no ``engine``
        key: llama.cpp, the one engine before ik_llama.cpp)."""
        raw = raw or {}
        fa = raw.get("fa_quants")
        return cls(str(raw.get("commit") or UNKNOWN), str(raw.get("version") or UNKNOWN),
                   str(raw.get("build_number") or UNKNOWN), str(raw.get("backend") or UNKNOWN),
                   fa if isinstance(fa, str) else None, kind_by_name(raw.get("engine")).name)


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
