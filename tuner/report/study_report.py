"""A study's result for people: report.md, PNG plots (only those that carry information), and the launch line of
the measured winner (or the N-th), rendered by the same renderer that measured it. The result itself (result.json,
typed and versioned) is :mod:`tuner.search.result`'s; which line a run hands out, at which rank, is
:mod:`tuner.report.handover`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.core.errors import UsageError
from tuner.engine.identity import EngineIdentity, replay_note
from tuner.engine.kinds import EngineKind
from tuner.machine.fileio import atomic_write
from tuner.report import deploy, handover
from tuner.report.handover import Pick, deciding_session, ranked, session_paged  # noqa: F401 - re-exported
from tuner.search import dedup
from tuner.search.finish import Finish
from tuner.search.result import StudyResult, load_result, write_result  # noqa: F401 - load_result re-exported
from tuner.search.trials import TrialRecord, non_dominated
from tuner.search.verdict import Verdict

# How the baselines read in the report ("fit": llama.cpp's own --fit placement).
BASELINE_NAMES = {"fit": "llama.cpp fit"}


def picks(result: StudyResult) -> list[Pick]:
    """What ``launch-line --rank N`` counts, the printed line first (:func:`tuner.report.handover.of`)."""
    return handover.of(result).picks


def engine_of(result: StudyResult, rank: int = 1) -> EngineKind:
    """Which kind of engine the ``rank``-th line is for (its config's ``engine``)."""
    return handover.of(result).at(rank).kind


def binary_for(result: StudyResult, rank: int = 1, llama_cpp_dir: Path | None = None) -> str:
    """The llama-server the ``rank``-th line names (:func:`tuner.report.handover.binary_for`)."""
    return handover.binary_for(handover.of(result).at(rank), llama_cpp_dir)


def launch_argv(result: StudyResult, *, rank: int = 1, host: str | None = None, port: int | None = None,
                binary: str = "llama-server") -> list[str]:
    """The measured command of the ``rank``-th line as an argument list (what ``--exec`` runs)."""
    return handover.argv(handover.of(result).at(rank), host=host, port=port, binary=binary)


def launch_env(result: StudyResult, *, rank: int = 1) -> dict[str, str]:
    """What the ``rank``-th line's engine reads from its environment (:func:`tuner.engine.flags.server_env`)."""
    return handover.env(handover.of(result).at(rank))


def launch_line(result: StudyResult, *, rank: int = 1, fmt: str = "shell", host: str | None = None,
                port: int | None = None, binary: str | None = None, env: Mapping[str, str] | None = None,
                llama_cpp_dir: Path | None = None) -> str:
    """The ``rank``-th line a run hands out as ``fmt`` (:func:`tuner.report.handover.render`): the printed line first,
    one answer from either folder of a race across engines; a line its price refused is never one."""
    if fmt not in deploy.FORMATS:
        raise UsageError(f"unknown --format {fmt}: use {', '.join(deploy.FORMATS)}")
    return handover.render(handover.of(result).at(rank), fmt, host=host, port=port, binary=binary, env=env,
                           llama_cpp_dir=llama_cpp_dir)


# ------------------------------------------------------------------------------------------- files


def _fmt(v: float | None, spec: str = ",.1f") -> str:
    return "n/a" if v is None else format(v, spec)


def offload_cell(c: dict[str, Any]) -> str:
    """What a trial kept off the GPU, in llama-server's short flags: ``ngl 28`` (a dense model's layers on the GPU)
    or ``ncmoe 4`` (a MoE's layers whose experts stay in host RAM); "default" where neither was set."""
    if c.get("n_gpu_layers") is not None:
        return f"ngl {c['n_gpu_layers']}"
    return "default" if c.get("n_cpu_moe") is None else f"ncmoe {c['n_cpu_moe']}"


def _cell(v: object) -> str:
    """A config value as a person reads it: "default" where the engine's own default applies."""
    return "default" if v is None else str(v)


def _or_dash(v: object) -> str:
    return "-" if v is None else str(v)


def workload_words(w: dict[str, Any] | None) -> str:
    """``{"kind": "chat", "prompt_tokens": 512, ...}`` as words: chat, 512-token prompts, 128-token replies ..."""
    if not w:
        return "-"
    users = w.get("concurrency") or 1
    text = (f"{w.get('kind')}: {w.get('prompt_tokens')}-token prompts, {w.get('gen_tokens')}-token replies "
            f"generated at depth {w.get('depth_tokens', w.get('prompt_tokens'))}")
    return text + (f", {users} requests in flight" if users > 1 else ", one request at a time")


def _winner_lines(result: dict[str, Any]) -> list[str]:  # the to_dict() form
    w = result.get("winner")
    if not w:
        return []
    fin = Finish.from_dict(result["finish"])
    sp = result.get("speedup") or {}
    versus = "; ".join(f"vs {BASELINE_NAMES.get(k, k)}: {v:.2f}x" for k, v in sp.items() if v is not None)
    cfg = w["config"]
    q = result.get("quality") or {}
    floor = q.get("max_kld")
    kld = (f"mean KLD {w['kld_mean']:.5f} vs the f16 cache (same top token {_fmt(w['same_top_pct'], '.2f')} %)"
           if w.get("kld_mean") is not None else "not priced (--max-kld off)")
    decision = result["finish"].get("decision") or {}
    lines = ["## Launch line", "", f"`{w['launch_line']}`", "", f"- why: {decision.get('reason', '-')}",
             f"- generation {_fmt(w['gen_tok_s'])} tok/s per request (CV across rounds {_fmt(w['gen_cv_pct'])} %), "
             f"prompt {_fmt(w['prompt_tok_s'])} tok/s, TTFT {_fmt((w['ttft_s'] or 0) * 1000, ',.0f')} ms",
             f"- quality: KV {cfg.get('cache_type_k')}/{cfg.get('cache_type_v')}, {kld}; floor "
             f"{'off' if floor is None else format(floor, 'g')}"]
    if w.get("slots", 1) > 1 or fin.concurrency > 1:
        lines.append(f"- {w.get('slots', 1)} slots: {_fmt(w.get('loaded_gen_tok_s'))} tok/s per request with every "
                     f"slot busy, {_fmt(w.get('end_to_end_gen_tok_s'))} tok/s aggregate (prompts included)")
    if result.get("seed_story"):  # auto-tune --seed-from: which seed won, and where it came from
        lines.append(f"- seed: {result['seed_story']}")
    if versus:
        lines.append(f"- {versus} (by {fin.metric})")
    lines += [f"- {Verdict.from_dict(v).describe()}" for v in result["finish"].get("verdicts", [])]
    lines.append(f"- spill: {w['spill']}; roofline: {_fmt(w['roofline_pct'], '.0f')} %; "
                 f"tok/J: {_fmt(w['tokens_per_joule'], '.2f')}")
    lines.append(f"- host paging: {w.get('host_paging_evidence') or 'not measured'}")
    return [*lines, ""]


def _session_lines(result: StudyResult) -> list[str]:
    """The agent workload's session stage: it chose the launch line, so it comes first."""
    stage = deciding_session(result)
    if stage is None:
        return []
    confirmation = stage.get("confirmation") or []
    win = next(a for a in [*confirmation, *stage["arms"]] if a["label"] == stage["winner"])
    lines = ["## Agent sessions: the launch line", "", f"`{win['launch_line']}`", "",
             f"- chosen by {stage['metric']} over the {stage['source']} session: {stage['winner']}"]
    if stage.get("reason"):
        lines.append(f"- why: {stage['reason']}")
    if stage.get("verdict_text"):
        lines.append(f"- {stage['verdict_text']}")
    lines += [f"- {label}: {note}" for label, note in (stage.get("not_launched") or {}).items()]
    for title, arms in ((("selection rounds (they choose the reuse arm to confirm; they decide nothing)",
                          stage["arms"]), ("confirmation rounds (fresh; the verdict is theirs)", confirmation))
                        if confirmation else (("every round", stage["arms"]),)):
        lines += ["", f"{title}:", ""] + _session_table(arms)
    lines += ["", "The sections below are the single-request finish the session stage started from.", ""]
    return lines


def _session_table(arms: list[dict[str, Any]]) -> list[str]:
    lines = ["| arm | median session s | rounds | median TTFT ms (typical round) | re-processed % | launch line |",
             "|---|---:|---:|---:|---:|---|"]
    for arm in arms:
        typical = None if arm["typical_round"] is None else arm["rounds"][arm["typical_round"]]
        ttft = "" if typical is None else f"{1000 * typical['median_ttft_s']:,.0f}"
        share = "" if typical is None else f"{100 * typical['reprocessed_share']:.0f}"
        done = sum(r is not None for r in arm["rounds"])
        paged = " (host RAM paging: never the line)" if arm.get("paging") else ""
        lines.append(f"| {arm['label']}{paged} | {_fmt(arm['median_session_s'], '.2f')} | {done} | {ttft} | {share} | "
                     f"`{arm['launch_line']}` |")
    lines += [f"- {arm['label']} paged host RAM: {arm['paging']}" for arm in arms if arm.get("paging")]
    return lines


def _memory_lines(result: dict[str, Any]) -> list[str]:
    """Whose memory figures decided the gate, and the commit the replay follows when the engine is another."""
    figures = result.get("memory_figures")
    if not figures:
        return []
    engine = EngineIdentity.from_dict(figures.get("engine"))
    lines = [f"- memory verdicts: {engine.name}'s own projection (llama-fit-params) for {figures.get('configs')} "
             f"configs ({figures.get('projections_run')} run in {figures.get('projection_s')} s); the replay of "
             f"llama.cpp {figures.get('replay_commit')} made the first guesses"]
    whose = replay_note(engine)
    return lines + ([f"- {whose}"] if whose else []) + [f"- {note}" for note in figures.get("notes") or []]


def _engines_lines(block: dict[str, Any] | None) -> list[str]:
    """`auto-tune --engines`: each engine's line, the head to head's figures and verdicts, and what was printed."""
    if not block:
        return []
    versus = block.get("head_to_head") or {}
    arms = {a["label"]: a for a in versus.get("arms", [])}
    out = ["## Engines head to head", "", f"By {versus.get('metric', 'the workload')}. "
           "KLD: the engine's logits against llama.cpp's on this model (f16 KV).", "",
           "| line | engine | gen tok/s | prompt tok/s | TTFT s | session s | KLD | launch line |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for x in block.get("lines", []):
        a = arms.get(x["label"], {})
        out.append(f"| {x['label']} | {x['engine']} | {_fmt(a.get('gen_tok_s'))} | {_fmt(a.get('prompt_tok_s'))} | "
                   f"{_fmt(a.get('ttft_s'), '.2f')} | {_fmt(a.get('session_s'))} | {_fmt(x.get('engine_kld'), '.3g')} "
                   f"| `{x['launch_line']}` |")
    out += ["", *(f"- {Verdict.from_dict(v).describe()}" for v in versus.get("verdicts", [])),
            *(f"- {r}" for r in block.get("refused", [])),
            f"- printed: {block['printed']} ({block['reason']})"
            + ("" if block.get("chosen") else f"; its result is {block['printed_engine']}'s"), ""]
    return out


def markdown(study_result: StudyResult) -> str:
    result = study_result.to_dict()
    trials = [TrialRecord(**t) for t in result["trials"]]
    m = result.get("measure") or {}
    lines = [f"# auto-tune: {Path(result['model'] or '?').name}", "",
             f"- study: `{result['study']}`", f"- machine: {_or_dash((result.get('hardware') or {}).get('describe'))}",
             f"- engine: {EngineIdentity.from_dict(result.get('engine')).describe()}",
             *_memory_lines(result),
             f"- workload: {workload_words(result.get('workload'))}",
             f"- trials: llama-bench pp{m.get('n_prompt')} at depth {m.get('prompt_depth')}, tg{m.get('n_gen')} at "
             f"depth {m.get('gen_depth')}, scored by one request's end-to-end time" if m else "- trials: llama-bench",
             "", *_engines_lines(result.get("engines")), *_session_lines(study_result), *_winner_lines(result)]
    fin = result["finish"]
    confirmed = fin.get("confirmation") or []
    phases = (["Selection rounds come first: they chose the candidate to confirm and decide nothing; the "
               "confirmation rounds measured it again, beside the baselines, and the verdicts are theirs.", ""]
              if confirmed else [])
    lines += ["## Server re-measure", "",
              "gen tok/s and prompt tok/s: one request alone; per request, slots busy: each request's generation "
              "speed with every slot in use; end-to-end tok/s: generated tokens per second of wall time, prompts "
              "and every slot included (below the generation speed with one slot, as it counts the prompt too).",
              "", *phases, "| config | slots | gen tok/s | CV % | prompt tok/s | per request, slots busy | "
              "end-to-end tok/s | KLD | rounds | launch line |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in [*fin.get("baselines", []), *fin.get("candidates", []), *confirmed]:
        if confirmed and s is confirmed[0]:
            lines.append("| **confirmation rounds** | | | | | | | | | |")
        rounds = sum(x is not None for x in s.get("scores", []))
        lines.append(f"| {s['label']} | {s.get('slots', 1)} | {_fmt(s['gen_tok_s'])} | {_fmt(s['gen_cv_pct'])} | "
                     f"{_fmt(s['prompt_tok_s'])} | {_fmt(s.get('loaded_gen_tok_s'))} | "
                     f"{_fmt(s.get('end_to_end_gen_tok_s'))} | {_fmt(s.get('kld_mean'), '.3g')} | {rounds} | "
                     f"`{s['launch_line']}` |")
    lines += ["", "## Trials", "",
              "| # | status | seed | offload | K/V | fa | threads | ubatch | depth | reps | gen tok/s | "
              "prompt tok/s | s/request | KLD | note |",
              "|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in trials:
        c = t.config
        note = ""
        if t.status == "infeasible":
            note = ", ".join(f"{k}={v:+.4g}" for k, v in t.constraints.items() if v > 0)
        elif t.status == dedup.PAGING:
            faults = (t.host_paging or {}).get("major_faults_per_token")
            note = "host RAM paging" + ("" if faults is None else f": {faults:,.1f} major faults per token") + \
                ": never a candidate"
        elif t.status == dedup.BESIDE_OTHERS:
            note = "paged while other programs took RAM: measured again, not held against the config"
        elif t.failure:
            note = f"{t.failure.get('kind')}: {str(t.failure.get('reason'))[:60]}"
        lines.append(f"| {t.number} | {t.status} | {t.seed or ''} | {offload_cell(c)} | "
                     f"{c.get('cache_type_k')}/{c.get('cache_type_v')} | {_cell(c.get('flash_attn'))} | "
                     f"{_cell(c.get('threads'))} | {_cell(c.get('ubatch'))} | "
                     f"{'' if t.gen_depth is None else t.gen_depth} | {t.repetitions or ''} | {_fmt(t.gen_tok_s)} | "
                     f"{_fmt(t.prompt_tok_s)} | {_fmt(t.request_s, '.3f')} | {_fmt(t.kld, '.3g')} | {note} |")
    return "\n".join(lines) + "\n"


def plots(study_result: StudyResult, out_dir: Path) -> list[Path]:
    """Only plots that carry information: tok/s vs the offload axis (--n-cpu-moe, or -ngl for a dense model) per KV
    pair when it took several values, and generation vs prompt tok/s with the Pareto front when two or more trials
    were measured."""
    result = study_result.to_dict()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [t for t in result["trials"] if t["status"] == "measured" and t.get("gen_tok_s")]
    written: list[Path] = []
    # The offload axis: -ngl for a dense model (layers on the GPU), --n-cpu-moe for a MoE (layers whose experts
    # stay in RAM).
    dense = any(t["config"].get("n_gpu_layers") is not None for t in measured)
    key, axis = (("n_gpu_layers", "layers on the GPU") if dense else
                 ("n_cpu_moe", "layers whose experts stay in RAM"))
    if len({t["config"].get(key) for t in measured} - {None}) >= 2:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        by_kv: dict[str, list[tuple[int, float]]] = {}
        for t in measured:
            c = t["config"]
            by_kv.setdefault(f"K {c['cache_type_k']} / V {c['cache_type_v']}", []).append(
                (c.get(key) or 0, t["gen_tok_s"]))
        for label, pts in sorted(by_kv.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if len(pts) > 1 else "",
                    label=label)
        ax.set_xlabel(axis)
        ax.set_ylabel("generation tok/s at the workload's depth (llama-bench)")
        ax.set_title(f"Generation speed vs {axis} per KV cache pair")
        ax.legend(fontsize="small")
        written.append(save_png(fig, out_dir / f"tok_s_vs_{key}.png"))
    if len(measured) >= 2:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        front = set(result.get("pareto") or [])
        if not front:  # single objective: mark the non-dominated measured trials
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
        written.append(save_png(fig, out_dir / "pareto_front.png"))
    return written


def save_png(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(result: StudyResult, out_dir: Path) -> list[Path]:
    """result.json (the data), report.md and the plots (for people) into ``out_dir``."""
    written = [write_result(result, out_dir), atomic_write(out_dir / "report.md", markdown(result))]
    return [*written, *plots(result, out_dir)]
