"""`auto-tune --engines llama.cpp,ik` for real on the demo model (random weights: its figures are not speeds, the
tests read its lines and records): each engine tuned, the lines judged head to head, the printed line naming its
engine and binary; then `serve` of an ik_llama.cpp result starts ik's own server, which answers /v1/models behind
the key (ik reads no key from its environment: it gets a key file of its own)."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from tests.cli.test_serve import gone, model_ids, post, ready, start
from tests.conftest import run_cli
from tests.fakes import FakeNVML
from tuner.engine import build
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP
from tuner.report import study_report
from tuner.search.result import load_result
from tuner.share.record import fitted  # a reason as a record holds it (cut to the gate's bound)

QUICK = ("--workload", "chat", "-p", "48", "-n", "16", "--min-ctx", "1024", "--trials", "3", "--allow-busy")


@pytest.fixture(scope="module")
def two_engines(engine_loc, ik_loc, tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """ik first, on a model no run has priced (issue 61: llama.cpp's reference run once got ik's -rtr and the whole run
    ended in an error after both tunes), with the default quality floor: the printed line is priced as it runs."""
    from tuner.models import demo

    out = tmp_path_factory.mktemp("engines")
    (model,) = [f.path for f in demo.make_demo_models(quants=["Q4_K_M"], out=out / "model", engine=engine_loc,
                                                       seed=int(time.time()) % 100_000) if f.quant == "Q4_K_M"]
    res = run_cli("auto-tune", str(model), *QUICK, "--engines", "ik,llama.cpp", "--results-dir", str(out),
                  timeout=1800)
    return res, out


def test_each_engine_is_searched_and_raced_and_the_printed_line_names_its_engine(two_engines, ik_loc):
    res, out = two_engines
    assert res.returncode == 0, res.stderr[-3000:]
    assert "plan: search ik_llama.cpp, llama.cpp (3 trials each); " in res.stderr and "race up to 4 lines" in res.stderr
    assert "engine 1 of 2: ik_llama.cpp ik-llama-cpp-python-0.1.5 (cpu, the pinned build), its search" in res.stderr
    assert "engine 2 of 2: llama.cpp 0c1e57098 (cpu, the pinned build), its search" in res.stderr
    assert "ik_llama.cpp's own levers searched: run_time_repack, fused_moe, merge_up_gate" in res.stderr
    assert "race: llama.cpp default, " in res.stderr
    # Each search says each trial as it ends (the Qwen3-30B shape's searches once ran ten minutes silent).
    trials = [x.split(":")[0] for x in res.stderr.splitlines() if x.startswith("trial ")]
    assert trials == ["trial 1/3", "trial 2/3", "trial 3/3"] * 2, res.stderr[-3000:]
    results = [load_result(p) for p in out.glob("*/result.json")]
    assert len(results) == 2 and all(r.engines for r in results)  # each holds the same race
    chosen = [r for r in results if r.engines and r.engines["chosen"]]
    assert len(chosen) == 1
    block = chosen[0].engines
    printed = next(x for x in block["lines"] if x["label"] == block["printed"])
    assert block["printed_engine"] == printed["engine"] == chosen[0].engine["engine"]
    assert {x["engine"] for x in block["lines"]} == {LLAMA_CPP.name, IK_LLAMA.name}
    assert block["lines"][0]["label"] == "llama.cpp default"  # the reference races first
    # every line that raced has its verdict against llama.cpp's default, from the race's own rounds
    raced = {a["label"] for a in block["head_to_head"]["arms"] if a["score"] is not None} - {"llama.cpp default"}
    assert {v["a"] for v in block["verdicts_against_default"]} == raced
    # the printed line, where it computes other numbers than llama.cpp's bare launch, was priced as it runs
    config = printed["config"]
    if printed["engine"] != LLAMA_CPP.name or config.get("cache_type_v", "f16") != "f16":
        # the demo's random weights predict no text (its reference's perplexity, ~4,400, over a 4,096-token
        # vocabulary): learned from the reference's first chunks before the race, no line's price is run, and said
        assert printed["price"]["says_nothing"].startswith("the model predicts no text")
        assert printed["standing"]["state"] == "printed" and "(unpriced: the model predicts no text" in block["reason"]
        assert "no line is priced: the model predicts no text" in res.stderr
    assert f"printed: {block['printed']}" in res.stdout and "vs default" in res.stdout
    how = "" if printed["engine"] == LLAMA_CPP.name else ": its own llama-server, by path"
    *_, said, line = res.stdout.strip().splitlines()
    assert said == f"launch line ({printed['engine']}{how}):"
    runs = "llama-server " if printed["engine"] == LLAMA_CPP.name else f"{ik_loc.bin_dir}/llama-server "
    assert line.startswith(runs)
    # launch-line of the chosen result prints the same line, its first pick the race's
    chosen_file = next(p for p in out.glob("*/result.json") if load_result(p).engines["chosen"])
    shown = run_cli("launch-line", str(chosen_file))
    assert shown.returncode == 0 and shown.stdout.strip() == line


def test_every_handover_gives_the_race_s_printed_line_from_either_folder(two_engines, tmp_path):
    """Issue 68: launch-line's ranks 1-3 (one answer, the printed line first, distinct), serve's command line (what the
    server runs, as ps reads it), share's record (the printed line, its engine and its verdict against llama.cpp's
    default) and the MCP tool, from each engine's folder of the same run."""
    from tests.test_mcp import ask

    res, out = two_engines
    assert res.returncode == 0, res.stderr[-3000:]
    *_, printed_line = res.stdout.strip().splitlines()
    folders = sorted(p.parent for p in out.glob("*/result.json"))
    block = load_result(folders[0]).engines
    assert len(folders) == 2 and block is not None
    ranks = []
    for folder in folders:
        got = [run_cli("launch-line", str(folder), "--rank", str(k)) for k in (1, 2, 3)]
        assert [g.returncode for g in got] == [0, 0, 0], [g.stderr for g in got]
        ranks.append([g.stdout.strip() for g in got])
    assert ranks[0] == ranks[1] and ranks[0][0] == printed_line and len(set(ranks[0])) == 3
    _, tools = ask([("launch_line", {"result": str(f), "rank": k}) for f in folders for k in (1, 2, 3)])
    assert [t.content[0].text.strip() for t in tools] == ranks[0] + ranks[1]
    for folder in folders:
        shared = run_cli("share", str(folder), "--repo", "alice/moe-tune-results", "--dry-run",
                         env={"MOE_TUNE_CONFIG": str(tmp_path / "config")})
        assert shared.returncode == 0, shared.stderr
        record = json.loads(shared.stdout)
        assert record["printed"]["label"] == block["printed"] and record["printed"]["why"] == fitted(block["reason"])
        assert record["engine"]["engine"] == block["printed_engine"]
        if block["against_default"] is not None:
            assert record["verdicts"][0] == {k: block["against_default"][k] for k in record["verdicts"][0]}
    # serve, from the folder of the engine that did not print the line: the server runs the printed line
    other = next(f for f in folders if not load_result(f).engines["chosen"])
    dry = run_cli("serve", str(other), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    words = shlex.split(dry.stdout)  # the variables the engine reads, then its command
    argv = words[next(i for i, w in enumerate(words) if not re.match(r"[A-Z_][A-Z0-9_]*=", w)):]
    assert argv[1:] == shlex.split(printed_line)[1:] and Path(argv[0]).name == "llama-server"
    proc = start(str(other))
    try:
        _, pid, said = ready(proc)
        ran = psutil.Process(pid).cmdline()
        assert ran[:len(argv)] == argv, said
        assert f"{block['printed']} of " in said
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert gone(pid)


@pytest.fixture(scope="module")
def ik_result(demo_models, ik_loc, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ik-only")
    res = run_cli("auto-tune", str(demo_models[("qwen3moe", "Q4_K_M")]), *QUICK, "--engines", "ik",
                  "--results-dir", str(out), timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    # ik alone is priced against llama.cpp (installed here): its printed line, as it runs
    assert "engine price: ik_llama.cpp" in res.stdout and "against llama.cpp" in res.stdout
    *_, said, line = res.stdout.strip().splitlines()
    assert said == f"launch line ({IK_LLAMA.name}: its own llama-server, by path):"
    assert line.startswith(f"{ik_loc.bin_dir}/llama-server -m ")
    (result,) = out.glob("*/result.json")
    return result


def test_ik_alone_is_priced_against_llama_cpp_as_its_line_runs(ik_result):
    price = load_result(ik_result).engine_price
    assert price is not None and price["refused"] is False, price
    assert price["engine"].startswith(IK_LLAMA.name) and price["reference"].startswith(LLAMA_CPP.name)
    # the demo's random weights predict no text: the reference's first chunks say so, and no line's run is made
    assert price["says_nothing"].startswith("the model predicts no text") and price["kld_mean"] is None
    assert price["note"].startswith("ik_llama.cpp") and "against llama.cpp" in price["note"]


def test_serve_of_an_ik_result_runs_ik_s_server_behind_its_key(ik_result, ik_loc, tmp_path):
    assert study_report.engine_of(load_result(ik_result)) is IK_LLAMA
    key_file = tmp_path / "key"
    proc = start(str(ik_result.parent), "--api-key-file", str(key_file), "--alias", "ik-demo")
    try:
        url, pid, said = ready(proc)
        server = psutil.Process(pid)
        assert Path(server.exe()) == ik_loc.tool("llama-server").resolve()
        key = key_file.read_text().strip()
        assert not any(key in w for w in server.cmdline())  # the key by file, never in argv
        ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(f"{url}/chat/completions", ask)
        assert refused.value.code == 401
        assert post(f"{url}/chat/completions", ask, key=key)["choices"][0]["message"]["role"] == "assistant"
        assert model_ids(url, key) == ["ik-demo"]
        handed = server.cmdline()[server.cmdline().index("--api-key-file") + 1]
        assert Path(handed).stat().st_mode & 0o077 == 0 and Path(handed) != key_file
    finally:
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    assert proc.returncode == 0, said + rest
    assert gone(pid) and not Path(handed).exists()  # its key file went with it


def test_compose_and_presets_refuse_an_ik_line_with_the_formats_that_carry_it(ik_result):
    for fmt in ("compose", "preset"):
        res = run_cli("launch-line", str(ik_result), "--format", fmt)
        assert res.returncode == 1
        assert res.stderr.strip() == (f"error: --format {fmt} runs llama.cpp's own "
                                      f"{'server image' if fmt == 'compose' else 'router (--models-preset)'}, not "
                                      "ik_llama.cpp, whose line this is: use --format shell, systemd or llama-swap "
                                      "(they run ik_llama.cpp's llama-server by its path)")
    unit = run_cli("launch-line", str(ik_result), "--format", "systemd")
    assert unit.returncode == 0 and "/llama-server" in unit.stdout and "ik_llama.cpp" in unit.stdout or \
        "ExecStart=" in unit.stdout
    data = json.loads(run_cli("launch-line", str(ik_result), "--format", "json").stdout)
    assert data["config"]["engine"] == IK_LLAMA.name and data["argv"][0].endswith("/llama-server")


class FakeCardServingBoth(FakeNVML):
    """A FAKE driver (the NVML boundary) whose card's used VRAM counts, for each llama-server this test runs, what its
    engine holds: ``held`` maps each engine's server binary to MiB (the CPU builds here hold none)."""

    def __init__(self, cards: list[tuple[str, int, int]], held: dict[str, int]) -> None:
        super().__init__(cards)
        self.held = held

    def _contexts(self) -> list[tuple[int, int]]:
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.exe() in self.held:
                    found.append((child.pid, self.held[child.exe()] * 2**20))
            except psutil.Error:  # gone between the listing and the look
                continue
        return found

    def nvmlDeviceGetMemoryInfo(self, handle: int):  # noqa: N802 - mirrors pynvml
        mem = super().nvmlDeviceGetMemoryInfo(handle)
        held = sum(used for _, used in self._contexts())
        return type(mem)(total=mem.total, free=mem.free - held, used=mem.used + held)


@pytest.mark.parametrize(("ik_mib", "ik_runs"), [(400, True), (7000, False)])
def test_the_engines_race_holds_the_vram_budget(engine_loc, ik_loc, demo_models, monkeypatch, tmp_path, ik_mib,
                                                ik_runs):
    """Issue 62: the engines' rounds hold a --vram-budget as the finish does. On a fake 24 GiB card (6,000 MiB
    budget) each line's VRAM is read round by round; ik's server holding 7,000 MiB breaks the budget and is never
    printed, the reason says so; at 400 MiB it keeps it."""
    from tuner.core.config import LaunchConfig
    from tuner.measure import workload
    from tuner.search import decide
    from tuner.versus import engines, judge

    card = FakeCardServingBoth([("NVIDIA GeForce RTX 4090", 24 * 2**30, 4 * 2**30)],
                               {str(engine_loc.tool("llama-server").resolve()): 400,
                                str(ik_loc.tool("llama-server").resolve()): ik_mib})
    monkeypatch.setitem(sys.modules, "pynvml", card)
    model = demo_models[("qwen3moe", "Q4_K_M")]
    base = LaunchConfig(model=model, ctx=1024, parallel=1)
    lines = [engines.EngineLine(engines.REFERENCE, LLAMA_CPP.name, base, "s", tmp_path, engine_loc.tool("llama-server"),
                                "default"),
             engines.EngineLine("ik_llama.cpp default", IK_LLAMA.name, replace(base, engine=IK_LLAMA.name), "s",
                                tmp_path, ik_loc.tool("llama-server"), "default")]
    where = {LLAMA_CPP.name: (engine_loc, build.capabilities(engine_loc)),
             IK_LLAMA.name: (ik_loc, build.capabilities(ik_loc))}
    budget = 6000 * 2**20
    race = judge.head_to_head(engine_loc, [(x.label, x.config) for x in lines], workload.preset(
        workload.WorkloadKind.CHAT, 32, 4), log_dir=tmp_path / "race", rounds=decide.Rounds(min=1, max=1, select=0),
        engines={x.label: where[x.engine] for x in lines}, vram_budget_bytes=budget)
    ik = race.arm("ik_llama.cpp default")
    assert ik is not None and ik.vram_growth_bytes == ik_mib * 2**20, ik
    assert race.arm(engines.REFERENCE).vram_growth_bytes == 400 * 2**20  # type: ignore[union-attr]
    assert (ik.budget_words(budget) is None) is ik_runs
    printed, why, _ = engines.choose(lines, race)
    assert printed == engines.REFERENCE  # one round decides nothing: the default stays either way
    if not ik_runs:
        assert "ik_llama.cpp default did not keep the VRAM budget: it used 7,000 MiB of VRAM, over the 6,000 MiB " \
               "budget" in why
