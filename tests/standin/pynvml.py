"""A FAKE ``pynvml`` (named as a fake; the NVML boundary only): put ``tests/standin`` first on PYTHONPATH and a
scenario file in ``MOE_TUNE_FAKE_NVML``, and a ``moe-tune`` command run as a user runs it sees that machine's
NVIDIA driver instead of this one's (which has none). Scenarios are written by :mod:`tests.desktop`.

The scenario is JSON: ``cards`` ([name, total bytes, used bytes]), ``graphics`` and ``processes`` ([pid, used
bytes]: graphics and compute contexts), ``util_pct``, ``process_sm`` ({pid: SM %} or null: not supported) and
``grow`` ([pid, bytes per second]: that process's VRAM grows from ``t0``, a wall-clock time), ``sample_lag_s``
(per-process samples stamped that long ago) and ``lost`` (every query after init fails with that message).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.fakes

from tests.fakes import FakeNVML, FakeNVMLError  # noqa: E402

NVMLError = FakeNVMLError
NVML_CLOCK_MEM = 2


def _machine() -> FakeNVML:
    data = json.loads(Path(os.environ["MOE_TUNE_FAKE_NVML"]).read_text())
    procs = [tuple(p) for p in data.get("processes", [])]
    if data.get("grow"):
        pid, per_s = data["grow"]
        grown = int(per_s * max(0.0, time.time() - data["t0"]))
        procs = [(p, used + grown if p == pid else used) for p, used in procs]
    sm = data.get("process_sm")
    per_process = None if sm is None else {int(k): v for k, v in sm.items()}
    return FakeNVML([tuple(c) for c in data["cards"]], driver=data.get("driver", "570.86.10"),
                    processes=procs, graphics=[tuple(p) for p in data.get("graphics", [])],
                    util_pct=data.get("util_pct"), process_sm=per_process,
                    compute_capability=tuple(data.get("compute_capability", (8, 6))),
                    sample_lag_s=float(data.get("sample_lag_s", 0.0)), lost=data.get("lost"))


_current: FakeNVML | None = None


def nvmlInit() -> None:  # noqa: N802
    global _current
    _current = _machine()
    _current.nvmlInit()


def __getattr__(name: str):  # every other NVML call goes to the machine read at nvmlInit
    if name.startswith("nvml") and _current is not None:
        return getattr(_current, name)
    raise AttributeError(name)
