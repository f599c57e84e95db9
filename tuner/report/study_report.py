"""A study's result for people: report.md, PNG plots (only those that carry information), and the launch line of
the measured winner (or the N-th), rendered by the same renderer that measured it. The result itself (result.json,
typed and versioned) is :mod:`tuner.search.result`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tuner.core.errors import TunerError, UsageError
from tuner.engine import build, flags
from tuner.engine.identity import EngineIdentity, replay_note
from tuner.engine.kinds import EngineKind, kind_by_name
from tuner.machine.fileio import atomic_write
from tuner.report import deploy
from tuner.search import dedup
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.result import StudyResult, load_result, write_result  # noqa: F401 - load_result re-exported
from tuner.search.trials import TrialRecord, config_from_dict, non_dominated
from tuner.search.verdict import Verdict

# How the baselines read in the report ("fit": llama.cpp's own --fit placement).
BASELINE_NAMES = {"fit": "llama.cpp fit"}
T = TypeVar("T")


def _distinct(arms: list[T], line_of: Callable[[T], str]) -> list[T]:
    """``arms`` without the later ones that run the same line as an earlier one (one line to launch)."""
    seen: set[str] = set()
    kept = []
    for arm in arms:
        key = line_of(arm)
        if key not in seen:
            seen.add(key)
            kept.append(arm)
    return kept


def ranked(result: StudyResult) -> list[ServerMeasurement]:
    """Every config re-measured with llama-server (candidates and baselines), each distinct line once: the printed
    one (:attr:`tuner.search.finish.Finish.winner`, as its verdict measured it) first, then the others in the
    finish's own order, the score it selects by (:meth:`~tuner.search.finish.Finish.rank`, over the rounds every
    arm was measured in); those that miss --min-tok-s after them, failed ones last. An arm whose own VRAM broke
    the budget, or was never read under one, is not a line to launch: it is left out.

    The winner is matched by label, not identity: after confirmation rounds it is the confirmation's copy, and its
    selection copy must not come back as a runner-up. An arm that paged host RAM is left out too (a line that reads
    its model back from disk is never printed)."""
    fin = result.finish
    winner = fin.winner
    rest = [m for m in (*fin.candidates, *fin.baselines)
            if (winner is None or m.label != winner.label) and not fin.over_budget(m) and not fin.vram_unknown(m)
            and not m.paging]
    rest.sort(key=lambda m: (not fin.eligible(m), fin.rank(m) is None, -(fin.rank(m) or 0.0)))
    return _distinct([winner, *rest] if winner is not None else rest, lambda m: m.launch_line)


@dataclass(frozen=True, slots=True)
class Pick:
    """A launchable config of a result and the figures it was chosen on."""

    label: str
    config: dict[str, Any]
    figures: dict[str, Any]


def session_paged(result: StudyResult) -> dict[str, str]:
    """The launch lines the session stage saw page host RAM, with the evidence: never printed, whatever ranks them."""
    stage = result.session or {}
    return {a["launch_line"]: a["paging"] for a in [*stage.get("arms", []), *(stage.get("confirmation") or [])]
            if a.get("paging")}


def deciding_session(result: StudyResult) -> dict[str, Any] | None:
    """The agent workload's session stage when it chose the config to launch (it ran and has a winner)."""
    stage = result.session
    return stage if stage and stage.get("winner") else None


def picks(result: StudyResult) -> list[Pick]:
    """What ``launch-line --rank N`` counts, the printed line first. Where the engines' head to head printed a line
    of this result's engine (``auto-tune --engines``), that line comes first. The agent workload's session stage
    scores whole sessions, so when it ran, its arms (its printed one, then by median session time, the confirmation's
    figures where an arm was measured again; failed last; none that paged host RAM, broke the VRAM budget or was not
    known to keep it) are the ranking; otherwise :func:`ranked`."""
    own = _own_picks(result)
    chosen = engines_pick(result)
    if chosen is None:
        return own
    return _distinct([chosen, *own], lambda p: flags.launch_line(config_from_dict(p.config)))


def engines_pick(result: StudyResult) -> Pick | None:
    """The line the engines' head to head printed, when it is this result's engine's (None: no such head to head,
    or another engine's line was printed)."""
    block = result.engines or {}
    if not block.get("chosen"):
        return None
    line = next((x for x in block.get("lines", []) if x.get("label") == block.get("printed")), None)
    if line is None:
        return None
    return Pick(line["label"], line["config"], {"chosen_by": "the engines' head to head", "reason": block["reason"]})


def _own_picks(result: StudyResult) -> list[Pick]:
    stage = deciding_session(result)
    paged = session_paged(result)
    if stage is not None:
        judged = {a["label"]: a for a in [*stage["arms"], *(stage.get("confirmation") or [])]
                  if a.get("config") and a["launch_line"] not in paged and not a.get("over_budget")
                  and a.get("vram_verdict") != "unknown"}
        arms = sorted(judged.values(), key=lambda a: (a["label"] != stage["winner"], a["median_session_s"] is None,
                                                     a["median_session_s"] or 0.0))
        return _distinct([Pick(a["label"], a["config"], {"median_session_s": a["median_session_s"],
                                                         "chosen_by": "agent session time"}) for a in arms],
                         lambda p: flags.launch_line(config_from_dict(p.config)))
    return [Pick(m.label, m.config, {"gen_tok_s": m.gen_tok_s, "gen_cv_pct": m.gen_cv_pct}) for m in ranked(result)
            if m.launch_line not in paged]


def _pick_at(result: StudyResult, rank: int) -> Pick:
    cands = picks(result)
    fin = result.finish
    paged = [*session_paged(result).values(), *(m.host_paging_evidence or "" for m in (*fin.candidates,
                                                                                          *fin.baselines) if m.paging)]
    if not cands and paged:
        raise UsageError(f"no line: every measured config paged host RAM ({paged[0]}); a line that reads its model "
                         "back from disk is never printed: free RAM, or tune again with a smaller quant or context")
    if not 1 <= rank <= len(cands):
        raise UsageError(f"--rank {rank} is out of range: this result has {len(cands)} measured configs")
    return cands[rank - 1]


def _argv(pick: Pick, host: str | None, port: int | None, binary: str) -> list[str]:
    return flags.server_argv(Path(binary), config_from_dict(pick.config)) + flags.address_argv(host, port)


def launch_argv(result: StudyResult, *, rank: int = 1, host: str | None = None, port: int | None = None,
                binary: str = "llama-server") -> list[str]:
    """The measured command of the ``rank``-th config as an argument list (what ``--exec`` runs)."""
    return _argv(_pick_at(result, rank), host, port, binary)


def engine_of(result: StudyResult, rank: int = 1) -> EngineKind:
    """Which kind of engine the ``rank``-th line is for (its config's ``engine``)."""
    return kind_by_name(_pick_at(result, rank).config.get("engine"))


def binary_for(result: StudyResult, rank: int = 1, llama_cpp_dir: Path | None = None) -> str:
    """The llama-server a printed line names: plain ``llama-server`` for llama.cpp (the user's own, on PATH); for
    another engine, whose server has the same name, the absolute path of that engine's build here (the one the
    result was measured with when it is still there), so the line runs the engine that was measured."""
    kind = engine_of(result, rank)
    if kind.server_on_path:
        return "llama-server"
    measured = Path(str((result.engine or {}).get("bin_dir", ""))) / "llama-server"
    try:
        return str(build.locate_engine(llama_cpp_dir, kind).tool("llama-server"))
    except TunerError:
        if measured.is_file():
            return str(measured)
        raise


def launch_env(result: StudyResult, *, rank: int = 1) -> dict[str, str]:
    """What the ``rank``-th config's engine reads from its environment (:func:`tuner.engine.flags.server_env`)."""
    return flags.server_env(config_from_dict(_pick_at(result, rank).config))


def launch_line(result: StudyResult, *, rank: int = 1, fmt: str = "shell", host: str | None = None,
                port: int | None = None, binary: str | None = None, env: Mapping[str, str] | None = None,
                llama_cpp_dir: Path | None = None) -> str:
    """The ``rank``-th measured config as ``fmt`` (one of :data:`tuner.report.deploy.FORMATS`; what a format cannot
    carry is written into it). A service (llama-swap, systemd, compose) does not inherit the shell's environment,
    so by default it gets the variables here that choose the card (:func:`tuner.report.deploy.line_env`); a
    systemd unit runs the engine found here (``llama_cpp_dir``, LLAMA_CPP_DIR, PATH, the managed one) by its
    absolute path. ``binary`` None: the line's own engine (:func:`binary_for`)."""
    if fmt not in deploy.FORMATS:
        raise UsageError(f"unknown --format {fmt}: use {', '.join(deploy.FORMATS)}")
    cand = _pick_at(result, rank)
    if binary is None:
        binary = binary_for(result, rank, llama_cpp_dir)
    if fmt == "systemd" and not Path(binary).is_absolute():
        binary = str(build.locate_engine(llama_cpp_dir, engine_of(result, rank)).tool("llama-server"))
    if env is None:
        env = deploy.line_env(os.environ) if fmt in deploy.SERVICE_FORMATS else {}
    line = deploy.Line(config_from_dict(cand.config), cand.label, result.study, cand.config, cand.figures,
                       result.engine)
    return deploy.render(line, fmt, host=host, port=port, binary=binary, env=env).text


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
