"""The command line as a user meets it: help with examples, one-line errors, the main job's measured run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.conftest import run_cli
from tuner.cli import app
from tuner.engine import build

COMMANDS = [["doctor"], ["demo-model"], ["bench"], ["plan"], ["quality"], ["quants"], ["download"], ["compare-quants"],
            ["auto-tune"], ["launch-line"], ["shape-model"], ["engine", "install"], ["engine", "path"],
            ["engine", "info"]]


def test_top_level_help_lists_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for name in ("doctor", "demo-model", "bench", "plan", "quality", "quants", "download", "auto-tune",
                 "launch-line", "shape-model", "engine"):
        assert name in proc.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_every_command_has_help_with_an_example(command):
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    assert "Example" in res.output


def test_bench_on_a_missing_model_is_one_line():
    proc = run_cli("bench", "/nonexistent/model.gguf")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not found" in lines[0] and "Traceback" not in proc.stderr


def test_bench_refuses_quantized_v_without_flash_attention(demo_models):
    proc = run_cli("bench", str(demo_models[("qwen3moe", "Q4_K_M")]), "-ctv", "q8_0", "-fa", "off")
    assert proc.returncode == 1
    assert "needs flash attention" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bench_json_reports_real_speeds(demo_models):
    model = demo_models[("qwen35moe", "Q4_K_M")]
    proc = run_cli("bench", str(model), "-p", "32", "-n", "8", "-r", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa",
                   "on", "-t", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    kinds = {("pp" if r["n_gen"] == 0 else "tg"): r for r in report["rows"]}
    assert kinds["pp"]["n_prompt"] == 32 and kinds["tg"]["n_gen"] == 8
    assert kinds["pp"]["avg_tok_s"] > 0 and kinds["tg"]["avg_tok_s"] > 0
    assert len(kinds["tg"]["samples_tok_s"]) == 2
    assert report["launch_line"].startswith("llama-server -m ")
    assert "-ctk q8_0 -ctv q8_0" in report["launch_line"] and "-fa on" in report["launch_line"]
    assert "-ctk" in report["argv"] and report["argv"][-2:] == ["-o", "jsonl"]


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and build.PIN.commit in proc.stdout
