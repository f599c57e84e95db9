"""scripts/harness.py, the benchmark harness the frontier benchmark (and every scripts/bench_*.py) runs under:
the measuring lock held while a grid is measured, the CV gate and its re-measurement (the median pass kept), the
resumable cache (the load of every run kept), the hold and the watch a bench main reads instead of claiming and
watching again, and the rule that every benchmark script runs its main under the harness."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tuner.core.errors import MachineBusyError
from tuner.engine import runner
from tuner.machine import quiet

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import harness  # noqa: E402


def _grid(n: int) -> list[dict]:
    return [{"ctx": 512 * (i + 1), "kv": "f16"} for i in range(n)]


class Cut(Exception):
    """A run cut short."""


class Measure:
    """A measurement with set CVs: ``cvs[ctx]`` lists the CV of each pass of that config (request time = ctx/1000
    plus the pass number, so passes can be told apart); ``fail_after`` chunks, it raises (a run cut short)."""

    def __init__(self, cvs: dict[int, list[float]], fail_after: int | None = None) -> None:
        self.cvs = cvs
        self.calls: list[list[int]] = []
        self.fail_after = fail_after

    def __call__(self, part: list[dict]) -> list[dict]:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise Cut
        self.calls.append([d["ctx"] for d in part])
        out = []
        for d in part:
            n = sum(d["ctx"] in c for c in self.calls) - 1
            out.append({"request_s": d["ctx"] / 1000 + n, "cv_pct": self.cvs[d["ctx"]][n]})
        return out


def _measure(cache, grid, m, lines=None, chunks_of=2, **kw):
    return harness.measure_grid(cache, grid, m, chunks=lambda todo: [todo[i:i + chunks_of]
                                                                     for i in range(0, len(todo), chunks_of)],
                                rank=lambda r: r["request_s"], command="test",
                                say=lines.append if lines is not None else print, **kw)


def _quiet(monkeypatch) -> None:
    """The real watch records the machine's load, but its verdict is set to quiet: what these tests count (passes,
    calls) must not depend on what else this machine runs meanwhile."""
    real = harness.watched
    monkeypatch.setattr(harness, "watched", lambda fn, rec=None: (real(fn, rec)[0], None))


def test_a_row_over_the_cv_gate_is_measured_again_and_keeps_the_pass_that_passes(tmp_path, monkeypatch):
    _quiet(monkeypatch)
    grid = _grid(3)
    m = Measure({512: [2.0], 1024: [30.0, 4.0], 1536: [25.0, 22.0, 21.0]})
    cache = harness.GridCache("g.json", {"k": 1}, folder=tmp_path)
    rows = _measure(cache, grid, m, cv_gate_pct=10.0, max_passes=3)
    assert [len(r["passes"]) for r in rows] == [1, 2, 3]
    assert rows[1]["request_s"] == pytest.approx(2.024) and rows[1]["cv_gate"] == "pass"  # the agreeing pass
    # None passes: the median pass (1.536, 2.536, 3.536 s), not the fastest: best-of-3 keeps the luckiest noise.
    assert rows[2]["cv_gate"] == "fail" and rows[2]["request_s"] == pytest.approx(2.536)
    assert m.calls[2:] == [[1536, 1024], [1536]]  # later passes: only the rows over the gate, reverse order
    saved = json.loads((tmp_path / "g.json").read_text())
    assert saved["complete"] and saved["key"] == {"k": 1} and saved["measured_at"]
    assert "watched measurements disturbed" in saved["load"] and all("noise" in p for r in rows for p in r["passes"])


def test_a_grid_cut_short_resumes_where_it_stopped_and_a_new_key_starts_over(tmp_path, monkeypatch):
    _quiet(monkeypatch)
    grid = _grid(4)
    cvs = {c["ctx"]: [1.0] for c in grid}
    with pytest.raises(Cut):
        _measure(harness.GridCache("g.json", {"k": 1}, folder=tmp_path), grid, Measure(cvs, fail_after=1))
    part = json.loads((tmp_path / "g.json").read_text())
    assert not part["complete"] and len(part["rows"]) == 2
    again = Measure(cvs)
    rows = _measure(harness.GridCache("g.json", {"k": 1}, folder=tmp_path), grid, again)
    assert again.calls == [[1536, 2048]] and len(rows) == 4
    # Both runs' loads are kept, each with what it measured: the resume once overwrote the first run's.
    saved = json.loads((tmp_path / "g.json").read_text())
    assert [r["measurements"] for r in saved["runs"]] == [2, 2], saved["runs"]
    assert all("watched measurements disturbed" in r["load"] for r in saved["runs"])
    assert saved["load"].startswith("over 2 runs: run 1 (") and "run 2 (" in saved["load"]
    lines: list[str] = []
    cached = Measure(cvs)
    _measure(harness.GridCache("g.json", {"k": 1}, folder=tmp_path), grid, cached, lines)
    assert cached.calls == [] and lines[0].startswith("grid from g.json: 4 rows")
    fresh = Measure(cvs)
    _measure(harness.GridCache("g.json", {"k": 2}, folder=tmp_path), grid, fresh)
    assert sum(len(c) for c in fresh.calls) == 4


def test_a_disturbed_row_is_measured_again_until_a_quiet_pass_or_the_last_pass(tmp_path, monkeypatch):
    """A row measured while something else used the machine is not settled, even when its CV passes the gate (a
    grid once kept ten rows disturbed by a test run beside it); a row disturbed in every pass stops at
    ``max_passes`` and keeps its median pass, marked, and a later run of a complete grid does not measure it
    again."""
    busy_calls = {0, 1, 3, 4}  # chunk calls measured while the machine was busy: 512 disturbed in every pass

    def watched(fn, rec=None):
        n = len(m.calls)
        return fn(), ("other processes use 0.9 CPU cores" if n in busy_calls else None)

    monkeypatch.setattr(harness, "watched", watched)
    grid = _grid(2)
    m = Measure({512: [1.0, 1.0, 1.0], 1024: [1.0, 1.0, 1.0]})
    rows = _measure(harness.GridCache("g.json", {"k": 1}, folder=tmp_path), grid, m, max_passes=3,
                    chunks_of=1)
    assert m.calls == [[512], [1024], [1024], [512], [512]]
    assert [len(r["passes"]) for r in rows] == [3, 2]
    # Disturbed in every pass: the median pass (0.512, 1.512, 2.512 s), marked.
    assert rows[0]["noise"] and rows[0]["request_s"] == pytest.approx(1.512) and rows[0]["cv_gate"] == "fail"
    assert rows[1]["noise"] is None and rows[1]["request_s"] == pytest.approx(2.024) and rows[1]["cv_gate"] == "pass"
    again = Measure({512: [1.0], 1024: [1.0]})
    _measure(harness.GridCache("g.json", {"k": 1}, folder=tmp_path), grid, again, max_passes=3)
    assert again.calls == []


def test_a_benchmark_holds_the_measuring_lock_while_it_measures():
    with harness.machine("test", say=lambda _: None) as rec:
        assert rec.locked
        # Another run (here: another thread; a claim nested in the same thread is the same hold) is refused.
        seen: list[BaseException] = []

        def rival() -> None:
            try:
                with quiet.claim_machine("auto-tune", wait_s=0):
                    pass
            except MachineBusyError as exc:
                seen.append(exc)

        t = threading.Thread(target=rival)
        t.start()
        t.join()
        assert len(seen) == 1 and "moe-tune benchmark test" in str(seen[0])
        with harness.machine("nested") as inner:  # re-entrant: the same hold
            assert inner is rec
    with quiet.claim_machine("auto-tune", wait_s=0, allow_busy=True) as after:
        assert after.locked


def test_a_benchmark_that_went_ahead_without_the_lock_says_who_held_it():
    """The claim's finding is kept on the held record (``start_noise``), for a script to print with its figures."""
    rival = subprocess.Popen([sys.executable, "-c", "import time\nfrom tuner.machine import quiet\n"
                              "with quiet.claim_machine('rival run'):\n print('ready', flush=True)\n time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert rival.stdout is not None and rival.stdout.readline().strip() == "ready"
        with harness.machine("test", say=lambda _: None, wait_s=0) as rec:
            assert not rec.locked and rec.start_noise is not None
            assert f"moe-tune rival run (pid {rival.pid}) is measuring" in rec.start_noise
    finally:
        rival.kill()
        rival.wait()


def test_a_bench_main_reads_the_hold_and_the_watch_it_runs_under_and_its_children_are_its_own():
    """bench_agent_session once claimed the machine again inside its harness hold (the second ``flock`` fails: it
    named itself as the rival) and watched with a bare ``quiet.Watch()`` (its own llama-servers and their CPU
    counted as others'). A main reads :func:`harness.held` and :func:`harness.watching` instead: the hold the
    harness took, and a watch to which what the runner starts is ours."""
    seen: dict[str, object] = {}

    @harness.bench("test")
    def main() -> None:
        seen["rec"], watch = harness.held(), harness.watching()
        with runner.hold([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"],
                         ready_timeout_s=10, what="burner", fix="none") as burner:
            time.sleep(3.0)
            seen["burner_cpu_s"] = sum(psutil.Process(burner.pid).cpu_times()[:2])
        seen["seen"] = watch.seen

    main()
    rec = seen["rec"]
    assert isinstance(rec, harness.LoadRecord) and rec.locked and rec.watched == 1  # main's whole-run watch
    assert seen["burner_cpu_s"] > 0.3  # it did load the CPU: only the watch's ``own`` keeps it out
    assert seen["seen"].cpu_cores < 0.2, seen["seen"]  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="harness.bench"):
        harness.held()
    with pytest.raises(RuntimeError, match="harness.bench"):
        harness.watching()


def test_every_benchmark_script_runs_its_main_under_the_harness():
    scripts = sorted(SCRIPTS.glob("bench_*.py"))
    assert len(scripts) >= 10
    for path in scripts:
        tree = ast.parse(path.read_text())
        [main] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        decorators = [ast.unparse(d) for d in main.decorator_list]
        assert any(d.startswith("harness.bench(") for d in decorators), path.name
