"""One config measured end to end, as a library call: llama-bench at depth (with its spread), then a llama-server
workload at concurrency 1..slots (TTFT, per-request and aggregate tok/s, memory peaks, spill verdict), with the
roofline beside it and, for a speculative config, the acceptance llama-server reported.

``moe-tune bench`` is this function plus a table; :meth:`BenchReport.to_dict` is its ``--json`` schema.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import build, flags
from tuner.engine.build import EngineLocation
from tuner.engine.identity import EngineIdentity
from tuner.machine import hardware, paths
from tuner.measure import engine_memory, gpu_use, session_run, speculation
from tuner.measure.bench import BenchResult, ServerTrial, run_bench, run_server_trial
from tuner.measure.session_run import SessionTrial
from tuner.measure.workload import Workload, WorkloadKind
from tuner.models.gguf_reader import inspect_model
from tuner.plan import roofline
from tuner.plan.placement import placed_by_fit


@dataclass(frozen=True, slots=True)
class BenchReport:
    config: LaunchConfig
    bench: BenchResult
    server: ServerTrial | None
    roofline: roofline.Roofline
    acceptance: speculation.LogAcceptance | None = None
    session: SessionTrial | None = None  # the agent workload: a multi-turn session replayed
    finding: session_run.Finding | None = None  # its full re-processes, and the setting that avoids them
    engine: EngineIdentity | None = None  # the build that ran it (its own --version)

    def percent_of_roofline(self, gen_tok_s: float) -> float | None:
        ceiling = self.roofline.gen_tok_s
        return 100.0 * gen_tok_s / ceiling if ceiling else None

    def to_dict(self) -> dict[str, Any]:
        result, trial, roof = self.bench, self.server, self.roofline
        report: dict[str, Any] = {
            "model": str(self.config.model), "engine": self.engine.to_dict() if self.engine else None,
            "argv": list(result.argv), "elapsed_s": result.elapsed_s,
            "launch_line": flags.launch_line(self.config), "runs": result.runs,
            "rows": [r.to_dict() for r in result.rows], "host_paging": result.host_paging.to_dict(),
            "roofline": {"gen_tok_s": roof.gen_tok_s or None, "prompt_tok_s": roof.prompt_tok_s,
                         "gpu_bytes_per_token": roof.gpu_bytes_per_token,
                         "host_bytes_per_token": roof.host_bytes_per_token},
        }
        for row in report["rows"]:
            if row["n_gen"]:
                row["percent_of_roofline"] = self.percent_of_roofline(row["median_tok_s"])
        if trial is not None:
            mem = trial.memory
            report["server"] = {
                "argv": list(trial.argv), "workload": trial.workload.kind.value,
                "prompt_tokens": trial.workload.prompt_tokens, "gen_tokens": trial.workload.gen_tokens,
                "levels": [lvl.to_dict() for lvl in trial.levels],
                "memory": {"rss_peak_bytes": mem.rss_peak_bytes, "vram_peak_bytes": mem.vram_peak_bytes,
                           "vram_total_bytes": mem.vram_total_bytes, "proc_vram_peak_bytes": mem.proc_vram_peak_bytes,
                           "swap_growth_bytes": mem.swap_growth_bytes, "energy_j": mem.energy_j,
                           "samples": mem.n_samples},
                "tokens_per_joule": trial.tokens_per_joule, "roofline_tok_s": trial.roofline_tok_s,
                "spill": {"verdict": trial.spill.kind.value, "evidence": trial.spill.evidence},
                "host_paging": trial.host_paging.to_dict(),
                "llama_cpp_memory_mib": None if trial.memory_breakdown is None else [
                    {"buffer": r.name, "model": r.model_mib, "context": r.context_mib, "compute": r.compute_mib}
                    for r in trial.memory_breakdown.rows
                ],
                "log": str(trial.log_path),
            }
            if self.acceptance is not None:
                a = self.acceptance
                report["server"]["speculation"] = {"drafted_n": a.drafted_n, "accepted_n": a.accepted_n,
                                                   "acceptance_rate": a.rate, "mean_len": a.mean_len}
        if self.session is not None:
            report["session"] = {"argv": list(self.session.argv), **self.session.result.to_dict(),
                                 "log": str(self.session.log_path),
                                 "host_paging": self.session.host_paging.to_dict(),
                                 "finding": None if self.finding is None else {
                                     "turns": list(self.finding.turns), "cause": self.finding.cause,
                                     "fix": self.finding.fix_text, "text": self.finding.describe()}}
        return report


def bench_config(loc: EngineLocation, cfg: LaunchConfig, load: Workload, *, depth: int = 0,
                 repetitions: int | None = None, server: bool = True, vram_budget_mib: float | None = None,
                 log_dir: Path | None = None, on_step: Callable[[str], None] | None = None,
                 session: session_run.SessionSource | Sequence[session_run.SessionSource] | None = None,
                 session_gen_tokens: int = 64) -> BenchReport:
    """Measure ``cfg`` for ``load``: llama-bench (without speculation, which it cannot run), then llama-server:
    the request workload at concurrency 1..slots, or for the agent workload the ``session`` replayed (several:
    at once, one client each)."""
    say = on_step or (lambda _msg: None)
    flags.validate(cfg)
    if vram_budget_mib is not None and cfg.device == gpu_use.CPU_DEVICE:
        raise UsageError("--vram-budget plans the card and --device none leaves it out: drop one of them")
    probed = hardware.probe_hardware(host_bandwidth_s=0)
    gpu_use.preflight(loc, probed, cfg.device)  # a GPU rig measured on the CPU stops here
    caps = build.capabilities(loc)
    say(f"llama-bench on {cfg.model.name} (pp{load.prompt_tokens}, tg{load.gen_tokens}, depth {depth})")
    result = run_bench(loc, speculation.without_speculation(cfg), n_prompt=load.prompt_tokens,
                       n_gen=load.gen_tokens, repetitions=repetitions, depth=depth, caps=caps)
    say("measuring host memory bandwidth for the roofline")
    hw = hardware.with_vram_budget(hardware.probe_hardware(host_bandwidth_s=1.0), vram_budget_mib)
    if cfg.device == gpu_use.CPU_DEVICE:
        hw = hw.cpu_only()
    info = inspect_model(cfg.model)
    # A line that leaves placement to --fit, placed as the engine's own projection says fit would place it.
    price = engine_memory.in_force() or engine_memory.EngineMemory(loc, caps.identity)
    roof = roofline.roofline(info, placed_by_fit(info, cfg, hw, price, engine=caps.kind), hw, depth_tokens=depth)
    trial = None
    if server and load.kind is WorkloadKind.AGENT and session is not None:
        many = len(session) if isinstance(session, (list, tuple)) else 1
        say(f"llama-server: {f'{many} agent sessions at once' if many > 1 else 'an agent session'}, turn by turn "
            f"({session_gen_tokens} tokens generated per turn)")
        ses = session_run.run_session_trial(loc, cfg, session, session_gen_tokens,
                                            log_dir=log_dir or paths.cache_root() / "logs", caps=caps)
        found = session_run.diagnose(ses.result, inspect_model(cfg.model), cfg)
        return BenchReport(cfg, result, None, roof, None, ses, found, caps.identity)
    if server:
        say(f"llama-server {load.kind.value} workload at concurrency 1..{cfg.parallel or 1}")
        trial = run_server_trial(loc, cfg, load, log_dir=log_dir or paths.cache_root() / "logs", caps=caps,
                                 roofline_tok_s=roof.gen_tok_s or None, vram_budget_bytes=hw.vram_budget_bytes or None)
    accepted = speculation.acceptance_from_log(trial.log_path.read_text(errors="replace")) if trial else None
    return BenchReport(cfg, result, trial, roof, accepted, engine=caps.identity)
