"""Replaying a :class:`~tuner.measure.session.Session` against llama-server, turn by turn, and what each turn
cost: time to first token, prompt tokens processed vs taken from the slot's cache (the server's own
``timings``: ``prompt_n``, ``cache_n``), generation speed; per session the total and the share of the context
that was re-processed when it could have come from the cache.

A turn's prompt is the previous turn's prompt plus the previous reply and the new messages, so at best it
processes only what is new since the last prompt. Tokens beyond that were re-processed: the engine could not
roll its memory back to where the prompts diverge (recurrent state or a sliding window without a checkpoint
close enough, ``server-context.cpp``: the ``pos_min >= pos_min_thold`` branch of ``update_slots``).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import TrialFailedError, TunerError
from tuner.core.model import ModelInfo
from tuner.engine import flags, runner
from tuner.engine.caps import Capabilities, EngineLocation
from tuner.engine.flags import dialect
from tuner.machine import pressure
from tuner.machine.sampler import NOT_MEASURED, PagingVerdict, Sampler, paging_verdict
from tuner.measure import failures, gpu_use
from tuner.measure.phases import paging_fix
from tuner.measure.session import Session
from tuner.plan import memory

# A turn that re-processes at least this share of what it could have reused is a full re-process.
FULL_REPROCESS_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class TurnResult:
    index: int
    context_tokens: int  # the whole prompt of this turn: cached + processed
    cached_tokens: int  # taken from the slot's cache (timings.cache_n)
    processed_tokens: int  # evaluated for this turn (timings.prompt_n)
    reusable_tokens: int  # the previous turn's prompt: a prefix of this one, so reusable at best
    ttft_s: float  # request sent → first generated token, as the client saw it
    prompt_s: float  # the server's own prompt time (timings.prompt_ms)
    gen_tokens: int
    gen_tok_s: float
    elapsed_s: float
    agent: int = 0  # which of the concurrent sessions (0 when one agent runs)

    @property
    def reprocessed_tokens(self) -> int:
        """Tokens of the reusable prefix that were evaluated again."""
        return max(0, min(self.reusable_tokens, self.reusable_tokens - self.cached_tokens))

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.context_tokens if self.context_tokens else 0.0

    @property
    def full_reprocess(self) -> bool:
        return self.reusable_tokens > 0 and self.reprocessed_tokens >= FULL_REPROCESS_SHARE * self.reusable_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"turn": self.index + 1, "context_tokens": self.context_tokens, "cached_tokens": self.cached_tokens,
                "processed_tokens": self.processed_tokens, "reprocessed_tokens": self.reprocessed_tokens,
                "cached_share": self.cached_share, "ttft_s": self.ttft_s, "prompt_s": self.prompt_s,
                "gen_tokens": self.gen_tokens, "gen_tok_s": self.gen_tok_s, "elapsed_s": self.elapsed_s,
                "full_reprocess": self.full_reprocess, "agent": self.agent + 1}

    def name(self, agents: int) -> str:
        """``3``, or ``2.3`` (agent 2, turn 3) when several agents ran at once."""
        return f"{self.agent + 1}.{self.index + 1}" if agents > 1 else str(self.index + 1)


@dataclass(frozen=True, slots=True)
class SessionResult:
    turns: tuple[TurnResult, ...]  # agent by agent, each in turn order
    # The whole session: every turn, request sent → last byte received; with concurrent agents the wall time
    # from the first request to the last agent's last byte.
    session_s: float
    source: str = "bundled"

    @property
    def agents(self) -> int:
        return len({t.agent for t in self.turns})

    @property
    def total_turn_s(self) -> float:
        return sum(t.elapsed_s for t in self.turns)

    @property
    def reprocessed_share(self) -> float:
        """Re-processed tokens over the tokens that could have come from the cache, all turns together."""
        reusable = sum(t.reusable_tokens for t in self.turns)
        return sum(t.reprocessed_tokens for t in self.turns) / reusable if reusable else 0.0

    @property
    def full_reprocess_turns(self) -> tuple[TurnResult, ...]:
        return tuple(t for t in self.turns if t.full_reprocess)

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(t.ttft_s for t in self.turns)

    def score(self) -> float | None:
        """Sessions per second (higher is better): the score auto-tune ranks by."""
        return 1.0 / self.session_s if self.session_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "session_s": self.session_s, "turns": [t.to_dict() for t in self.turns],
                "reprocessed_share": self.reprocessed_share, "median_ttft_s": self.median_ttft_s,
                "full_reprocess_turns": [t.name(self.agents) for t in self.full_reprocess_turns],
                "agents": self.agents}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionResult:
        turns = tuple(TurnResult(int(t["turn"]) - 1, int(t["context_tokens"]), int(t["cached_tokens"]),
                                 int(t["processed_tokens"]), _reusable(d["turns"], i),
                                 float(t["ttft_s"]), float(t["prompt_s"]), int(t["gen_tokens"]),
                                 float(t["gen_tok_s"]), float(t["elapsed_s"]), int(t.get("agent", 1)) - 1)
                      for i, t in enumerate(d["turns"]))
        return cls(turns, float(d["session_s"]), str(d.get("source", "bundled")))


def _reusable(turns: list[dict[str, Any]], i: int) -> int:
    """The previous turn's prompt of the same agent (nothing for an agent's first turn)."""
    same = i > 0 and turns[i - 1].get("agent", 1) == turns[i].get("agent", 1)
    return int(turns[i - 1]["context_tokens"]) if same else 0


def replay(server: runner.ServerProcess, session: Session, gen_tokens: int, *, timeout_s: float = 600.0,
           on_turn: Callable[[TurnResult], None] | None = None, agent: int = 0) -> SessionResult:
    """Send every turn of ``session`` in order on one connection's worth of state (one slot), each generating
    ``gen_tokens``; the server's prompt cache is on, as for any chat client."""
    results: list[TurnResult] = []
    previous = 0
    for k in range(len(session.turns)):
        done = server.stream_chat(session.messages_before(k), gen_tokens, timeout_s=timeout_s)
        t = done.timings
        cached, processed = int(t.get("cache_n", 0)), int(t.get("prompt_n", 0))
        res = TurnResult(k, cached + processed, cached, processed, previous, done.ttft_s,
                         float(t.get("prompt_ms", 0.0)) / 1000.0, int(t.get("predicted_n", 0)),
                         float(t.get("predicted_per_second", 0.0)), done.elapsed_s, agent)
        results.append(res)
        previous = res.context_tokens
        if on_turn is not None:
            on_turn(res)
    # Turns follow each other with no think time: the session is the sum of the turns.
    return SessionResult(tuple(results), sum(r.elapsed_s for r in results), session.source)


def replay_together(server: runner.ServerProcess, sessions: Sequence[Session], gen_tokens: int, *,
                    timeout_s: float = 600.0) -> SessionResult:
    """Each session replayed by its own client thread at the same time (two agents on ``-np 2``); the result
    holds every agent's turns and the wall time until the last agent's last reply."""
    if len(sessions) == 1:
        return replay(server, sessions[0], gen_tokens, timeout_s=timeout_s)
    pool = ThreadPoolExecutor(max_workers=len(sessions), thread_name_prefix="moe-tune-agent")
    start = time.monotonic()
    try:
        futures = [pool.submit(replay, server, ses, gen_tokens, timeout_s=timeout_s, agent=k)
                   for k, ses in enumerate(sessions)]
        done = [fut.result() for fut in futures]  # re-raises an agent's error; Ctrl-C interrupts this wait
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.monotonic() - start
    return SessionResult(tuple(t for res in done for t in res.turns), wall, sessions[0].source)


@dataclass(frozen=True, slots=True)
class SessionTrial:
    argv: tuple[str, ...]
    config: LaunchConfig
    result: SessionResult
    log_path: Path
    # Host RAM over the replay (after the warm-up): was the model read back from disk while the turns ran.
    host_paging: PagingVerdict = NOT_MEASURED
    # The card's use grown over the sampler's first look, taken before the server started: the line's own VRAM
    # (None: no GPU sampled).
    vram_growth_bytes: int | None = None


SessionSource = Session | Callable[[Callable[[str], list[int]]], Session]


def run_session_trial(engine: EngineLocation, cfg: LaunchConfig, session: SessionSource | Sequence[SessionSource],
                      gen_tokens: int, *, log_dir: Path, caps: Capabilities | None = None,
                      load_timeout_s: float = 300.0, request_timeout_s: float = 600.0,
                      trace: bool = False, nvml: Any = None) -> SessionTrial:
    """llama-server with exactly ``cfg``, one short warm-up request, then the session replayed (several
    sessions: replayed at once, one client each). A session may be a function of the server's tokenizer (the
    bundled one is sized in the model's own tokens). With ``trace`` the server logs every checkpoint it makes
    (:func:`checkpoints_from_log` reads them). The host counters are read around the replay, as a server trial reads
    them around its timed requests: the engine's page-ins per generated token over every turn give the session's
    host-paging verdict."""
    sources: list[SessionSource] = list(session) if isinstance(session, (list, tuple)) else [session]  # type: ignore[list-item]
    try:
        binary = engine.tool("llama-server")
    except TunerError as exc:
        raise TrialFailedError("llama-server", failures.from_error(exc)) from None
    kind = dialect.kind_for(caps, cfg)
    argv = flags.server_argv(binary, cfg, caps) + (flags.trace_argv(kind) if trace else []) + \
        flags.file_log_argv(kind, log_dir)
    sampler = Sampler(nvml)  # the card, sampled as a server trial samples it (the line's own VRAM)
    sampler.start()
    try:
        with runner.serve(argv, log_dir=log_dir, load_timeout_s=load_timeout_s,
                          log_jsonl=flags.server_logs_jsonl(caps), env=flags.server_env(cfg)) as server:
            sampler.attach(server.proc.pid)
            sessions = [s(server.tokenize) if callable(s) else s for s in sources]
            server.stream_complete(server.tokenize("Warm up the engine.") or [1], 4, timeout_s=request_timeout_s)
            ours = [server.proc.pid]
            before = pressure.read_counters(ours) if pressure.available() else None
            result = replay_together(server, sessions, gen_tokens, timeout_s=request_timeout_s)
            host = None if before is None else pressure.between(before, pressure.read_counters(ours))
    except TunerError as exc:
        raise TrialFailedError("llama-server", failures.from_error(exc)) from None
    finally:
        memory = sampler.stop()
    gpu_use.check_server(server.log.read_text(errors="replace"), cfg)  # as every server trial is checked
    peak, base = memory.vram_peak_bytes, memory.vram_baseline_bytes
    paging = paging_verdict(host, sum(t.gen_tokens for t in result.turns))
    if paging.paging:
        paging = replace(paging, fix=paging_fix(cfg))
    return SessionTrial(tuple(server.argv), cfg, result, server.log, paging,
                        None if peak is None or base is None else max(0, peak - base))


# server-context.cpp, create_checkpoint: "created context checkpoint %d of %d (pos_min = …, size = %.3f MiB)"
_CHECKPOINT = re.compile(r"created context checkpoint (\d+) of (\d+) \(pos_min = (-?\d+), pos_max = (-?\d+), "
                         r"n_tokens = (\d+), size = ([0-9.]+) MiB\)")
# server-context.cpp, load_model: "prompt cache is enabled, size limit: %d MiB"
_PROMPT_CACHE = re.compile(r"prompt cache is enabled, size limit: (\d+) MiB")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    number: int
    of: int
    n_tokens: int
    size_mib: float


def checkpoints_from_log(text: str) -> list[Checkpoint]:
    """The context checkpoints a trace-level llama-server log records, in order."""
    return [Checkpoint(int(m[1]), int(m[2]), int(m[5]), float(m[6])) for m in _CHECKPOINT.finditer(text)]


def prompt_cache_limit_mib(text: str) -> int | None:
    """The host prompt cache's limit the server set (trace level), None when it is off or unlimited."""
    m = _PROMPT_CACHE.search(text)
    return int(m[1]) if m else None


@dataclass(frozen=True, slots=True)
class Finding:
    """Turns that re-processed their whole context, why the engine had to, and the setting that fixes it."""

    turns: tuple[str, ...]  # 1-based turn numbers ("2.3": agent 2, turn 3, when several agents ran)
    reprocessed_tokens: int
    cause: str
    fix: LaunchConfig | None  # the config with the fix applied (None: nothing in the engine fixes it)
    fix_text: str

    def describe(self) -> str:
        shown = ", ".join(str(t) for t in self.turns[:8]) + (" …" if len(self.turns) > 8 else "")
        return (f"turn{'s' if len(self.turns) > 1 else ''} {shown} re-processed the whole context "
                f"({self.reprocessed_tokens:,} tokens that were cached): {self.cause}; fix: {self.fix_text}")


def diagnose(result: SessionResult, info: ModelInfo, cfg: LaunchConfig) -> Finding | None:
    """Name the full re-processes of a session and the engine setting that avoids them (server-context.cpp,
    ``update_slots``: memory that cannot be rolled back is restored from a context checkpoint at or before
    the point where the prompts diverge, or the whole prompt is evaluated again)."""
    bad = result.full_reprocess_turns
    if not bad:
        return None
    turns = tuple(t.name(result.agents) for t in bad)
    wasted = sum(t.reprocessed_tokens for t in bad)
    checkpoints = memory.DEFAULT_CTX_CHECKPOINTS if cfg.ctx_checkpoints is None else cfg.ctx_checkpoints
    swa = bool(info.n_swa and any(info.swa_layers))
    if (info.is_hybrid or (swa and not cfg.swa_full)) and checkpoints == 0:
        what = "recurrent state" if info.is_hybrid else "sliding-window cache"
        fix = replace(cfg, ctx_checkpoints=memory.DEFAULT_CTX_CHECKPOINTS)
        return Finding(turns, wasted, f"the {what} cannot be rolled back and context checkpoints are off", fix,
                       flags.spelled("ctx_checkpoints", memory.DEFAULT_CTX_CHECKPOINTS))
    if swa and not cfg.swa_full:
        return Finding(turns, wasted, "the sliding-window cache no longer holds the tokens where the prompts "
                       "diverge and no checkpoint is close enough", replace(cfg, swa_full=True),
                       f"{flags.spelled('swa_full')} (a full-size cache for the SWA layers: more KV memory)")
    if info.is_hybrid:
        step = memory.DEFAULT_CHECKPOINT_MIN_STEP if cfg.checkpoint_min_step is None else cfg.checkpoint_min_step
        more = replace(cfg, ctx_checkpoints=max(2 * checkpoints, 8), checkpoint_min_step=max(0, step // 4))
        return Finding(turns, wasted, "the recurrent state cannot be rolled back and no context checkpoint lies "
                       "before the point where the prompts diverge", more,
                       f"{flags.spelled('ctx_checkpoints', more.ctx_checkpoints)} "
                       f"{flags.spelled('checkpoint_min_step', more.checkpoint_min_step)}")
    if cfg.cache_ram_mib == 0 and (cfg.parallel or 1) > 1:
        fix = replace(cfg, cache_ram_mib=memory.DEFAULT_CACHE_RAM_MIB)
        return Finding(turns, wasted, "another request took the slot and the host prompt cache is off", fix,
                       flags.spelled("cache_ram_mib", memory.DEFAULT_CACHE_RAM_MIB))
    return Finding(turns, wasted, "the prompt changed before the new messages (the client rewrote its history)",
                   None, "keep the history unchanged between turns (nothing in the engine fixes this)")
