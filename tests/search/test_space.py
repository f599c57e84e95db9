"""The search space: axes per machine, the quantized-V ⇒ flash-attention dependency, and memory gating."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from tuner.catalog.cards import find_card
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search import space

GIB = 2**30
MIB = 2**20
CPU_ONLY = Hardware("", 0, 0, 0.0, 0.0, 16 * GIB, 12 * GIB, 0, 20e9, 8, source="none")


@pytest.fixture(scope="module")
def model(demo_models):
    return demo_models[("qwen3moe", "Q4_K_M")]


@pytest.fixture(scope="module")
def info(model):
    return inspect_model(model)


def test_cpu_space_skips_n_cpu_moe_and_ubatch_for_short_prompts(model, info):
    sp = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=1, prompt_tokens=512)
    assert sp.n_cpu_moe is None and sp.ubatch == (None,) and sp.threads == (4, 7, 8) and sp.slots == (1,)
    long = space.build_space(model, info, CPU_ONLY, ctx=8192, parallel=1, prompt_tokens=4096)
    assert long.ubatch == (None, 1024, 2048, 4096)  # 8192 only where the prompt is that long
    batch = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=4, prompt_tokens=256, concurrency=4)
    assert batch.slots == (1, 2, 4) and space.slot_counts(6) == (1, 2, 4, 6)
    with pytest.raises(UsageError):
        space.build_space(model, info, CPU_ONLY, ctx=0, parallel=1, prompt_tokens=8)


def test_gpu_space_searches_n_cpu_moe_near_the_fitting_boundary(model, info):
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9)
    roomy = space.build_space(model, info, hw, ctx=4096, parallel=2, prompt_tokens=512)
    assert roomy.n_cpu_moe == (0, space.N_CPU_MOE_ABOVE)  # everything fits on 16 GB: 0 and a few above
    # A card where the boundary moves with the KV pair: the range runs from the smallest boundary of any pair
    # to the largest plus a few, never from 0 to n_layer.
    f16 = LaunchConfig(model=model, ctx=4096, parallel=2, flash_attn=FlashAttn.ON)
    q4 = replace(f16, cache_type_k=CacheType.Q4_0, cache_type_v=CacheType.Q4_0)
    for mib in range(300, 400):
        small = replace(hw, vram_total_bytes=mib * 2**20, vram_free_bytes=mib * 2**20)
        lo, hi = space.fitting_boundary(info, q4, small, 0), space.fitting_boundary(info, f16, small, 0)
        if lo is not None and hi is not None and lo < hi:
            break
    else:
        pytest.fail("no card size puts the f16 and q4_0 boundaries apart")
    sp = space.build_space(model, info, small, ctx=4096, parallel=2, prompt_tokens=512, vram_margin_mib=0)
    assert sp.n_cpu_moe == (lo, min(info.n_layer, hi + space.N_CPU_MOE_ABOVE))


def test_kv_pairs_are_same_type_or_k_more_precise_and_quantized_v_forces_flash_attention(model, info):
    sp = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=1, prompt_tokens=512)
    rank = {CacheType.F16: 0, CacheType.Q8_0: 1, CacheType.Q4_0: 2}
    assert len(sp.kv_pairs) == 6 and all(rank[k] <= rank[v] for k, v in sp.kv_pairs)
    cfg = space.suggest(optuna.trial.FixedTrial({"kv": "q8_0/q4_0", "threads": 4}), sp)
    assert cfg.flash_attn is FlashAttn.ON and cfg.cache_type_v is CacheType.Q4_0 and cfg.threads == 4
    configs = list(space.iter_configs(sp))
    # (f16/f16 x 2 fa + 5 pairs with quantized V, fa on) x 3 thread counts
    assert len(configs) == (2 + 5) * 3 == sp.size
    for c in configs:
        assert not (c.cache_type_v.is_quantized and c.flash_attn is not FlashAttn.ON)
        assert space.make_config(sp, space.params_of(sp, c)) == c


def test_memory_model_gates_configs_with_constraint_values(model, info):
    tiny = replace(find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9), vram_total_bytes=1100 * 2**20,
                   vram_free_bytes=1100 * 2**20)
    sp = space.build_space(model, info, tiny, ctx=4096, parallel=1, prompt_tokens=512)
    all_gpu = space.make_config(sp, {"n_cpu_moe": 0})
    f = space.check(info, all_gpu, tiny)  # 1 GiB margin + weights + KV + compute + CUDA context > 1100 MiB
    assert not f.feasible and f.vram_over_mib > 0 and f.constraints["vram_over_mib"] == round(f.vram_over_mib, 3)
    assert space.check(info, all_gpu, tiny, vram_margin_mib=0).vram_over_mib < f.vram_over_mib
    roomy = replace(tiny, vram_total_bytes=16 * GIB, vram_free_bytes=16 * GIB)
    assert sp.n_cpu_moe == (info.n_layer, info.n_layer)  # nothing fits the small card: only all-on-host is asked
    guess = space.best_guess(space.build_space(model, info, roomy, ctx=4096, parallel=1, prompt_tokens=512), info,
                             roomy)
    assert guess is not None and guess.n_cpu_moe == 0 and guess.cache_type_k is CacheType.F16
    assert space.check(info, guess, roomy).feasible


def test_a_dense_model_that_does_not_fit_searches_ngl_and_its_line_carries_it(trained_model):
    """SmolLM2-135M (dense llama, 30 layers) on a card whose budget holds about half of it at 8K: the offload axis
    is -ngl (whole layers), not --n-cpu-moe (which moves routed experts: a dense model has none)."""
    from tuner.engine import flags
    from tuner.plan import placement

    info = inspect_model(trained_model)
    assert info.n_expert == 0 and placement.offload_of(info).setting == "n_gpu_layers"
    card = Hardware("RTX test", 12 * GIB, 12 * GIB, 360e9, 25e9, 16 * GIB, 12 * GIB, 0, 50e9, 8, source="catalog")
    whole = placement.fit_interval(info, LaunchConfig(model=trained_model, ctx=8192, parallel=1), card)
    assert whole.lo == 0 and whole.describe() == "fits with -ngl 31..0"  # every layer and the head fit
    sp = space.build_space(trained_model, info, card, ctx=8192, parallel=1, prompt_tokens=128)
    assert sp.n_gpu_layers is None and sp.n_cpu_moe is None and "whole model fits" in sp.n_cpu_moe_why

    # A budget that holds all 31 at f16 needs ~671 MiB (plan's table); give it 1 GiB margin + 500 MiB.
    tight = replace(card, vram_budget_override_bytes=(1024 + 500) * MIB)
    sp = space.build_space(trained_model, info, tight, ctx=8192, parallel=1, prompt_tokens=128)
    assert sp.n_cpu_moe is None and sp.n_gpu_layers is not None
    lo, hi = sp.n_gpu_layers
    def most(k: CacheType, v: CacheType) -> int:
        cfg = LaunchConfig(model=trained_model, ctx=8192, parallel=1, cache_type_k=k, cache_type_v=v,
                           flash_attn=FlashAttn.ON)
        return max(n for n in range(32) if space.check(info, replace(cfg, n_gpu_layers=n), tight).feasible)

    per_pair = {kv: most(*kv) for kv in sp.kv_pairs}
    assert hi == max(per_pair.values()) < 31  # the most layers that fit at any KV pair: not all
    assert per_pair[(CacheType.F16, CacheType.F16)] < hi  # a smaller cache leaves room for more layers
    assert lo == max(0, min(per_pair.values()) - space.N_CPU_MOE_ABOVE)
    assert "-ngl searched" in sp.n_cpu_moe_why and sp.describe()["n_gpu_layers"] == [lo, hi]
    guess = space.best_guess(sp, info, tight)
    # The memory model's pick: the most precise KV pair, with the most layers that fit at it.
    assert guess is not None and guess.n_gpu_layers == per_pair[(CacheType.F16, CacheType.F16)]
    assert f"-ngl {guess.n_gpu_layers}" in flags.launch_line(guess)
    grid = list(space.iter_configs(sp))
    assert {c.n_gpu_layers for c in grid} == set(range(lo, hi + 1))
    assert space.make_config(sp, space.params_of(sp, guess)) == guess


def test_prompt_heavy_workloads_offer_big_ubatches_with_a_batch_as_large(model, info):
    """With host experts each ubatch copies them to the GPU: a prompt of 4,096 tokens or more is offered -ub 4096
    (8192 where the prompt is that long and the context holds it), and -b rises with it (llama.cpp clamps -ub to
    -b, 2048 unless given: ``llama_context``'s ``n_ubatch = min(n_batch, n_ubatch)``)."""
    from tuner.engine import flags

    assert space.ubatch_choices(4095, 65536) == (None, 1024, 2048)
    assert space.ubatch_choices(4096, 65536) == (None, 1024, 2048, 4096)
    assert space.ubatch_choices(8192, 65536) == (None, 1024, 2048, 4096, 8192)
    assert space.ubatch_choices(8192, 4096) == (None, 1024, 2048, 4096)  # the batch cannot pass the context
    sp = space.build_space(model, info, CPU_ONLY, ctx=16384, parallel=1, prompt_tokens=8192)
    assert sp.ubatch == (None, 1024, 2048, 4096, 8192)
    big = space.make_config(sp, {"ubatch": 4096})
    assert (big.ubatch, big.batch) == (4096, 4096)
    assert space.make_config(sp, {"ubatch": 2048}).batch is None  # the engine's own -b 2048 holds it
    line = flags.launch_line(big)
    assert "-b 4096" in line and "-ub 4096" in line
    argv = flags.bench_argv(Path("llama-bench"), space.make_config(sp, {"ubatch": 8192}), n_prompt=8192, n_gen=16,
                            repetitions=1)
    assert argv[argv.index("-b") + 1] == argv[argv.index("-ub") + 1] == "8192"
    for cfg in space.iter_configs(sp):
        assert cfg.batch is None or cfg.batch >= (cfg.ubatch or 0)
        assert (cfg.ubatch or 512) <= 2048 or cfg.batch == cfg.ubatch
        assert space.make_config(sp, space.params_of(sp, cfg)) == cfg


def test_the_memory_model_prices_the_big_ubatch_and_leaves_out_one_that_never_fits(tmp_path):
    """Qwen3.5-35B-A3B at -c 16384, one slot: the compute buffer grows with -ub (activations are n_embd x ubatch
    per tensor), while llama-server reserves logits for one output a slot, not a ubatch of them
    (server_context::load_model sets n_outputs_max from common_speculative_n_max; llama_context::llama_context
    reserves min(n_tokens, n_outputs_max)). A bigger ubatch moves experts to the host on an 8 GB card; on a
    (fake) card sized between -ub 4096 and -ub 8192 with every expert on the host, 8192 fits nowhere and is left
    out, said, and 4096 stays."""
    from tuner.models import shape_model
    from tuner.plan import memory, placement

    path = shape_model.write_catalog_model("Qwen3.5-35B-A3B:Q4_K_M", tmp_path / "q35.gguf").path
    big = inspect_model(path)
    card = find_card("RTX 4060 Ti 8GB").hardware(64 * GIB, 60 * GIB, 50e9)
    by_ub = {u: space.fitting_boundary(big, space.ubatch_config(path, CacheType.Q8_0, CacheType.Q8_0, 16384, 1, u),
                                       card) for u in (None, 4096, 8192)}
    assert None not in by_ub.values() and by_ub[None] < by_ub[4096] < by_ub[8192]  # each doubling costs experts
    cfg = space.make_config(space.build_space(path, big, card, ctx=16384, parallel=1, prompt_tokens=8192),
                            {"ubatch": 4096, "n_cpu_moe": by_ub[4096], "kv": "q8_0/q8_0"})
    assert space.check(big, cfg, card).feasible
    assert space.check(big, replace(cfg, n_cpu_moe=by_ub[4096] - 1), card).vram_over_mib > 0

    every = big.n_layer
    need = {u: max(memory.estimate(big, replace(space.ubatch_config(path, k, v, 16384, 1, u), n_cpu_moe=every),
                                   card).gpu.total_bytes for k, v in space.KV_PAIRS) for u in (4096, 8192)}
    low = min(memory.estimate(big, replace(space.ubatch_config(path, k, v, 16384, 1, 8192), n_cpu_moe=every),
                              card).gpu.total_bytes for k, v in space.KV_PAIRS)
    assert need[4096] < low  # the cheapest KV pair at 8192 needs more than the dearest at 4096
    budget = (need[4096] + low) // 2 + memory.FIT_MARGIN_BYTES
    tiny = replace(card, vram_total_bytes=budget, vram_free_bytes=budget)  # a fake card at the hardware boundary
    assert placement.overs(memory.estimate(big, replace(cfg, n_cpu_moe=every), tiny), tiny)[0] < 0
    sp = space.build_space(path, big, tiny, ctx=16384, parallel=1, prompt_tokens=8192)
    assert sp.ubatch == (None, 1024, 2048, 4096)
    assert sp.left_out[0] == "-ub 8192 left out: its compute buffer fits at no --n-cpu-moe on this card at -c 16384"
    assert not any("-ub" in n and "left out" in n for n in sp.left_out[1:])


def _experts_bytes(info, layer: int) -> int:
    """What one layer's routed experts weigh, read from the GGUF header (the tensors --n-cpu-moe moves)."""
    return sum(t.n_bytes for t in info.tensors if t.name.startswith(f"blk.{layer}.") and "_exps" in t.name)


def test_each_config_carries_its_own_cache_ram_and_more_host_experts_a_smaller_one():
    """Issues 41 and 51: llama-server's prompt cache may grow to --cache-ram 8192 MiB (common_params::cache_ram_mib)
    beside the host experts, and each config is priced on its own: one more layer's experts on the host takes that
    layer's expert bytes (read from the header) from the cache's room. With room for the default beside the fewest
    host experts only, the configs with more carry ever smaller caps (it was once priced at the fewest alone, so
    none carried one); where even the fewest leave no room, every line carries its cap, the memory gate refuses the
    same config without it, and llama.cpp's own arms (the bare launch, --fit's placement) carry theirs too."""
    from tuner.engine import flags
    from tuner.hub.resolve import resolve_model
    from tuner.plan.memory import estimate
    from tuner.search import known_good

    shape = resolve_model("qwen3.6-35b-a3b:Q4_K_M", header_only=True).path
    info = inspect_model(shape)
    card = find_card("RTX 4060 8GB")
    roomy = space.build_space(shape, info, card.hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0), ctx=32768, parallel=1,
                              prompt_tokens=512)
    assert roomy.cache_ram_caps == () and roomy.n_cpu_moe is not None  # 64 GiB: the default fits everywhere
    lo, hi = roomy.n_cpu_moe
    need = estimate(info, space.make_config(roomy, {"n_cpu_moe": lo}), card.hardware(0, 0, 89.6e9, 8, 0))
    for spare_gib, fewest_capped in ((10.25, False), (8.25, True)):  # beside the fewest: 8 GiB cache + 2 GiB kept
        ram = int(need.host_need_bytes + spare_gib * GIB)
        hw = card.hardware(ram, ram, 89.6e9, 8, 0)
        sp = space.build_space(shape, info, hw, ctx=32768, parallel=1, prompt_tokens=512)
        assert sp.n_cpu_moe == (lo, hi)
        caps = [space.make_config(sp, {"n_cpu_moe": n}).cache_ram_mib for n in range(lo, hi + 1)]
        assert (caps[0] is not None) == fewest_capped and all(c is not None for c in caps[1:]), caps
        for n in range(lo + 1, hi):  # each step moves layer n's experts to the host: that much less cache
            step = caps[n - lo] - caps[n + 1 - lo]
            assert abs(step * MIB - _experts_bytes(info, n)) < 256 * MIB, (n, step, _experts_bytes(info, n))
        for cfg in space.iter_configs(sp):  # every line the search can print carries its cap
            line = flags.launch_line(cfg)
            assert cfg.cache_ram_mib is not None or cfg.n_cpu_moe == lo, line
            assert ("-cram " in line) == (cfg.cache_ram_mib is not None), line
        for n in range(lo + 1, hi + 1):  # the gate counts the default cache: without the cap the line is refused
            capped = space.make_config(sp, {"n_cpu_moe": n})
            assert space.check(info, capped, hw).feasible
            assert space.check(info, replace(capped, cache_ram_mib=None), hw).feasible == (not fewest_capped), n
        fit = LaunchConfig(model=shape, ctx=32768, parallel=1, n_cpu_moe=hi)  # --fit's placement, as parsed
        default, fit_arm = known_good.own_choice(sp, info, hw, fit)
        assert default.n_cpu_moe is None and default.cache_ram_mib == fit_arm.cache_ram_mib == caps[-1]
    assert any("--cache-ram" in n and f"at --n-cpu-moe {hi}" in n for n in sp.left_out), sp.left_out


def test_a_cuda_rig_with_host_experts_searches_op_offload_and_the_host_buffer():
    """Issue 43: where experts live in RAM and a GPU is there, op offload (on/off) and the host buffer (default or
    --no-host) are axes, each rendered as the llama-server and llama-bench flags the pinned engine takes; a CPU
    run, or a card that holds every expert, searches neither."""
    from tuner.engine import flags
    from tuner.hub.resolve import resolve_model

    shape = resolve_model("qwen3.6-35b-a3b:Q4_K_M", header_only=True).path
    info = inspect_model(shape)
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)
    sp = space.build_space(shape, info, hw, ctx=32768, parallel=1, prompt_tokens=4096)
    assert sp.n_cpu_moe is not None and sp.n_cpu_moe[1] > 0
    assert sp.op_offload == (True, False) and sp.no_host == (False, True)
    assert sp.describe()["op_offload"] == [True, False] and any("op offload (on/off)" in n for n in sp.left_out)
    configs = list(space.iter_configs(sp))
    assert {(c.op_offload, c.no_host) for c in configs} == {(True, False), (False, False), (True, True),
                                                             (False, True)}
    off = next(c for c in configs if not c.op_offload and c.no_host)
    assert space.make_config(sp, space.params_of(sp, off)) == off  # seeds map back onto the space
    line = flags.launch_line(off)
    assert "--no-op-offload" in line.split() and "--no-host" in line.split()
    assert flags.parse_command(line).config == off
    bench = flags.bench_group_argv(Path("llama-bench"), [off], n_prompt=8, n_gen=8, repetitions=1)
    assert bench[bench.index("-nopo") + 1] == "1" and bench[bench.index("--no-host") + 1] == "1"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))  # four combos in 40 draws, every run
    suggested = {(c.op_offload, c.no_host) for c in (space.suggest(study.ask(), sp) for _ in range(40))}
    assert len(suggested) == 4
    for cpu in (space.build_space(shape, info, CPU_ONLY, ctx=32768, parallel=1, prompt_tokens=4096),
                space.build_space(shape, info, hw, ctx=32768, parallel=1, prompt_tokens=4096, device="none")):
        assert cpu.op_offload == (True,) and cpu.no_host == (False,) and "op_offload" not in cpu.describe()
    big = find_card("RTX 5090").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)
    whole = space.build_space(shape, info, big, ctx=8192, parallel=1, prompt_tokens=512)
    assert whole.n_cpu_moe is not None and whole.n_cpu_moe[0] == 0 and whole.op_offload == (True,)


def test_op_offload_off_has_no_gpu_copy_and_no_pcie_ceiling():
    """With op offload, the GPU's compute buffer must hold the largest host weight copied up for a >= 32-token
    ubatch (where that is more than the graph's own) and the prompt is bounded by PCIe
    (ggml_backend_cuda_device_offload_op); --no-op-offload has neither."""
    from tuner.hub.resolve import resolve_model
    from tuner.plan import memory, roofline

    shape = resolve_model("qwen3.6-35b-a3b:Q4_K_M", header_only=True).path
    info = inspect_model(shape)
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)
    on = LaunchConfig(model=shape, ctx=8192, parallel=1, n_cpu_moe=30, flash_attn=FlashAttn.ON)
    off = replace(on, op_offload=False)
    e_on, e_off = memory.estimate(info, on, hw), memory.estimate(info, off, hw)
    assert e_off.gpu_offload_copy_bytes == 0 and e_off.gpu.compute_bytes <= e_on.gpu.compute_bytes
    assert roofline.roofline(info, on, hw).prompt_tok_s and roofline.roofline(info, off, hw).prompt_tok_s is None


def test_the_default_seed_is_placed_where_its_own_kv_fits_not_at_the_smallest_pairs_bound():
    """On an H100 with 12 GiB free (results/benchmarks/gpu-lease-2, -c 8192 chat), the space ran from
    --n-cpu-moe 21 (the q4_0/q4_0 bound) and the default seed, f16 KV, was put there: the gate refused it
    untried (284 MiB over), in four tunes of five, one trial of three lost each time. The seed now takes the
    fewest host experts at which its own f16 KV fits; llama-fit-params' choice and the memory model's stay."""
    from tuner.hub.resolve import resolve_model
    from tuner.search import known_good

    shape = resolve_model("qwen3-30b-a3b:Q4_K_M", header_only=True).path
    info = inspect_model(shape)
    h100 = Hardware("NVIDIA H100 80GB HBM3", 81559 * MIB, 12288 * MIB, 3.35e12, 63e9, 126 * GIB, 120 * GIB, 0,
                    50e9, 16)
    sp = space.build_space(shape, info, h100, ctx=8192, parallel=1, prompt_tokens=512)
    assert sp.n_cpu_moe is not None
    label, seed = known_good.seed_configs(sp, info, h100, None)[0]
    assert label == "default" and (seed.cache_type_k, seed.cache_type_v) == (CacheType.F16, CacheType.F16)
    assert space.check(info, seed, h100).feasible
    assert seed.n_cpu_moe is not None and seed.n_cpu_moe > sp.n_cpu_moe[0]  # the bound is the small pair's
    assert not space.check(info, replace(seed, n_cpu_moe=seed.n_cpu_moe - 1), h100).feasible
