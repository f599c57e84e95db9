"""A quant comparison as the user reads it: terminal/markdown cells, report.md, CSV, JSON and the speed-vs-KLD
plot, written into the comparison's folder."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from tuner.machine.fileio import atomic_write
from tuner.quants.compare import Comparison, QuantRow


def _f(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


COLUMNS = ("quant", "origin", "size", "fit", "best config", "prompt tok/s", "gen tok/s at depth", "PPL",
           "mean KLD", "KLD p99", "same top %", "Pareto", "verdict", "published (catalog)")


def cells(r: QuantRow) -> list[str]:
    """The row as the terminal and markdown tables print it."""
    size = f"{r.size_bytes / 2**30:,.2f} GiB" if r.size_bytes >= 2**30 else f"{r.size_bytes / 2**20:,.1f} MiB"
    config = r.launch_line.replace(r.path, Path(r.path).name) if r.launch_line else (
        f"failed: {r.error}" if r.error else "")
    ppl = "" if r.ppl is None else f"{r.ppl:.3f} ± {r.ppl_error or 0:.3f}"
    kld = "0 (reference)" if r.is_reference and r.kld_mean == 0 else _f(r.kld_mean, ".5f")
    if kld and not r.is_reference and r.kld_mean_error is not None:
        kld += f" ± {r.kld_mean_error:.5f}"
    gen = _f(r.gen_tok_s, ",.1f")
    if gen and r.gen_tok_s_error:
        gen += f" ± {r.gen_tok_s_error:,.1f}"
    if gen and r.depth_tokens is not None:
        gen += f" @ {r.depth_tokens}"
    origin = r.origin + ("" if r.kept or not r.path else " (dropped)")
    return [r.quant, origin, size, r.fit, config, _f(r.prompt_tok_s, ",.1f"), gen, ppl, kld,
            _f(r.kld_p99, ".4f"), _f(r.same_top_pct, ".2f"), "yes" if r.pareto else "", r.verdict,
            r.published or ""]


# The terminal table: one line per quant at 80 columns. Short headers (the caption says what they mean), the
# config as a short name with its full launch line below the table; origin, PPL, KLD p99, same-top % and the
# catalog's figures are in report.md, compare.csv and compare.json.
TERMINAL_COLUMNS = ("quant", "size", "fit", "config", "gen t/s", "pp t/s", "mean KLD", "verdict")
SHORT_VERDICTS = {"tie, larger file": "tie", "below speed floor": "too slow", "over loss budget": "over KLD",
                  "not measured": "-"}


def short_size(n_bytes: int) -> str:
    n, unit = (n_bytes / 2**30, "G") if n_bytes >= 2**30 else (n_bytes / 2**20, "M")
    return f"{n:,.0f}{unit}" if n >= 100 else f"{n:.1f}{unit}"


def short_speed(tok_s: float) -> str:
    """Three figures are enough for a speed: ``35.1``, ``135``, ``1,234``."""
    return f"{tok_s:,.0f}" if tok_s >= 100 else f"{tok_s:.1f}"


def short_fit(fit: str) -> str:
    """``offload 12`` → ``cm12`` (the fewest --n-cpu-moe that fit), ``offload 12..40`` → ``cm12-40``,
    ``RAM (no GPU)`` → ``RAM``."""
    return fit.replace("offload ", "cm").replace("..", "-").replace(" (no GPU)", "")


def terminal_cells(r: QuantRow) -> list[str]:
    """The row as the 80-column terminal table prints it (``*``: on the Pareto front)."""
    gen = "" if r.gen_tok_s is None else short_speed(r.gen_tok_s)
    if r.gen_tok_s is not None and r.gen_tok_s_error is not None:  # the interval to the value's own decimals
        gen += f"±{r.gen_tok_s_error:,.0f}" if r.gen_tok_s >= 100 else f"±{r.gen_tok_s_error:.1f}"
    kld = "0 (ref)" if r.is_reference and r.kld_mean == 0 else _f(r.kld_mean, ".4f")
    if kld and not r.is_reference and r.kld_mean_error is not None:
        kld += f"±{r.kld_mean_error:.4f}"
    config = r.config_name or ("failed" if r.error else "")
    return [r.quant + ("*" if r.pareto else ""), short_size(r.size_bytes) if r.size_bytes else "", short_fit(r.fit),
            config, gen, "" if r.prompt_tok_s is None else short_speed(r.prompt_tok_s), kld,
            SHORT_VERDICTS.get(r.verdict, r.verdict)]


def caption(cmp: Comparison, fit_where: str) -> str:
    depth = next((r.depth_tokens for r in cmp.rows if r.depth_tokens is not None), None)
    at = f" at depth {depth}" if depth is not None else ""
    return (f"*: Pareto front. size: file (M/G: MiB/GiB). fit: {fit_where} (VRAM, cmN: --n-cpu-moe N, no). "
            f"config: the best found here, K/V cache types, cm: --n-cpu-moe, np: slots (launch lines below). "
            f"gen/pp: tok/s{at}, ± the 90 % interval. mean KLD vs the reference, ± 90 %.")


def after_table(cmp: Comparison) -> list[str]:
    """What follows the terminal table: each quant's full launch line (or why it failed), then the commands
    that made quants here."""
    lines = []
    for r in cmp.rows:
        if r.launch_line:
            lines.append(f"{r.quant}: {r.launch_line}")
        elif r.error:
            lines.append(f"{r.quant}: failed: {r.error}")
    lines += [f"made here: {r.quant}: {r.command}" for r in cmp.rows if r.command]
    return lines


def markdown(cmp: Comparison) -> str:
    lines = [f"# Quant comparison: {cmp.title}", ""]
    if cmp.reference:
        lines += [f"KLD and same-top-token % against `{cmp.reference}`. Pareto front: higher generation tok/s "
                  "and lower mean KLD.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in cmp.rows]
    lines += ["", f"Answer: {cmp.pick}; {cmp.binding}" if cmp.pick else f"Answer: {cmp.binding}"]
    if cmp.undecided:
        lines += ["", "Undecided (an interval straddles a limit, so the row was not picked):", ""]
        lines += [f"- {u}" for u in cmp.undecided]
    made = [r for r in cmp.rows if r.command]
    if made:
        lines += ["", "Made here:", ""] + [f"- {r.quant}: `{r.command}`" for r in made]
    if cmp.catalog_model:
        lines += ["", f"Published figures come from the catalog entry {cmp.catalog_model}; they were not measured "
                  "here."]
    lines += ["", "![gen tok/s vs KLD](gen_tok_s_vs_kld.png)", ""]
    return "\n".join(lines)


def to_json(cmp: Comparison) -> dict[str, Any]:
    return {"title": cmp.title, "reference": cmp.reference, "catalog_model": cmp.catalog_model,
            "out_dir": str(cmp.out_dir), "pick": cmp.pick, "binding": cmp.binding,
            "disk_used_bytes": cmp.disk_used_bytes, "undecided": list(cmp.undecided),
            "rows": [asdict(r) for r in cmp.rows]}


def to_csv(rows: Sequence[QuantRow]) -> str:
    buf = io.StringIO()
    names = [f.name for f in fields(QuantRow)]
    writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})
    return buf.getvalue()


def plot(cmp: Comparison, path: Path) -> Path:
    """Generation tok/s against mean KLD per quant, the Pareto front drawn through its points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r.kld_mean, r.gen_tok_s, r.quant, r.pareto) for r in cmp.rows
           if r.gen_tok_s is not None and r.kld_mean is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], label="quants (measured)")
    for kld_mean, gen, name, _ in pts:
        ax.annotate(name, (kld_mean, gen), textcoords="offset points", xytext=(4, 4), fontsize="small")
    front = sorted(p for p in pts if p[3])
    ax.plot([p[0] for p in front], [p[1] for p in front], color="red", marker="D", label="Pareto front")
    ax.set_xlabel("mean KL-divergence vs the reference (lower is better)")
    ax.set_ylabel("generation tok/s, best config (higher is better)")
    ax.set_title(f"Speed vs quality: {cmp.title}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(cmp: Comparison) -> list[Path]:
    files = {"report.md": markdown(cmp), "compare.csv": to_csv(cmp.rows),
             "compare.json": json.dumps(to_json(cmp), indent=2) + "\n"}
    for name, text in files.items():
        atomic_write(cmp.out_dir / name, text)
    return [*(cmp.out_dir / n for n in files), plot(cmp, cmp.out_dir / "gen_tok_s_vs_kld.png")]
