"""The measured line in the places people run a model as a service: a llama-swap entry, a systemd user unit, a
docker compose service for the official llama.cpp server image, and as JSON.

Every format is rendered from the same argument list the line was measured with (:func:`tuner.engine.flags.
server_argv`), so its flags are the measured ones; what a format cannot carry is written into it (a comment, or
a ``not_carried`` field), never dropped silently. Ollama is not a format here: its Modelfile has no place for
``--n-cpu-moe`` or the KV cache types (docs/deploy.md says what carries over).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import flags
from tuner.engine import serve as served
from tuner.engine.kinds import kind_by_name

FORMATS = ("shell", "llama-swap", "systemd", "compose", "preset", "json")
# Formats that run llama.cpp itself, whatever engine measured the line: the official image, the router's presets.
LLAMA_CPP_ONLY = {"compose": "server image", "preset": "router (--models-preset)"}
# Started by another program, not from the user's shell.
SERVICE_FORMATS = ("llama-swap", "systemd", "compose", "preset")
# The variables that choose which card the line runs on: a service started elsewhere needs them as they are here.
LINE_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
IMAGE_CUDA = "ghcr.io/ggml-org/llama.cpp:server-cuda"
IMAGE_CPU = "ghcr.io/ggml-org/llama.cpp:server"
IMAGE_PORT = 8080  # the image's own HEALTHCHECK asks this port: the server listens on it inside the container
DEFAULT_PORT = 8080  # llama-server's default, published on the host when --port is not given
MODELS_IN_CONTAINER = "/models"


@dataclass(frozen=True, slots=True)
class Line:
    """One measured config of a result, with what the formats say about where it was measured."""

    config: LaunchConfig
    label: str
    study: str
    record: dict[str, Any] = field(default_factory=dict)  # the config as result.json stores it
    figures: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] | None = None  # the result's engine record: commit, version, backend


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str
    not_carried: tuple[str, ...] = ()  # also written into ``text``, as the format allows


def line_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` the line needs wherever it runs (which card), in a stable order."""
    return {k: environ[k] for k in LINE_ENV if environ.get(k)}


def render(line: Line, fmt: str, *, host: str | None = None, port: int | None = None,
           binary: str = "llama-server", env: Mapping[str, str] | None = None) -> Rendered:
    kind = kind_by_name(line.config.engine)
    if fmt in LLAMA_CPP_ONLY and not kind.server_on_path:
        raise UsageError(f"--format {fmt} runs llama.cpp's own {LLAMA_CPP_ONLY[fmt]}, not {kind.name}, whose line this "
                         f"is: use --format shell, systemd or llama-swap (they run {kind.name}'s llama-server by its "
                         "path)")
    env = {**(env or {}), **flags.server_env(line.config)}  # the engine reads part of the config from there
    if fmt in SERVICE_FORMATS:  # clients of a service see the model by name, not by this machine's path
        env.setdefault(served.ALIAS_ENV, served.alias_for(line.config.model))
    argv = flags.server_argv(Path(binary), line.config) + flags.address_argv(host, port)
    if fmt == "shell":
        return Rendered(shlex.join([*(f"{k}={v}" for k, v in env.items()), *argv]))
    if fmt == "json":
        return Rendered(json.dumps({"argv": argv, "env": env, "config": line.record, **line.figures,
                                    "not_carried": []}, indent=2))
    if fmt == "llama-swap":
        return _llama_swap(line, argv, port, env)
    if fmt == "systemd":
        return _systemd(line, argv, env)
    if fmt == "compose":
        return _compose(line, host, port, env)
    if fmt == "preset":
        return _preset(line, flags.server_argv(Path(binary), line.config), env)
    raise UsageError(f"unknown --format {fmt}: use {', '.join(FORMATS)}")


def _measured_on(line: Line) -> str:
    e = line.engine or {}
    return f"{kind_by_name(e.get('engine')).name} {e.get('commit', '?')} ({e.get('backend', '?')})"


# ------------------------------------------------------------------------------------------- llama-swap


def _llama_swap(line: Line, argv: list[str], port: int | None, env: dict[str, str]) -> Rendered:
    name = line.config.model.stem
    cmd = shlex.join([*argv, *([] if port is not None else flags.address_argv(port="${PORT}"))])
    lines = ["models:", f"  {json.dumps(name)}:", f"    cmd: {json.dumps(cmd)}"]
    if env:
        lines += ["    env:", *(f"      - {json.dumps(f'{k}={v}')}" for k, v in env.items())]
    return Rendered("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------- systemd


def systemd_quote(arg: str) -> str:
    """One ExecStart word as systemd reads it: specifiers (``%``) and variables (``$``) doubled, and the word
    double-quoted with C escapes when it holds a space, a quote, a backslash or is a lone ``;``."""
    word = arg.replace("%", "%%").replace("$", "$$")
    if word and not re.search(r"[\s\"'\\;]", word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def systemd_env(key: str, value: str) -> str:
    return f"Environment={systemd_quote(f'{key}={value}')}"


def _systemd(line: Line, argv: list[str], env: dict[str, str]) -> Rendered:
    if not Path(argv[0]).is_absolute():
        raise UsageError(f"a systemd unit needs the engine's absolute path, not {argv[0]}: run "
                         "`moe-tune engine install` or pass --llama-cpp-dir")
    text = [
        f"# {line.config.model.stem}: the line moe-tune measured ({line.label}, study {line.study}) on "
        f"{_measured_on(line)}.",
        "# Install: save as ~/.config/systemd/user/llama-server.service, then",
        "#   systemctl --user daemon-reload && systemctl --user enable --now llama-server",
        "# (`loginctl enable-linger` keeps it running while you are logged out.)",
        "[Unit]",
        f"Description=llama-server {line.config.model.name} (tuned by moe-tune)",
        "",
        "[Service]",
        "Type=exec",
        "ExecStart=" + " ".join(systemd_quote(a) for a in argv),
        *(systemd_env(k, v) for k, v in env.items()),
        "Restart=on-failure",
        "RestartSec=5",
        "",
        "[Install]",
        "WantedBy=default.target",
    ]
    return Rendered("\n".join(text) + "\n")


# ------------------------------------------------------------------------------------------- compose


def _yaml(value: Any, indent: int = 0) -> list[str]:
    """Block YAML for dicts and lists of JSON scalars (each scalar written as JSON, which YAML reads as is)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines += [f"{pad}{k}:", *_yaml(v, indent + 2)]
            else:
                lines.append(f"{pad}{k}: {json.dumps(v)}")
    else:
        for item in value:
            if isinstance(item, dict) and item:
                first, *rest = _yaml(item, indent + 2)
                lines += [f"{pad}- {first.lstrip()}", *rest]
            else:
                lines.append(f"{pad}- {json.dumps(item)}")
    return lines


def _service_name(model: Path) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", model.stem.lower()).strip("-._") or "llama-server"


def _gpu_devices(env: dict[str, str]) -> dict[str, Any]:
    """The compose GPU reservation: the cards CUDA_VISIBLE_DEVICES names here, else every card."""
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    which: dict[str, Any] = {"device_ids": visible} if visible else {"count": "all"}
    return {"driver": "nvidia", **which, "capabilities": ["gpu"]}


def _compose(line: Line, host: str | None, port: int | None, env: dict[str, str]) -> Rendered:
    cfg = line.config
    mounts = {cfg.model.parent: MODELS_IN_CONTAINER}
    if cfg.draft_model is not None and cfg.draft_model.parent not in mounts:
        mounts[cfg.draft_model.parent] = f"{MODELS_IN_CONTAINER}-draft"
    inside = flags.with_overrides(
        cfg, model=Path(mounts[cfg.model.parent]) / cfg.model.name,
        draft_model=None if cfg.draft_model is None else Path(mounts[cfg.draft_model.parent]) / cfg.draft_model.name)
    command = flags.server_argv(Path("llama-server"), inside)[1:] + flags.address_argv("0.0.0.0", IMAGE_PORT)
    cpu = cfg.device == "none" or (line.engine or {}).get("backend") == "cpu"
    published = f"{host or '127.0.0.1'}:{port or DEFAULT_PORT}:{IMAGE_PORT}"
    service: dict[str, Any] = {
        "image": IMAGE_CPU if cpu else IMAGE_CUDA,
        "command": command,
        "volumes": [{"type": "bind", "source": str(src), "target": dst, "read_only": True}
                    for src, dst in mounts.items()],
        "ports": [published],
        "restart": "unless-stopped",
    }
    carried_env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    if carried_env:
        service["environment"] = carried_env
    if not cpu:
        service["deploy"] = {"resources": {"reservations": {"devices": [_gpu_devices(env)]}}}
    not_carried = [f"the measured engine: the image runs its own llama.cpp build, not {_measured_on(line)}; pin an "
                   "image tag built from that commit to run what was measured"]
    if cpu and cfg.device != "none":
        not_carried.append("a GPU: the line was measured on a CPU build, so the CPU image is used and no card is "
                           "reserved")
    header = [f"# {cfg.model.stem}: the line moe-tune measured ({line.label}, study {line.study}), for the official "
              "llama.cpp server image.",
              f"# The model's folder is mounted read-only at {MODELS_IN_CONTAINER}; the server listens on "
              f"{IMAGE_PORT} inside, published on {published.rsplit(':', 1)[0]}.",
              *(f"# not carried: {n}" for n in not_carried)]
    body = _yaml({"services": {_service_name(cfg.model): service}})
    return Rendered("\n".join([*header, *body]) + "\n", tuple(not_carried))


# ------------------------------------------------------------------------------------- llama-server preset


def _preset(line: Line, argv: list[str], env: dict[str, str]) -> Rendered:
    """A model preset for llama-server's router (``--models-preset FILE``, common/preset.cpp ``load_from_ini``):
    one section named after the model, each flag a key without its dashes (the router accepts the spellings
    the command line does), a bare flag as ``true``. Host and port are the router's own; the card it runs on
    is the router's environment, which a preset cannot set."""
    out = ["version = 1", "", f"; measured by moe-tune ({line.label} of {line.study}) on {_measured_on(line)}",
           f"[{line.config.model.stem}]"]
    words = argv[1:]
    i = 0
    while i < len(words):
        flag = words[i]
        if flags.takes_value(flag) and i + 1 < len(words):
            value, i = words[i + 1], i + 2
        else:
            value, i = "true", i + 1
        out.append(f"{flag.lstrip('-')} = {value}")
    not_carried = tuple(f"{k}={v}" for k, v in env.items())
    if not_carried:
        out.append(f"; set in the router's environment: {' '.join(not_carried)}")
    return Rendered("\n".join(out) + "\n", not_carried)
