"""Seeds proposed from shared lines (tuner/search/proposals.py): put into this run's space, re-checked by the memory
model, said when they come from another engine or a larger card, left out with a reason when they do not fit."""

from __future__ import annotations

from pathlib import Path

from tuner.catalog.cards import find_card
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.models.gguf_reader import inspect_model
from tuner.search import proposals, space

GIB = 2**30


def test_a_proposal_is_measured_in_this_runs_space_or_left_out_with_the_reason(demo_models):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    hw = find_card("RTX 3060 12GB").hardware(64 * GIB, 60 * GIB, 50e9)
    sp = space.build_space(model, info, hw, ctx=4096, parallel=1, prompt_tokens=512)
    shared = LaunchConfig(model=Path("their-copy.gguf"), n_cpu_moe=99, cache_type_k=CacheType.Q8_0,
                          cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON, ctx=131072, parallel=4, threads=3)
    p = proposals.Proposal("shared-1", shared, "record 1 in o/r", engine_commit="abc1234",
                           vram_budget_bytes=23 * GIB)
    got = proposals.adapt([p], sp, info, hw, engine_commit="0c1e570")
    [(label, cfg)] = got.seeds
    # The run's own model, context and slots; the searched settings as shared, moved inside the space.
    assert label == "shared-1" and cfg.model == model and (cfg.ctx, cfg.parallel) == (4096, 1)
    assert (cfg.cache_type_k, cfg.cache_type_v) == (CacheType.Q8_0, CacheType.Q8_0)
    assert cfg.n_cpu_moe == sp.n_cpu_moe[1] and got.origins == {"shared-1": "record 1 in o/r"}
    [note] = got.notes
    assert "measured on engine abc1234, this one is 0c1e570" in note and "this card has" in note
    assert "re-checked it: it fits" in note

    # A margin no config can leave free: the memory model refuses it, and the reason says so.
    refused = proposals.adapt([p], sp, info, hw, engine_commit="abc1234", vram_margin_mib=12 * 1024)
    assert refused.seeds == () and "left out: the memory model says it does not fit here" in refused.notes[0]

    # The same config as a seed the search has anyway is measured once, under that seed's name.
    same = proposals.adapt([p], sp, info, hw, engine_commit="abc1234", known=[("fit", cfg)])
    assert same.seeds == () and "the same config here as seed fit" in same.notes[0]
