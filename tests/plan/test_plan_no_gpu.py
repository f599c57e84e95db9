"""`moe-tune plan` on a machine with no GPU (issue 67): one row, since --n-cpu-moe moves nothing without a card, and
without -c a context a user would run: the largest that fits (the model's trained context is its ceiling), or
llama.cpp's least where none fits, said. The machine is made GPU-less at the NVML boundary: a FAKE driver that lists
no card (tests/standin/pynvml.py), whatever this machine has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

MODEL = "qwen3.5-35b-a3b:Q4_K_M"  # trained context 262,144; Q4_K_M needs ~29 GiB of RAM on the CPU backend
STANDIN = Path(__file__).resolve().parents[1] / "standin"


@pytest.fixture
def no_gpu(tmp_path) -> dict[str, str]:
    scenario = tmp_path / "no-card.json"
    scenario.write_text(json.dumps({"cards": [], "graphics": []}))
    return {"PYTHONPATH": str(STANDIN), "MOE_TUNE_FAKE_NVML": str(scenario), "MOE_TUNE_CACHE": str(tmp_path / "c")}


def _plan(env: dict[str, str], *argv: str) -> dict:
    res = run_cli("plan", MODEL, *argv, "--json", env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_plan_without_a_gpu_prints_one_row(no_gpu):
    res = run_cli("plan", MODEL, "-c", "8192", env=no_gpu)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    rule = next(i for i, ln in enumerate(lines) if set(ln.strip()) == {"─"})
    body = [ln for ln in lines[rule + 1:rule + 40] if ln.strip()][:2]
    assert body[0].split()[0] == "CPU" and body[1].startswith("RAM need:")  # one row, then the table's notes
    assert "-c 8192 -ctk f16 -ctv f16 " in res.stdout and "--n-cpu-moe 0..40" not in res.stdout
    assert "one row: --n-cpu-moe changes nothing without a card" in res.stderr
    doc = _plan(no_gpu, "-c", "8192", "--ram", "64")
    assert len(doc["rows"]) == 1 and doc["rows"][0]["n_cpu_moe"] == 0 and doc["rows"][0]["verdict"] == "fits"
    assert doc["fit_intervals"][0]["summary"] == "fits with everything on the CPU"


def test_without_c_the_trained_context_is_a_ceiling_not_a_default(no_gpu):
    tight = _plan(no_gpu, "--ram", "30")  # fits, but not at 262,144 with f16 KV
    largest = tight["largest_ctx"][0]["ctx"]
    assert 4096 < largest < 262144
    assert f"no -c given: planned at {largest}, the largest context that fits (the model's trained context, 262144, " \
        "is its ceiling); pass -c for the one you run" in tight["notes"]
    assert tight["rows"][0]["verdict"] == "fits"
    short = _plan(no_gpu, "--ram", "24")  # no context fits: planned at what llama.cpp's --fit would shrink it to
    assert any(n.startswith("no -c given: planned at 4096, the least llama.cpp's --fit would shrink it to")
               for n in short["notes"])
    assert len(short["rows"]) == 1 and short["rows"][0]["verdict"] == "exceeds RAM"
