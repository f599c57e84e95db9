"""compare-quants --make from the demo model's F16: four made types incl. a MoE mix, a disk budget sampled while
it runs, target mode and resuming — with the real engine."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tuner.quants import disk as quant_disk

MiB = 2**20
MAKE = "Q8_0,Q4_K_M,Q3_K_M,Q2_K/Q8_0"


@pytest.fixture
def env(engine_loc, tmp_path):
    return {"MOE_TUNE_CACHE": str(tmp_path / "mt"), "LLAMA_CPP_DIR": str(engine_loc.bin_dir),
            "HF_HUB_OFFLINE": "1"}


def _args(src: Path, out: Path, *extra: str) -> list[str]:
    return ["compare-quants", "--from", str(src), "--make", MAKE, "--trials", "1", "--chunks", "2", "-c", "128",
            "-p", "32", "-n", "16", "--min-ctx", "512", "--out", str(out), *extra]


def test_made_quants_within_a_disk_budget_then_target_mode_and_resume(demo_models, env, tmp_path):
    src = demo_models[("qwen3moe", "F16")]
    out = tmp_path / "cmp"
    budget = 40 * MiB  # the Q8_0 winner (17 MiB), one more quant, the reference logits and the folder
    logits_dir = tmp_path / "mt" / "quality" / "logits"
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):  # a file dropped between listing and stat
                peak[0] = max(peak[0], quant_disk.tree_bytes(out) + quant_disk.tree_bytes(logits_dir))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        proc = run_cli(*_args(src, out, "--disk-budget", str(budget / 2**30), "--json"), env=env)
    finally:
        stop.set()
        sampler.join()
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {r["quant"]: r for r in data["rows"]}
    assert set(rows) == {"Q8_0", "Q4_K_M", "Q3_K_M", "Q2_K/Q8_0"}
    for r in rows.values():
        assert r["error"] is None, r
        assert r["origin"] == "made here" and r["command"].startswith("llama-quantize ")
        assert r["gen_tok_s"] > 0 and r["kld_mean"] > 0 and r["kld_mean_error"] > 0 and r["depth_tokens"] == 32
    assert "--tensor-type attn_=q8_0" in rows["Q2_K/Q8_0"]["command"]
    assert rows["Q2_K/Q8_0"]["size_bytes"] < rows["Q4_K_M"]["size_bytes"] < rows["Q8_0"]["size_bytes"]
    assert rows["Q8_0"]["kld_mean"] < rows["Q4_K_M"]["kld_mean"] < rows["Q3_K_M"]["kld_mean"]
    # No limits: the least loss wins; the budget kept its file and dropped others on the way.
    assert data["pick"] == "Q8_0" and rows["Q8_0"]["verdict"] == "pick"
    assert Path(rows["Q8_0"]["path"]).is_file() and rows["Q8_0"]["kept"]
    dropped = [q for q, r in rows.items() if not r["kept"]]
    assert dropped and all(not Path(rows[q]["path"]).exists() for q in dropped)
    assert 0 < peak[0] <= budget, f"peak {peak[0] / MiB:.1f} MiB over the {budget / MiB:.0f} MiB budget"
    assert data["disk_used_bytes"] <= budget

    # Resuming: the same comparison again measures nothing new and keeps every row.
    again = run_cli(*_args(src, out, "--disk-budget", str(budget / 2**30), "--min-tok-s", "1e9",
                           "--max-kld", "1"), env=env)
    assert again.returncode == 0, again.stderr
    assert "resuming: 4 quant(s) already measured" in again.stderr
    assert "auto-tune" not in again.stderr and "making" not in again.stderr
    assert "no quant meets both --min-tok-s 1e+09 and --max-kld 1" in again.stdout
    assert "made here" in again.stdout and "llama-quantize" in again.stdout

    # Fewer quants asked for: their rows come back as measured (not again), the others stay out of the table.
    subset = run_cli(*[a if a != MAKE else "Q8_0,Q2_K/Q8_0" for a in _args(src, out, "--json")], env=env)
    assert subset.returncode == 0, subset.stderr
    kept = {r["quant"]: r for r in json.loads(subset.stdout)["rows"]}
    assert sorted(kept) == ["Q2_K/Q8_0", "Q8_0"]
    assert all(kept[q]["gen_tok_s"] == rows[q]["gen_tok_s"] for q in kept)

    # Target mode on the same rows: a floor no quant reaches, then one every quant reaches.
    floor = max(r["gen_tok_s"] + (r["gen_tok_s_error"] or 0) for r in rows.values()) + 1
    none = run_cli(*_args(src, out, "--min-tok-s", str(floor), "--json"), env=env)
    assert none.returncode == 0, none.stderr
    assert json.loads(none.stdout)["pick"] is None
    assert json.loads(none.stdout)["binding"].startswith(f"no quant meets --min-tok-s {floor:g}")
    lax = run_cli(*_args(src, out, "--min-tok-s", "0.1", "--max-kld", "1", "--json"), env=env)
    picked = json.loads(lax.stdout)
    assert picked["pick"] == "Q8_0" and picked["binding"].startswith("no limit binds")
