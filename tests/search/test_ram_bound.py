"""A rig whose host RAM is the binding side: the search stays inside the feasible --n-cpu-moe interval and says
which memory bounds it. The card is a fake at the hardware boundary (a small VRAM budget); the trials run on
the real engine with the tiny demo model."""

from __future__ import annotations

from dataclasses import replace

from tests.fakes import small_card
from tuner.catalog.cards import find_card
from tuner.core.config import FlashAttn, LaunchConfig
from tuner.engine import build
from tuner.models.gguf_reader import inspect_model
from tuner.plan import memory
from tuner.search import study
from tuner.search.space import build_space, feasible_n_cpu_moe, make_config, params_of

GIB, MIB = 2**30, 2**20
TINY = study.Measure(n_prompt=16, n_gen=4, repetitions=1, timeout_s=120, prompt_depth=0, gen_depth=16)


def test_search_stays_inside_a_ram_capped_interval_and_says_why(demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    base = LaunchConfig(model=model, ctx=1024, parallel=1)
    small = small_card(info, replace(base, flash_attn=FlashAttn.ON), info.n_layer // 2)
    roomy = feasible_n_cpu_moe(info, base, small, 0)  # the card alone bounds it from below
    assert roomy is not None and 0 < roomy[0] < info.n_layer - 1 and roomy[1] == info.n_layer
    # RAM for the host side one layer above the card's bound, not for more.
    cap = roomy[0] + 1
    ram = memory.estimate(info, replace(base, n_cpu_moe=cap), small).host.total_bytes + MIB // 4
    hw = replace(small, ram_total_bytes=ram, ram_available_bytes=ram)
    interval = feasible_n_cpu_moe(info, base, hw, 0)
    assert interval == (roomy[0], cap)
    sp = build_space(model, info, hw, ctx=1024, parallel=1, prompt_tokens=16, vram_margin_mib=0,
                     kv_pairs=((base.cache_type_k, base.cache_type_v),))
    assert sp.n_cpu_moe is not None and interval[0] <= sp.n_cpu_moe[0] <= sp.n_cpu_moe[1] <= interval[1]
    assert "host RAM" in sp.n_cpu_moe_why and f"at most {interval[1]}" in sp.n_cpu_moe_why
    loc = build.locate_engine()
    caps = build.capabilities(loc)
    obj = study.Objective()
    st = study.open_study(study.study_name(model, hw, caps, sp, TINY, obj), study.default_storage(tmp_path), obj,
                          seed=1)
    # One known-good start inside the interval (flash attention off needs a bigger compute buffer than this card
    # leaves: a trial the sampler draws there is refused by the gate, as it should be).
    st.enqueue_trial(params_of(sp, make_config(sp, {"n_cpu_moe": interval[0], "flash_attn": "on"})))
    out = study.run_search(st, sp, info, hw, loc, budget=study.Budget(trials=2), measure=TINY, caps=caps,
                           vram_margin_mib=0)
    assert out.trials_this_run == 2
    measured = [r for r in study.records(st) if r.status == "measured"]
    assert measured and all(interval[0] <= (r.config.get("n_cpu_moe") or 0) <= interval[1] for r in measured)


def test_ram_budget_is_checked_and_never_exceeds_what_is_free():
    import pytest

    from tuner.core.errors import UsageError
    from tuner.machine.hardware import with_ram_budget

    hw = find_card("RTX 3090").hardware(32 * GIB, 20 * GIB, 50e9)
    assert with_ram_budget(hw, None) is hw
    assert with_ram_budget(hw, 16).ram_available_bytes == 16 * GIB
    assert with_ram_budget(hw, 24).ram_available_bytes == 20 * GIB  # only 20 GiB are free now
    for bad in (0, -1, 33):
        with pytest.raises(UsageError, match="--ram"):
            with_ram_budget(hw, bad)
