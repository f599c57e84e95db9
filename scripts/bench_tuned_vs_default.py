"""The tuned config against llama.cpp's default launch and against its ``--fit on`` choice, with llama-server at
the same workload, measured alternately in one run (the order rotates every round, so slow drift and bursts from
other processes on a shared machine hit every arm alike).

The tuned config is the winner of an auto-tune result (``--result results/<study>/result.json``); without one a
small auto-tune of the demo model runs first (chat workload, ``--trials`` trials). ``default`` is
``llama-server -m MODEL -c CTX -np N``; ``fit`` is what llama-fit-params prints for that launch, made explicit.

    .venv/bin/python scripts/bench_tuned_vs_default.py [--result PATH] [--rounds 5] [--trials 10]

Last line: ``tuned/default: X.XXx, tuned/fit: Y.YYx`` (ratios of the per-arm medians of per-request
generation tok/s at concurrency 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.machine import hardware
from tuner.measure import workload
from tuner.models import demo
from tuner.report import study_report
from tuner.search import autotune, finish, study

OUT = Path(__file__).resolve().parent.parent / "results" / "benchmarks"


def tune_first(loc: build.EngineLocation, trials: int, results_dir: Path) -> dict[str, Any]:
    model = demo.default_model(loc)
    load = workload.preset(workload.WorkloadKind.CHAT)
    req = autotune.TuneRequest(model=model, workload=load, budget=study.Budget(trials=trials),
                               measure=study.Measure(n_prompt=min(load.prompt_tokens, 512),
                                                     n_gen=min(load.gen_tokens, 128)),
                               results_dir=results_dir)
    hw = hardware.probe_hardware(host_bandwidth_s=0.3)
    t0 = time.monotonic()
    res = autotune.auto_tune(req, loc, hw, on_step=lambda m: print(f"  auto-tune: {m}", flush=True))
    print(f"auto-tune: {len(res.result['trials'])} trials in {time.monotonic() - t0:.0f} s, study {res.study_name}")
    return res.result


def cv_pct(xs: list[float]) -> float:
    return 100 * statistics.stdev(xs) / statistics.fmean(xs) if len(xs) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--result", type=Path, help="results/<study>/result.json of an auto-tune run")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (each arm once per round)")
    ap.add_argument("--requests", type=int, default=3, help="requests per arm per round")
    ap.add_argument("--trials", type=int, default=10, help="auto-tune trials when no --result is given")
    args = ap.parse_args()

    loc = build.locate_engine()
    caps = build.capabilities(loc)
    with tempfile.TemporaryDirectory(prefix="bench-tuned-") as tmp:
        result = study_report.load_result(args.result) if args.result else tune_first(loc, args.trials, Path(tmp))
        tuned = study.config_from_dict(study_report.ranked(result)[0].config)
        default = LaunchConfig(model=tuned.model, ctx=tuned.ctx, parallel=tuned.parallel)
        fit = finish.fit_config(loc, default)
        arms: dict[str, LaunchConfig] = {"tuned": tuned, "default": default, "fit": fit or default}
        w = result["workload"]
        load = workload.Workload(workload.WorkloadKind(w["kind"]), w["prompt_tokens"], w["gen_tokens"],
                                 rounds=args.requests)
        print(f"llama.cpp {caps.commit}, {hardware.probe_hardware(host_bandwidth_s=0).describe()}; workload "
              f"{w['kind']} P={load.prompt_tokens} G={load.gen_tokens}, {args.requests} requests x {args.rounds} "
              f"rounds per arm")
        for label, cfg in arms.items():
            print(f"{label:>7}: {flags.launch_line(cfg)}")
        if fit is None or fit == default:
            print("    fit: llama-fit-params keeps the default launch on this machine (nothing to fit)")
        samples: dict[str, list[float]] = {label: [] for label in arms}
        cvs: dict[str, list[float]] = {label: [] for label in arms}
        labels = list(arms)
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for label in order:
                m = finish.measure_server(loc, arms[label], load, label=label, log_dir=Path(tmp) / "logs",
                                          caps=caps)
                if m.gen_tok_s is None:
                    print(f"  round {r + 1}: {label} failed: {(m.failure or {}).get('reason')}")
                    continue
                samples[label].append(m.gen_tok_s)
                if m.gen_cv_pct is not None:
                    cvs[label].append(m.gen_cv_pct)
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.1f}" for k, v in samples.items() if v), flush=True)

    med = {k: statistics.median(v) for k, v in samples.items() if v}
    for label, xs in samples.items():
        if xs:
            print(f"{label:>7}: median {med[label]:,.1f} tok/s over {len(xs)} rounds, CV across rounds "
                  f"{cv_pct(xs):.1f} %, median CV within a round {statistics.median(cvs[label] or [0.0]):.1f} %")
    paired = {b: statistics.median(t / x for t, x in zip(samples["tuned"], samples[b], strict=False))
              for b in ("default", "fit") if samples[b] and samples["tuned"]}
    print("paired per-round ratio (median): " + ", ".join(f"tuned/{b} {v:.2f}x" for b, v in paired.items()))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tuned_vs_default.json").write_text(json.dumps({
        "engine": caps.commit, "workload": w, "rounds": args.rounds, "requests": args.requests,
        "arms": {k: study.config_to_dict(v) for k, v in arms.items()}, "gen_tok_s": samples,
        "median_gen_tok_s": med, "paired_ratio": paired, "study": result.get("study"),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"tuned/default: {med['tuned'] / med['default']:.2f}x, tuned/fit: {med['tuned'] / med['fit']:.2f}x")


if __name__ == "__main__":
    main()
