"""Which line the engines' race prints (tuner.versus.rule.choose): one decided faster than llama.cpp's default in
the race's rounds and decided slower than no other line; the fastest such, or the simpler where undecided between
them; never a line decided slower than another, one that paged host RAM or broke the VRAM budget, or one refused by
its price; llama.cpp's default where nothing wins; nothing, said, where nothing can run.

The verdicts are the real ones (tuner.search.verdict over the rounds' scores below), not stubs: each table of scores is
what the race would have measured, round by round."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.search.verdict import BETTER, UNDECIDED, WORSE
from tuner.versus import judge
from tuner.versus.engines import EngineChoice
from tuner.versus.lines import REFERENCE, EngineLine, changed_settings
from tuner.versus.rule import choose, out_of_running, settled
from tuner.versus.standing import Gates

M = Path("/m.gguf")
LLAMA_TUNED, IK_DEFAULT, IK_TUNED = "llama.cpp tuned", "ik_llama.cpp default", "ik_llama.cpp tuned"
CONFIGS = {
    REFERENCE: LaunchConfig(model=M, ctx=4096, parallel=1),
    LLAMA_TUNED: LaunchConfig(model=M, ctx=4096, parallel=1, threads=2, flash_attn=FlashAttn.OFF),
    IK_DEFAULT: LaunchConfig(model=M, ctx=4096, parallel=1, engine="ik_llama.cpp"),
    IK_TUNED: LaunchConfig(model=M, ctx=4096, parallel=1, engine="ik_llama.cpp", run_time_repack=True,
                           cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON),
}
# Per-round scores (higher is faster): steady, clearly faster, equal-but-noisy.
STEADY = (1.00, 1.02, 0.99, 1.01)
FAST = (1.70, 1.75, 1.68, 1.73)
FASTER = (2.10, 2.16, 2.05, 2.12)
NOISY = (1.10, 1.60, 0.95, 1.45)


def _lines(labels: list[str]) -> list[EngineLine]:
    def base(x: str) -> LaunchConfig:
        return CONFIGS[REFERENCE] if CONFIGS[x].engine == "llama.cpp" else CONFIGS[IK_DEFAULT]

    return [EngineLine(x, CONFIGS[x].engine, CONFIGS[x], "s", Path("r"), Path("b"), "default" if "default" in x
                       else "tuned", changed=changed_settings(CONFIGS[x], base(x), 2)) for x in labels]


def _race(scores: dict[str, tuple[float | None, ...]], paged: tuple[str, ...] = (), vram: dict[str, int] | None = None,
          budget: int | None = None, busy: dict[str, tuple[int, ...]] | None = None) -> judge.HeadToHead:
    arms = []
    for label, xs in scores.items():
        rounds = tuple(judge.Round(s, noise="a browser took 0.6 cores" if i in (busy or {}).get(label, ()) else None,
                                   host_paging="read 900 MiB back from disk" if label in paged else None,
                                   vram_growth_bytes=(vram or {}).get(label), number=i + 1) for i, s in enumerate(xs))
        arms.append(judge.Arm(label, "", rounds, None if any(s is not None for s in xs) else "it crashed"))
    return judge.HeadToHead(tuple(arms), "end-to-end request time", (), None, budget)


def test_the_race_s_verdicts_are_the_real_ones():
    race = _race({REFERENCE: STEADY, IK_TUNED: FAST, IK_DEFAULT: NOISY})
    assert race.pair(IK_TUNED, REFERENCE).outcome == BETTER
    assert race.pair(IK_DEFAULT, REFERENCE).outcome == UNDECIDED
    assert race.pair(REFERENCE, IK_TUNED).outcome == WORSE


def test_a_decided_win_over_the_default_is_printed_though_undecided_against_another_line():
    # The agent benchmark's case: ik tuned decided 1.75x llama.cpp's default, undecided against ik's own default
    # (one busy round made that pair wide): the old rule threw the win away and printed llama.cpp's line.
    labels = [REFERENCE, LLAMA_TUNED, IK_DEFAULT, IK_TUNED]
    race = _race({REFERENCE: STEADY, LLAMA_TUNED: STEADY, IK_DEFAULT: NOISY, IK_TUNED: FAST})
    printed, why, v = choose(_lines(labels), race)
    assert printed == IK_TUNED
    assert v is not None and v.outcome == BETTER and v.a == IK_TUNED and v.b == REFERENCE
    assert why.startswith(f"{IK_TUNED} was decided faster than llama.cpp's default (1.7")


def test_a_line_decided_slower_than_another_is_never_printed():
    # ik default is decided faster than the default but slower than ik tuned; ik tuned is refused by its price.
    labels = [REFERENCE, IK_DEFAULT, IK_TUNED]
    race = _race({REFERENCE: STEADY, IK_DEFAULT: FAST, IK_TUNED: FASTER})
    assert choose(_lines(labels), race)[0] == IK_TUNED
    gates = Gates(refused={IK_TUNED: "was refused by its price (mean KLD 0.05)"})
    printed, why, _ = choose(_lines(labels), race, gates)
    assert printed == IK_DEFAULT  # with the faster line gone, nothing it is slower than remains
    # and llama.cpp's default, decided slower than ik's lines, is not printed while they can run
    race2 = _race({REFERENCE: STEADY, LLAMA_TUNED: FAST, IK_TUNED: FASTER})
    printed2, _, _ = choose(_lines([REFERENCE, LLAMA_TUNED, IK_TUNED]), race2)
    assert printed2 == IK_TUNED


def test_a_win_over_the_default_decided_slower_than_another_line_is_not_printed():
    # llama.cpp tuned is decided faster than the default and decided slower than ik tuned, which is undecided against
    # the default (busy rounds left the pair too few quiet rounds): neither the slower line nor the default, decided
    # slower than it, is printed; ik tuned is, as the fastest line decided slower than no other.
    six = (1.0, 1.01, 0.99, 1.0, 1.02, 0.98)
    race = _race({REFERENCE: six, LLAMA_TUNED: tuple(1.7 * x for x in six[::-1]),
                  IK_TUNED: tuple(2.1 * x for x in six)}, busy={REFERENCE: (0, 1), IK_TUNED: (2, 3, 4)})
    assert race.pair(LLAMA_TUNED, REFERENCE).outcome == BETTER and race.pair(LLAMA_TUNED, IK_TUNED).outcome == WORSE
    assert race.pair(IK_TUNED, REFERENCE).outcome == UNDECIDED
    printed, why, v = choose(_lines([REFERENCE, LLAMA_TUNED, IK_TUNED]), race)
    assert printed == IK_TUNED and v is not None and v.outcome == UNDECIDED
    slower = race.pair(REFERENCE, LLAMA_TUNED)
    assert why == (f"llama.cpp's default was decided slower than {LLAMA_TUNED} ({slower.ratio:.2f}x, 99 % "
                   f"{slower.low:.2f}-{slower.high:.2f}x over {slower.rounds} rounds): {IK_TUNED} ({v.ratio:.2f}x "
                   "llama.cpp's default in the rounds both ran, over 1 round: too few to bound (a verdict needs 3)) is "
                   "the fastest line "
                   "decided slower than no other")


def test_a_line_that_paged_is_never_printed_and_the_default_stays():
    labels = [REFERENCE, LLAMA_TUNED, IK_TUNED]
    race = _race({REFERENCE: STEADY, LLAMA_TUNED: FAST, IK_TUNED: FASTER}, paged=(IK_TUNED, LLAMA_TUNED))
    printed, why, _ = choose(_lines(labels), race)
    assert printed == REFERENCE
    assert "left out" in why and "ik_llama.cpp tuned read its model back from disk" in why


def test_llama_cpp_s_default_stays_when_nothing_is_decided_faster():
    race = _race({REFERENCE: STEADY, LLAMA_TUNED: NOISY, IK_TUNED: NOISY})
    printed, why, v = choose(_lines([REFERENCE, LLAMA_TUNED, IK_TUNED]), race)
    assert printed == REFERENCE and v is None
    assert why.startswith("llama.cpp's default stays: no line was decided faster than it (the closest, ")
    assert "undecided" in why


def test_the_simpler_line_where_two_winners_are_undecided_between_them():
    # Both decided faster than the default; the faster median (ik tuned) is undecided against the simpler ik
    # default: the simpler line is printed. Decided between them, the faster one is.
    labels = [REFERENCE, IK_DEFAULT, IK_TUNED]
    close = (1.80, 1.66, 1.85, 1.70)  # a faster median than FAST's, undecided against it
    race = _race({REFERENCE: STEADY, IK_DEFAULT: FAST, IK_TUNED: close})
    assert race.arm(IK_TUNED).score > race.arm(IK_DEFAULT).score  # type: ignore[union-attr, operator]
    assert race.pair(IK_TUNED, IK_DEFAULT).outcome == UNDECIDED
    printed, why, _ = choose(_lines(labels), race)
    assert printed == IK_DEFAULT
    p = race.pair(IK_TUNED, IK_DEFAULT)
    simpler = (f"the simpler line (0 settings changed from its engine's default, 2 for the other) where the rounds "
               f"left it undecided against the faster median of {IK_TUNED} "
               f"({p.ratio:.2f}x it, 99 % {p.low:.2f}-{p.high:.2f}x over 4 rounds both ran clean)")
    assert why.endswith(f"slower than no other line; of the lines that were, it is {simpler}"), why
    printed, why, _ = choose(_lines(labels), _race({REFERENCE: STEADY, IK_DEFAULT: FAST, IK_TUNED: FASTER}))
    assert printed == IK_TUNED and why.endswith("slower than no other line")
    # Where llama.cpp's default cannot run (the agent run: it paged in 1 of 5 rounds), the same pick, said as such:
    # never "the fastest" of a line whose median was not.
    printed, why, _ = choose(_lines(labels), _race({REFERENCE: STEADY, IK_DEFAULT: FAST, IK_TUNED: close},
                                                   paged=(REFERENCE,)))
    assert printed == IK_DEFAULT and "fastest line" not in why and why.endswith(f"it is {simpler}")



def test_nothing_runnable_prints_no_line_and_says_why():
    # every line fails, llama.cpp's default too: no crash, no line, each cause named.
    labels = [REFERENCE, IK_TUNED]
    race = _race({REFERENCE: (None, None, None), IK_TUNED: (None, None, None)})
    lines = _lines(labels)
    printed, why, _ = choose(lines, race)
    assert printed is None
    assert why == ("no line can be run here: llama.cpp default failed (it crashed); ik_llama.cpp tuned failed (it "
                   "crashed)")
    choice = EngineChoice(tuple(lines), race, printed, why)
    assert choice.line is None and choice.to_dict()["printed_engine"] is None


def test_where_nothing_else_runs_llama_cpp_s_default_stays_though_it_paged_and_says_so():
    # Issue 66: where nothing is decided faster, llama.cpp's default stays, said; a paging default is no exception.
    race = _race({REFERENCE: STEADY, IK_TUNED: (None, None, None)}, paged=(REFERENCE,))
    printed, why, _ = choose(_lines([REFERENCE, IK_TUNED]), race)
    assert printed == REFERENCE
    assert why == ("llama.cpp's default stays, though it read its model back from disk while generating in 4 of 4 "
                   "rounds (it does not fit this machine's RAM as it is): no other line can be printed; left out: "
                   "ik_llama.cpp tuned failed (it crashed)")


def test_when_the_default_pages_a_line_decided_faster_is_printed_one_decided_slower_never():
    labels = [REFERENCE, LLAMA_TUNED, IK_TUNED]
    race = _race({REFERENCE: STEADY, LLAMA_TUNED: STEADY, IK_TUNED: FAST}, paged=(REFERENCE,))
    printed, why, v = choose(_lines(labels), race)
    assert printed == IK_TUNED and v is not None and v.outcome == BETTER  # its verdict against the default, kept
    # per-round ratios to the default: 1.70/1.00, 1.75/1.02, 1.68/0.99, 1.73/1.01; the middle two 1.700 and 1.713
    assert v.ratio == pytest.approx((1.70 / 1.00 + 1.73 / 1.01) / 2, abs=1e-9)
    assert why.startswith(f"{IK_TUNED} was decided faster than llama.cpp's default ({v.ratio:.2f}x")
    # Issue 66: the old fallback printed the fastest line left whatever its verdict against the paging default (a line
    # measured 0.8x it could be printed). Now a line decided slower than that default is never printed: it stays.
    slow = tuple(0.8 * x for x in STEADY[::-1])
    race = _race({REFERENCE: STEADY, IK_TUNED: slow}, paged=(REFERENCE,))
    assert race.pair(IK_TUNED, REFERENCE).outcome == WORSE
    printed, why, _ = choose(_lines([REFERENCE, IK_TUNED]), race)
    assert printed == REFERENCE and "ik_llama.cpp tuned was decided slower than llama.cpp default (0.80x" in why
    # undecided against the paging default: the line still in is printed, its verdict said
    race = _race({REFERENCE: STEADY, IK_TUNED: NOISY}, paged=(REFERENCE,))
    printed, why, v = choose(_lines([REFERENCE, IK_TUNED]), race)
    assert printed == IK_TUNED and v is not None and v.outcome == UNDECIDED
    assert why.startswith("llama.cpp's default read its model back from disk while generating in 4 of 4 rounds")
    assert why.endswith(f"{IK_TUNED} ({v.ratio:.2f}x llama.cpp's default in the rounds both ran, 99 % "
                        f"{v.low:.2f}-{v.high:.2f}x over 4 rounds) is the fastest line decided slower than no other")


def test_a_line_over_the_vram_budget_or_unread_is_never_printed():
    labels = [REFERENCE, IK_TUNED]
    gib = 2**30
    over = _race({REFERENCE: STEADY, IK_TUNED: FASTER}, vram={REFERENCE: 5 * gib, IK_TUNED: 9 * gib}, budget=8 * gib)
    printed, why, _ = choose(_lines(labels), over)
    assert printed == REFERENCE and "over the 8,192 MiB budget" in why
    unread = _race({REFERENCE: STEADY, IK_TUNED: FASTER}, vram={REFERENCE: 5 * gib}, budget=8 * gib)
    printed, why, _ = choose(_lines(labels), unread)
    assert printed == REFERENCE and "its VRAM was not read" in why
    within = _race({REFERENCE: STEADY, IK_TUNED: FASTER}, vram={REFERENCE: 5 * gib, IK_TUNED: 7 * gib}, budget=8 * gib)
    assert choose(_lines(labels), within)[0] == IK_TUNED


def test_without_a_race_the_default_stays():
    assert choose(_lines([REFERENCE, IK_TUNED]), None)[0] == REFERENCE
    assert choose(_lines([IK_TUNED]), None)[0] is None


@pytest.mark.parametrize(("scores", "max_rounds", "done"), [
    # llama.cpp tuned is undecided against the printed ik line and as noisy as it is, one round more would not decide
    # it: hopeless within 5 rounds; with 20 it could be decided, so the race goes on
    ({REFERENCE: STEADY, IK_TUNED: FAST, LLAMA_TUNED: NOISY}, 5, True),
    ({REFERENCE: STEADY, IK_TUNED: FAST, LLAMA_TUNED: NOISY}, 20, False),
    ({REFERENCE: STEADY, IK_TUNED: FAST, IK_DEFAULT: FASTER}, 5, True),  # every line decided against the answer
    ({REFERENCE: STEADY, LLAMA_TUNED: STEADY[::-1], IK_TUNED: FAST}, 20, True),  # decided slower than ik: no rival
])
def test_the_race_stops_once_more_rounds_could_not_change_the_printed_line(scores, max_rounds, done):
    lines = _lines(list(scores))
    assert settled(lines, max_rounds)(_race(scores)) is done


def test_a_line_decided_slower_than_another_or_that_paged_is_out_of_the_running_the_default_never():
    race = _race({REFERENCE: STEADY, LLAMA_TUNED: STEADY[::-1], IK_DEFAULT: FAST, IK_TUNED: NOISY},
                 paged=(IK_TUNED,))
    # llama.cpp tuned is decided slower than ik's default, ik tuned paged; the default, slower too, stays measured
    assert out_of_running(_lines(list(CONFIGS)))(race) == {LLAMA_TUNED, IK_TUNED}


def test_the_race_measures_no_more_rounds_of_a_line_out_of_the_running(engine_loc, demo_models, tmp_path):
    """On the engine: the line the rounds put out after round 1 is not started again (its server log count says so)."""
    from tuner.measure import workload
    from tuner.search import decide

    model = demo_models[("qwen3moe", "Q4_K_M")]
    a, b = LaunchConfig(model=model, ctx=512, parallel=1), LaunchConfig(model=model, ctx=512, parallel=1, threads=1)
    said: list[str] = []
    race = judge.head_to_head(engine_loc, [("a", a), ("b", b)], workload.preset(workload.WorkloadKind.CHAT, 16, 2),
                              log_dir=tmp_path, rounds=decide.Rounds(min=3, max=3, select=0), on_step=said.append,
                              out_by=lambda h: {"b"} if len(h.arm("b").rounds) >= 1 else set())  # type: ignore
    assert len(race.arm("a").rounds) == 3 and len(race.arm("b").rounds) == 1  # type: ignore[union-attr]
    assert "b is out of the running: not measured again" in said


@pytest.mark.parametrize(("trials", "time_s", "n", "want"), [
    (10, None, 2, (5, None)), (10, None, 3, (4, None)), (None, 1200.0, 2, (5, 1200.0)), (6, 600.0, 2, (4, 600.0))])
def test_the_default_budget_is_shared_between_the_engines(trials, time_s, n, want):
    # trials are shared; a time budget stays whole: the run's clock keeps it across the engines (tuner.versus.clock)
    from tuner.search.study import Budget
    from tuner.versus.engine_run import split_budget

    got = split_budget(Budget(trials=trials, time_s=time_s), n)
    assert (got.trials, got.time_s) == want
