"""The one table `scripts/gpu_check` writes: markdown and JSON, from the state file's step results.

Every figure names what it was measured on (card, budget, model and its weights, engine commit); on a machine
without a GPU the table holds the memory model's plan for each budget, labelled as planned, not measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The model a step measured on (its result's ``model_weights``): zero weights only for memory figures.
WEIGHTS = {"zero": "zero weights", "direct": "valid weights"}


def _f(v: Any, fmt: str = "{:,.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f}"


def _roof(row: dict[str, Any], zero_weights: bool) -> str:
    """The tuned line's generation and prompt speed as shares of their ceilings (tuner.plan.roofline). A zero-filled
    model's router ties, so a ubatch copies a few experts instead of nearly all: its prompt share is not shown."""
    pct = row.get("prompt_roofline_pct")
    prompt = "n/m (zero weights)" if zero_weights else _f(pct, "{:.0f}")
    if pct is not None and pct > 100 and not zero_weights:  # the bound counts the experts an even router uses
        prompt += " (fewer experts copied than an even router uses)"
    return f"{_f(row.get('roofline_pct'), '{:.0f}')} / {prompt}"


def _arm(rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    return next((r for r in rows if r.get("label") == label), {})


def tune_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured budget/workload: tuned vs default vs --fit, side by side from one auto-tune run."""
    rows = []
    for name, step in state.get("steps", {}).items():
        res = step.get("result") or {}
        if not name.startswith(("tune-", "budget-", "long-")) or "tune" not in res:
            continue
        tune = res["tune"]
        fin = tune.get("finish", {})
        base = fin.get("baselines", [])
        win = tune.get("winner") or {}
        default, fit = _arm(base, "default"), _arm(base, "fit")
        rows.append({
            "run": name, "budget_mib": res.get("free_mib"), "workload": res.get("workload"), "ctx": res.get("ctx"),
            "tuned": win.get("launch_line"), "tuned_label": win.get("label"),
            "tuned_gen_tok_s": win.get("gen_tok_s"), "tuned_prompt_tok_s": win.get("prompt_tok_s"),
            "default_gen_tok_s": default.get("gen_tok_s"), "default_prompt_tok_s": default.get("prompt_tok_s"),
            "fit_gen_tok_s": fit.get("gen_tok_s"), "fit_prompt_tok_s": fit.get("prompt_tok_s"),
            "tuned_vs_default": (tune.get("speedup") or {}).get("default"),
            "tuned_vs_fit": (tune.get("speedup") or {}).get("fit"),
            "roofline_pct": win.get("roofline_pct"), "prompt_roofline_pct": win.get("prompt_roofline_pct"),
            "tok_per_j": win.get("tokens_per_joule"),
            "vram_peak_bytes": win.get("vram_peak_bytes"), "spill": win.get("spill"),
            "default_failure": (default.get("failure") or {}).get("kind"),
        })
    return rows


def memory_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    """(a): the memory step's rows (``memory-<budget>g``), and any tune step's check of its own config."""
    rows = []
    for name, step in state.get("steps", {}).items():
        res = step.get("result") or {}
        for r in res.get("memory", []) if not name.startswith("memory-") else res.get("rows", []):
            rows.append({"run": name, **r})
    return rows


def _step_rows(state: dict[str, Any], prefix: str, key: str, *shared: str) -> list[dict[str, Any]]:
    """The rows that steps named ``prefix…`` keep under ``key``, each with its step's name and ``shared`` fields."""
    rows = []
    for name, step in state.get("steps", {}).items():
        if name.startswith(prefix):
            res = step.get("result") or {}
            rows += [{"run": name, **{k: res.get(k) for k in shared}, **r} for r in res.get(key, [])]
    return rows


def spill_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    return _step_rows(state, "spill-", "runs")


def opoff_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    return _step_rows(state, "opoff-", "rows", "free_mib")


def plan_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    step = state.get("steps", {}).get("plan-budgets") or {}
    return list((step.get("result") or {}).get("rows", []))


def render(state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(markdown, JSON document) of everything the check has so far."""
    info = state.get("machine", {})
    card = info.get("gpu_name") or "no GPU"
    model = (state.get("steps", {}).get("model", {}).get("result") or {})
    valid = (state.get("steps", {}).get("model-valid", {}).get("result") or {})
    lines = [
        f"# GPU check: {card}",
        "",
        f"Command: `{state.get('command', 'scripts/gpu_check')}`",
        "",
        f"- machine: {info.get('describe', '?')}",
        f"- engine: llama.cpp {info.get('engine_commit', '?')} ({info.get('engine_backend', '?')})",
        f"- model: {model.get('target', '?')} ({model.get('weights_label', '?')}), {model.get('path', '?')}",
        *([f"- model for speed: {valid.get('target', '?')} ({valid.get('weights_label', '?')}), "
           f"{valid.get('path', '?')}"] if valid else []),
        "- budgets: the VRAM left free by a ballast process (cudaMalloc) holding the rest of the card; the tool "
        "reads it as free VRAM at start (NVML), as on a user's card",
        "",
    ]
    doc: dict[str, Any] = {"machine": info, "model": model, "model_valid": valid, "tune": tune_rows(state),
                           "memory": memory_rows(state), "spill": spill_rows(state), "opoff": opoff_rows(state),
                           "plan": plan_rows(state),
                           "steps": {k: {"status": v.get("status"), "took_s": v.get("took_s"),
                                         "weights": (v.get("result") or {}).get("model_weights"),
                                         "note": v.get("note")} for k, v in state.get("steps", {}).items()}}
    from gpucheck import race as gpu_race
    from gpucheck import versus as gpu_versus

    doc["versus"] = gpu_versus.rows(state)
    lines += gpu_versus.markdown(state)
    doc["race"] = gpu_race.rows(state)
    lines += gpu_race.markdown(state)
    zero = model.get("weights") == "zero"
    if doc["tune"]:
        lines += ["## (b) auto-tune vs llama.cpp default vs --fit (one run each, arms interleaved; --max-kld off)", "",
                  "| run | free VRAM MiB | workload | ctx | tuned gen / prompt tok/s | default gen / prompt | "
                  "--fit gen / prompt | tuned/default | tuned/fit | roofline % gen / prompt | tok/J | VRAM peak MiB | "
                  "spill |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in doc["tune"]:
            default = f"{_f(r['default_gen_tok_s'])} / {_f(r['default_prompt_tok_s'], '{:,.0f}')}" \
                if r["default_gen_tok_s"] is not None else f"failed ({r['default_failure'] or '?'})"
            lines.append(
                f"| {r['run']} | {_f(r['budget_mib'], '{:,}')} | {r['workload']} | {_f(r['ctx'], '{}')} | "
                f"{_f(r['tuned_gen_tok_s'])} / {_f(r['tuned_prompt_tok_s'], '{:,.0f}')} | {default} | "
                f"{_f(r['fit_gen_tok_s'])} / {_f(r['fit_prompt_tok_s'], '{:,.0f}')} | "
                f"{_f(r['tuned_vs_default'], '{:.2f}x')} | {_f(r['tuned_vs_fit'], '{:.2f}x')} | "
                f"{_roof(r, zero)} | {_f(r['tok_per_j'], '{:.2f}')} | "
                f"{_mib(r['vram_peak_bytes'])} | {r['spill'] or '-'} |")
        lines += ["", "Tuned launch lines:", ""] + [f"- {r['run']}: `{r['tuned']}`" for r in doc["tune"]] + [""]
    if doc["memory"]:
        lines += ["## (a) memory model vs llama.cpp's own CUDA breakdown, component by component", "",
                  "| run | llama.cpp's figure | device | component | model MiB | llama.cpp MiB | error MiB | error % | "
                  "agrees |", "|---|---|---|---|---:|---:|---:|---:|---|"]
        for r in doc["memory"]:
            err = None if r.get("engine_mib") is None or r.get("model_mib") is None else \
                r["model_mib"] - r["engine_mib"]
            pct = None if err is None or not r["engine_mib"] else 100 * err / r["engine_mib"]
            agrees = "-" if r.get("agrees") is None else ("yes" if r["agrees"] else
                                                          f"no (tolerance {r.get('tolerance_mib')} MiB)")
            lines.append(f"| {r['run']} | {r.get('src', 'at exit')} | {r['device']} | {r['component']} | "
                         f"{_f(r.get('model_mib'), '{:,}')} | {_f(r.get('engine_mib'), '{:,}')} | "
                         f"{_f(err, '{:+,}')} | {_f(pct, '{:+.1f}')} | {agrees} |")
        lines.append("")
    if doc["spill"]:
        lines += ["## (c) induced spill: what the tool classified", "",
                  "| run | try | unified memory | free VRAM MiB | needs MiB (model) | classified | gen tok/s | "
                  "vs no spill | evidence |", "|---|---:|---|---:|---:|---|---:|---:|---|"]
        for r in doc["spill"]:
            lines.append(f"| {r['run']} | {r.get('attempt', 1)} | {'yes' if r.get('unified') else 'no'} | "
                         f"{_f(r.get('free_mib'), '{:,}')} | {_f(r.get('need_mib'), '{:,}')} | {r.get('verdict')} | "
                         f"{_f(r.get('gen_tok_s'))} | {_f(r.get('vs_reference'), '{:.2f}x')} | "
                         f"{str(r.get('evidence', ''))[:160]} |")
        lines.append("")
    if doc["opoff"]:
        lines += ["## (d) op offload on vs off (--no-op-offload), each line as tuned otherwise", "",
                  "| run | line | --n-cpu-moe | -ub | op offload | turn prompt tok/s | turn TTFT s | "
                  "long prompt tok/s | long TTFT s | gen tok/s | off/on turn | off/on long | spill |",
                  "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in doc["opoff"]:
            if r.get("failed"):
                lines.append(f"| {r['run']} | {r['line']} | {r.get('n_cpu_moe')} | {r.get('ubatch')} | "
                             f"{r['op_offload']} | failed: {r['failed'][:120]} |  |  |  |  |  |  |  |")
                continue
            lines.append(f"| {r['run']} | {r['line']} | {r.get('n_cpu_moe')} | {r.get('ubatch') or 'default'} | "
                         f"{r['op_offload']} | {_f(r.get('turn_prompt_tok_s'), '{:,.0f}')} | "
                         f"{_f(r.get('turn_ttft_s'), '{:.2f}')} | {_f(r.get('long_prompt_tok_s'), '{:,.0f}')} | "
                         f"{_f(r.get('long_ttft_s'), '{:.2f}')} | {_f(r.get('gen_tok_s'))} | "
                         f"{_f(r.get('turn_prompt_tok_s_off_vs_on'), '{:.2f}x')} | "
                         f"{_f(r.get('long_prompt_tok_s_off_vs_on'), '{:.2f}x')} | {r.get('spill', '-')} |")
        lines.append("")
    if doc["plan"]:
        lines += ["## planned, not measured (memory model only; no GPU on this machine)", "",
                  "| budget MiB | workload | ctx | smallest --n-cpu-moe that fits | VRAM MiB | tg ceiling tok/s |",
                  "|---:|---|---:|---:|---:|---:|"]
        for r in doc["plan"]:
            lines.append(f"| {r['budget_mib']:,} | {r['workload']} | {r['ctx']} | "
                         f"{'does not fit' if r['n_cpu_moe'] is None else r['n_cpu_moe']} | "
                         f"{_mib(r.get('vram_bytes'))} | {_f(r.get('gen_tok_s_ceiling'), '{:,.0f}')} |")
        lines += ["", f"(planned for {state.get('plan_card', '?')} with --vram-budget; host RAM and its bandwidth, "
                  "which bounds the tg ceiling of offloaded experts, as probed on this machine)", ""]
    lines += ["## steps", "", "| step | status | took s | measured on | note |", "|---|---|---:|---|---|"]
    for name, s in doc["steps"].items():
        lines.append(f"| {name} | {s['status']} | {_f(s['took_s'], '{:.0f}')} | {WEIGHTS.get(s['weights'], '-')} | "
                     f"{s.get('note') or ''} |")
    return "\n".join(lines) + "\n", doc


def card_slug(state: dict[str, Any]) -> str:
    name = state.get("machine", {}).get("gpu_name") or "cpu"
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def write_back(state: dict[str, Any], dest: Path) -> list[Path]:
    """``gpu-<card>.md`` and ``gpu-<card>.json`` (the table's document with the whole state inside, so a later
    lease starts from it with ``--state``) in ``dest``: the files a lease brings back, kept as they came."""
    md, doc = render(state)
    dest.mkdir(parents=True, exist_ok=True)
    paths = [dest / f"gpu-{card_slug(state)}.md", dest / f"gpu-{card_slug(state)}.json"]
    paths[0].write_text(md)
    paths[1].write_text(json.dumps({**doc, "build": state.get("engine_build"), "engine_back": state.get("engine_back"),
                                    "state": state}, indent=2, default=str) + "\n")
    return paths


def write(state: dict[str, Any], out_dir: Path, bench_dir: Path | None) -> list[Path]:
    md, doc = render(state)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "table.md", out_dir / "table.json"]
    written[0].write_text(md)
    written[1].write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if bench_dir is not None:
        path = bench_dir / f"gpu-{card_slug(state)}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(md)
        written.append(path)
    return written
