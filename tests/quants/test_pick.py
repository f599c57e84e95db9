"""Target mode: the least loss that meets a speed floor, within a loss budget; error bars make ties, and the
smaller file wins a tie."""

from __future__ import annotations

import math

import pytest

from tuner.quants import pick as quant_pick
from tuner.quants.pick import Candidate, pick

MiB = 2**20


def _c(quant: str, size_mib: float, gen: float, kld: float, gen_err: float = 1.0, kld_err: float = 0.001):
    return Candidate(quant, round(size_mib * MiB), gen, gen_err, kld, kld_err)


ROWS = [
    _c("Q8_0", 16, 20.0, 0.001),
    _c("Q6_K", 13, 25.0, 0.004),
    _c("Q4_K_M", 10, 32.0, 0.020),
    _c("Q3_K_M/Q8_0", 9, 35.0, 0.030),
    _c("Q2_K", 7, 40.0, 0.120),
]


def test_speed_floor_binds_when_the_best_quality_is_too_slow():
    p = pick(ROWS, min_tok_s=30.0)
    assert p.quant == "Q4_K_M"
    assert p.binding.startswith("the speed floor binds") and "Q8_0" in p.binding
    assert p.verdicts["Q8_0"] == quant_pick.TOO_SLOW and p.verdicts["Q6_K"] == quant_pick.TOO_SLOW
    assert p.verdicts["Q2_K"] == quant_pick.MORE_LOSS and p.verdicts["Q4_K_M"] == quant_pick.PICK


def test_no_limit_binds_when_the_best_quality_is_fast_enough():
    p = pick(ROWS, min_tok_s=10.0, max_kld=0.05)
    assert p.quant == "Q8_0" and p.binding.startswith("no limit binds")


def test_no_quant_meets_both_is_one_line_naming_the_nearest_misses():
    p = pick(ROWS, min_tok_s=38.0, max_kld=0.05)
    assert p.quant is None
    assert p.binding.startswith("no quant meets both --min-tok-s 38 and --max-kld 0.05")
    assert "Q3_K_M/Q8_0" in p.binding and "Q2_K" in p.binding and "\n" not in p.binding
    assert p.verdicts["Q2_K"] == quant_pick.OVER_LOSS and p.verdicts["Q8_0"] == quant_pick.TOO_SLOW


def test_a_kld_difference_inside_the_error_bars_is_a_tie_and_the_smaller_file_wins():
    rows = [_c("Q8_0", 16, 20.0, 0.0010, kld_err=0.0008), _c("Q6_K", 13, 21.0, 0.0015, kld_err=0.0008),
            _c("Q4_K_M", 10, 30.0, 0.0200, kld_err=0.0008)]
    p = pick(rows)
    assert p.quant == "Q6_K"
    assert p.verdicts == {"Q8_0": quant_pick.TIE, "Q6_K": quant_pick.PICK, "Q4_K_M": quant_pick.MORE_LOSS}
    # Tighter error bars separate them: the least loss wins again.
    tight = [_c(c.quant, c.size_bytes / MiB, c.gen_tok_s or 0, c.kld_mean or 0, kld_err=0.0001) for c in rows]
    assert pick(tight).quant == "Q8_0"


def test_a_row_meets_the_speed_floor_only_when_its_whole_interval_is_above_it():
    floor = 30.0
    assert quant_pick.floor_side(33.0, 2.0, floor) is quant_pick.Side.MEETS  # 31..35
    assert quant_pick.floor_side(32.0, 2.0, floor) is quant_pick.Side.MEETS  # 30..34: on the floor counts
    assert quant_pick.floor_side(29.0, 2.0, floor) is quant_pick.Side.UNDECIDED  # 27..31 straddles
    assert quant_pick.floor_side(31.0, 2.0, floor) is quant_pick.Side.UNDECIDED  # 29..33 straddles
    assert quant_pick.floor_side(28.0, 2.0, floor) is quant_pick.Side.UNDECIDED  # 26..30 touches it
    assert quant_pick.floor_side(27.0, 2.0, floor) is quant_pick.Side.FAILS  # 25..29
    assert quant_pick.floor_side(35.0, None, floor) is quant_pick.Side.UNDECIDED  # one round: no interval


def test_a_row_meets_the_loss_budget_only_when_its_whole_interval_is_below_it():
    budget = 0.010
    assert quant_pick.ceiling_side(0.008, 0.001, budget) is quant_pick.Side.MEETS  # 0.007..0.009
    assert quant_pick.ceiling_side(0.0095, 0.001, budget) is quant_pick.Side.UNDECIDED  # 0.0085..0.0105
    assert quant_pick.ceiling_side(0.0105, 0.001, budget) is quant_pick.Side.UNDECIDED  # 0.0095..0.0115
    assert quant_pick.ceiling_side(0.012, 0.001, budget) is quant_pick.Side.FAILS  # 0.011..0.013


def test_a_noisy_speed_straddling_the_floor_is_undecided_and_never_picked():
    # The committed benchmark's case: Q5_0 at 5.06 ± 4.29 tok/s passed a 5 tok/s floor because gen + error >= 5.
    rows = [_c("Q8_0", 16, 4.0, 0.001, gen_err=0.2), _c("Q5_0", 11, 5.06, 0.004, gen_err=4.29),
            _c("Q4_K_M", 10, 7.5, 0.02, gen_err=0.5)]
    p = pick(rows, min_tok_s=5.0)
    assert p.quant == "Q4_K_M"
    assert p.verdicts == {"Q8_0": quant_pick.TOO_SLOW, "Q5_0": quant_pick.UNDECIDED, "Q4_K_M": quant_pick.PICK}
    assert p.undecided == ("Q5_0 is undecided: 5.1 ± 4.3 tok/s straddles --min-tok-s 5; "
                           "measure more rounds to settle it",)
    assert p.binding.endswith(p.undecided[0])  # it loses less than the pick: the answer says so
    # The interval wholly below the floor fails, wholly above meets and, losing less, wins.
    assert pick([rows[0], _c("Q5_0", 11, 5.06, 0.004, gen_err=0.05), rows[2]], min_tok_s=5.0).quant == "Q5_0"
    below = pick([rows[0], _c("Q5_0", 11, 4.5, 0.004, gen_err=0.4), rows[2]], min_tok_s=5.0)
    assert below.quant == "Q4_K_M" and below.verdicts["Q5_0"] == quant_pick.TOO_SLOW and not below.undecided


def test_a_kld_straddling_the_loss_budget_is_undecided_and_never_picked():
    rows = [_c("Q8_0", 16, 20.0, 0.0095, kld_err=0.001), _c("Q4_K_M", 10, 30.0, 0.008, kld_err=0.001),
            _c("Q3_K_M", 8, 35.0, 0.012, kld_err=0.001)]
    p = pick(rows, max_kld=0.01)  # the fastest within the budget
    assert p.quant == "Q4_K_M"
    assert p.verdicts["Q8_0"] == quant_pick.UNDECIDED and p.verdicts["Q3_K_M"] == quant_pick.OVER_LOSS
    assert p.undecided == ("Q8_0 is undecided: mean KLD 0.0095 ± 0.0010 straddles --max-kld 0.01; "
                           "measure more rounds to settle it",)
    assert "Q8_0" not in p.binding  # slower than the pick: it could not have won, so the answer stands
    only = pick(rows[:1], max_kld=0.01)
    assert only.quant is None and "1 undecided (Q8_0 is undecided: mean KLD 0.0095 ± 0.0010" in only.binding


def test_a_single_round_speed_is_undecided_against_a_floor_but_ranks_without_one():
    rows = [Candidate("Q8_0", 16, 50.0, None, 0.001, 0.0001), _c("Q4_K_M", 10, 40.0, 0.02)]
    p = pick(rows, min_tok_s=30.0)
    assert p.quant == "Q4_K_M" and p.verdicts["Q8_0"] == quant_pick.UNDECIDED
    assert "50.0 (one round, no interval) tok/s straddles --min-tok-s 30" in p.binding
    assert pick(rows).quant == "Q8_0"  # no floor: the least loss, whatever the speed's interval


def test_with_only_a_loss_budget_the_fastest_inside_it_wins_and_the_budget_binds():
    p = pick(ROWS, max_kld=0.025)
    assert p.quant == "Q4_K_M"
    assert p.binding.startswith("the loss budget binds") and "Q2_K" in p.binding
    assert p.verdicts["Q2_K"] == quant_pick.OVER_LOSS


def test_unmeasured_rows_are_never_picked():
    rows = [Candidate("Q8_0", 1, None, 0.0, None, 0.0), _c("Q4_K_M", 10, 30.0, 0.02)]
    p = pick(rows, min_tok_s=5.0)
    assert p.quant == "Q4_K_M" and p.verdicts["Q8_0"] == quant_pick.UNMEASURED
    assert pick([Candidate("X", 1, None, 0.0, None, 0.0)]).binding.startswith("no quant was measured")


def test_speed_error_is_the_t_interval_half_width():
    assert quant_pick.speed_error([10.0]) is None
    half = quant_pick.speed_error([10.0, 12.0])
    assert half == pytest.approx(6.314 * math.sqrt(2.0) / math.sqrt(2))
    assert quant_pick.kld_error(0.01) == pytest.approx(0.01645)


def test_the_speed_interval_is_centred_on_the_mean_it_is_printed_beside():
    """Three rounds [16, 16, 10] under a floor of 10: the median (16) with the mean's half-width would 'meet' it
    ([10.16, 21.84]); the mean (14.0) with its own interval [8.16, 19.84] straddles it: undecided."""
    samples = [16.0, 16.0, 10.0]
    mean, err = quant_pick.speed_mean(samples), quant_pick.speed_error(samples)
    assert mean == pytest.approx(14.0) and err == pytest.approx(2.920 * 3.4641 / 3**0.5, rel=1e-3)
    row = Candidate("Q4_K_M", 1, mean, err, 0.01, 0.001)
    assert pick([row], min_tok_s=10.0).verdicts["Q4_K_M"] == quant_pick.UNDECIDED
