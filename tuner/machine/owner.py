"""Whose a process is, by the marker moe-tune leaves in its children's environment: every child the runner starts
carries ``MOE_TUNE_OWNER=<pid>:<start time>`` (readable from /proc by the same user; pids are reused, so the start
time goes with it). A llama.cpp process whose owner is gone was left by an earlier run (:mod:`tuner.machine.processes`);
a moe-tune command whose parent set the marker to its own is waited on by it (:func:`waiting_owner`)."""

from __future__ import annotations

import os

import psutil

OWNER_ENV = "MOE_TUNE_OWNER"


def owner_marker() -> str:
    """The value of ``MOE_TUNE_OWNER`` for children of this process: its pid and start time (pids are reused)."""
    me = psutil.Process()
    return f"{me.pid}:{me.create_time():.2f}"


def owner_gone(marker: str) -> bool:
    """Is the process a marker names gone (its pid free, or taken by a later process)?"""
    pid_text, _, started = marker.partition(":")
    if not pid_text.isdigit():
        return False
    try:
        return f"{psutil.Process(int(pid_text)).create_time():.2f}" != started
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def waiting_owner() -> int | None:
    """The process that started this one and waits on it, where it says so: a parent that set ``MOE_TUNE_OWNER`` to
    its own marker (:func:`owner_marker`) in this process's environment, as a benchmark harness running a moe-tune
    command does. Its own CPU and page-ins are this run's (the harness's own watch polling /proc beside the command
    once made 4 of an agent race's rounds "busy"); its other children are not, whether they run or it has reaped
    them (:meth:`tuner.machine.processes._View.ours_cpu_s`). None where no such parent is alive."""
    marker = os.environ.get(OWNER_ENV, "")
    pid_text = marker.partition(":")[0]
    if not pid_text.isdigit() or int(pid_text) != os.getppid() or owner_gone(marker):
        return None
    return int(pid_text)
