"""`compare-quants` over three demo quants served by a real local Hub server, measured with llama.cpp."""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import run_cli
from tests.hub_server import HubServer, root_layout
from tuner.quants import compare

REPO = "demo/Compare-GGUF"


def _row(quant: str, gen: float | None, kld: float | None) -> compare.QuantRow:
    return compare.QuantRow(quant=quant, path=quant, size_bytes=1, n_parts=1, fit="VRAM", gen_tok_s=gen,
                            kld_mean=kld)


def test_pareto_front_keeps_only_undominated_rows():
    rows = [_row("A", 100.0, 0.0), _row("B", 150.0, 0.01), _row("C", 120.0, 0.02), _row("D", None, 0.001)]
    assert compare.pareto_flags(rows) == [True, True, False, False]


@pytest.fixture
def hub_env(demo_models, engine_loc, tmp_path):
    models = {q: demo_models[("qwen3moe", q)] for q in ("F16", "Q8_0", "Q4_K_M")}
    with HubServer() as srv:
        srv.add_repo(REPO, root_layout(models, "Demo-30B-A3B"))
        yield {"HF_ENDPOINT": srv.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"),
               "MOE_TUNE_CACHE": str(tmp_path / "mt"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_TOKEN": "", "LLAMA_CPP_DIR": str(engine_loc.bin_dir)}


def test_compare_quants_over_three_demo_quants(hub_env, tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli("compare-quants", REPO, "--quants", "Q8_0,Q4_K_M,F16", "--trials", "1", "--chunks", "2",
                   "-c", "256", "-p", "32", "-n", "16", "--min-ctx", "512", "--out", str(out), "--json",
                   env=hub_env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {r["quant"]: r for r in data["rows"]}
    assert [r["quant"] for r in data["rows"]] == ["Q4_K_M", "Q8_0", "F16"]  # smallest first
    assert rows["Q4_K_M"]["size_bytes"] < rows["Q8_0"]["size_bytes"] < rows["F16"]["size_bytes"]
    assert rows["F16"]["is_reference"] and rows["F16"]["kld_mean"] == 0.0 and rows["F16"]["same_top_pct"] == 100.0
    assert 0.0 < rows["Q8_0"]["kld_mean"] < rows["Q4_K_M"]["kld_mean"]
    for r in data["rows"]:
        assert r["error"] is None and r["gen_tok_s"] > 0 and r["prompt_tok_s"] > 0, r
        assert "llama-server" in r["launch_line"] and r["path"] in r["launch_line"]
        assert r["ppl"] > 1 and r["fit"]
    # Pareto flags agree with the figures: a row is off the front exactly when another dominates it.
    for r in data["rows"]:
        dominated = any(o["gen_tok_s"] >= r["gen_tok_s"] and o["kld_mean"] <= r["kld_mean"]
                        and (o["gen_tok_s"], o["kld_mean"]) != (r["gen_tok_s"], r["kld_mean"]) for o in data["rows"])
        assert r["pareto"] is (not dominated)
    assert rows["F16"]["pareto"]  # the lowest KLD cannot be dominated
    with (out / "compare.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert [t["quant"] for t in table] == ["Q4_K_M", "Q8_0", "F16"]
    assert json.loads((out / "compare.json").read_text())["rows"] == data["rows"]
    assert (out / "gen_tok_s_vs_kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "| Q8_0 |" in report and "mean KLD" in report
    shown = run_cli("compare-quants", REPO, "--quants", "Q8_0,Q4_K_M,F16", "--trials", "1", "--chunks", "2",
                    "-c", "256", "-p", "32", "-n", "16", "--min-ctx", "512", "--out", str(out), env=hub_env)
    assert shown.returncode == 0, shown.stderr
    print(shown.stdout)
    for name in ("Q4_K_M", "Q8_0", "F16", "0 (ref)", "gen t/s", "mean KLD", "Pareto front", "llama-server"):
        assert name in shown.stdout


def test_compare_quants_unknown_quant_is_one_line(hub_env):
    proc = run_cli("compare-quants", REPO, "--quants", "Q3_K_S", "--json", env=hub_env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Q3_K_S" in lines[0] and "Traceback" not in proc.stderr
