"""Sessions replayed on the real llama-server: the prompt cache works turn after turn where the engine can roll
back, a hybrid model without context checkpoints re-processes every turn (named, with the fix measured), and
the sliding-window demo shows what --swa-full changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner.core.config import LaunchConfig
from tuner.measure import session, session_run
from tuner.models import demo, gguf_reader

DEPTH, GEN = 1024, 8  # one thread: on a loaded shared machine, spinning threads cost more than they bring


@pytest.fixture(scope="module")
def swa_model(engine_loc, tmp_path_factory):
    """The tiny gpt-oss-shaped demo: every other layer attends over a 128-token window."""
    return demo.make_demo_models(arch="gpt-oss", out=tmp_path_factory.mktemp("swa"), engine=engine_loc)[0].path


def _replay(engine_loc, cfg, tmp_path, **kw):
    maker = session.session_maker(None, DEPTH, GEN)
    return session_run.run_session_trial(engine_loc, replace(cfg, threads=1), maker, GEN, log_dir=tmp_path, **kw)


def test_plain_attention_reuses_the_whole_previous_prompt(engine_loc, demo_models, tmp_path):
    cfg = LaunchConfig(model=demo_models[("qwen3moe", "Q8_0")], ctx=2048, parallel=1)
    trial = _replay(engine_loc, cfg, tmp_path)
    res = trial.result
    # Host RAM read over the replay (after the warm-up): measured, and nothing read back on the tiny model.
    assert trial.host_paging.measured and not trial.host_paging.paging, trial.host_paging.describe()
    turns = res.turns
    assert len(turns) >= 4 and turns[0].cached_tokens == 0
    assert 0.8 * DEPTH <= turns[-1].context_tokens + GEN <= DEPTH + 100  # the bundled session fills the depth
    for prev, t in zip(turns, turns[1:], strict=False):
        assert t.reusable_tokens == prev.context_tokens and t.context_tokens > prev.context_tokens
        # Everything up to the previous prompt's end comes from the cache (the reply differs: it is scripted).
        assert t.cached_tokens >= prev.context_tokens - 2, (t, prev)
        assert t.gen_tokens == GEN and t.ttft_s > 0
    assert res.reprocessed_share < 0.01 and not res.full_reprocess_turns
    assert res.session_s == pytest.approx(sum(t.elapsed_s for t in turns))


def test_hybrid_without_checkpoints_reprocesses_every_turn_and_the_fix_is_measured(engine_loc, demo_models,
                                                                                   tmp_path):
    path = demo_models[("qwen35moe", "Q8_0")]
    off = LaunchConfig(model=path, ctx=2048, parallel=1, ctx_checkpoints=0)
    bad = _replay(engine_loc, off, tmp_path / "off").result
    assert all(t.full_reprocess for t in bad.turns[1:]) and bad.reprocessed_share > 0.95
    assert all(t.cached_tokens == 0 for t in bad.turns)  # the recurrent state cannot be rolled back at all
    finding = session_run.diagnose(bad, gguf_reader.inspect_model(path), off)
    assert finding is not None and finding.turns == tuple(str(k) for k in range(2, len(bad.turns) + 1))
    assert finding.fix == replace(off, ctx_checkpoints=32)
    fixed = _replay(engine_loc, finding.fix, tmp_path / "on", trace=True)
    good = fixed.result
    assert not good.full_reprocess_turns and good.reprocessed_share < 0.05
    # The fix processes a small fraction of what the broken config processed.
    assert sum(t.processed_tokens for t in good.turns) < 0.3 * sum(t.processed_tokens for t in bad.turns)
    made = session_run.checkpoints_from_log(fixed.log_path.read_text(errors="replace"))
    assert made and all(c.of == 32 for c in made)


def test_sliding_window_session_with_and_without_swa_full(engine_loc, swa_model, tmp_path):
    base = LaunchConfig(model=swa_model, ctx=2048, parallel=1)
    window = _replay(engine_loc, base, tmp_path / "swa", trace=True)
    full = _replay(engine_loc, replace(base, swa_full=True), tmp_path / "full", trace=True)
    # With the full cache no checkpoint is needed (server-context.cpp: do_checkpoint needs n_swa > 0) and
    # every turn reuses the previous prompt.
    assert not session_run.checkpoints_from_log(full.log_path.read_text(errors="replace"))
    assert full.result.reprocessed_share < 0.01
    # With the window, checkpoints near each prompt's end let the turns reuse almost all of it.
    assert session_run.checkpoints_from_log(window.log_path.read_text(errors="replace"))
    assert window.result.reprocessed_share < 0.05


def test_a_users_session_file_is_replayed(engine_loc, demo_models, tmp_path):
    import json

    messages = [{"role": "system", "content": "You are a terse assistant. " * 20}]
    for k in range(3):
        messages += [{"role": "user", "content": f"Question {k}: " + "explain the cache. " * 15},
                     {"role": "assistant", "content": f"Answer {k}: it keeps the prompt."}]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"messages": messages}))
    cfg = LaunchConfig(model=demo_models[("qwen3moe", "Q8_0")], ctx=2048, parallel=1, threads=1)
    res = session_run.run_session_trial(engine_loc, cfg, session.session_maker(path, None, GEN), GEN,
                                        log_dir=tmp_path).result
    assert res.source == str(path) and len(res.turns) == 3
    assert res.turns[1].cached_tokens >= res.turns[0].context_tokens - 2 and not res.full_reprocess_turns


def test_two_agents_at_once_each_keep_their_own_slot(engine_loc, demo_models, tmp_path):
    """-np 2 with two agents: their turns overlap in time (the wall time is well under the sum of the turns),
    and each agent's later turns come from its own slot's cache, not the other's."""
    cfg = LaunchConfig(model=demo_models[("qwen3moe", "Q8_0")], ctx=2 * 2048, parallel=2, threads=1)
    makers = session.session_makers(None, DEPTH, GEN, agents=2)
    res = session_run.run_session_trial(engine_loc, cfg, makers, GEN, log_dir=tmp_path).result
    assert res.agents == 2
    for agent in (0, 1):
        own = [t for t in res.turns if t.agent == agent]
        assert len(own) >= 4 and own[0].reusable_tokens == 0
        for prev, t in zip(own, own[1:], strict=False):
            assert t.reusable_tokens == prev.context_tokens
            assert t.cached_tokens >= prev.context_tokens - 2, (t, prev)  # its own history, whole
    assert not res.full_reprocess_turns
    assert res.session_s < 0.8 * res.total_turn_s  # they ran side by side, not one after the other
