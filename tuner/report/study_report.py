"""A study's result as files: result.json (everything needed to rebuild the report), report.md, PNG plots;
and the launch line of the measured winner (or the N-th), rendered by the same renderer that measured it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from tuner.core.errors import UsageError
from tuner.engine import flags
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.study import TrialRecord, config_from_dict, non_dominated, pareto_front, records

RESULT_VERSION = 1


def result_from_study(st: Any) -> dict[str, Any]:
    """Rebuild the whole result from the study's storage alone."""
    attrs = dict(st.user_attrs)
    recs = records(st)
    fin = Finish.from_dict(attrs["finish"]) if "finish" in attrs else Finish((), ())
    winner = fin.winner
    return {
        "version": RESULT_VERSION, "study": st.study_name, "model": attrs.get("model"),
        "hardware": attrs.get("hardware"), "engine": attrs.get("engine"), "workload": attrs.get("workload"),
        "objective": attrs.get("objective"), "space": attrs.get("space"),
        "trials": [r.to_dict() for r in recs],
        "pareto": [r.number for r in pareto_front(st)],
        "finish": fin.to_dict(),
        "winner": winner.to_dict() if winner else None,
        "speedup": {"default": fin.speedup("default"), "fit": fin.speedup("fit")},
    }


def load_result(path: Path) -> dict[str, Any]:
    file = path / "result.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {file} ({exc}): pass results/<study>/result.json from auto-tune") from None
    if not isinstance(data, dict) or "finish" not in data:
        raise UsageError(f"{file} is not an auto-tune result: pass results/<study>/result.json")
    return data


def ranked(result: dict[str, Any]) -> list[ServerMeasurement]:
    """Every config re-measured with llama-server (candidates and baselines): the winner
    (:attr:`tuner.search.finish.Finish.winner`) first, then the rest fastest first, failed ones last."""
    fin = Finish.from_dict(result["finish"])
    rest = sorted((m for m in (*fin.candidates, *fin.baselines) if m is not fin.winner),
                  key=lambda m: -(m.gen_tok_s or -1.0))
    return [fin.winner, *rest] if fin.winner is not None else rest


def launch_line(result: dict[str, Any], *, rank: int = 1, fmt: str = "shell", host: str | None = None,
                port: int | None = None, binary: str = "llama-server") -> str:
    cands = ranked(result)
    if not 1 <= rank <= len(cands):
        raise UsageError(f"--rank {rank} is out of range: this result has {len(cands)} measured configs")
    cand = cands[rank - 1]
    cfg = config_from_dict(cand.config)
    argv = flags.server_argv(Path(binary), cfg)
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    if fmt == "shell":
        return shlex.join(argv)
    if fmt == "json":
        return json.dumps({"argv": argv, "config": cand.config, "gen_tok_s": cand.gen_tok_s,
                           "gen_cv_pct": cand.gen_cv_pct}, indent=2)
    if fmt == "llama-swap":
        name = Path(cand.config["model"]).stem
        cmd = shlex.join([*argv[:1], *argv[1:], *([] if port is not None else ["--port", "${PORT}"])])
        return f"models:\n  {json.dumps(name)}:\n    cmd: {json.dumps(cmd)}\n"
    raise UsageError(f"unknown --format {fmt}: use shell, llama-swap or json")


# ------------------------------------------------------------------------------------------- files


def _fmt(v: float | None, spec: str = ",.1f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(result: dict[str, Any]) -> str:
    trials = [TrialRecord(**t) for t in result["trials"]]
    lines = [f"# auto-tune: {Path(result['model'] or '?').name}", "",
             f"- study: `{result['study']}`", f"- machine: {(result.get('hardware') or {}).get('describe')}",
             f"- engine: llama.cpp {(result.get('engine') or {}).get('commit')} "
             f"({(result.get('engine') or {}).get('backend')})",
             f"- workload: {result.get('workload')}", ""]
    w = result.get("winner")
    if w:
        sp = result.get("speedup") or {}
        lines += ["## Winner", "", f"`{w['launch_line']}`", "",
                  f"- generation {_fmt(w['gen_tok_s'])} tok/s per request (CV {_fmt(w['gen_cv_pct'])} %), "
                  f"prompt {_fmt(w['prompt_tok_s'])} tok/s, TTFT {_fmt((w['ttft_s'] or 0) * 1000, ',.0f')} ms",
                  f"- vs default: {_fmt(sp.get('default'), '.2f')}x; vs --fit: {_fmt(sp.get('fit'), '.2f')}x "
                  f"(by {Finish.from_dict(result['finish']).metric})",
                  f"- spill: {w['spill']}; roofline: {_fmt(w['roofline_pct'], '.0f')} %; "
                  f"tok/J: {_fmt(w['tokens_per_joule'], '.2f')}", ""]
    lines += ["## Server re-measure", "", "| config | gen tok/s | CV % | prompt tok/s | TTFT ms | launch line |",
              "|---|---:|---:|---:|---:|---|"]
    fin = result["finish"]
    for m in [*fin.get("baselines", []), *fin.get("candidates", [])]:
        lines.append(f"| {m['label']} | {_fmt(m['gen_tok_s'])} | {_fmt(m['gen_cv_pct'])} | {_fmt(m['prompt_tok_s'])}"
                     f" | {_fmt((m['ttft_s'] or 0) * 1000, ',.0f')} | `{m['launch_line']}` |")
    lines += ["", "## Trials", "",
              "| # | status | seed | n-cpu-moe | K | V | fa | threads | ubatch | gen tok/s | prompt tok/s | note |",
              "|---:|---|---|---:|---|---|---|---:|---:|---:|---:|---|"]
    for t in trials:
        c = t.config
        note = ""
        if t.status == "infeasible":
            note = ", ".join(f"{k}={v:+.0f}" for k, v in t.constraints.items() if v > 0)
        elif t.failure:
            note = f"{t.failure.get('kind')}: {str(t.failure.get('reason'))[:60]}"
        lines.append(f"| {t.number} | {t.status} | {t.seed or ''} | {c.get('n_cpu_moe')} | {c.get('cache_type_k')} |"
                     f" {c.get('cache_type_v')} | {c.get('flash_attn')} | {c.get('threads')} | {c.get('ubatch')} |"
                     f" {_fmt(t.gen_tok_s)} | {_fmt(t.prompt_tok_s)} | {note} |")
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """tok/s vs n-cpu-moe per KV type, and generation vs prompt tok/s with the Pareto front marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [t for t in result["trials"] if t["status"] == "measured"]
    written: list[Path] = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_kv: dict[str, list[tuple[int, float]]] = {}
    for t in measured:
        c = t["config"]
        by_kv.setdefault(f"K {c['cache_type_k']} / V {c['cache_type_v']}", []).append(
            (c.get("n_cpu_moe") or 0, t["gen_tok_s"]))
    for label, pts in sorted(by_kv.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if len(pts) > 1 else "",
                label=label)
    ax.set_xlabel("--n-cpu-moe (layers whose experts stay in RAM)")
    ax.set_ylabel("generation tok/s (llama-bench)")
    ax.set_title("Generation speed vs --n-cpu-moe per KV cache type")
    if by_kv:
        ax.legend(fontsize="small")
    path = out_dir / "tok_s_vs_n_cpu_moe.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    front = set(result.get("pareto") or [])
    if not front and measured:  # single objective: mark the non-dominated measured trials
        flags = non_dominated([(t["gen_tok_s"], t["prompt_tok_s"]) for t in measured])
        front = {t["number"] for t, on in zip(measured, flags, strict=True) if on}
    ax.scatter([t["prompt_tok_s"] for t in measured], [t["gen_tok_s"] for t in measured], label="measured trials")
    pf = sorted((t for t in measured if t["number"] in front), key=lambda t: t["prompt_tok_s"])
    ax.plot([t["prompt_tok_s"] for t in pf], [t["gen_tok_s"] for t in pf], color="red", marker="D",
            label="Pareto front")
    ax.set_xlabel("prompt tok/s")
    ax.set_ylabel("generation tok/s")
    ax.set_title("Generation vs prompt speed")
    ax.legend(fontsize="small")
    path = out_dir / "pareto_front.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def write(result: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(result))
    return [out_dir / "result.json", out_dir / "report.md", *plots(result, out_dir)]
