from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.conftest import run_cli
from tests.hub_server import HubServer, root_layout
from tuner.catalog import cards
from tuner.core.config import CacheType, LaunchConfig
from tuner.machine.hardware import Hardware
from tuner.models import gguf_reader
from tuner.plan import placement, roofline
from tuner.plan.memory import FIT_MARGIN_BYTES, estimate

CPU_ONLY = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")


def test_plan_rows_and_summaries(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    hw = cards.find_card("RTX 3060").hardware(32 * 2**30, 30 * 2**30, 40e9)
    p = placement.make_plan(info, LaunchConfig(model=info.paths[0], ctx=8192), hw, kv_choices=placement.KV_CHOICES)
    assert [r.n_cpu_moe for r in p.rows] == list(range(info.n_layer + 1))
    vram = [r.estimate.gpu.total_bytes for r in p.rows]
    assert vram == sorted(vram, reverse=True) and vram[0] > vram[-1]
    assert all(r.fits for r in p.rows)
    assert p.smallest_fits[0].n_cpu_moe == 0
    assert all(lc.ctx == info.ctx_train for lc in p.largest_ctx)  # the tiny model fits at its full context
    # Ceilings fall as experts move to the host; pp is PCIe-bound only once experts are offloaded.
    tg = [r.roofline.gen_tok_s for r in p.rows]
    assert tg == sorted(tg, reverse=True) and p.rows[0].roofline.prompt_tok_s is None
    assert p.rows[1].roofline.prompt_tok_s and p.rows[1].roofline.prompt_tok_s > 0


def test_smallest_fit_on_a_small_card(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "F16")])
    hw = cards.find_card("RTX 3060").hardware(32 * 2**30, 30 * 2**30, 40e9)
    # A card just big enough for everything but a few layers' experts, plus the 1 GiB margin.
    need_all = placement.plan_rows(info, LaunchConfig(model=info.paths[0], ctx=4096), hw)
    small = replace(hw, vram_total_bytes=need_all[3].estimate.gpu.total_bytes + FIT_MARGIN_BYTES)
    cfg = LaunchConfig(model=info.paths[0], ctx=4096)
    assert placement.smallest_fitting_n_cpu_moe(info, cfg, small) == 3


def test_roofline_arithmetic(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "F16")])
    hw = cards.find_card("RTX 3090").hardware(32 * 2**30, 30 * 2**30, 50e9)
    cfg = LaunchConfig(model=info.paths[0], ctx=4096, n_cpu_moe=info.n_layer)
    r = roofline.roofline(info, cfg, hw)
    experts = info.bytes_by_class()[gguf_reader.TensorClass.ROUTED_EXPERTS]
    assert r.host_bytes_per_token == int(experts * info.n_expert_used / info.n_expert)
    expect = 1 / (r.gpu_bytes_per_token / hw.gpu_bandwidth_bytes_s + r.host_bytes_per_token / 50e9)
    assert abs(r.gen_tok_s - expect) / expect < 1e-6
    assert r.percent_of_ceiling(r.gen_tok_s / 2) == 50.0


def test_cli_plan_for_a_card_without_gpu(demo_models):
    model = demo_models[("qwen35moe", "Q4_K_M")]
    res = run_cli("plan", str(model), "--gpu", "RTX 4060 Ti 16GB", "--ram", "32", "-c", "8192,16384",
                  "-ctk", "q8_0", "-ctv", "q8_0", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert "RTX 4060 Ti 16GB" in data["hardware"] and len(data["rows"]) == 9
    assert {s["ctx"] for s in data["fit_intervals"]} == {8192, 16384}
    assert all(s["lo"] == 0 and s["hi"] == 8 for s in data["fit_intervals"])  # the tiny model fits anywhere
    assert data["rows"][0]["verdict"] == "fits" and data["rows"][0]["gpu"]["recurrent"] > 0


def test_cli_plan_errors(demo_models, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    res = run_cli("plan", str(bad))
    assert res.returncode == 1 and "truncated" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("plan", str(demo_models[("qwen3moe", "Q8_0")]), "--gpu", "RTX 1234")
    assert res.returncode == 1 and "no card matches" in res.stderr
    res = run_cli("plan", str(demo_models[("qwen3moe", "Q8_0")]), "-ctv", "q8_0", "-fa", "off")
    assert res.returncode == 1 and "flash attention" in res.stderr


def test_plan_row_tolerance_and_engine_check_rows(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    cfg = LaunchConfig(model=info.paths[0], ctx=4096, parallel=1)
    est = estimate(info, cfg, CPU_ONLY)
    mib = 2**20
    host = {"model": (est.engine_host_weights_bytes - est.repack_bytes) // mib + 3,
            "context": est.host.context_bytes // mib,
            "compute": est.host.compute_bytes // mib + 40}
    rows = placement.engine_check_rows(est, True, host, None, info.tensor_bytes)
    assert [(r.component, r.error_mib, r.agrees) for r in rows] == [
        ("weights", -3, True), ("context", 0, True), ("compute", -40, False)]


def test_cli_plan_catalog_shape_with_engine_check(tmp_path, engine_loc):
    env = {"MOE_TUNE_CACHE": str(tmp_path / "mt"), "LLAMA_CPP_DIR": str(engine_loc.bin_dir)}
    res = run_cli("plan", "qwen3-30b-a3b:Q4_K_M", "--gpu", "RTX 3060 12GB", "--ram", "64", "-c", "32768",
                  "--engine-check", "--json", env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert "quant catalog" in data["model_source"] and "memory model" in data["figures_from"]
    assert len(data["rows"]) == 49 and data["rows"][0]["verdict"] == "needs spill"  # 17 GiB of weights, 12 GB card
    assert data["rows"][-1]["verdict"] == "fits"
    check = {c["component"]: c for c in data["engine_check"]}
    assert check["context"]["engine_mib"] == 3072 and check["context"]["model_mib"] == 3072  # 48 layers × 64 KiB
    assert all(c["agrees"] for c in data["engine_check"]), data["engine_check"]
    res = run_cli("plan", "qwen3-30b-a3b:Q4_K_M", "-c", "8192", env=env)
    assert res.returncode == 0 and "--engine-check" in res.stdout and "memory model" in res.stdout


def test_cli_plan_of_the_dense_qwen35_shape_agrees_with_llama_cpp(tmp_path, engine_loc):
    """Qwen3.5-9B (dense hybrid: 32 layers, KV on every 4th) planned along -ngl; llama-fit-params' projection of
    the shape-true file is the expected figure for every component (context: 8 KV layers x 32,768 cells x
    4 heads x 256 x 2 (K, V) x f16 = 1,024 MiB, plus the DeltaNet state)."""
    env = {"MOE_TUNE_CACHE": str(tmp_path / "mt"), "LLAMA_CPP_DIR": str(engine_loc.bin_dir)}
    res = run_cli("plan", "qwen3.5-9b:Q4_K_M", "--gpu", "RTX 3060 12GB", "--ram", "64", "-c", "32768",
                  "--engine-check", "--json", env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["dense"] and len(data["rows"]) == 34 and data["rows"][0]["n_gpu_layers"] == 33
    check = {c["component"]: c for c in data["engine_check"]}
    assert check["context"]["engine_mib"] >= 1024 and all(c["agrees"] for c in data["engine_check"])


def test_cli_plan_reads_a_hub_quant_header_only(demo_models, tmp_path):
    model = demo_models[("qwen35moe", "Q4_K_M")]
    with HubServer() as srv:
        srv.add_repo("demo/Plan-GGUF", root_layout({"Q4_K_M": model}, "Plan"))
        env = {"HF_ENDPOINT": srv.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"),
               "MOE_TUNE_CACHE": str(tmp_path / "mt"), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": ""}
        res = run_cli("plan", "demo/Plan-GGUF:Q4_K_M", "-c", "8192", "--json", env=env)
        assert res.returncode == 0, res.stderr
        assert srv.body_bytes("Plan-Q4_K_M") < model.stat().st_size // 2  # the header, not the weights
    data = json.loads(res.stdout)
    assert "range requests" in data["model_source"]
    # One row per --n-cpu-moe where a card is planned for; one row on a machine with none (issue 67).
    cpu_only = data["hardware"].startswith("CPU only")
    assert len(data["rows"]) == (1 if cpu_only else gguf_reader.inspect_model(model).n_layer + 1)
    res = run_cli("plan", "no-such-model:Q4_K_M")
    assert res.returncode == 1 and "Qwen3-30B-A3B" in res.stderr and "Traceback" not in res.stderr


def test_fit_verdict_in_the_users_words(demo_models):
    from tuner.catalog import cards
    from tuner.models.gguf_reader import inspect_model
    from tuner.plan import placement

    model = inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    card = cards.find_card("RTX 3060 12GB").hardware(64 << 30, 60 << 30, 0.0)
    assert placement.fit_verdict(model, 8192, card) == "VRAM"
    # The same shapes at 3000x the bytes (~30 GB): the experts must move to RAM, all or in part.
    big = placement.scaled(model, 3000.0)
    assert big.tensor_bytes > 2900 * model.tensor_bytes
    verdict = placement.fit_verdict(big, 8192, card)
    assert verdict.startswith("offload ") or verdict == "no"
    cpu_only = cards.machine(None)
    if not cpu_only.has_gpu:
        assert placement.fit_verdict(model, 8192, cpu_only) == "RAM (no GPU)"


def test_make_plan_estimates_each_config_once(demo_models, monkeypatch):
    """The table's ctx/KV pair is also the first summary's: its estimates are made once and serve both."""
    from collections import Counter

    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    hw = cards.find_card("RTX 3060").hardware(32 * 2**30, 30 * 2**30, 40e9)
    seen: Counter[LaunchConfig] = Counter()

    def counting(model, cfg, hw):
        seen[cfg] += 1
        return estimate(model, cfg, hw)

    monkeypatch.setattr(placement, "estimate", counting)
    # ctx 1000 is no multiple of 256, so the largest-context search (which steps by 256) never lands on it.
    p = placement.make_plan(info, LaunchConfig(model=info.paths[0], ctx=1000), hw, [1000, 2000],
                            placement.KV_CHOICES)
    summary = {cfg: k for cfg, k in seen.items() if cfg.ctx in (1000, 2000)}
    table = [cfg for cfg in summary if cfg.ctx == 1000 and cfg.cache_type_k == cfg.cache_type_v == CacheType.F16]
    assert len(table) == info.n_layer + 1  # every step of the table, and no other estimate of its pair
    assert set(summary.values()) == {1}, [cfg for cfg, k in summary.items() if k > 1][:2]
    assert p.smallest_fits[0].interval == placement.fit_interval(info, LaunchConfig(model=info.paths[0], ctx=1000), hw)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_the_bisected_interval_is_the_one_every_step_gives(kind, demo_models, trained_model):
    """fit_interval bisects each end (the card's need falls step by step, the host's rises); it must say what
    interval_of says over every step: fits, short of VRAM, short of RAM, short of both, a card with no GPU."""
    path = demo_models[("qwen3moe", "Q4_K_M")] if kind == "moe" else trained_model
    info = gguf_reader.inspect_model(path)
    axis = placement.offload_of(info)
    base = LaunchConfig(model=path, ctx=4096)
    card = cards.find_card("RTX 3060").hardware(32 * 2**30, 32 * 2**30, 40e9)
    every = [estimate(info, axis.apply(base, n), card) for n in range(axis.steps)]
    gpu = [e.gpu.total_bytes + FIT_MARGIN_BYTES for e in every]
    host = [e.host.total_bytes for e in every]
    seen = set()
    for vram in (gpu[-1] - 1, gpu[-1], (gpu[0] + gpu[-1]) // 2, gpu[0], gpu[0] + 2**30):
        for ram in (host[0] - 1, host[0], (host[0] + host[-1]) // 2, host[-1], host[-1] + 2**30):
            hw = replace(card, ram_total_bytes=ram, ram_available_bytes=ram, vram_total_bytes=vram,
                         vram_free_bytes=vram)
            want = placement.interval_of([estimate(info, axis.apply(base, n), hw) for n in range(axis.steps)], hw,
                                         axis=axis)
            assert placement.fit_interval(info, base, hw) == want, (vram, ram)
            seen.add((want.fits, want.ram_short_bytes is None, want.vram_short_bytes is None))
    assert len(seen) >= 4  # fits, and each way of not fitting
    cpu = cards.machine(None)
    if not cpu.has_gpu:
        assert placement.fit_interval(info, base, cpu) == placement.interval_of(
            [estimate(info, axis.apply(base, n), cpu) for n in range(axis.steps)], cpu, axis=axis)


def test_cli_plan_of_a_dense_model_is_along_ngl(trained_model):
    """SmolLM2-135M (dense, 30 layers): --n-cpu-moe would print 31 identical rows (it moves routed experts, and
    there are none); the plan is along -ngl, 31 (every layer and the output head) down to 0, VRAM falling with
    every layer moved to the host and host RAM rising."""
    res = run_cli("plan", str(trained_model), "--gpu", "RTX 3060 12GB", "--vram-budget", "1524", "-c", "8192",
                  "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["dense"] is True and doc["offload_flag"] == "--n-gpu-layers"
    rows = doc["rows"]
    assert [r["n_gpu_layers"] for r in rows] == list(range(31, -1, -1)) and "n_cpu_moe" not in rows[0]
    vram = [r["vram_bytes"] for r in rows]
    ram = [r["ram_need_bytes"] for r in rows]
    assert all(a > b for a, b in zip(vram, vram[1:], strict=False))  # each layer moved frees VRAM ...
    assert all(a <= b for a, b in zip(ram, ram[1:], strict=False))  # ... and takes host RAM
    first = doc["fit_intervals"][0]
    assert first["setting"] == "n_gpu_layers" and first["summary"].startswith("fits with -ngl ")
    assert first["n_gpu_layers"] == first["flag_lo"] < 31  # the most layers that fit the 500 MiB left
    assert rows[31 - first["flag_lo"]]["verdict"] == "fits" and rows[30 - first["flag_lo"]]["verdict"] != "fits"
    text = run_cli("plan", str(trained_model), "--gpu", "RTX 3060 12GB", "-c", "8192")
    assert text.returncode == 0 and "dense;" in text.stdout and "--n-gpu-layers" in text.stdout
    assert "--n-cpu-moe moves nothing" in text.stdout


def _plan_json(*argv: str) -> dict:
    res = run_cli("plan", *argv, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_the_ram_side_shows_headroom_tight_rows_and_the_prompt_cache_that_fits():
    """Issue 41: with --ram 24, Qwen3.6-35B-A3B Q4_K_M on an 8 GB card was called "fits" at the first --n-cpu-moe
    that fits VRAM with well under a GiB to spare. Each row now shows what is left beside it, with llama-server's
    prompt cache at the size it can reach (--cache-ram 8192 MiB by default, common_params::cache_ram_mib), and
    a row under the 2 GiB margin is tight; the cache that fits is what the line sets."""
    doc = _plan_json("qwen3.6-35b-a3b:Q4_K_M", "--gpu", "RTX 4060 8GB", "--ram", "24", "-c", "32768")
    avail, margin, mib = doc["ram_available_bytes"], doc["ram_tight_margin_bytes"], 2**20
    assert avail == 24 * 2**30 and margin == 2 * 2**30
    for r in doc["rows"]:
        cache = r["cache_ram_fit_mib"] * mib if r["cache_ram_fit_mib"] is not None else 8192 * mib
        assert r["ram_headroom_bytes"] == avail - r["ram_need_bytes"] - cache
        if r["cache_ram_fit_mib"] is not None:  # the default cache would leave less than the margin
            assert avail - r["ram_need_bytes"] - 8192 * mib < margin
            assert r["cache_ram_fit_mib"] % 256 == 0 and r["ram_headroom_bytes"] >= margin or \
                r["cache_ram_fit_mib"] == 0
        assert r["ram_tight"] == (r["ram_need_bytes"] <= avail and r["ram_headroom_bytes"] < margin)
    first = next(r for r in doc["rows"] if r["verdict"] == "fits")
    assert first["ram_tight"] and first["cache_ram_fit_mib"] == 0  # no room left for any prompt cache
    assert first["ram_headroom_bytes"] < margin
    assert any("launch it with --cache-ram 0" in n for n in doc["notes"])
    roomy = _plan_json("qwen3.6-35b-a3b:Q4_K_M", "--gpu", "RTX 4060 8GB", "--ram", "64", "-c", "32768")
    first = next(r for r in roomy["rows"] if r["verdict"] == "fits")
    assert not first["ram_tight"] and first["cache_ram_fit_mib"] is None
    assert first["ram_headroom_bytes"] == 64 * 2**30 - first["ram_need_bytes"] - 8192 * mib
    table = run_cli("plan", "qwen3.6-35b-a3b:Q4_K_M", "--gpu", "RTX 4060 8GB", "--ram", "24", "-c", "32768")
    assert " tight " in table.stdout and "RAM left" in table.stdout
    rule = next(line for line in table.stdout.splitlines() if "───" in line)
    assert len(rule.rstrip()) <= 80  # the table fits 80 columns


def test_ram_holders_name_a_real_process_holding_ram():
    """What holds the rest of RAM is named from the machine itself: a real process holding 512 MiB (touched)."""
    import subprocess
    import sys

    from tuner.machine.hardware import ram_holders

    code = "import sys,time; b = bytearray(512 * 2**20); b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); " \
           "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"1"
        held = dict(ram_holders(limit=50))
        python = {name: rss for name, rss in held.items() if name.startswith("python")}
        assert python and max(python.values()) >= 512 * 2**20
    finally:
        proc.kill()
        proc.wait()


def test_bench_is_warned_before_measuring_a_config_the_plan_says_exceeds_or_fills_ram(demo_models, engine_loc):
    """A config whose host side exceeds RAM measures the disk, not the config (issue 41: 4.3 vs 18.3 tok/s beside
    a balloon, "spill: none"): bench says so before measuring. The demo model's whole host need is tens of MiB."""
    from tuner.cli.cmd_bench import _ram_warning as before_measuring

    model = demo_models[("qwen3moe", "Q4_K_M")]
    cfg = LaunchConfig(model=model, ctx=2048, parallel=1, cache_ram_mib=0)
    hw = cards.machine(None)
    assert before_measuring(engine_loc, cfg, replace(hw, ram_available_bytes=8 * 2**30)) is None
    tight = before_measuring(engine_loc, cfg, replace(hw, ram_available_bytes=1 * 2**30))
    assert tight is not None and "tight" in tight and "it may measure the disk" in tight
    over = before_measuring(engine_loc, cfg, replace(hw, ram_available_bytes=4 * 2**20))
    assert over is not None and "exceeds RAM by" in over
