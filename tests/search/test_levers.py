"""The prompt-side levers of host experts (tuner/search/levers.py): the op-offload threshold, tried by the agent
session stage rather than the bench search, and priced by the plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from tuner.catalog.cards import find_card
from tuner.core.config import FlashAttn, LaunchConfig
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search import space

GIB = 2**30
CPU_ONLY = Hardware("", 0, 0, 0.0, 0.0, 16 * GIB, 12 * GIB, 0, 20e9, 8, source="none")


@pytest.fixture(scope="module")
def shape():
    from tuner.hub.resolve import resolve_model

    return resolve_model("qwen3.6-35b-a3b:Q4_K_M", header_only=True).path


@pytest.fixture(scope="module")
def info(shape):
    return inspect_model(shape)


@pytest.fixture(scope="module")
def slow_link():
    return find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)


def test_the_bench_search_has_no_threshold_axis_it_could_not_tell_apart(shape, info, slow_link):
    """llama-bench times a prompt in full ubatches: a threshold at or below the ubatch measures as op offload on,
    one above it as off (searched on its own). Trials on it would be spent on copies of the same measurement."""
    sp = space.build_space(shape, info, slow_link, ctx=32768, parallel=1, prompt_tokens=8192)
    assert sp.op_offload == (True, False) and not hasattr(sp, "op_offload_min_batch")
    assert "op_offload_min_batch" not in sp.describe()
    assert {c.op_offload_min_batch for c in space.iter_configs(sp)} == {None}
    assert any("GGML_OP_OFFLOAD_MIN_BATCH, 32 tokens) is tried by the agent session stage" in n for n in sp.left_out)


def test_the_session_stage_tries_the_threshold_at_the_lines_ubatch_where_experts_live_in_ram(shape, info,
                                                                                              slow_link):
    """Whole sessions tell the threshold apart: a turn shorter than a ubatch runs the host experts on the CPU, full
    ubatches still copy them up. One arm, at the tuned line's ubatch; none without a GPU, with op offload off, or
    with every expert on the card. The arm's line carries the variable (a llama-server reads it from its
    environment)."""
    from tuner.engine import flags
    from tuner.search import session_stage

    default = LaunchConfig(model=shape, ctx=32768, parallel=1)
    tuned = replace(default, n_cpu_moe=30, flash_attn=FlashAttn.ON)
    arms, _ = session_stage.stage_arms(default, tuned, info, slow_link, None)
    by_label = dict(arms)
    arm = by_label.get("tuned + op offload from 512 tokens")
    assert arm is not None and arm == replace(tuned, op_offload_min_batch=512)
    assert flags.launch_line(arm).startswith("GGML_OP_OFFLOAD_MIN_BATCH=512 llama-server ")
    big_ub = dict(session_stage.stage_arms(default, replace(tuned, ubatch=2048, batch=2048), info, slow_link,
                                           None)[0])
    assert any(c.op_offload_min_batch == 2048 for c in big_ub.values())
    for hw, line in ((CPU_ONLY, tuned), (slow_link, replace(tuned, op_offload=False)),
                     (slow_link, replace(tuned, n_cpu_moe=None))):
        labels = [label for label, _ in session_stage.stage_arms(default, line, info, hw, None)[0]]
        assert not any("op offload from" in label for label in labels), (hw.gpu_name, line.op_offload)


def test_a_threshold_above_the_ubatch_prices_the_host_experts_on_the_cpu(shape, info, slow_link):
    """Above the ubatch no batch reaches the threshold: no copy of the largest host weight in the GPU's compute
    buffer and no PCIe ceiling, as with op offload off; at or below it, the default's pricing. (A 128-token ubatch,
    where the copied weight outweighs the graph's own buffer.)"""
    from tuner.plan import memory, roofline

    on = LaunchConfig(model=shape, ctx=8192, parallel=1, n_cpu_moe=30, flash_attn=FlashAttn.ON, ubatch=128)
    above, at = replace(on, op_offload_min_batch=129), replace(on, op_offload_min_batch=128)
    off = replace(on, op_offload=False)
    e_on, e_above, e_at = (memory.estimate(info, c, slow_link) for c in (on, above, at))
    assert e_on.gpu_offload_copy_bytes > 0 and e_at.gpu_offload_copy_bytes == e_on.gpu_offload_copy_bytes
    assert e_above.gpu_offload_copy_bytes == 0
    assert e_above.gpu.compute_bytes == memory.estimate(info, off, slow_link).gpu.compute_bytes
    assert roofline.roofline(info, above, slow_link).prompt_tok_s is None
    assert roofline.roofline(info, at, slow_link).prompt_tok_s == roofline.roofline(info, on, slow_link).prompt_tok_s


def _fake_gpu_machine(ram_gib: float) -> Hardware:
    """This machine as the probe sees it with an RTX 4060 Ti 16GB in it (the NVML fake) and ``ram_gib`` of RAM."""
    from tests.fakes import FakeNVML
    from tuner.machine import hardware

    hw = hardware.probe_hardware(FakeNVML([("NVIDIA GeForce RTX 4060 Ti", 16 * GIB, GIB)]), host_bandwidth_s=0)
    return replace(hw, ram_total_bytes=int(ram_gib * GIB), ram_available_bytes=int(ram_gib * GIB),
                   host_bandwidth_bytes_s=89.6e9, physical_cores=8)


def _pinned_headroom(info, sp, hw, cache_ram_mib: int | None = None) -> float:
    """RAM (GiB) the pinned copy leaves at the space's most host experts and largest ubatch, as the plan counts it
    (with that placement's prompt-cache cap, or ``cache_ram_mib``)."""
    from tuner.plan import memory, ram

    cap = sp.cache_ram_at(sp.n_cpu_moe[1], None) if cache_ram_mib is None else cache_ram_mib
    most = replace(space.ubatch_config(sp.model, *sp.kv_pairs[0], sp.ctx, sp.parallel, sp.ubatch[-1]),
                   n_cpu_moe=sp.n_cpu_moe[1], cache_ram_mib=cap, mmap=False)
    return ram.ram_side(memory.estimate(info, most, hw), most, hw).headroom_bytes / GIB


def test_the_load_mode_is_an_axis_where_a_gpu_copies_host_experts_and_ram_holds_the_pinned_copy(shape, info):
    """Issue 53: a GPU (the NVML fake), experts on the host and RAM for the pinned copy with the 2 GiB margin:
    --load-mode none vs mmap is searched, rendered as llama-server and llama-bench take it, asked only where
    --no-host leaves a pinned buffer to choose; the pinned copy holds the experts once, as the mapped one does."""
    from tuner.engine import flags
    from tuner.plan import memory

    hw = _fake_gpu_machine(64)
    assert hw.has_gpu and hw.source == "probed"
    sp = space.build_space(shape, info, hw, ctx=32768, parallel=1, prompt_tokens=4096)
    assert sp.n_cpu_moe is not None and sp.n_cpu_moe[0] > 0 and _pinned_headroom(info, sp, hw) > 2
    assert sp.load_mode == ("mmap", "none") and sp.describe()["load_mode"] == ["mmap", "none"]
    assert any(n.startswith("--load-mode none vs mmap searched") for n in sp.left_out)
    configs = list(space.iter_configs(sp))
    assert {(c.no_host, c.mmap) for c in configs} == {(False, True), (False, False), (True, True)}
    pinned = next(c for c in configs if not c.mmap)
    assert space.make_config(sp, space.params_of(sp, pinned)) == pinned
    assert " -lm none" in flags.launch_line(pinned)
    assert flags.parse_command(flags.launch_line(pinned)).config == pinned
    bench = flags.bench_group_argv(Path("llama-bench"), [pinned], n_prompt=8, n_gen=8, repetitions=1)
    assert bench[bench.index("-lm") + 1] == "none"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    asked = [space.suggest(study.ask(), sp) for _ in range(40)]
    assert {c.mmap for c in asked if not c.no_host} == {True, False} and all(c.mmap for c in asked if c.no_host)
    e_pin, e_map = (memory.estimate(info, c, hw) for c in (pinned, replace(pinned, mmap=True)))
    assert e_pin.pinned_bytes == e_map.mapped_bytes > 0 and e_map.pinned_bytes == 0 and e_pin.mapped_bytes == 0
    assert e_pin.host.weights_bytes == e_map.host.weights_bytes
    from tuner.plan import ram

    side = ram.ram_side(e_pin, pinned, hw)
    assert side.locked_bytes == e_pin.pinned_bytes and "GiB of the need pinned" in side.describe()
    assert ram.ram_side(e_map, replace(pinned, mmap=True), hw).locked_bytes == 0


def test_the_load_mode_is_no_axis_where_the_pinned_copy_would_page_or_nothing_is_copied(shape, info):
    """With a GPU: never where the pinned copy would leave under the 2 GiB margin (it cannot be paged out: the mapped
    default stays, said), or where the card holds every expert. On the CPU alone the axis is residence (issue 61): a
    resident copy is offered where it leaves the margin, and said either way."""
    roomy = space.build_space(shape, info, _fake_gpu_machine(64), ctx=32768, parallel=1, prompt_tokens=4096)
    # RAM that holds the mapped experts at the space's most host experts, but leaves the pinned copy 1 GiB (with
    # llama-server's prompt cache capped to nothing, as a line short of RAM would set it).
    need = 64 - _pinned_headroom(info, roomy, _fake_gpu_machine(64), cache_ram_mib=0)
    tight_hw = _fake_gpu_machine(need + 1.0)
    tight = space.build_space(shape, info, tight_hw, ctx=32768, parallel=1, prompt_tokens=4096)
    assert tight.n_cpu_moe == roomy.n_cpu_moe
    assert _pinned_headroom(info, tight, tight_hw, cache_ram_mib=0) == pytest.approx(1.0, abs=0.01)
    assert tight.load_mode == ("mmap",) and "load_mode" not in tight.describe()
    assert any(n.startswith("--load-mode none not searched: its pinned copy of ") for n in tight.left_out)
    assert all(c.mmap for c in space.iter_configs(tight))
    mapped = replace(space.make_config(tight, {"n_cpu_moe": tight.n_cpu_moe[1]}), cache_ram_mib=0)
    assert space.check(info, mapped, tight_hw).feasible  # the mapped default holds there
    big = find_card("RTX 5090").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)
    on_card = space.build_space(shape, info, big, ctx=8192, parallel=1, prompt_tokens=512)
    assert on_card.load_mode == ("mmap",) and all(c.mmap for c in space.iter_configs(on_card))
    assert not any("--load-mode" in n for n in on_card.left_out)
    # The CPU alone (--device none), by the RAM free for this 21 GiB model: 12 GiB holds no resident copy; 32 GiB holds
    # one but not beside the mapped file (a resident line evicts the mapping: searched, said); 64 GiB holds both
    # (nothing evicts it: mmap stays, nothing to say).
    cpu_tight = space.build_space(shape, info, CPU_ONLY, ctx=8192, parallel=1, prompt_tokens=4096)
    assert cpu_tight.load_mode == ("mmap",) and all(c.mmap for c in space.iter_configs(cpu_tight))
    assert any(n.startswith("--load-mode none not searched: a resident copy of the model (")
               for n in cpu_tight.left_out)
    for ram_gib, modes, said in ((32, ("mmap", "none"), "--load-mode none vs mmap searched: a resident copy is never"),
                                 (64, ("mmap",), None)):
        cpu = space.build_space(shape, info, _fake_gpu_machine(ram_gib), ctx=32768, parallel=1, prompt_tokens=4096,
                                device="none")
        assert cpu.load_mode == modes, ram_gib
        assert {c.mmap for c in space.iter_configs(cpu)} == {m == "mmap" for m in modes}
        assert [n for n in cpu.left_out if "--load-mode" in n and (said is None or not n.startswith(said))] == []
        assert said is None or any(n.startswith(said) for n in cpu.left_out), cpu.left_out


def test_the_load_mode_check_and_fits_placement_follow_a_builds_own_host_need(engine_loc, tmp_path, monkeypatch):
    """Issue 58: the pinned copy is judged by the figures in force, not the replay's. b99999 (the pinned binaries
    behind shims, tests/other_engine.py) projects 3 GiB more host compute than the pin; as a CPU build it projects
    no card, so the figures for the card carry its own host drift (what its projection adds beside the replay's,
    read from its llama-fit-params) onto the card's host side. With RAM that leaves the pinned copy the 2 GiB margin
    and 1 GiB more by the replay, the replay searches --load-mode none; b99999's figures leave it under the margin
    and it is not searched. --fit's placement does not move: fit sizes the card alone."""
    from tests.other_engine import other_engine
    from tuner.measure.engine_memory import EngineMemory, deciding
    from tuner.models import shape_model
    from tuner.plan import memory, placement, ram
    from tuner.plan.pricing import corrected
    from tuner.search import levers

    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    q30 = inspect_model(shape_model.write_catalog_model("Qwen3-30B-A3B:Q4_K_M", tmp_path / "q30.gguf").path)
    other = EngineMemory.of(other_engine(engine_loc, tmp_path / "b99999", "b99999", "99999", host_compute_mib=3072))

    def b99999(model, cfg, hw):  # type: ignore[no-untyped-def]
        return corrected(memory.estimate(model, cfg, hw), other.drift(model, cfg, hw.cpu_only()), hw)

    card0 = find_card("RTX 4060 Ti 16GB").hardware(0, 0, 89.6e9, 8, 0)
    most_host = LaunchConfig(model=q30.paths[0], ctx=8192, parallel=1, n_cpu_moe=q30.n_layer, flash_attn=FlashAttn.ON)
    pinned = replace(most_host, mmap=False)
    moved = b99999(q30, pinned, card0).host_need_bytes - memory.estimate(q30, pinned, card0).host_need_bytes
    assert moved == 3072 * 2**20  # b99999's own projection, as its llama-fit-params printed it
    room = memory.estimate(q30, pinned, card0).host_need_bytes + ram.TIGHT_MARGIN_BYTES + GIB
    card = find_card("RTX 4060 Ti 16GB").hardware(room, room, 89.6e9, 8, 0)
    moe = (20, q30.n_layer)
    assert levers.load_mode_axis(q30, card, None, moe, most_host)[0] == levers.LOAD_MODES
    with deciding(b99999):
        modes, note = levers.load_mode_axis(q30, card, None, moe, most_host)
    assert modes == ("mmap",) and note[0].startswith("--load-mode none not searched: its pinned copy of ")
    bare = LaunchConfig(model=q30.paths[0], ctx=8192, parallel=1)
    placed = placement.placed_by_fit(q30, bare, card)
    assert placed.n_cpu_moe and placement.placed_by_fit(q30, bare, card, b99999) == placed
