"""Which engine on this machine: llama.cpp and ik_llama.cpp each searched with its own levers (auto-tune's search,
``search_only``), then four lines judged head to head on the workload in interleaved rounds (the engines' judge,
:func:`tuner.versus.judge.head_to_head`: selection rounds choose, fresh rounds decide): llama.cpp's default launch,
llama.cpp's best candidate, ik_llama.cpp's default launch and ik's best candidate. Every pair's verdict is taken
from the confirmation rounds, which measured every line. Under the machine lock and the watch (scripts/harness.py).

    .venv/bin/python scripts/bench_which_engine.py MODEL.gguf --workload chat -p 512 -n 64 --trials 6 \\
        --out results/benchmarks/which-engine-cpu/qwen3-30b-a3b-chat.json
    .venv/bin/python scripts/bench_which_engine.py MODEL.gguf --workload agent --depth 1024 -n 32 --trials 6 \\
        --out results/benchmarks/which-engine-cpu/qwen3-30b-a3b-agent.json

KV prices are off (``--max-kld off``): the shape models' weights are valid but not trained, so their KL-divergence
says nothing; the engines' numerics on trained weights are tests/engine/test_ik.py's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import harness

from tuner.core.errors import UsageError
from tuner.engine import build, flags
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP
from tuner.machine import hardware
from tuner.measure import workload
from tuner.search import autotune, study
from tuner.search.verdict import compare_quiet
from tuner.versus import judge


def say(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


@harness.bench("bench_which_engine")
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--workload", choices=("chat", "agent"), default="chat")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--depth", type=int, default=None, help="agent: the session's depth")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    agent = args.workload == "agent"
    kind = workload.WorkloadKind.AGENT if agent else workload.WorkloadKind.CHAT
    load = workload.preset(kind, args.n_prompt, args.n_gen, depth_tokens=args.depth)
    hw = hardware.probe_hardware(host_bandwidth_s=0.3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    lines: list[tuple[str, object]] = []
    engines: dict[str, tuple[build.EngineLocation, build.Capabilities]] = {}
    searches = {}
    for engine in (LLAMA_CPP, IK_LLAMA):
        loc = build.locate_engine(kind=engine)
        caps = build.capabilities(loc)
        say(f"search: {caps.identity.describe()}, {args.trials} trials")
        req = autotune.TuneRequest(model=args.model, workload=load, min_ctx=args.ctx, max_kld=None,
                                   budget=study.Budget(trials=args.trials), top_candidates=1, search_only=True,
                                   results_dir=args.out.parent / "tune")
        t0 = time.time()
        try:
            res = autotune.auto_tune(req, loc, hw, on_step=say)
        except UsageError as exc:  # an engine that cannot run this model (ik_llama.cpp on OLMoE): said, left out
            say(f"{engine.name} left out: {exc}")
            searches[engine.name] = {"error": str(exc), "elapsed_s": round(time.time() - t0, 1)}
            continue
        assert res.default is not None
        best = res.candidates[0] if res.candidates else res.default
        searches[engine.name] = {"study": res.study_name, "trials": res.search.trials_this_run,
                                 "elapsed_s": round(time.time() - t0, 1), "default": flags.launch_line(res.default),
                                 "best": flags.launch_line(best)}
        lines.append((f"{engine.name} default", res.default))
        if flags.launch_line(best) != flags.launch_line(res.default):
            lines.append((f"{engine.name} tuned", best))
        for label, _ in lines[-2:]:
            engines[label] = (loc, caps)
    say("head to head: " + ", ".join(label for label, _ in lines))
    session = (None, args.depth, args.n_gen, 1) if agent else None
    h2h = judge.head_to_head(engines[lines[0][0]][0], lines, load, log_dir=args.out.parent / "logs" / args.out.stem,
                             session=session, on_step=say, engines=engines)  # type: ignore[arg-type]
    arms = {a.label: a for a in h2h.arms}
    pairs = [compare_quiet(a, b, arms[a].scores, arms[b].scores, arms[a].quiet_scores(), arms[b].quiet_scores())
             for a, b in itertools.permutations(arms, 2) if a < b or "default" in b]
    rec = harness.held()
    out = {"model": str(args.model), "workload": load.describe(), "session": session, "ctx": args.ctx,
           "searches": searches, "elapsed_s": round(time.time() - start, 1), "head_to_head": h2h.to_dict(),
           "pairs": [v.to_dict() for v in pairs], "load": rec.describe()}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(h2h.summary())
    for arm in h2h.arms:
        fig = arm.figures()
        print(f"{arm.label}: score {arm.score}, gen {fig['gen_tok_s']}, prompt {fig['prompt_tok_s']}, "
              f"session {fig['session_s']} s; rounds {[r.score for r in arm.rounds]}")
    for v in pairs:
        print(v.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
