"""A line's standing in the race (tuner.versus.standing) and what issue 66 asked of it: paging decides only when it
repeats or the plan says the line does not fit; rounds are paired by their number; "hopeless" needs the rounds a
verdict needs; the stop asks whether any line still in could become the printed one; "simpler" counts settings
changed from the engine's default; the rule, the stop and the drop read one standing.

Scores are what the race would have measured round by round; the verdicts over them are the real ones."""

from __future__ import annotations

from pathlib import Path

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.search.verdict import BETTER, UNDECIDED, WORSE, compare, decidable
from tuner.versus import judge
from tuner.versus.lines import REFERENCE, EngineLine, changed_settings
from tuner.versus.rule import choose, out_of_running, settled
from tuner.versus.standing import IN, PAGED, SLOWER, standings

M = Path("/m.gguf")
IK_DEFAULT, IK_TUNED = "ik_llama.cpp default", "ik_llama.cpp tuned"
BASE = LaunchConfig(model=M, ctx=4096, parallel=1)
IK_BASE = LaunchConfig(model=M, ctx=4096, parallel=1, engine="ik_llama.cpp")
IK_RTR = LaunchConfig(model=M, ctx=4096, parallel=1, engine="ik_llama.cpp", threads=2, flash_attn=FlashAttn.ON,
                      run_time_repack=True, cache_ram_mib=3072)


def _line(label: str, cfg: LaunchConfig, base: LaunchConfig) -> EngineLine:
    return EngineLine(label, cfg.engine, cfg, "s", Path("r"), Path("b"), "default" if "default" in label else "tuned",
                      changed=changed_settings(cfg, base, 2))


LINES = [_line(REFERENCE, BASE, BASE), _line(IK_DEFAULT, IK_BASE, IK_BASE), _line(IK_TUNED, IK_RTR, IK_BASE)]


def _arm(label: str, scores: list[float | None], *, paged: tuple[int, ...] = (), numbers: list[int] | None = None,
         plan_pages: str | None = None) -> judge.Arm:
    nums = numbers or list(range(1, len(scores) + 1))
    return judge.Arm(label, "", tuple(judge.Round(s, host_paging="read 373 MiB back" if n in paged else None, number=n)
                                      for s, n in zip(scores, nums, strict=True)), plan_pages=plan_pages)


def _race(*arms: judge.Arm) -> judge.HeadToHead:
    return judge.HeadToHead(arms, "end-to-end request time")


def test_one_paging_round_is_that_round_s_noise_two_or_the_plan_make_it_the_line_s():
    # The Qwen3-30B-A3B chat run: llama.cpp's default paged in 1 of 3 rounds (373 MiB right after a resident arm took
    # the page cache) and was marked "does not fit" for good; its other rounds ran at its speed.
    once = _arm(REFERENCE, [1.0, 0.6, 1.01], paged=(2,))
    assert once.paging is None and once.paged_rounds == 1
    assert once.quiet_scores() == [1.0, None, 1.01]  # left out like a busy round, and said as such
    assert "paged in this round alone" in (once.noise_of(once.rounds[1]) or "")
    assert once.score == 1.005  # the median of the rounds it ran clean
    assert _arm(REFERENCE, [1.0, 0.6, 0.62], paged=(2, 3)).paging == "read 373 MiB back"  # it repeats
    assert _arm(REFERENCE, [1.0, 0.6, 1.01], paged=(2,), plan_pages="17.3 GiB mapped and 16 GiB repacked beside 23 "
                "GiB").paging == "read 373 MiB back"  # the plan says it does not fit: one round is enough
    st = standings(LINES[:2], _race(once, _arm(IK_DEFAULT, [1.3, 1.32, 1.29])))
    assert st[REFERENCE].state != PAGED


def test_rounds_are_paired_by_their_number_not_their_position():
    # ik default sat out rounds 2 and 3 (out of the running), then came back in rounds 4 and 5.
    ref = _arm(REFERENCE, [1.0, 2.0, 2.0, 1.0, 1.0])
    back = _arm(IK_DEFAULT, [1.5, 1.5, 1.5], numbers=[1, 4, 5])
    race = _race(ref, back)
    v = race.pair(IK_DEFAULT, REFERENCE)
    assert v.rounds == 3 and v.outcome == BETTER and abs(v.ratio - 1.5) < 1e-9  # rounds 1, 4, 5 against 1, 4, 5
    by_position = compare(IK_DEFAULT, REFERENCE, back.scores, ref.scores)  # 1.5/1, 1.5/2, 1.5/2: the old pairing
    assert by_position.outcome == UNDECIDED


def test_hopeless_needs_the_rounds_a_verdict_needs():
    # The agent run: ik tuned against ik default 1.34x on 2 clean rounds (1.07-1.69) was called hopeless and the race
    # stopped; two rounds are one degree of freedom and say nothing of what a third would.
    two = compare("ik tuned", "ik default", [1.1, 1.6], [1.0, 1.0])
    assert two.outcome == UNDECIDED and two.rounds == 2
    assert decidable(two, 1)  # its noise from two rounds would call it hopeless: it is not known yet
    three = compare("a", "b", [1.0, 1.3, 0.8], [1.0, 1.0, 1.0])
    assert not decidable(three, 1)  # with its noise known, one more round cannot decide it


def test_the_race_goes_on_while_a_line_could_still_be_decided_faster_than_the_default():
    # ik tuned is decided faster than the default and printed; ik default, simpler, is undecided against both but
    # could yet be decided faster than the default, and then, undecided against ik tuned, it would be printed as the
    # simpler line: the race must not stop. The old stop asked only ik default against the printed line.
    ref = _arm(REFERENCE, [1.0, 1.0, 1.0])
    ik_tuned = _arm(IK_TUNED, [1.40, 1.45, 1.42])
    ik_default = _arm(IK_DEFAULT, [1.30, 1.22, 1.38])
    race = _race(ref, ik_default, ik_tuned)
    assert choose(LINES, race)[0] == IK_TUNED
    assert race.pair(IK_DEFAULT, REFERENCE).outcome == UNDECIDED and decidable(race.pair(IK_DEFAULT, REFERENCE), 2)
    assert not decidable(race.pair(IK_TUNED, IK_DEFAULT), 2)  # the old stop's one question: hopeless
    assert not settled(LINES, 5)(race)
    # decided against the default and hopeless against ik tuned: nothing more rounds could change
    race = _race(ref, _arm(IK_DEFAULT, [1.40, 1.36, 1.50]), ik_tuned)
    assert race.pair(IK_DEFAULT, REFERENCE).outcome == BETTER
    assert settled(LINES, 4)(race) is not decidable(race.pair(IK_TUNED, IK_DEFAULT), 1)


def test_simpler_counts_settings_changed_from_the_engine_s_default_not_words():
    # -t 2 where the default runs 2 threads and -fa on where auto is on change nothing; -cram 3072 is one setting
    # (two words), -rtr one.
    assert changed_settings(IK_RTR, IK_BASE, 2) == ("cache_ram_mib", "run_time_repack")
    assert changed_settings(IK_RTR, IK_BASE, 4) == ("threads", "threads_batch", "cache_ram_mib", "run_time_repack")
    q8 = LaunchConfig(model=M, ctx=4096, parallel=1, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0)
    assert changed_settings(q8, BASE, 2) == ("cache_type_k", "cache_type_v")


def test_the_rule_the_stop_and_the_drop_read_one_standing():
    ref = _arm(REFERENCE, [1.0, 1.02, 0.99])
    slow = _arm(IK_DEFAULT, [0.7, 0.71, 0.69])  # decided slower than the default
    fast = _arm(IK_TUNED, [1.5, 1.52, 1.49], paged=(1, 2))  # paged twice: out
    race = _race(ref, slow, fast)
    st = standings(LINES, race)
    assert (st[REFERENCE].state, st[IK_DEFAULT].state, st[IK_TUNED].state) == (IN, SLOWER, PAGED)
    assert st[IK_DEFAULT].slower_than == REFERENCE and st[IK_DEFAULT].verdict is not None
    assert st[IK_DEFAULT].verdict.outcome == WORSE
    assert out_of_running(LINES)(race) == {IK_DEFAULT, IK_TUNED}
    assert choose(LINES, race)[0] == REFERENCE
    assert settled(LINES, 5)(race)
