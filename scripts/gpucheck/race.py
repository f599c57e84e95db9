"""(e) of `scripts/gpu_check`: ik_llama.cpp against llama.cpp on the card, with experts in RAM, the way users compare
them (r/LocalLLaMA side-by-sides, DESIGN §16: ik +46 % prompt with every expert on the CPU, llama.cpp +31 % at
``--n-cpu-moe 24``; the winner depends on model and rig).

At one budget of free VRAM, two lines a user would launch, both loaded at once and measured in interleaved rounds of
agent sessions by :func:`gpucheck.versus.versus` (its verdict, 99 %):

- llama.cpp's default (``-c``, one slot): its ``--fit`` places the experts within the VRAM it finds free;
- ik_llama.cpp with every layer on the card (``-ngl 999``; its default is none) and the experts of the first layers in
  RAM (``--n-cpu-moe N``), N the fewest that fit the budget by the memory model (``moe-tune plan``), plus
  ``IK_MARGIN_LAYERS`` (ik's buffers are not llama.cpp's), and its own defaults otherwise (fused MoE on).

Both engines are the lease's CUDA builds, built portable for the CPU (``MOE_TUNE_CPU_ISA=avx2``): the CPU-side expert
work is AVX2 code in both, like for like.
"""

from __future__ import annotations

from typing import Any

from gpucheck.context import Check
from tuner.core.config import FlashAttn, LaunchConfig
from tuner.engine.kinds import IK_LLAMA
from tuner.search.space import ALL_LAYERS

CTX = 32768  # the agent runs' context (steps.AGENT_CTX)
IK_MARGIN_LAYERS = 2  # layers of experts more in RAM than llama.cpp's projection needs: ik's buffers differ
PLAN_S = 10.0  # the plan that sizes ik's line: llama-fit-params' projections on the card (lease 2: ~10 s a plan)


def ik_line(c: Check, model: Any, budget_gib: int) -> tuple[LaunchConfig | None, dict[str, Any]]:
    """ik_llama.cpp's line at ``budget_gib`` free: the fewest host experts the plan fits, plus the margin; None where
    even every expert in RAM does not fit."""
    plan = c.cli("plan", str(model), "-c", str(CTX), "-np", "1", "-fa", "on", "--vram-budget", str(budget_gib * 1024))
    fits = [r for r in plan["rows"] if r["verdict"] == "fits"]
    if not fits:
        return None, {"note": f"nothing fits {budget_gib} GiB at -c {CTX}, not even every expert in RAM"}
    n_layer = len(plan["rows"]) - 1
    n = min(n_layer, fits[0]["n_cpu_moe"] + IK_MARGIN_LAYERS)
    line = LaunchConfig(model=model, ctx=CTX, parallel=1, flash_attn=FlashAttn.ON, n_gpu_layers=ALL_LAYERS,
                        n_cpu_moe=n, engine=IK_LLAMA.name)
    return line, {"planned_n_cpu_moe": fits[0]["n_cpu_moe"], "n_cpu_moe": n}


def race(c: Check, budget_gib: int, model: Any, rounds: int) -> dict[str, Any]:
    """Both lines loaded at ``budget_gib`` free, ``rounds`` interleaved agent rounds: ik's ("tuned" in the verdict's
    words) against llama.cpp's default."""
    from gpucheck import versus as gpu_versus

    ik_bin = c.result("ik-engine").get("bin")
    assert c.engine_dir is not None and ik_bin
    ik, sized = ik_line(c, model, budget_gib)
    if ik is None:
        return {"kind": "agent", "budget_mib": budget_gib * 1024, "verdict": None, **sized}
    c.cuda_call("the VRAM ballast (cudaMalloc) that leaves the budget free before llama.cpp's default loads")
    default = LaunchConfig(model=model, ctx=CTX, parallel=1)
    res = gpu_versus.versus(c.engine_dir, ik, default, budget_gib * 1024, "agent", rounds=rounds,
                            log_dir=c.out / f"race-{budget_gib}g-agent", deadline_s=c.deadline_s(), log=c.log,
                            engines={"tuned": ik_bin})
    return {**res, "engines": {"tuned": IK_LLAMA.name, "default": "llama.cpp"}, "sizing": sized}


def rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, step in state.get("steps", {}).items():
        res = step.get("result") or {}
        if not name.startswith("race-"):
            continue
        v, arms, scores = res.get("verdict") or {}, res.get("arms") or {}, res.get("scores") or {}
        out.append({"run": name, "budget_mib": res.get("budget_mib"), "rounds": v.get("rounds"),
                    "ratio": v.get("ratio"), "low": v.get("low"), "high": v.get("high"), "outcome": v.get("outcome"),
                    "ik_score": gpu_median(scores.get("tuned", [])),
                    "llama_score": gpu_median(scores.get("default", [])),
                    "ik": (arms.get("tuned") or {}).get("launch_line"),
                    "llama": (arms.get("default") or {}).get("launch_line"), "note": res.get("note")})
    return out


def gpu_median(values: list[float | None]) -> float | None:
    from gpucheck import versus as gpu_versus

    return gpu_versus._median(values)


def markdown(state: dict[str, Any]) -> list[str]:
    found = rows(state)
    if not found:
        return []

    def per(x: float | None) -> str:
        return "-" if not x else f"{1 / x:.2f}"

    lines = ["## (e) ik_llama.cpp vs llama.cpp's default on the card, experts in RAM (valid weights)", "",
             "Seconds per agent session, medians; ik/llama.cpp is the ratio of sessions per second (above 1: ik "
             "faster); the verdict is the project's own (99 %).", "",
             "| run | rounds | ik s | llama.cpp s | ik/llama.cpp | 99 % interval | verdict |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in found:
        interval = f"{r['low']:.2f}-{r['high']:.2f}x" if r["rounds"] and r["rounds"] > 1 else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        lines.append(f"| {r['run']} | {r['rounds'] or 0} | {per(r['ik_score'])} | {per(r['llama_score'])} | {ratio} | "
                     f"{interval} | {r['outcome'] or r['note'] or '-'} |")
    lines += ["", "Lines:", ""]
    for r in found:
        lines += [f"- {r['run']} ik_llama.cpp: `{r['ik']}`", f"- {r['run']} llama.cpp default: `{r['llama']}`"]
    return lines + [""]
