"""compare-quants making quants from the demo model's F16: three made types incl. a MoE mix within a disk budget
sampled while it runs, resuming, the 80-column table, target mode, and the refusals — with the real engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.quants.disk_sampler import disk_bytes, sampled

MiB = 2**20
MAKE = "Q8_0,Q4_K_M,Q2_K/Q8_0"
TUNING = ["--trials", "1", "--chunks", "2", "-c", "128", "-p", "32", "-n", "16", "--min-ctx", "512"]


@pytest.fixture
def env(engine_loc, tmp_path):
    return {"MOE_TUNE_CACHE": str(tmp_path / "mt"), "LLAMA_CPP_DIR": str(engine_loc.bin_dir),
            "HF_HUB_OFFLINE": "1"}


def _args(src: Path, out: Path, *extra: str, make: str = MAKE) -> list[str]:
    return ["compare-quants", "--from", str(src), "--make", make, *TUNING, "--out", str(out), *extra]


def test_made_quants_within_a_disk_budget_then_the_table_target_mode_and_resume(demo_models, env, tmp_path):
    src = demo_models[("qwen3moe", "F16")]
    out = tmp_path / "cmp"
    # The fixed part (the reference logits, 1 MiB at -c 128 x 2 chunks) plus two quants (Q8_0 17 MiB, Q4_K_M
    # 10 MiB), the KV-pricing logits of the one being tuned (16 MiB) and the 4 MiB work reserve: the third
    # quant makes Q4_K_M go.
    budget = 51 * MiB
    # The natural spelling: a local F16 and --quants makes them, as --make ... --from does.
    with sampled(tmp_path / "mt", out) as peak:
        proc = run_cli("compare-quants", str(src), "--quants", MAKE, *TUNING, "--out", str(out),
                       "--disk-budget", str(budget / 2**30), env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"{src.name} is unquantized: making {MAKE} from it (as --make {MAKE} --from {src.name} does)" in proc.stderr
    data = json.loads((out / "compare.json").read_text())
    rows = {r["quant"]: r for r in data["rows"]}
    assert set(rows) == {"Q8_0", "Q4_K_M", "Q2_K/Q8_0"}
    for r in rows.values():
        assert r["error"] is None, r
        assert r["origin"] == "made here" and r["command"].startswith("llama-quantize ")
        assert r["gen_tok_s"] > 0 and r["kld_mean"] > 0 and r["kld_mean_error"] > 0 and r["depth_tokens"] == 32
    assert rows["Q2_K/Q8_0"]["size_bytes"] < rows["Q4_K_M"]["size_bytes"] < rows["Q8_0"]["size_bytes"]
    assert rows["Q8_0"]["kld_mean"] < rows["Q4_K_M"]["kld_mean"]
    # No limits: the least loss wins; the budget kept its file and dropped Q4_K_M on the way.
    assert data["pick"] == "Q8_0" and rows["Q8_0"]["verdict"] == "pick"
    assert Path(rows["Q8_0"]["path"]).is_file() and rows["Q8_0"]["kept"]
    assert "disk budget: dropped Q4_K_M" in proc.stderr
    assert not rows["Q4_K_M"]["kept"] and not Path(rows["Q4_K_M"]["path"]).exists()
    print(f"peak {peak[0] / MiB:.1f} MiB of a {budget / MiB:.0f} MiB budget")
    assert 0 < peak[0] <= budget, f"peak {peak[0] / MiB:.1f} MiB over the {budget / MiB:.0f} MiB budget"
    assert data["disk_used_bytes"] <= budget
    # No KV-pricing logits are left behind: the tool cache holds the reference logits and small files only.
    assert disk_bytes(tmp_path / "mt") < 3 * MiB

    # Resuming, spelled with --make/--from (the same comparison): nothing measured again, every row kept; at 80
    # columns one line per quant, no cell cut or folded, the full launch lines after the table.
    again = run_cli(*_args(src, out, "--disk-budget", str(budget / 2**30)), env={**env, "COLUMNS": "80"})
    assert again.returncode == 0, again.stderr
    assert "resuming: 3 quant(s) already measured" in again.stderr
    assert "auto-tune" not in again.stderr and "making" not in again.stderr
    print(again.stdout)
    lines = again.stdout.splitlines()
    first_launch = min(lines.index(f"{q}: {r['launch_line']}") for q, r in rows.items())
    assert max(len(line) for line in lines[:first_launch]) <= 80  # the table and its caption
    rule = next(i for i, line in enumerate(lines) if set(line) == {"─"})
    body = lines[rule + 1: rule + 1 + len(rows)]
    assert sorted(line.split()[0].rstrip("*") for line in body) == sorted(rows)  # one line each, nothing between
    assert "…" not in "".join(lines[rule - 1: rule + 1 + len(rows)])  # no cell cut
    for q, r in rows.items():
        row = next(line for line in body if line.split()[0].rstrip("*") == q)
        assert f"{r['kld_mean']:.4f}±{r['kld_mean_error']:.4f}" in row, row
        assert f"{q}: {r['launch_line']}" in lines  # whole, on its own line, after the table
        assert lines.index(f"{q}: {r['launch_line']}") > rule + len(rows)
    assert "answer: Q8_0" in again.stdout and "made here: Q2_K/Q8_0: llama-quantize" in again.stdout

    # Target mode on the same rows: a floor no interval reaches, then one every interval clears.
    floor = max(r["gen_tok_s"] + r["gen_tok_s_error"] for r in rows.values()) + 1
    none = run_cli(*_args(src, out, "--min-tok-s", str(floor), "--json"), env=env)
    assert none.returncode == 0, none.stderr
    assert json.loads(none.stdout)["pick"] is None
    assert json.loads(none.stdout)["binding"].startswith(f"no quant meets --min-tok-s {floor:g}")
    # A floor at Q8_0's own measured speed: its interval straddles it, so Q8_0 is undecided, never the answer,
    # and the answer names it with its interval.
    q8 = rows["Q8_0"]
    mid = run_cli(*_args(src, out, "--min-tok-s", repr(q8["gen_tok_s"]), "--json"), env=env)
    picked = json.loads(mid.stdout)
    assert picked["pick"] != "Q8_0"
    assert next(r for r in picked["rows"] if r["quant"] == "Q8_0")["verdict"] == "undecided"
    assert any(u.startswith(
        f"Q8_0 is undecided: {q8['gen_tok_s']:.1f} ± {q8['gen_tok_s_error']:.1f} tok/s straddles --min-tok-s")
               for u in picked["undecided"])


def test_a_fixed_part_over_the_budget_is_refused_before_anything_is_made(demo_models, env, tmp_path):
    src = demo_models[("qwen3moe", "F16")]
    out = tmp_path / "cmp"
    proc = run_cli(*_args(src, out, "--disk-budget", "0.0005", make="Q4_K_M"), env=env)  # 0.5 MiB
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the comparison's fixed part (the reference logits "), lines
    assert "raise it to at least" in lines[0]
    assert not (out / "quants").exists() and not list((tmp_path / "mt").rglob("*.logits"))


def test_a_comparison_that_measured_nothing_exits_non_zero_in_one_line(demo_models, env, tmp_path):
    src = demo_models[("qwen3moe", "F16")]
    proc = run_cli(*_args(src, tmp_path / "cmp", make="IQ2_XXS"), env=env)  # needs an importance matrix
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: compare-quants measured none of its 1 quant(s): IQ2_XXS: "), proc.stderr
    assert "--imatrix" in last and "Traceback" not in proc.stderr


def test_quants_of_an_already_quantized_local_file_point_at_make_from(demo_models, env):
    q4 = demo_models[("qwen3moe", "Q4_K_M")]
    proc = run_cli("compare-quants", str(q4), "--quants", "Q3_K_M", env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--make Q3_K_M --from MODEL-F16.gguf" in lines[0], lines
