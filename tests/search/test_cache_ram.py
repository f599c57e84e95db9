"""The --cache-ram each config carries (tuner/search/cache_ram.py), priced by the figures that decide: on a build whose
own projection needs more host RAM than the replay of the pin says, the cap, llama.cpp's own arms and the gate follow
that build's figures (issue 58)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.other_engine import other_engine
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.engine import breakdown
from tuner.measure.engine_memory import EngineMemory, deciding, projectable
from tuner.models import gguf_reader, shape_model
from tuner.plan.memory import DEFAULT_CACHE_RAM_MIB, estimate
from tuner.plan.ram import CACHE_RAM_STEP_MIB, TIGHT_MARGIN_BYTES
from tuner.search import cache_ram, known_good, space

MIB, GIB = 2**20, 2**30
F16 = CacheType.F16
MOVED_MIB = 3072  # the other build's projection: 3 GiB more host compute than the pin's (as in issue 58)


def cpu_machine(ram_bytes: int) -> Hardware:
    return Hardware("", 0, 0, 0.0, 0.0, ram_bytes, ram_bytes, 0, 20e9, 8, "none")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def q30(tmp_path_factory):
    path = tmp_path_factory.mktemp("q30") / "qwen3-30b-a3b.gguf"
    return gguf_reader.inspect_model(shape_model.write_catalog_model("Qwen3-30B-A3B:Q4_K_M", path).path)


def test_a_build_whose_projection_needs_more_host_ram_moves_the_cap_the_arms_and_the_gate(engine_loc, q30, tmp_path,
                                                                                          cache):
    """Issue 58: b99999 (the pinned binaries behind shims, its projection's host compute 3 GiB above the pin's) on a
    machine with room for llama-server's default 8 GiB prompt cache beside the replay's need and 384 MiB to spare.
    By the replay (and by the pin's own figures) no cap; by b99999's the cap is what its own need leaves, the bare
    launch and --fit's placement carry it, and the gate refuses the line without it, as b99999 would page."""
    other = other_engine(engine_loc, tmp_path / "b99999", "b99999", "99999", host_compute_mib=MOVED_MIB)
    cfg = LaunchConfig(model=q30.paths[0], ctx=8192, parallel=1)
    # How far the other build's own projection moves the host need: the two engines' figures, side by side.
    pin_fp, other_fp = (breakdown.fit_params_breakdown(loc, projectable(cfg, cpu_machine(0))) for loc in
                        (engine_loc, other))
    moved_mib = sum(other_fp.host_total(p) - pin_fp.host_total(p) for p in ("model", "context", "compute"))
    assert moved_mib == MOVED_MIB
    spare_mib = DEFAULT_CACHE_RAM_MIB + 384
    ram = estimate(q30, cfg, cpu_machine(0)).host_need_bytes + TIGHT_MARGIN_BYTES + spare_mib * MIB
    hw = cpu_machine(ram)
    want = (spare_mib - moved_mib) // CACHE_RAM_STEP_MIB * CACHE_RAM_STEP_MIB
    assert want == 5376  # the figure issue 58 names
    assert cache_ram.cap(q30, cfg, hw) is None
    with deciding(EngineMemory.of(engine_loc)):
        assert cache_ram.cap(q30, cfg, hw) is None  # the pin's own figures agree with its replay
    mem = EngineMemory.of(other)
    with deciding(mem):
        assert cache_ram.cap(q30, cfg, hw) == want
        assert not space.check(q30, cfg, hw).feasible  # the default cache does not fit beside b99999's need
        assert space.check(q30, replace(cfg, cache_ram_mib=want), hw).feasible
        sp = space.build_space(q30.paths[0], q30, hw, ctx=8192, parallel=1, prompt_tokens=64)
        default, fit_arm = known_good.own_choice(sp, q30, hw, replace(cfg, threads=8))
    assert mem.priced >= 1 and any("host compute" in n and "b99999" in n for n in mem.notes), mem.notes
    # llama.cpp's own arms carry the cap b99999's figures give, the space's configs theirs (priced at the space's
    # most host-hungry settings: the replay's cap with that much less RAM).
    assert default.cache_ram_mib == fit_arm.cache_ram_mib == want
    hungriest = replace(space.ubatch_config(q30.paths[0], F16, F16, 8192, 1, None), flash_attn=FlashAttn.OFF)
    each = cache_ram.cap(q30, hungriest, cpu_machine(ram - moved_mib * MIB))
    assert each is not None and each < want and sp.cache_ram_caps == ((None, each),)
    assert {c.cache_ram_mib for c in space.iter_configs(sp)} == {each}
    with deciding(None):
        replay_sp = space.build_space(q30.paths[0], q30, hw, ctx=8192, parallel=1, prompt_tokens=64)
    # By the replay alone the same space carries a cap larger by what b99999 moved, and the arms none.
    by_replay = cache_ram.cap(q30, hungriest, hw)
    assert replay_sp.cache_ram_caps == ((None, by_replay),) and by_replay is not None and by_replay - each == moved_mib
    assert [a.cache_ram_mib for a in known_good.own_choice(replay_sp, q30, hw, cfg)] == [None, None]
