"""GPU truth in two commands of one lease: the GPU path of moe-tune on any NVIDIA Linux machine, offline, resumable.

    scripts/gpu_check --pack .gpu-pack            # here (online): trimmed llama.cpp source + wheels, <= 60 MiB
    scripts/gpu_check --dry-run                   # the first lease, command by command, on the estimates
    scripts/gpu_check --from .gpu-pack --out results/gpu-check --copy-to $OUT --time-limit N   # there; twice

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
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from gpucheck import lease as gpu_lease  # noqa: E402
from gpucheck.steps import (  # noqa: E402, F401 - parse_smi: the check's public name
    DEFAULT_MODEL,
    ENGINE_CMDS,
    FIRST_BUDGET_GIB,
    LATER_BUDGETS_GIB,
    LONG_CTX,
    parse_smi,
    steps_for,
    use_site,
)
from tuner.core.errors import ProcessTimeoutError, TunerError  # noqa: E402
from tuner.engine import build, runner  # noqa: E402
from tuner.machine import ballast, hardware  # noqa: E402

EXIT_CONTINUE = 75  # stopped before the time limit: run the same command again
RESUMABLE_MIN_S = 60.0  # a step that goes on where it stopped (the build) starts with at least this much left


class Check:
    """The state of one check run: options, OUT folder, state file, engine and model once known."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out or REPO / "results" / "gpu-check"
        self.gpu_reason = ballast.gpu_missing_reason()  # None: a GPU is here
        self.has_gpu = self.gpu_reason is None
        self.state_path = self.out / "state.json"
        self.state: dict[str, Any] = {"steps": {}, "machine": {}}
        source = self.state_path if self.state_path.is_file() else args.state
        if source is not None and source.is_file():
            raw = json.loads(source.read_text())
            self.state = raw.get("state", raw)  # a gpu-<card>.json that came back holds the state inside
            if source == args.state:  # another lease's machine: this one's card is asked again
                self.state["steps"].pop("gpu-info", None)
                self._again(args.again)
            self._forget_what_is_not_here()
        self.state["command"] = "scripts/gpu_check " + shlex.join(sys.argv[1:])
        self.started = time.monotonic()
        self.packing: threading.Thread | None = None

    def _again(self, names: tuple[str, ...]) -> None:
        """Steps a new lease measures again (after a fix): their earlier results move to ``earlier``, kept in the
        state. Only a lease that starts from ``--state`` does this, so the second command of one lease, which
        continues from the state in --out, does not measure them a third time."""
        earlier = self.state.setdefault("earlier", {})
        for name in names:
            if name in self.state["steps"]:
                earlier.setdefault(name, []).append(self.state["steps"].pop(name))

    def _forget_what_is_not_here(self) -> None:
        """A state carried from another machine (a fresh, bare one): its wheels, engine and model are not here,
        so those steps run again; measured steps stay done."""
        steps = self.state["steps"]
        checks = {"wheels": lambda r: (self.out / "site").is_dir() or not r.get("installed"),
                  "engine": lambda r: Path(r.get("bin", "/nonexistent")).is_dir(),
                  "model": lambda r: Path(r.get("path", "/nonexistent")).is_file(),
                  "model-valid": lambda r: Path(r.get("path", "/nonexistent")).is_file(),
                  "gpu-info": lambda r: True}
        for name, here in checks.items():
            if name in steps and not here(steps[name].get("result") or {}):
                del steps[name]

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2, default=str) + "\n")
        tmp.replace(self.state_path)

    def left_s(self) -> float:
        """Seconds left of --time-limit in this run (children get no more, so none outlives the command)."""
        return max(30.0, self.args.time_limit - (time.monotonic() - self.started))

    def result(self, name: str) -> dict[str, Any]:
        return (self.state["steps"].get(name) or {}).get("result") or {}

    @property
    def engine_dir(self) -> Path | None:
        found = self.result("engine").get("bin")
        return Path(found) if found else None

    @property
    def model_path(self) -> Path:
        return Path(self.result("model")["path"])

    @property
    def budget_mib(self) -> int:
        return FIRST_BUDGET_GIB * 1024

    def cli(self, *argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        """One `moe-tune` command (the CLI is the stable contract), its --json output parsed."""
        extra = ["--llama-cpp-dir", str(self.engine_dir)] if self.engine_dir and argv[0] in ENGINE_CMDS else []
        res = runner.run_process([sys.executable, "-m", "tuner.cli", *argv, *extra, "--json"], timeout_s=self.left_s(),
                                 what=f"moe-tune {argv[0]}", fix="see the step's note", env=env, cwd=REPO)
        return json.loads(res.stdout)

    def log(self, text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)




# ------------------------------------------------------------------------------------------------ driver


def dry_run(c: Check) -> int:
    gpu_steps = steps_for(_with_gpu(c, True))
    todo = [s for s in gpu_steps if (c.state["steps"].get(s.name) or {}).get("status") != "done"]
    plan = gpu_lease.plan([gpu_lease.Planned(s.name, s.est_s, s.what, s.part, s.resumable) for s in todo])
    line = "scripts/gpu_check --from .gpu-pack --out results/gpu-check --copy-to $OUT"
    if c.args.state is not None:  # a new lease from another's state: the first command names it (and --again)
        line += f" --state {c.args.state}" + (f" --again {','.join(c.args.again)}" if c.args.again else "")
    print(f"on a GPU machine (estimates for 16 cores; model {c.args.model}; {len(gpu_steps) - len(todo)} steps done "
          "in the state):")
    done_parts = [s.part for s in gpu_steps if s.part and s not in todo]
    print(gpu_lease.render(plan, line, done_parts), end="")
    cpu_steps = steps_for(_with_gpu(c, False))
    print(f"without a GPU (this machine: {c.gpu_reason or 'a GPU is here'}):")
    for s in cpu_steps:
        print(f"  {s.name:16s} ~{s.est_s:5.0f} s  {s.what}")
    return 0


def _with_gpu(c: Check, gpu: bool) -> Check:
    c.has_gpu = gpu
    return c


def run_steps(c: Check) -> int:
    from gpucheck import procs as gpu_procs

    use_site(c.out)
    for ended in gpu_procs.end_leftovers(c.out, c.engine_dir) if c.has_gpu else ():
        print(f"ended a leftover of an earlier run: {ended}", file=sys.stderr)
    for step in steps_for(c):
        done = c.state["steps"].get(step.name, {})
        if done.get("status") == "done":
            continue
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


def finish_command(c: Check) -> None:
    if c.packing is not None:
        c.packing.join(timeout=max(1.0, c.args.time_limit - (time.monotonic() - c.started)))
    _describe_machine(c)
    c.save()
    for path in copy_out(c, REPO / "results" / "benchmarks" if c.has_gpu else None):
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, metavar="DIR", help="write the carry folder (trimmed source, wheels)")
    p.add_argument("--no-wheels", action="store_true", help="pack no wheels (offline; the GPU side must have them)")
    p.add_argument("--wheels-from", type=Path, metavar="DIR", help="copy wheels from DIR instead of downloading")
    p.add_argument("--sdist", type=Path, help="llama-cpp-python sdist to trim (default: the engine build's)")
    p.add_argument("--from", dest="from_dir", type=Path, metavar="DIR",
                   help="use a pack: build the engine from it (or restore DIR/engine, brought back by a lease)")
    p.add_argument("--out", type=Path, help="state, logs and the table (default results/gpu-check)")
    p.add_argument("--state", type=Path, metavar="JSON",
                   help="start from the state a lease brought back (results/benchmarks/gpu-<card>.json)")
    p.add_argument("--dry-run", action="store_true", help="the first lease, command by command, on the estimates")
    p.add_argument("--again", type=lambda s: tuple(x for x in s.split(",") if x), default=(), metavar="STEPS",
                   help="steps done in --state's lease to measure again (comma-separated), e.g. after a fix")
    p.add_argument("--budgets", type=lambda s: tuple(int(x) for x in s.split(",")), default=LATER_BUDGETS_GIB,
                   help=f"free VRAM of the later chat runs, GiB (default 8,16,24; {FIRST_BUDGET_GIB} comes first)")
    p.add_argument("--long-ctx", type=int, default=LONG_CTX, help="context of the long-context run (0: none)")
    p.add_argument("--trials", type=int, default=3, help="auto-tune trials per run")
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog model and recipe for shape-model")
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
            if not args.dry_run and args.out is None:
                return 0
        c = Check(args)
        if args.dry_run:
            return dry_run(c)
        return run_steps(c)
    except TunerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
