"""The steps of `scripts/gpu_check` (see its docstring) and their estimates, in the order they run: what each one
measures on the GPU machine, and what runs without one."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucheck.context import FIRST_BUDGET_GIB, Check
from tuner.core.errors import NoGpuError, UsageError
from tuner.engine import build, runner
from tuner.engine.kinds import IK_LLAMA
from tuner.machine import ballast, hardware, paths
from tuner.search.trials import config_from_dict

REPO = Path(__file__).resolve().parents[2]

# (b) as the lease decides it: the tuner's line vs llama.cpp's default on agent sessions at three budgets, and chat
# at 12 GiB as the control; in this order (the agent at 12 GiB answers the question soonest).
VERSUS_RUNS = ((12, "agent"), (8, "agent"), (16, "agent"), (12, "chat"))
# (e) ik_llama.cpp vs llama.cpp on the card with experts in RAM (gpucheck.race): the budgets where they sit there.
RACE_BUDGETS_GIB = (8, 16)
IK_CARRY = ".gpu-pack-ik"  # ik's CUDA engine, packed apart: the lease's second command carries it alone
LATER_BUDGETS_GIB = (24,)  # chat in later leases (lease 2: the default, everything on the card, was right)
DEFAULT_MODEL = "qwen3-30b-a3b:Q4_K_M"
CHAT_CTX = 8192
AGENT_CTX = 32768
AGENT_PROMPT = 4096  # the search's agent prompt: long enough for -ub 4096 to be offered
LONG_CTX = 65536
LONG_BUDGET_GIB = 16
SPILL_SHORT_MIB = 2048  # the spill ballast leaves this much less than the config needs
ENGINE_EST_S = 270.0  # a CUDA build there: 262.6 s on an H100 machine's 16 cores (gpu-lease-1/cmd1-engine.json)
RESTORE_EST_S = 5.0  # lease 2 restored the carried engine in 5.0 s


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    needs_gpu: bool
    est_s: float
    run: Callable[[Check], dict[str, Any]]
    what: str
    part: str = ""  # "a", "b", "c" (the questions) or "" (what they need)
    resumable: bool = False  # cut by a time limit, the next command goes on where it stopped (the build)
    carry: str = ""  # a carry folder of its own (its command's device call carries that folder: lease.Planned)


def step_gpu_info(c: Check) -> dict[str, Any]:
    """The first card as NVML reports it (the owner of that boundary, tuner.machine.hardware: the same driver the
    ballast and the tuner ask; a rehearsal's NVML stand-in answers it here)."""
    probe = hardware.probe_gpus()
    cc = hardware.compute_capability()
    if not probe.gpus or cc is None:
        raise NoGpuError(f"{probe.reason or 'NVML reports no compute capability'}: the GPU check needs an NVIDIA GPU")
    g = probe.gpus[0]
    return {"gpu_name": g.name, "compute_cap": f"{cc[0]}.{cc[1]}", "cuda_arch": f"{cc[0]}{cc[1]}",
            "total_mib": g.total_bytes // 2**20, "free_mib": g.free_bytes // 2**20, "driver": g.driver_version}


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
    """The pinned engine with CUDA for this card's architecture only: restored from the carry when the last lease
    brought it back, else built (ninja resumes a build a time limit cut); the build's seconds go to the state."""
    if c.args.from_dir is None:
        loc = build.locate_engine()
        caps = build.capabilities(loc)
        if caps.backend != "cuda":
            raise UsageError(f"the engine at {loc.bin_dir} is a {caps.backend} build: pass --from PACK to build "
                             "one with CUDA, or set LLAMA_CPP_DIR to a CUDA build")
        return {"bin": str(loc.bin_dir), "commit": caps.commit, "backend": caps.backend, "built": False}
    from gpucheck import engine as gpu_engine
    from gpucheck import pack as gpu_pack

    arch = c.result("gpu-info")["cuda_arch"]
    bdir = c.out / "engine-build"
    restored = gpu_engine.restore(c.args.from_dir / "engine", bdir / "bin", gpu_engine.identity(arch))
    if restored is not None:
        if not restored.get("stand_in"):  # a rehearsal's CPU build needs no CUDA runtime beside it
            gpu_engine.link_runtime(bdir / "bin", gpu_engine.configure_argv(bdir, bdir, arch)[1])
            c.cuda_call("llama-server --list-devices of the restored CUDA build (its first run on the card)")
        how = {"restored": True, "built_in_lease_s": restored.get("build", {}).get("build_s"),
               **({"stand_in": restored["stand_in"]} if restored.get("stand_in") else {})}
    else:
        c.cuda_call("the CUDA build of llama.cpp: no engine carried (build it here first and pack it: "
                    "scripts/gpu_check --pack .gpu-pack --engine ARCH)")
        src = c.out / "engine-src"
        if not (src / "CMakeLists.txt").is_file():
            gpu_pack.extract_tree(c.args.from_dir / gpu_pack.TREE_NAME, src)
        times = c.state.setdefault("engine_build", {})
        with (c.out / "engine-build.log").open("a") as fh:
            def log(line: str) -> None:
                fh.write(line + "\n")

            try:
                gpu_engine.compile_engine(src, bdir, arch, timeout_s=c.left_s(), times=times, log=log)
            finally:
                c.state["machine"]["build"] = dict(times)  # measured, kept even when the time limit cut it
                c.save()
        how = {"restored": False, "build": dict(times)}
    loc = build.locate_engine(bdir / "bin")
    caps = build.capabilities(loc, use_cache=False)
    if not restored and c.args.copy_to is not None:  # bring it back for the next lease, beside the other steps
        meta = {**gpu_engine.identity(arch), "build": c.state.get("engine_build", {})}
        c.packing = threading.Thread(target=_pack_engine, args=(c, bdir / "bin", meta), daemon=True)
        c.packing.start()
    return {"bin": str(bdir / "bin"), "commit": caps.commit, "backend": caps.backend, "cuda_arch": arch,
            "fa_kernels": caps.fa_kernels.source, **how}


def step_ik_engine(c: Check) -> dict[str, Any]:
    """ik_llama.cpp's CUDA engine for this card, restored from the second command's carry (``--ik-from``, built here
    before the lease: its build would take most of a lease there, and it does not fit beside llama.cpp's in one
    64 MiB carry)."""
    from gpucheck import engine as gpu_engine

    arch = c.result("gpu-info")["cuda_arch"]
    bdir = c.out / "ik-engine"
    src = c.args.ik_from / gpu_engine.PACK_DIRS[IK_LLAMA.name] if c.args.ik_from else None
    restored = gpu_engine.restore(src, bdir / "bin", gpu_engine.identity(arch, IK_LLAMA)) if src else None
    if restored is None:
        c.cuda_call("ik_llama.cpp's CUDA build: none carried")
        raise UsageError(f"no ik_llama.cpp CUDA engine for arch {arch} was carried: build it before the lease "
                         f"(MOE_TUNE_CPU_ISA=avx2 MOE_TUNE_CUDA_ARCHS={arch} moe-tune engine install --engine ik "
                         f"--backend cuda), pack it (scripts/gpu_check --pack-ik {IK_CARRY} --engine {arch}) and carry "
                         f"{IK_CARRY} in this command")
    if not restored.get("stand_in"):
        gpu_engine.link_runtime(bdir / "bin", gpu_engine.configure_argv(bdir, bdir, arch, IK_LLAMA)[1])
        c.cuda_call("ik_llama.cpp's start-up on the card (the restored CUDA build's first run)")
    caps = build.capabilities(build.locate_engine(bdir / "bin", IK_LLAMA), use_cache=False)
    return {"bin": str(bdir / "bin"), "commit": caps.commit, "backend": caps.backend, "cuda_arch": arch,
            "restored": True, **({"stand_in": restored["stand_in"]} if restored.get("stand_in") else {})}


def _race_step(budget_gib: int) -> Callable[[Check], dict[str, Any]]:
    def run(c: Check) -> dict[str, Any]:
        from gpucheck import race as gpu_race

        return gpu_race.race(c, budget_gib, model_path(c, "direct"), c.args.rounds)
    return _on_model("direct", run)


def _pack_engine(c: Check, bin_dir: Path, meta: dict[str, Any]) -> None:
    from gpucheck import engine as gpu_engine

    try:
        c.state["engine_back"] = gpu_engine.pack(bin_dir, c.args.copy_to, meta)
    except (OSError, ValueError) as exc:
        c.state["engine_back"] = {"packed": False, "note": str(exc)[:300]}


# The model each step measures on: zero weights (a sparse hole, written in seconds) only where memory is the
# figure; every speed figure on valid weights drawn directly (`shape-model --weights direct`), whose router
# spreads a ubatch's tokens over the experts as a trained one does (results/benchmarks/valid-weights-writer.md).
MODEL_STEPS = {"zero": "model", "direct": "model-valid"}
WEIGHTS_LABEL = {"zero": "zero-filled weights (shape-true, sparse; the router ties: memory figures only)",
                 "direct": "valid weights drawn directly (routing spreads over the experts: speed figures)"}
TAG = {"zero": " [zero weights]", "direct": " [valid weights]"}


def _model_step(weights: str) -> Callable[[Check], dict[str, Any]]:
    def run(c: Check) -> dict[str, Any]:
        target = c.args.model
        path = paths.cache_root() / "models" / "gpu-check" / f"{target.replace(':', '-')}-{weights}.gguf"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            runner.run_process([sys.executable, "-m", "tuner.cli", "shape-model", target, "--out", str(path),
                                "--weights", weights], timeout_s=c.left_s(), what="moe-tune shape-model",
                               fix="check disk space (df -h)", cwd=REPO)
        return {"target": target, "path": str(path), "weights": weights, "weights_label": WEIGHTS_LABEL[weights],
                "logical_bytes": path.stat().st_size}
    return run


def model_path(c: Check, weights: str) -> Path:
    """The model file a step measures on: ``zero`` for memory checks, ``direct`` for speed."""
    return Path(c.result(MODEL_STEPS[weights])["path"])


def _on_model(weights: str, run: Callable[[Check], dict[str, Any]]) -> Callable[[Check], dict[str, Any]]:
    """``run``, its result saying which model it measured on (the table shows it per step; a later lease measures
    again every speed step whose result does not say valid weights)."""
    def go(c: Check) -> dict[str, Any]:
        return {**run(c), "model_weights": weights}
    return go


def step_memory(c: Check) -> dict[str, Any]:
    from gpucheck import memory as gpu_memory

    assert c.engine_dir is not None
    c.cuda_call("llama-fit-params of the CUDA build, then its llama-server loading the model")
    return gpu_memory.memory_check(c.engine_dir, model_path(c, "zero"), c.budget_mib, CHAT_CTX,
                                   c.out / "memory-logs")


def _search_step(budget_gib: int, kind: str) -> Callable[[Check], dict[str, Any]]:
    def run(c: Check) -> dict[str, Any]:
        from gpucheck import tune as gpu_tune

        assert c.engine_dir is not None
        c.cuda_call("the VRAM ballast (cudaMalloc) that leaves the budget free for auto-tune's search")
        ctx, prompt = (AGENT_CTX, AGENT_PROMPT) if kind == "agent" else (CHAT_CTX, None)
        return gpu_tune.search(c.engine_dir, model_path(c, "direct"), budget_gib * 1024, kind, ctx, prompt,
                               c.out / f"search-{budget_gib}g-{kind}", c.log, trials=c.args.trials)
    return _on_model("direct", run)


def _versus_step(budget_gib: int, kind: str) -> Callable[[Check], dict[str, Any]]:
    def run(c: Check) -> dict[str, Any]:
        from gpucheck import versus as gpu_versus

        assert c.engine_dir is not None
        c.cuda_call("the VRAM ballast (cudaMalloc) before llama.cpp's default loads")
        found = c.result(f"search-{budget_gib}g-{kind}")
        if not found.get("best"):
            return {"kind": kind, "budget_mib": budget_gib * 1024, "verdict": None,
                    "note": "the search's best line is llama.cpp's own (default or --fit): nothing to compare"}
        return gpu_versus.versus(c.engine_dir, config_from_dict(found["best"]), config_from_dict(found["default"]),
                                 budget_gib * 1024, kind, rounds=c.args.rounds,
                                 log_dir=c.out / f"versus-{budget_gib}g-{kind}", deadline_s=c.deadline_s(), log=c.log)
    return _on_model("direct", run)


def step_opoff(c: Check) -> dict[str, Any]:
    from gpucheck import opoff as gpu_opoff

    assert c.engine_dir is not None
    c.cuda_call("the VRAM ballast (cudaMalloc) before the op-offload lines load")
    return gpu_opoff.opoff_run(c.engine_dir, c.result(f"search-{FIRST_BUDGET_GIB}g-agent"), c.budget_mib,
                               c.out / "opoff-logs")


def _spill_step(tries: int, unified: bool = False) -> Callable[[Check], dict[str, Any]]:
    def run(c: Check) -> dict[str, Any]:
        from gpucheck import spill as gpu_spill

        if unified and not c.args.unified_spill:
            return {"runs": [], "note": "skipped: pass --unified-spill (managed memory asked beyond the free VRAM "
                                        "can hang a GPU; run it only on a machine you may reset)"}
        need_mib = int(_plan(c, CHAT_CTX)["rows"][0]["vram_bytes"] / 2**20)
        c.cuda_call("the VRAM ballast (cudaMalloc) that induces the spill")
        return gpu_spill.spill_run(model_path(c, "direct"), c.engine_dir, c.out / "spill-logs", need_mib,
                                   unified=unified, ctx=CHAT_CTX, tries=tries, short_mib=SPILL_SHORT_MIB)
    return _on_model("direct", run)


def _plan(c: Check, ctx: int, *more: str, fa: str = "on", slots: int = 1) -> dict[str, Any]:
    return c.cli("plan", str(c.model_path), "-c", str(ctx), "-np", str(slots), "-fa", fa, *more)


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
    """(budget GiB, workload, ctx) the CPU fallback plans: the lease's runs, then the later chat budgets."""
    runs = [(b, kind, AGENT_CTX if kind == "agent" else CHAT_CTX) for b, kind in VERSUS_RUNS]
    runs += [(b, "chat", CHAT_CTX) for b in c.args.budgets if (b, "chat") not in VERSUS_RUNS]
    if c.args.long_ctx:
        runs.append((LONG_BUDGET_GIB, "agent", c.args.long_ctx))
    return runs


def engine_est_s(c: Check) -> tuple[float, str]:
    """The engine step's estimate: a carried build restores in seconds; a build measured on such a machine
    before (the state that came back) takes what it took; otherwise the estimate."""
    carried = c.args.from_dir is not None and (c.args.from_dir / "engine" / "engine.json").is_file()
    if carried:
        return RESTORE_EST_S, "restore the engine carried in the pack (built here before the lease, or brought back)"
    if c.planning:  # the dry run plans the lease as it is to be run: its engine built here first and carried
        return RESTORE_EST_S, "restore the engine built here before the lease (the prerequisite above)"
    measured = (c.state.get("machine", {}).get("build") or {})
    if measured.get("finished") and measured.get("build_s"):
        return float(measured["build_s"]), f"CUDA build, measured {measured['build_s']:.0f} s on such a machine"
    ran = (c.state.get("engine_build") or {}).get("compile_s", 0.0)
    if ran and (c.out / "engine-build" / "build.ninja").is_file():  # cut by a time limit here: ninja goes on
        return max(30.0, ENGINE_EST_S - ran), f"the rest of the CUDA build ({ran:.0f} s compiled so far)"
    return ENGINE_EST_S, ("CUDA build of llama-server, llama-bench and llama-fit-params for this card's arch only "
                          "(nvidia-smi's compute capability), every K/V pair's FA kernel; 263 s on an H100 "
                          "machine's 16 cores, the command measures it again")


def steps_for(c: Check) -> list[Step]:
    from gpucheck import estimates as est
    from gpucheck import versus as gpu_versus

    if not c.has_gpu:
        return [Step("model", False, 3.0, _model_step("zero"), f"write {c.args.model} at real scale (zero weights)"),
                Step("plan-budgets", False, 10.0 * len(runs_wanted(c)), step_plan_budgets,
                     "memory model per budget (planned, not measured)"),
                Step("ballast", False, 1.0, step_ballast_cpu, "VRAM ballast (reports that no GPU is here)")]
    engine_s, engine_what = engine_est_s(c)
    g = FIRST_BUDGET_GIB
    steps = [Step("gpu-info", True, est.GPU_INFO_S, step_gpu_info, "card, compute capability, free VRAM (NVML)"),
             Step("wheels", True, est.WHEELS_S, step_wheels, "install the carried wheels (optuna, gguf)"),
             Step("engine", True, engine_s, step_engine, engine_what, resumable=True),
             Step("model-valid", True, est.MODEL_VALID_S, _model_step("direct"), f"write {c.args.model} at real "
                  "scale with valid weights drawn directly (every speed step below measures on it)")]
    pairs: dict[tuple[int, str], list[Step]] = {}
    for budget, kind in VERSUS_RUNS:
        ctx = AGENT_CTX if kind == "agent" else CHAT_CTX
        what = "chat requests (512 + 128 tokens)" if kind == "chat" else (
            f"agent sessions ({gpu_versus.TURNS} turns of {gpu_versus.TURN_TOKENS} new tokens and a "
            f"{gpu_versus.AGENT_GEN_TOKENS}-token reply)")
        pairs[(budget, kind)] = [
            Step(f"search-{budget}g-{kind}", True, est.SEARCH_S[kind], _search_step(budget, kind),
                 f"{budget} GiB free, {kind} -c {ctx}: auto-tune's search ({c.args.trials} trials, no finish)"
                 + TAG["direct"], "b"),
            Step(f"versus-{budget}g-{kind}", True,
                 est.versus_s(budget, kind, c.args.rounds, turns=gpu_versus.TURNS,
                              turn_tokens=gpu_versus.TURN_TOKENS, gen_tokens=gpu_versus.AGENT_GEN_TOKENS),
                 _versus_step(budget, kind), f"{budget} GiB free: its best line vs llama.cpp's default, both "
                 f"loaded, {c.args.rounds} interleaved rounds of {what}" + TAG["direct"], "b")]
    # (b) on agent turns answers the project's question: first. Then (e), the second engine on a card, which no lease
    # has measured; its engine comes in the second command's carry. Then the rest, as the lease leaves room.
    steps += [s for (b, kind), pair in pairs.items() if kind == "agent" for s in pair]
    steps += [Step("ik-engine", True, RESTORE_EST_S, step_ik_engine, f"restore ik_llama.cpp's CUDA engine carried in "
                   f"{IK_CARRY} (built here before the lease, portable for the CPU)", "e", carry=IK_CARRY)]
    steps += [Step(f"race-{b}g-agent", True,
                   est.race_s(b, c.args.rounds, turns=gpu_versus.TURNS, turn_tokens=gpu_versus.TURN_TOKENS,
                              gen_tokens=gpu_versus.AGENT_GEN_TOKENS),
                   _race_step(b), f"{b} GiB free, agent -c {AGENT_CTX}: ik_llama.cpp (every layer on the card, the "
                   "experts of the first layers in RAM, as many as the plan needs + 2) vs llama.cpp's default, both "
                   f"loaded, {c.args.rounds} interleaved rounds of agent sessions" + TAG["direct"], "e")
              for b in RACE_BUDGETS_GIB]
    steps += [Step("model", True, est.MODEL_ZERO_S, _model_step("zero"), f"write {c.args.model} at real scale, "
                   "zero weights (sparse): for the memory check only"),
              Step(f"memory-{g}g", True, est.MEMORY_S, _on_model("zero", step_memory), f"{g} GiB free: the model's "
                   f"pick at -c {CHAT_CTX}, projected (llama-fit-params) and loaded (llama-server at exit), CUDA0 and "
                   "host, per component" + TAG["zero"], "a"),
              Step("spill-oom", True, est.SPILL_S, _spill_step(1), f"a ballast leaves {SPILL_SHORT_MIB} MiB less "
                   "than every expert on the card needs: the OOM at load classified" + TAG["direct"], "c"),
              Step(f"opoff-{g}g-agent", True, est.OPOFF_S, _on_model("direct", step_opoff), f"{g} GiB free: the "
                   "agent search's best line and the default with op offload on and off" + TAG["direct"], "d")]
    steps += [s for (b, kind), pair in pairs.items() if kind != "agent" for s in pair]
    steps += [Step("spill-oom-more", True, 2 * est.SPILL_S, _spill_step(2), "the OOM spill twice more: every time?"
                   + TAG["direct"], "c")]
    steps.append(Step("spill-unified", True, 240.0 if c.args.unified_spill else 1,
                      _spill_step(1, unified=True), "GGML_CUDA_ENABLE_UNIFIED_MEMORY=1: spill and the tok/s collapse "
                      "(opt-in: --unified-spill)" + TAG["direct"], "c"))
    return steps
