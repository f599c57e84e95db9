"""What the MCP tools answer, as JSON-safe dicts built from the library calls the commands make: ``plan`` from
:func:`tuner.plan.placement.make_plan` as ``moe-tune plan --json`` writes it (:mod:`tuner.report.plan_doc`), ``quants``
from the Hub listing and one quant's header (``moe-tune quants --json``), ``results`` from the results on disk and
the check ``serve`` makes before it starts, ``launch_line`` as ``moe-tune launch-line`` renders it: both hand out what
:func:`tuner.report.handover.of` hands out (after a race across engines, the line the race printed, from either
engine's folder; never a line its price refused). Nothing here measures, starts a server or downloads model data.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.catalog import cards, families
from tuner.core.errors import EngineNotFoundError, TunerError, UnknownQuantError, UsageError
from tuner.engine import build
from tuner.engine.kinds import EngineKind
from tuner.plan.placement import fit_verdict, scaled
from tuner.report import handover, line_check, plan_doc
from tuner.search.result import load_result
from tuner.search.verdict import Verdict


def plan(model: str, card: str | None = None, context: int | None = None, ram_gib: float | None = None,
         host_bandwidth_gb_s: float | None = None, llama_cpp_dir: Path | None = None) -> dict[str, Any]:
    """VRAM, RAM, verdict and speed ceilings per --n-cpu-moe for ``model`` on ``card`` (this machine when None),
    with the defaults of ``moe-tune plan`` (f16 KV, flash attention auto, mmap): its document, from its builder."""
    if context is not None and context < 1:
        raise UsageError(f"context must be >= 1 token, got {context}")
    if ram_gib is not None and ram_gib <= 0:
        raise UsageError(f"ram_gib {ram_gib:g} leaves nothing to plan for: give the host RAM in GiB, e.g. 64")
    from tuner.hub.resolve import resolve_model

    resolved = resolve_model(model, header_only=True)
    req = plan_doc.PlanRequest(resolved.path, resolved.source, gpu=card, ram_gib=ram_gib,
                               host_bandwidth_gb_s=host_bandwidth_gb_s, ctxs=(context,) if context else (),
                               llama_cpp_dir=llama_cpp_dir)
    return plan_doc.build(req).document()


def quants(repo: str, card: str | None = None, context: int = 8192, revision: str = "main") -> dict[str, Any]:
    """Every quant of a Hugging Face repo with its size, parts and fit verdict on ``card`` at ``context``; the
    architecture from one quant's GGUF header (range requests, no tensor data)."""
    from tuner.hub import remote_header, repos

    ref = repos.parse_hub_ref(repo)
    if ref is None:
        raise UsageError(f"{repo} is not a Hugging Face repo name: use owner/name, e.g. unsloth/Qwen3-30B-A3B-GGUF")
    listing = repos.list_quants(ref.repo_id, revision=revision)
    if not listing.quants:
        raise UsageError(f"{ref.repo_id} holds no GGUF files: pick a GGUF repo (names often end in -GGUF)")
    try:
        probe = listing.get(ref.quant or repos.DEFAULT_QUANT)
    except UnknownQuantError:
        if ref.quant:
            raise
        probe = listing.quants[0]
    headers = remote_header.read_quant_headers(ref.repo_id, probe, commit=listing.commit or revision)
    model = headers.model_info()
    hw = cards.machine(card)
    size = probe.total_bytes or 1
    known = families.find_model(ref.repo_id)
    return {
        "repo": listing.repo_id, "revision": listing.revision, "commit": listing.commit, "ctx": context,
        "hardware": hw.describe(), "header_of": probe.name, "architecture": model.arch,
        "n_layer": model.n_layer, "n_expert": model.n_expert, "n_expert_used": model.n_expert_used,
        "quants": [{"name": q.name, "n_parts": q.n_parts, "total_bytes": q.total_bytes,
                    "fit": fit_verdict(scaled(model, (q.total_bytes or size) / size), context, hw),
                    "published": [{"gpu": f.gpu, "ctx": f.ctx, "settings": f.settings, "figures": dict(f.figures),
                                   "source": known.sources[f.source]} for f in known.figures_for(q.name)]
                    if known else []}
                   for q in listing.quants],
    }


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).isoformat(timespec="seconds")


def _line_entry(f: line_check.Found, now: Callable[[EngineKind], line_check.Now | str],
                llama_cpp_dir: Path | None) -> dict[str, Any]:
    hand = handover.of(f.result)
    pick = hand.printed
    if pick is None:
        return {"line": None, "why": hand.why_none, "never_handed_out": list(hand.withheld)}
    race = hand.race
    measured = line_check.measured_by(pick, f)
    verdicts = ([Verdict.from_dict(pick.figures["against_llama_cpp_default"]).describe()]
                if race is not None and pick.figures.get("against_llama_cpp_default") else
                [] if race is not None else f.verdicts())
    entry: dict[str, Any] = {"label": pick.label, "engine": pick.kind.name, "measured_in": str(measured.file),
                             "line": handover.render(pick, llama_cpp_dir=llama_cpp_dir), "figures": pick.figures,
                             "why": race.reason if race is not None else f.decision(), "verdicts": verdicts,
                             "never_handed_out": list(hand.withheld)}
    here = now(pick.kind)
    if isinstance(here, str):
        return entry | {"still_holds": {"holds": None, "not_checked": [here]}}
    c = line_check.check(measured, pick.config, pick.label, here)
    return entry | {"still_holds": {"holds": c.holds, "changes": list(c.changes), "notes": list(c.notes),
                                    "not_checked": list(c.unchecked)}}


def results(results_dir: Path, llama_cpp_dir: Path | None = None) -> dict[str, Any]:
    """The tuned results in ``results_dir``, newest first: each one's line (after a race across engines, the line the
    race printed, whichever engine's folder), why it was chosen, its verdicts, and whether it still holds here (the
    check ``moe-tune serve`` makes before it starts, on the line's own engine)."""
    found = line_check.find_results(results_dir)
    probed: dict[str, line_check.Now | str] = {}

    def now(kind: EngineKind) -> line_check.Now | str:
        if kind.name not in probed:
            try:
                probed[kind.name] = line_check.probe_now(build.locate_engine(llama_cpp_dir, kind))
            except EngineNotFoundError as exc:
                probed[kind.name] = str(exc)
        return probed[kind.name]

    listed = []
    for f in found:
        entry: dict[str, Any] = {"result": str(f.file), "study": f.result.study, "model": f.result.model,
                                 "written": _when(f.written_s), "engine": f.result.engine,
                                 "machine": (f.result.hardware or {}).get("describe"),
                                 "workload": f.result.workload}
        try:
            listed.append(entry | _line_entry(f, now, llama_cpp_dir))
        except (TunerError, OSError) as exc:  # one result's trouble is its own entry, not the whole answer's
            listed.append(entry | {"line": None, "error": str(exc)})
    return {"results_dir": str(results_dir.absolute()), "results": listed}


def launch_line(result: str, fmt: str = "shell", rank: int = 1, host: str | None = None, port: int | None = None,
                llama_cpp_dir: Path | None = None) -> str:
    """The ``rank``-th line a result hands out as ``fmt``, as ``moe-tune launch-line`` prints it; what a format cannot
    carry is written into it."""
    return handover.render(handover.of(load_result(Path(result))).at(rank), fmt, host=host, port=port,
                           llama_cpp_dir=llama_cpp_dir)
