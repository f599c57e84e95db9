"""A shared record: one auto-tune result as others may read it, built from result.json and read back strictly.

What goes in (docs/sharing.md): the card, the host's size, the engine, the model by Hub id or fingerprint, the
workload, every line the finish measured with its figures, spread, verdicts and spill, and the printed line with
why. What never does: paths (a line names the model by its file name, rendered again by the flag layer), the
host name, the user, serial numbers, failure logs (their argv and stderr hold paths).

Reading is a gate: the file is bounded in size, every field is checked against the schema of its version, fields
the schema does not name are dropped, every line is read by the flag layer's own parser (which refuses a flag
moe-tune does not measure), and a record from a newer schema is refused with the fix. Anything wrong is one
:class:`RecordError` naming the record.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner import __version__
from tuner.core.config import LaunchConfig
from tuner.core.errors import RecordError, UsageError
from tuner.engine import flags
from tuner.engine.identity import EngineIdentity
from tuner.hub.repos import quant_name
from tuner.search.finish import ServerMeasurement
from tuner.search.result import StudyResult
from tuner.search.trials import config_from_dict

SCHEMA = "moe-tune/shared-result"
SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024
MAX_LINES = 32
MAX_TEXT = 600  # characters of any one string (a launch line, a reason)
CPU_CARD = "cpu"  # the card of a result measured without a GPU

_HF_CACHE_DIR = re.compile(r"^(?:models|datasets)--(?P<owner>[\w.-]+?)--(?P<name>[\w.-]+)$")


# -- schema: field → kind ("str", "int", "num", "bool"; a trailing "?" allows null). Other fields are dropped.

CARD = {"name": "str", "vram_total_bytes": "int", "vram_budget_bytes": "int?", "driver": "str?", "pcie_link": "str?"}
HOST = {"ram_total_bytes": "int?", "physical_cores": "int?", "cpu_model": "str?"}
ENGINE = {"version": "str?", "commit": "str?", "backend": "str?", "fa_quants": "str?"}
MODEL = {"hub_repo": "str?", "hub_file": "str?", "file_name": "str", "quant": "str?", "size_bytes": "int",
         "head_sha256": "str?", "tail_sha256": "str?"}
WORKLOAD = {"kind": "str", "prompt_tokens": "int", "gen_tokens": "int", "depth_tokens": "int?",
            "concurrency": "int"}
LINE = {"label": "str", "round": "str", "line": "str", "slots": "int", "gen_tok_s": "num?", "gen_cv_pct": "num?",
        "prompt_tok_s": "num?", "ttft_s": "num?", "loaded_gen_tok_s": "num?", "end_to_end_gen_tok_s": "num?",
        "vram_peak_bytes": "int?", "spill": "str?", "kld_mean": "num?", "failure": "str?"}
VERDICT = {"a": "str", "b": "str", "rounds": "int", "ratio": "num", "low": "num", "high": "num",
           "noise_pct": "num", "outcome": "str"}
PRINTED = {"label": "str", "line": "str", "why": "str"}
TOP = {"schema": "str", "version": "int", "tool": "str?", "card": CARD, "host": HOST, "engine": ENGINE,
       "model": MODEL, "workload": WORKLOAD, "lines": [LINE], "verdicts": [VERDICT], "printed": PRINTED,
       "speedup_vs_default": "num?", "speedup_vs_fit": "num?"}


def _check(value: Any, kind: Any, where: str) -> Any:
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object")
        return {k: _check(value.get(k), sub, f"{where}.{k}" if where else k) for k, sub in kind.items()}
    if isinstance(kind, list):
        if not isinstance(value, list) or len(value) > MAX_LINES:
            raise ValueError(f"{where} must be a list of at most {MAX_LINES}")
        return [_check(v, kind[0], f"{where}[{i}]") for i, v in enumerate(value)]
    base, optional = kind.rstrip("?"), kind.endswith("?")
    if value is None:
        if optional:
            return None
        raise ValueError(f"{where} is missing")
    ok = {"str": isinstance(value, str) and len(value) <= MAX_TEXT and value.isprintable(),
          "int": isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53,
          "num": isinstance(value, int | float) and not isinstance(value, bool) and value == value
          and abs(value) < 1e12, "bool": isinstance(value, bool)}[base]
    if not ok:
        raise ValueError(f"{where} must be a {base}" + (f" of at most {MAX_TEXT} printable characters"
                                                         if base == "str" else ""))
    return value


# -- reading ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SharedRecord:
    """A record that passed the gate: ``data`` holds only the schema's fields; ``printed`` is the printed line as
    the flag layer read it."""

    record_id: str  # the file's name in the repo, without .json
    data: dict[str, Any]
    printed: LaunchConfig

    @property
    def card(self) -> dict[str, Any]:
        return dict(self.data["card"])

    @property
    def engine_commit(self) -> str:
        return self.data["engine"]["commit"] or "unknown"

    @property
    def model(self) -> dict[str, Any]:
        return dict(self.data["model"])

    def line(self, label: str) -> dict[str, Any] | None:
        return next((ln for ln in self.data["lines"] if ln["label"] == label), None)

    def describe(self) -> str:
        card = self.card["name"]
        return f"{self.record_id} ({card}, engine {self.engine_commit}, {self.data['workload']['kind']})"


def read_record(raw: bytes, record_id: str) -> SharedRecord:
    """``raw`` (a record file's bytes) through the gate; :class:`RecordError` in one line otherwise."""
    def refuse(why: str) -> RecordError:
        return RecordError(f"shared record {record_id[:40]} skipped: {why}")

    if len(raw) > MAX_RECORD_BYTES:
        raise refuse(f"{len(raw):,} bytes, more than the {MAX_RECORD_BYTES:,} a record may hold")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise refuse("not JSON") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise refuse(f"not a {SCHEMA} record")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise refuse("no schema version")
    if version > SCHEMA_VERSION:
        raise refuse(f"schema version {version} is newer than this moe-tune reads ({SCHEMA_VERSION}): "
                     "upgrade moe-tune (pip install -U moe-tune)")
    try:
        clean = _check(data, TOP, "")
    except ValueError as exc:
        raise refuse(str(exc)) from None
    try:
        for ln in [*clean["lines"], clean["printed"]]:
            flags.parse_command(ln["line"])  # the flag layer's parser: an unknown flag is refused here
        printed = flags.parse_command(clean["printed"]["line"]).config
    except UsageError as exc:
        raise refuse(f"a line the flag layer refuses ({exc})") from None
    return SharedRecord(record_id, clean, printed)


# -- writing ------------------------------------------------------------------------------------------------


def model_identity(path: Path, fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The model as others can name it: its Hub id and file when it sits in the Hugging Face cache, else only its
    file name and fingerprint; never its folder."""
    hub_repo = hub_file = None
    parts = path.parts
    for i, part in enumerate(parts[:-3]):
        m = _HF_CACHE_DIR.match(part)
        if m and parts[i + 1] == "snapshots":
            hub_repo, hub_file = f"{m['owner']}/{m['name']}", "/".join(parts[i + 3:])
            break
    fp = fingerprint or {}
    size = fp.get("size")
    if size is None:
        size = path.stat().st_size if path.is_file() else 0
    return {"hub_repo": hub_repo, "hub_file": hub_file, "file_name": path.name, "quant": quant_name(path.name),
            "size_bytes": int(size), "head_sha256": fp.get("head_sha256"), "tail_sha256": fp.get("tail_sha256")}


def shared_line(config: dict[str, Any]) -> str:
    """A measured config's launch line with every model named by its file name (rendered by the flag layer)."""
    cfg = config_from_dict(config)
    cfg = replace(cfg, model=Path(cfg.model.name),
                  draft_model=Path(cfg.draft_model.name) if cfg.draft_model is not None else None)
    return flags.launch_line(cfg)


def _line(m: ServerMeasurement, round_name: str) -> dict[str, Any]:
    out = {k: getattr(m, k) for k in LINE if k not in ("round", "line", "failure")}
    failure = (m.failure or {}).get("kind")
    return {**out, "round": round_name, "line": shared_line(m.config), "failure": failure}


def build_record(result: StudyResult) -> dict[str, Any]:
    """The record of ``result``: the schema's fields only, every value from the result (nothing probed here)."""
    if result.model is None or result.finish.winner is None:
        raise UsageError(f"result {result.study} has no printed line to share: share a finished auto-tune result")
    hw, eng, load = result.hardware or {}, result.engine or {}, result.workload or {}
    fin = result.finish
    decision = fin.decision
    shipped = decision.shipped or fin.winner
    assert shipped is not None  # checked above
    card = ({"name": hw.get("gpu") or "GPU", "vram_total_bytes": int(hw.get("vram_total_bytes") or 0),
             "vram_budget_bytes": hw.get("vram_budget_bytes")} if hw.get("has_gpu")
            else {"name": CPU_CARD, "vram_total_bytes": 0, "vram_budget_bytes": None})
    card |= {"driver": hw.get("driver"), "pcie_link": hw.get("pcie_link")}
    record: dict[str, Any] = {
        "schema": SCHEMA, "version": SCHEMA_VERSION, "tool": f"moe-tune {__version__}", "card": card,
        "host": {"ram_total_bytes": hw.get("ram_total_bytes"), "physical_cores": hw.get("physical_cores"),
                 "cpu_model": hw.get("cpu_model")},
        "engine": {k: v for k, v in EngineIdentity.from_dict(eng).to_dict().items() if k in ENGINE},
        "model": model_identity(Path(result.model), result.model_fingerprint),
        "workload": {k: load.get(k) for k in WORKLOAD},
        "lines": [_line(m, "selection") for m in (*fin.baselines, *fin.candidates)]
        + [_line(m, "confirmation") for m in fin.confirmation],
        "verdicts": [{k: getattr(v, k) for k in VERDICT} for v in decision.verdicts
                     if all(math.isfinite(x) for x in (v.ratio, v.low, v.high, v.noise_pct))],
        "printed": {"label": shipped.label, "line": shared_line(shipped.config), "why": decision.reason},
        "speedup_vs_default": result.speedup.get("default"), "speedup_vs_fit": result.speedup.get("fit"),
    }
    record["lines"] = record["lines"][:MAX_LINES]
    return _check(record, TOP, "")  # what is shared passes the same gate as what is read


def record_bytes(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()


def record_id(record: dict[str, Any]) -> str:
    """Content-addressed: sharing the same result twice writes the same file (no second record)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
