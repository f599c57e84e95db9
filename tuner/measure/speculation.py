"""Speculative decoding measured on llama-server, the only llama.cpp tool that has it (llama-bench at the pinned
commit has no draft model and no ``--spec-*`` option).

An *arm* is one launch config (``none`` or one speculation setting). Arms are measured one after another, in
alternating order over rounds, on the same prompts: the workload's own (windows of the bundled corpus, or a
user's ``--prompts FILE`` of real requests, since acceptance depends on the text). Each request yields its
end-to-end time as the client saw it and llama-server's draft counts (``timings.draft_n`` and
``timings.draft_n_accepted``), so every arm is reported with the acceptance it achieved.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import TunerError, UsageError
from tuner.core.stats import cv_pct
from tuner.engine import flags, runner
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine import quiet
from tuner.measure import failures, workload
from tuner.measure.workload import Workload
from tuner.models.gguf_reader import ModelInfo

# llama-server's own check (common/speculative.cpp): vocab sizes may differ by at most this many tokens.
VOCAB_SIZE_SLACK = 128
PROMPT_SEPARATOR = "\n---\n"


def without_speculation(cfg: LaunchConfig) -> LaunchConfig:
    """``cfg`` with every speculation setting at the engine default (what llama-bench can measure)."""
    return replace(cfg, spec_types=(), draft_model=None, spec_draft_n_max=None, spec_draft_n_min=None,
                   spec_draft_p_min=None, spec_synth_len=None, spec_synth_rates=None)


def draft_mismatch(target: ModelInfo, draft: ModelInfo) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (header-level form of llama-server's vocabulary check), or None."""
    if target.tokenizer_ids[0] != draft.tokenizer_ids[0]:
        return f"tokenizer {draft.tokenizer_ids[0]!r} is not the target's {target.tokenizer_ids[0]!r}"
    if target.tokenizer_ids[1:] != draft.tokenizer_ids[1:]:
        return "its BOS/EOS tokens differ from the target's"
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_SLACK:
        return f"its vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}"
    return None


def load_prompts(path: Path) -> list[str]:
    """Real requests to measure acceptance on: JSONL (``{"prompt": …}`` or a JSON string per line), or text
    whose requests are separated by lines holding only ``---`` (a file without one is a single request)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read --prompts {path} ({exc.strerror}): check the path") from None
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(f"{path} line {n} is not JSON: one {{\"prompt\": …}} object per line") from None
            prompts.append(item.get("prompt", "") if isinstance(item, dict) else str(item))
    else:
        prompts = re.split(r"\n-{3,}[ \t]*\n", "\n" + text + "\n")
    prompts = [p.strip() for p in prompts if p.strip()]
    if not prompts:
        raise UsageError(f"{path} holds no prompts: put one request per JSONL line or separate them with ---")
    return prompts


@dataclass(frozen=True, slots=True)
class Arm:
    label: str  # "none", "ngram-mod", "draft-mtp n=4 p=0.5", …
    config: LaunchConfig


@dataclass(frozen=True, slots=True)
class SpecRequest:
    """One request under one arm: the client's end-to-end time and the server's own counts."""

    round: int
    prompt_index: int
    elapsed_s: float
    ttft_s: float
    prompt_n: int
    gen_n: int
    prompt_tok_s: float
    gen_tok_s: float
    draft_n: int
    draft_accepted_n: int


@dataclass(frozen=True, slots=True)
class ArmResult:
    arm: Arm
    requests: tuple[SpecRequest, ...] = ()
    argv: tuple[str, ...] = ()
    failure: dict[str, Any] | None = None
    # (round, what disturbed the machine while this arm was measured in it; None: quiet), one per round measured.
    round_noise: tuple[tuple[int, str | None], ...] = ()

    @property
    def ok(self) -> bool:
        return self.failure is None and bool(self.requests)

    def noise_of(self, round_index: int) -> str | None:
        return next((n for r, n in self.round_noise if r == round_index), None)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafted tokens / drafted tokens, over every request; None when nothing was drafted."""
        drafted = sum(r.draft_n for r in self.requests)
        return sum(r.draft_accepted_n for r in self.requests) / drafted if drafted else None

    @property
    def mean_elapsed_s(self) -> float | None:
        return statistics.fmean(r.elapsed_s for r in self.requests) if self.requests else None

    def _median(self, name: str) -> float | None:
        return statistics.median(getattr(r, name) for r in self.requests) if self.requests else None

    @property
    def gen_tok_s(self) -> float | None:
        return self._median("gen_tok_s")

    @property
    def prompt_tok_s(self) -> float | None:
        return self._median("prompt_tok_s")

    @property
    def ttft_s(self) -> float | None:
        return self._median("ttft_s")

    @property
    def gen_cv_pct(self) -> float | None:
        return cv_pct([r.gen_tok_s for r in self.requests])

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.arm.label, "launch_line": flags.launch_line(self.arm.config),
                "argv": list(self.argv), "failure": self.failure, "acceptance_rate": self.acceptance_rate,
                "mean_elapsed_s": self.mean_elapsed_s, "gen_tok_s": self.gen_tok_s,
                "prompt_tok_s": self.prompt_tok_s, "gen_cv_pct": self.gen_cv_pct,
                "draft_n": sum(r.draft_n for r in self.requests),
                "draft_accepted_n": sum(r.draft_accepted_n for r in self.requests),
                "requests": [{"round": r.round, "prompt": r.prompt_index, "elapsed_s": r.elapsed_s,
                              "gen_n": r.gen_n, "gen_tok_s": r.gen_tok_s, "draft_n": r.draft_n,
                              "draft_accepted_n": r.draft_accepted_n} for r in self.requests]}


def _prompt_tokens(server: runner.ServerProcess, load: Workload, count: int, texts: Sequence[str] | None,
                   slot_ctx: int | None) -> list[list[int]]:
    if not texts:
        return workload.prompt_windows(server.tokenize, load.prompt_tokens, count)
    room = (slot_ctx or 4096) - load.gen_tokens - 1
    if room < 1:
        raise UsageError(f"-c leaves no room for a prompt beside {load.gen_tokens} generated tokens: raise -c")
    # A long request keeps its end: the part the next token depends on.
    return [server.tokenize(t)[-room:] or [1] for t in texts[:count]]


def measure_arm(loc: EngineLocation, arm: Arm, load: Workload, *, round_index: int = 0, requests: int = 4,
                texts: Sequence[str] | None = None, log_dir: Path, caps: Capabilities | None = None,
                load_timeout_s: float = 300.0, request_timeout_s: float = 300.0) -> ArmResult:
    """One llama-server with ``arm.config``: warm up, then ``requests`` prompts one at a time (concurrency 1)."""
    from tuner.measure.bench import slot_context

    try:
        argv = flags.server_argv(loc.tool("llama-server"), arm.config, caps)
        with runner.serve(argv, log_dir=log_dir, load_timeout_s=load_timeout_s,
                          env=flags.server_env(arm.config)) as server:
            prompts = _prompt_tokens(server, load, requests, texts, slot_context(arm.config))
            workload.warm_up(server, request_timeout_s)
            done = []
            for i, prompt in enumerate(prompts):
                s = server.stream_complete(prompt, load.gen_tokens, timeout_s=request_timeout_s)
                t = s.timings
                done.append(SpecRequest(round_index, i, s.elapsed_s, s.ttft_s, int(t.get("prompt_n", 0)),
                                        int(t.get("predicted_n", 0)), float(t.get("prompt_per_second", 0.0)),
                                        float(t.get("predicted_per_second", 0.0)), int(t.get("draft_n", 0)),
                                        int(t.get("draft_n_accepted", 0))))
    except TunerError as exc:
        return ArmResult(arm, failure=failures.from_error(exc).to_dict())
    return ArmResult(arm, tuple(done), tuple(server.argv))


def measure_arms(loc: EngineLocation, arms: Sequence[Arm], load: Workload, *, rounds: int = 2,
                 requests: int = 4, texts: Sequence[str] | None = None, log_dir: Path,
                 caps: Capabilities | None = None, on_step: Callable[[str], None] | None = None,
                 first_round: int = 0) -> list[ArmResult]:
    """Every arm ``rounds`` times, the order reversed on every other round (ABC CBA …) so slow drift of a
    shared machine falls on all arms alike; an arm that fails once is not run again. ``first_round`` numbers
    the rounds of a later call, so its requests pair with the same rounds of other arms, not earlier ones."""
    merged: dict[str, ArmResult] = {a.label: ArmResult(a) for a in arms}
    for rnd in range(first_round, first_round + rounds):
        order = arms if rnd % 2 == 0 else list(reversed(arms))
        for arm in order:
            if merged[arm.label].failure is not None:
                continue
            if on_step:
                on_step(f"speculation round {rnd + 1}/{first_round + rounds}: {arm.label}")
            # Watched as the finish's rounds are (tuner.search.watched_round): a disturbed round decides nothing.
            with quiet.watch_for([arm.config], runner.own_pids) as watch:
                res = measure_arm(loc, arm, load, round_index=rnd, requests=requests, texts=texts,
                                  log_dir=log_dir, caps=caps)
            if watch.noise and on_step:
                on_step(f"speculation round {rnd + 1}: {arm.label} was measured on a busy machine ({watch.noise}): "
                        "it decides nothing")
            prev = merged[arm.label]
            merged[arm.label] = replace(prev, requests=prev.requests + res.requests,
                                        argv=res.argv or prev.argv, failure=res.failure,
                                        round_noise=(*prev.round_noise, (rnd, watch.noise)))
    return [merged[a.label] for a in arms]


@dataclass(frozen=True, slots=True)
class Gain:
    """An arm against ``none`` on the same prompts: how much faster whole requests finish, and the noise."""

    gain_pct: float  # > 0: requests finish sooner than without speculation
    noise_pct: float  # two standard errors of the paired log time ratio, as a percentage
    pairs: int

    @property
    def beyond_noise(self) -> bool:
        return self.pairs >= 2 and self.gain_pct > self.noise_pct


def paired_gain(base: ArmResult, arm: ArmResult) -> Gain | None:
    """Pairs each request with the same prompt in the same round under ``none``: the ratio of end-to-end
    times cancels what the prompt itself costs, so the spread left is the measurement's noise."""
    times = {(r.round, r.prompt_index): r.elapsed_s for r in base.requests}
    logs = [math.log(times[(r.round, r.prompt_index)] / r.elapsed_s) for r in arm.requests
            if (r.round, r.prompt_index) in times and r.elapsed_s > 0]
    if not logs:
        return None
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    noise = 100 * (math.exp(2 * se) - 1) if math.isfinite(se) else math.inf
    return Gain(100 * (math.exp(mean) - 1), noise, len(logs))


_ACCEPT_RE = re.compile(
    r"draft acceptance = ([0-9.]+) \(\s*(\d+) accepted /\s*(\d+) generated\), mean len =\s*([0-9.]+)")


@dataclass(frozen=True, slots=True)
class LogAcceptance:
    """llama-server's per-request ``draft acceptance`` log lines, summed."""

    requests: int
    drafted_n: int
    accepted_n: int
    mean_len: float  # tokens per verification step, the target's own token included

    @property
    def rate(self) -> float | None:
        return self.accepted_n / self.drafted_n if self.drafted_n else None


def acceptance_from_log(text: str) -> LogAcceptance | None:
    """The acceptance a server log reports (None when it drafted nothing), e.g. after ``moe-tune bench``."""
    found = [(int(m.group(2)), int(m.group(3)), float(m.group(4))) for m in _ACCEPT_RE.finditer(text)]
    if not found:
        return None
    accepted = sum(a for a, _, _ in found)
    steps = sum(a / (length - 1) for a, _, length in found if length > 1)
    return LogAcceptance(len(found), sum(g for _, g, _ in found), accepted, 1 + accepted / steps if steps else 1.0)
