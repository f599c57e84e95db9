"""Hostile shards for the pool's tests and benchmarks (tests/share/test_attacks.py, scripts/bench_lookup_rss.py), and
a command's own peak RSS, measured as a user's shell would see it."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def bomb(rows: int, row_group_rows: int, value_bytes: int, key: str, head: str) -> bytes:
    """A shard of ``rows`` rows whose record is one ``value_bytes`` string, dictionary-encoded: a few KiB of file
    that decodes to rows x value_bytes when read the plain way."""
    def same(text: str) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)), pa.array([text]))

    table = pa.table({"model_key": same(key), "head_sha256": same(head), "record_id": same("0" * 16),
                      "sharer": same("a" * 16), "vram_class_gib": pa.array(np.zeros(rows, dtype=np.int32)),
                      "engine_commit": same("0c1e570"), "record": same("x" * value_bytes)})
    sink = io.BytesIO()
    # store_schema=False: nothing in the file asks a reader for dictionaries; the plain read expands every row.
    pq.write_table(table, sink, row_group_size=row_group_rows, compression="zstd", store_schema=False)
    return sink.getvalue()


# A small process between the caller and the measured command: a child's peak RSS (wait4's ru_maxrss) counts the
# memory it had before exec, and a child forked from a test run or a benchmark that holds 1.9 GB of records starts
# with that much. This wrapper is a bare interpreter (-S, a few MiB) that forks, execs the command and reports.
_WRAPPER = ("import os, sys\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.execv(sys.argv[2], sys.argv[2:])\n"
            "_, status, usage = os.wait4(pid, 0)\n"
            "open(sys.argv[1], 'w').write(f'{usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}')\n")


@dataclass(frozen=True)
class Measured:
    returncode: int
    stdout: str
    stderr: str
    peak_rss_mib: float  # the command's own (its exec'd image and what it allocated; a few MiB of the wrapper's)
    wall_s: float


def run_measured(argv: list[str], env: dict[str, str], work: Path, timeout_s: float = 300) -> Measured:
    """``argv`` run with ``env``; its exit code, output, peak RSS and wall time (``work``: a folder for its files)."""
    report = work / "rusage"
    report.unlink(missing_ok=True)
    with open(work / "out", "w") as out, open(work / "err", "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-S", "-c", _WRAPPER, str(report), *argv], stdout=out, stderr=err,
                                env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wall = time.perf_counter() - start
    rss_kib, code = (report.read_text().split() if report.exists() else ("0", "-9"))
    return Measured(int(code), (work / "out").read_text(), (work / "err").read_text(), int(rss_kib) / 1024, wall)
