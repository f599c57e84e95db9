"""The state of one `scripts/gpu_check` run (options, OUT folder, state file, engine and model once known), in a
module of its own so that the steps and the driver both use it and neither imports the other's."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tuner.engine import runner
from tuner.machine import ballast

REPO = Path(__file__).resolve().parents[2]
FIRST_BUDGET_GIB = 12  # (a) of the first lease: a 12 GB card's worth of free VRAM
ENGINE_CMDS = {"auto-tune", "bench"}  # moe-tune commands that take --llama-cpp-dir
RESUMABLE_MIN_S = 60.0  # a step that goes on where it stopped (the build) starts with at least this much left
# Steps whose figures are speeds: measured again when the state's model had zero weights.
SPEED_STEP_PREFIXES = ("tune-", "budget-", "long-", "opoff-", "search-", "versus-")
STOP_MARGIN_S = 15.0  # a step that measures in rounds stops this long before the time limit, to copy out


class RehearsalStop(Exception):
    """A rehearsal (``--rehearse``) reached the lease's first CUDA call, or a step that needs a CUDA build it does not
    have: the command ends there, saying which."""


class Check:
    """The state of one check run: options, OUT folder, state file, engine and model once known."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out or REPO / "results" / "gpu-check"
        self.gpu_reason = ballast.gpu_missing_reason()  # None: a GPU is here
        self.has_gpu = self.gpu_reason is None
        self.state_path = self.out / "state.json"
        self.state: dict[str, Any] = {"steps": {}, "machine": {}}
        source = self.state_path if self.state_path.is_file() else args.state
        if source is not None and source.is_file():
            raw = json.loads(source.read_text())
            self.state = raw.get("state", raw)  # a gpu-<card>.json that came back holds the state inside
            if source == args.state:  # another lease's machine: this one's card is asked again
                self.state["steps"].pop("gpu-info", None)
                self._again(args.again)
                self._zero_weight_speed_again()
            self._forget_what_is_not_here()
        self.state["command"] = "scripts/gpu_check " + shlex.join(sys.argv[1:])
        self.started = time.monotonic()
        self.packing: threading.Thread | None = None
        self.planning = False  # the dry run: the lease as it is to be run (its engine carried)
        # A rehearsal on a machine without a GPU (NVML answered by a stand-in): each command runs as the lease would
        # and stops at its first CUDA call (``cuda_call``), which it cannot make.
        self.rehearsing = bool(getattr(args, "rehearse", False))

    def _again(self, names: tuple[str, ...]) -> None:
        """Steps a new lease measures again (after a fix): their earlier results move to ``earlier``, kept in the
        state. Only a lease that starts from ``--state`` does this, so the second command of one lease, which
        continues from the state in --out, does not measure them a third time."""
        earlier = self.state.setdefault("earlier", {})
        for name in names:
            if name in self.state["steps"]:
                earlier.setdefault(name, []).append(self.state["steps"].pop(name))

    def _zero_weight_speed_again(self) -> None:
        """Speed steps not measured on valid weights (lease 2's, on a zero-filled model whose router tied, so every
        prompt with host experts was optimistic) are measured again; their results move to ``earlier``."""
        earlier = self.state.setdefault("earlier", {})
        for name, step in list(self.state["steps"].items()):
            if name.startswith(SPEED_STEP_PREFIXES) and (step.get("result") or {}).get("model_weights") != "direct":
                earlier.setdefault(name, []).append(self.state["steps"].pop(name))

    def _forget_what_is_not_here(self) -> None:
        """A state carried from another machine (a fresh, bare one): its wheels, engine and model are not here,
        so those steps run again; measured steps stay done."""
        steps = self.state["steps"]
        checks = {"wheels": lambda r: (self.out / "site").is_dir() or not r.get("installed"),
                  "engine": lambda r: Path(r.get("bin", "/nonexistent")).is_dir(),
                  "ik-engine": lambda r: Path(r.get("bin", "/nonexistent")).is_dir(),
                  "model": lambda r: Path(r.get("path", "/nonexistent")).is_file(),
                  "model-valid": lambda r: Path(r.get("path", "/nonexistent")).is_file(),
                  "gpu-info": lambda r: True}
        for name, here in checks.items():
            if name in steps and not here(steps[name].get("result") or {}):
                del steps[name]

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2, default=str) + "\n")
        tmp.replace(self.state_path)

    def deadline_s(self) -> float:
        """The monotonic time by which a step that measures in rounds stops, keeping what it measured."""
        return self.started + self.args.time_limit - STOP_MARGIN_S

    def left_s(self) -> float:
        """Seconds left of --time-limit in this run (children get no more, so none outlives the command)."""
        return max(30.0, self.args.time_limit - (time.monotonic() - self.started))

    def cuda_call(self, what: str) -> None:
        """Where a step makes its first CUDA call (a CUDA build's first run, the ballast's cudaMalloc): a rehearsal
        stops here, naming it; a lease goes on."""
        if self.rehearsing:
            raise RehearsalStop(what)

    def result(self, name: str) -> dict[str, Any]:
        return (self.state["steps"].get(name) or {}).get("result") or {}

    @property
    def engine_dir(self) -> Path | None:
        found = self.result("engine").get("bin")
        return Path(found) if found else None

    @property
    def model_path(self) -> Path:
        return Path(self.result("model")["path"])

    @property
    def budget_mib(self) -> int:
        return FIRST_BUDGET_GIB * 1024

    def cli(self, *argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        """One `moe-tune` command (the CLI is the stable contract), its --json output parsed."""
        extra = ["--llama-cpp-dir", str(self.engine_dir)] if self.engine_dir and argv[0] in ENGINE_CMDS else []
        res = runner.run_process([sys.executable, "-m", "tuner.cli", *argv, *extra, "--json"], timeout_s=self.left_s(),
                                 what=f"moe-tune {argv[0]}", fix="see the step's note", env=env, cwd=REPO)
        return json.loads(res.stdout)

    def log(self, text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)
