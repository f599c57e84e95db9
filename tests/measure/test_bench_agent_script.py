"""scripts/bench_agent_session.py on the real engine: on a quiet machine (this test session's scope) it reports no
other llama.cpp process and no rival for the measuring lock, though it starts llama-server processes of its own.
It once watched with a bare ``quiet.Watch()`` (its own servers counted as others': "141 other llama.cpp
processes") and claimed the lock a second time inside the harness's hold (and named itself as the rival)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tuner.models import demo

REPO = Path(__file__).resolve().parents[2]


def test_the_agent_benchmark_does_not_count_its_own_servers_or_its_own_lock(engine_loc, tmp_path):
    model = demo.make_demo_models(arch="qwen3moe", out=tmp_path / "demo", engine=engine_loc)[0].path
    out = tmp_path / "agent_session.md"
    run = subprocess.run([sys.executable, "scripts/bench_agent_session.py", "--model", str(model), "--depths", "512",
                          "--gen", "4", "--rounds", "1", "--no-off", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    # Its own servers ran: a session row with turns, for the default and the cache-reuse arm (plain attention).
    assert re.search(r"^512 \| [1-9]\d* \| \d+\.\d+ \| tuned \+ cache-reuse 256 \| \d+\.\d+ \|", text, re.M), text
    assert "load at start: this run holds the measuring lock; quiet" in text, text
    assert "is measuring" not in text, text
    assert re.search(r"^load while measuring: 0 other llama\.cpp processes came and went; other processes used up to "
                     r"0\.\d CPU cores: quiet;", text, re.M), text
