"""A shared record built from result.json: one auto-tune result as others may read it.

What goes in (docs/sharing.md): the card, the host's size, the engine, the model by Hub id or fingerprint, the
workload, every line the finish measured with its figures, spread, verdicts and spill, the printed line with why,
and the sharer (this installation's random id, :mod:`tuner.share.sharer`). A run that raced engines shares the line
the race printed, from whichever engine's folder: the engine that ran it, its verdict against llama.cpp's default,
and the race's lines of that engine (a record speaks one engine's flags). A line its price refused is never shared.
What never does: paths (a line names the model by its file name, rendered by the flag layer), the host name, the
user, serial numbers, failure logs (their argv and stderr hold paths). Whether the Hub repo is named at all is the
sharing step's to decide (:func:`tuner.share.store.share`: only a public repo, or one the user names).

A record is built to pass the reading gate (:mod:`tuner.share.gate`) whole: text is cut to the gate's bound, not
refused, and the built record is read back through the gate before anything is sent.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from tuner import __version__
from tuner.core.errors import RecordError, UsageError
from tuner.engine import flags
from tuner.engine.identity import EngineIdentity
from tuner.hub.repos import quant_name
from tuner.search.finish import ServerMeasurement
from tuner.search.result import Race, RaceLine, StudyResult, race_of, race_result, refused_price
from tuner.search.trials import config_from_dict
from tuner.search.verdict import Verdict
from tuner.share.gate import (
    CPU_CARD,
    ENGINE,
    LINE,
    MAX_LINES,
    MAX_RATIO,
    MAX_TEXT,
    SCHEMA,
    SCHEMA_VERSION,
    VERDICT,
    WORKLOAD,
    read_record,
)

_HF_CACHE_DIR = re.compile(r"^(?:models|datasets)--(?P<owner>[\w.-]+?)--(?P<name>[\w.-]+)$")


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
    if size is None and not path.is_file():
        # A record of a model of 0 bytes is refused by every look-up (tuner.share.gate): none is shared.
        raise UsageError(f"{path} is gone and this result predates model fingerprints, so its size is unknown: "
                         "restore the file, or tune it again and share that result")
    if size is None:
        size = path.stat().st_size
    return {"hub_repo": hub_repo, "hub_file": hub_file, "file_name": path.name, "quant": quant_name(path.name),
            "size_bytes": int(size), "head_sha256": fp.get("head_sha256"), "tail_sha256": fp.get("tail_sha256")}


def without_hub_repo(record: dict[str, Any]) -> dict[str, Any]:
    """The record naming its model by file name and fingerprint only."""
    return record | {"model": record["model"] | {"hub_repo": None, "hub_file": None}}


def shared_line(config: dict[str, Any]) -> str:
    """A measured config's launch line with every model named by its file name (rendered by the flag layer)."""
    cfg = config_from_dict(config)
    cfg = replace(cfg, model=Path(cfg.model.name),
                  draft_model=Path(cfg.draft_model.name) if cfg.draft_model is not None else None)
    return flags.launch_line(cfg)


def fitted(text: Any) -> Any:
    """A string as a record holds it: one printable line of at most the gate's length, cut with an ellipsis."""
    if not isinstance(text, str):
        return text
    flat = "".join(c if c.isprintable() else " " for c in text)
    return flat if len(flat) <= MAX_TEXT else flat[:MAX_TEXT - 1] + "…"


def _line(m: ServerMeasurement, round_name: str) -> dict[str, Any]:
    out = {k: getattr(m, k) for k in LINE if k not in ("round", "line", "failure", "spill")}
    failure = (m.failure or {}).get("kind")
    return {**out, "round": round_name, "line": shared_line(m.config), "failure": fitted(failure),
            "spill": fitted(m.spill)}


def build_record(result: StudyResult, sharer: str | None) -> dict[str, Any]:
    """The record of ``result``: the schema's fields only, every value from the result (nothing probed here);
    :class:`UsageError` in one line when it would not pass the reading gate, or has no line to run to share."""
    refused = refused_price(result)
    if refused is not None:
        raise UsageError(f"result {result.study}'s printed line was refused by its price ({refused}): a line not to "
                         "run is not shared; tune with --engines llama.cpp and share that result")
    race = race_of(result)
    if race is not None:
        return _race_record(result, race, sharer)
    if result.model is None or result.finish.winner is None:
        raise UsageError(f"result {result.study} has no printed line to share: share a finished auto-tune result")
    fin = result.finish
    decision = fin.decision
    shipped = decision.shipped or fin.winner
    assert shipped is not None  # checked above
    record = _about(result, sharer) | {
        "lines": [_line(m, "selection") for m in (*fin.baselines, *fin.candidates)]
        + [_line(m, "confirmation") for m in fin.confirmation],
        "verdicts": _verdicts(decision.verdicts),
        "printed": {"label": fitted(shipped.label), "line": shared_line(shipped.config),
                    "why": fitted(decision.reason)},
        "speedup_vs_default": _ratio(result.speedup.get("default")),
        "speedup_vs_fit": _ratio(result.speedup.get("fit")),
    }
    record["lines"] = record["lines"][:MAX_LINES]
    return checked(record, result.study)


def _about(result: StudyResult, sharer: str | None) -> dict[str, Any]:
    """What a record says of where and how its lines were measured: the card, the host, the engine that ran the printed
    line (``result``'s), the model and the workload."""
    hw, eng, load = result.hardware or {}, result.engine or {}, result.workload or {}
    card = ({"name": fitted(hw.get("gpu") or "GPU"), "vram_total_bytes": int(hw.get("vram_total_bytes") or 0),
             "vram_budget_bytes": hw.get("vram_budget_bytes")} if hw.get("has_gpu")
            else {"name": CPU_CARD, "vram_total_bytes": 0, "vram_budget_bytes": None})
    card |= {"driver": fitted(hw.get("driver")), "pcie_link": fitted(hw.get("pcie_link"))}
    if result.model is None:
        raise UsageError(f"result {result.study} names no model: share a finished auto-tune result")
    return {
        "schema": SCHEMA, "version": SCHEMA_VERSION, "tool": f"moe-tune {__version__}", "sharer": sharer,
        "card": card,
        "host": {"ram_total_bytes": hw.get("ram_total_bytes"), "physical_cores": hw.get("physical_cores"),
                 "cpu_model": fitted(hw.get("cpu_model"))},
        # The engine that ran, as its one owner spells it (tuner.engine.identity), each string cut to the gate's size.
        "engine": {k: fitted(v) for k, v in EngineIdentity.from_dict(eng).to_dict().items() if k in ENGINE},
        "model": model_identity(Path(result.model), result.model_fingerprint),
        "workload": {k: fitted(load.get(k)) for k in WORKLOAD},
    }


def _verdicts(verdicts: Any) -> list[dict[str, Any]]:
    return [{k: fitted(getattr(v, k)) for k in VERDICT} for v in verdicts
            if all(math.isfinite(x) and x >= 0 for x in (v.ratio, v.low, v.high, v.noise_pct))
            and _in_range(v.ratio) and v.low <= v.ratio <= v.high][:MAX_LINES]


def _race_record(result: StudyResult, race: Race, sharer: str | None) -> dict[str, Any]:
    """The race's printed line as a record of the engine that ran it: that engine's folder gives the engine; its lines
    that raced and are still in, with the race's figures, are the record's lines; its verdict against llama.cpp's
    default comes first."""
    printed = race.printed_line
    if printed is None:
        raise UsageError(f"{race.why_none}: nothing to share")
    ran = race_result(result, printed)
    if ran is None:
        raise UsageError(f"the run printed {printed.engine}'s line ({printed.label}): its result is in "
                         f"{printed.result_dir}, which cannot be read here: share that folder's result.json")
    raced = [x for x in race.lines if x.engine == printed.engine and not x.withheld and x is not printed
             and any(v is not None for v in x.figures.values())]  # a line never raced has no figures to share
    mine = [printed, *raced]
    first = Verdict.from_dict(printed.against_default) if printed.against_default else None
    record = _about(ran, sharer) | {
        "lines": [_race_line(x) for x in mine][:MAX_LINES],
        "verdicts": _verdicts([Verdict.from_dict(x.against_default) for x in mine if x.against_default]),
        "printed": {"label": fitted(printed.label), "line": shared_line(printed.config), "why": fitted(race.reason)},
        "speedup_vs_default": _ratio(first.ratio) if first is not None else None,
        "speedup_vs_fit": None,
    }
    return checked(record, ran.study)


def _race_line(x: RaceLine) -> dict[str, Any]:
    """A race's line as a record's: the race's medians (one request alone), no spread (the race judges by verdicts)."""
    f = x.figures
    return {"label": fitted(x.label), "round": "race", "line": shared_line(x.config),
            "slots": int(x.config.get("parallel") or 1), "gen_tok_s": f.get("gen_tok_s"), "gen_cv_pct": None,
            "prompt_tok_s": f.get("prompt_tok_s"), "ttft_s": f.get("ttft_s"), "loaded_gen_tok_s": None,
            "end_to_end_gen_tok_s": None, "vram_peak_bytes": None, "spill": None,
            "kld_mean": (x.price or {}).get("kld_mean"), "failure": None}


def _in_range(ratio: float) -> bool:
    return 1 / MAX_RATIO <= ratio <= MAX_RATIO


def _ratio(x: float | None) -> float | None:
    """A speed-up the gate reads (a verdict beyond 1/100..100x is no measurement of one card: left out)."""
    return x if x is not None and math.isfinite(x) and _in_range(x) else None


def checked(record: dict[str, Any], study: str) -> dict[str, Any]:
    """``record`` as the reading gate gives it back (what is shared is exactly what others read)."""
    try:
        return read_record(record_bytes(record), record_id(record)).data
    except RecordError as exc:
        why = str(exc).split(" skipped: ", 1)[-1]
        raise UsageError(f"result {study} cannot be shared: {why}") from None


def record_bytes(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()


def record_id(record: dict[str, Any]) -> str:
    """Content-addressed: sharing the same result twice writes the same file (no second record)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
