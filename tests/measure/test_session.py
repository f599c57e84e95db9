"""The agent session: the bundled one sized in the model's tokens, a user's messages file read (or refused in one
line), per-turn and per-session figures from the server's timings, and full re-processes named with their fix."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.measure import session, session_run
from tuner.measure.session_run import SessionResult, TurnResult
from tuner.models import gguf_reader


def _words(text: str) -> int:
    return len(text.split())  # a stand-in tokenizer: one token per word


def test_bundled_session_fills_the_depth_and_grows_by_appending():
    ses = session.bundled_session(_words, 4096, gen_tokens=32)
    system = _words(ses.system)
    assert 900 <= system <= 1100  # a quarter of the depth, tool schemas included
    assert all(t["function"]["name"] in ses.system for t in session.TOOLS)
    appended = [_words(m["content"]) for t in ses.turns for m in t.appended]
    assert all(217 <= n <= 295 for n in appended), appended  # a sixteenth of the depth each (256), ±15 %
    total = system + sum(appended) + sum(_words(t.reply) for t in ses.turns)
    assert 3000 <= total <= 4096 and len(ses.turns) >= 10
    # Each turn's messages extend the previous turn's: the history is never rewritten.
    two, three = ses.messages_before(1), ses.messages_before(2)
    assert three[:len(two)] == two and three[len(two)]["role"] == "assistant"
    assert {m["role"] for t in ses.turns for m in t.appended} == {"user", "tool"}
    with pytest.raises(UsageError, match="too short"):
        session.bundled_session(_words, 100)


def _write(tmp_path: Path, body: object) -> Path:
    path = tmp_path / "s.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


def test_user_session_file_is_replayed_turn_by_turn(tmp_path):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"},
        {"role": "assistant", "content": [{"type": "text", "text": "Two files."}]},
        {"role": "user", "content": "Thanks."},
    ]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    ses = session.load_session(_write(tmp_path, {"messages": messages, "tools": tools}))
    assert len(ses.turns) == 3 and ses.turns[1].reply == "Two files." and ses.turns[2].reply == ""
    assert ses.system.startswith("You are terse.") and '"name": "ls"' in ses.system
    assert ses.turns[1].appended == ({"role": "tool", "content": "a.py b.py", "tool_call_id": "c1"},)
    assert '"name": "ls"' in ses.turns[0].reply  # the tool call, replayed as text
    assert session.load_session(_write(tmp_path, messages)).turns[0].appended[0]["content"] == "List the files."


@pytest.mark.parametrize(("body", "says"), [
    ("{not json", "is not JSON"),
    ({"messages": []}, "has no messages"),
    ([{"role": "robot", "content": "x"}], "needs a \"role\""),
    ([{"role": "user", "content": 3}], "needs text"),
    ([{"role": "assistant", "content": "hi"}], "nothing before it to answer"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "after the conversation started"),
    ([{"role": "system", "content": "only"}], "no user or tool message"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": "x"}, "must be a list"),
])
def test_malformed_session_is_refused_in_one_line(tmp_path, body, says):
    with pytest.raises(UsageError, match=says) as exc:
        session.load_session(_write(tmp_path, body))
    assert "\n" not in str(exc.value)
    with pytest.raises(UsageError, match="no such file"):
        session.load_session(tmp_path / "missing.json")


def _turn(k: int, context: int, cached: int, previous: int, s: float = 1.0) -> TurnResult:
    return TurnResult(k, context, cached, context - cached, previous, 0.1, 0.05, 8, 20.0, s)


def test_session_figures_from_the_server_timings():
    # Turn 2 reused the first prompt; turn 3 re-processed all of it (as a hybrid model without checkpoints does).
    res = SessionResult((_turn(0, 1000, 0, 0), _turn(1, 1300, 996, 1000), _turn(2, 1600, 0, 1300, 3.0)), 5.0)
    assert [t.reprocessed_tokens for t in res.turns] == [0, 4, 1300]
    assert [t.full_reprocess for t in res.turns] == [False, False, True]
    assert res.reprocessed_share == pytest.approx(1304 / 2300)
    assert res.score() == pytest.approx(0.2) and res.turns[1].cached_share == pytest.approx(996 / 1300)
    back = SessionResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert back == res


@pytest.fixture(scope="module")
def infos(tmp_path_factory):
    """Headers of the three demo shapes (written without the engine: no quantization)."""
    from tuner.models import demo_model

    out = tmp_path_factory.mktemp("shapes")
    return {arch: gguf_reader.inspect_model(demo_model.write_demo_model(out / f"{arch}.gguf", arch=arch))
            for arch in ("qwen3moe", "qwen35moe", "gpt-oss")}


def test_full_reprocess_is_named_with_the_setting_that_fixes_it(infos):
    bad = SessionResult((_turn(0, 1000, 0, 0), _turn(1, 1300, 0, 1000)), 2.0)
    good = SessionResult((_turn(0, 1000, 0, 0), _turn(1, 1300, 990, 1000)), 2.0)
    hybrid, swa, plain = infos["qwen35moe"], infos["gpt-oss"], infos["qwen3moe"]
    cfg = LaunchConfig(model=Path("m.gguf"))
    assert session_run.diagnose(good, hybrid, cfg) is None
    off = session_run.diagnose(bad, hybrid, LaunchConfig(model=Path("m.gguf"), ctx_checkpoints=0))
    assert off is not None and off.turns == ("2",) and off.fix is not None and off.fix.ctx_checkpoints == 32
    assert "--ctx-checkpoints 32" in off.describe() and "recurrent state" in off.describe()
    window = session_run.diagnose(bad, swa, cfg)
    assert window is not None and window.fix is not None and window.fix.swa_full and "--swa-full" in window.fix_text
    spaced = session_run.diagnose(bad, hybrid, cfg)
    assert spaced is not None and spaced.fix is not None
    assert (spaced.fix.ctx_checkpoints, spaced.fix.checkpoint_min_step) == (64, 2048)
    rewritten = session_run.diagnose(bad, plain, cfg)
    assert rewritten is not None and rewritten.fix is None and "rewrote" in rewritten.cause


def test_cli_rejects_a_malformed_session_file_in_one_line(tmp_path):
    from tests.conftest import run_cli

    bad = _write(tmp_path, [{"role": "assistant", "content": "hello"}])
    (tmp_path / "x.gguf").write_bytes(b"")  # refused before any model is read
    for cmd in (["bench", "--workload", "agent"], ["auto-tune", "--workload", "agent"]):
        res = run_cli(*cmd, "--session", str(bad), str(tmp_path / "x.gguf"), timeout=120)
        assert res.returncode == 1, res.stderr
        [line] = res.stderr.strip().splitlines()
        assert line.startswith("error: --session ") and "nothing before it to answer" in line, line
    res = run_cli("bench", "--session", str(bad), str(tmp_path / "x.gguf"), timeout=120)
    assert res.returncode == 1 and "add --workload agent" in res.stderr


def test_two_agents_share_the_system_prompt_and_part_after_it():
    one, two = (session.bundled_session(_words, 2048, gen_tokens=32, agent=k) for k in (0, 1))
    assert one.system == two.system and len(one.turns) >= 3 and len(two.turns) >= 3
    assert one.messages_before(0)[1] != two.messages_before(0)[1]  # their first turns already differ
    assert not {t.reply for t in one.turns} & {t.reply for t in two.turns}
    # Each agent's figures count only its own history: agent 2's first turn has nothing to reuse.
    turns = (_turn(0, 1000, 0, 0), _turn(1, 1300, 996, 1000),
             replace(_turn(0, 1000, 990, 0), agent=1), replace(_turn(1, 1400, 1000, 1000, 3.0), agent=1))
    both = SessionResult(turns, 3.5)
    assert both.agents == 2 and [t.name(2) for t in turns] == ["1.1", "1.2", "2.1", "2.2"]
    assert SessionResult.from_dict(json.loads(json.dumps(both.to_dict()))) == both
    assert both.reprocessed_share == pytest.approx(4 / 2000)


def test_a_byte_level_vocabulary_keeps_the_session_a_session():
    """Shape-true models encode text byte by byte (`vocab.synthetic_vocab`): all four tool schemas are ~1,600
    tokens there. On the gpt-oss-20b shape at depth 2048 the first turn once carried 1,842 tokens and the session
    had two turns (results/benchmarks/agent_session_real.md); the schemas kept are those that fit the system
    prompt's quarter of the depth, so the turns fill the rest."""
    def byte_tokens(text: str) -> int:
        return len(text.encode())

    assert byte_tokens(session.system_text("", session.TOOLS)) > 1500
    ses = session.bundled_session(byte_tokens, 2048, gen_tokens=16)
    assert 448 <= byte_tokens(ses.system) <= 2048 // 4 + 64
    assert session.TOOLS[0]["function"]["name"] in ses.system and len(ses.turns) >= 8
    # Where the schemas fit, all four are kept.
    assert all(t["function"]["name"] in session.bundled_session(byte_tokens, 16384).system for t in session.TOOLS)


def test_a_depth_with_no_room_in_the_models_own_tokens_is_refused_with_a_depth_that_has_room():
    """The estimate (four characters a token) lets --depth 512 through; a byte-level vocabulary (shape-true
    models) does not: a real run tuned two such models for 44 minutes and then stopped on it
    (results/benchmarks/compare-models-qwen-real.md: refused at 512, replayed at 2048)."""
    session.session_maker(None, 512, 32)  # the estimate: room

    def byte_ids(text: str) -> list[int]:
        return list(text.encode())

    with pytest.raises(session.NoRoomError) as err:
        session.check_room(512, 32, byte_ids, "shape.gguf")
    msg = str(err.value)
    assert msg.startswith("--depth 512 leaves no room for a turn after the system prompt (") and "shape.gguf" in msg
    enough = int(msg.rsplit("raise --depth to ", 1)[1].split()[0].replace(",", ""))
    assert 512 < enough <= 2048 and len(session.bundled_session(lambda t: len(byte_ids(t)), enough, gen_tokens=32)
                                        .turns) >= 1
    assert err.value.system_tokens > 512 - 32 - 64  # the system prompt alone leaves less than a turn and a reply
    session.check_room(512, 32, lambda text: [0] * (len(text) // 4), "real-vocab.gguf")  # a real vocabulary: room
