"""`moe-tune auto-tune --frontier`: run the frontier study, write its files and print the front as a table.
(The option lives on `auto-tune` in :mod:`tuner.cli.cmd_tune`; this module registers no command.)

Stdout carries the answer (the table, or with ``--json`` the JSON alone); the progress (a bar on a terminal, one
line per trial otherwise) and the steps go to stderr in every mode, so a ``--json`` run is never silent."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from tuner.cli.app import err, out, say_fitted

if TYPE_CHECKING:
    from tuner.engine.build import EngineLocation
    from tuner.machine.hardware import Hardware
    from tuner.search import study
    from tuner.search.autotune import TuneRequest


REASON_CHARS = 160  # of a failure's own reason, on a trial line


def eta_s(done: int, total: int | None, elapsed_s: float, time_s: float | None) -> float | None:
    """Seconds left: the trials left at this run's pace, never past the time budget; None before the first."""
    left = [] if time_s is None else [max(0.0, time_s - elapsed_s)]
    if done and total:
        left.append(elapsed_s / done * max(0, total - done))
    return min(left) if left else None


def _clock(seconds: float | None) -> str:
    return "?" if seconds is None else f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def outcome(last: study.TrialRecord) -> str:
    """What came of a trial, in words: its request time, or why it was not measured."""
    from tuner.frontier.result import AGAIN, PAGING, unmeasured_reason

    if last.status == "measured" and last.request_s:
        return f"{last.request_s:,.3f} s/request"
    if last.status == PAGING:
        faults = (last.host_paging or {}).get("major_faults_per_token")
        rate = "" if faults is None else f", {faults:,.1f} major faults per generated token"
        return (f"{last.request_s or 0:,.3f} s/request, but it paged host RAM{rate}: kept off the front (never a "
                "line)")
    reason = unmeasured_reason(last.status, last.failure, last.constraints)
    if reason is None:
        return last.status
    told = str((last.failure or {}).get("reason") or "")
    if last.status == "failed" and told:
        reason += f" ({told if len(told) <= REASON_CHARS else told[:REASON_CHARS - 1] + '…'})"
    return reason + ("; the next run measures it" if last.status in AGAIN else "")


def trial_line(p: study.Progress, elapsed_s: float, time_s: float | None, left_s: float | None = None) -> str:
    """One line per finished trial, for logs and pipes (a terminal gets the bar instead): the trial's settings as its
    launch line spells them (every setting two trials may differ by: flash attention, load mode, an engine's own
    levers), what came of it, and the time left (``left_s``: the run's own estimate, where it knows more than this
    search's pace)."""
    left = eta_s(p.done, p.total, elapsed_s, time_s) if left_s is None else left_s
    return (f"trial {p.done}/{p.total or '?'}: {settings_words(p.last.config)}: {outcome(p.last)}; "
            f"{_clock(elapsed_s)} elapsed, about {_clock(left)} left")


def settings_words(config: dict[str, object]) -> str:
    """A trial's config as its launch line's flags after the model ("-c 4096 -np 1 -t 2 -fa on -lm none")."""
    from tuner.core.errors import TunerError
    from tuner.engine import flags
    from tuner.search.trials import config_from_dict

    try:
        words = flags.launch_line(config_from_dict(dict(config))).split()
    except (TunerError, KeyError, TypeError, ValueError):
        return str(config)
    return " ".join(words[3:]) if len(words) > 3 and words[1] == "-m" else " ".join(words[1:])


def _to_stderr(msg: str) -> None:
    say_fitted(err, msg)


def run(req: TuneRequest, loc: EngineLocation, hw: Hardware, *, max_ctx: int | None, trials: int | None,
        as_json: bool, say: Callable[[str], None]) -> None:
    """``say``: the command's step printer (silent with ``--json``, where steps still go to stderr here)."""
    from rich import box
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tuner.frontier import tune as frontier_tune
    from tuner.report import frontier_report

    live = err.is_terminal
    step = _to_stderr if as_json else say
    time_s = frontier_tune.time_budget_s(req, trials)
    start = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[eta]}"), console=err, disable=not live, transient=False) as bar:
        task = bar.add_task("frontier", total=trials, eta="")

        def on_progress(p: study.Progress) -> None:
            elapsed = time.monotonic() - start
            bar.update(task, completed=p.done, total=p.total, description=f"frontier (last: {p.last.status})",
                       eta=f"about {_clock(eta_s(p.done, p.total, elapsed, time_s))} left")
            if not live:
                step(trial_line(p, elapsed, time_s))

        done = frontier_tune.tune_frontier(req, loc, hw, max_ctx=max_ctx, trials=trials, on_progress=on_progress,
                                           on_step=step)
    if done.search.interrupted:
        step(f"interrupted after {done.search.trials_this_run} trials; run the same command again to resume "
            f"study {done.study_name}")
        raise typer.Exit(130)
    files = frontier_report.write(done.result, done.result_dir)
    front = frontier_report.frontier_of(done.result)
    assert front is not None  # tune_frontier refuses a run with no measured point
    if as_json:
        for line in frontier_report.summary_lines(front):  # for the person watching; the JSON carries them too
            step(line)
        out.print_json(json.dumps(done.result.to_dict() | {"result_dir": str(done.result_dir)}))
        return
    table = Table(title=f"frontier: {front.trials_measured} measured trials, {len(front.points)} on the front",
                  box=box.SIMPLE, pad_edge=False, collapse_padding=True)
    for col in frontier_report.headers(front):
        table.add_column(frontier_report.SHORT.get(col, col), justify="left" if col == "config" else "right",
                         no_wrap=col == "config")
    for row in frontier_report.rows(front):
        table.add_row(*row)
    out.print(table)
    for line in frontier_report.summary_lines(front):
        say_fitted(out, line)
    say_fitted(out, f"study {done.study_name} in {done.storage}")
    say_fitted(out, f"report: {done.result_dir / 'report.md'}; plots: "
                    f"{', '.join(str(f) for f in files if f.suffix == '.png')}")
    flag = " --slots N" if front.concurrent else ""
    out.print("launch line of a point:", highlight=False)  # the command whole on its own line, to copy
    out.print(f"moe-tune launch-line {done.result_dir / 'result.json'} --ctx N{flag}", highlight=False,
              soft_wrap=True)
