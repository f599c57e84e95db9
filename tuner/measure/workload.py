"""What a server trial sends: prompts of P real-text tokens, G generated tokens, at concurrency 1..parallel.

Prompts are windows of real text tokenized by the server under test (so P is exact for any model), taken at
different offsets so no two requests share a prefix. :func:`prompt_text` is the one source of that text.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from tuner.core.errors import UsageError

if TYPE_CHECKING:  # a runner's process is passed in: the workload's kinds load without it (the CLI's options)
    from tuner.engine.runner import ServerProcess, StreamedCompletion


class WorkloadKind(str, Enum):
    CHAT = "chat"
    AGENT = "agent"
    BATCH = "batch"
    CUSTOM = "custom"


@dataclass(frozen=True, slots=True)
class Workload:
    """What one user request looks like, and how many are in flight: the measurement every trial makes.

    ``depth_tokens`` is the context already filled when generation happens (None: the prompt itself, i.e. a
    fresh conversation); an agent living with a long history sets it higher. The prompt is then processed on
    top of ``depth_tokens - prompt_tokens`` tokens of history, and generation runs at ``depth_tokens``.
    """

    kind: WorkloadKind
    prompt_tokens: int
    gen_tokens: int
    # Rounds per concurrency level: at level c, c clients each send this many requests back to back.
    rounds: int = 2
    depth_tokens: int | None = None
    concurrency: int = 1  # requests in flight at once (server slots worth searching up to this)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.gen_tokens < 1 or self.rounds < 1:
            raise UsageError("workload prompt tokens, generated tokens and rounds must be >= 1: fix -p/-n")
        if self.depth_tokens is not None and self.depth_tokens < self.prompt_tokens:
            raise UsageError(f"--depth {self.depth_tokens} is shorter than the {self.prompt_tokens}-token prompt it "
                             "includes: raise --depth or lower -p")
        if self.concurrency < 1:
            raise UsageError("workload concurrency must be >= 1")

    @property
    def gen_depth(self) -> int:
        """Tokens in the context while generating (llama-bench ``-d`` of the generation test)."""
        return self.prompt_tokens if self.depth_tokens is None else self.depth_tokens

    @property
    def prompt_depth(self) -> int:
        """History already in the context when the prompt is processed (``-d`` of the prompt test)."""
        return self.gen_depth - self.prompt_tokens

    @property
    def context_tokens(self) -> int:
        """Context one request needs: history, prompt and the reply."""
        return self.gen_depth + self.gen_tokens

    def request_s(self, prompt_tok_s: float, gen_tok_s: float) -> float:
        """Seconds one request takes end to end: its prompt at ``prompt_tok_s`` plus its reply at ``gen_tok_s``."""
        return self.prompt_tokens / prompt_tok_s + self.gen_tokens / gen_tok_s

    def score(self, prompt_tok_s: float | None, gen_tok_s: float | None) -> float | None:
        """Requests per second for one user (higher is better): the one score the search and the finish share."""
        if not prompt_tok_s or not gen_tok_s or prompt_tok_s <= 0 or gen_tok_s <= 0:
            return None
        return 1.0 / self.request_s(prompt_tok_s, gen_tok_s)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "prompt_tokens": self.prompt_tokens, "gen_tokens": self.gen_tokens,
                "depth_tokens": self.gen_depth, "prompt_depth_tokens": self.prompt_depth,
                "concurrency": self.concurrency, "rounds": self.rounds}


# chat: short turns; agent: long tool-laden prompts, modest replies; batch: many long generations, 4 in flight.
PRESETS = {
    WorkloadKind.CHAT: (512, 128),
    WorkloadKind.AGENT: (8192, 256),
    WorkloadKind.BATCH: (256, 512),
}
CONCURRENCY = {WorkloadKind.BATCH: 4}


def preset(kind: WorkloadKind, prompt_tokens: int | None = None, gen_tokens: int | None = None,
           rounds: int = 2, *, depth_tokens: int | None = None, concurrency: int | None = None) -> Workload:
    """A named workload; explicit token counts override the preset (and are required for ``custom``). A preset
    prompt longer than the ``--depth`` asked for is cut to it (an agent's 8192-token prompt at depth 1024)."""
    if kind is WorkloadKind.CUSTOM and (prompt_tokens is None or gen_tokens is None):
        raise UsageError("--workload custom needs both -p PROMPT_TOKENS and -n GEN_TOKENS")
    for flag, value in (("-p/--n-prompt", prompt_tokens), ("-n/--n-gen", gen_tokens), ("--depth", depth_tokens),
                        ("-np/--parallel", concurrency)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value} measures nothing: give a positive number of tokens (or drop it)")
    p, g = PRESETS.get(kind, (0, 0))
    if prompt_tokens is None and depth_tokens is not None:
        p = min(p, depth_tokens)
    return Workload(kind, prompt_tokens or p, gen_tokens or g, rounds, depth_tokens,
                    concurrency or CONCURRENCY.get(kind, 1))


def prompt_text() -> str:
    """The real text prompts are cut from: the bundled corpus (prose, technical text, code and dialogue)."""
    from tuner.quality import corpus

    return corpus.text()


def prompt_windows(tokenize: Callable[[str], list[int]], n_tokens: int, count: int) -> list[list[int]]:
    """``count`` distinct windows of exactly ``n_tokens`` tokens of real text."""
    text = prompt_text()
    stride = max(1, n_tokens // 4)
    need = n_tokens + stride * (count - 1)
    chars = min(len(text), need * 6 + 4096)
    tokens = tokenize(text[:chars])
    while len(tokens) < need and chars < len(text):
        chars = min(len(text), chars * 2)
        tokens = tokenize(text[:chars])
    if len(tokens) < n_tokens:
        raise UsageError(f"the prompt text has only {len(tokens)} tokens for this model: use a smaller -p")
    span = len(tokens) - n_tokens
    offsets = [min(span, i * stride) if need <= len(tokens) else (i * span) // max(1, count - 1)
               for i in range(count)]
    return [tokens[o:o + n_tokens] for o in offsets]


@dataclass(frozen=True, slots=True)
class RequestResult:
    ttft_s: float
    elapsed_s: float
    prompt_n: int
    gen_n: int
    prompt_tok_s: float
    gen_tok_s: float
    start_s: float = 0.0  # when it was sent, on the monotonic clock

    @classmethod
    def from_stream(cls, done: StreamedCompletion) -> RequestResult:
        t = done.timings
        return cls(done.ttft_s, done.elapsed_s, int(t.get("prompt_n", 0)), int(t.get("predicted_n", 0)),
                   float(t.get("prompt_per_second", 0.0)), float(t.get("predicted_per_second", 0.0)),
                   done.started_s)


@dataclass(frozen=True, slots=True)
class LevelResult:
    """All requests at one concurrency: what each user saw, and what the server delivered in total."""

    concurrency: int
    requests: tuple[RequestResult, ...]
    wall_s: float

    @property
    def gen_tokens(self) -> int:
        return sum(r.gen_n for r in self.requests)

    @property
    def decode_s(self) -> float:
        """Wall time during which at least one request was generating (first token → last token)."""
        spans = sorted((r.start_s + r.ttft_s, r.start_s + r.elapsed_s) for r in self.requests)
        total, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    @property
    def aggregate_gen_tok_s(self) -> float:
        """Generated tokens per second of generation wall time, summed over concurrent requests."""
        return self.gen_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def end_to_end_gen_tok_s(self) -> float:
        """Generated tokens per second of the whole level, prompt processing and queueing included."""
        return self.gen_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def per_request_gen_tok_s(self) -> float:
        return statistics.median(r.gen_tok_s for r in self.requests)

    @property
    def per_request_prompt_tok_s(self) -> float:
        return statistics.median(r.prompt_tok_s for r in self.requests)

    @property
    def ttft_s(self) -> float:
        return statistics.median(r.ttft_s for r in self.requests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency, "wall_s": self.wall_s, "gen_tokens": self.gen_tokens,
            "aggregate_gen_tok_s": self.aggregate_gen_tok_s, "end_to_end_gen_tok_s": self.end_to_end_gen_tok_s,
            "decode_s": self.decode_s, "per_request_gen_tok_s": self.per_request_gen_tok_s,
            "per_request_prompt_tok_s": self.per_request_prompt_tok_s, "ttft_s": self.ttft_s,
            "requests": [
                {"ttft_s": r.ttft_s, "elapsed_s": r.elapsed_s, "prompt_n": r.prompt_n, "gen_n": r.gen_n,
                 "prompt_tok_s": r.prompt_tok_s, "gen_tok_s": r.gen_tok_s} for r in self.requests
            ],
        }


def warm_up(server: ServerProcess, timeout_s: float) -> None:
    """One short request so first-use costs (page faults, thread start) stay out of the figures."""
    server.stream_complete(server.tokenize("Warm up the engine.") or [1], 4, timeout_s=timeout_s)


def run_level(server: ServerProcess, workload: Workload, concurrency: int, prompts: Sequence[list[int]],
              *, timeout_s: float) -> LevelResult:
    """``concurrency`` clients at once, each sending ``workload.rounds`` requests back to back."""
    jobs = [[prompts[(c * workload.rounds + r) % len(prompts)] for r in range(workload.rounds)]
            for c in range(concurrency)]
    results: list[RequestResult] = []
    lock = threading.Lock()

    def client(own: list[list[int]]) -> None:
        for prompt in own:
            done = server.stream_complete(prompt, workload.gen_tokens, timeout_s=timeout_s)
            with lock:
                results.append(RequestResult.from_stream(done))

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="moe-tune-client")
    start = time.monotonic()
    try:
        futures = [pool.submit(client, own) for own in jobs]
        for fut in futures:
            fut.result()  # re-raises the first client's error; Ctrl-C interrupts this wait
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return LevelResult(concurrency, tuple(results), time.monotonic() - start)


def run_workload(server: ServerProcess, workload: Workload, max_concurrency: int, *,
                 timeout_s: float = 300.0, on_timed: Callable[[], None] | None = None) -> tuple[LevelResult, ...]:
    """Warm up, then every level from 1 to ``max_concurrency`` with fresh prompts per request. ``on_timed`` is
    called between the warm-up and the first timed request."""
    count = max(1, max_concurrency) * workload.rounds
    prompts = prompt_windows(server.tokenize, workload.prompt_tokens, count)
    warm_up(server, timeout_s)
    if on_timed is not None:
        on_timed()
    return tuple(run_level(server, workload, c, prompts, timeout_s=timeout_s)
                 for c in range(1, max_concurrency + 1))
