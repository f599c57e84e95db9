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

PREFACE = """# Which engine on this CPU, as `auto-tune` answers it

Each section below is one run of the command a user runs, `moe-tune auto-tune MODEL` with llama.cpp and
ik_llama.cpp both installed and no `--engines` (scripts/bench_which_engine.py runs it and keeps its `--json`, its
wall time and the machine's load; this page is written from those files by scripts/report_which_engine.py). The run
searches each engine with its own levers, races each engine's default launch and best candidate against llama.cpp's
default in fresh interleaved rounds, prices the line it would print, and prints one line with its verdict.

Model: the Qwen3-30B-A3B Q4_K_M shape with **valid, untrained weights** (`moe-tune shape-model qwen3-30b-a3b:Q4_K_M
--weights direct`, 17.3 GiB): its speed is the real model's on this machine, its text is not. Both engines were built
here for this CPU by `moe-tune engine install` (the flags each build states are listed per run).
"""


def _fmt(v: float | None, spec: str = ",.2f") -> str:
    return "" if v is None else format(v, spec)


def section(path: Path, note: str) -> list[str]:
    d = json.loads(path.read_text())
    run = d["run"]
    eng = run["engines"]
    h2h = eng["head_to_head"]
    v_by = {v["a"]: v for v in eng.get("verdicts_against_default") or []}
    lines = [f"## {path.stem}", "", note, "", "```", d["command"], "```", ""]
    load = d["load"]
    lines.append(f"Measured {d['measured_at']}; wall time {d['wall_s']:,.0f} s ({d['wall_s'] / 60:.1f} min); 1-min "
                 f"load average {load['start_1min']:.2f} at start, {load['end_1min']:.2f} at end, on {load['cores']} "
                 "cores. Stages: " + ", ".join(f"{k} {v:,.0f} s" for k, v in run["stages_s"].items()) + ".")
    lines.append("")
    for name, built in d["engines_built"].items():
        flags = [f for f in built.get("cmake_flags") or [] if "NATIVE" in f or "AVX" in f or "AMX" in f]
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
        verdict = f"{v['ratio']:.2f}x ({v['low']:.2f}-{v['high']:.2f}), {v['outcome']}" if v else "—"
        price = line.get("price")
        priced = "—" if not price else (f"KLD {price['kld_mean']:.3g}" + (" (says nothing: untrained weights)"
                                                                           if price.get("says_nothing") else ""))
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path, help="JSON files of scripts/bench_which_engine.py")
    ap.add_argument("--note", action="append", default=[], help="a note per run, in order")
    ap.add_argument("--after", type=Path, help="markdown appended after the runs (findings written by hand)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    notes = a.note + [""] * (len(a.runs) - len(a.note))
    body: list[str] = [PREFACE]
    for path, note in zip(a.runs, notes, strict=True):
        body += section(path, note)
    if a.after:
        body.append(a.after.read_text())
    a.out.write_text("\n".join(body).rstrip() + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
