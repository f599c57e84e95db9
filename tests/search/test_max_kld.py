"""auto-tune with a quality floor: configs whose measured KL-divergence is above --max-kld are never run."""

from __future__ import annotations

import optuna
import pytest

from tuner.core.config import CacheType
from tuner.core.errors import UsageError
from tuner.machine import hardware
from tuner.measure.workload import WorkloadKind, preset
from tuner.quality import perplexity
from tuner.search import autotune, study

KLD_CTX, KLD_CHUNKS = 256, 4


def _request(model, tmp_path, max_kld: float) -> autotune.TuneRequest:
    return autotune.TuneRequest(
        model=model, workload=preset(WorkloadKind.CUSTOM, 64, 16, rounds=1), max_kld=max_kld,
        kld_ctx=KLD_CTX, kld_chunks=KLD_CHUNKS, budget=study.Budget(trials=2),
        measure=study.Measure(n_prompt=32, n_gen=8, repetitions=1), storage=f"sqlite:///{tmp_path}/s.db",
        results_dir=tmp_path / "results", top_candidates=1,
    )


def test_configs_above_max_kld_are_infeasible_and_never_launched(engine_loc, demo_models, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    model = demo_models[("qwen3moe", "Q4_K_M")]  # its F16 lies beside it: the reference
    floor = perplexity.measure(engine_loc, model, cache_type_k=CacheType.F16, cache_type_v=CacheType.F16,
                            ctx=KLD_CTX, chunks=KLD_CHUNKS).kld_mean
    assert floor is not None and floor > 0
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    # Below the quant's own KLD at f16 KV: no KV choice can meet it, so nothing may be measured.
    with pytest.raises(UsageError, match=r"raise --max-kld"):
        autotune.auto_tune(_request(model, tmp_path, floor / 2), engine_loc, hw)
    trials = [t for s in optuna.get_all_study_summaries(f"sqlite:///{tmp_path}/s.db")
              for t in optuna.load_study(study_name=s.study_name, storage=f"sqlite:///{tmp_path}/s.db").trials]
    assert trials and all(t.state is optuna.trial.TrialState.PRUNED for t in trials)
    assert all(t.user_attrs["status"] == "infeasible" and t.user_attrs["kld"] > floor / 2 for t in trials)
    assert all(t.values is None for t in trials)  # no score, not a 0.0


def test_max_kld_without_a_reference_is_a_one_line_error(engine_loc, demo_models, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    lonely = tmp_path / "alone" / demo_models[("qwen3moe", "Q4_K_M")].name
    lonely.parent.mkdir()
    lonely.symlink_to(demo_models[("qwen3moe", "Q4_K_M")])
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    with pytest.raises(UsageError, match="--max-kld needs a reference"):
        autotune.auto_tune(_request(lonely, tmp_path, 0.01), engine_loc, hw)
