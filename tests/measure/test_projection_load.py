"""How many llama-fit-params projections a prefetch runs at once (tuner/measure/projection_load.py): on a card, as
many as their CUDA contexts fit in the free VRAM less the margin, each context read per process through NVML or, where
NVML attributes none, planned; a CPU build keeps all cores at a time (issue 58).

The projections are the real pinned llama-fit-params, behind a shim that notes how many run when each starts (and
lingers half a second, so that those allowed at once do overlap). This machine has no GPU: the card is a FAKE NVML (the
hardware boundary), whose every running llama-fit-params holds a context of the size the test gives, as a CUDA
build's does; the build is named a CUDA one (an identity), so the prefetch plans for a card."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tests.fakes import FakeNVML
from tuner.catalog.cards import find_card
from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.engine import build
from tuner.engine.identity import EngineIdentity
from tuner.machine import hardware
from tuner.measure import projection_load
from tuner.measure.engine_memory import EngineMemory
from tuner.measure.projection_load import PLANNED_CONTEXT_BYTES, ProjectionLoad, jobs_on_card
from tuner.models import demo_model, gguf_reader
from tuner.plan.memory import FIT_MARGIN_BYTES

MIB, GIB = 2**20, 2**30
CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * GIB, 64 * GIB, 0, 20e9, 8, "none")
ROOM = 1000 * MIB  # what the fake card leaves free beyond llama.cpp's 1 GiB margin

COUNTING = """#!/bin/sh
# the pinned llama-fit-params, noting how many projections run as this one starts
touch "{dir}/running/$$"
ls "{dir}/running" | wc -l >> "{dir}/at-start"
sleep 0.5
"{real}" "$@"
rc=$?
rm -f "{dir}/running/$$"
exit $rc
"""


def test_jobs_on_a_card_are_what_its_room_holds_at_most_a_core_each_and_at_least_one():
    """The arithmetic, with the contexts published for two cards (llama.cpp PR 23604): a 12 GB desktop card with
    10 GiB free keeps 9 GiB beside the 1 GiB margin."""
    room = 9 * GIB
    assert jobs_on_card(room, 107 * MIB, 16) == 16  # RTX 4060 Ti's 107 MiB: the cores bound it
    assert jobs_on_card(room, 555 * MIB, 16) == 16 and jobs_on_card(room, 555 * MIB, 32) == 16  # 9216 // 555
    assert jobs_on_card(room, PLANNED_CONTEXT_BYTES, 32) == 16  # 9216 // 576
    assert jobs_on_card(512 * MIB, PLANNED_CONTEXT_BYTES, 16) == 1 and jobs_on_card(0, 555 * MIB, 16) == 1


@pytest.fixture
def counted(engine_loc, tmp_path, monkeypatch):
    """A folder whose llama-fit-params is the counting shim over the pinned one; the projections cache of its own."""
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "bin"
    (folder / "running").mkdir(parents=True)
    shim = folder / "llama-fit-params"
    shim.write_text(COUNTING.format(dir=folder, real=engine_loc.tool("llama-fit-params")))
    os.chmod(shim, 0o755)
    info = gguf_reader.inspect_model(demo_model.write_demo_model(tmp_path / "qwen3moe.gguf"))
    return build.EngineLocation(folder, "option"), folder / "at-start", info


def _asks(info, hw):  # type: ignore[no-untyped-def]
    """A run that asks six distinct configs (contexts 1024..6144): what a plan or a space asks, in small."""
    base = LaunchConfig(model=info.paths[0], parallel=1, n_cpu_moe=1 if hw.has_gpu else None)
    return lambda price: [price(info, replace(base, ctx=1024 * (n + 1)), hw) for n in range(6)]


def _card(engine_loc: build.EngineLocation, monkeypatch, context_mib: int | None) -> Hardware:
    """A FAKE 16 GiB card with ROOM free beyond the margin; each running llama-fit-params holds ``context_mib``
    (None: NVML attributes nothing to it)."""
    used = 16 * GIB - FIT_MARGIN_BYTES - ROOM
    real = str(engine_loc.tool("llama-fit-params").resolve())
    nvml = FakeNVML([("NVIDIA GeForce RTX 4060 Ti", 16 * GIB, used)],
                    contexts=(real, context_mib * MIB) if context_mib else None)
    monkeypatch.setattr(hardware, "_load_nvml", lambda: nvml)
    return find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)


def _starts(log: Path) -> list[int]:
    return [int(n) for n in log.read_text().split()]


def test_on_a_card_projections_run_as_many_at_once_as_their_contexts_fit(engine_loc, counted, monkeypatch):
    """300 MiB per context, read from the first projection's own process (it runs alone): 1000 MiB of room holds 3,
    so 3 at a time of 8 allowed, and never more."""
    loc, log, info = counted
    card = _card(engine_loc, monkeypatch, context_mib=300)
    mem = EngineMemory(loc, EngineIdentity("b99999", backend="cuda"))
    mem.prefetched(_asks(info, card), jobs=8)
    assert mem.load == ProjectionLoad(3, True, 300 * MIB, "read: the first projection's own, NVML per process", ROOM)
    starts = _starts(log)
    assert len(starts) >= 6 and starts[0] == 1 and max(starts) == 3, starts  # a lost record is asked again
    assert mem.calls == 6 and "3 at a time on the card: 300 MiB of VRAM each" in mem.describe()
    assert mem.summary()["prefetch"]["jobs"] == 3


def test_where_nvml_attributes_no_vram_the_planned_context_decides(engine_loc, counted, monkeypatch):
    """NVML lists no process of ours (a PID namespace it cannot see into, a driver that does not say): the planned
    576 MiB stands, and 1000 MiB of room holds one at a time."""
    loc, log, info = counted
    card = _card(engine_loc, monkeypatch, context_mib=None)
    mem = EngineMemory(loc, EngineIdentity("b99999", backend="cuda"))
    mem.prefetched(_asks(info, card), jobs=8)
    assert mem.load == ProjectionLoad(1, True, PLANNED_CONTEXT_BYTES, projection_load.PLANNED_SOURCE, ROOM)
    starts = _starts(log)
    assert len(starts) >= 6 and set(starts) == {1}, starts


def test_a_cpu_build_keeps_all_cores_at_a_time(counted):
    loc, log, info = counted
    mem = EngineMemory(loc, EngineIdentity("b99999", backend="cpu"))
    mem.prefetched(_asks(info, CPU), jobs=4)
    assert mem.load == ProjectionLoad(4, source="a CPU build: a core each")
    starts = _starts(log)
    assert len(starts) >= 6 and max(starts) == 4, starts
