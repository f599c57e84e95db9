"""Memory and power sampled during a run, and the spill verdict; NVML is a fake at the hardware boundary."""

from __future__ import annotations

import os
import time

import pytest

from tests.fakes_live import FakeLiveNVML, FakeStep
from tuner.machine import sampler
from tuner.machine.sampler import Sample, Sampler, SpillKind, spill_verdict, summarize

GIB = 2**30
MIB = 2**20


def _run(fake: FakeLiveNVML, n_samples: int) -> sampler.MemoryReport:
    s = Sampler(fake, interval_s=0.01)
    s.attach(os.getpid())
    s.start()
    deadline = time.monotonic() + 30
    while len(s.samples) < n_samples and time.monotonic() < deadline:
        time.sleep(0.01)
    return s.stop()


def test_peaks_energy_and_process_vram_follow_the_fake_timeline():
    timeline = [FakeStep(1 * GIB, 50_000, None), FakeStep(6 * GIB, 180_000, 5 * GIB),
                FakeStep(15 * GIB, 230_000, 14 * GIB), FakeStep(9 * GIB, 120_000, 8 * GIB)]
    fake = FakeLiveNVML(timeline, 16 * GIB, pid=os.getpid(), energy_mj_per_step=500)
    report = _run(fake, 8)
    assert report.vram_total_bytes == 16 * GIB
    assert report.vram_baseline_bytes == 1 * GIB  # the first sample, before the load
    assert report.vram_peak_bytes == 15 * GIB
    assert report.proc_vram_peak_bytes == 14 * GIB
    assert report.power_peak_w == pytest.approx(230.0)
    # The counter advanced 500 mJ per sample after the first one.
    assert report.energy_j == pytest.approx(0.5 * (report.n_samples - 1))
    assert report.tokens_per_joule(100) == pytest.approx(100 / report.energy_j)
    assert report.rss_peak_bytes is not None and report.rss_peak_bytes > 10 * MIB  # this Python process
    assert fake.initialized is False  # NVML shut down again


def test_without_a_driver_only_host_figures_are_sampled():
    report = _run(_broken(), 3)
    assert report.vram_peak_bytes is None and report.energy_j is None and report.power_peak_w is None
    assert report.n_samples >= 3 and report.rss_peak_bytes and report.rss_peak_bytes > 0


def _broken():
    fake = FakeLiveNVML([FakeStep(0)], GIB)
    fake.init_error = "NVML Shared Library Not Found"
    return fake


def test_energy_integrates_power_when_the_card_has_no_counter():
    samples = [Sample(0.0, power_w=100.0), Sample(1.0, power_w=200.0), Sample(3.0, power_w=200.0)]
    assert sampler.energy_j(samples) == pytest.approx(150.0 + 400.0)
    assert summarize(samples).duration_s == 3.0
    assert summarize([]).n_samples == 0


def _report(peak_gib: float, total_gib: float = 16, swap_mib: int = 0) -> sampler.MemoryReport:
    samples = [Sample(0.0, int(GIB), int(total_gib * GIB), swap_used_bytes=1000 * MIB),
               Sample(1.0, int(peak_gib * GIB), int(total_gib * GIB), swap_used_bytes=(1000 + swap_mib) * MIB)]
    return summarize(samples)


def test_spill_verdicts_name_their_evidence():
    v = spill_verdict(None, oom_reason="cudaMalloc failed: out of memory")
    assert v.kind is SpillKind.OOM_AT_LOAD and "cudaMalloc failed" in v.evidence

    v = spill_verdict(_report(15.9), gen_tok_s=12.0, roofline_tok_s=120.0)
    assert v.kind is SpillKind.THROUGHPUT_CLIFF and "10 %" in v.evidence and "16,282 of 16,384 MiB" in v.evidence

    v = spill_verdict(_report(15.9), gen_tok_s=60.0, roofline_tok_s=120.0)
    assert v.kind is SpillKind.VRAM_AT_CAPACITY

    v = spill_verdict(_report(15.9))  # no roofline known: capacity is all that can be said
    assert v.kind is SpillKind.VRAM_AT_CAPACITY

    v = spill_verdict(_report(10.0, swap_mib=512))
    assert v.kind is SpillKind.HOST_SWAP and "+512 MiB" in v.evidence

    v = spill_verdict(_report(10.0, swap_mib=8))
    assert v.kind is SpillKind.NONE and "10,240 of 16,384 MiB" in v.evidence
