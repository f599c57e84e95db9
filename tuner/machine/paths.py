"""Where the tool keeps things outside the repository: engine builds, demo models, capability caches.

``MOE_TUNE_CACHE`` overrides the root; otherwise ``$XDG_CACHE_HOME/moe-tune`` or ``~/.cache/moe-tune``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    override = os.environ.get("MOE_TUNE_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "moe-tune"


def engine_root() -> Path:
    return cache_root() / "engine"


def models_dir() -> Path:
    return cache_root() / "models"


def logs_dir() -> Path:
    return cache_root() / "logs"
