"""llama.cpp's own memory figures, parsed: `--log-jsonl` ``fit_memory_breakdown`` records and the
``llama-fit-params -fitp on`` table.

llama.cpp prints whole MiB, rounded down, so every figure here is exact only to 1 MiB.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tuner.core.config import LaunchConfig
from tuner.core.errors import BreakdownParseError
from tuner.engine import flags, runner
from tuner.engine.caps import EngineLocation

SERVER_ATTEMPTS = 3
# A projection takes a fraction of a second: asked again until its record is there (lost in ~1 of 3 tiny runs).
FIT_PARAMS_ATTEMPTS = 8


@dataclass(frozen=True, slots=True)
class BufferRow:
    """One row of llama.cpp's breakdown: a device (``CUDA0``), the host, or an extra buffer type."""

    kind: str  # "device", "host" or "buffer_type"
    name: str  # "CUDA0", "Host", "CPU_REPACK", ...
    model_mib: int
    context_mib: int
    compute_mib: int
    total_mib: int | None = None  # devices only
    free_mib: int | None = None

    @property
    def self_mib(self) -> int:
        return self.model_mib + self.context_mib + self.compute_mib


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    rows: tuple[BufferRow, ...]
    # From the --log-jsonl record (every buffer type); False: the plain table, which leaves CPU_REPACK out.
    from_record: bool = True

    def row(self, name: str) -> BufferRow | None:
        return next((r for r in self.rows if r.name == name), None)

    @property
    def devices(self) -> tuple[BufferRow, ...]:
        return tuple(r for r in self.rows if r.kind == "device")

    @property
    def host_side(self) -> tuple[BufferRow, ...]:
        """Host plus host-resident extra buffers (CPU_REPACK): everything that lives in system RAM."""
        return tuple(r for r in self.rows if r.kind != "device")

    def host_total(self, part: str) -> int:
        return sum(getattr(r, f"{part}_mib") for r in self.host_side)

    def device_total(self, part: str) -> int:
        return sum(getattr(r, f"{part}_mib") for r in self.devices)


def parse_log_jsonl(text: str) -> list[MemoryBreakdown]:
    """Every ``fit_memory_breakdown`` record in a `--log-jsonl` stream, in order.

    llama-server and llama-perplexity print one when fitting (projected) and one at exit (actual); the
    last record is the actual one.
    """
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{") or "fit_memory_breakdown" not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("type") != "fit_memory_breakdown":
            continue
        rows = record.get("data", {}).get("rows", [])
        found.append(MemoryBreakdown(tuple(_row(r) for r in rows)))
    return found


# A load log's buffer lines, as engines without --log-jsonl print them (ik_llama.cpp's llama.cpp-era loader):
# "llm_load_tensors:        CPU buffer size =     9.89 MiB", "llama_kv_cache_init:        CPU KV buffer size =
# 16.00 MiB", "llama_init_from_model:        CPU compute buffer size =     8.50 MiB" (and "output buffer").
_LOAD_LINE = re.compile(r"^(llm_load_tensors|llama_kv_cache_init|llama_init_from_model|llama_new_context_with_model):"
                        r"\s+(\S+)\s+(KV |compute |output )?buffer size\s*=\s*([\d.]+) MiB", re.MULTILINE)


def parse_load_log(text: str) -> MemoryBreakdown | None:
    """The buffers a load log says it allocated (model, KV, compute per buffer type), whole MiB rounded down as
    llama.cpp prints its own; None when the log has none. From the plain log: not a ``--log-jsonl`` record."""
    parts: dict[str, dict[str, float]] = {}
    for _, name, what, mib in _LOAD_LINE.findall(text):
        part = {"KV ": "context", "compute ": "compute", "output ": "context"}.get(what, "model")
        parts.setdefault(name, {"model": 0.0, "context": 0.0, "compute": 0.0})[part] += float(mib)
    if not parts:
        return None
    rows = tuple(BufferRow("device" if n.upper().startswith(("CUDA", "ROCM", "VULKAN")) and "_HOST" not in n.upper()
                           else "host", n, int(p["model"]), int(p["context"]), int(p["compute"]))
                 for n, p in parts.items())
    return MemoryBreakdown(rows, from_record=False)


def _row(r: dict[str, object]) -> BufferRow:
    def num(key: str) -> int | None:
        v = r.get(key)
        return int(v) if isinstance(v, (int, float)) else None

    return BufferRow(
        kind=str(r.get("kind", "")), name=str(r.get("name", "")),
        model_mib=num("model") or 0, context_mib=num("context") or 0, compute_mib=num("compute") or 0,
        total_mib=num("total"), free_mib=num("free"),
    )


def actual_breakdown(text: str) -> MemoryBreakdown:
    """The last (at-exit) breakdown of a `--log-jsonl` log."""
    found = parse_log_jsonl(text)
    if not found:
        raise BreakdownParseError("no fit_memory_breakdown record in the log: run llama.cpp with --log-jsonl")
    return found[-1]


def parse_fit_params(stdout: str) -> MemoryBreakdown:
    """``llama-fit-params -fitp on`` stdout: lines ``NAME model context compute`` in MiB.

    With `--log-jsonl` the same run also carries a full record (with extra buffer types such as
    CPU_REPACK, which the plain table leaves out); that record is preferred when present.
    """
    records = parse_log_jsonl(stdout)
    if records:
        return records[-1]
    rows = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
            name = parts[0]
            model, context, compute = (int(p) for p in parts[1:])
            rows.append(BufferRow("host" if name == "Host" else "device", name, model, context, compute))
    if not rows:
        raise BreakdownParseError("llama-fit-params printed no memory table: pass -fitp on")
    return MemoryBreakdown(tuple(rows), from_record=False)


# --- measuring: llama.cpp's own figures for one LaunchConfig -------------------------------------------


def fit_params_breakdown(engine: EngineLocation, cfg: LaunchConfig, timeout_s: float = 120) -> MemoryBreakdown:
    """The engine's projection (``llama-fit-params -fitp on``): header only, no weights loaded. Its --log-jsonl
    record (every buffer type) can be lost at exit, as the server's can (the logger's thread is not joined): seen
    in 4 of 12 runs of b11434 and 2 of 12 of the pin on the tiny demo. The run is repeated until the record is
    there; after the last attempt the plain table is what is left (``from_record`` False)."""
    argv = flags.fit_params_argv(engine.tool("llama-fit-params"), cfg)
    for _ in range(FIT_PARAMS_ATTEMPTS):
        res = runner.run_process(argv, timeout_s=timeout_s, what="llama-fit-params",
                                 fix="check the model file and flags", env=flags.server_env(cfg))
        if parse_log_jsonl(res.stdout):
            break
    return parse_fit_params(res.stdout)


def server_breakdown(engine: EngineLocation, cfg: LaunchConfig, log_dir: Path,
                     load_timeout_s: float = 300) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """(projected at start, actual at exit) of a llama-server that loads ``cfg`` and is stopped."""
    argv = flags.server_argv(engine.tool("llama-server"), cfg)
    found: list[MemoryBreakdown] = []
    for _ in range(SERVER_ATTEMPTS):
        with runner.serve(argv, log_dir=log_dir, load_timeout_s=load_timeout_s, log_jsonl=True,
                          env=flags.server_env(cfg)) as server:
            log = server.log
        found = parse_log_jsonl(log.read_text(errors="replace"))
        if len(found) >= 2:
            return found[0], found[-1]
        # llama.cpp logs from a worker thread that is not joined at exit (common/log.cpp leaks the logger on
        # purpose), so the last records can be lost. Seen now and then on a busy machine; a rerun has them.
    raise BreakdownParseError(
        f"llama-server left {len(found)} memory breakdown records in {log}, expected 2: "
        "run again on a less busy machine"
    )
