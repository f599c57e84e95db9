"""What each step of a lease is expected to take, from what lease 2 measured on an H100 machine (16 cores, PCIe 5;
results/benchmarks/gpu-lease-2: the steps' ``took_s`` in the state, the server logs' own clocks in logs.tgz).

Lease 2 ran the whole auto-tune per run (3 trials, then 2 confirmation rounds of 3 arms, a server start each):

- tune-12g-agent took 179.8 s; its six server runs lived 19.7–28.5 s (138.8 s together), so the search and
  llama-fit-params took ~41 s. tune-12g-chat 87.2 s, six runs 64.1 s: ~23 s. budget-8g 101.2 s, six runs 75.4 s:
  ~26 s. budget-16g 98.9 s, six runs 68.8 s: ~30 s.
- A server's load (start to "model loaded") took 1.2–7.2 s (chat runs) on a zero-filled file; 7 s is planned.
- The default line generated 36.7 tok/s at 8 GiB, 42.3 at 12 GiB (chat; 37.6 on the agent's 32K context) and
  72.5 at 16 GiB.

Valid weights cost more than zero weights where experts sit on the host: every ubatch of a prompt copies the
experts its tokens chose, nearly all of them (zero weights tie the router to 8 of 128), so a prompt runs at the PCIe
bound (~1,460–1,840 tok/s for 48 host layers at -ub 512 on PCIe 5, DESIGN.md §15). The plan takes 1,400 tok/s for
every budget (below the bound: a turn is planned no shorter than it can be) and adds 10 s to each agent search for
its 4,096-token prompts at that speed.
"""

from __future__ import annotations

LOAD_S = 7.0
SEARCH_S = {"agent": 41.0 + 10.0, "chat": 30.0}
PROMPT_TOK_S = 1400.0
GEN_TOK_S = {8: 36.7, 12: 37.6, 16: 72.5}  # the default's, lease 2; at 12 GiB the agent's (32K context)
CHAT_GEN_TOK_S = {8: 36.7, 12: 42.3, 16: 72.5}
TURN_OVERHEAD_S = 0.05  # a request's HTTP round trip and sampling set-up
GPU_INFO_S = 1.0  # nvidia-smi: 0.0 s in lease 2
WHEELS_S = 2.0  # 1.8 s in lease 2
# The default model's valid weights (17.3 GiB) drawn and written: 34.5 s on this project's 2 busy cores
# (results/benchmarks/valid-weights-writer.md); the device's disk is not measured yet, hence the margin.
MODEL_VALID_S = 45.0
MODEL_ZERO_S = 2.0  # the sparse zero-weight file: 0.6 s here (the same benchmark); 2.9 s in lease 2
MEMORY_S = 15.0  # memory-12g: 10.2 s in lease 2
SPILL_S = 30.0  # spill-oom: 25.7 s in lease 2
OPOFF_S = 120.0  # opoff-12g-agent: 114.7 s in lease 2


def _gen(budget_gib: int, table: dict[int, float]) -> float:
    return table.get(budget_gib) or min(table.values())


def agent_session_s(budget_gib: int, turns: int, turn_tokens: int, gen_tokens: int) -> float:
    """One session as :mod:`gpucheck.versus` replays it: per turn, its new tokens' prompt and its reply."""
    per_turn = turn_tokens / PROMPT_TOK_S + gen_tokens / _gen(budget_gib, GEN_TOK_S) + TURN_OVERHEAD_S
    return turns * per_turn


def chat_request_s(budget_gib: int, prompt_tokens: int = 512, gen_tokens: int = 128) -> float:
    return prompt_tokens / PROMPT_TOK_S + gen_tokens / _gen(budget_gib, CHAT_GEN_TOK_S) + TURN_OVERHEAD_S


def versus_s(budget_gib: int, kind: str, rounds: int, *, turns: int, turn_tokens: int, gen_tokens: int) -> float:
    """Two loads, a warm-up per arm, then ``rounds`` rounds of one session (or request) per arm."""
    one = agent_session_s(budget_gib, turns, turn_tokens, gen_tokens) if kind == "agent" else chat_request_s(budget_gib)
    return 2 * LOAD_S + 2 * (rounds + 1) * one


# The race's plan (gpucheck.race: `moe-tune plan` sizes ik's line; the CPU fallback's plans took ~10 s each).
RACE_PLAN_S = 10.0


def race_s(budget_gib: int, rounds: int, *, turns: int, turn_tokens: int, gen_tokens: int) -> float:
    """ik_llama.cpp against llama.cpp's default (gpucheck.race): the plan that sizes ik's line, then a versus of agent
    sessions, each session planned at llama.cpp's default speeds (ik has never run on a card here: no figure of its
    own yet; users' side-by-sides put it within ±50 % either way)."""
    return RACE_PLAN_S + versus_s(budget_gib, "agent", rounds, turns=turns, turn_tokens=turn_tokens,
                                  gen_tokens=gen_tokens)
