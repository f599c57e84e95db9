"""Process handling: timeouts and Ctrl-C kill the whole group; llama-server always stops."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tuner.core.config import LaunchConfig
from tuner.core.errors import ProcessFailedError, ProcessTimeoutError
from tuner.engine import flags, runner
from tuner.measure import failures
from tuner.measure.failures import FailureKind


def _children_of_group_gone(pgid: int, within_s: float = 3.0) -> bool:
    """True once no live process is left in the group (a killed process may take a moment on a busy machine)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = False
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                    alive = True
                    break
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                continue
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_output_and_exit_code():
    res = runner.run_process(["sh", "-c", "echo out; echo err >&2"], timeout_s=10, what="sh", fix="none")
    assert res.returncode == 0 and res.stdout == "out\n" and res.stderr_tail == "err"
    with pytest.raises(ProcessFailedError, match=r"sh failed \(exit 3\): boom; fix it"):
        runner.run_process(["sh", "-c", "echo boom >&2; exit 3"], timeout_s=10, what="sh", fix="fix it")


def test_lines_as_they_come_and_the_exit_before_the_reaping():
    """What the host-paging windows of the benchmark tools rest on: each line told as it arrives (a progress line
    left out of the error tail), every line before the exit, and the exited child's counters still readable."""
    seen: list[str] = []
    at_exit: dict[str, object] = {}

    def exited(pid: int) -> None:
        at_exit["lines"], at_exit["pid"] = list(seen), pid
        at_exit["state"] = psutil.Process(pid).status()  # not reaped yet: a zombie whose /proc is still there
        at_exit["stat"] = (Path("/proc") / str(pid) / "stat").read_text().split(") ")[1].split()[9]  # majflt
        at_exit["io"] = (Path("/proc") / str(pid) / "io").read_text()

    script = "echo 'progress: run 1' >&2; echo row1; echo 'an error' >&2; echo 'progress: run 2' >&2; echo row2"
    res = runner.run_process(["sh", "-c", script], timeout_s=10, what="sh", fix="none",
                             on_stdout=lambda line: seen.append(f"out {line}"),
                             on_stderr=lambda line: seen.append(f"err {line}") or line.startswith("progress"),
                             on_exit=exited)
    assert res.stdout == "row1\nrow2\n" and res.stderr_tail == "an error"  # progress lines not kept
    assert sorted(at_exit["lines"]) == sorted(seen) and len(seen) == 5  # all five lines before the exit
    assert at_exit["state"] == psutil.STATUS_ZOMBIE and str(at_exit["stat"]).isdigit()
    assert "read_bytes:" in str(at_exit["io"])  # what pressure.read_counters reads, read from the exited child
    assert not psutil.pid_exists(int(at_exit["pid"]))  # reaped on the way out: no zombie left behind


def test_timeout_kills_the_whole_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(ProcessTimeoutError) as info:
        runner.run_process(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout_s=0.5, what="sh",
                           fix="none")
    assert info.value.returncode is None
    grandchild = int(pidfile.read_text())
    time.sleep(0.2)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_ctrl_c_stops_the_child(tmp_path):
    pidfile = tmp_path / "child.pid"
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        runner.run_process(["sh", "-c", f"echo $$ > {pidfile}; sleep 60"], timeout_s=30, what="sh", fix="none")
    child = int(pidfile.read_text())
    assert _children_of_group_gone(child)


def test_server_serves_and_is_gone_afterwards(engine_loc, demo_models, tmp_path):
    cfg = LaunchConfig(model=demo_models[("qwen3moe", "Q4_K_M")], ctx=1024, parallel=1, threads=2)
    argv = flags.server_argv(engine_loc.tool("llama-server"), cfg)
    with runner.serve(argv, log_dir=tmp_path) as server:
        pid = server.proc.pid
        body = server.complete("The quick brown fox", n_predict=12)
        assert body["timings"]["predicted_n"] == 12
        assert body["timings"]["predicted_per_second"] > 0
        assert body["tokens_predicted"] == 12
    assert server.proc.poll() is not None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_server_that_cannot_start_reports_its_log(engine_loc, tmp_path):
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    argv = flags.server_argv(engine_loc.tool("llama-server"), LaunchConfig(model=bogus))
    with pytest.raises(ProcessFailedError, match="llama-server failed"), runner.serve(argv, log_dir=tmp_path):
        pass


# ------------------------------------------------------------------------------ classification, streaming

OOM_CUDA = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1536.00 MiB on device 0: cudaMalloc failed: "
            "out of memory\nalloc_tensor_range: failed to allocate CUDA0 buffer of size 1610612736\n"
            "llama_model_load: error loading model: unable to allocate CUDA0 buffer")


@pytest.mark.parametrize("returncode,tail,kind,signal_name", [
    (1, OOM_CUDA, FailureKind.OUT_OF_MEMORY, None),
    (1, "llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache",
     FailureKind.OUT_OF_MEMORY, None),
    (1, "llama_init_from_model: failed to initialize the context: quantized V cache was requested, but this "
        "requires Flash Attention", FailureKind.REJECTED_CONFIG, None),
    (1, "error: invalid argument: 1024", FailureKind.REJECTED_CONFIG, None),
    (-6, "GGML_ASSERT(n_tokens <= n_batch) failed", FailureKind.CRASHED, "SIGABRT"),
    (-9, "load_tensors: loading model", FailureKind.CRASHED, "SIGKILL"),
    (3, "something odd", FailureKind.CRASHED, None),
])
def test_failures_are_classified_from_the_engines_own_messages(returncode, tail, kind, signal_name):
    f = failures.classify_exit(["llama-server", "-m", "x.gguf"], returncode, tail)
    assert f.kind is kind and f.signal_name == signal_name and f.argv == ("llama-server", "-m", "x.gguf")
    assert f.stderr_tail == tail and "\n" not in f.summary()
    if kind is FailureKind.OUT_OF_MEMORY:
        assert "alloc" in f.reason or "memory" in f.reason


def test_streamed_completion_times_the_first_token_and_keeps_timings(engine_loc, demo_models, tmp_path):
    cfg = LaunchConfig(model=demo_models[("qwen3moe", "Q8_0")], ctx=512, parallel=1, threads=2)
    argv = flags.server_argv(engine_loc.tool("llama-server"), cfg)
    with runner.serve(argv, log_dir=tmp_path, log_jsonl=True) as server:
        tokens = server.tokenize("def main():\n    return 42\n" * 4)
        done = server.stream_complete(tokens, n_predict=6)
        tail = server.log_tail()
    assert done.timings["prompt_n"] == len(tokens) and done.timings["predicted_n"] == 6
    assert done.tokens_predicted == 6 and 0 < done.ttft_s <= done.elapsed_s
    assert "listening on" in tail and '{"type"' not in tail  # JSONL records read back as plain text


def test_kill_9_of_the_tool_leaves_no_llama_process(demo_models):
    """A hard kill cannot run any cleanup: the children die with the tool (PR_SET_PDEATHSIG), not later."""
    import subprocess
    import sys
    from pathlib import Path

    model = demo_models[("qwen3moe", "Q4_K_M")]
    exe = Path(sys.executable).parent / "moe-tune"
    tool = subprocess.Popen([str(exe), "bench", str(model), "-r", "1", "-p", "16", "-n", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        deadline = time.monotonic() + 60
        while server is None and time.monotonic() < deadline and tool.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                server = next((c for c in psutil.Process(tool.pid).children(recursive=True)
                               if c.name() == "llama-server"), None)
            time.sleep(0.01)
    finally:
        tool.send_signal(signal.SIGKILL)
        _, stderr = tool.communicate()
    assert server is not None, f"the bench never started llama-server: {stderr[-500:]}"
    try:
        server.wait(timeout=3)
    except psutil.TimeoutExpired:
        server.kill()
        raise AssertionError(f"llama-server pid {server.pid} outlived kill -9 of moe-tune") from None


def test_a_new_run_names_llama_processes_left_by_an_earlier_one(engine_loc, demo_models, tmp_path):
    """A llama-server an earlier moe-tune run left behind: started with the runner's environment (the owner mark)
    by a process that then exits without the death signal taking it along. Known by the mark, whoever adopts it;
    the same server started by hand (no mark) is someone else's."""
    import subprocess

    from tuner.machine import processes

    model = demo_models[("qwen3moe", "Q4_K_M")]
    argv = [*flags.server_argv(engine_loc.tool("llama-server"), LaunchConfig(model=model, ctx=256, threads=1)),
            *flags.listen_argv("127.0.0.1", runner.free_port())]
    # An earlier run: a Python process that marks its children as the runner does, starts the server in the
    # background and exits. The server outlives it, its owner gone.
    pidfile = tmp_path / "orphan.pid"
    earlier = ("import subprocess, sys\nfrom tuner.engine import runner\n"
               "p = subprocess.Popen(sys.argv[2:], env=runner._child_env(None), stdout=subprocess.DEVNULL, "
               "stderr=subprocess.DEVNULL, start_new_session=True)\nopen(sys.argv[1], 'w').write(str(p.pid))\n")
    subprocess.run([sys.executable, "-c", earlier, str(pidfile), *argv], check=True)
    pid = int(pidfile.read_text())
    hand_argv = [*flags.server_argv(engine_loc.tool("llama-server"), LaunchConfig(model=model, ctx=256, threads=1)),
                 *flags.listen_argv("127.0.0.1", runner.free_port())]
    by_hand = subprocess.Popen(hand_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={
                                   k: v for k, v in os.environ.items() if k != processes.OWNER_ENV})
    try:
        time.sleep(0.3)
        found = [p for p in processes.left_by_earlier_runs() if p.pid == pid]
        assert found and found[0].ours_earlier and "left by an earlier moe-tune run" in found[0].describe()
        assert by_hand.pid not in {p.pid for p in processes.left_by_earlier_runs()}
    finally:
        by_hand.kill()
        by_hand.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 3
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < deadline:
            time.sleep(0.05)


def test_a_stop_signal_during_a_child_start_waits_until_the_child_is_counted(monkeypatch):
    """A SIGTERM that lands while a child starts (in the fork's hooks CI once printed "Exception ignored" and a
    traceback) is raised once the child is started and counted as ours, so the stop path can stop it: here the
    signal is sent just before the real Popen forks, under the CLI's handlers."""
    import subprocess as sp

    from tuner.machine import interrupt

    real = sp.Popen
    before = runner.own_pids()

    def popen_with_a_signal(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs at once in the main thread, unless held
        return real(*a, **kw)

    monkeypatch.setattr(runner.subprocess, "Popen", popen_with_a_signal)
    started: set[int] = set()
    with interrupt.sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        try:
            runner._popen(["sleep", "30"])
        finally:
            started = set(runner.own_pids() - before)
            interrupt.handled()
    assert len(started) == 1  # the child started and was counted before the interrupt was raised
    for pid in started:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        runner._LIVE.discard(pid)
