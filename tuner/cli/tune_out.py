"""`auto-tune` of one engine, rendered: the llama-server re-measure's table, the verdicts and where the result is; an
agent run's session table (the two-engine run renders in :mod:`tuner.cli.engines_out`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from tuner.cli.app import out, say_fitted

if TYPE_CHECKING:
    from tuner.search import autotune
    from tuner.search.session_stage import SessionStage


def session_summary(stage: SessionStage) -> None:
    """Per arm: median session time; the default's and the winner's per-turn tables; the verdict; findings."""
    from rich import box

    from tuner.cli.cmd_bench import print_session

    together = f", {stage.agents} agents at once" if stage.agents > 1 else ""
    table = Table(title=f"agent sessions ({stage.source}{together}), by session time", box=box.SIMPLE_HEAD)
    for col in ("arm", "session s", "median TTFT ms", "re-processed %", "full re-processes"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm in (*stage.arms, *stage.confirmation):
        if stage.confirmation and arm is stage.confirmation[0]:
            table.add_section()
            table.add_row("confirmation", "", "", "", "")
        typical = arm.typical
        if typical is None:
            table.add_row(arm.label, "failed", "", "", arm.failure or "")
            continue
        table.add_row(arm.label + (" (RAM paging)" if arm.paging else ""), f"{arm.median_session_s:.2f}",
                      f"{1000 * typical.median_ttft_s:,.0f}", f"{100 * typical.reprocessed_share:.0f}",
                      str(len(typical.full_reprocess_turns)))
    out.print(table)
    for label in dict.fromkeys(a.label for a in (*stage.arms, *stage.confirmation) if a.paging):
        paged = next(a.paging for a in (*stage.confirmation, *stage.arms) if a.label == label and a.paging)
        if paged is not None:
            say_fitted(out, f"{label}: host paging, never the line: {paged.describe()}")
    for label, note in stage.notes.items():
        say_fitted(out, f"{label}: {note}")
    for label in dict.fromkeys(["default", stage.winner or "default"]):
        shown = stage.arm(label)
        if shown is not None and shown.typical is not None:
            print_session(shown.typical, f"{label}: per turn (a typical round)")
            if shown.finding is not None:
                say_fitted(out, f"{label}: {shown.finding.describe()}")
    if stage.verdict is not None:
        say_fitted(out, f"by session time: {stage.verdict.describe()}")
    if stage.reason:
        say_fitted(out, f"session stage: {stage.reason}")


def spill_cell(m: dict[str, Any]) -> str:
    """VRAM spill and host paging in one cell: a row that paged host RAM says so (it is never the printed line)."""
    vram = m.get("spill") or ""
    if m.get("host_paging") != "host_paging":
        return vram
    return "RAM paging" if vram in ("", "none") else f"{vram}, RAM paging"


def summary(res: autotune.TuneResult) -> None:
    from rich import box

    from tuner.report import frontier_report
    from tuner.search import finish, verdict

    r = res.result.to_dict()
    w = r["workload"]
    table = Table(title=f"llama-server re-measure ({w['kind']}, P={w['prompt_tokens']}, G={w['gen_tokens']}, "
                        f"depth {w.get('depth_tokens', w['prompt_tokens'])})", box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False, collapse_padding=True)
    # Short headers, no vertical rules, and cells fold rather than being cut: at 80 columns every name and
    # figure stays whole.
    table.caption = ("gen/pp: one request alone; loaded: per request with every slot in use; e2e: generated "
                     "tok/s of wall time, prompts and all slots included")
    for col in ("config", "slots", "gen tok/s", "CV %", "pp tok/s", "loaded", "e2e", "KLD", "spill"):
        table.add_column(col, justify="left" if col == "config" else "right", overflow="fold",
                         no_wrap=col == "config")
    fin = r["finish"]

    def num(v: float | None, spec: str = ",.1f") -> str:
        if v is not None and spec == ",.1f" and v >= 1000:
            spec = ",.0f"  # five digits and a decimal would fold the column at 80
        return "" if v is None else format(v, spec)

    confirmed = fin.get("confirmation") or []
    if confirmed:
        table.title = f"{table.title}: selection rounds (they decide nothing)"
    rows = [*fin["baselines"], *fin["candidates"]]
    for m in rows + confirmed:
        gen = "failed" if m["gen_tok_s"] is None else num(m["gen_tok_s"])
        if confirmed and m is confirmed[0]:
            table.add_section()
            table.add_row("confirmation", *[""] * 8)  # the rounds below decide; the ones above chose
        table.add_row(m["label"], str(m.get("slots", 1)), gen, num(m["gen_cv_pct"]), num(m["prompt_tok_s"]),
                      num(m.get("loaded_gen_tok_s")), num(m.get("end_to_end_gen_tok_s")),
                      num(m.get("kld_mean"), ".2g"), spill_cell(m))
    out.print(table)
    n = len(r["trials"])
    say_fitted(out, f"study {res.study_name}: {n} trials stored ({res.search.trials_this_run} this run) in "
                    f"{res.storage}")
    winner = r.get("winner")
    decision = fin.get("decision") or {}
    if winner:
        say_fitted(out, f"printed: {winner['label']} ({decision.get('reason', '')})")
    if story := res.result.seed_story():
        say_fitted(out, f"seed: {story}")
    sp = r["speedup"]
    parts = [f"{k}: {v:.2f}x" for k, v in sp.items() if v is not None and not (winner and winner["label"] == k)]
    if parts:
        metric = finish.Finish.from_dict(r["finish"]).metric
        say_fitted(out, f"{winner['label'] if winner else 'printed'} vs {', '.join(parts)} (by {metric})")
    for v in fin.get("verdicts", []):
        say_fitted(out, verdict.Verdict.from_dict(v).describe())
    say_fitted(out, f"report: {res.result_dir / 'report.md'}")
    where = frontier_report.winner_on_frontier(res.result, res.result_dir.parent)
    if where:
        say_fitted(out, where)
