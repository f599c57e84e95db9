"""A real auto-tune result on the demo model, made in seconds (two trials, one round, no KV pricing): what
``serve``, the deployment formats and the MCP server are tested on. Speeds in it are whatever this machine
measured; tests read its lines and records, never its figures."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.engine import build
from tuner.machine import hardware
from tuner.measure import workload
from tuner.measure.workload import WorkloadKind
from tuner.models import demo
from tuner.search import autotune, finish, study
from tuner.search.result import RESULT_FILE


def tune_demo(loc: build.EngineLocation, out: Path) -> Path:
    """auto-tune the qwen3moe demo at Q4_K_M into ``out``; the result.json it wrote."""
    [*_, model] = demo.make_demo_models(arch="qwen3moe", quants=["Q4_K_M"], out=out / "models", engine=loc)
    load = workload.preset(WorkloadKind.CHAT, 16, 16, rounds=1)
    req = autotune.TuneRequest(model=model.path, workload=load, min_ctx=512, max_kld=None,
                               budget=study.Budget(trials=2), top_candidates=1, results_dir=out / "results",
                               measure=study.Measure.for_workload(load, repetitions=1),
                               rounds=finish.Rounds(min=1, max=1, select=1))
    res = autotune.auto_tune(req, loc, hardware.probe_hardware(host_bandwidth_s=0))
    return res.result_dir / RESULT_FILE


def variant(result_file: Path, dest: Path, change: Callable[[dict[str, Any]], None] = lambda d: None,
            model: Path | None = None) -> Path:
    """A copy of a result in ``dest`` (a results/<study> folder), its records edited by ``change`` and its model
    moved to ``model`` (every config names the new path); the new result.json."""
    text = result_file.read_text()
    if model is not None:
        old = json.loads(text)["model"]
        text = text.replace(json.dumps(old)[1:-1], json.dumps(str(model))[1:-1])
    data = json.loads(text)
    change(data)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / RESULT_FILE).write_text(json.dumps(data, indent=2))
    return dest / RESULT_FILE


def measured_flags(result_file: Path, label: str) -> list[str]:
    """The flags llama-server ran with when ``label`` was measured (the finish's own argv), without the program and
    the address the finish chose."""
    fin = json.loads(result_file.read_text())["finish"]
    for m in [*fin["candidates"], *fin["baselines"], *fin.get("confirmation", [])]:
        if m["label"] == label:
            argv = m["argv"]
            return argv[1:argv.index("--host")]
    raise AssertionError(f"{label} was not measured")
