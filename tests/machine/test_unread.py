"""Processes whose page traffic cannot be read (another user's: ``/proc/<pid>/io`` needs ptrace access; or one gone
since the listing) count as unknown, never as zero: where the machine's page-ins are more than the processes we read
account for, under memory pressure, the look says so, and a paging verdict measured beside it is not pinned on the
line (tuner.machine.books, :meth:`tuner.machine.sampler.PagingVerdict.beside`).

The process is real and reads a real file dropped from the page cache between two real looks. It is made unreadable
for real where the tests run as root (the looks are taken by a second user, who may not read root's ``io``), and by
a named fake of the one read that fails (:func:`tuner.machine.pressure.proc_text` of its ``io``) anywhere. Memory
pressure is written into the second look: a fast test cannot make the machine stall (tests/machine/test_host_paging.py
does, with a balloon)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.machine.second_user import python_for, root_only, second_user, user_env
from tuner.machine import sampler

pytestmark = pytest.mark.fast
MIB = 2**20
FILE_MIB = 64  # what the unread process reads: in a look of up to 4 s, over the 16 MiB/s bar
STALL_PCT = 5  # the memory pressure written into the second look

# Waits, reads its file once told, says so, and waits to be let go.
READER = ("import sys\nsys.stdin.readline()\nf = open(sys.argv[1], 'rb')\nwhile f.read(1 << 20):\n    pass\n"
          "print('read', flush=True)\nsys.stdin.readline()\n")

# Two looks at the machine with the reader's reading between them; the books between them, as JSON.
OBSERVER = """
import json, sys, time
from dataclasses import replace
from tuner.machine import books, pressure, processes

reader, fake = int(sys.argv[1]), sys.argv[2] == "fake"
if fake:  # a named fake: the read another user's process refuses us, /proc/<reader>/io, refused here for one pid
    real_proc_text = pressure.proc_text

    def unreadable_io(pid, name):
        if pid == reader and name == "io":
            raise PermissionError(13, "Permission denied", f"/proc/{pid}/io")
        return real_proc_text(pid, name)

    pressure.proc_text = unreadable_io
a = processes._View(())
t0 = time.monotonic()
print("looked", flush=True)
sys.stdin.readline()
time.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))  # a look of half a second, as a watch's (books.MIN_CPU_WINDOW_S)
b = processes._View(())
elapsed = time.monotonic() - t0
psi = a.look.psi or {"cpu": (0, 0), "memory": (0, 0), "io": (0, 0)}
stalled = {**psi, "memory": (psi["memory"][0] + int(float(sys.argv[3]) / 100 * elapsed * 1e6), psi["memory"][1])}
ledger = books.account(a.look, replace(b.look, psi=stalled), elapsed)
print(json.dumps({"unread": [reader in a.look.unread, reader in b.look.unread], "read": reader in b.look.others_traffic,
                  "n": ledger.unread, "unaccounted_mib": ledger.unaccounted_mib_s * elapsed, "memory": ledger.memory,
                  "pid": a.me}),
      flush=True)
"""
UNKNOWN = re.compile(r"(1 process could not be read: its|[\d,]+ processes could not be read: their) page-ins are "
                     rf"unknown \([\d,]+ MiB/s of the machine's page-ins are no readable process's; memory pressure "
                     rf"{STALL_PCT} %\)")


@pytest.fixture
def cold_file(tmp_path) -> Path:
    """Real data on disk, dropped from the page cache: reading it is real page-ins (``pgpgin``)."""
    path = tmp_path / "cold.bin"
    with path.open("wb") as f:
        for _ in range(FILE_MIB):
            f.write(os.urandom(MIB))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


@contextlib.contextmanager
def _started(argv: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A process of this test in a group of its own, waited for on the way out (its group killed where it does not
    end), and proved gone."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        yield proc
    finally:
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
        assert not psutil.pid_exists(proc.pid), f"pid {proc.pid} left running"


def _tell(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def _looked_beside_reader(cold: Path, observer: list[str], env: dict[str, str], way: str) -> dict:
    """The observer's books over the look in which the reader read ``cold``; both processes proved gone."""
    with _started([sys.executable, "-c", READER, str(cold)]) as reader:
        with _started([*observer, "-c", OBSERVER, str(reader.pid), way, str(STALL_PCT)], env) as looker:
            assert _line(looker) == "looked"
            _tell(reader)
            assert _line(reader) == "read"
            _tell(looker)
            said = json.loads(_line(looker))
        _tell(reader)
    assert not psutil.pid_exists(said["pid"])  # the looks' own process too (runuser's child)
    return said


def _assert_unknown(said: dict) -> None:
    assert said["unread"] == [True, True] and not said["read"]  # unknown in both looks, never a zero in the books
    assert said["n"] >= 1
    assert said["unaccounted_mib"] >= 0.75 * FILE_MIB, said  # what it read is what no readable process brought in
    assert said["memory"] and UNKNOWN.search(said["memory"]), said
    # A paging verdict measured beside it is theirs as well as it might be: measured again, not pinned on the line.
    paged = sampler.PagingVerdict(sampler.PagingKind.HOST_PAGING, "the engine read its model back from disk")
    theirs = paged.beside(said["memory"])
    assert theirs.beside_others and not theirs.paging
    assert UNKNOWN.search(theirs.evidence.partition("; meanwhile ")[2]), theirs.evidence


@root_only
def test_another_users_process_paging_beside_ours_is_unknown_and_said(cold_file):
    # The looks are a second user's; the reader is root's, whose /proc/<pid>/io that user may not read (EACCES).
    user = second_user().pw_name
    said = _looked_beside_reader(cold_file, ["runuser", "-u", user, "--", python_for(user)], user_env(scoped=False),
                                 "real")
    _assert_unknown(said)
    assert said["n"] > 1  # every process of root's (the reader's parent, this test, ...) is as unread


def test_a_process_whose_io_cannot_be_read_is_unknown_not_zero(cold_file):
    # Anywhere (no second user needed): the one read refused, by a named fake, for the reader alone.
    env = {k: v for k, v in os.environ.items() if k != "MOE_TUNE_MACHINE_SCOPE"}  # the whole machine, as a user's run
    said = _looked_beside_reader(cold_file, [sys.executable], env, "fake")
    _assert_unknown(said)
