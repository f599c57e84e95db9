"""Shared fixtures: the real engine, the demo models, and a guard that no llama.cpp process outlives a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.trained import trained_dense_f16, trained_model, trained_moe  # noqa: F401  (session fixtures: trained GGUFs)
from tuner.engine import build
from tuner.machine import processes
from tuner.models import demo

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    # A shell that starts pytest in the background ignores SIGINT, and Python then keeps it ignored; the Ctrl-C
    # tests need the normal KeyboardInterrupt behaviour however the suite was launched.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Other test suites may run llama.cpp on this machine at the same time: the interference check (and the
    # measuring lock) look only at this session's own processes. The busy tests start competitors under it.
    os.environ[processes.SCOPE_ENV] = str(os.getpid())
    # With ik_llama.cpp built (`make test` builds it), every auto-tune would tune both engines: the suite tunes
    # llama.cpp alone unless a test names the engines (tests/versus/test_engines.py).
    os.environ.setdefault(build.ENGINES_ENV, "llama.cpp")


@pytest.fixture
def unscoped(monkeypatch):
    """Opt out of the suite's machine scope (set above) for one test: the CPU check then computes what a user's run
    computes, the whole machine's CPU time minus our own tree, with other suites' load in it."""
    monkeypatch.delenv(processes.SCOPE_ENV, raising=False)


ENGINE_FIXTURES = {"engine_loc", "demo_models", "ik_loc"}


def pytest_collection_modifyitems(config, items):
    """Two tiers: ``fast`` (pure code and files, no llama.cpp; `make test` runs it first and stops at the first
    failure) and ``engine`` (the real binaries on synthetic models)."""
    for item in items:
        uses_engine = bool(ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())))
        item.add_marker(pytest.mark.engine if uses_engine or item.get_closest_marker("slow") else pytest.mark.fast)


def _ours_or_orphaned(proc: psutil.Process, me: int) -> bool:
    """Started by this test process (at any depth), or orphaned and adopted by init."""
    try:
        parents = proc.parents()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(p.pid == me for p in parents) or proc.ppid() == 1


def _llama_pids(since: float) -> set[int]:
    """Live llama.cpp processes that this test run could have left behind.

    Other programs on the machine may run llama.cpp too; only our descendants and orphans count.
    """
    me = os.getpid()
    found = set()
    for proc in psutil.process_iter(["name", "status", "create_time"]):
        try:
            if (
                (proc.info["name"] or "").startswith("llama-")
                and proc.info["status"] != psutil.STATUS_ZOMBIE
                and proc.info["create_time"] >= since
                and _ours_or_orphaned(proc, me)
            ):
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(autouse=True)
def no_llama_process_left_behind():
    since = time.time() - 1
    yield
    deadline = time.monotonic() + 3
    while (left := _llama_pids(since)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"llama.cpp processes left running: {sorted(left)}"


@pytest.fixture(scope="session")
def engine_loc() -> build.EngineLocation:
    return build.locate_engine()


@pytest.fixture(scope="session")
def ik_loc() -> build.EngineLocation:
    """ik_llama.cpp as the project builds it (`make test` runs `moe-tune engine install --engine ik` first)."""
    from tuner.core.errors import EngineNotFoundError
    from tuner.engine.kinds import IK_LLAMA

    try:
        return build.locate_engine(kind=IK_LLAMA)
    except EngineNotFoundError:
        pytest.fail("ik_llama.cpp is not built: run `moe-tune engine install --engine ik` (make test does)")


@pytest.fixture(scope="session")
def demo_models(engine_loc, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Both demo architectures at F16, Q8_0 and Q4_K_M, written once per test session."""
    out = tmp_path_factory.mktemp("demo")
    models = {}
    for arch in ("qwen3moe", "qwen35moe"):
        files = demo.make_demo_models(arch=arch, quants=["Q8_0", "Q4_K_M"], out=out / arch, engine=engine_loc)
        for f in files:
            models[(arch, f.quant)] = f.path
    return models


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the installed console script the way a user would."""
    exe = Path(sys.executable).parent / "moe-tune"
    full_env = dict(os.environ)
    full_env.pop("MOE_TUNE_DEBUG", None)
    full_env["COLUMNS"] = "200"
    if env:
        full_env.update(env)
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=full_env, timeout=timeout)
