"""llama-bench's rows as typed values: parsed from llama.cpp's jsonl or ik_llama.cpp's json, each figure with its
spread; and, for ik_llama.cpp's llama-bench (which has no ``-d``), a prompt's speed at a depth taken from two
prompts timed from an empty cache."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tuner.core.stats import cv_pct
from tuner.machine.pressure import HostPressure

RSE_TARGET_PCT = 3.0


@dataclass(frozen=True, slots=True)
class Spread:
    n: int
    median: float
    mean: float
    cv_pct: float  # sample standard deviation / mean
    rse_pct: float  # standard error of the mean / mean: how well the mean is known


def spread(samples: Sequence[float]) -> Spread:
    if not samples:
        raise ValueError("no samples")
    mean = statistics.fmean(samples)
    cv = cv_pct(samples) or 0.0
    rse = cv / math.sqrt(len(samples)) if len(samples) > 1 else math.inf
    return Spread(len(samples), statistics.median(samples), mean, cv, rse)


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
    # The settings llama-bench reports it ran with (type_k, flash_attn, n_threads, …), as text.
    params: tuple[tuple[str, str], ...] = ()
    # The GPU devices llama-bench's backend registry held (``get_gpu_info``); empty when it ran on the CPU alone.
    gpu_info: str = ""
    # Host memory over this test's timed generation runs (:mod:`tuner.measure.phases`), and how many runs that
    # covers; None: not read.
    host: HostPressure | None = None
    host_runs: int = 0

    @property
    def kind(self) -> str:
        return "pp" if self.n_gen == 0 else "tg"

    @property
    def spread(self) -> Spread:
        return spread(self.samples_tok_s or (self.avg_tok_s,))

    def to_dict(self) -> dict[str, Any]:
        s = self.spread
        return {"kind": self.kind, "n_prompt": self.n_prompt, "n_gen": self.n_gen, "n_depth": self.n_depth,
                "avg_tok_s": self.avg_tok_s, "stddev_tok_s": self.stddev_tok_s, "median_tok_s": s.median,
                "cv_pct": s.cv_pct, "rse_pct": s.rse_pct, "samples_tok_s": list(self.samples_tok_s),
                "build_commit": self.build_commit}


_PARAM_KEYS = ("type_k", "type_v", "flash_attn", "n_threads", "n_batch", "n_ubatch", "n_gpu_layers", "n_cpu_moe")


# ik_llama.cpp's label of a generation test after a prompt (``-gp``): "tg32@pp4096" (examples/llama-bench).
_GP_LABEL = re.compile(r"^tg(\d+)@pp(\d+)$")


def _param(value: Any) -> str:
    """A row's setting as text, as llama.cpp's jsonl writes it (ik's json writes booleans as true/false)."""
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def _row(raw: dict[str, Any]) -> BenchRow:
    n_prompt, n_gen, n_depth = int(raw["n_prompt"]), int(raw["n_gen"]), int(raw.get("n_depth", 0))
    gp = _GP_LABEL.match(str(raw.get("test", "")))
    if gp:  # ik: N generated after a prompt of D tokens is generation at depth D
        n_prompt, n_depth = 0, int(gp.group(2))
    return BenchRow(
        n_prompt=n_prompt, n_gen=n_gen, n_depth=n_depth, avg_tok_s=float(raw["avg_ts"]),
        stddev_tok_s=float(raw.get("stddev_ts", 0.0)),
        samples_tok_s=tuple(float(x) for x in raw.get("samples_ts", [])),
        build_commit=str(raw.get("build_commit", "")),
        params=tuple((k, _param(raw[k])) for k in _PARAM_KEYS if k in raw),
        gpu_info=str(raw.get("gpu_info", "")).strip())


def parse_rows(text: str) -> tuple[BenchRow, ...]:
    """Every test object in llama-bench's output: llama.cpp's jsonl (one per line) or ik's json (an array printed
    as each test ends, so a sweep cut short still gives the tests it finished)."""
    decoder = json.JSONDecoder()
    rows: list[BenchRow] = []
    i = text.find("{")
    while i != -1:
        try:
            raw, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        if isinstance(raw, dict) and "avg_ts" in raw and "n_prompt" in raw:
            rows.append(_row(raw))
        i = text.find("{", end)
    return tuple(rows)


parse_jsonl = parse_rows  # the name scripts and tests know it by


def prompt_at_depth(rows: Sequence[BenchRow], n_prompt: int, depths: Sequence[int]) -> tuple[BenchRow, ...]:
    """``rows`` with ik's prompt tests turned into prompts at depth: a prompt of N tokens at depth D takes the time
    of a D + N token prompt less that of a D token one (both from an empty cache, the same ubatches up to D), so its
    speed is N / (t(D+N) - t(D)), per repetition. Generation rows pass through; the D-token helpers are dropped."""
    wanted = {d for d in depths if d > 0}
    if not wanted:
        return tuple(r for r in rows if r.kind == "tg" or r.n_prompt == n_prompt)
    out: list[BenchRow] = []
    pp = [r for r in rows if r.kind == "pp"]
    for r in rows:
        if r.kind == "tg" or r.n_prompt == n_prompt and 0 in depths and r.n_depth == 0 and not any(
                o.kind == "pp" and o.n_depth == 0 and o.params == r.params for o in out):
            out.append(r)
    for d in sorted(wanted):
        for short in (r for r in pp if r.n_prompt == d):
            long = next((r for r in pp if r.n_prompt == d + n_prompt and r.params == short.params), None)
            if long is None:
                continue
            pairs = list(zip(short.samples_tok_s or (short.avg_tok_s,), long.samples_tok_s or (long.avg_tok_s,),
                             strict=False))
            samples = tuple(n_prompt / ((d + n_prompt) / b - d / a) for a, b in pairs
                            if (d + n_prompt) / b - d / a > 0)
            if not samples:
                continue
            mean = statistics.fmean(samples)
            out.append(BenchRow(n_prompt, 0, d, mean, statistics.stdev(samples) if len(samples) > 1 else 0.0,
                                samples, long.build_commit, long.params, long.gpu_info, long.host, long.host_runs))
    return tuple(out)
