"""The frontier for people: the table (context | config | request time and tok/s at that depth | KLD | memory),
the report.md section, the plots (speed vs context per KV pair; throughput vs latency per slot count) and the
measured launch line of the point a user picks (``launch-line --ctx N --slots N``).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import flags
from tuner.frontier.result import AGAIN, Frontier, FrontierPoint, counted, unmeasured_reason
from tuner.machine.fileio import atomic_write
from tuner.plan.memory import effective_config
from tuner.report.study_report import save_png  # one way to write a PNG
from tuner.search.result import StudyResult, write_result
from tuner.search.trials import config_from_dict

GIB = 2**30
HEADERS = ("context", "slots", "config", "s/request", "gen tok/s", "aggregate tok/s", "KLD", "VRAM GiB", "RAM GiB",
           "paging", "trial")
AXIS_WORDS = {"request_s": "request time (less)", "aggregate_tok_s": "aggregate tok/s (more)",
              "ctx": "context (more)", "kld": "KV quality loss, KLD (less)"}
BUSY_MARK = " !"  # a point measured while other programs used the machine (the notes say what)
SHORT = {"s/request": "s/req", "gen tok/s": "gen t/s", "aggregate tok/s": "agg t/s", "slots": "np"}  # 80 columns


def frontier_of(result: StudyResult) -> Frontier | None:
    return Frontier.from_dict(result.frontier) if result.frontier else None


def config_label(c: dict[str, Any]) -> str:
    """Compact, in llama-server's own short flags: ``q8_0/q8_0 fa on ncmoe 4 t 2 ub 1024``."""
    parts = [f"{c.get('cache_type_k')}/{c.get('cache_type_v')}", f"fa {c.get('flash_attn')}"]
    for key, flag in (("n_cpu_moe", "ncmoe"), ("n_gpu_layers", "ngl"), ("threads", "t"), ("ubatch", "ub")):
        if c.get(key) is not None:
            parts.append(f"{flag} {c[key]}")
    return " ".join(parts)


def _num(v: float | int | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def headers(front: Frontier) -> tuple[str, ...]:
    """The columns that carry something: aggregate tok/s only for concurrent workloads, VRAM only with a GPU,
    KLD only when it is an axis (not with ``--max-kld off``)."""
    return tuple(h for h in HEADERS if not (h == "aggregate tok/s" and not front.concurrent
                                            or h == "VRAM GiB" and not front.has_gpu
                                            or h == "KLD" and "kld" not in front.axes))


def rows(front: Frontier) -> list[tuple[str, ...]]:
    """One row per frontier point, in the order of :func:`headers`."""
    keep = headers(front)
    out = []
    for p in front.points:
        cells = dict(zip(HEADERS, (
            f"{p.ctx:,}", str(p.slots), config_label(p.config),
            _num(p.request_s, ",.3f") + (BUSY_MARK if p.interference else ""), _num(p.gen_tok_s, ",.1f"),
            _num(p.aggregate_tok_s, ",.1f"), _num(p.kld, ".5f"),
            _num(p.vram_bytes / GIB if p.vram_bytes is not None else None, ".2f"),
            _num(p.ram_bytes / GIB if p.ram_bytes is not None else None, ".2f"), p.paging_cell, str(p.trial)),
            strict=True))
        out.append(tuple(cells[h] for h in keep))
    return out


def unmeasured_line(front: Frontier) -> str | None:
    """The study's trials not measured, counted by reason; None when every trial was measured."""
    if not front.unmeasured:
        return None
    n = sum(count for _, count in front.unmeasured)
    again = {unmeasured_reason(status) for status in AGAIN}
    resume = ("; the same command again measures the ones stopped, not started or cut short"
              if any(reason in again for reason, _ in front.unmeasured) else "")
    return f"{n} of {n + front.trials_measured} trials not measured: {counted(front.unmeasured)}{resume}."


def paging_legend(front: Frontier) -> str | None:
    """What the table's paging column says, when a point's verdict could not be read."""
    if not any(p.paging_cell == "?" for p in front.points):
        return None
    return ("paging ?: host paging not measured for that point (no /proc here, a llama-bench without --progress, or "
            "a concurrent trial of one batch); \"none\": no page of the model was read back while it generated.")


def summary_lines(front: Frontier) -> list[str]:
    """What the front says, in words: its notes, the trials not measured and why, and the cost of each step of
    context at the fastest point per context."""
    lines = list(front.notes)
    legend = paging_legend(front)
    if legend:
        lines.append(legend)
    unmeasured = unmeasured_line(front)
    if unmeasured:
        lines.append(unmeasured)
    for slots in front.slots:
        best: dict[int, FrontierPoint] = {}
        for p in front.points:
            if p.slots == slots and (p.ctx not in best or p.request_s < best[p.ctx].request_s):
                best[p.ctx] = p
        ctxs = sorted(best)
        if len(ctxs) >= 2:
            first, last = best[ctxs[0]], best[ctxs[-1]]
            steps = "; ".join(f"{b:,}: {best[b].request_s / best[a].request_s:.2f}x the time of {a:,}"
                              for a, b in zip(ctxs, ctxs[1:], strict=False))
            who = "" if len(front.slots) < 2 else f"{slots} slots: "
            lines.append(f"{who}from {ctxs[0]:,} to {ctxs[-1]:,} tokens "
                         f"of context a request at full depth takes {last.request_s / first.request_s:.2f}x as long "
                         f"({steps}).")
    return lines


def markdown(result: StudyResult) -> str:
    front = frontier_of(result)
    if front is None:
        return ""
    w = result.workload or {}
    contexts = ", ".join(f"{c:,}" for c in front.contexts)
    flight = "" if w.get("concurrency", 1) < 2 else f", up to {w.get('concurrency')} in flight"
    lines = [f"# auto-tune --frontier: {Path(result.model or '?').name}", "",
             f"- study: `{result.study}`", f"- machine: {(result.hardware or {}).get('describe')}",
             f"- engine: llama.cpp {(result.engine or {}).get('commit')} ({(result.engine or {}).get('backend')})",
             f"- workload: {w.get('kind')}, {w.get('prompt_tokens')} prompt + {w.get('gen_tokens')} generated tokens"
             f"{flight}",
             f"- objectives: {', '.join(AXIS_WORDS.get(a, a) for a in front.axes)}; contexts {contexts}"
             f"{'' if len(front.slots) < 2 else '; slots ' + ', '.join(map(str, front.slots))}; "
             f"{front.trials_measured} trials measured",
             "- each request is measured at the depth its context allows: the reply ends at the slot's last token",
             "", "## Frontier", "", *[f"- {line}" for line in summary_lines(front)], "",
             "| " + " | ".join(headers(front)) + " | launch line |",
             "|" + "|".join("---" if h == "config" else "---:" for h in headers(front)) + "|---|"]
    for row, p in zip(rows(front), front.points, strict=True):
        lines.append("| " + " | ".join(row) + f" | `{p.launch_line}` |")
    lines += ["", "`moe-tune launch-line result.json --ctx N" + (" --slots N" if front.concurrent else "") +
              "` prints the measured line of a point.", "", *paged_lines(front)]
    return "\n".join(lines)


def paged_lines(front: Frontier) -> list[str]:
    """report.md's section on the trials kept off the front because they paged host RAM (none: no section)."""
    if not front.paged:
        return []
    lines = ["## Kept off the front: host paging", "",
             "These configs were measured, but the engine read its model back from disk while it generated (host RAM "
             "too short for them as they stand): their times are the disk's, and their lines are never printed.", "",
             "| trial | context | slots | config | s/request | major faults per token | evidence | to change |",
             "|---:|---:|---:|---|---:|---:|---|---|"]
    for p in front.paged:
        lines.append(f"| {p['trial']} | {p['ctx']:,} | {p['slots']} | {config_label(p['config'] or {})} | "
                     f"{_num(p['request_s'], ',.3f')} | {_num(p['major_faults_per_token'], ',.1f')} | "
                     f"{p['evidence']} | {p['fix'] or ''} |")
    return [*lines, ""]


def plots(result: StudyResult, out_dir: Path) -> list[Path]:
    """Speed vs context, one line per KV pair (the fastest measured trial at each context); for concurrent
    workloads, aggregate throughput vs per-request time, one series per slot count."""
    front = frontier_of(result)
    measured = [t for t in result.trials if t.status == "measured" and t.request_s]
    if front is None or not measured:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for slots in front.slots:
        by_kv: dict[str, dict[int, float]] = {}
        for t in measured:
            c = t.config
            if (c.get("parallel") or 1) != slots:
                continue
            kv = by_kv.setdefault(f"K {c['cache_type_k']} / V {c['cache_type_v']}", {})
            ctx = int(c.get("ctx") or 0)
            kv[ctx] = min(kv.get(ctx, float("inf")), t.request_s or float("inf"))
        for label, pts in sorted(by_kv.items()):
            xs = sorted(pts)
            name = label if len(front.slots) < 2 else f"{label}, np {slots}"
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(front.contexts), [f"{c:,}" for c in front.contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens); each request measured at that depth")
    ax.set_ylabel("seconds per request (lower is faster)")
    ax.set_title("Request time vs context, per KV cache pair")
    ax.legend(fontsize="small")
    written.append(save_png(fig, out_dir / "frontier_context.png"))
    if front.concurrent:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        gen_tokens = int((result.workload or {}).get("gen_tokens") or 0)
        for i, slots in enumerate(front.slots):
            # Every measured trial: N requests finish together, so N x reply tokens over one request's time.
            runs = [t.request_s for t in measured if (t.config.get("parallel") or 1) == slots and t.request_s]
            ax.scatter(runs, [slots * gen_tokens / r for r in runs], alpha=0.35, color=f"C{i}",
                       label=f"{slots} slot{'s' if slots > 1 else ''}: measured")
            agg = sorted((p.request_s, p.aggregate_tok_s or 0.0) for p in front.points if p.slots == slots)
            if agg:
                ax.plot([a[0] for a in agg], [a[1] for a in agg], marker="D", color=f"C{i}",
                        label=f"{slots} slot{'s' if slots > 1 else ''}: on the frontier")
        ax.set_xlabel("seconds per request, every slot busy")
        ax.set_ylabel("aggregate generated tok/s")
        ax.set_title("Throughput vs latency per slot count")
        ax.legend(fontsize="small")
        written.append(save_png(fig, out_dir / "frontier_slots.png"))
    return written


def point(result: StudyResult, ctx: int | None, slots: int | None) -> FrontierPoint:
    from tuner.core.errors import UsageError

    front = frontier_of(result)
    if front is None:
        raise UsageError("this result has no frontier: run `moe-tune auto-tune --frontier` for --ctx/--slots")
    return front.at(ctx, slots)


def launch_line(result: StudyResult, ctx: int | None, slots: int | None, *, host: str | None = None,
                port: int | None = None, binary: str = "llama-server") -> str:
    """The measured llama-server line of the frontier point at ``ctx``/``slots`` (the fastest there)."""
    cfg = config_from_dict(point(result, ctx, slots).config)
    env = [f"{k}={v}" for k, v in flags.server_env(cfg).items()]
    return shlex.join([*env, *flags.server_argv(Path(binary), cfg), *flags.address_argv(host, port)])


def write(result: StudyResult, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_result(result, out_dir), atomic_write(out_dir / "report.md", markdown(result))]
    return [*written, *plots(result, out_dir)]


def _runs_as(config: dict[str, Any], cores: int) -> LaunchConfig:
    """A stored config as the engine runs it (its defaults spelled out), context and slots aside."""
    return effective_config(config_from_dict({**config, "model": "m", "ctx": None, "parallel": None}), cores)


def winner_on_frontier(result: StudyResult, results_dir: Path) -> str | None:
    """Where a single-winner auto-tune's winner sits on a frontier measured for the same model in
    ``results_dir`` (the newest one), in one line; None when there is no such frontier."""
    from tuner.core.errors import UsageError
    from tuner.search.result import load_result

    w = result.winner
    if w is None or not results_dir.is_dir():
        return None
    files = sorted(results_dir.glob("*frontier*/result.json"), key=lambda f: f.stat().st_mtime, reverse=True)
    for file in files:
        try:
            other = load_result(file)
        except UsageError:
            continue
        front = frontier_of(other)
        if other.model != result.model or front is None or not front.points:
            continue
        ctx = int(w.config.get("ctx") or front.contexts[0])
        slots = int(w.config.get("parallel") or 1)
        rung = min(front.contexts, key=lambda c: abs(c - ctx))
        cores = int((other.hardware or {}).get("physical_cores") or 0)
        settings = _runs_as(w.config, cores)
        same = [p for p in front.points if _runs_as(p.config, cores) == settings]
        if same:
            at = [p for p in same if p.ctx == rung and (not front.concurrent or p.slots == slots)]
            others = ", ".join(f"{p.ctx}" + (f" np{p.slots}" if front.concurrent else "") for p in same
                               if p not in at)
            head = (f"the winner runs as its point at -c {at[0].ctx} (trial {at[0].trial}, {at[0].request_s:.3f} "
                    "s/request at full depth)" if at else "the winner's settings are on it")
            return f"on the frontier ({file}): {head}" + (f"; the same settings at -c {others}" if others else "")
        here = [p for p in front.points if p.ctx == rung and (not front.concurrent or p.slots == slots)]
        best = min(here or front.points, key=lambda p: p.request_s)
        return (f"on the frontier ({file}): the winner's settings are not on it; at -c {best.ctx} its fastest point "
                f"is trial {best.trial} ({config_label(best.config)}, {best.request_s:.3f} s/request at full depth)")
    return None
