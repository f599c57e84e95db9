"""compare-quants --disk-budget against a real local Hub server, with the reference (F16) split in three shards:
everything the comparison keeps (Hugging Face cache, tool cache, output folder) sampled on disk while it runs,
every shard counted, a reference that alone exceeds the budget refused before any byte of model data is
fetched, and a resumed comparison counting the quants it downloaded — with the real engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.hub_server import HubServer, split_gguf
from tests.quants.disk_sampler import disk_bytes, sampled

REPO = "acme/Tiny-MoE-GGUF"
MiB = 2**20


@pytest.fixture
def hub(demo_models, engine_loc, tmp_path):
    """F16 split in three (the largest quant and the reference), Q8_0 and Q4_K_M whole, as a Hub repo."""
    models = {q: demo_models[("qwen3moe", q)] for q in ("F16", "Q8_0", "Q4_K_M")}
    shards = split_gguf(models["F16"], tmp_path / "shards" / "Tiny-MoE-F16.gguf", 3)
    files = {f"F16/{p.name}": p for p in shards}
    files |= {"Tiny-MoE-Q8_0.gguf": models["Q8_0"], "Tiny-MoE-Q4_K_M.gguf": models["Q4_K_M"]}
    sizes = {"F16": sum(p.stat().st_size for p in shards), "Q8_0": models["Q8_0"].stat().st_size,
             "Q4_K_M": models["Q4_K_M"].stat().st_size}
    with HubServer() as srv:
        srv.add_repo(REPO, files)
        env = {"HF_ENDPOINT": srv.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"),
               "MOE_TUNE_CACHE": str(tmp_path / "mt"), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "",
               "LLAMA_CPP_DIR": str(engine_loc.bin_dir)}
        yield srv, env, sizes, [tmp_path / "hf", tmp_path / "mt", tmp_path / "cmp"]


def _args(out: Path, quants: str, *extra: str) -> list[str]:
    return ["compare-quants", REPO, "--quants", quants, "--trials", "1", "--chunks", "2", "-c", "128", "-p", "32",
            "-n", "16", "--min-ctx", "512", "--out", str(out), *extra]


def test_a_reference_over_the_budget_is_refused_before_any_model_data_is_fetched(hub):
    srv, env, sizes, folders = hub
    budget = 0.0183  # the case: 18.7 MiB, under the 3-shard F16 reference
    assert sizes["F16"] > budget * 2**30
    proc = run_cli(*_args(folders[2], "Q4_K_M,Q8_0", "--disk-budget", str(budget)), env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    # Named by its parts, every shard of the reference counted (its size from the files the server holds).
    assert f"the reference F16 {sizes['F16'] / 2**30:.3f} GiB" in lines[0], lines[0]
    assert "the reference logits" in lines[0] and "raise it to at least" in lines[0]
    # Only GGUF headers were read (range requests of at most 256 KiB per shard): no model data, no blob cached.
    assert srv.body_bytes(".gguf") <= 3 * 256 * 2**10
    assert not list((folders[0]).rglob("blobs/*"))
    # The same for a --make source in a repo: sized from the listing, refused before it is fetched.
    made = run_cli("compare-quants", "--make", "Q4_K_M", "--from", REPO, "--out", str(folders[2]), "--disk-budget",
                   str(budget), env=env)
    assert made.returncode == 1
    lines = made.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the source F16 {sizes['F16'] / 2**30:.3f} GiB" in lines[0], made.stderr
    assert not list((folders[0]).rglob("blobs/*"))


def test_the_budget_holds_over_everything_kept_and_every_shard_counts(hub):
    srv, env, sizes, folders = hub
    out = folders[2]
    # Room for the F16 reference (3 shards), its logits, the quant being measured with its KV-pricing logits
    # (16 MiB: 512 x 8 chunks x 4,096-token vocabulary at fp16) and the work reserve, but not for Q4_K_M and
    # Q8_0 together: Q4_K_M is dropped to make room for Q8_0.
    budget_bytes = sizes["F16"] + sizes["Q8_0"] + 16.1 * MiB + 1.1 * MiB + 4 * MiB + 3 * MiB
    with sampled(*folders) as peak:
        proc = run_cli(*_args(out, "F16,Q4_K_M,Q8_0", "--disk-budget", str(budget_bytes / 2**30)), env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "compare.json").read_text())
    rows = {r["quant"]: r for r in data["rows"]}
    assert set(rows) == {"F16", "Q4_K_M", "Q8_0"}
    for r in rows.values():
        assert r["error"] is None and r["gen_tok_s"] > 0, r
    assert rows["F16"]["n_parts"] == 3 and rows["F16"]["size_bytes"] == sizes["F16"]
    assert "disk budget: dropped Q4_K_M" in proc.stderr
    assert not rows["Q4_K_M"]["kept"] and not Path(rows["Q4_K_M"]["path"]).exists()
    assert data["pick"] == "F16" and all(Path(p).is_file() for p in _parts(rows["F16"]["path"]))
    print(f"peak {peak[0] / MiB:.1f} MiB of a {budget_bytes / MiB:.1f} MiB budget")
    assert 0 < peak[0] <= budget_bytes, f"peak {peak[0] / MiB:.1f} MiB over {budget_bytes / MiB:.1f} MiB"
    assert peak[0] > sizes["F16"] + sizes["Q8_0"]  # the sampler saw the comparison's files

    # Resumed, the downloaded Q8_0 is counted again (with the three reference shards): what the tool reports
    # is what the disk holds, within the work reserve.
    again = run_cli(*_args(out, "F16,Q4_K_M,Q8_0", "--disk-budget", str(budget_bytes / 2**30)), env=env)
    assert again.returncode == 0, again.stderr
    assert "resuming: 3 quant(s) already measured" in again.stderr
    used = json.loads((out / "compare.json").read_text())["disk_used_bytes"]
    assert used >= sizes["F16"] + sizes["Q8_0"]
    on_disk = sum(disk_bytes(f) for f in folders)
    assert abs(used - on_disk) <= 4 * MiB, (used, on_disk)


def _parts(first: str) -> list[Path]:
    p = Path(first)
    return sorted(p.parent.glob(p.name.replace("00001-of", "*-of")))


def test_made_quants_over_the_budget_are_refused_before_the_source_is_fetched(hub):
    """Room for the F16 source but not for it and the smallest quant made from it: the made quant is sized from the
    source's header (llama-quantize's own bits per weight for Q8_0), so the refusal comes before any byte of the
    source is downloaded and before any importance matrix is computed (issue 34: it used to come after both)."""
    srv, env, sizes, folders = hub
    budget = (sizes["F16"] + 4 * MiB + 3 * MiB) / 2**30  # the source and the work reserve, not a Q8_0 of it
    made = run_cli("compare-quants", "--make", "Q8_0", "--from", REPO, "--imatrix", "--out", str(folders[2]),
                   "--disk-budget", f"{budget:.4f}", "-c", "128", "--chunks", "2", env=env)
    assert made.returncode == 1
    lines = made.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in made.stderr, made.stderr
    assert "with the smallest quant (" in lines[-1] and "raise it to at least" in lines[-1], lines[-1]
    assert srv.body_bytes(".gguf") <= 3 * 256 * 2**10  # headers only
    assert not list(folders[0].rglob("blobs/*")) and not list(folders[1].rglob("*imatrix*"))
