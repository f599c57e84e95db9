"""The GPU lease rehearsed here, on a machine with no GPU: both commands of the first lease as `scripts/gpu_check
--dry-run` plans them, each run as the lease would run it and stopped at its first CUDA call (``--rehearse``), with
NVML answered by the tests' FAKE driver (tests/standin/pynvml.py: an H100 80GB, compute capability 9.0, driver 580).

    flock /tmp/moe-tune-dev-cpu.lock .venv/bin/python scripts/rehearse_lease.py

What it runs: the packs (``--pack`` with the trimmed source and the wheels, ``--pack-ik``), each engine's slot in
them filled by this machine's CPU build as a stand-in (``--stand-in``: the CUDA builds take 30-90 CPU-minutes here and
are not built for a rehearsal); then command 1 (gpu-info, wheels, engine, model-valid, up to the search's VRAM
ballast) and command 2 (``--start-at ik-engine``: ik's engine, the race's plan, up to its ballast). It writes
results/benchmarks/gpu-lease-rehearsal.md: each step's seconds here beside the plan's estimate, where each command
stopped and why, the carries' sizes, and which steps need the CUDA builds. The rehearsal's cache, model (17 GiB of
valid weights) and packs live in a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from harness import OUT, Log  # noqa: E402

from tuner.engine import build  # noqa: E402
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP  # noqa: E402
from tuner.machine import paths  # noqa: E402

GPU_CHECK = REPO / "scripts" / "gpu_check"
STATE = "results/benchmarks/gpu-nvidia-h100-80gb-hbm3.json"  # what the next lease starts from
# An H100 80GB HBM3 as lease 2's NVML saw it (81,559 MiB, driver 580.159.04), nothing else on it.
CARD = {"cards": [["NVIDIA H100 80GB HBM3", 81559 * 2**20, 0]], "graphics": [], "driver": "580.159.04",
        "compute_capability": [9, 0], "util_pct": 0}


def _size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def _run(argv: list[str], env: dict[str, str], log: Log, label: str) -> tuple[int, float, str]:
    log(f"$ {' '.join(argv)}")
    t0 = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    took = time.monotonic() - t0
    out = (res.stdout + res.stderr).rstrip()
    for line in out.splitlines():
        log(f"  {line}")
    log(f"  [{label}: exit {res.returncode}, {took:.1f} s]")
    return res.returncode, took, out


def _state(out: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((out / "state.json").read_text())
    return state


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one, removed)")
    args = p.parse_args()
    log = Log()
    llama = build.managed_builds(LLAMA_CPP)
    ik = build.managed_builds(IK_LLAMA)
    if not llama or not ik:
        raise SystemExit("needs both CPU engines here as stand-ins: make setup && moe-tune engine install --engine ik")
    sdist = paths.engine_root() / "src" / build.PIN.sdist_name
    work = args.keep or Path(tempfile.mkdtemp(prefix="lease-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    scenario = work / "nvml-h100.json"
    scenario.write_text(json.dumps(CARD))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "standin"), str(REPO)]),
               MOE_TUNE_FAKE_NVML=str(scenario), MOE_TUNE_CACHE=str(work / "cache"))
    pack, pack_ik, out, back = work / ".gpu-pack", work / ".gpu-pack-ik", work / "out", work / "OUT"
    started = time.monotonic()
    try:
        log(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; NVML: the FAKE driver of "
            f"tests/standin (an {CARD['cards'][0][0]}, cc 9.0); stand-ins for the CUDA engines: {llama[0].parent.name}"
            f", {ik[0].parent.name}")
        log("this rehearsal will spend: the packs (~1 min: the source trimmed, the wheels fetched), command 1 "
            "(~1-2 min here: 17 GiB of valid weights written on 2 cores), command 2 (~30 s); the lease's own figures "
            "are the plan's")
        log()
        _run([str(GPU_CHECK), "--pack", str(pack), "--sdist", str(sdist), "--engine", "90", "--engine-dir",
              str(llama[0]), "--stand-in"], env, log, "pack")
        _run([str(GPU_CHECK), "--pack-ik", str(pack_ik), "--engine", "90", "--engine-dir", str(ik[0]), "--stand-in"],
             env, log, "pack-ik")
        log(f"carries: {pack.name} {_size_mib(pack):.1f} MiB (its engine a CPU stand-in; lease 1's CUDA engine packed "
            f"to 42.2 MiB), {pack_ik.name} {_size_mib(pack_ik):.1f} MiB (a CPU stand-in; ik's CUDA engine not built)")
        log()
        common = ["--from", str(pack), "--ik-from", str(pack_ik), "--out", str(out), "--copy-to", str(back)]
        plan_text = _run([str(GPU_CHECK), "--dry-run", *common, "--state", STATE], env, log, "dry-run")[2]
        log()
        _run([str(GPU_CHECK), *common, "--state", STATE, "--time-limit", "540", "--rehearse"], env, log, "command 1")
        log()
        _run([str(GPU_CHECK), *common, "--time-limit", "260", "--rehearse", "--start-at", "ik-engine"], env, log,
             "command 2")
        log()
        state = _state(out)
        carried = json.loads((REPO / STATE).read_text())["state"]["steps"]
        step_line = re.compile(r"^  (?:\([a-e]\) | {4})(\S+) +~ *(\d+) s ", re.M)
        planned = {m.group(1): float(m.group(2)) for m in step_line.finditer(plan_text.split("later leases")[0])}
        log("steps this rehearsal ran (seconds here, on 2 cores, beside the plan's estimate for the lease's machine):")
        for name, step in state["steps"].items():
            if name in carried and carried[name] == step:
                continue  # lease 2's, carried in the state
            res = step.get("result") or {}
            extra = f"; {res['stand_in']}" if res.get("stand_in") else ""
            note = step.get("note") or ""
            if "is not a supported wheel on this platform" in note:
                note = ("the pack's wheels are for the GPU image's CPython 3.12 and this machine runs "
                        f"{sys.version_info.major}.{sys.version_info.minor}: not rehearsable here (lease 2: 1.8 s)")
            est = f"~{planned[name]:.0f} s planned" if name in planned else "not in the plan's commands"
            log(f"  {name:16s} {step.get('status'):6s} {step.get('took_s', 0):6.1f} s ({est}){extra}"
                + (f"; {note[:240]}" if note else ""))
        for stop in state.get("rehearsal", []):
            log(f"  stopped in {stop['step']} after {stop['step_ran_s']} s of it: the lease's first CUDA call there is "
                f"{stop['first_cuda_call']}")
        log("needs the CUDA builds (not built for a rehearsal: 30-90 CPU-minutes on these 2 cores): the engine and "
            "ik-engine steps' first CUDA call (each restored build's first run on the card) and everything after each "
            "command's stop above; the restore itself, the packs' parts and identities were rehearsed with the CPU "
            "stand-ins")
        log(f"rehearsal wall time: {time.monotonic() - started:.0f} s")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    log.write(OUT / "gpu-lease-rehearsal.md", "The first GPU lease rehearsed on a machine without a GPU",
              __doc__.split("\n\n", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
