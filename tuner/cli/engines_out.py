"""`auto-tune` over several engines, rendered: the library's run (:func:`tuner.versus.engine_run.tune_engines`) with
each search's progress bar, then the race's table, every line's verdict against llama.cpp's default, the printed line
with its engine and why, and the line itself on its own line. `--engines ik` alone: its printed line's price."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer
from rich import box
from rich.table import Table

from tuner.cli.app import out, say_fitted
from tuner.core.errors import UsageError

if TYPE_CHECKING:
    from tuner.engine.build import EngineLocation
    from tuner.machine.hardware import Hardware
    from tuner.search import autotune
    from tuner.versus.engine_run import EnginesRun
    from tuner.versus.engines import EngineChoice


def tune_engines(req: autotune.TuneRequest, locs: list[EngineLocation], hw: Hardware, as_json: bool,
                 say: Callable[[str], None], search: Callable[..., autotune.TuneResult],
                 started: float | None = None) -> None:
    """``search(req, loc, hooks, left_s)``: one engine's search as the command draws it (:func:`tuner.cli.cmd_tune.
    _search`), fed the run's hooks and its estimate of the time left; ``started``: when the command began (its
    --time counts from there)."""
    from tuner.engine import build
    from tuner.report import study_report
    from tuner.search.finish import server_load
    from tuner.versus import engine_run, protocol
    from tuner.versus.clock import RunClock

    sent = protocol.race_request(req.workload) or server_load(req.workload)
    clock = RunClock(tuple(build.capabilities(loc).kind.name for loc in locs), req.budget.trials,
                     engine_run.RACE_ROUNDS, sent.prompt_tokens, sent.gen_tokens, req.kld_ctx,
                     engine_run.price_chunks(req), req.budget.time_s)
    if started is not None:
        clock.start = started

    def tune(r: autotune.TuneRequest, loc: EngineLocation, hooks: engine_run.SearchHooks) -> autotune.TuneResult:
        res = search(r, loc, hooks, clock.left_s)
        if not res.search.interrupted:
            best = res.candidates[0] if res.candidates else None
            from tuner.engine import flags

            say(f"search done: {res.search.trials_this_run} trials in {res.search.elapsed_s:,.0f} s; best candidate: "
                + (flags.launch_line(best) if best is not None else "none beyond the default"))
        return res

    run = engine_run.tune_engines(req, locs, hw, tune=tune, on_step=say, clock=clock)
    if run.choice is None:
        last = run.tunes[-1]
        study = last.result.study_name if last.result else "?"
        say(f"interrupted in {last.kind.name}'s search: run the same command again to resume study {study} and the "
            "engines after it")
        raise typer.Exit(130)
    for t in run.tunes:  # each engine's report.md beside its result.json (the chosen engine's written last)
        if t.result is not None:
            from tuner.search.result import load_result

            study_report.write(load_result(t.result.result_dir), t.result.result_dir)
    if as_json:
        out.print_json(json.dumps(run.to_dict()))
    else:
        _print(run.choice, run)
    if run.choice.printed is None:
        raise UsageError(f"no line printed: {run.choice.reason}")


def _print(choice: EngineChoice, run: EnginesRun) -> None:
    from tuner.versus.engine_run import launch_of

    versus = choice.versus
    table = Table(title="engines race" + (f" (by {versus.metric})" if versus else ""), box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False, collapse_padding=True)
    for col in ("line", "gen tok/s", "pp tok/s", "TTFT s", "session s", "vs default", "KLD"):
        table.add_column(col, justify="left" if col == "line" else "right", no_wrap=col == "line")
    verdicts = {v.a: v for v in choice.verdicts()}

    def num(v: float | None, spec: str = ",.1f") -> str:
        return "" if v is None else format(v, spec)

    for x in choice.lines:
        arm = versus.arm(x.label) if versus else None
        if arm is None and x.label in choice.gates.held:
            continue  # a reserve that did not race: nothing to show
        fig = arm.figures() if arm else {}
        v = verdicts.get(x.label)
        cells = [num(fig.get("gen_tok_s")), num(fig.get("prompt_tok_s")), num(fig.get("ttft_s"), ".2f"),
                 num(fig.get("session_s"), ".1f"), f"{v.ratio:.2f}x" if v else "", "" if x.kld is None
                 else format(x.kld, ".2g")]
        if arm is not None and arm.failure:
            cells[0] = "failed"
        elif arm is not None and arm.paging:
            cells[0] += " (paged)"
        table.add_row(x.label, *cells)
    out.print(table)
    say_fitted(out, "vs default: the median ratio of its score to llama.cpp's default, round by round (higher is "
                    "faster); KLD: its logits against llama.cpp's f16 ones, where priced")
    for v in choice.verdicts():
        say_fitted(out, v.describe())
    for note in choice.refused:
        if "refused by its price" not in note:
            say_fitted(out, note)
    for label, s in choice.standings().items():
        if label != choice.printed and s.state not in ("in", "held") or label in choice.gates.screened:
            say_fitted(out, f"{label}: {s.why}")
    stages = ", ".join(f"{k} {v / 60:,.1f} min" for k, v in run.stages_s.items())
    say_fitted(out, f"time: {run.elapsed_s / 60:,.1f} min ({stages}); {run.clock}")
    line = choice.line
    if line is None:
        say_fitted(out, f"printed: none ({choice.reason})")
        return
    say_fitted(out, f"printed: {line.label} ({choice.reason})")
    how = "" if launch_of(line).startswith("llama-server ") else ": its own llama-server, by path"
    out.print(f"launch line ({line.engine}{how}):", highlight=False, markup=False, soft_wrap=True)
    out.print(launch_of(line), highlight=False, markup=False, soft_wrap=True)  # whole, on a line of its own
