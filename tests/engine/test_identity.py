"""The engine's identity, spelled one way (tuner.engine.identity): which builds are the same, how each is named, the
engine block of result.json and records, and the note a plan gives when its replay follows another commit."""

from __future__ import annotations

from tuner.engine.identity import PIN, REPLAY_COMMIT, EngineIdentity, replay_note, same_commit


def test_the_same_commit_is_a_hash_prefix_and_never_an_unknown_one():
    assert same_commit("0c1e57098", "0c1e570982b4f6a1d1e6f5dbf2f4c6e1d2a3b4c5")  # llama.cpp prints 9 digits
    assert same_commit("0C1E57098", "0c1e57098")
    assert not same_commit("0c1e57098", "0c1e57099")
    assert not same_commit("b11434", "b1143")  # release tags are names: equal or not the same
    assert not same_commit("unknown", "unknown") and not same_commit(None, "b11434")


def test_each_build_is_named_in_the_users_words():
    assert EngineIdentity("b11434", "x", "11434", "cpu").describe() == "llama.cpp b11434 (cpu)"
    assert EngineIdentity(PIN.commit, backend="cuda").describe() == f"llama.cpp {PIN.commit} (cuda, the pinned build)"
    assert EngineIdentity("unknown", build_number="0", backend="cpu").name == "llama.cpp of unknown commit"
    assert EngineIdentity("unknown", build_number="6500").name == "llama.cpp build 6500 (commit unknown)"
    assert not EngineIdentity("unknown").known and not EngineIdentity("unknown").pinned


def test_the_engine_block_reads_back_and_older_blocks_read_as_unknown():
    ident = EngineIdentity("b11434", "0.5.0-dev", "11434", "cuda", "f16-f16;q8_0-q8_0")
    assert EngineIdentity.from_dict(ident.to_dict()) == ident
    old = EngineIdentity.from_dict({"commit": "abc1234", "backend": "cuda"})  # a result.json from before build_number
    assert (old.commit, old.build_number, old.backend, old.fa_quants) == ("abc1234", "unknown", "cuda", None)
    assert EngineIdentity.from_dict(None) == EngineIdentity("unknown")


def test_the_replay_says_whose_figures_it_follows_unless_the_engine_is_the_pin():
    assert PIN.commit == REPLAY_COMMIT
    assert replay_note(EngineIdentity(PIN.commit)) is None
    assert replay_note(EngineIdentity("b11434")) == (
        f"memory figures: the replay follows llama.cpp {PIN.commit}; the engine here is llama.cpp b11434")
    assert replay_note(EngineIdentity("unknown")) == (
        f"memory figures: the replay follows llama.cpp {PIN.commit}; the engine here reports no commit "
        "(llama.cpp of unknown commit)")
    assert "no engine found" in (replay_note(None) or "")
