"""The measuring lock where several users and several tuners live: a lock file another user made (under
``fs.protected_regular``, systemd's default), one this user may only read, one nobody else may open; ``--allow-busy``
runs and the Python API serializing with the others; claims nesting within a thread.

The second user is real (``useradd``, then ``runuser``): these tests need root, and skip without it. The lock is
the suite's own (tests/conftest.py scopes it), so runs of other suites on this machine are not disturbed.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tuner
from tests.conftest import run_cli
from tests.machine.second_user import USER, python_for, root_only, second_user, user_env
from tuner.core.errors import MachineBusyError
from tuner.machine import quiet

PROTECTED_REGULAR = Path("/proc/sys/fs/protected_regular")

# What a run of the second user does: claim the machine (beside other load: only the lock is in question), say
# what it got, and hold it until told to let go on stdin.
HOLD = """
import sys
from tuner.core.errors import MachineBusyError
from tuner.machine import processes, quiet
try:
    with quiet.claim_machine(sys.argv[1], wait_s=float(sys.argv[2]), allow_busy=True) as c:
        print("held", c.locked, c.note, flush=True)
        sys.stdin.readline()
except MachineBusyError as exc:
    print("refused", exc, flush=True)
"""


@contextlib.contextmanager
def _as_user(command: str, wait_s: float = 0, home: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """The second user's run (a real process of that user) claiming the machine; let go when the block ends."""
    user = second_user()
    home_env = [f"HOME={home}"] if home else []  # runuser sets the user's own HOME
    proc = subprocess.Popen(["runuser", "-u", user.pw_name, "--", "env", *home_env, python_for(user.pw_name), "-c",
                             HOLD, command, str(wait_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=user_env())
    try:
        yield proc
    finally:
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def _said(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


@contextlib.contextmanager
def _protected_regular() -> Iterator[None]:
    """``fs.protected_regular=1`` for the block, restored after (skip where it cannot be set)."""
    try:
        before = PROTECTED_REGULAR.read_text().strip()
        PROTECTED_REGULAR.write_text("1")
    except OSError as exc:
        pytest.skip(f"fs.protected_regular cannot be set here ({exc})")
    try:
        yield
    finally:
        PROTECTED_REGULAR.write_text(before)


@pytest.fixture
def lock_file() -> Iterator[Path]:
    path = quiet.lock_path()
    path.unlink(missing_ok=True)
    yield path
    path.unlink(missing_ok=True)


@root_only
def test_a_lock_file_another_user_made_serves_both_users_under_protected_regular(lock_file):
    with _protected_regular():
        with _as_user("auto-tune") as theirs:
            assert _said(theirs) == "held True None"
            st = lock_file.stat()
            assert st.st_uid == second_user().pw_uid and st.st_mode & 0o777 == 0o666  # theirs, usable by all
            # Root opening it with O_CREAT is refused here (EACCES): the run must open it as it is, and wait.
            with pytest.raises(MachineBusyError, match=r"moe-tune auto-tune \(pid \d+\) is measuring"), \
                    quiet.claim_machine("bench", wait_s=1.0):
                pass
        with quiet.claim_machine("bench", wait_s=0) as ours:  # their run ended: ours goes, on the same file
            assert ours.locked and ours.note is None and lock_file.stat().st_uid == second_user().pw_uid
            with _as_user("bench", wait_s=1.0) as second:  # and theirs waits for ours
                said = _said(second)
                assert said.startswith("refused") and f"moe-tune bench (pid {os.getpid()}) is measuring" in said


@root_only
def test_a_lock_file_the_user_may_only_read_still_serializes(lock_file):
    lock_file.write_text("")
    lock_file.chmod(0o644)  # root's, not writable by the second user: flock needs only a read-only descriptor
    with _protected_regular():
        with _as_user("auto-tune") as theirs:
            assert _said(theirs) == "held True None"
            # It could not write its name: who holds the lock is read from /proc/locks.
            with pytest.raises(MachineBusyError, match=rf"a moe-tune run of user {USER} \(pid \d+\) is measuring"), \
                    quiet.claim_machine("bench", wait_s=0.6):
                pass
        with quiet.claim_machine("bench", wait_s=0), _as_user("bench", wait_s=0.6) as second:
            assert _said(second).startswith(f"refused the machine is busy (moe-tune bench (pid {os.getpid()})")


@root_only
def test_a_lock_file_nobody_else_may_open_falls_back_to_the_users_own_and_says_so(lock_file):
    lock_file.write_text("")
    lock_file.chmod(0o600)
    home = Path(tempfile.mkdtemp(prefix="moe-tune-2nd-home-", dir="/tmp"))  # the suite's tmp_path is root's alone
    try:
        shutil.chown(home, second_user().pw_uid, second_user().pw_gid)
        with _as_user("bench", home=home) as theirs:
            said = _said(theirs)
            assert said.startswith(f"held True {lock_file} cannot be opened (Permission denied): this run waits "
                                   "only for your own runs, not other users'"), said
            assert f"chmod 666 {lock_file}" in said
            assert (home / ".cache" / "moe-tune" / lock_file.name).is_file()
            with quiet.claim_machine("bench", wait_s=0) as ours:  # the machine's lock is free: as it said
                assert ours.locked and ours.note is None
    finally:
        shutil.rmtree(home)


@root_only
def test_bench_runs_as_root_on_a_lock_file_another_user_made(lock_file, demo_models):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    with _as_user("auto-tune") as theirs:
        assert _said(theirs) == "held True None"
    assert lock_file.stat().st_uid == second_user().pw_uid
    with _protected_regular():
        res = run_cli("bench", str(model), "--no-server", "-r", "1", "-p", "8", "-n", "8", "--busy-wait", "30s")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "cannot be opened" not in res.stderr, res.stderr  # the machine's lock, not a fallback


def _claim_elsewhere(home: Path) -> subprocess.CompletedProcess[str]:
    """A run of another user (root's tests) or of this one claiming the machine, let go at once; killed after 30 s,
    so a claim that waits on what sits at the lock path fails the test instead of hanging it."""
    as_user = (["runuser", "-u", second_user().pw_name, "--"] if os.geteuid() == 0 else [])
    shutil.chown(home, *((second_user().pw_uid, second_user().pw_gid) if as_user else (os.getuid(), os.getgid())))
    python = python_for(second_user().pw_name) if as_user else sys.executable
    argv = [*as_user, "env", f"HOME={home}", "XDG_RUNTIME_DIR=", python, "-c", HOLD, "bench", "0"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=user_env(), start_new_session=True)
    try:
        out, err = proc.communicate(input="\n", timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: runuser's child too, or it waits in open() forever
        proc.communicate()
        raise AssertionError("the claim hung on what sits at the lock path") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_a_fifo_at_the_lock_path_is_one_line_never_a_hang(lock_file):
    """Another user's FIFO where the lock goes: a claim that may only read it (not root, which opens it
    read-write) would wait in open() for a writer, forever, before saying anything."""
    os.mkfifo(lock_file, 0o444)
    home = Path(tempfile.mkdtemp(prefix="moe-tune-2nd-home-", dir="/tmp"))
    try:
        ran = _claim_elsewhere(home)
        owner = pwd.getpwuid(os.getuid()).pw_name
        assert ran.returncode == 0 and ran.stdout.strip() == (
            f"held True {lock_file} is a FIFO, not a regular file, owned by user {owner}: this run waits only for "
            f"your own runs, not other users'; remove it (rm {lock_file}) so every user's runs wait for each other")
        with quiet.claim_machine("bench", wait_s=0) as ours:  # root too refuses it, in the same words
            assert ours.locked and ours.note is not None and ours.note.startswith(f"{lock_file} is a FIFO, not a "
                                                                                  "regular file")
    finally:
        shutil.rmtree(home)


def test_a_symlink_at_the_lock_path_is_refused_in_one_line(lock_file, tmp_path):
    target = tmp_path / "elsewhere.lock"
    target.write_text("")
    lock_file.symlink_to(target)  # e.g. to a file of someone else's that flock would then hold
    with quiet.claim_machine("bench", wait_s=0) as ours:
        assert ours.locked and ours.note is not None
        assert ours.note.startswith(f"{lock_file} is a symbolic link, not a regular file, owned by user "), ours.note
        assert "\n" not in ours.note and f"remove it (rm {lock_file})" in ours.note
    assert target.read_text() == ""  # nothing was written through it


def _hold_in_another_process(hold_s: float) -> subprocess.Popen[str]:
    """Another measuring run (this user's): it holds the machine for ``hold_s`` once it says "held"."""
    code = ("import sys, time\nfrom tuner.machine import quiet\n"
            "with quiet.claim_machine('auto-tune', allow_busy=True):\n"
            "    print('held', flush=True)\n    time.sleep(float(sys.argv[1]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(hold_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_allow_busy_waits_for_another_measuring_run_and_then_measures(demo_models):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    quick = ("bench", str(model), "--no-server", "-r", "1", "-p", "8", "-n", "8", "--allow-busy")
    other = _hold_in_another_process(60)
    try:
        refused = run_cli(*quick, "--busy-wait", "2s")
        assert refused.returncode == 1, refused.stderr
        assert "is measuring" in refused.stderr and "--allow-busy or not" in refused.stderr, refused.stderr
    finally:
        other.kill()
        other.wait()
    other = _hold_in_another_process(6)
    t0 = time.monotonic()
    waited = run_cli(*quick, "--busy-wait", "2m")
    took_s = time.monotonic() - t0
    other.wait(timeout=30)
    assert waited.returncode == 0, waited.stderr
    assert waited.stderr.startswith("waiting for moe-tune auto-tune (pid"), waited.stderr  # it waited its turn
    assert "the machine is ours after" in waited.stderr and took_s >= 4, (took_s, waited.stderr)


def test_the_python_api_holds_the_lock_and_nests_in_a_held_machine(demo_models, engine_loc):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    for name in tuner.MEASURING:
        assert hasattr(getattr(tuner, name), "__wrapped__"), name  # every measuring entry point is wrapped
    seen: list[str] = []
    done = threading.Event()

    def look() -> None:  # another process tries to claim while the API call measures
        code = ("from tuner.machine import quiet\nfrom tuner.core.errors import MachineBusyError\n"
                "try:\n    with quiet.claim_machine('bench', wait_s=0, allow_busy=True): print('free')\n"
                "except MachineBusyError as exc: print(exc)\n")
        while not done.is_set():
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
            seen.append(out.stdout.strip())

    checker = threading.Thread(target=look)
    cfg = tuner.LaunchConfig(model=model, ctx=256, threads=1)
    load = tuner.Workload(tuner.WorkloadKind.CUSTOM, 16, 256, rounds=1)
    checker.start()
    try:
        time.sleep(0.2)
        report = tuner.bench(engine_loc, cfg, load, server=False, repetitions=3)
    finally:
        done.set()
        checker.join(timeout=60)
    assert report is not None and seen, seen
    assert any("bench (Python API) (pid" in s and "is measuring" in s for s in seen), seen
    with tuner.hold_machine("a sweep", wait_s=0, allow_busy=True) as held:  # a script holding it: the call nests
        assert held.locked
        assert tuner.bench(engine_loc, cfg, load, server=False, repetitions=1) is not None
