"""GPU truth in two commands of one lease: the GPU path of moe-tune on any NVIDIA Linux machine, offline, resumable.

    scripts/gpu_check --pack .gpu-pack --engine 90     # here (online): trimmed source, wheels, llama.cpp's engine
    scripts/gpu_check --pack-ik .gpu-pack-ik --engine 90   # here: ik_llama.cpp's engine, the 2nd command's carry
    scripts/gpu_check --dry-run                   # the first lease, command by command, on the estimates
    scripts/gpu_check --from .gpu-pack --out results/gpu-check --copy-to $OUT --time-limit N   # there; twice
    scripts/rehearse_lease.py                     # here, no GPU: the lease's commands up to their first CUDA call

On a GPU, ordered by what answers soonest: the card (its compute capability is the build's only CUDA
architecture), the pinned engine built with CUDA (timed into the state), a real-scale model written there, then
(a) the memory model against llama.cpp's CUDA breakdown at 12 GiB free, component by component, (c) a spill
induced by a ballast and classified, (b) tuned vs --fit vs default at 12 GiB free for the chat and the agent
workload; later leases go on with more budgets, a long context and more spill tries. Every step's result goes
to the state file the moment it ends, and the table and its JSON (``gpu-<card>.md``/``.json``, the state inside)
to ``--copy-to`` after every step, so a command cut anywhere still brings back what it measured. A command
stops itself before a step that would pass its ``--time-limit``; the next continues at the first step not done,
and a later lease starts from the JSON that came back (``--state``). The built engine comes back too when it
packs small enough, and the next lease restores it from its carry instead of building again (``--from``).
Without a GPU the same command runs what needs none: the memory model's plan per budget, and the ballast saying
no GPU is there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from gpucheck import lease as gpu_lease  # noqa: E402
from gpucheck.context import RESUMABLE_MIN_S, Check, RehearsalStop  # noqa: E402
from gpucheck.steps import (  # noqa: E402, F401 - parse_smi: the check's public name
    DEFAULT_MODEL,
    IK_CARRY,
    LATER_BUDGETS_GIB,
    LONG_CTX,
    parse_smi,
    steps_for,
    use_site,
)
from tuner.core.errors import ProcessTimeoutError, TunerError, UsageError  # noqa: E402
from tuner.engine import build  # noqa: E402
from tuner.engine.kinds import IK_LLAMA  # noqa: E402
from tuner.machine import hardware  # noqa: E402

EXIT_CONTINUE = 75  # stopped before the time limit: run the same command again
DEFAULT_ROUNDS = 6  # scripts/sim_lease_power.py: P = 0.99 at 1.14x and sigma 4 % (5 rounds: 0.94)


# ------------------------------------------------------------------------------------------------ driver


def dry_run(c: Check) -> int:
    from gpucheck import power

    c.planning = True
    gpu_steps = steps_for(_with_gpu(c, True))
    todo = [s for s in gpu_steps if (c.state["steps"].get(s.name) or {}).get("status") != "done"]
    plan = lease_plan(todo)
    line = f"scripts/gpu_check --from {c.args.from_dir or '.gpu-pack'} --out results/gpu-check --copy-to $OUT"
    if c.args.state is not None:  # a new lease from another's state: the first command names it (and --again)
        line += f" --state {c.args.state}" + (f" --again {','.join(c.args.again)}" if c.args.again else "")
    if c.args.rounds != DEFAULT_ROUNDS:
        line += f" --rounds {c.args.rounds}"
    source = f"the state {c.args.state} came back with" if c.args.state is not None else "a fresh state"
    print(f"the next lease, from {source} (estimates for 16 cores from lease 2's measured steps, "
          f"scripts/gpucheck/estimates.py; model {c.args.model}; {len(gpu_steps) - len(todo)} steps done):")
    engine = c.args.from_dir / "engine" / "engine.json" if c.args.from_dir else None
    if engine is None or not engine.is_file():
        print("  prerequisite, here, before the first device call: the engine is built here, portable for the CPU, and "
              "carried, so the lease spends no time building it:\n    MOE_TUNE_CPU_ISA=avx2 MOE_TUNE_CUDA_ARCHS=90 "
              "moe-tune engine install --backend cuda   (27 min on 2 cores, results/benchmarks/cuda-build-2core.md)\n"
              f"    scripts/gpu_check --pack {c.args.from_dir or '.gpu-pack'} --engine 90   (carry it)")
    ik = c.args.ik_from / "engine-ik" / "engine.json" if c.args.ik_from else None
    if ik is None or not ik.is_file():
        print("  prerequisite for (e): ik_llama.cpp's CUDA engine, built here the same way and carried by the second "
              "command alone (the two engines do not fit one 64 MiB carry):\n    MOE_TUNE_CPU_ISA=avx2 "
              "MOE_TUNE_CUDA_ARCHS=90 moe-tune engine install --engine ik --backend cuda   (not built yet; its CUDA "
              "sources are ~1.5x llama.cpp's: 219 .cu files compiled vs 147)\n"
              f"    scripts/gpu_check --pack-ik {c.args.ik_from or IK_CARRY} --engine 90   (carry it in command 2)")
    done_parts = [s.part for s in gpu_steps if s.part and s not in todo]
    print(gpu_lease.render(plan, line, done_parts), end="")
    p = power.power(c.args.rounds, power.TARGET_GAIN, power.TARGET_SIGMA)
    print(f"each versus step: {c.args.rounds} interleaved rounds decide a {power.TARGET_GAIN:.2f}x gain at "
          f"{100 * power.TARGET_SIGMA:.0f} % round-to-round noise with P = {p.p_better:.2f} (99 % verdict; "
          "scripts/sim_lease_power.py); it stops between rounds at its command's limit, keeping what it measured")
    cpu_steps = steps_for(_with_gpu(c, False))
    print(f"without a GPU (this machine: {c.gpu_reason or 'a GPU is here'}):")
    for s in cpu_steps:
        print(f"  {s.name:16s} ~{s.est_s:5.0f} s  {s.what}")
    return 0


def lease_plan(todo: list[Any]) -> gpu_lease.LeasePlan:
    """The steps not done yet into the lease's commands (:func:`gpucheck.lease.plan`)."""
    return gpu_lease.plan([gpu_lease.Planned(s.name, s.est_s, s.what, s.part, s.resumable, s.carry) for s in todo])


def _with_gpu(c: Check, gpu: bool) -> Check:
    c.has_gpu = gpu
    return c


def run_steps(c: Check) -> int:
    from gpucheck import procs as gpu_procs

    use_site(c.out)
    for ended in gpu_procs.end_leftovers(c.out, c.engine_dir) if c.has_gpu else ():
        print(f"ended a leftover of an earlier run: {ended}", file=sys.stderr)
    steps = steps_for(c)
    if c.args.start_at:  # a later command of the plan (a rehearsal of it: its earlier steps cannot run here)
        names = [s.name for s in steps]
        if c.args.start_at not in names:
            raise UsageError(f"--start-at {c.args.start_at}: no such step; the steps are {', '.join(names)}")
        steps = steps[names.index(c.args.start_at):]
    todo = [s for s in steps if (c.state["steps"].get(s.name) or {}).get("status") != "done"]
    print(f"[    0 s] {announce(todo, c.args.time_limit)}", file=sys.stderr, flush=True)
    for ran, step in enumerate(todo):
        if step.carry and ran:
            print(f"stopping before {step.name}: its command carries {step.carry} (run the next command with that "
                  "carry)", file=sys.stderr)
            finish_command(c)
            return EXIT_CONTINUE
        left = c.args.time_limit - (time.monotonic() - c.started)
        if step.est_s > left and not (step.resumable and left >= RESUMABLE_MIN_S):
            print(f"stopping before {step.name} (~{step.est_s:.0f} s, {left:.0f} s left of --time-limit): run the "
                  "same command again to continue", file=sys.stderr)
            finish_command(c)
            return EXIT_CONTINUE
        print(f"[{time.monotonic() - c.started:5.0f} s] {step.name}: {step.what}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            result = step.run(c)
            entry = {"status": "done", "result": result, "note": result.pop("note", None) if result else None}
        except RehearsalStop as exc:  # the lease's first CUDA call: what a machine without a GPU cannot do
            took = round(time.monotonic() - t0, 1)
            c.state.setdefault("rehearsal", []).append({"step": step.name, "first_cuda_call": str(exc),
                                                        "after_s": round(time.monotonic() - c.started, 1),
                                                        "step_ran_s": took})
            print(f"rehearsal stops in {step.name} after {took} s of it: its first CUDA call is {exc}", file=sys.stderr)
            finish_command(c)
            return 0
        except ProcessTimeoutError as exc:  # stopped at the time limit: not failed, continue next run
            timeouts = c.state.setdefault("timeouts", {})
            timeouts[step.name] = timeouts.get(step.name, 0) + 1
            if c.has_gpu:
                gpu_procs.end_leftovers(c.out, c.engine_dir)
            print(f"{step.name} stopped at --time-limit ({exc}): run the same command again", file=sys.stderr)
            finish_command(c)
            return EXIT_CONTINUE
        except (TunerError, OSError, ValueError, KeyError) as exc:
            entry = {"status": "failed", "result": None, "note": str(exc)[:500]}
            print(f"  {step.name} failed: {exc}", file=sys.stderr)
        entry["took_s"] = round(time.monotonic() - t0, 1)
        c.state["steps"][step.name] = entry
        if step.name == "gpu-info" and entry["status"] == "done":
            c.state["machine"].update(result)
        c.save()
        copy_out(c)  # after every step: a command cut by the device's own limit still brings back what it did
    finish_command(c)
    failed = [n for n, s in c.state["steps"].items() if s.get("status") == "failed"]
    return 1 if failed else 0


def announce(todo: list[Any], limit_s: float) -> str:
    """What this command will spend, said on start: the steps it expects to run before its --time-limit (the stop
    rule's, on the estimates) and their total."""
    planned: list[Any] = []
    for s in todo:
        if (s.carry and planned) or sum(p.est_s for p in planned) + s.est_s > limit_s:
            break
        planned.append(s)
    total = sum(p.est_s for p in planned)
    rest = f"; then {len(todo) - len(planned)} steps for the next command" if len(planned) < len(todo) else ""
    return (f"this command plans {', '.join(p.name for p in planned) or 'nothing'}: ~{total:.0f} s of its "
            f"{limit_s:.0f} s --time-limit{rest}")


def finish_command(c: Check) -> None:
    if c.packing is not None:
        c.packing.join(timeout=max(1.0, c.args.time_limit - (time.monotonic() - c.started)))
    _describe_machine(c)
    c.save()
    keep = c.has_gpu and not c.rehearsing  # a rehearsal's NVML stand-in is no card to keep figures of
    for path in copy_out(c, REPO / "results" / "benchmarks" if keep else None):
        print(f"wrote {path}", file=sys.stderr)


def copy_out(c: Check, bench_dir: Path | None = None) -> list[Path]:
    """The state and the table in OUT; with ``--copy-to`` (a device call's $OUT) the table and its JSON (the state
    inside) as ``gpu-<card>.md`` and ``gpu-<card>.json``: what results/benchmarks keeps, as it came back."""
    from gpucheck import table as gpu_table

    written = gpu_table.write(c.state, c.out, bench_dir)
    if c.args.copy_to is not None:
        written += gpu_table.write_back(c.state, c.args.copy_to)
    return written


def _describe_machine(c: Check) -> None:
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    m = c.state["machine"]
    m["describe"] = hw.describe()
    m.setdefault("gpu_name", hw.gpu_name)
    m["cores"] = os.cpu_count()
    eng = c.result("engine")
    m["engine_commit"], m["engine_backend"] = eng.get("commit", build.PIN.commit), eng.get("backend", "n/a")


def newest_state() -> Path | None:
    """The state the last lease brought back (results/benchmarks/gpu-<card>.json), as a path from the repo root."""
    found = sorted((REPO / "results" / "benchmarks").glob("gpu-*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].relative_to(REPO) if found else None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, metavar="DIR", help="write the carry folder (trimmed source, wheels)")
    p.add_argument("--no-wheels", action="store_true", help="pack no wheels (offline; the GPU side must have them)")
    p.add_argument("--wheels-from", type=Path, metavar="DIR", help="copy wheels from DIR instead of downloading")
    p.add_argument("--sdist", type=Path, help="llama-cpp-python sdist to trim (default: the engine build's)")
    p.add_argument("--engine", metavar="ARCH", help="with --pack: carry the CUDA engine built here for ARCH (90: "
                   "H100/H200), so the lease restores it instead of building")
    p.add_argument("--engine-dir", type=Path, metavar="BIN", help="with --engine: that build's bin folder")
    p.add_argument("--pack-ik", type=Path, metavar="DIR", help="with --engine ARCH: pack ik_llama.cpp's CUDA engine "
                   "built here into DIR/engine-ik, the carry of the lease's second command")
    p.add_argument("--ik-from", type=Path, metavar="DIR", default=Path(IK_CARRY),
                   help=f"where ik_llama.cpp's carried engine is (DIR/engine-ik; default {IK_CARRY})")
    p.add_argument("--stand-in", action="store_true", help="with --engine-dir: pack that build (a CPU one) in the "
                   "CUDA engine's place, marked as a stand-in, for --rehearse")
    p.add_argument("--rehearse", action="store_true", help="run as the lease would on a machine with no GPU (NVML "
                   "from a stand-in): each command stops at its first CUDA call and says which")
    p.add_argument("--start-at", metavar="STEP", help="begin at this step (with --rehearse: a later command)")
    p.add_argument("--from", dest="from_dir", type=Path, metavar="DIR",
                   help="use a pack: build the engine from it (or restore DIR/engine, brought back by a lease)")
    p.add_argument("--out", type=Path, help="state, logs and the table (default results/gpu-check)")
    p.add_argument("--state", type=Path, metavar="JSON",
                   help="start from the state a lease brought back (results/benchmarks/gpu-<card>.json)")
    p.add_argument("--dry-run", action="store_true", help="the first lease, command by command, on the estimates")
    p.add_argument("--again", type=lambda s: tuple(x for x in s.split(",") if x), default=(), metavar="STEPS",
                   help="steps done in --state's lease to measure again (comma-separated), e.g. after a fix")
    p.add_argument("--budgets", type=lambda s: tuple(int(x) for x in s.split(",")), default=LATER_BUDGETS_GIB,
                   help="free VRAM of more chat runs the CPU fallback plans, GiB (default 24)")
    p.add_argument("--long-ctx", type=int, default=LONG_CTX, help="context of the long-context run (0: none)")
    p.add_argument("--trials", type=int, default=3, help="auto-tune trials per run")
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog model and recipe for shape-model")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help=f"interleaved rounds per versus step (default {DEFAULT_ROUNDS}: P >= 0.9 at 1.14x, sigma 4 %%)")
    p.add_argument("--unified-spill", action="store_true", help="also spill with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1")
    p.add_argument("--plan-card", default="RTX 4090", help="card the CPU fallback plans for")
    p.add_argument("--time-limit", type=float, default=gpu_lease.COMMAND_MAX_S,
                   help="stop before a step that would pass this, s (the dry run gives each command's)")
    p.add_argument("--copy-to", type=Path, metavar="DIR", help="also write gpu-<card>.md/.json here (e.g. $OUT)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.pack is not None:
            from gpucheck import pack as gpu_pack

            res = gpu_pack.make_pack(args.pack, sdist=args.sdist, wheels=not args.no_wheels,
                                     wheel_dir=args.wheels_from)
            print(gpu_pack.describe(res), end="")
            if args.engine is not None:
                packed = gpu_pack.pack_engine(args.pack, args.engine, args.engine_dir, stand_in=args.stand_in)
                print(f"  engine/ (arch {args.engine}): {packed.get('archive_mib')} MiB"
                      + ("" if packed.get("packed") else f" NOT PACKED: {packed.get('note')}"))
            if not args.dry_run and args.out is None:
                return 0
        if args.pack_ik is not None:
            from gpucheck import pack as gpu_pack

            if args.engine is None:
                raise UsageError("--pack-ik needs --engine ARCH (90 for an H100/H200): the card it is built for")
            packed = gpu_pack.pack_engine(args.pack_ik, args.engine, args.engine_dir, IK_LLAMA, stand_in=args.stand_in)
            print(f"{args.pack_ik}/engine-ik (arch {args.engine}): {packed.get('archive_mib')} MiB"
                  + ("" if packed.get("packed") else f" NOT PACKED: {packed.get('note')}"))
            if not args.dry_run and args.out is None:
                return 0
        if args.dry_run and args.state is None and args.pack is None:
            args.state = newest_state()  # the next lease: from what the last one brought back
        if args.dry_run and args.from_dir is None:
            args.from_dir = Path(".gpu-pack")
        c = Check(args)
        if args.dry_run:
            return dry_run(c)
        return run_steps(c)
    except TunerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
