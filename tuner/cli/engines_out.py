"""`auto-tune` over several engines: each engine's search and finish as usual, then the engines' head to head, its
table, its verdicts, and the printed line with its engine and binary."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer
from rich import box
from rich.table import Table

from tuner.cli.app import out

if TYPE_CHECKING:
    from tuner.engine.build import EngineLocation
    from tuner.machine.hardware import Hardware
    from tuner.search import autotune
    from tuner.versus.engines import EngineChoice, EngineLine


def tune_engines(req: autotune.TuneRequest, locs: list[EngineLocation], hw: Hardware, as_json: bool,
                 say: Callable[[str], None], search: Callable[[EngineLocation], autotune.TuneResult],
                 summary: Callable[[autotune.TuneResult], None]) -> None:
    from tuner.report import study_report
    from tuner.versus import engines

    def tune(loc: EngineLocation) -> autotune.TuneResult:
        res = search(loc)
        study_report.write(res.result, res.result_dir)
        if not res.search.interrupted and not as_json:
            summary(res)
        return res

    del hw  # each engine's search probes what it needs; the machine was described once already
    tunes, choice = engines.tune_engines(req, locs, tune=tune, on_step=say)
    if choice is None:
        last = tunes[-1].result
        say(f"interrupted in {tunes[-1].kind.name}'s search: run the same command again to resume study "
            f"{last.study_name} and the engines after it")
        raise typer.Exit(130)
    written = engines.record(tunes, choice)
    for res in written:  # the chosen engine's last: the newest result of the model is the one to serve
        study_report.write(res.result, res.result_dir)
    if as_json:
        out.print_json(json.dumps({"engines": choice.to_dict(),
                                   "results": {t.kind.name: str(t.result.result_dir) for t in tunes}}))
        return
    _print(choice)


def _print(choice: EngineChoice) -> None:
    versus = choice.versus
    table = Table(title="engines head to head" + (f" (by {versus.metric})" if versus else ""), box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False, collapse_padding=True,
                  caption="score: the workload's own (higher is better); KLD: the engine's logits against llama.cpp's")
    for col in ("line", "gen tok/s", "pp tok/s", "TTFT s", "session s", "KLD"):
        table.add_column(col, justify="left" if col == "line" else "right", no_wrap=col == "line")
    arms = {a.label: a for a in versus.arms} if versus else {}

    def num(v: float | None, spec: str = ",.1f") -> str:
        return "" if v is None else format(v, spec)

    for line in choice.lines:
        arm = arms.get(line.label)
        fig = arm.figures() if arm else {}
        cells = [num(fig.get("gen_tok_s")), num(fig.get("prompt_tok_s")), num(fig.get("ttft_s"), ".2f"),
                 num(fig.get("session_s"), ".1f"), "" if line.kld is None else format(line.kld, ".2g")]
        if arm is not None and arm.failure:
            cells[0] = "failed"
        table.add_row(line.label, *cells)
    out.print(table)
    for note in choice.refused:
        out.print(note, highlight=False, markup=False, soft_wrap=True)
    if versus is not None:
        for v in versus.verdicts:
            out.print(v.describe(), highlight=False, markup=False, soft_wrap=True)
    out.print(f"printed: {choice.printed} ({choice.reason})", highlight=False, markup=False, soft_wrap=True)
    line = choice.line
    out.print(f"launch line ({line.engine}, {line.binary}):", highlight=False, markup=False, soft_wrap=True)
    out.print(_launch(line), highlight=False, markup=False, soft_wrap=True)


def _launch(line: EngineLine) -> str:
    """llama.cpp's line as ``llama-server …`` (the user's own, as every single-engine result prints it); another
    engine's by its binary's path (its server has the same name)."""
    from tuner.engine import flags
    from tuner.engine.kinds import LLAMA_CPP

    binary = "llama-server" if line.engine == LLAMA_CPP.name else str(line.binary)
    return flags.launch_line(line.config, binary)
