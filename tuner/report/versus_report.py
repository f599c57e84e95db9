"""compare-models for people: one table (the terminal's and report.md's), the launch lines, the verdict, and a
plot of each model's score per round."""

from __future__ import annotations

from pathlib import Path

from tuner.machine.fileio import atomic_write
from tuner.search.verdict import Verdict
from tuner.versus.compare import ModelComparison, ModelRow

CAPTION = ("placement: fit at the context (--n-cpu-moe for a MoE, -ngl for a dense model); tg max: the roofline's "
           "generation ceiling there; gen t/s, TTFT, session s: medians of the head-to-head's confirmation rounds; "
           "max ctx: the largest context that fits at that KV")


def _f(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def columns(cmp: ModelComparison) -> list[str]:
    """The table's columns: the plan's alone with --plan-only; the head-to-head's figures once measured."""
    if cmp.versus is None:
        return ["model", "GiB", "placement", "KV", "tg max", "max ctx"]
    agent = "session" in cmp.versus.metric
    return ["model", "GiB", "placement", "gen t/s", "TTFT ms", *(["session s"] if agent else []), "max ctx"]


def cells(cmp: ModelComparison, row: ModelRow) -> list[str]:
    p = row.plan
    arm = next((a for a in cmp.versus.arms if a.label == p.label), None) if cmp.versus else None
    fig = arm.figures() if arm else {}
    ttft = fig.get("ttft_s")
    every = {"model": p.label, "GiB": f"{p.file_bytes / 2**30:.2f}",
             "placement": p.offload if p.fits else "does not fit", "KV": p.kv or "",
             "tg max": _f(p.gen_ceiling_tok_s, ",.0f"), "gen t/s": _f(fig.get("gen_tok_s"), ",.1f"),
             "TTFT ms": _f(None if ttft is None else 1000 * ttft, ",.0f"), "session s": _f(fig.get("session_s"), ".2f"),
             "max ctx": f"{p.max_ctx:,}" if p.max_ctx else ""}
    return [every[c] for c in columns(cmp)]


def after_table(cmp: ModelComparison) -> list[str]:
    """The lines that follow the table: each model's tuned line (or why it has none), the verdict, the notes."""
    lines = []
    for r in cmp.rows:
        if r.launch_line:
            lines.append(f"{r.plan.label}: {r.launch_line}")
            if r.decision:
                lines.append(f"  ({r.decision})")
        elif r.error:
            lines.append(f"{r.plan.label}: {r.error}")
        if r.plan.published:
            lines.append(f"{r.plan.label}, published: {r.plan.published}")
    if cmp.versus is not None:
        lines.append(f"verdict: {cmp.versus.summary()}")
        lines += [v.describe() for v in cmp.versus.verdicts]
    lines += list(cmp.notes)
    return lines


def markdown(cmp: ModelComparison) -> str:
    wl = cmp.workload
    out = ["# compare-models", "", f"- machine: {cmp.hardware}",
           f"- workload: {wl.get('kind')}, {wl.get('prompt_tokens')}-token prompts, {wl.get('gen_tokens')}-token "
           f"replies" + (f", depth {wl.get('depth_tokens')}" if wl.get("depth_tokens") else ""), ""]
    if cmp.versus is not None:
        out += [f"**{cmp.versus.summary()}**", ""]
    cols = columns(cmp)
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cells(cmp, r)) + " |" for r in cmp.rows]
    out += ["", CAPTION, "", "## Launch lines", ""]
    for r in cmp.rows:
        what = f"`{r.launch_line}`" if r.launch_line else (r.error or "not tuned (--plan-only)")
        out.append(f"- {r.plan.label}: {what}" + (f" — {r.decision}" if r.decision else ""))
    if cmp.versus is not None:
        out += ["", f"## Head to head, by {cmp.versus.metric}", ""]
        out += [f"- {Verdict.from_dict(v.to_dict()).describe()}" for v in cmp.versus.verdicts]
        out += [f"- {a.label} paged host RAM (not a config to run on this machine as tuned): {a.paging}"
                for a in cmp.versus.arms if a.paging]
        if cmp.versus.selected:
            out += ["", f"Selected by the selection rounds: {cmp.versus.selected}; the verdicts are from the "
                    "confirmation rounds alone."]
        out += ["", "| model | round | phase | score | quiet | host paging |", "|---|---:|---|---:|---|---|"]
        for a in cmp.versus.arms:
            phased = [("selection", r) for r in a.selection] + [("confirmation", r) for r in a.rounds]
            out += [f"| {a.label} | {i + 1} | {ph} | {_f(r.score, '.4g')} | {'yes' if not r.noise else r.noise} | "
                    f"{r.paging_verdict} |" for i, (ph, r) in enumerate(phased)]
    out += ["", "## Notes", "", *(f"- {n}" for n in cmp.notes)]
    published = [r for r in cmp.rows if r.plan.published]
    out += [f"- {r.plan.label}, published: {r.plan.published}" for r in published]
    return "\n".join(out) + "\n"


def plot(cmp: ModelComparison, path: Path) -> Path | None:
    """Each model's score per head-to-head round (x: selection, o: confirmation; quiet rounds filled, disturbed
    ones hollow)."""
    if cmp.versus is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, a in enumerate(cmp.versus.arms):
        for marker, rounds in (("x", a.selection), ("o", a.rounds)):  # x: selection rounds, o: confirmation
            for r in rounds:
                if r.score is not None:
                    ax.plot([i], [r.score], marker, color="C0", fillstyle="full" if not r.noise else "none")
    ax.set_xticks(range(len(cmp.versus.arms)), [a.label for a in cmp.versus.arms], rotation=15, ha="right")
    ax.set_ylabel(f"score per round ({'sessions' if 'session' in cmp.versus.metric else 'requests'}/s)")
    ax.set_title(cmp.versus.summary(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(cmp: ModelComparison) -> list[Path]:
    written = [atomic_write(cmp.out_dir / "report.md", markdown(cmp))]
    png = plot(cmp, cmp.out_dir / "scores.png")
    return written + ([png] if png else [])
