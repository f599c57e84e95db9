"""What a two-engine run hands over (tuner.report.handover), from either engine's folder: launch-line's ranks in every
format, share's record, the MCP tools; a line its price refused, or one out of the running, never; a run that printed
no line, or whose printed line was refused, says so in one line and exits 1. On results the race's own record writes
(tests/report/race_result.py); serve on the real engines is in tests/versus/test_engines.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.report.race_result import (
    FAST,
    FASTER,
    IK_DEFAULT,
    IK_TUNED,
    LLAMA_TUNED,
    REFERENCE,
    STEADY,
    WIDE,
    write_run,
)
from tests.report.test_study_report import _finish
from tests.test_mcp import ask
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP
from tuner.report import handover
from tuner.search.result import load_result, write_result
from tuner.share.record import fitted  # a reason as a record holds it (cut to the gate's bound)

RACE = {REFERENCE: STEADY, LLAMA_TUNED: WIDE, IK_DEFAULT: FAST, IK_TUNED: FASTER}


def _tail(line: str) -> str:
    """A launch line without its program (an engine's server by whichever path it is found here)."""
    return line.split(" ", 1)[1]


def _line(folder: Path, *args: str) -> str:
    res = run_cli("launch-line", str(folder), *args)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("race"), RACE)


def test_either_folder_hands_out_the_printed_line_first_then_distinct_lines(run):
    block = load_result(run.chosen).engines
    assert block is not None and block["printed"] == IK_TUNED  # decided faster than llama.cpp's default, and the rest
    printed = next(x for x in block["lines"] if x["label"] == IK_TUNED)
    ranks = {folder: [_line(folder, "--rank", str(k)) for k in (1, 2, 3)] for folder in (run.chosen, run.other)}
    assert ranks[run.chosen] == ranks[run.other]  # one answer, whichever folder
    first, second, third = ranks[run.other]
    assert _tail(first) == _tail(printed["launch_line"])
    assert first.split(" ")[0].endswith("/llama-server")  # ik's own server, by its path
    assert len({first, second, third}) == 3
    # rank 2: the race's line still in the running (llama.cpp tuned: undecided against ik tuned)
    tuned = next(x for x in block["lines"] if x["label"] == LLAMA_TUNED)
    assert second == "llama-server " + _tail(tuned["launch_line"])
    # rank 3 on: each search's measured configs, the printed engine's first (its third-best trial, -ub 128)
    assert "-ub 128" in third and "--run-time-repack" in third
    # Lines the race decided slower than another are out of the running: never at any rank.
    every = [_line(run.other, "--rank", str(k)) for k in range(1, 7)]
    out = [x for x in block["lines"] if x["standing"]["state"] == "slower"]
    assert {x["label"] for x in out} == {IK_DEFAULT, REFERENCE}
    assert not {_tail(x["launch_line"]) for x in out} & {_tail(x) for x in every}
    beyond = run_cli("launch-line", str(run.other), "--rank", "7")
    assert beyond.returncode == 1 and len(beyond.stderr.strip().splitlines()) == 1
    assert beyond.stderr.startswith("error: --rank 7 is out of range: this result has 6 lines to hand out")
    assert f"never handed out: {IK_DEFAULT}: was decided slower than {IK_TUNED}" in beyond.stderr


def test_every_format_takes_the_ranked_lines(run):
    for folder in (run.chosen, run.other):
        as_json = json.loads(_line(folder, "--format", "json"))
        assert as_json["config"]["engine"] == IK_LLAMA.name and as_json["argv"][0].endswith("/llama-server")
        assert as_json["standing"] == "printed" and as_json["against_llama_cpp_default"]["outcome"] == "better"
        second = json.loads(_line(folder, "--rank", "2", "--format", "json"))
        assert second["config"]["engine"] == LLAMA_CPP.name and second["standing"] == "in"
        assert second["argv"][0] == "llama-server"
        assert "--run-time-repack" in _line(folder, "--format", "llama-swap")
        assert "ExecStart=" in _line(folder, "--format", "systemd")
        # llama.cpp's own image runs rank 2 (llama.cpp's line); ik's printed line it cannot
        assert "ghcr.io/ggml-org/llama.cpp:server" in _line(folder, "--rank", "2", "--format", "compose")
        refused = run_cli("launch-line", str(folder), "--format", "compose")
        assert refused.returncode == 1 and "not ik_llama.cpp, whose line this is" in refused.stderr


def test_share_records_the_printed_line_its_engine_and_its_verdict(run, tmp_path):
    env = {"MOE_TUNE_CONFIG": str(tmp_path / "config")}
    block = load_result(run.chosen).engines
    assert block is not None
    for folder in (run.chosen, run.other):
        res = run_cli("share", str(folder), "--repo", "alice/moe-tune-results", "--dry-run", env=env)
        assert res.returncode == 0, res.stderr
        record = json.loads(res.stdout)
        assert record["printed"]["label"] == IK_TUNED and record["printed"]["why"] == fitted(block["reason"])
        # the line as others run it: by the model's file name, the server on their PATH
        assert record["printed"]["line"] == "llama-server " + _tail(_line(folder)).replace(str(run.model),
                                                                                           run.model.name)
        assert record["engine"]["engine"] == IK_LLAMA.name  # the engine that ran it, not the folder's
        first = record["verdicts"][0]
        assert (first["a"], first["b"], first["outcome"]) == (IK_TUNED, REFERENCE, "better")
        assert record["speedup_vs_default"] == pytest.approx(block["against_default"]["ratio"])
        assert {x["label"] for x in record["lines"]} == {IK_TUNED}  # ik's lines still in: its default was slower


def test_mcp_launch_line_equals_launch_line_and_results_name_the_printed_line(run):
    calls = [("launch_line", {"result": str(folder), "rank": rank, "format": fmt})
             for folder in (run.chosen, run.other) for rank in (1, 2, 3) for fmt in ("shell", "json")]
    _, got = ask([*calls, ("results", {})], results_dir=run.chosen.parent)
    for (_, args), answer in zip(calls, got, strict=False):
        assert not answer.is_error, answer.content
        assert answer.content[0].text.strip() == _line(Path(args["result"]), "--rank", str(args["rank"]),
                                                       "--format", args["format"])
    listed = got[-1].structured_content["results"]
    assert len(listed) == 2 and {x["label"] for x in listed} == {IK_TUNED}
    assert all(x["engine"] == IK_LLAMA.name and x["line"] == _line(run.chosen) for x in listed)
    assert all(x["measured_in"] == str(run.folders[IK_LLAMA.name] / "result.json") for x in listed)


def test_a_line_its_price_refused_is_never_handed_out(tmp_path):
    run = write_run(tmp_path, RACE, refused=(IK_TUNED,))
    block = load_result(run.chosen).engines
    assert block is not None and block["printed"] != IK_TUNED
    refused = next(x for x in block["lines"] if x["label"] == IK_TUNED)
    for folder in (run.chosen, run.other):
        hand = handover.of(load_result(folder))
        assert hand.printed is not None and hand.printed.label == block["printed"]
        assert _tail(refused["launch_line"]) not in {_tail(handover.render(p)) for p in hand.picks}
        assert any(w.startswith(f"{IK_TUNED}: was refused by its price") for w in hand.withheld)
        beyond = run_cli("launch-line", str(folder), "--rank", str(len(hand.picks) + 1))
        assert beyond.returncode == 1 and f"{IK_TUNED}: was refused by its price (mean KLD 18.26" in beyond.stderr


def test_a_run_that_printed_no_line_hands_out_none_as_its_line(tmp_path):
    run = write_run(tmp_path, dict.fromkeys(RACE, (None, None, None)))  # every line crashed
    block = load_result(run.folders[LLAMA_CPP.name]).engines
    assert block is not None and block["printed"] is None
    for folder in run.folders.values():
        for cmd in (("launch-line", str(folder)), ("serve", str(folder), "--dry-run"),
                    ("share", str(folder), "--repo", "alice/x", "--dry-run")):
            res = run_cli(*cmd, env={"MOE_TUNE_CONFIG": str(tmp_path / "config")})
            assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, (cmd, res.stderr)
            assert "the run printed no line: no line can be run here: llama.cpp default failed" in res.stderr, cmd


@pytest.mark.parametrize("stage", ["finish", "search"])
def test_a_single_engine_line_its_price_refused_is_refused_in_one_line(tmp_path, stage):
    """`auto-tune --engines ik` alone, its printed line priced and refused (as on the exact MoE made from SmolLM2):
    launch-line, serve, share and the MCP tool refuse it in one line, exit 1; no other line takes its place. Its lines
    ranked by a finish (auto-tune's), or by its search alone."""
    raced = write_run(tmp_path / "race", RACE)
    ik = load_result(raced.folders[IK_LLAMA.name])
    fin = _finish(seed=7) if stage == "finish" else ik.finish
    note = ("ik_llama.cpp against llama.cpp's f16 logits: mean KLD 18.26 ± 0.4 nats/token: above --max-kld 0.01, so "
            "this line is not one to run")
    alone = replace(ik, engines=None, finish=fin, engine_price={"kld_mean": 18.26, "note": note, "refused": True})
    folder = tmp_path / "ik-only" / ik.study
    folder.mkdir(parents=True)
    write_result(alone, folder)
    env = {"MOE_TUNE_CONFIG": str(tmp_path / "config")}
    for cmd in (("launch-line", str(folder)), ("launch-line", str(folder), "--format", "json"),
                ("serve", str(folder)), ("share", str(folder), "--repo", "alice/x", "--dry-run")):
        res = run_cli(*cmd, env=env)
        assert res.returncode == 1 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, cmd
        assert "refused by its price" in res.stderr and "18.26" in res.stderr, (cmd, res.stderr)
    _, [tool, listed] = ask([("launch_line", {"result": str(folder)}), ("results", {})],
                            results_dir=folder.parent)
    assert tool.is_error and "refused by its price" in tool.content[0].text
    [entry] = listed.structured_content["results"]
    assert entry["line"] is None and "refused by its price" in entry["why"]
    # Its runner-up is asked for by its rank, never handed out in the refused line's place; an ik line (it computes the
    # numbers the price refused) not at all.
    if stage == "finish":  # the finish's lines here are f16 llama.cpp lines: nothing to price
        assert "-ub 1024" in _line(folder, "--rank", "2")
    else:
        second = run_cli("launch-line", str(folder), "--rank", "2")
        assert second.returncode == 1 and "search trial 2: not priced, and the line this result printed was refused " \
            "by its price" in second.stderr
