"""Tuned results on this machine, and whether a result's line still holds here now.

A line is measured on one engine build, one card with so much VRAM free, and one model file. ``serve`` (and the
MCP ``results`` tool) look before they launch: the engine's commit and backend against the result's ``engine``
record, the card and its free VRAM against the ``hardware`` record and the line's measured VRAM peak, the model
file against the time the result was written. What a result does not record well enough to check is said too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.errors import TunerError, UsageError
from tuner.engine import build
from tuner.engine.identity import EngineIdentity, same_commit
from tuner.machine import hardware
from tuner.models import fingerprint
from tuner.report.handover import Pick
from tuner.search.result import RESULT_FILE, StudyResult, load_result
from tuner.search.verdict import Verdict

MIB = 2**20


@dataclass(frozen=True, slots=True)
class Found:
    """A result on disk: its file, its contents, and when it was written (the file's modification time)."""

    file: Path
    result: StudyResult
    written_s: float

    @property
    def model(self) -> Path | None:
        return Path(self.result.model) if self.result.model else None

    def verdicts(self) -> list[str]:
        return [Verdict.from_dict(v).describe() for v in self.result.finish.to_dict().get("verdicts", [])]

    def decision(self) -> str | None:
        return (self.result.finish.to_dict().get("decision") or {}).get("reason")


def found_at(path: Path) -> Found:
    """The result at ``path`` (a result.json or the folder holding one)."""
    file = path / RESULT_FILE if path.is_dir() else path
    result = load_result(file)
    return Found(file, result, file.stat().st_mtime)


def measured_by(pick: Pick, found: Found) -> Found:
    """The result whose engine measured ``pick`` (after a race across engines, the other engine's folder where the line
    is that engine's): its engine record, card and model are what the line is checked against."""
    res = pick.result
    if res is None or res.study == found.result.study:
        if res is None and pick.kind.name != EngineIdentity.from_dict(found.result.engine).engine:
            raise UsageError(f"{pick.label} was measured in {pick.kind.name}'s folder ({pick.figures.get('result')}), "
                             f"which cannot be read beside {found.file.parent}: pass that folder, or run auto-tune "
                             "again")
        return found
    file = res.source or found.file
    return Found(file, res, file.stat().st_mtime)


def find_results(results_dir: Path) -> list[Found]:
    """Every single-winner auto-tune result in ``results_dir``, newest first. Frontier results (a trade-off, not one
    line) and files this version cannot read are left out."""
    found = []
    for file in results_dir.glob(f"*/{RESULT_FILE}"):
        with contextlib.suppress(TunerError, OSError):
            f = found_at(file)
            if f.result.frontier is None:
                found.append(f)
    return sorted(found, key=lambda f: f.written_s, reverse=True)


def latest(results_dir: Path, model: Path | None = None) -> Found:
    """The newest result in ``results_dir`` (for ``model`` when given)."""
    found = find_results(results_dir)
    if model is not None:
        want = model.resolve()
        found = [f for f in found if f.model is not None and f.model.resolve() == want]
    # After `auto-tune --engines`, each engine's result holds the head to head: the one whose engine printed the line.
    found = [f for f in found if (f.result.engines or {}).get("chosen", True)] or found
    if not found:
        what = f"for {model}" if model is not None else "at all"
        raise UsageError(f"no tuned result {what} in {results_dir}/: run `moe-tune auto-tune"
                         f"{'' if model is None else ' ' + str(model)}` first, or pass --results-dir or a result "
                         "folder")
    return found[0]


@dataclass(frozen=True, slots=True)
class Now:
    """What the line would run on here and now."""

    engine_commit: str
    engine_backend: str
    gpu_name: str  # "" without an NVIDIA GPU
    vram_free_bytes: int
    engine: str = "llama.cpp"  # which kind of engine (tuner.engine.kinds)


def probe_now(loc: build.EngineLocation, nvml: Any = None) -> Now:
    caps = build.capabilities(loc)
    probe = hardware.probe_gpus(nvml)
    gpu = probe.gpus[0] if probe.gpus else None
    return Now(caps.commit, caps.backend, gpu.name if gpu else "", gpu.free_bytes if gpu else 0, caps.kind.name)


@dataclass(frozen=True, slots=True)
class Measured:
    """What a line's own measurement says of its VRAM (a finish's arm, or a race's)."""

    vram_growth_bytes: int | None  # how far the line grew the card's use (None: not read)
    vram_peak_bytes: int | None = None  # the card's whole use during the trial, other programs' included


def _raced(res: StudyResult, label: str) -> list[Measured]:
    """The race's rounds of ``label`` (a run across engines), as one measurement: the most they grew the card's use."""
    arm = next((a for a in ((res.engines or {}).get("head_to_head") or {}).get("arms", []) if a["label"] == label),
               None)
    if arm is None:
        return []
    grew = [r["vram_growth_bytes"] for r in (*arm.get("selection", []), *arm.get("rounds", []))
            if r.get("vram_growth_bytes") is not None]
    return [Measured(max(grew) if grew else None)]


@dataclass(frozen=True, slots=True)
class LineCheck:
    changes: tuple[str, ...]  # what is no longer as measured: the line may not hold
    notes: tuple[str, ...]  # worth knowing; the line holds
    unchecked: tuple[str, ...]  # what the result does not record well enough to check

    @property
    def holds(self) -> bool:
        return not self.changes


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M")


def _unreadable(path: Path) -> str | None:
    """Why the model file at ``path`` cannot be what llama-server loads, in one line naming it; None when it is a
    regular file this user can open for reading (opened non-blocking: a FIFO there is named, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"the model file {path} is gone"
    except OSError as exc:
        return f"the model file {path} cannot be read ({exc.strerror or exc}): make it readable for this user"
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    if stat.S_ISDIR(mode):
        return f"the model file {path} is a directory now, not the tuned GGUF file"
    if not stat.S_ISREG(mode):
        return f"the model file {path} is not a regular file now, not the tuned GGUF file"
    return None


def _model_changes(paths: Iterable[Path], written_s: float, recorded: dict[str, Any] | None = None
                   ) -> tuple[list[str], list[str]]:
    """What changed about the model files, and notes. The first file (the model) is checked by its fingerprint
    when the result recorded one (tuner.models.fingerprint): a copied or re-downloaded identical file holds
    whatever its modification time; otherwise, and for a draft model, by modification time."""
    changes: list[str] = []
    notes: list[str] = []
    for i, path in enumerate(paths):
        unreadable = _unreadable(path)
        if unreadable:
            changes.append(unreadable)
            continue
        mtime = path.stat().st_mtime
        if i == 0 and recorded:
            try:
                why = fingerprint.differs(recorded, path)
            except OSError as exc:  # changed between the look and the read
                changes.append(f"the model file {path} cannot be read ({exc.strerror or exc})")
                continue
            if why:
                changes.append(f"the model file {path} is not the file that was tuned: {why}")
            elif mtime > written_s:
                notes.append(f"the model file {path} was modified at {_when(mtime)}, after the tune; its contents "
                             "are the tuned file's (size and sampled hashes)")
        elif mtime > written_s:
            changes.append(f"the model file {path} was modified at {_when(mtime)}, after the tune ({_when(written_s)})")
    return changes, notes


def _engine_changes(engine: dict[str, Any] | None, now: Now) -> tuple[list[str], list[str]]:
    if not engine:
        return [], ["the engine (the result records none)"]
    then = EngineIdentity.from_dict(engine)
    here = EngineIdentity(now.engine_commit, backend=now.engine_backend, engine=now.engine)
    moved = then.backend != here.backend or then.engine != here.engine or (
        then.known and here.known and not same_commit(then.commit, here.commit))
    if moved or then.known != here.known:
        return [f"the engine is {here.describe()} now; the line was measured on {then.describe()}"], []
    if not here.known:
        return [], [f"the engine: {here.name} reports no commit, so the line cannot be tied to the build it was "
                    "measured on"]
    return [], []


def _vram_changes(hw: dict[str, Any] | None, own: Measured | None, now: Now, on_cpu: bool
                  ) -> tuple[list[str], list[str], list[str]]:
    """The card and its free VRAM against the budget the line was tuned for and the VRAM the line itself took:
    changes, notes and what could not be checked.

    Like with like: free VRAM now already leaves out what other programs hold (a desktop, the driver), so it is
    compared with the line's own growth over the sampler's first look (``vram_growth_bytes``), not with the card's
    peak use during the trial, which counts the desktop too."""
    if not hw:
        return [], [], []
    if not hw.get("has_gpu"):
        if now.gpu_name and now.engine_backend != "cpu" and not on_cpu:
            return [f"the line was measured without a GPU; {now.gpu_name} is visible now and llama-server would "
                    "offload to it"], [], []
        return [], [], []
    if not now.gpu_name:
        return [f"the line was measured on {hw.get('gpu')}; no NVIDIA GPU is visible now"], [], []
    if now.gpu_name != hw.get("gpu"):
        return [f"the card is {now.gpu_name} now; the line was measured on {hw.get('gpu')}"], [], []
    budget = int(hw.get("vram_budget_bytes") or 0)
    free = f"{now.vram_free_bytes / MIB:,.0f} MiB of VRAM is free now"
    tuned = f"tuned with a budget of {budget / MIB:,.0f} MiB"
    line_bytes = own.vram_growth_bytes if own is not None else None
    if line_bytes is None:
        unchecked = [] if own is None or own.vram_peak_bytes is None else [
            "the line's own VRAM (this result records only the card's whole use during the trial, other programs' "
            "included: checked against the budget instead; a new auto-tune records it)"]
        if now.vram_free_bytes < budget:
            return [f"{free}, {tuned} (the line's own VRAM was not measured): close what holds VRAM"], [], unchecked
        return [], [], unchecked
    took = f"the line itself took {line_bytes / MIB:,.0f} MiB"
    if now.vram_free_bytes < line_bytes:
        return [f"{free}, {took} when measured ({tuned}): close what holds VRAM"], [], []
    if now.vram_free_bytes < budget:
        return [], [f"{free}, below the budget it was tuned for ({budget / MIB:,.0f} MiB); {took}, which fits"], []
    return [], [], []


def check(found: Found, config: dict[str, Any], label: str, now: Now) -> LineCheck:
    """Whether the line of ``config`` (the pick labelled ``label``) still holds on ``now``."""
    res = found.result
    models = [Path(config["model"])] + ([Path(config["draft_model"])] if config.get("draft_model") else [])
    changes, model_notes = _model_changes(models, found.written_s, res.model_fingerprint)
    unchecked = [] if res.model_fingerprint else [
        "the model file's contents (this result records no fingerprint: a file replaced without a newer "
        "modification time would pass; a new auto-tune records one)"]
    engine_changes, engine_unchecked = _engine_changes(res.engine, now)
    arms = [Measured(m.vram_growth_bytes, m.vram_peak_bytes) for m in (*res.finish.candidates, *res.finish.baselines,
                                                                       *res.finish.confirmation) if m.label == label]
    measured = max(arms + _raced(res, label), key=lambda m: (m.vram_growth_bytes is not None,
                                                             m.vram_growth_bytes or 0, m.vram_peak_bytes or 0),
                   default=None)
    if not res.hardware:
        unchecked.append("the card and its free VRAM (the result records no hardware)")
    vram_changes, vram_notes, vram_unchecked = _vram_changes(res.hardware, measured, now,
                                                             config.get("device") == "none")
    return LineCheck(tuple(changes + engine_changes + vram_changes), tuple(model_notes + vram_notes),
                     tuple(unchecked + engine_unchecked + vram_unchecked))
