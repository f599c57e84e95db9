"""Where an engine's binaries are and what they accept: the two values every engine module passes around.

They live below ``build`` (which finds and builds engines) and ``flags`` (which spells a config for a binary's
capabilities), so that neither has to import the other: runner → flags → caps ← build.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tuner.core.errors import EngineNotFoundError


@dataclass(frozen=True, slots=True)
class EngineLocation:
    bin_dir: Path
    source: str  # "option" | "env" | "path" | "managed"

    def tool(self, name: str) -> Path:
        path = self.bin_dir / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EngineNotFoundError(name, [str(self.bin_dir)])
        return path

    def has(self, name: str) -> bool:
        path = self.bin_dir / name
        return path.is_file() and os.access(path, os.X_OK)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one engine build is (version, commit, backend, devices) and which flags each of its tools accepts,
    read from ``--version``, ``--list-devices`` and ``--help`` (see :func:`tuner.engine.build.capabilities`)."""

    version: str
    build_number: str
    commit: str
    backend: str
    devices: tuple[str, ...]
    flags: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def supports(self, tool: str, flag: str) -> bool:
        return flag in self.flags.get(tool, ())
