"""The tuned config against llama.cpp's default launch and against its ``--fit`` choice, with llama-server at the
workload's depth, measured in interleaved rounds in one run (the order rotates every round, so slow drift and
bursts from other processes on a shared machine hit every arm alike).

The tuned config is the winner of an auto-tune result (``--result results/<study>/result.json``); without one an
auto-tune of MODEL runs first (``--trials`` trials) at the same workload. ``default`` is
``llama-server -m MODEL -c CTX -np 1``; ``fit`` is what llama-fit-params prints for that launch, made explicit.

    .venv/bin/python scripts/bench_tuned_vs_default.py [MODEL] [-p 256] [-n 32] [--depth 1024] [--rounds 3]
                                                       [--trials 4] [--result PATH]

Score: one request's end-to-end time (prompt + reply at the workload's depth), per round; ratios are medians
of the per-round paired ratios, with their 90 % interval. Last line: ``tuned/default: X.XXx, tuned/fit: Y.YYx``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import harness

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.machine import hardware
from tuner.measure import workload
from tuner.models import demo
from tuner.report import study_report
from tuner.search import autotune, finish, study, verdict
from tuner.search import result as study_result

OUT = Path(__file__).resolve().parent.parent / "results" / "benchmarks"


def tune_first(loc: build.EngineLocation, model: Path, load: workload.Workload, trials: int,
               results_dir: Path, kld_chunks: int) -> study_result.StudyResult:
    req = autotune.TuneRequest(model=model, workload=load, budget=study.Budget(trials=trials),
                               measure=study.Measure.for_workload(load, max_gen_tokens=16, repetitions=2),
                               results_dir=results_dir, top_candidates=1, rounds=finish.Rounds(min=1, max=1),
                               kld_chunks=kld_chunks)
    hw = hardware.probe_hardware(host_bandwidth_s=0.3)
    t0 = time.monotonic()
    res = autotune.auto_tune(req, loc, hw, on_step=lambda m: print(f"  auto-tune: {m}", flush=True))
    print(f"auto-tune: {len(res.result.trials)} trials in {time.monotonic() - t0:.0f} s, study {res.study_name}")
    for t in (r.to_dict() for r in res.result.trials):
        c = t["config"]
        print(f"  trial {t['number']}: {t['status']:<10} {c['cache_type_k']}/{c['cache_type_v']} fa {c['flash_attn']}"
              f" t {c['threads']} ub {c['ubatch']}: pp {t['prompt_tok_s'] or 0:.1f} tok/s at depth "
              f"{t['prompt_depth']}, tg {t['gen_tok_s'] or 0:.2f} tok/s at depth {t['gen_depth']}, KLD {t['kld']}")
    return res.result


@harness.bench("bench_tuned_vs_default")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="GGUF file (default: the demo model)")
    ap.add_argument("-p", "--n-prompt", type=int, default=256)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--depth", type=int, default=None, help="context filled when generating (default: the prompt)")
    ap.add_argument("--result", type=Path, help="results/<study>/result.json of an auto-tune run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each arm once per round)")
    ap.add_argument("--requests", type=int, default=1, help="requests per arm per round")
    ap.add_argument("--trials", type=int, default=4, help="auto-tune trials when no --result is given")
    ap.add_argument("--kld-chunks", type=int, default=2, help="512-token chunks the KV pricing reads")
    args = ap.parse_args()

    loc = build.locate_engine()
    caps = build.capabilities(loc)
    model = args.model or demo.default_model(loc)
    load = workload.Workload(workload.WorkloadKind.CUSTOM, args.n_prompt, args.n_gen, rounds=args.requests,
                             depth_tokens=args.depth)
    with tempfile.TemporaryDirectory(prefix="bench-tuned-") as tmp:
        result = study_report.load_result(args.result) if args.result else tune_first(
            loc, model, load, args.trials, Path(tmp), args.kld_chunks)
        tuned = study.config_from_dict(study_report.ranked(result)[0].config)
        default = LaunchConfig(model=tuned.model, ctx=tuned.ctx, parallel=1)
        fit = finish.fit_config(loc, default)
        baselines = [("default", default)] + ([("fit", fit)] if fit is not None and fit != default else [])
        print(f"llama.cpp {caps.commit}, {hardware.probe_hardware(host_bandwidth_s=0).describe()}; model "
              f"{tuned.model.name}; workload P={load.prompt_tokens} G={load.gen_tokens} at depth {load.gen_depth}, "
              f"{args.requests} request(s) x {args.rounds} rounds per arm")
        for label, cfg in [("tuned", tuned), *baselines]:
            print(f"{label:>7}: {flags.launch_line(cfg)}")
        if len(baselines) == 1:
            print("    fit: llama-fit-params keeps the default launch on this machine (nothing to fit): fit = default")
        t0 = time.monotonic()
        done = finish.finish(loc, [(0, tuned)], baselines, load, log_dir=Path(tmp) / "logs", caps=caps,
                             rounds=finish.Rounds(min=args.rounds, max=args.rounds),
                             on_step=lambda m: print(f"  {m.split(' (')[0]}", flush=True))
    arms = {"tuned": done.candidates[0], **{b.label: b for b in done.baselines}}
    for label, m in arms.items():
        scores = [f"{s:.4f}" if s else "failed" for s in m.scores]
        print(f"{label:>7}: requests/s per round {', '.join(scores)}; median gen {m.gen_tok_s or 0:.2f} tok/s, "
              f"prompt {m.prompt_tok_s or 0:.1f} tok/s")
    ratio: dict[str, Any] = {}
    for b in done.baselines:
        v = verdict.compare("tuned", b.label, arms["tuned"].scores, b.scores)
        ratio[b.label] = v.to_dict()
        print(v.describe())
    if "fit" not in ratio:
        ratio["fit"] = ratio["default"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tuned_vs_default.json").write_text(json.dumps({
        "engine": caps.commit, "model": str(tuned.model), "workload": load.describe(), "rounds": args.rounds,
        "arms": {k: m.to_dict() for k, m in arms.items()}, "verdicts": ratio, "study": result.study,
        "elapsed_s": round(time.monotonic() - t0, 1), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"tuned/default: {ratio['default']['ratio']:.2f}x, tuned/fit: {ratio['fit']['ratio']:.2f}x")


if __name__ == "__main__":
    main()
