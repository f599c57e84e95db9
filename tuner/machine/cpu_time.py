"""The whole machine's CPU time by kind, from /proc/stat (through psutil): the work done in processes' context,
and the time that is no program's work on this machine.

/proc/stat's ``cpu`` line has, in order (``man 5 proc``): user, nice, system, idle, iowait, irq ("time servicing
interrupts"), softirq ("time servicing softirqs"), steal ("stolen time, which is the time spent in other operating
systems when running in a virtualized environment"), guest and guest_nice ("time spent running a virtual CPU for
guest operating systems", already inside user and nice). A program's work is user + nice + system: the same kinds
its own utime and stime add up to, so the machine's sum minus our process tree's is others' work.

The rest is measured and said, never counted as another program's:

- ``steal``: the hypervisor withholding a vCPU that had work to run. A guest that keeps every vCPU busy (llama-server
  with ``-t`` set to the vCPU count) gets it, and with steal accounting the kernel takes it out of the running
  process's utime/stime. Counted as work, it read as others' on a VM with nothing else running: on a 16-vCPU H100
  VM nearly every round that kept all 16 busy was "disturbed by 0.6-2.2 cores", so the tune decided nothing.
- ``irq`` and ``softirq``: interrupts are served on whichever core they arrive, for whoever caused them: our own
  GPU's, disk's and loopback HTTP traffic among them.

Steal slows the rounds it falls in: what varies from round to round shows in the rounds' spread, which the
decision rule already judges, and what is steady slows every config alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True, slots=True)
class CpuTime:
    """CPU seconds summed over every core since boot (or, as a difference, over a look)."""

    work_s: float  # user + nice + system: work done in some process's context
    steal_s: float  # the hypervisor ran something else while a vCPU had work
    interrupts_s: float  # irq + softirq

    def __sub__(self, earlier: CpuTime) -> CpuTime:
        return CpuTime(self.work_s - earlier.work_s, self.steal_s - earlier.steal_s,
                       self.interrupts_s - earlier.interrupts_s)


def read() -> CpuTime:
    """The machine's CPU time so far (psutil leaves out the columns a kernel does not have: they read as 0)."""
    t = psutil.cpu_times()
    return CpuTime(t.user + getattr(t, "nice", 0.0) + t.system, getattr(t, "steal", 0.0),
                   getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))
