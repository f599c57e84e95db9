"""Concurrent requests in one process (llama-batched-bench): the argv, the jsonl, and a real run on the demo
model, including a batch the context cannot hold (the tool skips it and exits 0: that must not pass)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.engine import flags
from tuner.measure import batched, failures


def test_argv_spells_the_config_and_repeats_the_parallel_count():
    cfg = LaunchConfig(model=Path("m.gguf"), ctx=2048, parallel=4, cache_type_k=CacheType.Q8_0,
                       cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON, threads=2)
    argv = flags.batched_bench_argv(Path("llama-batched-bench"), cfg, n_prompt=500, n_gen=12, n_parallel=[4, 4])
    assert argv[:5] == ["llama-batched-bench", "-m", "m.gguf", "-c", "2048"]
    assert argv[argv.index("-npl") + 1] == "4,4" and argv[argv.index("-npp") + 1] == "500"
    assert argv[argv.index("-ctv") + 1] == "q8_0" and argv[argv.index("-fa") + 1] == "on"
    assert argv[-2:] == ["--output-format", "jsonl"] and "-np" not in argv
    with pytest.raises(Exception, match="flash attention"):
        flags.batched_bench_argv(Path("b"), LaunchConfig(model=Path("m"), cache_type_v=CacheType.Q4_0,
                                                         flash_attn=FlashAttn.OFF), n_prompt=1, n_gen=1,
                                 n_parallel=[1])


def test_jsonl_gives_per_request_time_and_aggregate_throughput():
    text = ("main: n_kv_max = 2048\n"
            '{"n_kv_max": 2048, "pp": 100, "tg": 10, "pl": 2, "n_kv": 220, "t_pp": 0.5, "speed_pp": 400, '
            '"t_tg": 0.5, "speed_tg": 40, "t": 1.0, "speed": 220}\n'
            '{"n_kv_max": 2048, "pp": 100, "tg": 10, "pl": 2, "n_kv": 220, "t_pp": 0.6, "speed_pp": 333, '
            '"t_tg": 0.4, "speed_tg": 50, "t": 1.0, "speed": 220}\n')
    runs = batched.parse_jsonl(text)
    res = batched.BatchedResult(("x",), runs, 2.0)
    assert res.request_s == 1.0 and res.aggregate_gen_tok_s == pytest.approx(20.0)
    assert res.per_request_gen_tok_s == pytest.approx((20 + 25) / 2)


def test_two_requests_at_once_on_the_demo_model(engine_loc, demo_models):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    cfg = LaunchConfig(model=model, ctx=512, parallel=2, threads=2)
    res = batched.run_batched(engine_loc, cfg, n_prompt=200, n_gen=8, repetitions=2)
    assert len(res.runs) == 2 and all(r.parallel == 2 and r.n_prompt == 200 for r in res.runs)
    assert res.request_s > 0 and res.request_s >= min(r.total_s for r in res.runs)
    assert min(r.aggregate_gen_tok_s for r in res.runs) <= res.aggregate_gen_tok_s <= max(
        2 * 8 / r.total_s for r in res.runs)
    # Host paging over the second batch (the first has no line before it): measured, and none on the tiny model.
    assert res.host_paging.measured and not res.host_paging.paging, res.host_paging.describe()
    assert "per generated token" in res.host_paging.evidence
    # 2 x (300 + 8) tokens do not fit 512 cells (the tool would skip the batch and exit 0): refused, classified.
    with pytest.raises(failures.TrialFailedError) as info:
        batched.run_batched(engine_loc, cfg, n_prompt=300, n_gen=8, repetitions=1)
    assert info.value.failure.kind is failures.FailureKind.REJECTED_CONFIG
    assert "-c 512 does not hold 2 x (300+8) tokens" in info.value.failure.reason
