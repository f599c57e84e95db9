"""A two-engine run's results, written in milliseconds by the race's own record (tuner.versus.engines.record over real
EngineTune, EngineLine, HeadToHead and EngineChoice values, so the format cannot drift from what auto-tune writes): each
engine's study folder with its search's measured configs, and the race in both. The rounds' scores are what a race
would have measured; the verdicts and standings are the real code's over them. What the handovers (launch-line, serve,
share, the MCP tools) are tested on where no engine runs; tests/versus/test_engines.py runs the real thing.

The engines' folders name a server that is a stand-in (a script that exits 1, never run here): a handover names a
binary, it does not start one, except serve, whose tests run the real engines."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.engine.build import EngineLocation
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP
from tuner.quality.engine_price import LinePrice
from tuner.search import autotune, study
from tuner.search.finish import Finish
from tuner.search.result import StudyResult, load_result
from tuner.search.trials import TrialRecord, config_to_dict
from tuner.versus import engines, judge
from tuner.versus.standing import Gates

REFERENCE, LLAMA_TUNED = "llama.cpp default", "llama.cpp tuned"
IK_DEFAULT, IK_TUNED = "ik_llama.cpp default", "ik_llama.cpp tuned"
# Per-round scores (higher is faster): steady; clearly faster; faster still; a wide spread around 1.5.
STEADY = (1.00, 1.02, 0.99, 1.01)
FAST = (1.70, 1.75, 1.68, 1.73)
FASTER = (2.10, 2.16, 2.05, 2.12)
WIDE = (1.20, 2.00, 1.10, 1.90)


@dataclass(frozen=True, slots=True)
class Run:
    folders: dict[str, Path]  # engine → its study folder (result.json inside)
    model: Path

    @property
    def chosen(self) -> Path:
        return next(p for p in self.folders.values() if (load_result(p).engines or {}).get("chosen"))

    @property
    def other(self) -> Path:
        return next(p for p in self.folders.values() if p != self.chosen)


def configs(model: Path) -> dict[str, LaunchConfig]:
    base = LaunchConfig(model=model, ctx=4096, parallel=1)
    return {REFERENCE: base, LLAMA_TUNED: replace(base, threads=2, flash_attn=FlashAttn.OFF),
            IK_DEFAULT: replace(base, engine=IK_LLAMA.name),
            IK_TUNED: replace(base, engine=IK_LLAMA.name, run_time_repack=True, cache_type_v=CacheType.Q8_0,
                              flash_attn=FlashAttn.ON)}


def _stand_in_server(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    server = folder / "llama-server"
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(0o755)
    return folder


def _searched(number: int, cfg: LaunchConfig, request_s: float) -> TrialRecord:
    return TrialRecord(number, "measured", config_to_dict(cfg), gen_tok_s=100 / request_s, prompt_tok_s=400 / request_s,
                       request_s=request_s, repetitions=2)


def write_run(tmp: Path, scores: dict[str, tuple[float | None, ...]], *, refused: tuple[str, ...] = (),
              paged: tuple[str, ...] = ()) -> Run:
    """Both engines' folders under ``tmp/results`` after a race with ``scores`` (label → per-round scores; a label left
    out did not race); ``refused``: lines whose price refused them (a KLD of 18 nats, as ik's MoE on a llama-
    architecture model read); ``paged``: lines that read their model back from disk in every round."""
    model = tmp / "models" / "demo-Q4_K_M.gguf"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(b"GGUF" + bytes(4092))
    cfg = configs(model)
    out = tmp / "results"
    tunes = []
    for kind, default, tuned, extra in ((LLAMA_CPP, REFERENCE, LLAMA_TUNED, replace(cfg[LLAMA_TUNED], ubatch=256)),
                                        (IK_LLAMA, IK_DEFAULT, IK_TUNED, replace(cfg[IK_TUNED], ubatch=128))):
        name = f"demo-Q4_K_M__{kind.name}__chat"
        trials = (_searched(0, cfg[default], 0.50), _searched(1, cfg[tuned], 0.30), _searched(2, extra, 0.35),
                  _searched(3, replace(extra, threads=1), 0.40))
        res = StudyResult(study=name, model=str(model), finish=Finish((), ()), trials=trials,
                          hardware={"has_gpu": False, "describe": "a test machine (CPU)", "physical_cores": 2,
                                    "ram_total_bytes": 8 * 2**30},
                          engine={"engine": kind.name, "commit": "0c1e57098", "version": "1", "backend": "cpu",
                                  "bin_dir": str(tmp / f"bin-{kind.name}")},
                          workload={"kind": "chat", "prompt_tokens": 48, "gen_tokens": 16, "depth_tokens": 48,
                                    "concurrency": 1})
        tr = autotune.TuneResult(name, f"sqlite:///{out}/{name}.db", out / name, res,
                                 study.SearchOutcome(name, len(trials), False, 1.0), candidates=(cfg[tuned],),
                                 default=cfg[default])
        tunes.append(engines.EngineTune(kind, EngineLocation(_stand_in_server(tmp / f"bin-{kind.name}"), "managed"),
                                        tr))
    price = LinePrice("ik_llama.cpp", "llama.cpp 0c1e57098", 18.26, 0.4, 12.0, 9.1e3, 18.8, 512, 4)
    lines = [replace(x, price=price.to_dict()) if x.label in refused else x for x in engines.lines_of(tunes)]
    versus = judge.HeadToHead(tuple(
        judge.Arm(label, "", tuple(judge.Round(s, host_paging="read 900 MiB back from disk" if label in paged else None,
                                               number=i + 1) for i, s in enumerate(xs)),
                  None if any(s is not None for s in xs) else "it crashed")
        for label, xs in scores.items()), "end-to-end request time (P=48, G=16)")
    gates = Gates(refused={x: "was refused by its price (mean KLD 18.26 against llama.cpp's f16 logits, above "
                              "--max-kld 0.01)" for x in refused})
    printed, reason, against = engines.choose(lines, versus, gates)
    notes = tuple(f"{x}: {why}" for x, why in gates.refused.items())
    choice = engines.EngineChoice(tuple(lines), versus, printed, reason, notes, against, gates)
    for t in tunes:
        assert t.result is not None
        t.result.result_dir.mkdir(parents=True, exist_ok=True)
    engines.record(tunes, choice)
    return Run({t.kind.name: t.result.result_dir for t in tunes if t.result is not None}, model)
