"""An agent session as it is lived: a system prompt with tool schemas, then turns that append a message and
wait for the reply, the context growing turn after turn. What the user waits for is each turn.

A :class:`Session` is what the client sends: the system text and, per turn, the messages appended before the
model answers and the reply that is written back into the history. Replies are scripted (the bundled text, or
the assistant messages of the user's file), never the generated text, so every config under test replays the
same conversation token for token; the model still generates ``gen_tokens`` per turn. The bundled session is
cut from the bundled corpus (tuner.quality.corpus) and sized in the model's own tokens; ``--session FILE``
reads an OpenAI-style messages file (``{"messages": [...], "tools": [...]}`` or a bare list of messages).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.errors import NoRoomError, UsageError

ROLES = ("system", "user", "assistant", "tool")
APPENDED_ROLES = ("user", "tool")
DEFAULT_DEPTH = 8192
DEFAULT_GEN_TOKENS = 64
MIN_DEPTH = 256  # below this a system prompt with tool schemas leaves no room for a second turn

# The bundled session's tools: an agent's usual four, as OpenAI function schemas (our own wording).
TOOLS: tuple[dict[str, Any], ...] = tuple(
    {"type": "function", "function": {"name": name, "description": what, "parameters": {
        "type": "object", "properties": {p: {"type": "string", "description": d} for p, d in params},
        "required": [params[0][0]]}}}
    for name, what, params in (
        ("read_file", "Return the text of a file in the working tree, with line numbers.",
         (("path", "file path relative to the repository root"), ("range", "optional line range such as 10-80"))),
        ("search", "Search the working tree for a regular expression and list matching lines.",
         (("pattern", "a regular expression"), ("glob", "optional file glob to limit the search"))),
        ("run", "Run a shell command in the repository root and return its output and exit status.",
         (("command", "the command line"), ("timeout", "seconds before the command is stopped"))),
        ("edit_file", "Replace one exact passage of a file with new text.",
         (("path", "file path"), ("old", "the exact text to replace"), ("new", "the replacement text"))),
    )
)


@dataclass(frozen=True, slots=True)
class Turn:
    """Messages appended before the model answers, and the reply then written into the history."""

    appended: tuple[dict[str, Any], ...]
    reply: str


@dataclass(frozen=True, slots=True)
class Session:
    system: str
    turns: tuple[Turn, ...]
    source: str  # "bundled" or the file it was read from

    def messages_before(self, k: int) -> list[dict[str, Any]]:
        """What the client sends for turn ``k`` (0-based): the history so far and turn k's new messages."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for turn in self.turns[:k]:
            out += [*turn.appended, {"role": "assistant", "content": turn.reply}]
        return out + list(self.turns[k].appended)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "turns": len(self.turns), "system_chars": len(self.system)}


def system_text(body: str, tools: Sequence[dict[str, Any]]) -> str:
    """The system message with the tool schemas written into it, as agent templates render them. They go in
    the text rather than the request's ``tools`` so every chat template sees them and no reply is parsed as a
    tool call (random-weight models write anything)."""
    if not tools:
        return body
    schemas = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return f"{body}\n\n# Tools\nYou may call these functions:\n<tools>\n{schemas}\n</tools>"


def _pieces(kind: str) -> list[str]:
    from tuner.quality import corpus

    docs = corpus.documents(corpus.DocumentKind(kind))
    return [seg for d in docs for seg in corpus.split_segments(d.text, 400)]


def _take(pieces: list[str], start: int, chars: int) -> tuple[str, int]:
    """Whole pieces from ``start`` (wrapping) until ``chars`` characters, cut at the last line end within."""
    out: list[str] = []
    i = start
    while sum(len(p) + 2 for p in out) < chars:
        out.append(pieces[i % len(pieces)])
        i += 1
    text = "\n\n".join(out)[:chars]
    cut = text.rfind("\n")
    return (text[:cut] if cut > chars // 2 else text), i


def bundled_session(count_tokens: Callable[[str], int], depth_tokens: int = DEFAULT_DEPTH, *,
                    gen_tokens: int = DEFAULT_GEN_TOKENS, turn_tokens: int | None = None,
                    system_tokens: int | None = None, agent: int = 0) -> Session:
    """The default session, sized in the model's own tokens (``count_tokens``): a system prompt of technical
    text with the tool schemas that fit in it (about a quarter of the depth, at most 4096 tokens), then turns
    alternating a tool result (code) and a user message (dialogue), each about ``turn_tokens`` (a sixteenth of
    the depth), answered by a reply of about ``gen_tokens`` of prose, until the context reaches ``depth_tokens``.

    ``agent`` numbers concurrent sessions (``-np 2``: two agents): they share the system prompt, as two agents
    of one product do, and their turns are cut from other places of the corpus, so their histories part after
    it."""
    if depth_tokens < MIN_DEPTH:
        raise UsageError(f"--depth {depth_tokens} is too short for an agent session: use {MIN_DEPTH} tokens or more")
    system_tokens = system_tokens or min(4096, depth_tokens // 4)
    turn_tokens = turn_tokens or max(64, depth_tokens // 16)
    kinds = {k: _pieces(k) for k in ("technical", "code", "dialogue", "prose")}
    at = dict.fromkeys(kinds, 0)

    def cut(kind: str, tokens: int, reserve_chars: int = 0) -> tuple[str, int]:
        """About ``tokens`` tokens of ``kind`` (one correction after counting), and their exact count."""
        sample = "\n\n".join(kinds[kind][:4])
        chars = tokens * len(sample) / max(1, count_tokens(sample))
        for _ in range(2):
            text, end = _take(kinds[kind], at[kind], max(16, int(chars) - reserve_chars))
            n = count_tokens(text)
            if abs(n - tokens) <= tokens // 10:
                break
            chars *= tokens / max(1, n)
        at[kind] = end
        return text, n

    # The tool schemas are kept while they fit the system prompt's share (at least one): a byte-level vocabulary
    # (shape-true models: one token per byte) spends ~1,600 tokens on all four, which once made the first turn
    # of a depth-2048 session 1,842 tokens long and left room for two turns.
    tools = list(TOOLS)
    tools_tokens = count_tokens(system_text("", tools))
    while len(tools) > 1 and tools_tokens > system_tokens - 64:
        tools.pop()
        tools_tokens = count_tokens(system_text("", tools))
    body, _ = cut("technical", max(64, system_tokens - tools_tokens))
    system = system_text("You are a coding agent working in the user's repository.\n\n" + body, tools)
    for kind in ("code", "dialogue", "prose"):  # agent k starts its turns k golden-ratio turns of the corpus on
        at[kind] += int(agent * 0.618 * len(kinds[kind]))
    used = count_tokens(system)
    turns: list[Turn] = []
    while used + turn_tokens + gen_tokens <= depth_tokens:
        k = len(turns)
        kind, role = ("code", "tool") if k % 2 else ("dialogue", "user")
        text, n_text = cut(kind, turn_tokens)
        reply, n_reply = cut("prose", gen_tokens)
        message = {"role": role, "content": text} | ({"tool_call_id": f"call_{k}"} if role == "tool" else {})
        turns.append(Turn((message,), reply))
        used += n_text + n_reply
    if not turns:
        raise NoRoomError(depth_tokens, used)
    return Session(system, tuple(turns), "bundled")


def load_session(path: Path) -> Session:
    """A user's session file: OpenAI chat messages (and optional tools), as an agent exports them. Each
    assistant message is a turn's reply; the user and tool messages before it are what the turn appends."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--session {path}: no such file: check the path") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"--session {path} is not JSON ({exc}): export the messages as JSON") from None
    messages, tools = (raw, []) if isinstance(raw, list) else (
        (raw.get("messages"), raw.get("tools") or []) if isinstance(raw, dict) else (None, []))
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"--session {path} has no messages: give a list of messages or {{\"messages\": [...]}}")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UsageError(f"--session {path}: \"tools\" must be a list of OpenAI tool schemas")
    system: list[str] = []
    turns: list[Turn] = []
    pending: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role, content = _check_message(path, i, msg)
        if role == "system":
            if turns or pending:
                raise UsageError(f"--session {path}: message {i} is a system message after the conversation "
                                 "started: put system text first")
            system.append(content)
        elif role == "assistant":
            if not pending:
                raise UsageError(f"--session {path}: message {i} is an assistant reply with nothing before it to "
                                 "answer: each reply must follow a user or tool message")
            turns.append(Turn(tuple(pending), content))
            pending = []
        else:
            pending.append({"role": role, "content": content} |
                           ({"tool_call_id": str(msg.get("tool_call_id", f"call_{i}"))} if role == "tool" else {}))
    if pending:  # the conversation ends on the user's side: one more turn, answered freely
        turns.append(Turn(tuple(pending), ""))
    if not turns:
        raise UsageError(f"--session {path} has no user or tool message to answer: add the conversation")
    return Session(system_text("\n\n".join(system), tools), tuple(turns), str(path))


def _check_message(path: Path, i: int, msg: object) -> tuple[str, str]:
    if not isinstance(msg, dict) or msg.get("role") not in ROLES:
        raise UsageError(f"--session {path}: message {i} needs a \"role\" of {', '.join(ROLES)}")
    content = msg.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content):
            raise UsageError(f"--session {path}: message {i} has non-text content parts: only text is replayed")
        content = "".join(str(p) for p in parts)
    if content is None and msg.get("tool_calls"):
        content = json.dumps(msg["tool_calls"], sort_keys=True)  # an assistant's tool call, as text
    if not isinstance(content, str):
        raise UsageError(f"--session {path}: message {i} needs text \"content\"")
    return str(msg["role"]), content


def check_room(depth_tokens: int | None, gen_tokens: int, tokenize: Callable[[str], list[int]], model: str
               ) -> None:
    """Refuse, before anything is measured, a depth at which the bundled session has no turn in ``model``'s own
    tokens (``tokenize``: :func:`tuner.engine.tokenizer.model_tokenizer`; a byte-level vocabulary spends about
    four times the tokens of a real one on the same text), naming a depth that leaves room (doubling, up to 64K)."""
    depth = depth_tokens or DEFAULT_DEPTH
    try:  # one token per byte is the most any vocabulary spends: room there is room in every model's tokens
        bundled_session(lambda text: len(text.encode()), depth, gen_tokens=gen_tokens)
        return
    except NoRoomError:
        pass

    def count(text: str) -> int:
        return len(tokenize(text))

    try:
        bundled_session(count, depth, gen_tokens=gen_tokens)
    except NoRoomError as exc:
        enough = None
        for more in (depth * 2**k for k in range(1, 8)):
            if more > 65536:
                break
            try:
                bundled_session(count, more, gen_tokens=gen_tokens)
            except NoRoomError:
                continue
            enough = more
            break
        raise NoRoomError(depth, exc.system_tokens, model, enough) from None


def session_maker(path: Path | None, depth_tokens: int | None, gen_tokens: int, *, agent: int = 0
                  ) -> Callable[[Callable[[str], list[int]]], Session]:
    """What a trial replays, given the server's tokenizer: the user's file (read and checked now, before any
    server starts) or the bundled session sized to ``depth_tokens`` in that model's tokens. Concurrent agents
    (``agent`` 1, 2, ...) replay the same file, or bundled sessions of their own after the shared system prompt.
    The depth is checked here with four characters to a token; :func:`check_room` checks it in a model's own."""
    if path is not None:
        loaded = load_session(path)
        return lambda _tokenize: loaded
    depth = depth_tokens or DEFAULT_DEPTH
    bundled_session(lambda text: len(text) // 4, depth, gen_tokens=gen_tokens)  # refuse a bad depth up front
    return lambda tokenize: bundled_session(lambda text: len(tokenize(text)), depth, gen_tokens=gen_tokens,
                                            agent=agent)


def session_makers(path: Path | None, depth_tokens: int | None, gen_tokens: int, agents: int = 1
                   ) -> list[Callable[[Callable[[str], list[int]]], Session]]:
    """One :func:`session_maker` per concurrent agent."""
    if agents < 1:
        raise UsageError(f"{agents} agents: an agent session needs one or more")
    return [session_maker(path, depth_tokens, gen_tokens, agent=k) for k in range(agents)]
