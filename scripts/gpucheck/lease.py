"""How `scripts/gpu_check`'s steps fall into the commands of a GPU lease, on their estimates.

A lease is 15 minutes of device time with everything counted: the machine's start (1 to 2 minutes), each
command (at most 10 minutes; planned at 9), the transfers around it and any idle wait. What is left after the
start is shared by two back-to-back commands; each command stops itself before a step that would not finish
inside its ``--time-limit`` and the next one continues from the state file. Steps are ordered by what answers
the project's questions soonest: (b) the tuner's line vs llama.cpp's default on agent turns first, then (e)
ik_llama.cpp against llama.cpp on the card, then (d), (a), (c); whatever does not fit the first lease is planned for
the next, which starts from the state that came back (a measured build time replaces its estimate).

Each device call carries at most 64 MiB beside the working tree, and a warm machine keeps what earlier calls left
there: a step that needs another carry (ik_llama.cpp's engine, packed apart from llama.cpp's) opens a command of its
own, whose call carries that folder alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

LEASE_S = 900.0  # device time of one lease: 15 minutes, start, commands, transfers and idle together
START_S = 120.0  # a fresh machine's start: 1 to 2 minutes; planned at the longer
TRANSFER_S = 10.0  # per command: the working tree there, $OUT back
COMMAND_MAX_S = 540.0  # one command: 9 minutes, a minute under the device's 10 to stop and copy out in
COMMANDS = 2  # back-to-back commands per lease
TIMEOUT_MARGIN_S = 40.0  # the device call's timeout_s above the command's own --time-limit

# What each question is, as the dry run and the table name it.
PARTS = {"a": "memory model vs llama.cpp's CUDA breakdown", "b": "tuned vs llama.cpp's default (valid weights)",
         "c": "induced spill classified", "d": "op offload on vs off on an agent turn",
         "e": "ik_llama.cpp vs llama.cpp on the card, experts in RAM"}
MAIN_CARRY = ".gpu-pack"  # llama.cpp's engine, its trimmed source and the wheels (scripts/gpu_check --pack)


@dataclass(frozen=True, slots=True)
class Planned:
    name: str
    est_s: float
    what: str
    part: str = ""  # "a", "b", "c" or "" (a step the answers need: info, wheels, engine, model)
    resumable: bool = False  # cut by a command's limit, the next command goes on from where it stopped (the build)
    carry: str = ""  # a carry folder of its own: the step opens a command whose device call carries that folder


@dataclass(frozen=True, slots=True)
class Command:
    limit_s: float  # the command's --time-limit
    steps: tuple[Planned, ...]

    @property
    def est_s(self) -> float:
        return sum(s.est_s for s in self.steps)

    @property
    def carry(self) -> str:
        """What its device call carries: the folder its first step asks for, else the main pack."""
        return self.steps[0].carry or MAIN_CARRY if self.steps else MAIN_CARRY


@dataclass(frozen=True, slots=True)
class LeasePlan:
    commands: tuple[Command, ...]
    later: tuple[Planned, ...]  # for the next leases
    lease_s: float = LEASE_S
    start_s: float = START_S
    transfer_s: float = TRANSFER_S
    parts_first: tuple[str, ...] = field(default=())

    @property
    def est_s(self) -> float:
        """The first lease on the estimates: start, commands and transfers."""
        return self.start_s + sum(c.est_s + self.transfer_s for c in self.commands)


def plan(steps: Sequence[Planned], *, lease_s: float = LEASE_S, start_s: float = START_S,
         transfer_s: float = TRANSFER_S, command_max_s: float = COMMAND_MAX_S, commands: int = COMMANDS
         ) -> LeasePlan:
    """Steps in order into the first lease's commands: each command takes the next steps while their estimates
    fit its limit, and the commands' limits share what the lease leaves after the start and the transfers.
    The first step that fits no command, and all after it, go to later leases (the order is kept). A step with a carry
    of its own opens a command (and a command's last step is before it)."""
    left = lease_s - start_s - commands * transfer_s
    out: list[Command] = []
    todo = list(steps)
    for _ in range(commands):
        limit = min(command_max_s, left)  # the command's --time-limit: what is left of the lease, at most 9 min
        taken: list[Planned] = []
        while todo and sum(s.est_s for s in taken) + todo[0].est_s <= limit and not (taken and todo[0].carry):
            taken.append(todo.pop(0))
        room = limit - sum(s.est_s for s in taken)
        if todo and todo[0].resumable and room >= 1 and not (taken and todo[0].carry):  # the part that fits now
            head = todo.pop(0)
            taken.append(Planned(head.name, room, head.what, head.part, True, head.carry))
            todo.insert(0, Planned(head.name, head.est_s - room, "(continued) " + head.what.removeprefix(
                "(continued) "), head.part, True))
        if not taken:
            break
        out.append(Command(round(limit), tuple(taken)))
        left -= sum(s.est_s for s in taken)  # on the estimates; the next command's limit is what they leave
    parts = tuple(sorted({s.part for c in out for s in c.steps if s.part}))
    return LeasePlan(tuple(out), tuple(todo), lease_s, start_s, transfer_s, parts)


def render(p: LeasePlan, command_line: str, done_parts: Sequence[str] = ()) -> str:
    """The dry run: per command its steps, each with its estimate and the running total, then the lease.
    ``done_parts``: questions an earlier lease answered (the state it brought back)."""
    lines = [f"first lease ({p.lease_s / 60:.0f} min of device time: a start of ~{p.start_s:.0f} s, then "
             f"{len(p.commands)} back-to-back commands and ~{p.transfer_s:.0f} s of transfers each):"]
    for n, cmd in enumerate(p.commands, 1):
        kept = "" if n == 1 else ("; the warm machine keeps what the commands before it left (wheels, engine, model, "
                                  "state)")
        lines.append(f"command {n}: {command_line} --time-limit {cmd.limit_s:.0f}   "
                     f"(device timeout_s {min(600, cmd.limit_s + TIMEOUT_MARGIN_S):.0f}; carry {cmd.carry}{kept})")
        total = 0.0
        for s in cmd.steps:
            total += s.est_s
            tag = f"({s.part}) " if s.part else "    "
            lines.append(f"  {tag}{s.name:18s} ~{s.est_s:4.0f} s  {total:4.0f} s  {s.what}")
        lines.append(f"  = ~{cmd.est_s:.0f} s of its {cmd.limit_s:.0f} s")
    if len(p.commands) > 1:
        lines.append("(a command that ran longer than planned leaves the next less: give that one status's "
                     f"budget_left_s - {TIMEOUT_MARGIN_S + p.transfer_s:.0f} s as --time-limit)")
    missing = [k for k in PARTS if k not in p.parts_first and k not in done_parts]
    reach = ", ".join(f"({k}) {PARTS[k]}" + (" (done earlier)" if k in done_parts and k not in p.parts_first else "")
                      for k in PARTS if k in p.parts_first or k in done_parts) or "none of (a)-(c)"
    lines.append(f"first lease on the estimates: ~{p.est_s:.0f} s of {p.lease_s:.0f} s; reaches {reach}"
                 + (f"; NOT {', '.join(f'({k})' for k in missing)}" if missing else ""))
    if p.later:
        lines.append("later leases (each starts from the state that came back; done steps are not run again):")
        lines += [f"  {'(' + s.part + ') ' if s.part else '    '}{s.name:18s} ~{s.est_s:4.0f} s  {s.what}"
                  for s in p.later]
    return "\n".join(lines) + "\n"
