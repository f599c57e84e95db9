"""`moe-tune mcp` through the official SDK's own client over stdio: the tool list, `plan` with the figures of
`moe-tune plan --json`, `quants` with those of `moe-tune quants --json` (a local Hub), `results` and
`launch_line` on a real auto-tune result, and the tool's own errors as the agent's error text."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from tests.conftest import run_cli
from tests.demo_result import tune_demo
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


def test_the_tools_and_a_plan_with_the_figures_of_plan_json(demo_models):
    model = str(demo_models[("qwen3moe", "Q4_K_M")])
    tools, [plan, missing] = ask([("plan", {"model": model, "card": CARD, "context": 4096, "ram_gib": 32}),
                                  ("plan", {"model": "/nowhere/none.gguf"})])
    assert sorted(tools) == ["launch_line", "plan", "quants", "results"]
    assert not plan.is_error, plan.content
    got = plan.structured_content
    want = cli_json("plan", model, "--gpu", CARD, "-c", "4096", "--ram", "32")
    assert got["rows"] == [{k: r[k] for k in got["rows"][0]} for r in want["rows"]]
    assert len(got["rows"]) > 1 and got["rows"][0]["vram_bytes"] > got["rows"][-1]["vram_bytes"]
    for key in ("model", "hardware", "n_configs", "vram_budget_bytes", "ram_available_bytes", "host_bandwidth_bytes_s",
                "fit_intervals", "largest_ctx", "model_source", "figures_from"):
        assert got[key] == want[key], key
    assert missing.is_error and "model /nowhere/none.gguf not found: give a .gguf path" in missing.content[0].text


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
