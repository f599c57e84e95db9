"""The benchmark harness: every ``scripts/bench_*.py`` measures through this module, so each one holds the machine's
measuring lock, is watched while it measures (:class:`tuner.machine.quiet.Watch`), records the load it ran
under, and writes its figures with the command that made them. A new benchmark is then a page: build a grid,
hand :func:`measure_grid` a function that measures a chunk of it, read the rows.

- :func:`machine` holds the lock of :mod:`tuner.machine.quiet` (waiting while another measuring run holds it).
  CPU load from other programs does not stop a benchmark on a shared machine; it is recorded instead.
- :func:`watched` runs one measurement under a watch and keeps the worst interference the watch saw.
- :class:`GridCache` keeps a grid's rows in ``results/benchmarks/NAME.json`` (key, ``measured_at``, rows, and
  the load of every run that measured some of them), saved after every chunk: a run cut short resumes where it
  stopped; a changed key starts over.
- :func:`measure_grid` measures every config, then re-measures each row whose kept pass fails the CV gate, up
  to ``max_passes``; the kept pass of a row is the one that passes the gate, else the median of its passes by
  ``rank`` (best-of-N would keep the luckiest of noisy passes). Every pass keeps what its watch saw.
  ``cached_only`` reads what an unfinished grid holds, and says so.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tuner.core.errors import MachineBusyError
from tuner.engine import runner
from tuner.machine import quiet
from tuner.machine.processes import Interference
from tuner.search import study

OUT = Path(__file__).resolve().parent.parent / "results" / "benchmarks"
LOCK_WAIT_S = 3600.0  # how long a benchmark waits for another measuring run to let go of the machine
LOCK_POLL_S = 2.0
CV_GATE_PCT = 10.0  # a row whose repetitions spread wider than this is measured again
T = TypeVar("T")


class Log:
    """Figures printed as they come (flushed, so a log file follows along) and kept for the markdown file."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.command = shlex.join([".venv/bin/python", f"scripts/{Path(sys.argv[0]).name}", *sys.argv[1:]])

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: Path, title: str, preface: str = "") -> None:
        """The kept lines as a markdown page: title, the command and when, the preface, the figures."""
        head = f"# {title}\n\nMade by `{self.command}` on {time.strftime('%Y-%m-%d %H:%M')}.\n\n"
        path.write_text(head + (preface.strip() + "\n\n" if preface else "") + "```text\n"
                        + "\n".join(self.lines) + "\n```\n")


def progress(line: str) -> None:
    """A progress line: printed and flushed, not kept with the figures."""
    print(f"  {line}", flush=True)


@dataclass
class LoadRecord:
    """What the machine carried while a benchmark measured: the 1-minute load average at start and end, the
    most CPU cores other processes used during any watched measurement, and how many were disturbed.
    ``start_noise``: what the claim found busy when the hold began (None: quiet)."""

    start_loadavg: float = field(default_factory=lambda: os.getloadavg()[0])
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    end_loadavg: float | None = None
    worst_cpu_cores: float = 0.0
    watched: int = 0
    disturbed: int = 0
    locked: bool = True
    start_noise: str | None = None

    def saw(self, seen: Interference) -> None:
        self.watched += 1
        self.disturbed += seen.busy
        self.worst_cpu_cores = max(self.worst_cpu_cores, seen.cpu_cores)

    def describe(self) -> str:
        end = os.getloadavg()[0] if self.end_loadavg is None else self.end_loadavg
        lock = "" if self.locked else "; measured WITHOUT the machine lock"
        return (f"1-min load average {self.start_loadavg:.2f} at start, {end:.2f} at end, on {self.cores} cores; "
                f"{self.disturbed} of {self.watched} watched measurements disturbed (other processes used up to "
                f"{self.worst_cpu_cores:.1f} cores){lock}")


def ours() -> set[int]:
    """This script and everything it started (llama.cpp tools, moe-tune commands): none of it is interference."""
    return {os.getpid(), *runner.own_pids()}


_HELD: list[LoadRecord] = []  # the record of the machine this process holds (machine() is re-entrant)
_WATCHING: list[quiet.Watch] = []  # the watches running now, innermost last (a bench main's whole-run watch first)


def held() -> LoadRecord:
    """The record of the machine this process holds (inside a :func:`bench` main): a script reads its claim here
    instead of claiming again (a second ``flock`` of the lock file in the same process fails, and the script
    would report itself as the rival)."""
    if not _HELD:
        raise RuntimeError("no machine held: run the benchmark's main under @harness.bench")
    return _HELD[-1]


def watching() -> quiet.Watch:
    """The outermost watch running now (a :func:`bench` main's whole-run watch, which counts this process's
    children as its own): a script reads what it saw instead of starting a second watch."""
    if not _WATCHING:
        raise RuntimeError("no watch running: run the benchmark's main under @harness.bench")
    return _WATCHING[0]


@contextlib.contextmanager
def _held(rec: LoadRecord, say: Callable[[str], None], note: str = "") -> Iterator[LoadRecord]:
    """``rec`` as the record of the machine this process holds, its load said when the hold ends."""
    _HELD.append(rec)
    try:
        yield rec
    finally:
        _HELD.pop()
        rec.end_loadavg = os.getloadavg()[0]
        say(f"load: {rec.describe()}{note}")


@contextlib.contextmanager
def machine(command: str, say: Callable[[str], None] = print, wait_s: float = LOCK_WAIT_S, *,
            children_claim: bool = False) -> Iterator[LoadRecord]:
    """Hold the machine's measuring lock for a benchmark: wait (at most ``wait_s``) while another measuring run
    holds it. Other programs' CPU load does not stop the benchmark: :func:`watched` records it per measurement
    and the record's line is said at the end. ``children_claim``: the benchmark runs moe-tune commands that
    take the lock themselves (holding it here would make them wait for us), so only the load is recorded.
    Re-entrant: inside a held machine (a :func:`bench` main) it yields the record already held."""
    if _HELD:
        yield _HELD[-1]
        return
    if children_claim:
        with _held(LoadRecord(locked=True), say, " (the lock held by each moe-tune command it ran)") as rec:
            yield rec
        return
    def waiting(what: str, waited_s: float) -> None:
        progress(f"{what} ({waited_s:.0f} s of {wait_s:.0f} s)")

    with contextlib.ExitStack() as stack:
        try:
            claim: quiet.Claim | None = stack.enter_context(quiet.claim_machine(
                f"benchmark {command}", allow_busy=True, own=ours, wait_s=wait_s, on_wait=waiting))
            noise = claim.noise if claim is not None else None
        except MachineBusyError as exc:  # another measuring run held it all along: go ahead, saying who
            claim, noise = None, str(exc)
        if noise:
            say(f"machine at start: {noise}")
        with _held(LoadRecord(locked=claim is not None and claim.locked, start_noise=noise), say) as rec:
            yield rec


def watched(fn: Callable[[], T], rec: LoadRecord | None = None) -> tuple[T, str | None]:
    """``fn()`` under a watch; what else used the machine meanwhile (None: quiet) is returned and recorded in
    ``rec`` (default: the held machine's record)."""
    with quiet.Watch(own=ours) as watch:
        _WATCHING.append(watch)
        try:
            out = fn()
        finally:
            _WATCHING.pop()
    if rec is not None or _HELD:
        (rec or _HELD[-1]).saw(watch.seen)
    return out, watch.noise


def bench(command: str, *, children_claim: bool = False) -> Callable[[Callable[[], T]], Callable[[], T]]:
    """A benchmark's ``main``, run holding the machine (:func:`machine`) and watched from start to end, so no
    benchmark measures outside the lock and the watch; measurements inside add their own :func:`watched`."""
    def wrap(main: Callable[[], T]) -> Callable[[], T]:
        @functools.wraps(main)
        def run() -> T:
            with machine(command, children_claim=children_claim):
                out, noise = watched(main)
            print(f"whole run watched: {'quiet' if noise is None else 'busy: ' + noise}", flush=True)
            return out
        return run
    return wrap


def config_id(config: dict[str, Any]) -> str:
    """A config's identity in a cache: read back into a LaunchConfig first, so a setting added to LaunchConfig
    after the grid was measured (at its default, i.e. not set) leaves the cached rows usable. A row that is not
    a launch config (no model) is keyed as it is."""
    if "model" in config:
        config = study.config_to_dict(study.config_from_dict(config))
    return json.dumps(config, sort_keys=True)


class GridCache:
    """A grid's measured rows (each with a ``config`` dict) in ``results/benchmarks/NAME``, under ``key``, and
    ``runs``: one entry per run that measured some of them (when, how many measurements, the load it ran
    under), so a grid finished by a resumed run still says what the earlier runs carried."""

    def __init__(self, name: str, key: dict[str, Any], *, refresh: bool = False, folder: Path = OUT) -> None:
        self.path = folder / name
        self.key = key
        data = json.loads(self.path.read_text()) if self.path.is_file() and not refresh else {}
        same = data.get("key") == key
        self.rows: dict[str, dict[str, Any]] = {config_id(r["config"]): r for r in data.get("rows", [])} if same else {}
        self.measured_at: str | None = data.get("measured_at") if same else None
        self.complete: bool = bool(same and data.get("complete", True))
        self.elapsed_s: float = float(data.get("elapsed_s", 0.0)) if same else 0.0
        # A cache written before runs were kept holds one load line: the last run's, kept as the only one known.
        old = [{"measured_at": data.get("measured_at"), "load": data["load"]}] if data.get("load") else []
        self.runs: list[dict[str, Any]] = list(data.get("runs", old)) if same else []
        self._run: int | None = None  # this run's index in ``runs``, once it has saved

    @property
    def load(self) -> str | None:
        """The load of every run that measured rows, in order; None before any."""
        if len(self.runs) <= 1:
            return self.runs[0]["load"] if self.runs else None
        return f"over {len(self.runs)} runs: " + "; ".join(
            f"run {n} ({r.get('started_at') or r.get('measured_at')}"
            + (f", {r['measurements']} measurements" if "measurements" in r else "") + f"): {r['load']}"
            for n, r in enumerate(self.runs, 1))

    def save(self, load: str, elapsed_s: float, complete: bool, measured: int = 0) -> None:
        """Save the rows, with this run's ``load`` and number of ``measured`` passes beside the earlier runs' (a
        run that measured nothing adds no entry)."""
        self.measured_at, self.complete, self.elapsed_s = time.strftime("%Y-%m-%d %H:%M:%S"), complete, elapsed_s
        if self._run is None and measured:
            self.runs.append({"started_at": self.measured_at})
            self._run = len(self.runs) - 1
        if self._run is not None:
            self.runs[self._run] |= {"measured_at": self.measured_at, "measurements": measured, "load": load}
        self.path.write_text(json.dumps({"key": self.key, "measured_at": self.measured_at, "complete": complete,
                                         "elapsed_s": round(elapsed_s, 1), "load": self.load, "runs": self.runs,
                                         "rows": list(self.rows.values())}, indent=1))

    def describe(self) -> str:
        return (f"{self.path.name}: {len(self.rows)} rows, measured {self.measured_at} in {self.elapsed_s:.0f} s "
                f"({'complete' if self.complete else 'INCOMPLETE'}); load {self.load}")


def _settled(row: dict[str, Any], cv_gate_pct: float) -> bool:
    """A row needs no more passes: it failed (a failure repeats), or its repetitions agree within the gate and
    nothing else used the machine while they ran. A disturbed row is measured again (on a machine shared all
    along every pass is disturbed: ``max_passes`` bounds it, and the kept pass says what it carried)."""
    return "failure" in row or ((row.get("cv_pct") or 0.0) <= cv_gate_pct and not row.get("noise"))


def _kept(passes: list[dict[str, Any]], rank: Callable[[dict[str, Any]], float],
          cv_gate_pct: float) -> dict[str, Any]:
    """The pass a row keeps: the median by ``rank`` of those that pass the gate, else of those that did not fail
    (of an even count the slower middle one: a real pass, and one that does not flatter); the last pass when
    every pass failed. Not the best: on a noisy machine best-of-N keeps whichever pass the noise favoured."""
    ok = [p for p in passes if "failure" not in p]
    pool = sorted([p for p in ok if _settled(p, cv_gate_pct)] or ok, key=rank)
    return pool[len(pool) // 2] if pool else passes[-1]


def measure_grid(cache: GridCache, configs: Sequence[dict[str, Any]],
                 measure: Callable[[list[dict[str, Any]]], list[dict[str, Any]]], *,
                 chunks: Callable[[list[dict[str, Any]]], list[list[dict[str, Any]]]],
                 rank: Callable[[dict[str, Any]], float], command: str, say: Callable[[str], None],
                 cv_gate_pct: float = CV_GATE_PCT, max_passes: int = 3,
                 cached_only: bool = False) -> list[dict[str, Any]]:
    """Every config's row: measured (``measure`` gets a chunk of config dicts and returns one dict each, with a
    ``cv_pct`` or a ``failure``), then measured again while its kept pass fails the gate (CV over
    ``cv_gate_pct`` or disturbed), at most ``max_passes`` passes in all; the kept pass is chosen by
    :func:`_kept` (the median by ``rank``). Resumes from the cache; saves it after each chunk, with this run's
    load beside the earlier runs'. Pass 2 and later run in reverse order, so a burst from another process does
    not hit the same configs twice."""
    ids = [config_id(c) for c in configs]
    if cached_only:  # what an unfinished grid holds so far, said as such
        say(f"PARTIAL grid: {sum(i in cache.rows for i in ids)} of {len(ids)} configs from {cache.describe()}")
        return [cache.rows[i] for i in ids if i in cache.rows]
    if cache.complete and all(i in cache.rows and (_settled(cache.rows[i], cv_gate_pct)
                                                   or len(cache.rows[i]["passes"]) >= max_passes) for i in ids):
        say(f"grid from {cache.describe()}")
        return [cache.rows[i] for i in ids]
    spent = cache.elapsed_s
    with machine(command, say) as rec:
        t0 = time.monotonic()
        measured = 0
        for n_pass in range(max_passes):
            todo = [c for c, i in zip(configs, ids, strict=True)
                    if i not in cache.rows or (len(cache.rows[i]["passes"]) <= n_pass
                                               and not _settled(cache.rows[i], cv_gate_pct))]
            if n_pass:
                todo.reverse()
            for part in chunks(todo):
                got, noise = watched(lambda part=part: measure(part), rec)  # type: ignore[misc]
                for cfg, m in zip(part, got, strict=True):
                    m = m | {"noise": noise}
                    row = cache.rows.setdefault(config_id(cfg), {"config": cfg, "passes": []})
                    row["passes"].append(m)
                    row.update(_kept(row["passes"], rank, cv_gate_pct))
                    row["cv_gate"] = "pass" if _settled(row, cv_gate_pct) else "fail"
                measured += len(part)
                cache.save(rec.describe(), spent + time.monotonic() - t0, complete=False, measured=measured)
                total = sum(len(r["passes"]) for r in cache.rows.values())
                progress(f"pass {n_pass + 1}: {len(part)} more measured; {total} measurements of {len(ids)} "
                         f"configs ({time.monotonic() - t0:.0f} s)")
        cache.save(rec.describe(), spent + time.monotonic() - t0, complete=True, measured=measured)
    say(f"grid measured: {cache.describe()}")
    return [cache.rows[i] for i in ids]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table, one line per row (numbers right-aligned)."""
    align = ["---:" if rows and isinstance(rows[0][i], int | float) else "---" for i in range(len(headers))]
    return (["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
            + ["| " + " | ".join(str(x) for x in r) + " |" for r in rows])
