"""Speculative decoding break-even on this machine: generation tok/s against synthetic acceptance length.

One draft kind (the model's MTP head when the file has one, else a 1-layer draft model of the same architecture
and vocabulary written here) and one n-gram mode (ngram-mod), each at ``--spec-synth-len`` 1.0 … 3.0 (mean
tokens per verification step, the target's own token included), against no speculation, all measured with
llama-server on prompts from the bundled corpus, arms alternating over rounds. Synthetic acceptance replaces
the verification outcome only: the drafter still drafts and the target still verifies every drafted token, so
the cost is real and the acceptance is set. An n-gram mode only drafts where the text repeats itself; the
drafted-token counts say whether it did.

    flock /tmp/moe-tune-cpu.lock .venv/bin/python scripts/bench_speculation.py [--model M.gguf] [--rounds 2]

Default model: the valid-weight OLMoE-1B-7B Q4_K_M from issue 11 (~/.cache/moe-tune/real/), else the largest
demo model (labelled). Ends with ``break-even acceptance: X.XX tokens``: the acceptance length at which the draft
kind's generation speed meets no speculation's (a least-squares line through the measured points).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import harness

from tuner.core.config import LaunchConfig, SpecType
from tuner.engine import build, flags
from tuner.measure import speculation
from tuner.measure.workload import Workload, WorkloadKind
from tuner.models import demo, gguf_reader, shape_model

REAL = Path.home() / ".cache" / "moe-tune" / "real" / "olmoe-1b-7b-Q4_K_M-valid.gguf"
LENGTHS = (1.0, 1.5, 2.0, 2.5, 3.0)
NGRAM_LENGTHS = (1.0, 2.0, 3.0)
BUDGET_S = 11 * 60  # the whole run stays under 12 minutes: a further round only if it fits


def draft_for(target: Path, info: gguf_reader.ModelInfo, loc: build.EngineLocation) -> Path:
    """A 1-layer model of the target's architecture and vocabulary (same synthetic tokens), valid weights."""
    out = target.with_name(f"{target.stem}-draft-1layer.gguf")
    if out.is_file():
        return out
    spec = replace(shape_model.EXTRA_SHAPES["olmoe-1b-7b"], n_layer=1, name="OLMoE-1B-7B draft (1 layer)")
    if info.arch != spec.arch or info.n_vocab != spec.n_vocab:
        raise SystemExit(f"no draft recipe for {info.arch}: pass a model with an MTP head or an OLMoE shape")
    shape_model.write_shape_model(spec, "Q4_K_M", out, weights="random", engine=loc)
    return out


def fit_break_even(points: list[tuple[float, float]], none_tok_s: float) -> tuple[float, float, float]:
    """Least-squares line tok/s = a + b·L through the points; the L where it meets ``none_tok_s``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, (none_tok_s - a) / b if b > 0 else float("inf")


@harness.bench("bench_speculation")
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("-p", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("-n", type=int, default=32, help="generated tokens per request")
    # One thread: on a shared 2-core machine, two llama.cpp threads spin at every barrier whenever another job
    # takes a core, and a run then crawls at a tenth of its speed; one thread only slows in proportion.
    ap.add_argument("-t", type=int, default=1, help="threads")
    args = ap.parse_args()
    loc = build.locate_engine()
    model, label = args.model, "given"
    if model is None and REAL.is_file():
        model, label = REAL, "real-scale shape (OLMoE-1B-7B Q4_K_M), valid random weights"
    elif model is None:
        model = demo.make_demo_models(arch="qwen35moe", size="large", quants=["Q4_K_M"], engine=loc)[-1].path
        label = "FALLBACK: largest demo model (qwen35moe large Q4_K_M), random weights"
    info = gguf_reader.inspect_model(model)
    # Weights in anonymous memory (-lm none): page cache shared with other jobs cannot be evicted under a run.
    base = LaunchConfig(model=model, ctx=1024, parallel=1, threads=args.t, mmap=False)
    if gguf_reader.has_mtp_head(info):
        kind, draft, draft_label = SpecType.DRAFT_MTP, None, "draft-mtp (the model's own MTP head)"
    else:
        draft = draft_for(model, info, loc)
        kind, draft_label = SpecType.DRAFT_SIMPLE, f"draft-simple with {draft.name}"
    arms = [speculation.Arm("none", base)]
    for length in LENGTHS:
        arms.append(speculation.Arm(f"{kind.value} L={length:g}", replace(
            base, spec_types=(kind,), draft_model=draft, spec_draft_n_max=3, spec_synth_len=length)))
        if length in NGRAM_LENGTHS:
            arms.append(speculation.Arm(f"ngram-mod L={length:g}", replace(
                base, spec_types=(SpecType.NGRAM_MOD,), spec_synth_len=length)))
    load = Workload(WorkloadKind.CUSTOM, args.p, args.n)
    print(f"command: flock /tmp/moe-tune-cpu.lock .venv/bin/python {' '.join(sys.argv)}")
    print(f"model: {model.name} ({label}); {info.n_layer} layers, {info.n_expert} experts, "
          f"{info.file_bytes / 2**30:.2f} GiB")
    print(f"draft kind: {draft_label}, --spec-draft-n-max 3; n-gram mode: ngram-mod (engine defaults)")
    print(f"device: this machine's CPU, {args.t} threads, -lm none, llama.cpp {build.PIN.commit}; workload P={args.p} "
          f"G={args.n}, {args.requests} requests per arm and round, {args.rounds} rounds alternating "
          f"(order reversed each round); synthetic acceptance (--spec-synth-len), so figures are mechanics, "
          f"not this model's real acceptance")
    t0 = time.monotonic()
    # One unmeasured pass of the reference first: the file is read into memory and the machine settles.
    speculation.measure_arm(loc, arms[0], load, requests=1, log_dir=Path("/tmp/moe-tune-bench-speculation"))
    print(f"  {time.monotonic() - t0:6.0f} s  primed (one unmeasured request on none)", flush=True)
    results: list[speculation.ArmResult] = []
    for rnd in range(args.rounds):
        took = time.monotonic() - t0
        if rnd and took / rnd > BUDGET_S - took:
            print(f"  round {rnd + 1} left out: a round takes {took / rnd:.0f} s, {BUDGET_S - took:.0f} s of the "
                  "budget remain")
            break
        more = speculation.measure_arms(loc, arms, load, rounds=1, first_round=rnd, requests=args.requests,
                                        log_dir=Path("/tmp/moe-tune-bench-speculation"),
                                        on_step=lambda s: print(f"  {time.monotonic() - t0:6.0f} s  {s}", flush=True))
        results = more if not results else [replace(a, requests=a.requests + b.requests, failure=a.failure
                                                    or b.failure) for a, b in zip(results, more, strict=True)]
    none = results[0]
    if not none.ok:
        print(f"none failed: {none.failure}")
        return 1
    print()
    print(f"{'arm':<26} {'gen tok/s':>10} {'vs none':>8} {'e2e gain %':>10} {'noise ±%':>9} {'drafted':>8} "
          f"{'accepted %':>10}")
    draft_points: list[tuple[float, float]] = []
    for r in results:
        if not r.ok:
            print(f"{r.arm.label:<26} failed: {(r.failure or {}).get('message', '')[:80]}")
            continue
        g = speculation.paired_gain(none, r)
        drafted = sum(q.draft_n for q in r.requests)
        acc = "" if r.acceptance_rate is None else f"{100 * r.acceptance_rate:.0f}"
        print(f"{r.arm.label:<26} {r.gen_tok_s:>10.2f} {r.gen_tok_s / none.gen_tok_s:>7.2f}x "
              f"{g.gain_pct:>+10.1f} {g.noise_pct:>9.1f} {drafted:>8} {acc:>10}")
        if r.arm.config.spec_types == (kind,):
            draft_points.append((r.arm.config.spec_synth_len or 1.0, r.gen_tok_s))
    longest = next(a for a in reversed(arms) if a.config.spec_types == (kind,))
    print(f"\nlaunch line of the longest draft arm: {flags.launch_line(longest.config)}")
    print(f"elapsed: {time.monotonic() - t0:.0f} s")
    if len(draft_points) < 2:
        print("break-even acceptance: nan tokens")
        return 1
    a, b, be = fit_break_even(draft_points, none.gen_tok_s)
    print(f"{kind.value}: gen tok/s ≈ {a:.2f} + {b:.2f}·L (L = mean tokens per step); none: {none.gen_tok_s:.2f} "
          f"tok/s; break-even {'inside' if LENGTHS[0] <= be <= LENGTHS[-1] else 'outside (extrapolated)'} "
          f"the measured range {LENGTHS[0]:g}…{LENGTHS[-1]:g}")
    print(f"break-even acceptance: {be:.2f} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
