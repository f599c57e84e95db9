"""Start-up: `moe-tune --help` and the commands that only read or plan load none of the heavy libraries (each
command imports what it uses inside its body). Timings are in scripts/bench_startup.py, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("numpy", "gguf", "huggingface_hub", "optuna", "matplotlib")
PROBE = """
import json, sys
heavy = %r
sys.argv = ["moe-tune", *json.loads(sys.argv[1])]
from tuner.cli import main
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(m for m in heavy if m in sys.modules)), file=sys.stderr)
"""


def loaded(*args: str, env: dict[str, str] | None = None) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """The heavy libraries a command left in sys.modules, run in a fresh interpreter."""
    code = PROBE % (HEAVY,)
    run = subprocess.run([sys.executable, "-c", code, json.dumps(list(args))], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "100", **(env or {})})
    return json.loads(run.stderr.strip().splitlines()[-1]), run


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["auto-tune", "--help"], ["--version"]])
def test_help_loads_none_of_the_heavy_libraries(args):
    heavy, run = loaded(*args)
    assert heavy == [], heavy
    assert "moe-tune" in run.stdout


def test_plan_of_a_catalog_shape_needs_no_optuna(tmp_path):
    """A plan reads a GGUF header (gguf, numpy) and nothing of the search. No engine here: the replay decides."""
    heavy, run = loaded("plan", "qwen3-30b-a3b:Q4_K_M", "-c", "4096", "--json",
                        env={"MOE_TUNE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "LLAMA_CPP_DIR": ""})
    assert "optuna" not in heavy and "matplotlib" not in heavy, heavy
    assert json.loads(run.stdout)["memory_figures"]["decided_by"] == "replay"
