"""results/benchmarks/which-engine-cpu.md from the JSON files scripts/bench_which_engine.py wrote (the user's own
`moe-tune auto-tune … --json`, with its command, wall time and load): one section per run, every figure read from the
run's own output, nothing typed in by hand but the page's preface and each run's note.

    .venv/bin/python scripts/report_which_engine.py results/benchmarks/which-engine-cpu/qwen3-30b-a3b-chat.json \\
        results/benchmarks/which-engine-cpu/qwen3-30b-a3b-agent.json --out results/benchmarks/which-engine-cpu.md
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import harness  # noqa: F401  (the repository on the path)

from tuner.search.verdict import Verdict

PREFACE = """# Which engine on this CPU, as `auto-tune` answers it

Each section below is one run of the command a user runs, `moe-tune auto-tune MODEL` with llama.cpp and
ik_llama.cpp both installed and no `--engines` (scripts/bench_which_engine.py runs it and keeps its `--json`, its
wall time, the machine's load and each stderr line's time; this page is written from those files by
scripts/report_which_engine.py). The run searches each engine with its own levers (short llama-bench trials: they
only propose), leaves out a candidate its search could not tell from its engine's default, prices the lines that
compute other numbers than llama.cpp's bare launch before they race (none where the model predicts no text), races
the rest against llama.cpp's default in fresh interleaved rounds of one request each, and prints one line with its
verdict (docs/engines.md, "What it does").

Models: shapes with **valid, untrained weights** (`moe-tune shape-model qwen3-30b-a3b:Q4_K_M --weights direct`,
17.3 GiB; `moe-tune shape-model gpt-oss-20b:MXFP4_MOE --weights direct`, 11.3 GiB): their speed is the real models'
on this machine, their text is not (so no price says anything: each run learns that from the reference's first
chunks). Both engines were built here for this CPU by `moe-tune engine install` (the flags each build states are
listed per run).
"""


def _fmt(v: float | None, spec: str = ",.2f") -> str:
    return "" if v is None else format(v, spec)


def section(path: Path, note: str) -> list[str]:
    d = json.loads(path.read_text())
    run = d["run"]
    eng = run["engines"]
    h2h = eng["head_to_head"]
    v_by = {v["a"]: v for v in eng.get("verdicts_against_default") or []}
    name = path.stem if path.parent.name == "which-engine-cpu" else f"{path.parent.name}/{path.stem}"
    lines = [f"## {name}", "", note, "", "```", d["command"], "```", ""]
    load = d["load"]
    silence = (f" The longest time between two lines on stderr: {d['longest_silence_s']:,.1f} s (from "
               f"{d['longest_silence_at_s']:,.0f} s; each line's time is in the .log beside the JSON)."
               if "longest_silence_s" in d else "")
    lines.append(f"Measured {d['measured_at']}; wall time {d['wall_s']:,.0f} s ({d['wall_s'] / 60:.1f} min); 1-min "
                 f"load average {load['start_1min']:.2f} at start, {load['end_1min']:.2f} at end, on {load['cores']} "
                 "cores. Stages: " + ", ".join(f"{k} {v:,.0f} s" for k, v in run["stages_s"].items()) + "."
                 + silence + (f" Time: {run['clock']}." if run.get("clock") else ""))
    lines.append("")
    for name, built in d["engines_built"].items():
        flags = [f for f in built.get("cmake_flags") or [] if "NATIVE" in f or "AVX" in f or "AMX" in f
                 or "ARCH_FLAGS" in f]
        lines.append(f"- {built.get('describe', name)}: built in {built.get('build_s')} s here, "
                     f"`{' '.join(flags)}`")
    lines += ["", "| line | launch (after `llama-server -m MODEL`) | gen tok/s | prompt tok/s | TTFT s | session s | "
                  "vs llama.cpp default (99 %) | price |", "|---|---|---|---|---|---|---|---|"]
    arms = {a["label"]: a for a in h2h["arms"]}
    for line in eng["lines"]:
        arm = arms.get(line["label"], {})
        words = shlex.split(arm.get("launch_line", line["launch_line"]))
        launch = " ".join(words[3:]) or "—"
        v = v_by.get(line["label"])
        verdict = f"{v['ratio']:.2f}x ({Verdict.from_dict(v).interval_words()}), {v['outcome']}" if v else "—"
        price = line.get("price")
        if not price:
            priced = "—"
        elif price.get("kld_mean") is None:  # a reference that predicts no text: no line was run to price it
            priced = "none run (untrained weights)" if price.get("says_nothing") else "unpriced"
        else:
            priced = f"KLD {price['kld_mean']:.3g}" + (" (says nothing: untrained weights)"
                                                        if price.get("says_nothing") else "")
        paged = " (paged)" if arm.get("host_paging") else ""
        cells = [_fmt(arm.get("gen_tok_s")), _fmt(arm.get("prompt_tok_s")), _fmt(arm.get("ttft_s")),
                 _fmt(arm.get("session_s"), ".1f"), verdict, priced]
        lines.append(f"| {line['label']}{paged} | `{launch}` | " + " | ".join(cells) + " |")
    busy = sum(1 for a in h2h["arms"] for r in a["rounds"] if r.get("noise"))
    rounds = max((len(a["rounds"]) for a in h2h["arms"]), default=0)
    lines += ["", f"Figures are medians over the race's {rounds} rounds ({busy} line-rounds measured on a busy "
                  "machine, left out of the verdicts); the verdicts are each line's per-round ratio to llama.cpp's "
                  "default.", ""]
    lines.append(f"**Printed: {eng['printed']}** ({eng['printed_engine']}). Why, as the run said it: {eng['reason']}.")
    for note_ in eng.get("refused") or []:
        lines.append(f"- left out: {note_}")
    lines.append("")
    return lines


def stage_table(before: list[tuple[str, Path | None, dict[str, float] | None]], after: list[Path]) -> list[str]:
    """Each run's stage times before this turn's protocol (its JSON, or figures named in an issue) beside the run
    of the same command now."""
    out = ["| run | before: searches, race, prices = wall | now: searches, race, prices = wall | longest silence "
           "now |", "|---|---|---|---|"]

    def words(stages: dict[str, float], wall: float) -> str:
        search = sum(v for k, v in stages.items() if k.startswith("search"))
        return (f"{search / 60:.1f} + {stages.get('race', 0) / 60:.1f} + {stages.get('prices', 0) / 60:.1f} = "
                f"**{wall / 60:.1f} min**")

    for (name, old_path, old_figures), new_path in zip(before, after, strict=True):
        if old_path is not None:
            old = json.loads(old_path.read_text())
            was = words(old["run"]["stages_s"], old["wall_s"])
        else:
            assert old_figures is not None
            was = words(old_figures, old_figures["wall"]) + " (issue 65's figures)"
        new = json.loads(new_path.read_text())
        now = words(new["run"]["stages_s"], new["wall_s"])
        out.append(f"| {name} | {was} | {now} | {new.get('longest_silence_s', float('nan')):,.0f} s |")
    return out + [""]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path, help="JSON files of scripts/bench_which_engine.py")
    ap.add_argument("--note", action="append", default=[], help="a note per run, in order")
    ap.add_argument("--after", type=Path, help="markdown appended after the runs (findings written by hand)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--before", action="append", default=[],
                    help="NAME=JSON (or NAME=search,race,prices,wall in seconds) of the same command before, in the "
                         "order of the first runs: a stage table compares them")
    a = ap.parse_args()
    notes = a.note + [""] * (len(a.runs) - len(a.note))
    body: list[str] = [PREFACE]
    if a.before:
        before: list[tuple[str, Path | None, dict[str, float] | None]] = []
        for item in a.before:
            name, _, what = item.partition("=")
            if what.endswith(".json"):
                before.append((name, Path(what), None))
            else:
                search, race, prices, wall = (float(x) for x in what.split(","))
                before.append((name, None, {"search": search, "race": race, "prices": prices, "wall": wall}))
        body += ["## Stage times, before and now", "",
                 "The same command on the same model before this turn's protocol and now (minutes):", ""]
        body += stage_table(before, a.runs[:len(before)])
    for path, note in zip(a.runs, notes, strict=True):
        body += section(path, note)
    if a.after:
        body.append(a.after.read_text())
    a.out.write_text("\n".join(body).rstrip() + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
