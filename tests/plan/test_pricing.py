"""Whose memory figures decide (tuner.plan.pricing): an engine's drift booked on the replay's estimate, and the replay's
bisected ends settled by the engine's price (tuner.plan.placement) to the interval the price gives at every step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner.catalog import cards
from tuner.core.config import CacheType, LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.models import gguf_reader
from tuner.plan import placement
from tuner.plan.memory import FIT_MARGIN_BYTES, MIB, Breakdown, MemoryEstimate, Verdict, estimate
from tuner.plan.pricing import Drift, corrected, decided_mib

CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")


def test_a_drift_books_the_engines_figure_and_judges_the_config_again():
    """Qwen3-30B-A3B at -c 8192 -ub 512 on a CPU build: the replay of 0c1e57098 reserves 304 MiB of compute,
    b11434's own projection 324 (its build_inp_embd input path); with RAM for the one and not the other, the
    verdict follows the engine."""
    host = Breakdown(weights_bytes=17691 * MIB, kv_bytes=768 * MIB, compute_bytes=304 * MIB)
    est = MemoryEstimate("cpu", Breakdown(), host, 0, 0, 8192, 1, 512, True, Verdict.FITS)
    hw = replace(CPU, ram_available_bytes=host.total_bytes + 10 * MIB)
    engine = corrected(est, Drift((("host", "compute", 20 * MIB),)), hw)
    assert engine.host.compute_bytes == 324 * MIB and engine.host.weights_bytes == host.weights_bytes
    assert engine.verdict is Verdict.EXCEEDS_RAM and est.verdict is Verdict.FITS
    assert corrected(est, Drift(), hw) is est
    shrunk = corrected(est, Drift((("host", "context", -2**40),)), hw)  # never below nothing
    assert shrunk.host.kv_bytes == 0


def test_the_figure_that_decides_is_the_engines_beyond_its_rounding():
    """llama.cpp prints whole MiB rounded down per buffer: two MiB apart is its rounding, three is a drift."""
    assert [decided_mib(304, e) for e in (302, 304, 306, 307, 324)] == [304, 304, 304, 307, 324]


@pytest.mark.parametrize("n_steps", [1, 2, 5, 49])
def test_settling_from_any_guess_finds_the_first_step_that_holds(n_steps):
    """Every place the answer can be (nowhere included) from every guess; a right guess costs two looks."""
    for first in range(n_steps + 1):
        want = None if first == n_steps else first
        for guess in [None, *range(n_steps)]:
            seen: list[int] = []

            def holds(n: int, first: int = first, seen: list[int] = seen) -> bool:
                seen.append(n)
                return n >= first

            assert placement._settle(holds, guess, n_steps - 1) == want, (first, guess)
            if guess is not None and guess == want and guess > 0:
                assert sorted(set(seen)) == [guess - 1, guess]


@pytest.mark.parametrize("drift_mib", [0, 40, 700, -300])
def test_an_engines_price_settles_the_replays_interval_to_the_one_every_step_gives(drift_mib, demo_models):
    """The replay bisects, the price settles each end: the result is what the price says over every step, on a card
    and RAM that put both ends inside the axis, for an engine that reserves more (or less) on the card than the
    replay and, for the RAM end, on the host."""
    path = demo_models[("qwen3moe", "Q4_K_M")]
    info = gguf_reader.inspect_model(path)
    axis = placement.offload_of(info)
    base = LaunchConfig(model=path, ctx=4096, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0)
    drift = Drift((("gpu", "compute", drift_mib * MIB), ("host", "compute", drift_mib * MIB)))

    def price(m, cfg, hw):  # an engine whose compute buffers differ from the replay's by drift_mib
        return corrected(estimate(m, cfg, hw), drift, hw)

    card = cards.find_card("RTX 3060").hardware(32 * 2**30, 32 * 2**30, 40e9)
    every = [estimate(info, axis.apply(base, n), card) for n in range(axis.steps)]
    gpu = [e.gpu.total_bytes + FIT_MARGIN_BYTES for e in every]
    host = [e.host.total_bytes for e in every]
    for vram in ((gpu[0] + gpu[-1]) // 2, gpu[-1], gpu[0] + 2**30):
        for ram in ((host[0] + host[-1]) // 2, host[-1] + 2**30):
            hw = replace(card, ram_total_bytes=ram, ram_available_bytes=ram, vram_total_bytes=vram,
                         vram_free_bytes=vram)
            want = placement.interval_of([price(info, axis.apply(base, n), hw) for n in range(axis.steps)], hw,
                                         axis=axis)
            assert placement.fit_interval(info, base, hw, price=price) == want, (vram, ram)
    # The largest context: bisected on the replay, settled by the price, as a scan of every context under it says.
    hw = replace(card, vram_total_bytes=gpu[-1] + 64 * MIB, vram_free_bytes=gpu[-1] + 64 * MIB)
    steps = info.ctx_train // 256
    fits = [k * 256 for k in range(1, steps + 1)
            if placement.fit_interval(info, replace(base, ctx=k * 256), hw, price=price).fits]
    assert placement.largest_fitting_ctx(info, base, hw, price)[0] == max(fits, default=0)
    if drift_mib in (0, 40):  # the card's end inside the ladder (700 MiB more fits nowhere, 300 less everywhere)
        assert 0 < max(fits) < info.ctx_train
