"""(d) of `scripts/gpu_check`: does op offload matter on an agent turn with experts in host RAM?

With a CUDA device, llama.cpp runs every op on a host-resident weight whose batch reaches
``GGML_OP_OFFLOAD_MIN_BATCH`` tokens (default 32; read once per device in ``ggml-cuda.cu``,
``ggml_backend_cuda_reg_get_device``, compared in ``ggml_backend_cuda_device_offload_op``) on the GPU, copying the
host experts over PCIe for each ubatch. ``--no-op-offload`` (common/arg.cpp) turns it off for the whole context:
the flag auto-tune searches and prints, and what this step measures.

The lines are the agent search's best line and llama.cpp's default (lease 2: the tuned line and ``--fit``), each
loaded once with op offload as llama.cpp ships it and once with it off, interleaved, at the same free VRAM. Each
load serves an agent turn (a tool result of ``TURN_TOKENS`` new tokens) and a long prompt (``LONG_TOKENS``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tuner.core.errors import TrialFailedError
from tuner.engine import build, runner
from tuner.machine import ballast
from tuner.measure import bench, workload
from tuner.search.trials import config_from_dict

TURN_TOKENS = 512
LONG_TOKENS = 4096
GEN_TOKENS = 32


def arms_of(search_result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, config dict) of the search's best line and llama.cpp's default in a search step's result (or, from
    lease 2's state, a whole tune's winner and its --fit baseline)."""
    if "best" in search_result or "default" in search_result:
        arms = [(label, search_result[key]) for label, key in (("tuned", "best"), ("default", "default"))
                if search_result.get(key)]
    else:
        tune = search_result.get("tune") or {}
        winner = tune.get("winner") or {}
        fit = next((b for b in (tune.get("finish") or {}).get("baselines", []) if b.get("label") == "fit"), None)
        arms = [("tuned", winner["config"])] if winner.get("config") else []
        if fit is not None and fit.get("config") and fit.get("launch_line") != winner.get("launch_line"):
            arms.append(("fit", fit["config"]))
    if not arms:
        raise ValueError("the agent search step measured no line to compare")
    return arms


def _one(loc: build.EngineLocation, cfg: Any, log_dir: Path, off: bool) -> dict[str, Any]:
    turn = workload.preset(workload.WorkloadKind.CUSTOM, TURN_TOKENS, GEN_TOKENS, rounds=2)
    long = workload.preset(workload.WorkloadKind.CUSTOM, LONG_TOKENS, GEN_TOKENS, rounds=1)
    seen: dict[str, Any] = {}

    def turn_first(server: runner.ServerProcess) -> None:
        seen["turn"] = workload.run_workload(server, turn, 1)[0]

    try:
        trial = bench.run_server_trial(loc, replace(cfg, op_offload=not off), long, log_dir=log_dir,
                                       on_ready=turn_first)
    except TrialFailedError as exc:
        return {"failed": f"{exc.failure.kind.value}: {exc.failure.reason}"[:300]}
    lvl = trial.levels[0]
    t = seen["turn"]
    return {"turn_prompt_tok_s": t.per_request_prompt_tok_s, "turn_ttft_s": t.ttft_s,
            "turn_gen_tok_s": t.per_request_gen_tok_s, "long_prompt_tok_s": lvl.per_request_prompt_tok_s,
            "long_ttft_s": lvl.ttft_s, "gen_tok_s": lvl.per_request_gen_tok_s,
            "vram_peak_bytes": trial.memory.vram_peak_bytes, "spill": trial.spill.kind.value}


def opoff_run(engine_dir: Path, tune_result: dict[str, Any], budget_mib: int, log_dir: Path) -> dict[str, Any]:
    """Each line with op offload on (llama.cpp's default) and off, interleaved, all but ``budget_mib`` held."""
    loc = build.locate_engine(engine_dir)
    rows = []
    with ballast.hold_vram(budget_mib, runner) as b:
        for label, cdict in arms_of(tune_result):
            cfg = config_from_dict(cdict)
            for off in (False, True):
                row = {"line": label, "op_offload": "off" if off else "on (min batch 32)", "no_host": cfg.no_host,
                       "n_cpu_moe": cfg.n_cpu_moe, "ubatch": cfg.ubatch, **_one(loc, cfg, log_dir, off)}
                rows.append(row)
    for label in {r["line"] for r in rows}:
        on, off = (next((r for r in rows if r["line"] == label and r["op_offload"].startswith(s)), {})
                   for s in ("on", "off"))
        for key in ("turn_prompt_tok_s", "long_prompt_tok_s", "gen_tok_s"):
            if on.get(key) and off.get(key):
                off[f"{key}_off_vs_on"] = off[key] / on[key]
    return {"free_mib": b.free_mib, "ballast_mib": b.held_mib, "off_flag": "--no-op-offload",
            "turn_tokens": TURN_TOKENS, "long_tokens": LONG_TOKENS, "rows": rows}
