"""Agent sessions on this machine: session time and turn time against depth, the engine's defaults against the
prompt-reuse settings auto-tune tries, on a hybrid (recurrent) and a sliding-window demo model.

Each depth replays the bundled session (tuner.measure.session) sized to that depth through llama-server's chat
API, -np 1, ctx = depth + 1024, as auto-tune's session stage does (tuner.search.session_stage.measure): with two
or more reuse settings, selection rounds of every arm choose the best one, then fresh confirmation rounds (at
least ``--rounds``) measure it beside ``default`` (no reuse flag); the "printed line" column is the stage's
decision. ``checkpoints off`` (``--ctx-checkpoints 0``: what a turn costs when nothing can be restored, the full
re-process users complain of) is measured after the stage, as a reference, not a candidate. The ratio
default/best is the median of the per-round ratios in the rounds both were measured in.

The load lines are the harness's (scripts/harness.py): the measuring lock it holds for the run and its
whole-run watch, which counts this run's own llama-server processes as its own.

    .venv/bin/python scripts/bench_agent_session.py [--arch qwen35moe,gpt-oss | --model FILE.gguf ...]
        [--depths 2048,4096,8192] [--gen 32] [--rounds 2] [--out results/benchmarks/agent_session.md]

``--model`` takes model files instead of the demos, e.g. a real-shape model with valid random weights:
``moe-tune shape-model gpt-oss-20b:MXFP4_MOE --weights random --out ~/.cache/moe-tune/real/gpt-oss-20b.gguf``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import harness

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.machine import paths
from tuner.machine.processes import Interference
from tuner.measure.session_run import SessionResult
from tuner.models import demo, gguf_reader
from tuner.search import session_stage, space

LOG: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _load(seen: Interference) -> str:
    """What the run's watch saw, in one line. The watch is the harness's (its ``own`` is this process and every
    child the runner started), so this run's own llama-server processes and their CPU are not counted: a bare
    ``quiet.Watch()`` once counted them as others (141 "other llama.cpp processes" in a run that started 40)."""
    gpu = "".join(f"; {g}" for g in seen.gpu)
    return (f"{len(seen.llama)} other llama.cpp processes came and went; other processes used up to "
            f"{seen.cpu_cores:.1f} CPU cores{gpu}: {'busy' if seen.busy else 'quiet'}")


def _turn_table(label: str, res: SessionResult) -> None:
    say(f"  {label}: turn | context | cached | processed | TTFT ms | turn s")
    for t in res.turns:
        say(f"    {t.index + 1:>3} | {t.context_tokens:>6} | {t.cached_tokens:>6} | {t.processed_tokens:>6} | "
            f"{1000 * t.ttft_s:>7.0f} | {t.elapsed_s:6.2f}")


@harness.bench("bench_agent_session")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen35moe,gpt-oss")
    ap.add_argument("--model", type=Path, action="append", default=[],
                    help="a model file to measure instead of the demos (repeat for several)")
    ap.add_argument("--weights", default="random (valid) weights written by `moe-tune shape-model --weights random`",
                    help="what --model files hold, in words, for the header")
    ap.add_argument("--depths", default="2048,4096,8192")
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--rounds", type=int, default=2, help="confirmation rounds (one more while undecided)")
    ap.add_argument("-t", "--threads", type=int, default=1,
                    help="llama-server threads (1: on a loaded shared machine spinning threads cost more)")
    ap.add_argument("--no-off", action="store_true",
                    help="leave out the `checkpoints off` arm (its full re-processes are the slowest sessions)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    loc = build.locate_engine()
    caps = build.capabilities(loc)
    depths = [int(d) for d in args.depths.split(",")]
    say(f"command: .venv/bin/python {' '.join(sys.argv)}")
    what = (f"real-shape models, {args.weights}, not trained checkpoints" if args.model else
            "tiny demo models with random weights (tuner.models.demo, F16), not real checkpoints")
    say(f"engine: llama.cpp {build.PIN.commit} ({caps.backend}); device: this machine's CPU, {args.threads} "
        f"thread(s); models: {what}; {args.gen} tokens generated per turn; at least {args.rounds} confirmation "
        "rounds")
    # The machine as harness.bench claimed and watches it: claiming again here would fail (a second flock of the
    # lock file in the same process) and name this very run as the rival.
    rec, watch = harness.held(), harness.watching()
    say(f"load at start: {'this run holds the measuring lock' if rec.locked else 'measured WITHOUT the lock'}; "
        f"{rec.start_noise or 'quiet'}")
    models = ([(p.stem, p.expanduser()) for p in args.model] if args.model else
              [(f"{arch} demo", demo.make_demo_models(arch=arch, engine=loc)[0].path)
               for arch in args.arch.split(",")])
    for name, path in models:
        info = gguf_reader.inspect_model(path)
        say(f"\n## {name} ({path.name}, {path.stat().st_size / 2**30:.2f} GiB, {info.arch})")
        say("depth | turns | default s | best reuse arm | its s | default/best | printed line | checkpoints off s | "
            "default re-processed % | off re-processed %")
        for depth in depths:
            base = LaunchConfig(model=path, ctx=depth + 1024, parallel=1, threads=args.threads)
            arms = [("default", base)]
            arms += [(f"tuned + {a.label}", a.apply(base))
                     for a in space.reuse_arms(info, lambda s: flags.server_accepts(caps, s))]
            req = session_stage.SessionRequest(depth_tokens=depth, gen_tokens=args.gen, rounds=args.rounds)
            log_dir = paths.cache_root() / "logs" / "bench_agent_session"
            t0 = time.monotonic()
            selection, confirmation = session_stage.measure(loc, arms, req, info, caps=caps, log_dir=log_dir)
            stage = (session_stage.judge(selection, "bundled", {}, confirmation=confirmation) if selection else
                     session_stage.judge(confirmation, "bundled", {}))
            # Not a candidate (it would only waste a selection round): measured after the stage, as a reference.
            off = None if args.no_off else session_stage.measure(
                loc, [("checkpoints off", replace(base, ctx_checkpoints=0))], req, info, caps=caps,
                log_dir=log_dir)[1][0]
            default = stage.arm("default")
            best = stage.arm(stage.best) if stage.best else None
            pairs = zip(default.results if default else (), best.results if best else (), strict=False)
            ratios = [d.session_s / t.session_s for d, t in pairs if d is not None and t is not None]
            typical = default.typical if default else None
            off_typ = off.typical if off else None

            def secs(arm: session_stage.ArmSessions | None) -> str:
                return "-" if arm is None or arm.median_session_s is None else f"{arm.median_session_s:.2f}"

            say(f"{depth} | {len(typical.turns) if typical else 0} | {secs(default)} | "
                f"{stage.best or '-'} | {secs(best)} | {_median(ratios):.2f}x | {stage.winner or '-'} | "
                f"{secs(off)} | {100 * (typical.reprocessed_share if typical else 0):.0f} | "
                f"{'-' if off_typ is None else format(100 * off_typ.reprocessed_share, '.0f')}   "
                f"({time.monotonic() - t0:.0f} s)")
            say(f"  {stage.reason}" + (f"; {stage.verdict.describe()}" if stage.verdict else ""))
            for a in (*selection, *confirmation, *([off] if off else [])):
                if a.failure:
                    say(f"  {a.label}: failed: {a.failure}")
            if depth == depths[-1]:
                for shown in dict.fromkeys((default, best, off)):
                    if shown is not None and shown.typical is not None:
                        _turn_table(shown.label, shown.typical)
    say(f"\nload while measuring: {_load(watch.seen)}; 1-min load average {rec.start_loadavg:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end (this run's own included), on {rec.cores} cores")
    if args.out:
        args.out.write_text("# Agent sessions: session and turn time vs depth, default vs tuned\n\n```\n"
                            + "\n".join(LOG) + "\n```\n")


if __name__ == "__main__":
    main()
