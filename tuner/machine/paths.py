"""Where the tool keeps things outside the repository: engine builds, demo models, capability caches.

``MOE_TUNE_CACHE`` overrides the root; otherwise ``$XDG_CACHE_HOME/moe-tune`` or ``~/.cache/moe-tune``. What
belongs to the installation rather than a cache (the sharer id) lives under :func:`config_root`.
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


def config_root() -> Path:
    """What the tool keeps about this installation (not a cache: never rebuilt): ``MOE_TUNE_CONFIG``, else
    ``$XDG_CONFIG_HOME/moe-tune`` or ``~/.config/moe-tune``."""
    override = os.environ.get("MOE_TUNE_CONFIG")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".config") / "moe-tune"


def engine_root() -> Path:
    return cache_root() / "engine"


def models_dir() -> Path:
    return cache_root() / "models"


def logs_dir() -> Path:
    return cache_root() / "logs"
