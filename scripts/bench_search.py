"""Search efficiency: how many trials auto-tune's sampler, plain random search and plain TPE need to reach 97 % of
the best config of the full grid, median over seeds.

The grid (every config of auto-tune's search space for MODEL on this machine, ``space.iter_configs``) is measured
with llama-bench the way auto-tune's trials are: the prompt at the workload's length, generation at the
workload's depth, scored by one request's end-to-end time (median of the repetitions), under the machine lock and
the watch, a config measured again (up to ``--passes``) while its repetitions spread wider than the CV gate, the
median of its agreeing passes kept (scripts/harness.py: the fastest would keep the luckiest of noisy passes). It is
cached in results/benchmarks/ (the grid cache bench_frontier.py uses too). The searches are then simulated against
it (each trial is a lookup of the measured score, not a new measurement), so every method sees the same
numbers. auto-tune's sampler starts from the same seeds auto-tune enqueues (llama.cpp's defaults, its ``--fit``
choice, the memory model's guess) and asks in batches as ``run_search`` does; random search and plain TPE start
from nothing.

    .venv/bin/python scripts/bench_search.py [MODEL] [--n-prompt 128] [--n-gen 16] [--depth 512] [--refresh]

Last line: ``trials to 97% of grid best: auto-tune N, random M, tpe K (grid G)``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness
import optuna

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.machine import hardware
from tuner.measure import bench, failures
from tuner.models import demo
from tuner.models.gguf_reader import inspect_model
from tuner.quality import kv_price
from tuner.search import finish, space, study

TARGET = 0.97
CTX = 4096


def measure_part(loc: build.EngineLocation, args: argparse.Namespace, caps: build.Capabilities,
                 part: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-bench figures of a chunk of configs, one dict each (a failure's kind, or the figures and the CV)."""
    cfgs = [study.config_from_dict(d) for d in part]
    results = bench.run_bench_many(loc, cfgs, n_prompt=args.n_prompt, n_gen=args.n_gen, depth=0,
                                   gen_depth=args.depth, repetitions=args.reps, timeout_s=1800, caps=caps)
    out: list[dict[str, Any]] = []
    for res in results:
        if isinstance(res, failures.Failure):
            out.append({"failure": res.kind.value})
            continue
        gen, pp = res.row("tg").spread, res.row("pp").spread
        out.append({"gen_tok_s": gen.median, "gen_cv_pct": gen.cv_pct, "prompt_tok_s": pp.median,
                    "prompt_cv_pct": pp.cv_pct, "cv_pct": max(gen.cv_pct, pp.cv_pct),
                    "score": args.measure.score(pp.median, gen.median)})
    return out


def simulate(make: Callable[[int], optuna.samplers.BaseSampler], seed: int, sp: space.SearchSpace,
             table: dict[LaunchConfig, float], target: float, cap: int,
             seeds: list[tuple[str, LaunchConfig]] | None = None, constrained: bool = False,
             batch: int = 1) -> int | None:
    """Trials until a config scoring >= ``target`` was tried (None: not within ``cap``)."""
    st = optuna.create_study(direction="maximize", sampler=make(seed))
    if seeds:
        for label, cfg in seeds:
            st.enqueue_trial(space.params_of(sp, cfg), user_attrs={"seed": label})
    n = 0
    while n < cap:
        asked = []
        for _ in range(min(batch, cap - n)):
            trial = st.ask()
            asked.append((trial, space.suggest(trial, sp)))
        for trial, cfg in asked:
            n += 1
            value = table.get(cfg)
            if constrained:
                study.set_constraints(trial, {"vram_over_mib": -1.0, "ram_over_mib": -1.0})
            if value is None:  # failed to measure: pruned, as run_search does
                st.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            st.tell(trial, value)
            if value >= target:
                return n
    return None


@harness.bench("bench_search")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="GGUF file (default: the tiny demo model)")
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--depth", type=int, default=512, help="context filled when generating")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--passes", type=int, default=1,
                    help="at most this many passes: a config is measured again while its CV is over the gate")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--refresh", action="store_true", help="measure the grid again even if cached")
    ap.add_argument("--price-chunks", type=int, default=2,
                    help="512-token chunks for pricing each K/V pair by KLD vs f16 KV (0: skip)")
    args = ap.parse_args()

    loc = build.locate_engine()
    caps = build.capabilities(loc)
    model = args.model or demo.default_model(loc)
    info = inspect_model(model)
    hw = hardware.probe_hardware(host_bandwidth_s=0.3)
    args.measure = study.Measure(n_prompt=args.n_prompt, n_gen=args.n_gen, prompt_depth=0, gen_depth=args.depth)
    sp = space.build_space(model, info, hw, ctx=CTX, parallel=1, prompt_tokens=args.n_prompt)
    grid = [c for c in space.iter_configs(sp) if space.check(info, c, hw).feasible]
    print(f"model {model.name} ({model.stat().st_size / 2**20:.0f} MiB), llama.cpp {caps.commit}, {hw.describe()}")
    print(f"grid: {len(grid)} feasible configs of {sp.size}; llama-bench pp{args.n_prompt} at depth 0, "
          f"tg{args.n_gen} at depth {args.depth}, x{args.reps}; score = requests/s of one "
          f"{args.n_prompt}+{args.n_gen}-token request")

    key = {"space": sp.describe() | {"model": model.name}, "n_prompt": args.n_prompt, "n_gen": args.n_gen,
           "depth": args.depth, "reps": args.reps, "engine": caps.commit, "statistic": "median",
           "passes": args.passes, "score": "requests/s"}
    cache = harness.GridCache(f"search_grid_{model.stem}.json", key, refresh=args.refresh)
    rows = harness.measure_grid(cache, [study.config_to_dict(c) for c in grid],
                                lambda part: measure_part(loc, args, caps, part),
                                chunks=lambda todo: [todo[i:i + 16] for i in range(0, len(todo), 16)],
                                rank=lambda m: -m["score"], command="bench_search", say=print,
                                max_passes=args.passes)
    table: dict[LaunchConfig, float] = {}
    for row in rows:
        cfg = study.config_from_dict(row["config"])
        if row.get("score"):
            table[replace(cfg, model=model)] = row["score"]
    best_cfg, best = max(table.items(), key=lambda kv: kv[1])
    target = TARGET * best
    values = sorted(table.values())
    cvs = [r["gen_cv_pct"] for r in rows if r.get("gen_cv_pct") is not None]
    near = sum(v >= target for v in values)
    print(f"grid requests/s: best {best:.4f}, median {statistics.median(values):.4f}, worst {values[0]:.4f} "
          f"(best/worst {best / values[0]:.2f}x); {near} of {len(values)} configs within 97 % of the best; "
          f"median CV {statistics.median(cvs):.1f} %, max CV {max(cvs):.1f} %")
    print(f"grid best: {flags.launch_line(best_cfg)}")
    for row in sorted(rows, key=lambda r: -(r.get("score") or 0)):
        c = row["config"]
        print(f"  {c['cache_type_k']}/{c['cache_type_v']} fa {c['flash_attn']} t {c['threads']} ub {c['ubatch']}: "
              f"pp {row.get('prompt_tok_s') or 0:.1f}, tg {row.get('gen_tok_s') or 0:.2f} tok/s, "
              f"{row.get('score') or 0:.4f} requests/s")
    diffs = [100 * abs(r["passes"][0]["gen_tok_s"] - r["passes"][1]["gen_tok_s"]) / r["gen_tok_s"]
             for r in rows if len([x for x in r.get("passes", []) if "gen_tok_s" in x]) >= 2]
    if diffs:
        print(f"pass-to-pass difference of a config's gen tok/s: median {statistics.median(diffs):.1f} %, "
              f"90th percentile {statistics.quantiles(diffs, n=10)[-1]:.1f} %")

    if args.price_chunks:
        print(f"K/V pairs priced by mean KLD vs the f16 cache (bundled corpus, {args.price_chunks} x 512 tokens; "
              f"default floor {kv_price.DEFAULT_MAX_KLD}):")
        for k, v in sp.kv_pairs:
            q = kv_price.price(loc, model, k, v, chunks=args.price_chunks)
            print(f"  {k.value}/{v.value}: KLD {q.kld_mean:.6f} +/- {q.kld_mean_error:.6f}, same top "
                  f"{q.same_top_pct:.2f} %{'' if q.kld_mean <= kv_price.DEFAULT_MAX_KLD else '  (over the floor)'}")
    fit = finish.fit_config(loc, finish.default_config(sp))
    seeds = finish.seed_configs(sp, info, hw, fit)
    print("auto-tune seeds: " + "; ".join(f"{label} = {table.get(cfg, float('nan')):.4f} requests/s"
                                          for label, cfg in seeds))
    cap = 3 * len(grid)
    methods: dict[str, Callable[[int], int | None]] = {
        "auto-tune": lambda s: simulate(lambda x: study.make_sampler(x), s, sp, table, target, cap, seeds=seeds,
                                        constrained=True, batch=study.BATCH_TRIALS),
        "auto-tune without seeds": lambda s: simulate(lambda x: study.make_sampler(x), s, sp, table, target, cap,
                                                      constrained=True, batch=study.BATCH_TRIALS),
        "random": lambda s: simulate(lambda x: optuna.samplers.RandomSampler(seed=x), s, sp, table, target, cap),
        "tpe": lambda s: simulate(lambda x: optuna.samplers.TPESampler(seed=x), s, sp, table, target, cap),
    }
    medians: dict[str, str] = {}
    for name, run in methods.items():
        counts = [run(s) for s in range(args.seeds)]
        shown = [str(c) if c is not None else f">{cap}" for c in counts]
        med = statistics.median(c if c is not None else cap + 1 for c in counts)
        medians[name] = f"{med:g}" if med <= cap else f">{cap}"
        print(f"{name:>23}: trials to 97 % per seed {', '.join(shown)}; median {medians[name]}")
    print(f"trials to 97% of grid best: auto-tune {medians['auto-tune']}, random {medians['random']}, "
          f"tpe {medians['tpe']} (grid {len(grid)})")


if __name__ == "__main__":
    main()
