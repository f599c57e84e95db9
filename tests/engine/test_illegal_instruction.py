"""A build made for another CPU dies of an illegal instruction (SIGILL) the first time it runs here: moe-tune says so in
one line naming the cause and the fix, whether the build is the managed one or the user's (LLAMA_CPP_DIR, PATH).
The process is real: a script that kills itself with SIGILL stands where llama-server and llama-bench would be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tuner.core.errors import ProcessFailedError
from tuner.engine import runner
from tuner.measure import failures
from tuner.measure.failures import FailureKind

pytestmark = pytest.mark.fast

# What a binary built with AVX-512 (or -march=native of another CPU) does on a CPU without it: the kernel sends
# SIGILL at the first such instruction. No core file is left behind.
DIES_OF_SIGILL = "#!/bin/sh\nulimit -c 0\nkill -ILL $$\n"
# A wrapper script that runs such a binary and passes its status on: a shell reports the signal as 128 + 4.
WRAPPER_OF_IT = "#!/bin/sh\nulimit -c 0\n\"{inner}\" \"$@\"\nexit $?\n"


def _engine_dir(folder: Path, body: str = DIES_OF_SIGILL) -> Path:
    folder.mkdir(parents=True)
    for tool in ("llama-server", "llama-bench"):
        path = folder / tool
        path.write_text(body)
        path.chmod(0o755)
    return folder


def test_a_process_that_dies_of_sigill_is_said_to_be_built_for_another_cpu(tmp_path):
    tools = _engine_dir(tmp_path / "bin")
    pids: list[int] = []
    with pytest.raises(ProcessFailedError) as info:
        runner.run_process([str(tools / "llama-bench"), "--version"], timeout_s=30, what="llama-bench --version",
                           fix="the caller's own fix", cwd=tmp_path, on_start=pids.append)
    exc = info.value
    assert exc.returncode == -4 and "\n" not in str(exc)
    assert str(exc) == (f"llama-bench --version failed: llama-bench in {tools} was built for another CPU (it died of "
                        "an illegal instruction, SIGILL): rebuild it here with `moe-tune engine install --force` "
                        "(ik_llama.cpp's: add --engine ik), or set MOE_TUNE_CPU_ISA=avx2 for a portable build; a build "
                        "of your own (LLAMA_CPP_DIR, PATH): build it on this machine")
    failure = failures.from_error(exc)  # a trial's failure: its own kind, not a crash
    assert failure.kind is FailureKind.WRONG_CPU and failure.signal_name == "SIGILL"
    assert failure.summary().startswith("wrong cpu: llama-bench in ") and "MOE_TUNE_CPU_ISA=avx2" in failure.summary()
    assert pids and not psutil.pid_exists(pids[0]) and not list(tmp_path.glob("core*"))  # gone, no core left


def test_a_wrapper_that_passes_the_signal_on_as_132_is_read_the_same(tmp_path):
    inner = _engine_dir(tmp_path / "inner")
    outer = _engine_dir(tmp_path / "outer", WRAPPER_OF_IT.format(inner=inner / "llama-server"))
    res = runner.run_process([str(outer / "llama-server"), "--help"], timeout_s=30, what="llama-server --help",
                             fix="-", check=False, cwd=tmp_path)
    assert res.returncode == 132
    got = failures.classify_exit(res.argv, res.returncode, res.stderr_tail)
    assert got.kind is FailureKind.WRONG_CPU and got.reason.startswith(f"llama-server in {outer} was built for ")


def test_the_users_own_build_in_llama_cpp_dir_is_refused_in_one_line(tmp_path):
    """`moe-tune engine info` with LLAMA_CPP_DIR at a build made for another CPU: exit 1, one line, the cause and the
    fix, no traceback; nothing it started is left running."""
    tools = _engine_dir(tmp_path / "theirs")
    env = dict(os.environ, LLAMA_CPP_DIR=str(tools), MOE_TUNE_CACHE=str(tmp_path / "cache"))
    env.pop("MOE_TUNE_DEBUG", None)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    res = subprocess.run([sys.executable, "-m", "tuner.cli", "engine", "info"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"the engine at {tools} was built for another CPU (its tools die of an illegal instruction, SIGILL)" \
        in lines[0]
    assert "moe-tune engine install --force" in lines[0] and "MOE_TUNE_CPU_ISA=avx2" in lines[0]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
