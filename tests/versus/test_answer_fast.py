"""`moe-tune auto-tune MODEL` across both engines, as a user runs it, on the demo model (random weights: its figures
are not speeds; the tests read the run's lines, their times, its records): the estimate of the time left said after
the first trial is within 2x of what was left; a --time budget is kept across the two engines, and what was cut to
keep it is said; a price that fails leaves its line unpriced and the run ends with its answer (issue 66: a file where
the reference logits' folder goes once ended a whole race in a traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tuner.search.result import load_result

QUICK = ("--workload", "chat", "-p", "48", "-n", "16", "--min-ctx", "1024", "--allow-busy")


def run_stamped(*args: str, env: dict[str, str] | None = None, timeout: float = 1800
                ) -> tuple[int, list[tuple[float, str]], str, float]:
    """The console script as a user runs it, each stderr line with the seconds since the start when it came."""
    exe = Path(sys.executable).parent / "moe-tune"
    full = {**os.environ, "COLUMNS": "200", **(env or {})}
    full.pop("MOE_TUNE_DEBUG", None)
    full.pop("MOE_TUNE_ENGINES", None)  # the suite's default of llama.cpp alone: a user's run races every engine
    t0 = time.monotonic()
    proc = subprocess.Popen([str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read() if proc.stdout else ""), daemon=True)
    reader.start()
    lines: list[tuple[float, str]] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
    code = proc.wait(timeout=timeout)
    reader.join()
    return code, lines, "".join(out), time.monotonic() - t0


def _left_s(line: str) -> float:
    m = re.search(r"about (\d+):(\d\d) left", line)
    assert m, line
    return int(m[1]) * 60 + int(m[2])


@pytest.fixture(scope="module")
def model(engine_loc, tmp_path_factory) -> Path:
    from tuner.models import demo

    out = tmp_path_factory.mktemp("fast")
    (path,) = [f.path for f in demo.make_demo_models(quants=["Q4_K_M"], out=out / "model", engine=engine_loc,
                                                      seed=int(time.time()) % 100_000) if f.quant == "Q4_K_M"]
    return path


def test_the_estimate_after_the_first_trial_is_within_2x_of_what_was_left(model, ik_loc, tmp_path):
    code, lines, _, wall = run_stamped("auto-tune", str(model), *QUICK, "--trials", "3", "--results-dir",
                                       str(tmp_path))
    assert code == 0, "\n".join(x for _, x in lines[-40:])
    first = next((t, x) for t, x in lines if x.startswith("trial 1/3:"))
    said, actual = _left_s(first[1]), wall - first[0]
    assert 0.5 <= said / actual <= 2.0, (said, actual, "\n".join(f"{t:6.1f} {x}" for t, x in lines))
    # and the run says its stages' estimate once a trial told it, and its time at the end
    assert any(x.startswith("estimate from what was measured:") for _, x in lines)
    assert any(x.startswith("time: ") and "in all" in x for _, x in lines)


def test_a_time_budget_is_kept_across_two_engines_and_what_was_cut_is_said(model, ik_loc, tmp_path):
    # unbounded, the run asks 40 trials an engine (each engine's space ends sooner); the budget leaves room for fewer
    free = run_stamped("auto-tune", str(model), *QUICK, "--trials", "40", "--results-dir", str(tmp_path / "free"))
    assert free[0] == 0, "\n".join(x for _, x in free[1][-40:])
    budget_s = max(12.0, free[3] * 0.6)
    code, lines, stdout, wall = run_stamped("auto-tune", str(model), *QUICK, "--trials", "40", "--time",
                                            f"{budget_s:.0f}s", "--results-dir", str(tmp_path / "kept"))
    text = "\n".join(f"{t:6.1f} {x}" for t, x in lines)
    assert code == 0, text
    assert wall <= budget_s * 1.1 + 2, (wall, budget_s, free[3], text)  # the interpreter's own start beside it
    trials = [x for _, x in lines if x.startswith("trial ")]
    assert any("ik_llama.cpp" in x for _, x in lines if x.startswith("engine 2 of 2"))
    assert len(trials) >= 2  # both engines searched, one trial at least each
    end = next(x for _, x in lines if x.startswith("time: "))
    assert f"of --time {budget_s:.0f} s (kept)" in end and "cut to keep it: " in end, end
    results = [load_result(p) for p in (tmp_path / "kept").glob("*/result.json")]
    assert len(results) == 2 and all(r.engines for r in results)


def test_a_price_that_fails_leaves_its_line_unpriced_and_the_run_answers(model, ik_loc, tmp_path):
    # the reference logits' folder is a file: writing them fails with an OSError (as a full disk would)
    from tuner.machine import paths

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "engine").symlink_to(paths.engine_root())  # the engines as built; the prices' cache is blocked
    (cache / "quality").write_text("in the way")
    code, lines, stdout, _ = run_stamped("auto-tune", str(model), *QUICK, "--trials", "3", "--results-dir",
                                         str(tmp_path / "r"), env={"MOE_TUNE_CACHE": str(cache)})
    text = "\n".join(x for _, x in lines)
    assert code == 0, text
    assert "Traceback" not in text
    results = [load_result(p) for p in (tmp_path / "r").glob("*/result.json")]
    assert len(results) == 2
    block = next(r.engines for r in results if r.engines and r.engines["chosen"])
    unpriced = [x for x in block["lines"] if (x.get("standing") or {}).get("state") == "unpriced"
                or "unpriced" in block["reason"]]
    assert unpriced or all(x["engine"] == "llama.cpp" and x["config"]["cache_type_v"] == "f16"
                           for x in block["lines"] if x["label"] == block["printed"]), json.dumps(block)[:3000]
    assert "launch line" in stdout
