"""The finish under the user's --vram-budget: llama.cpp's own choice is the one it makes under that budget (``fit``
with ``-fitt`` from the budget), never the bare launch that fills all the free VRAM; and an arm whose own VRAM broke
the budget is never printed nor ranked, however fast. VRAM is read by the real sampler from a fake NVML
(FakeLiveNVML, the hardware boundary) on a 24 GiB card beside a 1.5 GiB desktop."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fakes import FakeNVML
from tests.fakes_live import FakeLiveNVML, FakeStep
from tuner.core.config import LaunchConfig
from tuner.machine import hardware
from tuner.machine.sampler import Sampler
from tuner.report import study_report
from tuner.search import finish
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.result import StudyResult

pytestmark = pytest.mark.fast

GIB, MIB = 2**30, 2**20
CARD = "NVIDIA GeForce RTX 4090"
DESKTOP = 1536 * MIB
BUDGET = 6000 * MIB


def _hw(budget_mib: float | None) -> hardware.Hardware:
    """A 24 GiB card with 4 GiB held by others (20,480 MiB free), with or without --vram-budget."""
    hw = hardware.probe_hardware(FakeNVML([(CARD, 24 * GIB, 4 * GIB)]), host_bandwidth_s=0)
    return hardware.with_vram_budget(replace(hw, ram_total_bytes=64 * GIB, ram_available_bytes=64 * GIB), budget_mib)


def test_under_a_budget_below_free_vram_the_reference_is_fit_under_that_budget():
    sp = SimpleNamespace(model=Path("m.gguf"), ctx=4096, parallel=1, device=None, engine="llama.cpp")
    fit = LaunchConfig(model=Path("m.gguf"), ctx=4096, parallel=1, n_cpu_moe=20)  # llama-fit-params' placement
    # --fit's margin is per device over what the device reports free: 20,480 - 6,000 held back + its 1,024.
    assert finish.fit_target_mib(_hw(6000)) == 15504
    assert [label for label, _ in finish.baseline_configs(sp, _hw(6000), fit)] == ["fit"]  # type: ignore[arg-type]
    # The whole free VRAM as the budget: the bare launch is llama.cpp's own choice, fit beside it.
    assert [label for label, _ in finish.baseline_configs(sp, _hw(None), fit)] == ["default", "fit"]  # type: ignore
    # A wider margin than --fit's own: the bare launch would not keep it either.
    assert [label for label, _ in finish.baseline_configs(sp, _hw(None), fit, 2048)] == ["fit"]  # type: ignore


def _sampled_growth(line_bytes: int) -> int | None:
    """The real sampler over a fake card: the desktop, then the server loading ``line_bytes`` and serving."""
    fake = FakeLiveNVML([FakeStep(DESKTOP), FakeStep(DESKTOP + line_bytes // 2), FakeStep(DESKTOP + line_bytes),
                         FakeStep(DESKTOP + line_bytes)], 24 * GIB, pid=os.getpid())
    s = Sampler(fake, interval_s=0.01)
    s.start()
    deadline = time.monotonic() + 30
    while len(s.samples) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    report = s.stop()
    assert report.vram_peak_bytes == DESKTOP + line_bytes  # the card's peak counts the desktop in
    return finish.vram_growth_bytes(report.vram_peak_bytes, report.vram_baseline_bytes)


def _arm(label: str, scores: list[float], growth: int | None, line: str) -> ServerMeasurement:
    return ServerMeasurement(label, {"model": "m.gguf"}, line, [], max(scores), [], None, None, None, None,
                             vram_peak_bytes=None if growth is None else DESKTOP + growth, scores=scores,
                             vram_growth_bytes=growth)


@pytest.mark.parametrize("fast_arm_mib", [5632, 7168], ids=["within-budget", "over-budget"])
def test_an_arm_over_the_budget_is_never_printed_nor_ranked(fast_arm_mib):
    growth = _sampled_growth(fast_arm_mib * MIB)
    assert growth == fast_arm_mib * MIB  # the line's own share, not the desktop's
    fast = _arm("candidate-1", [2.0, 2.02, 1.99, 2.01], growth, "llama-server -m m.gguf -ub 2048")
    slow = _arm("candidate-2", [1.2, 1.21, 1.19, 1.2], _sampled_growth(4096 * MIB), "llama-server -m m.gguf -ub 512")
    fit = _arm("fit", [1.0, 1.01, 0.99, 1.0], 5000 * MIB, "llama-server -m m.gguf -ncmoe 20")
    fin = Finish((fast, slow), (fit,), vram_budget_bytes=BUDGET)
    labels = [m.label for m in study_report.ranked(StudyResult(study="s", model="m.gguf", finish=fin))]
    assert fin.winner is not None
    if fast_arm_mib * MIB <= BUDGET:
        assert fin.winner.label == "candidate-1" and labels == ["candidate-1", "candidate-2", "fit"]
    else:
        assert fin.winner.label == "candidate-2"  # decided faster than fit, and within the budget
        assert labels == ["candidate-2", "fit"]  # 2x faster, but it took 7,168 MiB of a 6,000 MiB budget
        assert not fin.eligible(fast) and fin.over_budget(fast)


def test_a_reference_over_the_budget_is_not_llama_cpps_choice_under_it():
    cand = _arm("candidate-1", [1.2, 1.21, 1.19, 1.2], 5000 * MIB, "llama-server -m m.gguf -ncmoe 24")
    bare = _arm("default", [1.5, 1.5, 1.51, 1.49], 18000 * MIB, "llama-server -m m.gguf")  # --fit filled the card
    fin = Finish((cand,), (bare,), vram_budget_bytes=BUDGET)
    assert fin.reference is None and fin.winner is cand
    assert fin.decision.reason == ("llama.cpp's own choice broke the VRAM budget (default): candidate-1 is printed")
    assert Finish.from_dict(fin.to_dict()).vram_budget_bytes == BUDGET


def test_an_arm_whose_vram_was_never_read_under_a_budget_is_not_taken_as_within_it():
    """Issue 58: a missing VRAM figure is never "within budget". The fastest candidate's VRAM was not sampled (NVML
    gave no reading): it is neither printed nor ranked; the next candidate, read within the budget, is."""
    unread = _arm("candidate-1", [2.0, 2.02, 1.99, 2.01], None, "llama-server -m m.gguf -ub 2048")
    kept = _arm("candidate-2", [1.2, 1.21, 1.19, 1.2], 4096 * MIB, "llama-server -m m.gguf -ub 512")
    fit = _arm("fit", [1.0, 1.01, 0.99, 1.0], 5000 * MIB, "llama-server -m m.gguf -ncmoe 20")
    fin = Finish((unread, kept), (fit,), vram_budget_bytes=BUDGET)
    assert fin.vram_unknown(unread) and not fin.eligible(unread) and not fin.over_budget(unread)
    assert fin.winner is not None and fin.winner.label == "candidate-2"
    labels = [m.label for m in study_report.ranked(StudyResult(study="s", model="m.gguf", finish=fin))]
    assert labels == ["candidate-2", "fit"]
    alone = Finish((unread,), (fit,), vram_budget_bytes=BUDGET)
    assert alone.winner is fit
    assert alone.decision.reason == ("candidate-1 had its VRAM unsampled (not known to keep the VRAM budget): "
                                     "llama.cpp's own choice (fit) is printed")
    # Without a budget (no GPU) nothing is read and nothing is missing: the fastest is printed.
    assert Finish((unread, kept), (fit,)).winner is unread
