"""Speed measurement with llama-bench: one config in, prompt and generation tok/s with spread out."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tuner import flags, runner
from tuner.config import LaunchConfig
from tuner.engine import EngineLocation
from tuner.errors import ProcessFailedError


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One llama-bench test: either prompt processing (n_gen == 0) or generation (n_prompt == 0)."""

    n_prompt: int
    n_gen: int
    n_depth: int
    avg_tok_s: float
    stddev_tok_s: float
    samples_tok_s: tuple[float, ...]
    build_commit: str

    @property
    def kind(self) -> str:
        return "pp" if self.n_gen == 0 else "tg"


@dataclass(frozen=True, slots=True)
class BenchResult:
    argv: tuple[str, ...]
    rows: tuple[BenchRow, ...]
    elapsed_s: float

    def row(self, kind: str) -> BenchRow:
        for row in self.rows:
            if row.kind == kind:
                return row
        raise KeyError(kind)

    @property
    def prompt_tok_s(self) -> float:
        return self.row("pp").avg_tok_s

    @property
    def gen_tok_s(self) -> float:
        return self.row("tg").avg_tok_s


def parse_jsonl(text: str) -> tuple[BenchRow, ...]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        raw = json.loads(line)
        rows.append(
            BenchRow(
                n_prompt=int(raw["n_prompt"]),
                n_gen=int(raw["n_gen"]),
                n_depth=int(raw.get("n_depth", 0)),
                avg_tok_s=float(raw["avg_ts"]),
                stddev_tok_s=float(raw.get("stddev_ts", 0.0)),
                samples_tok_s=tuple(float(x) for x in raw.get("samples_ts", [])),
                build_commit=str(raw.get("build_commit", "")),
            )
        )
    return tuple(rows)


def run_bench(
    engine: EngineLocation,
    cfg: LaunchConfig,
    *,
    n_prompt: int = 512,
    n_gen: int = 128,
    repetitions: int = 3,
    depth: int = 0,
    timeout_s: float = 1800.0,
) -> BenchResult:
    argv = flags.bench_argv(
        engine.tool("llama-bench"), cfg, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions, depth=depth
    )
    result = runner.run_process(
        argv, timeout_s=timeout_s, what="llama-bench", fix="check the model file and flags (rerun with -v for detail)"
    )
    rows = parse_jsonl(result.stdout)
    expected = (n_prompt > 0) + (n_gen > 0)
    if len(rows) < expected:
        # llama-bench can stop part-way through a sweep and still exit 0.
        raise ProcessFailedError(
            "llama-bench", argv, result.returncode, result.stderr_tail,
            f"it reported {len(rows)} of {expected} tests; check the flags",
        )
    return BenchResult(tuple(argv), rows, result.elapsed_s)
