"""GPU truth in one command: the whole GPU path of moe-tune on any NVIDIA Linux machine, offline, resumable.

    scripts/gpu_check --pack .gpu-pack            # here (online): trimmed llama.cpp source + wheels, <= 60 MiB
    scripts/gpu_check --dry-run                   # the steps and their estimated times
    scripts/gpu_check --from .gpu-pack --out /root/gpu-check      # on the GPU machine; again to continue

On a GPU: build the pinned engine with CUDA for the card's own architecture only, write a real-scale model,
then for each budget (a ballast holds the rest of the card) auto-tune against llama.cpp's default and --fit,
compare the memory model with llama.cpp's breakdown, and induce a spill to see it classified. Every step's
result goes to OUT/state.json the moment it ends; a run stopped by the time limit (or killed) continues at
the first step not done. Without a GPU the same command runs what needs none: the memory model's plan per
budget, and the ballast saying no GPU is there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from tuner.core.errors import NoGpuError, ProcessTimeoutError, TunerError, UsageError  # noqa: E402
from tuner.engine import build, runner  # noqa: E402
from tuner.machine import ballast, hardware, paths  # noqa: E402

DEFAULT_BUDGETS_GIB = (8, 12, 16, 24)
DEFAULT_MODEL = "qwen3-30b-a3b:Q4_K_M"
CHAT_CTX = 8192
LONG_CTX = 65536
LONG_BUDGET_GIB = 16
SPILL_TRIES = 3
SPILL_SHORT_MIB = 2048  # the spill ballast leaves this much less than the config needs
EXIT_CONTINUE = 75  # stopped before the time limit: run the same command again


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    needs_gpu: bool
    est_s: float  # on the GPU machine (16 cores) for GPU steps; on this kind of 2-core CPU box otherwise
    run: Callable[[Check], dict[str, Any]]
    what: str


class Check:
    """The state of one check run: options, OUT folder, state file, engine and model once known."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out or REPO / "results" / "gpu-check"
        self.gpu_reason = ballast.gpu_missing_reason()  # None: a GPU is here
        self.has_gpu = self.gpu_reason is None
        self.state_path = self.out / "state.json"
        self.state: dict[str, Any] = {"steps": {}, "machine": {}}
        if self.state_path.is_file():
            self.state = json.loads(self.state_path.read_text())
            self._forget_what_is_not_here()
        self.state["command"] = "scripts/gpu_check " + shlex.join(sys.argv[1:])
        self.started = time.monotonic()

    def _forget_what_is_not_here(self) -> None:
        """A state carried from another machine (a fresh, bare one): its wheels, engine and model are not here,
        so those steps run again; measured steps stay done."""
        steps = self.state["steps"]
        checks = {"wheels": lambda r: (self.out / "site").is_dir() or not r.get("installed"),
                  "engine": lambda r: Path(r.get("bin", "/nonexistent")).is_dir(),
                  "model": lambda r: Path(r.get("path", "/nonexistent")).is_file(),
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

    def cli(self, *argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        """One `moe-tune` command (the CLI is the stable contract), its --json output parsed."""
        extra = ["--llama-cpp-dir", str(self.engine_dir)] if self.engine_dir and argv[0] in ENGINE_CMDS else []
        res = runner.run_process([sys.executable, "-m", "tuner.cli", *argv, *extra, "--json"], timeout_s=self.left_s(),
                                 what=f"moe-tune {argv[0]}", fix="see the step's note", env=env, cwd=REPO)
        return json.loads(res.stdout)


ENGINE_CMDS = {"auto-tune", "bench"}


# ------------------------------------------------------------------------------------------------ steps


def step_gpu_info(c: Check) -> dict[str, Any]:
    res = runner.run_process(["nvidia-smi", "--query-gpu=name,compute_cap,memory.total,memory.free,driver_version",
                              "--format=csv,noheader,nounits"], timeout_s=60, what="nvidia-smi",
                             fix="check the NVIDIA driver")
    return parse_smi(res.stdout)


def parse_smi(text: str) -> dict[str, Any]:
    """The first GPU of ``nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.free,driver_version``."""
    name, cap, total, free, driver = (v.strip() for v in text.strip().splitlines()[0].rsplit(",", 4))
    return {"gpu_name": name, "compute_cap": cap, "cuda_arch": cap.replace(".", ""), "total_mib": int(total),
            "free_mib": int(free), "driver": driver}


def step_wheels(c: Check) -> dict[str, Any]:
    wheels = sorted((c.args.from_dir / "wheels").glob("*.whl")) if c.args.from_dir else []
    if not wheels:
        return {"installed": [], "note": "no wheels in the pack: optuna/gguf must already be importable"}
    runner.run_process([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(c.out / "site"), *map(str, wheels)], timeout_s=300,
                       what="pip install (carried wheels)", fix="re-make the pack with scripts/gpu_check --pack")
    use_site(c.out)
    return {"installed": [w.name for w in wheels]}


def use_site(out: Path) -> None:
    """Make the carried wheels importable here and in every moe-tune child."""
    site = out / "site"
    if site.is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])


def step_engine(c: Check) -> dict[str, Any]:
    """CUDA build of the pinned tree for this card's architecture only (ninja resumes a cut build)."""
    if c.args.from_dir is None:
        loc = build.locate_engine()
        caps = build.capabilities(loc)
        if caps.backend != "cuda":
            raise UsageError(f"the engine at {loc.bin_dir} is a {caps.backend} build: pass --from PACK to build "
                             "one with CUDA, or set LLAMA_CPP_DIR to a CUDA build")
        return {"bin": str(loc.bin_dir), "commit": caps.commit, "backend": caps.backend, "built": False}
    import gpu_pack

    src, bdir = c.out / "engine-src", c.out / "engine-build"
    if not (src / "CMakeLists.txt").is_file():
        gpu_pack.extract_tree(c.args.from_dir / gpu_pack.TREE_NAME, src)
    arch = c.result("gpu-info")["cuda_arch"]
    os.environ["MOE_TUNE_CUDA_ARCHS"] = arch  # read by build.cmake_flags
    log = c.out / "engine-build.log"
    with log.open("a") as fh:
        def line(text: str) -> None:
            fh.write(text + "\n")

        if not (bdir / "build.ninja").is_file():
            runner.run_process(["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja",
                                *build.cmake_flags(build.Backend.CUDA)], timeout_s=600, what="cmake configure",
                               fix=f"see {log}", on_line=line)
        runner.run_process(["cmake", "--build", str(bdir), "-j", str(os.cpu_count() or 4), "--target",
                            *build.TOOLS], timeout_s=c.left_s(), what="cmake build",
                           fix="run the same command again: the build continues", on_line=line)
    loc = build.locate_engine(bdir / "bin")
    caps = build.capabilities(loc, use_cache=False)
    return {"bin": str(bdir / "bin"), "commit": caps.commit, "backend": caps.backend, "cuda_arch": arch,
            "built": True}


def step_model(c: Check) -> dict[str, Any]:
    """A real-scale model: valid random weights where shape-model can write them, else zero-filled."""
    target = c.args.model
    # Random weights are written at full size; if that ran past the time limit once, zero-filled it is.
    random_ok = c.has_gpu and not c.args.zero_weights and not c.state.get("timeouts", {}).get("model") \
        and random_weights_available()
    weights = "random" if random_ok else "zero"
    path = paths.cache_root() / "models" / "gpu-check" / f"{target.replace(':', '-')}-{weights}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "tuner.cli", "shape-model", target, "--out", str(path)]
        runner.run_process(argv + (["--weights", "random"] if random_ok else []), timeout_s=c.left_s(),
                           what="moe-tune shape-model", fix="check disk space (df -h)", cwd=REPO)
    label = "random weights (valid, speed-true)" if random_ok else \
        "zero-filled weights (shape-true; the router ties, so prompt speed is optimistic)"
    return {"target": target, "path": str(path), "weights": weights, "weights_label": label,
            "logical_bytes": path.stat().st_size}


def random_weights_available() -> bool:
    """Can this checkout's shape-model write valid random weights (the speed-true models issue)?"""
    helptext = runner.run_process([sys.executable, "-m", "tuner.cli", "shape-model", "--help"], timeout_s=60,
                                  what="moe-tune shape-model --help", fix="check the checkout", cwd=REPO).stdout
    return "--weights" in helptext


def _plan(c: Check, ctx: int, *more: str, fa: str = "on", slots: int = 1) -> dict[str, Any]:
    return c.cli("plan", str(c.model_path), "-c", str(ctx), "-np", str(slots), "-fa", fa, *more)


def _memory_rows(plan: dict[str, Any], bench_doc: dict[str, Any], n_cpu_moe: int) -> list[dict[str, Any]]:
    """Memory model vs llama.cpp's breakdown, per device and component, for the measured config."""
    row = next((r for r in plan.get("rows", []) if r["n_cpu_moe"] == n_cpu_moe), None)
    found = (bench_doc.get("server") or {}).get("llama_cpp_memory_mib") or []
    if row is None or not found:
        return []
    out = []
    for device, parts in (("GPU", row["gpu"]), ("host", row["host"])):
        # CUDA_Host is pinned host memory: it belongs to the host side, not the card.
        engine = [b for b in found if _on_gpu(b["buffer"]) == (device == "GPU")]
        model = {"model": parts["weights"], "context": parts["kv"] + parts["recurrent"], "compute": parts["compute"]}
        for comp, model_bytes in model.items():
            out.append({"device": device, "component": comp, "model_mib": round(model_bytes / 2**20),
                        "engine_mib": sum(int(b.get(comp) or 0) for b in engine) if engine else None})
    # The host weights buffer by buffer (CUDA_Host / CPU_Mapped / CPU_REPACK / CPU), as the load log names them;
    # a mapped buffer is the span llama.cpp maps, first to last mapped tensor.
    for b in row.get("host_buffers", []):
        name = b["buffer"]
        model_bytes = row.get("mapped_span_bytes", b["bytes"]) if name == "CPU_Mapped" else b["bytes"]
        engine_row = next((e for e in found if e["buffer"] == name), None)
        out.append({"device": "host", "component": f"model in {name}", "model_mib": round(model_bytes / 2**20),
                    "engine_mib": int(engine_row.get("model") or 0) if engine_row else None})
    return out


def _on_gpu(buffer: str) -> bool:
    return buffer.upper().startswith("CUDA") and not buffer.upper().startswith("CUDA_HOST")


def tune_run(c: Check, budget_gib: int, workload: str, ctx: int) -> dict[str, Any]:
    """With all but ``budget_gib`` held by the ballast: auto-tune (tuned vs default vs --fit), then the tuned
    config once more through `bench` for llama.cpp's memory breakdown, power and roofline."""
    with ballast.hold_vram(budget_gib * 1024, runner) as b:
        # Speed and memory only: pricing every KV type's KL-divergence on a real-scale model (zero or random
        # weights, no reference) would spend the few GPU minutes on what the CPU suite already checks.
        tune = c.cli("auto-tune", str(c.model_path), "--workload", workload, "--min-ctx", str(ctx), "--trials",
                     str(c.args.trials), "--max-kld", "off", "--results-dir",
                     str(c.out / f"tune-{budget_gib}g-{workload}"))
        from tuner.engine import flags

        # The memory check needs an explicit placement: the winner, or the best candidate when llama.cpp's
        # own default (placed by its --fit at load) won.
        arms = [tune.get("winner") or {}, *(tune.get("finish") or {}).get("candidates", [])]
        line = next((a["launch_line"] for a in arms if a.get("launch_line")
                     and flags.parse_command(a["launch_line"]).config.n_cpu_moe is not None), None)
        memory: list[dict[str, Any]] = []
        bench_doc: dict[str, Any] = {}
        if line:
            cfg = flags.parse_command(line).config
            bench_doc = c.cli("bench", "--from-cmd", line, "-r", "2", "--workload", workload)
            plan = _plan(c, cfg.ctx or ctx, "-ctk", cfg.cache_type_k.value, "-ctv", cfg.cache_type_v.value,
                         *(["-ub", str(cfg.ubatch)] if cfg.ubatch else []), fa=cfg.flash_attn.value,
                         slots=cfg.parallel or 1)
            memory = _memory_rows(plan, bench_doc, cfg.n_cpu_moe or 0)
    return {"free_mib": b.free_mib, "ballast_mib": b.held_mib, "ballast_method": b.method, "workload": workload,
            "ctx": ctx, "tune": {k: tune.get(k) for k in ("winner", "finish", "speedup", "result_dir")},
            "bench": {k: bench_doc.get(k) for k in ("server", "roofline", "rows")}, "memory": memory}


def spill_run(c: Check, unified: bool) -> dict[str, Any]:
    """Every expert on the GPU at a context that needs more than a ballast leaves: classified each time."""
    import gpu_spill

    need_mib = int(_plan(c, CHAT_CTX)["rows"][0]["vram_bytes"] / 2**20)
    tries = 1 if unified else SPILL_TRIES
    return gpu_spill.spill_run(c.model_path, c.engine_dir, c.out / "spill-logs", need_mib, unified=unified,
                               ctx=CHAT_CTX, tries=tries, short_mib=SPILL_SHORT_MIB)


def step_unified(c: Check) -> dict[str, Any]:
    if not c.args.unified_spill:
        return {"runs": [], "note": "skipped: pass --unified-spill (managed memory asked beyond the free VRAM can "
                                    "hang a GPU; run it only on a machine you may reset)"}
    return spill_run(c, unified=True)


def step_plan_budgets(c: Check) -> dict[str, Any]:
    """Without a GPU: the memory model's smallest --n-cpu-moe per budget (planned, not measured)."""
    rows = []
    for budget, workload, ctx in runs_wanted(c):
        plan = _plan(c, ctx, "--gpu", c.args.plan_card, "--vram-budget", str(budget * 1024))
        fits = [r for r in plan["rows"] if r["verdict"] == "fits"]
        best = fits[0] if fits else None
        rows.append({"budget_mib": budget * 1024, "workload": workload, "ctx": ctx,
                     "n_cpu_moe": best["n_cpu_moe"] if best else None,
                     "vram_bytes": best["vram_bytes"] if best else None,
                     "gen_tok_s_ceiling": best["gen_tok_s_ceiling"] if best else None})
    c.state["plan_card"] = c.args.plan_card
    return {"rows": rows}


def step_ballast_cpu(c: Check) -> dict[str, Any]:
    try:
        with ballast.hold_vram(1024, runner):
            pass
    except NoGpuError as exc:
        return {"note": str(exc)}
    return {"note": "a GPU answered after all"}


def runs_wanted(c: Check) -> list[tuple[int, str, int]]:
    runs = [(b, "chat", CHAT_CTX) for b in c.args.budgets]
    if c.args.long_ctx:
        runs.append((LONG_BUDGET_GIB, "agent", c.args.long_ctx))
    return runs


def steps_for(c: Check) -> list[Step]:
    gpu = c.has_gpu
    # Valid random weights: 63 s for Qwen3-30B-A3B Q4_K_M on the 2-core CPU box (issue 11); sparse zeros: seconds.
    model_s = (90.0 if not c.args.zero_weights and random_weights_available() else 10.0) if gpu else 3.0
    common = [Step("model", False, model_s, step_model, f"write {c.args.model} at real scale")]
    if not gpu:
        return [*common,
                Step("plan-budgets", False, 3.0 * len(runs_wanted(c)), step_plan_budgets,
                     "memory model per budget (planned, not measured)"),
                Step("ballast", False, 1.0, step_ballast_cpu, "VRAM ballast (reports that no GPU is here)")]
    steps = [Step("gpu-info", True, 2, step_gpu_info, "card, compute capability, free VRAM (nvidia-smi)"),
             Step("wheels", True, 10, step_wheels, "install the carried wheels (optuna, gguf)"),
             Step("engine", True, 420, step_engine, "CUDA build of the pinned engine, this card's arch only"),
             *common]
    for budget, workload, ctx in runs_wanted(c):
        name = f"long-{budget}g" if workload == "agent" else f"budget-{budget}g"
        steps.append(Step(name, True, 120 + 25 * c.args.trials, _tune_step(budget, workload, ctx),
                          f"{budget} GiB free: auto-tune vs default vs --fit, -c {ctx} {workload}; breakdown"))
    steps += [Step("spill-oom", True, 90, lambda ch: spill_run(ch, unified=False),
                   f"ballast leaves {SPILL_SHORT_MIB} MiB less than needed: OOM at load, {SPILL_TRIES} tries"),
              Step("spill-unified", True, 240 if c.args.unified_spill else 1, step_unified,
                   "the same with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1: spill and the tok/s collapse")]
    return steps


def _tune_step(budget: int, workload: str, ctx: int) -> Callable[[Check], dict[str, Any]]:
    return lambda c: tune_run(c, budget, workload, ctx)


# ------------------------------------------------------------------------------------------------ driver


def dry_run(c: Check) -> int:
    gpu_steps = steps_for(_with_gpu(c, True))
    cpu_steps = steps_for(_with_gpu(c, False))
    print(f"on a GPU machine ({len(gpu_steps)} steps; estimates for 16 cores, model {c.args.model}):")
    total = 0.0
    for s in gpu_steps:
        total += s.est_s
        print(f"  {s.name:16s} ~{s.est_s:5.0f} s  {s.what}")
    print(f"  total ~{total / 60:.0f} min: about {int(total // c.args.time_limit) + 1} commands of "
          f"{c.args.time_limit:.0f} s; each continues where the last stopped")
    print(f"without a GPU (this machine: {c.gpu_reason or 'a GPU is here'}):")
    for s in cpu_steps:
        print(f"  {s.name:16s} ~{s.est_s:5.0f} s  {s.what}")
    return 0


def _with_gpu(c: Check, gpu: bool) -> Check:
    c.has_gpu = gpu
    return c


def run_steps(c: Check) -> int:
    import gpu_procs
    import gpu_table

    start = c.started
    use_site(c.out)
    for ended in gpu_procs.end_leftovers(c.out, c.engine_dir) if c.has_gpu else ():
        print(f"ended a leftover of an earlier run: {ended}", file=sys.stderr)
    for step in steps_for(c):
        done = c.state["steps"].get(step.name, {})
        if done.get("status") == "done":
            continue
        left = c.args.time_limit - (time.monotonic() - start)
        if step.est_s > left:
            c.save()
            copy_out(c, gpu_table.write(c.state, c.out, None))
            print(f"stopping before {step.name} (~{step.est_s:.0f} s, {left:.0f} s left of --time-limit): run the "
                  "same command again to continue", file=sys.stderr)
            return EXIT_CONTINUE
        print(f"[{time.monotonic() - start:5.0f} s] {step.name}: {step.what}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            result = step.run(c)
            entry = {"status": "done", "result": result, "note": result.pop("note", None) if result else None}
        except ProcessTimeoutError as exc:  # stopped at the time limit: not failed, continue next run
            timeouts = c.state.setdefault("timeouts", {})
            timeouts[step.name] = timeouts.get(step.name, 0) + 1
            if c.has_gpu:
                gpu_procs.end_leftovers(c.out, c.engine_dir)
            c.save()
            print(f"{step.name} stopped at --time-limit ({exc}): run the same command again", file=sys.stderr)
            return EXIT_CONTINUE
        except (TunerError, OSError, ValueError, KeyError) as exc:
            entry = {"status": "failed", "result": None, "note": str(exc)[:500]}
            print(f"  {step.name} failed: {exc}", file=sys.stderr)
        entry["took_s"] = round(time.monotonic() - t0, 1)
        c.state["steps"][step.name] = entry
        if step.name == "gpu-info" and entry["status"] == "done":
            c.state["machine"].update(result)
        c.save()
    _describe_machine(c)
    c.save()
    written = copy_out(c, gpu_table.write(c.state, c.out, REPO / "results" / "benchmarks" if c.has_gpu else None))
    print("\n".join(f"wrote {p}" for p in written), file=sys.stderr)
    failed = [n for n, s in c.state["steps"].items() if s.get("status") == "failed"]
    return 1 if failed else 0


def copy_out(c: Check, written: list[Path]) -> list[Path]:
    """``--copy-to``: the state and the tables, flat, where the caller collects them (a device call's $OUT)."""
    if c.args.copy_to is None:
        return written
    c.args.copy_to.mkdir(parents=True, exist_ok=True)
    for path in [c.state_path, *written]:
        if path.is_file():
            shutil.copy2(path, c.args.copy_to / path.name)
    return [*written, c.args.copy_to]


def _describe_machine(c: Check) -> None:
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    m = c.state["machine"]
    m["describe"] = hw.describe()
    m.setdefault("gpu_name", hw.gpu_name)
    eng = c.result("engine")
    m["engine_commit"], m["engine_backend"] = eng.get("commit", build.PIN.commit), eng.get("backend", "n/a")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", type=Path, metavar="DIR", help="write the carry folder (trimmed source, wheels)")
    p.add_argument("--no-wheels", action="store_true", help="pack no wheels (offline; the GPU side must have them)")
    p.add_argument("--wheels-from", type=Path, metavar="DIR", help="copy wheels from DIR instead of downloading")
    p.add_argument("--sdist", type=Path, help="llama-cpp-python sdist to trim (default: the engine build's)")
    p.add_argument("--from", dest="from_dir", type=Path, metavar="DIR", help="use a pack: build the engine from it")
    p.add_argument("--out", type=Path, help="state, logs and the table (default results/gpu-check)")
    p.add_argument("--dry-run", action="store_true", help="list the steps and their estimated times")
    p.add_argument("--budgets", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEFAULT_BUDGETS_GIB,
                   help="free VRAM per run, GiB (default 8,12,16,24)")
    p.add_argument("--long-ctx", type=int, default=LONG_CTX, help="context of the long-context run (0: none)")
    p.add_argument("--trials", type=int, default=4, help="auto-tune trials per budget")
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog model and recipe for shape-model")
    p.add_argument("--zero-weights", action="store_true", help="zero-filled weights even if random ones can be made")
    p.add_argument("--unified-spill", action="store_true", help="also spill with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1")
    p.add_argument("--plan-card", default="RTX 4090", help="card the CPU fallback plans for")
    p.add_argument("--time-limit", type=float, default=540.0, help="stop before a step that would pass this, s")
    p.add_argument("--copy-to", type=Path, metavar="DIR", help="also copy state and table here (e.g. $OUT)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.pack is not None:
            import gpu_pack

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
