"""Frontier benchmark: how much of a measured grid's trade-off frontier each sampler finds within N trials.

The grid is every config of the frontier space for MODEL on this machine (the context ladder times today's
axes: K/V pairs, flash attention, threads), measured with the engine the way frontier trials are
(``frontier_tune.engine_measure``) under the machine lock and the watch, each config re-measured while its
repetitions spread wider than the CV gate (scripts/harness.py); it is cached and resumable. The searches then
replay it: each trial is a lookup, so every sampler sees the same numbers.

Hypervolumes use a reference point fixed in the objectives' own units, not the grid's range: the slowest
acceptable request (``--max-request-s``), the smallest context (the workload's own tokens: one request and
nothing more), the largest acceptable KLD (``--max-kld``, the product's default limit). Coverage is a method's
hypervolume over the grid's, in sum and per context (request time x KLD at that context alone, where the
largest context cannot hide the others). Arms: ``auto-tune --frontier`` (MOTPE with the memory model's seeds),
MOTPE without seeds, NSGA-II and random search, median (worst) over sampler seeds.

    .venv/bin/python scripts/bench_frontier.py [MODEL] [--min-ctx 1024] [--max-ctx 16384] [--steps 8]
        [--workload chat|batch] [-p 512] [-n 128] [--max-request-s 5] [--budgets 8,16,24,32] [--seeds 5]
        [--out results/benchmarks/frontier-NAME.md]

Last line: ``coverage at N trials, median over seeds: seeded MOTPE x %, unseeded MOTPE y %, NSGA-II z %, random w %``.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness
import optuna

from tuner.core.config import CacheType, LaunchConfig
from tuner.engine import build
from tuner.frontier import hypervolume, pareto, watched
from tuner.frontier import tune as frontier_tune
from tuner.machine import hardware
from tuner.measure import failures
from tuner.measure.workload import WorkloadKind, preset
from tuner.models import demo
from tuner.models.gguf_reader import inspect_model
from tuner.quality import kv_price
from tuner.search import space, study

ARMS = {"auto-tune --frontier (MOTPE + seeds)": ("tpe", True), "MOTPE, no seeds": ("tpe", False),
        "NSGA-II": ("nsga2", False), "random": ("random", False)}


def _pairs(text: str) -> list[tuple[CacheType, CacheType]]:
    return [(CacheType(k), CacheType(v)) for k, v in (p.split("/") for p in text.split(","))]


def args_of() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="GGUF file (default: the tiny demo model)")
    ap.add_argument("--min-ctx", type=int, default=1024)
    ap.add_argument("--max-ctx", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=8, help="contexts on the ladder")
    ap.add_argument("--workload", choices=["chat", "batch"], default="chat",
                    help="batch: slot counts 1, 2, 4 as an axis, measured with llama-batched-bench")
    ap.add_argument("-p", "--n-prompt", type=int, default=None, help="default: the workload's")
    ap.add_argument("-n", "--n-gen", type=int, default=None, help="default: the workload's")
    ap.add_argument("--kv", default=",".join(f"{k.value}/{v.value}" for k, v in space.KV_PAIRS))
    ap.add_argument("--threads", default=None, help="comma list; default: the space's own")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cv-gate", type=float, default=harness.CV_GATE_PCT, help="re-measure above this CV %%")
    ap.add_argument("--max-passes", type=int, default=3)
    ap.add_argument("--max-request-s", type=float, default=5.0, help="reference: the slowest acceptable request")
    ap.add_argument("--max-kld", type=float, default=kv_price.DEFAULT_MAX_KLD, help="reference: the largest KLD")
    ap.add_argument("--price-chunks", type=int, default=2)
    ap.add_argument("--budgets", default="8,16,24,32")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--refresh", action="store_true", help="measure the grid again even if cached")
    ap.add_argument("--cached-only", action="store_true",
                    help="replay only what an unfinished grid holds so far (said as PARTIAL), measuring nothing")
    ap.add_argument("--out", type=Path, help="also write the figures as markdown, with the command, to this file")
    return ap.parse_args()


@harness.bench("bench_frontier")
def main() -> None:
    args = args_of()
    say = harness.Log()
    loc = build.locate_engine()
    caps = build.capabilities(loc)
    model = args.model or demo.default_model(loc)
    info = inspect_model(model)
    hw = hardware.probe_hardware(host_bandwidth_s=0.3)
    load = preset(WorkloadKind(args.workload), args.n_prompt, args.n_gen)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else None
    fs = pareto.build_frontier_space(model, info, hw, load, pareto.ctx_ladder(args.min_ctx, args.max_ctx, args.steps),
                                     slots=space.slot_counts(load.concurrency), kv_pairs=_pairs(args.kv),
                                     threads=threads)
    axes = pareto.Axes(concurrent=fs.concurrent, kld=True)
    grid = [c for c in pareto.iter_configs(fs)
            if space.check(info, c, hw).feasible and load.context_tokens <= (c.ctx or 0) // (c.parallel or 1)]
    say(f"model {model.name} ({model.stat().st_size / 2**20:.0f} MiB), llama.cpp {caps.commit}, {hw.describe()}")
    say(f"workload {load.kind.value}: {load.prompt_tokens} prompt + {load.gen_tokens} generated tokens"
        f"{f', {load.concurrency} in flight' if fs.concurrent else ''}; {frontier_tune.timing_note(load)}")
    say(f"space: contexts {list(fs.contexts)}, slots {list(fs.slots)}, KV {args.kv}, threads "
        f"{list(fs.base.threads)}; grid {len(grid)} configs, x{args.reps} repetitions, CV gate {args.cv_gate:g} %")

    measure = frontier_tune.engine_measure(loc, load, caps=caps, repetitions=args.reps)

    def measure_part(part: list[dict[str, Any]]) -> list[dict[str, Any]]:
        plans = []
        for d in part:
            cfg = study.config_from_dict(d)
            plans.append(pareto.Plan(cfg, *pareto.depths(load, cfg.ctx or 0, cfg.parallel or 1)))
        return [{"failure": r.kind.value} if isinstance(r, failures.Failure) else
                {"request_s": r.request_s, "gen_tok_s": r.gen_tok_s, "prompt_tok_s": r.prompt_tok_s,
                 "aggregate_tok_s": r.aggregate_tok_s, "cv_pct": r.cv_pct} for r in measure(plans)]

    def by_point(todo: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """One chunk per (context, slots): its configs share the depth, filled once per llama-bench process."""
        out: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for d in todo:
            out.setdefault((d["ctx"], d.get("parallel") or 1), []).append(d)
        return list(out.values())

    key = {"space": fs.describe() | {"model": model.name}, "load": load.describe(), "reps": args.reps,
           "engine": caps.commit, "cv_gate": args.cv_gate, "max_passes": args.max_passes, "timing": "one depth"}
    cache = harness.GridCache(f"frontier_grid_{model.stem}_{args.workload}.json", key, refresh=args.refresh)
    rows = harness.measure_grid(cache, [study.config_to_dict(c) for c in grid], measure_part, chunks=by_point,
                                rank=lambda m: m["request_s"], command="bench_frontier", say=say,
                                cv_gate_pct=args.cv_gate, max_passes=args.max_passes, cached_only=args.cached_only)
    if args.cached_only:  # replay only the contexts the unfinished grid holds whole
        held = {harness.config_id(r["config"]) for r in rows}
        whole = tuple(c for c in fs.contexts if all(harness.config_id(study.config_to_dict(g)) in held
                                                    for g in grid if g.ctx == c))
        fs = replace(fs, contexts=whole)
        grid = [g for g in grid if g.ctx in whole]
        rows = [r for r in rows if r["config"]["ctx"] in whole]
        say(f"PARTIAL: replaying the {len(whole)} contexts measured whole ({list(whole)}): {len(grid)} configs")
    gate_fail = [r for r in rows if r.get("cv_gate") == "fail"]
    cvs = [r["cv_pct"] for r in rows if r.get("cv_pct") is not None]
    say(f"grid: {sum('request_s' in r for r in rows)} of {len(rows)} measured; CV median {statistics.median(cvs):.1f} "
        f"%, max {max(cvs):.1f} %; {len(gate_fail)} over the {args.cv_gate:g} % gate ("
        f"{sum(len(r['passes']) < args.max_passes for r in gate_fail)} of them not re-measured yet, at most "
        f"{args.max_passes} passes); {sum(len(r['passes']) for r in rows)} measurements; "
        f"{sum(bool(r.get('noise')) for r in rows)} kept figures taken on a busy machine")

    prices = {}
    for k, v in {(c.cache_type_k, c.cache_type_v) for c in grid}:
        q = kv_price.price(loc, model, k, v, chunks=args.price_chunks) if (k, v) != (CacheType.F16,) * 2 else None
        prices[(k, v)] = q.kld_mean if q else 0.0
    say("KLD vs f16 KV: " + ", ".join(f"{k.value}/{v.value} {x:.5f}" for (k, v), x in sorted(prices.items())))

    table: dict[LaunchConfig, Any] = {}
    for row in rows:
        cfg = study.config_from_dict(row["config"])
        table[cfg] = (pareto.Measured(row["request_s"], row["gen_tok_s"], row["prompt_tok_s"],
                                      row.get("aggregate_tok_s"))
                      if "request_s" in row else failures.Failure(failures.FailureKind(row["failure"]), "grid"))
    replay_report(say, args, fs, axes, info, hw, load, table, prices)
    if args.out:
        say.write(args.out, f"Frontier benchmark: {model.name}, {args.workload}",
                  "The grid is measured once under the machine lock and the watch and cached; the searches replay "
                  "it. The load line says what the machine (2 cores) carried while the grid was measured; each "
                  "config keeps the median of its passes whose repetitions agree within the CV gate "
                  "(scripts/harness.py).")


def replay_report(say: harness.Log, args: argparse.Namespace, fs: pareto.FrontierSpace, axes: pareto.Axes,
                  info: Any, hw: Any, load: Any, table: dict[LaunchConfig, Any],
                  prices: dict[tuple[CacheType, CacheType], float]) -> None:
    measured = {c: m for c, m in table.items() if isinstance(m, pareto.Measured)}

    def kld(c: LaunchConfig) -> float:
        return prices[(c.cache_type_k, c.cache_type_v)]

    def objectives(c: LaunchConfig, m: pareto.Measured) -> tuple[float, ...]:
        return axes.minimized({"request_s": m.request_s, "aggregate_tok_s": m.aggregate_tok_s or 0.0,
                               "ctx": float(c.ctx or 0), "kld": kld(c)})

    # Fixed in the objectives' own units: request time, (aggregate tok/s: none wanted), context, KLD.
    ref_of = {"request_s": args.max_request_s, "aggregate_tok_s": 0.0, "ctx": -float(load.context_tokens),
              "kld": args.max_kld}
    ref = tuple(ref_of[n] for n in axes.names)
    say(f"reference point: request {args.max_request_s:g} s, context {load.context_tokens} tokens, "
        f"KLD {args.max_kld:g}" + (", aggregate 0 tok/s" if fs.concurrent else ""))

    def cover(points: dict[LaunchConfig, pareto.Measured]) -> tuple[float, dict[tuple[int, int], float]]:
        """Hypervolume in sum, and per (context, slots) on the other axes (the context axis dropped)."""
        total = hypervolume.hypervolume([objectives(c, m) for c, m in points.items()], ref)
        per: dict[tuple[int, int], float] = {}
        keep = [i for i, n in enumerate(axes.names) if n != "ctx"]
        for point in fs.points:
            at = [objectives(c, m) for c, m in points.items() if (c.ctx, c.parallel or 1) == point]
            per[point] = hypervolume.hypervolume([tuple(p[i] for i in keep) for p in at], tuple(ref[i] for i in keep))
        return total, per

    grid_total, grid_per = cover(measured)
    front = set(hypervolume.pareto_minimal([objectives(c, m) for c, m in measured.items()]))
    say(f"grid front: {len(front)} points; hypervolume {grid_total:.4g} (s x tokens x KLD"
        f"{' x tok/s' if fs.concurrent else ''})")
    lines = []
    for cfg, m in sorted(measured.items(), key=lambda cm: (cm[0].parallel or 1, cm[0].ctx or 0, cm[1].request_s)):
        if objectives(cfg, m) in front:
            agg = f"{m.aggregate_tok_s:.1f}" if m.aggregate_tok_s else ""
            lines.append((cfg.ctx, cfg.parallel or 1, f"{cfg.cache_type_k.value}/{cfg.cache_type_v.value} fa "
                          f"{cfg.flash_attn.value} t {cfg.threads}", f"{m.request_s:.3f}", agg, f"{kld(cfg):.5f}"))
    for line in harness.markdown_table(("context", "slots", "config", "s/request", "aggregate tok/s", "KLD"), lines):
        say(line)

    def replay(plans: list[pareto.Plan]) -> list[Any]:
        return [table[p.config] for p in plans]

    def kld_of(cfg: LaunchConfig) -> kv_price.KvPrice:
        return kv_price.KvPrice(cfg.cache_type_k, cfg.cache_type_v, kld(cfg), 0.0, 100.0, 0.0, 512, 1)

    def run_arm(sampler: str, seed: int, budget: int, seeded: bool) -> tuple[float, dict[tuple[int, int], float]]:
        st, _ = pareto.create_or_load("bench", optuna.storages.InMemoryStorage(), axes, seed=seed, sampler=sampler)
        if seeded:
            pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, hw))
        pareto.run_frontier(st, fs, info, hw, load, replay, budget=study.Budget(trials=budget), axes=axes,
                            kld_of=kld_of, watch=watched.Unwatched, quiet_now=lambda: True)
        found = {study.config_from_dict(t.user_attrs["config"]) for t in pareto.measured_trials(st)}
        total, per = cover({c: measured[c] for c in found if c in measured})
        return total / grid_total, {p: v / grid_per[p] for p, v in per.items() if grid_per[p] > 0}

    budgets = [int(b) for b in args.budgets.split(",")]
    results = {(name, b): [run_arm(s, seed, b, seeded) for seed in range(args.seeds)]
               for name, (s, seeded) in ARMS.items() for b in budgets}

    def cell(shares: list[float]) -> str:
        return f"{100 * statistics.median(shares):.1f} % ({100 * min(shares):.1f})"

    say(f"coverage of the grid's hypervolume, in sum; median (worst) over {args.seeds} sampler seeds:")
    for line in harness.markdown_table(("method", *(f"{b} trials" for b in budgets)),
                                       [(n, *(cell([r[0] for r in results[(n, b)]]) for b in budgets)) for n in ARMS]):
        say(line)
    for b in budgets:
        say(f"coverage per context at {b} trials (request time x KLD at that context), median (worst):")
        heads = [f"{c}" + (f" np{n}" if len(fs.slots) > 1 else "") for c, n in fs.points if (c, n) in grid_per]
        body = [(n, *(cell([r[1].get(p, 0.0) for r in results[(n, b)]]) for p in fs.points if p in grid_per))
                for n in ARMS]
        for line in harness.markdown_table(("method", *heads), body):
            say(line)
    b = budgets[-1]
    say(f"coverage at {b} trials, median over seeds: " + ", ".join(
        f"{n} {100 * statistics.median(r[0] for r in results[(n, b)]):.1f} %" for n in ARMS)
        + f" (grid {len(table)} configs)")


if __name__ == "__main__":
    main()
