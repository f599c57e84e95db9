"""`moe-tune mcp` through the official SDK's own client over stdio: the tool list, `plan` with the figures of
`moe-tune plan --json`, `quants` with those of `moe-tune quants --json` (a local Hub), `results` and
`launch_line` on a real auto-tune result, and the tool's own errors as the agent's error text."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from tests.conftest import run_cli
from tests.demo_result import tune_demo, variant
from tests.hub_server import HubServer, root_layout

EXE = str(Path(sys.executable).parent / "moe-tune")
CARD = "RTX 3060 12GB"
REPO = "demo-org/Demo-MoE-GGUF"


@pytest.fixture(scope="module")
def tuned(engine_loc, tmp_path_factory) -> Path:
    return tune_demo(engine_loc, tmp_path_factory.mktemp("tuned"))


def ask(calls: list[tuple[str, dict[str, Any]]], *, results_dir: Path | None = None,
        env: dict[str, str] | None = None) -> tuple[list[str], list[Any]]:
    """Start `moe-tune mcp`, list its tools and make ``calls`` with the SDK's client; the tool names and each
    call's result."""
    args = ["mcp", *(["--results-dir", str(results_dir)] if results_dir else [])]

    async def session() -> tuple[list[str], list[Any]]:
        async with Client(StdioServerParameters(command=EXE, args=args, env=env)) as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            return tools, [await client.call_tool(name, arguments) for name, arguments in calls]

    return anyio.run(session)


def cli_json(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    res = run_cli(*args, "--json", env=env)
    assert res.returncode == 0, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def test_the_tools_and_a_plan_equal_to_plan_json_for_moe_and_dense(demo_models):
    """A MoE (rows by --n-cpu-moe) and a dense catalog model (rows by -ngl, which used to come back as
    ``n_cpu_moe: null`` on every row): the tool's answer is `moe-tune plan --json`'s document, row for row."""
    model = str(demo_models[("qwen3moe", "Q4_K_M")])
    dense = "qwen3.5-9b:Q4_K_M"
    tools, [plan, plan_dense, missing] = ask([
        ("plan", {"model": model, "card": CARD, "context": 4096, "ram_gib": 32}),
        ("plan", {"model": dense, "card": CARD, "context": 4096, "ram_gib": 32}),
        ("plan", {"model": "/nowhere/none.gguf"})])
    assert sorted(tools) == ["launch_line", "plan", "quants", "results"]
    for got, name in ((plan, model), (plan_dense, dense)):
        assert not got.is_error, got.content
        want = cli_json("plan", name, "--gpu", CARD, "-c", "4096", "--ram", "32")
        assert got.structured_content == want, name
    moe_rows, dense_rows = plan.structured_content["rows"], plan_dense.structured_content["rows"]
    assert len(moe_rows) > 1 and moe_rows[0]["vram_bytes"] > moe_rows[-1]["vram_bytes"]
    # Qwen3.5-9B: 32 layers and the output head, so -ngl 33 (all on the GPU) down to 0, each row told apart.
    assert [r["n_gpu_layers"] for r in dense_rows] == list(range(33, -1, -1))
    assert all("n_cpu_moe" not in r for r in dense_rows) and plan_dense.structured_content["dense"] is True
    assert missing.is_error and "model /nowhere/none.gguf not found: give a .gguf path" in missing.content[0].text


# Holds 512 MiB of RAM, written (resident), until stdin closes: a program holding this machine's RAM.
HOLDER = "import sys\nheld = bytearray(512 << 20)\nfor i in range(0, len(held), 4096):\n    held[i] = 1\n" \
         "print('holding', flush=True)\nsys.stdin.read()\n"


def _of_this_moment(doc: dict[str, Any]) -> dict[str, Any]:
    """A plan for this machine's RAM without what moves between two reads of it (MemAvailable, each row's room
    beside it, the last step RAM holds, the sizes of what others hold): the rest must be the same document. (The
    model spills the card wherever RAM could hold it: no row's verdict turns on the RAM.)"""
    out = json.loads(json.dumps(doc))
    out.pop("ram_available_bytes")
    for row in out["rows"]:
        for key in ("ram_headroom_bytes", "ram_tight", "cache_ram_fit_mib"):
            row.pop(key)
    for fit in out["fit_intervals"]:  # where RAM runs out moves with it: the end it sets, and what that end lacks
        for key in ("ram_short_bytes", "vram_short_bytes", "hi", "flag_hi"):
            fit.pop(key)
        fit["summary"] = re.sub(r"\d[\d,.]*", "#", fit["summary"])
    out["notes"] = [re.sub(r"\d[\d,.]*", "#", n.split(", the most by ")[0]) for n in out["notes"]]
    return out


def test_a_plan_for_this_machines_ram_names_its_holders_as_plan_json_does():
    """Issue 51: without ``ram_gib`` the plan is for this machine's RAM, and `plan --json` names what holds the rest
    of it when a row is short; the tool once left that note out (the comparison above sets --ram, which hides it).
    A model four times this machine's RAM, beside a process of ours holding 512 MiB."""
    model = "gpt-oss-120b:MXFP4_MOE"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        _, [plan, given] = ask([("plan", {"model": model, "card": CARD, "context": 4096}),
                                ("plan", {"model": model, "card": CARD, "context": 4096, "ram_gib": 512})])
        want = cli_json("plan", model, "--gpu", CARD, "-c", "4096")
        with_ram = cli_json("plan", model, "--gpu", CARD, "-c", "4096", "--ram", "512")
    finally:
        holder.communicate("", timeout=30)
    assert not plan.is_error, plan.content
    holders = [n for n in want["notes"] if n.startswith("RAM in use by others: ")]
    assert len(holders) == 1 and ", the most by " in holders[0], want["notes"]
    assert _of_this_moment(plan.structured_content) == _of_this_moment(want)
    # --ram names another machine's RAM: nobody here holds it, and the answers are the same to the byte.
    assert given.structured_content == with_ram and not any("RAM in use" in n for n in with_ram["notes"])


@pytest.mark.parametrize(("card", "ram"), [(CARD, None), (CARD, "512"), (None, None), (None, "48")])
def test_the_tool_and_plan_json_are_one_document_on_every_field(engine_loc, monkeypatch, tmp_path, card, ram):
    """Issue 58: one builder (tuner.report.plan_doc.build) for both front ends, asked in one process of one machine
    (its host side held still by a fake at the psutil boundary: 30 of 32 GiB available, 3 GiB held by a browser):
    the MCP tool's answer is `moe-tune plan --json`'s document on every field, for a card named and for this machine,
    with and without --ram (without it, the rows short of RAM name the browser)."""
    from typer.testing import CliRunner

    from tests.fakes import FakeHost
    from tuner.cli.app import app
    from tuner.mcp_server import answers

    FakeHost(32 * 2**30, 30 * 2**30, (("firefox", 3 * 2**30),), bandwidth_bytes_s=41e9).install(monkeypatch)
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLAMA_CPP_DIR", str(engine_loc.bin_dir))
    model = "gpt-oss-120b:MXFP4_MOE"
    argv = ["plan", model, "-c", "4096", "--json", *(["--gpu", card] if card else []), *(["--ram", ram] if ram else [])]
    printed = CliRunner().invoke(app, argv)
    assert printed.exit_code == 0, printed.output
    cli = json.loads(printed.stdout)
    tool = answers.plan(model, card, 4096, float(ram) if ram else None)
    assert json.loads(json.dumps(tool)) == cli
    held = [n for n in cli["notes"] if n.startswith("RAM in use by others: ")]
    assert held == ([] if ram else ["RAM in use by others: 2.0 GiB of 32.0 GiB, the most by firefox 3.0 GiB"])
    assert cli["ram_available_bytes"] == (int(ram) if ram else 30) * 2**30
    assert cli["host_bandwidth_bytes_s"] == (89.6e9 if card else 41e9)
    figures = cli["memory_figures"]  # the engine here decides; as a CPU build it projects no card
    assert figures["decided_by"] == "engine" and (figures["configs"] == 0) == bool(card), figures


def test_results_and_launch_lines_of_this_machine(tuned):
    compose = run_cli("launch-line", str(tuned), "--format", "compose", env={"CUDA_VISIBLE_DEVICES": ""})
    _, [listed, line, wrong] = ask([("results", {}),
                                    ("launch_line", {"result": str(tuned), "format": "compose"}),
                                    ("launch_line", {"result": str(tuned), "format": "modelfile"})],
                                   results_dir=tuned.parent.parent, env={"CUDA_VISIBLE_DEVICES": ""})
    [entry] = listed.structured_content["results"]
    assert entry["result"] == str(tuned) and entry["line"] == run_cli("launch-line", str(tuned)).stdout.strip()
    assert entry["verdicts"] and entry["why"] and entry["still_holds"]["holds"] is True
    # The result records the model's fingerprint, the engine and the card: nothing is left unchecked.
    assert entry["still_holds"]["not_checked"] == []
    assert line.content[0].text.rstrip("\n") == compose.stdout.rstrip("\n")
    assert wrong.is_error and "use shell, llama-swap, systemd, compose, preset, json" in wrong.content[0].text


def test_a_result_whose_model_cannot_be_read_is_its_own_entry(tuned, tmp_path):
    """A directory where the model was (root reads through chmod 000, so a directory is what stops every user): that
    result's entry names it; the other result is answered as before."""
    results = tmp_path / "results"
    folder = tmp_path / "demo.gguf"
    folder.mkdir()
    variant(tuned, results / "gone-dir", model=folder)
    variant(tuned, results / "intact")
    _, [listed] = ask([("results", {})], results_dir=results, env={"CUDA_VISIBLE_DEVICES": ""})
    assert not listed.is_error, listed.content
    by_study = {Path(e["result"]).parent.name: e for e in listed.structured_content["results"]}
    assert sorted(by_study) == ["gone-dir", "intact"]
    bad = by_study["gone-dir"]["still_holds"]
    assert bad["holds"] is False
    assert bad["changes"] == [f"the model file {folder} is a directory now, not the tuned GGUF file"]
    assert by_study["intact"]["still_holds"]["holds"] is True


def test_quants_with_the_figures_of_quants_json(demo_models, tmp_path):
    files = root_layout({q: demo_models[("qwen3moe", q)] for q in ("Q8_0", "Q4_K_M")}, "Demo-MoE")
    with HubServer() as hub:
        hub.add_repo(REPO, files)
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_TOKEN": "",
               "MOE_TUNE_CACHE": str(tmp_path / "moe-tune")}
        _, [got] = ask([("quants", {"repo": REPO, "card": CARD, "context": 4096})], env=env)
        want = cli_json("quants", REPO, "--gpu", CARD, "-c", "4096", env=env)
    assert not got.is_error, got.content
    doc = got.structured_content
    assert [(q["name"], q["total_bytes"], q["fit"]) for q in doc["quants"]] == \
        [(q["name"], q["total_bytes"], q["fit"]) for q in want["quants"]]
    assert doc["commit"] == want["commit"] and doc["architecture"] == want["header"]["architecture"]
