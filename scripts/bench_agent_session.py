"""Agent sessions on this machine: session time and turn time against depth, the engine's defaults against the
prompt-reuse settings auto-tune tries, on a hybrid (recurrent) and a sliding-window demo model.

Each depth replays the bundled session (tuner.measure.session) sized to that depth through llama-server's chat
API, every arm once per round in rotating order (tuner.search.session_stage.measure), -np 1, ctx = depth + 1024.
Arms: ``default`` (no reuse flag), each setting of tuner.search.space.reuse_arms, and ``checkpoints off``
(``--ctx-checkpoints 0``: what a turn costs when nothing can be restored, the full re-process users complain of).
The "tuned" column is the arm with the shortest median session at that depth; the ratio default/tuned is the
median of the per-round ratios.

    .venv/bin/python scripts/bench_agent_session.py [--arch qwen35moe,gpt-oss | --model FILE.gguf ...]
        [--depths 2048,4096,8192] [--gen 32] [--rounds 2] [--out results/benchmarks/agent_session.md]

``--model`` takes model files instead of the demos, e.g. a real-shape model with valid random weights:
``moe-tune shape-model gpt-oss-20b:MXFP4_MOE --weights random --out ~/.cache/moe-tune/real/gpt-oss-20b.gguf``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import harness

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.machine import paths, quiet
from tuner.measure.session_run import SessionResult
from tuner.models import demo, gguf_reader
from tuner.search import session_stage, space

LOG: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _load(noise: str | None) -> str:
    """What the watch saw, in one short line: how many other llama.cpp processes ran, and the CPU they used."""
    if not noise:
        return "quiet"
    cores = re.search(r"other processes use ([0-9.]+) CPU cores", noise)
    if not cores and " pid " not in noise:
        return noise
    return (f"{noise.count(' pid ')} other llama.cpp processes came and went"
            + (f"; other processes used {cores[1]} CPU cores" if cores else ""))


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
    ap.add_argument("--rounds", type=int, default=2)
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
        f"thread(s); models: {what}; {args.gen} tokens generated per turn; {args.rounds} rounds per arm")
    with quiet.claim_machine("bench_agent_session", allow_busy=True) as claim, quiet.Watch() as watch:
        say(f"load at start: {_load(claim.noise)}")
        models = ([(p.stem, p.expanduser()) for p in args.model] if args.model else
                  [(f"{arch} demo", demo.make_demo_models(arch=arch, engine=loc)[0].path)
                   for arch in args.arch.split(",")])
        for name, path in models:
            info = gguf_reader.inspect_model(path)
            say(f"\n## {name} ({path.name}, {path.stat().st_size / 2**30:.2f} GiB, {info.arch})")
            say("depth | turns | default s | tuned arm | tuned s | default/tuned | checkpoints off s | "
                "default re-processed % | off re-processed %")
            for depth in depths:
                base = LaunchConfig(model=path, ctx=depth + 1024, parallel=1, threads=args.threads)
                arms = [("default", base)]
                arms += [(f"tuned + {a.label}", a.apply(base))
                         for a in space.reuse_arms(info, lambda s: flags.server_accepts(caps, s))]
                if not args.no_off:
                    arms.append(("checkpoints off", replace(base, ctx_checkpoints=0)))
                req = session_stage.SessionRequest(depth_tokens=depth, gen_tokens=args.gen, rounds=args.rounds)
                t0 = time.monotonic()
                measured = session_stage.measure(loc, arms, req, info, caps=caps,
                                                 log_dir=paths.cache_root() / "logs" / "bench_agent_session")
                by = {a.label: a for a in measured}
                tuned_arms = [a for a in measured if a.label != "checkpoints off" and a.median_session_s]
                best = min(tuned_arms, key=lambda a: a.median_session_s or float("inf"))
                default, off = by["default"], by.get("checkpoints off")
                ratios = [d / t for d, t in zip([r.session_s for r in default.results if r],
                                                [r.session_s for r in best.results if r], strict=False)]
                typical = default.typical
                off_typ = off.typical if off else None
                say(f"{depth} | {len(typical.turns) if typical else 0} | {default.median_session_s or 0:.2f} | "
                    f"{best.label} | {best.median_session_s or 0:.2f} | {_median(ratios):.2f}x | "
                    f"{'-' if off is None else format(off.median_session_s or 0, '.2f')} | "
                    f"{100 * (typical.reprocessed_share if typical else 0):.0f} | "
                    f"{'-' if off_typ is None else format(100 * off_typ.reprocessed_share, '.0f')}   "
                    f"({time.monotonic() - t0:.0f} s)")
                for a in measured:
                    if a.failure:
                        say(f"  {a.label}: failed: {a.failure}")
                if depth == depths[-1]:
                    for shown in dict.fromkeys((default, best, off)):
                        if shown is not None and shown.typical is not None:
                            _turn_table(shown.label, shown.typical)
        say(f"\nload while measuring: {_load(watch.noise)} (other agents share this 2-core machine: figures "
            "include their load)")
    if args.out:
        args.out.write_text("# Agent sessions: session and turn time vs depth, default vs tuned\n\n```\n"
                            + "\n".join(LOG) + "\n```\n")


if __name__ == "__main__":
    main()
