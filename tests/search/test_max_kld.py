"""auto-tune prices KV cache types by default: a config whose KV pair costs more KL-divergence (vs the f16 cache)
than the floor is never run, and the winner's quality cost is in the result."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from tuner.core.config import CacheType
from tuner.core.errors import UsageError
from tuner.machine import hardware
from tuner.measure.workload import WorkloadKind, preset
from tuner.quality import kv_price
from tuner.report import study_report
from tuner.search import autotune, finish, study

KLD_CTX, KLD_CHUNKS = 256, 4


def _request(model, tmp_path, max_kld: float | None, trials: int) -> autotune.TuneRequest:
    return autotune.TuneRequest(
        model=model, workload=preset(WorkloadKind.CUSTOM, 32, 8, rounds=1), max_kld=max_kld,
        kld_ctx=KLD_CTX, kld_chunks=KLD_CHUNKS, budget=study.Budget(trials=trials),
        measure=study.Measure(n_prompt=32, n_gen=8, repetitions=1, gen_depth=32), storage=f"sqlite:///{tmp_path}/s.db",
        results_dir=tmp_path / "results", top_candidates=1, rounds=finish.Rounds(min=1, max=1),
    )


def test_max_kld_parses_a_number_off_or_the_default():
    assert kv_price.parse_max_kld(None) == kv_price.DEFAULT_MAX_KLD
    assert kv_price.parse_max_kld("off") is None and kv_price.parse_max_kld("0.002") == 0.002
    with pytest.raises(UsageError, match="off"):
        kv_price.parse_max_kld("tiny")


def test_kv_pairs_above_the_floor_are_never_launched(engine_loc, demo_models, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    model = demo_models[("qwen3moe", "Q4_K_M")]
    q8 = kv_price.price(engine_loc, model, CacheType.Q8_0, CacheType.Q8_0, ctx=KLD_CTX, chunks=KLD_CHUNKS)
    q4 = kv_price.price(engine_loc, model, CacheType.Q8_0, CacheType.Q4_0, ctx=KLD_CTX, chunks=KLD_CHUNKS)
    assert 0 < q8.kld_mean < q4.kld_mean and q4.same_top_pct < 100
    floor = (q8.kld_mean + q4.kld_mean) / 2  # q8_0 passes, a 4-bit V does not
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    res = autotune.auto_tune(_request(model, tmp_path, floor, trials=8), engine_loc, hw)
    trials = [t for t in optuna.load_study(study_name=res.study_name, storage=f"sqlite:///{tmp_path}/s.db").trials
              if t.user_attrs.get("status") != "duplicate"]  # a sampler's repeat is skipped before it is priced
    priced = [t for t in trials if "kld" in t.user_attrs]
    assert len(priced) == len(trials)  # every launched or refused config carries its KV pair's price
    for t in priced:
        over = t.user_attrs["kld"] > floor
        assert (t.user_attrs["status"] == "infeasible") == over, t.user_attrs
        if over:
            assert t.state is optuna.trial.TrialState.PRUNED and t.values is None and not t.user_attrs.get("argv")
    doc = res.result.to_dict()
    w = doc["winner"]
    assert w["kld_mean"] is not None and w["kld_mean"] <= floor
    assert doc["quality"]["winner_kld_mean"] == w["kld_mean"] and doc["quality"]["max_kld"] == floor
    assert "mean KLD" in study_report.markdown(res.result)


def test_a_floor_below_every_lossy_pair_leaves_f16(engine_loc, demo_models, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    model = demo_models[("qwen3moe", "Q4_K_M")]
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    res = autotune.auto_tune(_request(model, tmp_path, 0.0, trials=4), engine_loc, hw)
    recs = study.records(optuna.load_study(study_name=res.study_name, storage=f"sqlite:///{tmp_path}/s.db"))
    measured = [r for r in recs if r.status == "measured"]
    assert measured and all((r.config["cache_type_k"], r.config["cache_type_v"]) == ("f16", "f16") for r in measured)
    assert res.result.to_dict()["winner"]["kld_mean"] == 0.0


def test_the_default_floor_on_a_trained_model_runs_q8_0_and_refuses_q4_0(engine_loc, trained_model, tmp_path,
                                                                          monkeypatch):
    """The issue's symptom: with the floor set from random weights auto-tune refused every quantized pair of a
    trained model (kld_over), q8_0/q8_0 included. Priced as auto-tune prices by default (512-token chunks)."""
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    req = replace(_request(trained_model, tmp_path, kv_price.DEFAULT_MAX_KLD, trials=12),
                  kld_ctx=kv_price.PRICE_CTX, kld_chunks=kv_price.PRICE_CHUNKS)
    res = autotune.auto_tune(req, engine_loc, hardware.probe_hardware(host_bandwidth_s=0))
    trials = optuna.load_study(study_name=res.study_name, storage=f"sqlite:///{tmp_path}/s.db").trials
    status = {(t.user_attrs["config"]["cache_type_k"], t.user_attrs["config"]["cache_type_v"]): t.user_attrs["status"]
              for t in trials if "kld" in t.user_attrs}
    assert status[("q8_0", "q8_0")] == "measured" and status[("f16", "q8_0")] == "measured", status
    assert status[("q4_0", "q4_0")] == "infeasible", status
    for t in trials:
        if "kld" in t.user_attrs:
            assert (t.user_attrs["status"] == "infeasible") == (t.user_attrs["kld"] > kv_price.DEFAULT_MAX_KLD)
    assert res.result.to_dict()["quality"]["max_kld"] == kv_price.DEFAULT_MAX_KLD
