"""(b) of `scripts/gpu_check`, the way a lease can decide it: the tuner's best line against llama.cpp's default,
both servers loaded at once at the same free VRAM, measured in interleaved rounds with no restart in between.

Each server starts the way a user would start it with ``budget`` MiB of VRAM free: a ballast holds the rest of the
card while the default loads (its ``--fit`` fills what it finds), is let go, and a new ballast holds all but
``budget`` again while the tuned line loads. Then, round after round, the same work goes to each (the order
alternating: ABBA), and the project's own verdict (tuner.search.verdict.compare: 99 %, per-round ratios) judges
them. A restart per round would cost both servers' loads each round (lease 2: 1.2–7.2 s a load, chat rounds of
8–16 s a server); with both loaded, a round is two sessions (or two requests). An idle llama-server sleeps on its
queue, and both map the same model file, so the one not measured takes neither cores nor page cache from the other.

The agent figure is a session's time (tuner.measure.session_run.replay: every turn's prompt on top of the cached
history, then its reply), the score the session stage ranks by (sessions per second). Each round replays a session
cut from another place of the bundled corpus after the same system prompt (an agent's next task), so nothing of a
round's turns is in any cache before it; one session before the first round warms both (not counted). The chat
figure is one request (the chat preset: 512 prompt tokens, 128 generated) scored as the search and the finish
score it (requests per second). A step that reaches its deadline stops between rounds and keeps what it measured.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags, runner
from tuner.machine import ballast
from tuner.measure import session as session_mod
from tuner.measure import session_run, workload
from tuner.search.verdict import compare

# The agent session a round replays: a system prompt with tool schemas, then turns of a ~1K-token tool result or
# user message each answered with a short reply (what an agent's turn waits for: the new tokens' prompt, then the
# reply). Four turns keep a round near 6 s at 8 GiB on lease 2's speeds (see lease.py's estimates).
SYSTEM_TOKENS = 2048
TURN_TOKENS = 1024
TURNS = 4
AGENT_GEN_TOKENS = 32
LOAD_TIMEOUT_S = 300.0


def agent_session(tokenize: Callable[[str], list[int]], round_index: int) -> session_mod.Session:
    # One turn more than needed: the system prompt's cut lands within 10 % of its size, either way.
    depth = SYSTEM_TOKENS + (TURNS + 1) * (TURN_TOKENS + AGENT_GEN_TOKENS)
    ses = session_mod.bundled_session(lambda text: len(tokenize(text)), depth, gen_tokens=AGENT_GEN_TOKENS,
                                      turn_tokens=TURN_TOKENS, system_tokens=SYSTEM_TOKENS, agent=round_index)
    if len(ses.turns) < TURNS:
        raise ValueError(f"the bundled session holds {len(ses.turns)} turns of {TURN_TOKENS} tokens, not {TURNS}")
    return session_mod.Session(ses.system, ses.turns[:TURNS], ses.source)


def _agent_round(server: runner.ServerProcess, r: int) -> tuple[float | None, dict[str, Any]]:
    done = session_run.replay(server, agent_session(server.tokenize, r), AGENT_GEN_TOKENS)
    return done.score(), {"session_s": round(done.session_s, 3), "median_ttft_s": round(done.median_ttft_s, 3),
                          "turns": [{k: t.to_dict()[k] for k in ("processed_tokens", "cached_tokens", "ttft_s",
                                                                  "gen_tok_s", "elapsed_s")} for t in done.turns]}


def _chat_round(load: workload.Workload) -> Callable[[runner.ServerProcess, int], tuple[float | None, dict[str, Any]]]:
    def run(server: runner.ServerProcess, r: int) -> tuple[float | None, dict[str, Any]]:
        prompt = workload.prompt_windows(server.tokenize, load.prompt_tokens, r + 1)[r]
        done = workload.RequestResult.from_stream(server.stream_complete(prompt, load.gen_tokens, timeout_s=300))
        score = load.score(done.prompt_tok_s, done.gen_tok_s)
        return score, {"prompt_tok_s": round(done.prompt_tok_s, 1), "gen_tok_s": round(done.gen_tok_s, 2),
                       "elapsed_s": round(done.elapsed_s, 3)}
    return run


def versus(engine_dir: Path, tuned: LaunchConfig, default: LaunchConfig, budget_mib: int, kind: str, *,
           rounds: int, log_dir: Path, deadline_s: float, log: Callable[[str], None],
           hold: Callable[[int, Any], contextlib.AbstractContextManager[Any]] = ballast.hold_vram,
           engines: Mapping[str, Path] | None = None) -> dict[str, Any]:
    """Load ``default`` then ``tuned`` each at ``budget_mib`` free, and measure ``rounds`` interleaved rounds (fewer
    when the monotonic clock reaches ``deadline_s``). Returns the verdict and every round's figures. ``hold``:
    what holds the rest of the card (the VRAM ballast; a test without a GPU passes a stand-in). ``engines``: another
    engine's build for an arm (``{"tuned": ik_bin}``: the race of two engines), else ``engine_dir`` runs both."""
    locs = {label: build.locate_engine((engines or {}).get(label, engine_dir)) for label in ("default", "tuned")}
    caps = {label: build.capabilities(loc) for label, loc in locs.items()}
    one = _agent_round if kind == "agent" else _chat_round(workload.preset(workload.WorkloadKind.CHAT))
    arms = {"default": default, "tuned": tuned}
    servers: dict[str, runner.ServerProcess] = {}
    held: dict[str, dict[str, Any]] = {}
    scores: dict[str, list[float | None]] = {"default": [], "tuned": []}
    details: dict[str, list[dict[str, Any]]] = {"default": [], "tuned": []}
    stopped = ""
    with contextlib.ExitStack() as stack:

        def load(label: str, b: Any) -> None:
            t0 = time.monotonic()
            cfg = arms[label]
            servers[label] = stack.enter_context(runner.serve(
                flags.server_argv(locs[label].tool("llama-server"), cfg, caps[label]), log_dir=log_dir / label,
                load_timeout_s=LOAD_TIMEOUT_S, env=flags.server_env(cfg), log_jsonl=True))
            held[label] = {"free_mib": b.free_mib, "ballast_mib": b.held_mib, "load_s": round(time.monotonic() - t0, 1),
                           "launch_line": flags.launch_line(cfg)}
            log(f"{label} loaded in {held[label]['load_s']} s at {b.free_mib} MiB free: {held[label]['launch_line']}")

        with hold(budget_mib, runner) as b:  # the default's --fit sees budget_mib free; its ballast then goes
            load("default", b)
        load("tuned", stack.enter_context(hold(budget_mib, runner)))  # held until both servers stop
        for server in servers.values():  # warm-up session, not counted
            one(server, 0)
        per_round: list[float] = []
        for r in range(1, rounds + 1):
            left = deadline_s - time.monotonic()
            if per_round and left < 1.2 * statistics.fmean(per_round):
                stopped = f"stopped after {r - 1} of {rounds} rounds at the step's deadline"
                break
            t0 = time.monotonic()
            order = ("default", "tuned") if r % 4 in (1, 0) else ("tuned", "default")  # ABBA
            for label in order:
                score, extra = one(servers[label], r)
                scores[label].append(score)
                details[label].append(extra)
            per_round.append(time.monotonic() - t0)
            log(f"round {r}: tuned/default {_ratio(scores, r - 1)}")
    verdict = compare("tuned", "default", scores["tuned"], scores["default"])
    return {"kind": kind, "budget_mib": budget_mib, "arms": held, "scores": scores, "rounds": details,
            "round_s": [round(x, 1) for x in per_round], "verdict": verdict.to_dict(), "said": verdict.describe(),
            **({"note": stopped} if stopped else {})}


def _ratio(scores: dict[str, list[float | None]], i: int) -> str:
    a, b = scores["tuned"][i], scores["default"][i]
    return f"{a / b:.3f}" if a and b else "n/a"


def _median(values: list[float | None]) -> float | None:
    got = [x for x in values if x]
    return statistics.median(got) if got else None


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or x != x or not x else format(x, fmt)  # None, NaN (no rounds) or 0


def rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per versus step: the verdict, each arm's median figure and its launch line."""
    out = []
    for name, step in state.get("steps", {}).items():
        res = step.get("result") or {}
        if not name.startswith("versus-"):
            continue
        v = res.get("verdict") or {}
        arms = res.get("arms") or {}
        scores = res.get("scores") or {}

        out.append({"run": name, "workload": res.get("kind"), "budget_mib": res.get("budget_mib"),
                    "rounds": v.get("rounds"), "ratio": v.get("ratio"), "low": v.get("low"), "high": v.get("high"),
                    "noise_pct": v.get("noise_pct"), "outcome": v.get("outcome"), "said": res.get("said"),
                    "tuned_score": _median(scores.get("tuned", [])),
                    "default_score": _median(scores.get("default", [])),
                    "tuned": (arms.get("tuned") or {}).get("launch_line"),
                    "default": (arms.get("default") or {}).get("launch_line"), "note": res.get("note")})
    return out


def markdown(state: dict[str, Any]) -> list[str]:
    found = rows(state)
    if not found:
        return []

    def per(x: float | None) -> str:
        return "-" if not x else f"{1 / x:.2f}"

    lines = ["## (b) the tuner's line vs llama.cpp's default, both loaded, interleaved rounds (valid weights)", "",
             "Seconds per agent session (a 2K system prompt cached, four turns of 1K new tokens and a 32-token reply) "
             "or per chat request (512 + 128 tokens), medians; the verdict is the project's own (99 %).", "",
             "| run | rounds | tuned s | default s | tuned/default | 99 % interval | noise % | verdict |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for r in found:
        interval = f"{r['low']:.2f}-{r['high']:.2f}x" if r["rounds"] and r["rounds"] > 1 else "-"
        lines.append(f"| {r['run']} | {r['rounds'] or 0} | {per(r['tuned_score'])} | {per(r['default_score'])} | "
                     f"{_num(r['ratio'], '.2f')}x | {interval} | {_num(r['noise_pct'], '.1f')} | "
                     f"{r['outcome'] or r['note'] or '-'} |")
    lines += ["", "Lines:", ""]
    for r in found:
        lines += [f"- {r['run']} tuned: `{r['tuned']}`", f"- {r['run']} default: `{r['default']}`"]
    return lines + [""]
