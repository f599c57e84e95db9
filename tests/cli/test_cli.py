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


@pytest.mark.parametrize("args,says", [
    (["plan", "any.gguf", "--ram", "0"], "--ram 0 GiB leaves nothing to plan for"),
    (["plan", "any.gguf", "--ram", "-1"], "--ram -1 GiB leaves nothing to plan for"),
    (["bench", "x.gguf", "-ctk", "q3_0"], "'q3_0' is not one of 'f32', 'f16'"),
    (["bench", "--no-such-flag"], "No such option: --no-such-flag; see `moe-tune bench --help`"),
    (["auto-tune", "x.gguf", "-p", "0"], "-p/--n-prompt 0 measures nothing"),
    (["download", "a:b:c", "--offline"], "a:b:c is not a Hugging Face repo name"),
])
def test_bad_input_is_one_line_exit_1_printed_literally(args, says):
    res = run_cli(*args)
    assert res.returncode == 1, res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line, line
    assert "🅱" not in line and "Usage" not in line


def test_help_shows_flags_without_a_type_and_bare_command_shows_help():
    res = run_cli("--help")
    assert res.returncode == 0 and "--version  " in res.stdout and "<bool>" not in res.stdout.split("--version")[1][:30]
    bare = run_cli()
    assert bare.returncode == 0 and "auto-tune" in bare.stdout


def test_model_path_is_absolute_and_study_name_keeps_its_letters(tmp_path, monkeypatch):
    from tuner.cli.app import model_path
    from tuner.search.study import _slug

    folder = tmp_path / "dir with space"
    folder.mkdir()
    (folder / "модель.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(folder)
    path = model_path("модель.gguf")
    assert path.is_absolute() and path == folder / "модель.gguf"
    assert _slug(path.stem) == "модель" and _slug("dir with space/x") == "dir-with-space-x"


def test_bench_agent_at_a_shallow_depth_times_a_prompt_that_fits_it(demo_models):
    """The agent preset's 8,192-token prompt is cut to `-d` (as auto-tune cuts it): llama-bench once timed pp8192
    beside a 1024-token depth, eight times the session it stood for."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    proc = run_cli("bench", str(model), "--workload", "agent", "-d", "1024", "-n", "8", "-r", "1", "--no-server",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [r["n_prompt"] for r in rows if r["n_gen"] == 0] == [1024]
    assert all(r["n_depth"] == 1024 for r in rows)
