"""Frontier budget: what share of the hypervolume of an exhaustive grid the frontier study reaches within N
trials, median and worst over sampler seeds.

The grid (every config of the frontier space for MODEL on this machine: the context ladder times today's axes,
restricted by --kv/--threads to keep it measurable) is measured once with the engine the way frontier trials
are (``frontier_tune.engine_measure``: llama-bench, the prompt and the reply at the depth each context allows)
and cached in results/benchmarks/. The searches are then replayed against it: each trial is a lookup of the
measured figures, so every sampler sees the same numbers. ``auto-tune --frontier`` is the constrained MOTPE
sampler with its seeds (the memory model's best guess at every context); NSGA-II and random search start from
nothing. Hypervolumes are taken on axes normalized by the grid's range, reference point 1.1 on every axis.

    .venv/bin/python scripts/bench_frontier.py [MODEL] [--min-ctx 512] [--max-ctx 4096] [-p 128] [-n 32]
        [--kv f16/f16,q8_0/q8_0,q4_0/q4_0] [--threads 2] [--budgets 6,8,12,16] [--seeds 5] [--workload batch]
        [--out results/benchmarks/frontier-NAME.md]

With ``--workload batch`` the slot count (1, 2, 4) is an axis too and each trial is a llama-batched-bench run;
the objectives gain the aggregate generated tok/s (hypervolume in four dimensions).

Last line: ``trials to 95% of grid hypervolume: auto-tune N (grid G)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import optuna

from tuner.core.config import CacheType, LaunchConfig
from tuner.engine import build
from tuner.frontier import hypervolume, pareto
from tuner.frontier import tune as frontier_tune
from tuner.machine import hardware
from tuner.measure import failures
from tuner.measure.workload import WorkloadKind, preset
from tuner.models import demo
from tuner.models.gguf_reader import inspect_model
from tuner.quality import kv_price
from tuner.search import space, study

OUT = Path(__file__).resolve().parent.parent / "results" / "benchmarks"
TARGET = 0.95
LOG: list[str] = []


def say(line: str = "") -> None:
    """Print a figure, and keep it for --out."""
    print(line, flush=True)
    LOG.append(line)


def _pairs(text: str) -> list[tuple[CacheType, CacheType]]:
    return [(CacheType(k), CacheType(v)) for k, v in (p.split("/") for p in text.split(","))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="GGUF file (default: the tiny demo model)")
    ap.add_argument("--min-ctx", type=int, default=512)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=pareto.LADDER_STEPS)
    ap.add_argument("--workload", choices=["chat", "batch"], default="chat",
                    help="batch: slot counts 1, 2, 4 as an axis, measured with llama-batched-bench")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--kv", default="f16/f16,f16/q8_0,q8_0/q8_0,q4_0/q4_0")
    ap.add_argument("--threads", default=None, help="comma list; default: the space's own")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--passes", type=int, default=1, help="measure the grid this many times (fastest pass kept)")
    ap.add_argument("--price-chunks", type=int, default=2)
    ap.add_argument("--budgets", default="4,6,8,10,12,16,20")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--refresh", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the figures as markdown, with the command, to this file")
    args = ap.parse_args()

    loc = build.locate_engine()
    caps = build.capabilities(loc)
    model = args.model or demo.default_model(loc)
    info = inspect_model(model)
    hw = hardware.probe_hardware(host_bandwidth_s=0.3)
    load = preset(WorkloadKind(args.workload), args.n_prompt, args.n_gen)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else None
    fs = pareto.build_frontier_space(model, info, hw, load, pareto.ctx_ladder(args.min_ctx, args.max_ctx,
                                                                                  args.steps),
                                       slots=space.slot_counts(load.concurrency), kv_pairs=_pairs(args.kv),
                                       threads=threads)
    axes = pareto.Axes(concurrent=fs.concurrent, kld=True)
    grid = list(pareto.iter_configs(fs))
    say(f"model {model.name} ({model.stat().st_size / 2**30:.2f} GiB), llama.cpp {caps.commit}, {hw.describe()}")
    how = (f"llama-batched-bench: each slot's whole history (context / slots - {args.n_gen}) as its prompt, then "
           f"{args.n_gen} tokens for every slot at once" if fs.concurrent else
           f"llama-bench pp{args.n_prompt} and tg{min(args.n_gen, frontier_tune.MAX_GEN_TOKENS)} at the depth each "
           "context allows (reply ends at the context's end)")
    say(f"space: contexts {list(fs.contexts)}, slots {list(fs.slots)}, KV {args.kv}, threads {list(fs.base.threads)}; "
        f"grid {len(grid)} configs; {how}, x{args.reps}")

    cache = OUT / f"frontier_grid_{model.stem}{'' if args.workload == 'chat' else '_' + args.workload}.json"
    key = {"space": fs.describe() | {"model": model.name}, "load": load.describe(), "reps": args.reps,
           "engine": caps.commit, **({"passes": args.passes} if args.passes > 1 else {})}
    cached = json.loads(cache.read_text()) if cache.is_file() else None
    if cached and cached.get("key") == key and not args.refresh:
        rows = cached["rows"]
        say(f"grid measurements from {cache.name} (measured {cached['measured_at']}, load {cached['load']})")
    else:
        import os

        t0 = time.monotonic()
        load_before = os.getloadavg()
        measure = frontier_tune.engine_measure(loc, load, caps=caps, repetitions=args.reps)
        passes: dict[LaunchConfig, list[dict[str, Any]]] = {c: [] for c in grid}
        for n_pass in range(args.passes):
            # Every other pass in reverse order, so a burst from another process does not hit the same configs twice.
            order = fs.points if n_pass % 2 == 0 else fs.points[::-1]
            for ctx, n in order:  # one llama-bench load per context (its configs share the depths)
                part = [c for c in grid if (c.ctx, c.parallel) == (ctx, n)]
                plans = [pareto.Plan(c, *pareto.depths(load, ctx, n)) for c in part]
                for cfg, res in zip(part, measure(plans), strict=True):
                    passes[cfg].append({"failure": res.kind.value} if isinstance(res, failures.Failure) else
                                       {"request_s": res.request_s, "gen_tok_s": res.gen_tok_s,
                                        "prompt_tok_s": res.prompt_tok_s, "aggregate_tok_s": res.aggregate_tok_s,
                                        "cv_pct": res.cv_pct})
                done = sum(len(v) for v in passes.values())
                print(f"  {done}/{len(grid) * args.passes} measured ({time.monotonic() - t0:.0f} s)", flush=True)
        rows = []
        for cfg, runs in passes.items():
            ok = [r for r in runs if "request_s" in r]
            # Other processes only ever slow a run down: the fastest pass is the closest to the config's speed.
            best = min(ok, key=lambda r: r["request_s"], default=runs[0])
            rows.append({"config": study.config_to_dict(cfg), "passes": runs, **best})
        load_after = os.getloadavg()
        note = (f"1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, on "
                f"{os.cpu_count()} cores")
        cache.write_text(json.dumps({"key": key, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                                     "elapsed_s": round(time.monotonic() - t0, 1), "load": note, "rows": rows},
                                    indent=1))
        say(f"grid measured in {time.monotonic() - t0:.0f} s; {note}")

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

    def objectives(c: LaunchConfig, m: pareto.Measured) -> tuple[float, ...]:
        return axes.minimized({"request_s": m.request_s, "aggregate_tok_s": m.aggregate_tok_s or 0.0,
                               "ctx": float(c.ctx or 0), "kld": prices[(c.cache_type_k, c.cache_type_v)]})

    measured = {c: m for c, m in table.items() if isinstance(m, pareto.Measured)}
    points = [objectives(c, m) for c, m in measured.items()]
    lows, spans = hypervolume.normalizer(points)
    ref = (1.1,) * len(lows)
    grid_hv = hypervolume.hypervolume(hypervolume.normalized(points, lows, spans), ref)
    say(f"grid: {len(points)} measured; its front has {len(hypervolume.pareto_minimal(points))} points; "
          f"normalized hypervolume {grid_hv:.4f}")
    say("grid front (context, slots, KV, fa, threads: s/request at that depth, aggregate tok/s, KLD):")
    front = set(hypervolume.pareto_minimal(points))
    for cfg, m in sorted(measured.items(), key=lambda cm: (cm[0].parallel or 1, cm[0].ctx or 0, cm[1].request_s)):
        if objectives(cfg, m) in front:
            agg = f", {m.aggregate_tok_s:.1f} tok/s aggregate" if m.aggregate_tok_s else ""
            say(f"  -c {cfg.ctx} -np {cfg.parallel}: {cfg.cache_type_k.value}/{cfg.cache_type_v.value} fa "
                f"{cfg.flash_attn.value} t {cfg.threads}: {m.request_s:.3f} s{agg}, KLD "
                f"{prices[(cfg.cache_type_k, cfg.cache_type_v)]:.5f}")

    say("grid: s/request at each context, the fastest config per KV pair (gen tok/s at that depth):")
    for pair in sorted({(c.cache_type_k.value, c.cache_type_v.value) for c in table}):
        cells = []
        for ctx, n in fs.points:
            ms = [m for c, m in measured.items()
                  if (c.ctx, c.parallel) == (ctx, n) and (c.cache_type_k.value, c.cache_type_v.value) == pair]
            m = min(ms, key=lambda m: m.request_s, default=None)
            at = f"{ctx}" if len(fs.slots) < 2 else f"{ctx} np{n}"
            cells.append(f"{at}: {m.request_s:.3f} s ({m.gen_tok_s or 0:.1f})" if m else f"{at}: failed")
        say(f"  {pair[0]}/{pair[1]}: " + "; ".join(cells))

    def replay(plans: list[pareto.Plan]) -> list[Any]:
        return [table[p.config] for p in plans]

    def kld_of(cfg: LaunchConfig) -> kv_price.KvPrice:
        return kv_price.KvPrice(cfg.cache_type_k, cfg.cache_type_v, prices[(cfg.cache_type_k, cfg.cache_type_v)],
                                0.0, 100.0, 0.0, 512, 1)

    def share(sampler: str, seed: int, budget: int, seeded: bool) -> float:
        st, _ = pareto.create_or_load("bench", optuna.storages.InMemoryStorage(), axes, seed=seed, sampler=sampler)
        if seeded:
            pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, hw))
        pareto.run_frontier(st, fs, info, hw, load, replay, budget=study.Budget(trials=budget), axes=axes,
                              kld_of=kld_of)
        got = [tuple(-v if d == optuna.study.StudyDirection.MAXIMIZE else v for v, d in zip(t.values, st.directions,
                                                                                          strict=True))
               for t in st.best_trials]
        return hypervolume.hypervolume(hypervolume.normalized(got, lows, spans), ref) / grid_hv

    budgets = [int(b) for b in args.budgets.split(",")]
    methods = {"auto-tune --frontier (MOTPE + seeds)": ("tpe", True), "NSGA-II": ("nsga2", False),
               "random": ("random", False)}
    reached: dict[str, int | None] = {}
    say(f"share of the grid's hypervolume, median (worst) over {args.seeds} sampler seeds:")
    say("| method | " + " | ".join(f"{b} trials" for b in budgets) + " |")
    say("|---|" + "---:|" * len(budgets))
    for name, (sampler, seeded) in methods.items():
        cells, reached[name] = [], None
        for b in budgets:
            shares = [share(sampler, s, b, seeded) for s in range(args.seeds)]
            cells.append(f"{100 * statistics.median(shares):.1f} % ({100 * min(shares):.1f})")
            if reached[name] is None and min(shares) >= TARGET:
                reached[name] = b
        say(f"| {name} | " + " | ".join(cells) + " |")
    first = reached["auto-tune --frontier (MOTPE + seeds)"]
    say(f"trials to 95% of grid hypervolume (every seed): auto-tune {first if first else '>' + str(budgets[-1])} "
          f"(grid {len(grid)}; {len(fs.contexts)} contexts x {len(grid) // len(fs.contexts)} configs)")

    if args.out:
        import shlex
        import sys

        cmd = shlex.join([".venv/bin/python", "scripts/bench_frontier.py", *sys.argv[1:]])
        head = (f"# Frontier budget: {model.name}\n\nMade by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M')} (grid "
                "measured once and cached; the searches replay it). The machine (2 cores) is shared with other agents' "
                "builds, tests and benchmarks: the load averages below are what it carried while the grid was measured,"
                " and the grid keeps each config's fastest pass.\n\n")
        args.out.write_text(head + "```text\n" + "\n".join(LOG) + "\n```\n")


if __name__ == "__main__":
    main()
