"""Fakes at the hardware boundary only: NVML for machines without an NVIDIA GPU, a host whose memory holds still
(psutil's readings of RAM, what holds it, and the RAM bandwidth measured), and another CPU's /proc/cpuinfo."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any


@dataclass
class _Memory:
    total: int
    free: int
    used: int


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Stands in for the ``pynvml`` module: a driver with the given cards, or none at all."""

    def __init__(self, cards: list[tuple[str, int, int]] | None = None, driver: str = "570.86.10",
                 init_error: str | None = None, extras: dict[str, float | None] | None = None,
                 processes: list[tuple[int, int]] | None = None, graphics: list[tuple[int, int]] | None = None,
                 util_pct: int | None = None, process_sm: dict[int, int] | None = None,
                 compute_capability: tuple[int, int] = (8, 6), sample_lag_s: float = 0.0,
                 lost: str | None = None, cuda_driver: int = 12080,
                 contexts: tuple[str, int] | None = None) -> None:
        self.cards = cards or []
        # (executable, bytes): every running child of this process that runs that executable holds a compute context
        # of that size on the card (what a CUDA build's tool creates when it asks the card's free memory).
        self.contexts = contexts
        # nvmlSystemGetCudaDriverVersion: the newest CUDA the driver runs (12080: CUDA 12.8, driver 570's)
        self.cuda_driver = cuda_driver
        self.processes = processes or []  # (pid, used bytes) holding a compute context on every card
        self.graphics = graphics or []  # (pid, used bytes) holding a graphics context (a display, a browser)
        self.util_pct = util_pct  # device utilization; None: the driver does not say
        # pid → SM share sampled per process; None: the driver keeps no per-process samples (NotSupported)
        self.process_sm = process_sm
        self.compute_capability = compute_capability
        self.extras = extras or {}
        self.driver = driver
        self.init_error = init_error
        self.initialized = False
        # Per-process samples stamped this long ago (a driver fills them every few seconds); 0: always fresh.
        self.sample_lag_s = sample_lag_s
        self.lost = lost  # every query past nvmlInit fails with this (a card that stops answering)
        self.queries = 0  # device-count queries: how often the card was looked at

    def nvmlInit(self) -> None:  # noqa: N802 - mirrors pynvml
        if self.init_error:
            raise FakeNVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        return self.cuda_driver

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self.queries += 1
        if self.lost:
            raise FakeNVMLError(self.lost)
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return self.cards[handle][0].encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Memory:  # noqa: N802
        _, total, used = self.cards[handle]
        return _Memory(total=total, free=total - used, used=used)

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return f"GPU-fake-{handle}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes + self._contexts()]

    def _contexts(self) -> list[tuple[int, int]]:
        if self.contexts is None:
            return []
        import psutil

        exe, used = self.contexts
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.exe() == exe:
                    found.append((child.pid, used))
            except psutil.Error:  # gone between the listing and the look
                continue
        return found

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.graphics]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:  # noqa: N802
        if self.util_pct is None:
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(gpu=self.util_pct, memory=max(0, self.util_pct // 2))

    def nvmlDeviceGetProcessUtilization(self, handle: int, last_seen_us: int) -> list[SimpleNamespace]:  # noqa: N802
        if self.process_sm is None:
            raise FakeNVMLError("Not Supported")
        stamp = last_seen_us + 1 if not self.sample_lag_s else int((time.time() - self.sample_lag_s) * 1e6)
        busy = [SimpleNamespace(pid=pid, smUtil=sm, memUtil=sm // 2, timeStamp=stamp)
                for pid, sm in self.process_sm.items() if sm > 0 and stamp > last_seen_us]
        if not busy:
            raise FakeNVMLError("Not Found")  # what NVML answers when no process ran in the window
        return busy

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:  # noqa: N802
        return self.compute_capability

    # Spec-like figures of an RTX 3090 (384-bit GDDR6X, NVML reports 9751 MHz memory clock), unless
    # ``extras`` says otherwise; a key mapped to None raises, as a driver that lacks the query does.
    NVML_CLOCK_MEM = 2

    def _extra(self, key: str, default: float) -> float:
        value = self.extras.get(key, default)
        if value is None:
            raise FakeNVMLError(f"{key} not supported")
        return value

    def nvmlDeviceGetMemoryBusWidth(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("bus_width", 384))

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock: int) -> int:  # noqa: N802
        assert clock == self.NVML_CLOCK_MEM
        return int(self._extra("mem_clock", 9751))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("pcie_gen", 4))

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("pcie_width", 16))

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("power_mw", 350_000))


class FakeHost:
    """Stands in for this machine's host side as :mod:`tuner.machine.hardware` reads it (psutil's RAM, swap and
    cores; the processes holding RAM; the measured RAM bandwidth): fixed, so two readings a moment apart see the same
    machine, as two front ends answering the same question must."""

    def __init__(self, ram_total_bytes: int, ram_available_bytes: int, holders: tuple[tuple[str, int], ...] = (),
                 bandwidth_bytes_s: float = 40e9, cores: int = 2) -> None:
        self.ram_total_bytes, self.ram_available_bytes = ram_total_bytes, ram_available_bytes
        self.holders, self.bandwidth_bytes_s, self.cores = holders, bandwidth_bytes_s, cores

    def install(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        from tuner.machine import hardware

        host = hardware.HostInfo(self.ram_total_bytes, self.ram_available_bytes, 0, 0, self.cores, self.cores)
        monkeypatch.setattr(hardware, "probe_host", lambda: host)
        monkeypatch.setattr(hardware, "ram_holders", lambda limit=3, exclude=frozenset(): self.holders[:limit])
        monkeypatch.setattr(hardware, "measure_host_bandwidth", lambda *a, **k: self.bandwidth_bytes_s)


class FakeFrontierRunner:
    """Stands in for the engine under a frontier study (the measurement is the hardware boundary): a request's
    time from a simple machine model — generation and prompt slow down with depth, a quantized KV cache reads
    fewer bytes per token, every expert layer left on the host costs a fixed share, slots share the speed.
    Records every plan it was handed, so a test can check nothing infeasible was ever "launched"."""

    def __init__(self, gen_tok_s: float = 400.0, prompt_tok_s: float = 4000.0, fail_kv: str | None = None) -> None:
        self.gen_tok_s = gen_tok_s
        self.prompt_tok_s = prompt_tok_s
        self.fail_kv = fail_kv
        self.plans: list = []

    def __call__(self, plans):
        from tuner.frontier.pareto import Measured
        from tuner.measure import failures

        out = []
        for p in plans:
            self.plans.append(p)
            c = p.config
            kv = f"{c.cache_type_k.value}/{c.cache_type_v.value}"
            if kv == self.fail_kv:
                out.append(failures.Failure(failures.FailureKind.CRASHED, "fake crash", ("llama-bench",), -11))
                continue
            bytes_per = {"f16": 1.0, "q8_0": 0.55, "q4_0": 0.3}
            kv_cost = (bytes_per[c.cache_type_k.value] + bytes_per[c.cache_type_v.value]) / 2
            host = 1.0 + 0.1 * (c.n_cpu_moe or 0)
            slots = c.parallel or 1
            tg = self.gen_tok_s / host / (1 + kv_cost * p.gen_depth / 4096) / (1 + 0.6 * (slots - 1)) * (
                1.05 if c.flash_attn.value == "on" else 1.0)
            pp = self.prompt_tok_s / host / (1 + kv_cost * p.prompt_depth / 8192)
            prompt = p.gen_depth if slots > 1 else p.gen_depth - p.prompt_depth
            request_s = prompt * slots / pp + 32 / tg
            out.append(Measured(request_s, tg, pp, slots * 32 / request_s if slots > 1 else None, 1.0, 2,
                                ("fake-bench",)))
        return out


def small_card(info, base, host_layers: int, ram_gib: int = 64):  # type: ignore[no-untyped-def]
    """A fake card (at the hardware boundary) whose VRAM holds ``base`` with the experts of ``host_layers`` layers on
    the host and not one fewer, at a zero margin: sized from the memory model, so a test
    about the search's behaviour on a small card does not depend on what the model prices this year."""
    from dataclasses import replace as _replace

    from tuner.catalog.cards import find_card
    from tuner.plan import memory

    gib = 2**30
    card = find_card("RTX 4060 Ti 16GB").hardware(ram_gib * gib, (ram_gib - 4) * gib, 50e9, physical_cores=2)
    need, one_more = (memory.estimate(info, _replace(base, n_cpu_moe=n), card).gpu.total_bytes
                      for n in (host_layers, host_layers - 1))
    vram = need + (one_more - need) // 2  # half a layer's experts of slack: the next config down does not fit
    return _replace(card, vram_total_bytes=vram, vram_free_bytes=vram)


# /proc/cpuinfo's feature lines as Linux writes them, for the CPU-flag boundary: an x86-64 CPU with AVX2 and no
# AVX-512 (a Haswell-class desktop), this project's machine (AMD EPYC, Zen 4: AVX-512 with VNNI, BF16, VBMI), and an
# ARM server core (Neoverse V1: SVE) beside one without SVE (Neoverse N1).
AVX2_CPU_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
    "pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 "
    "x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm invpcid_single fsgsbase bmi1 avx2 smep "
    "bmi2 erms invpcid xsaveopt arat md_clear")
ZEN4_CPU_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
    "mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid "
    "tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave "
    "avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext "
    "vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma "
    "clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr "
    "arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm")
NEOVERSE_V1_FEATURES = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 "
    "sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng")
NEOVERSE_N1_FEATURES = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs")


class FakeCpuInfo:
    """A FAKE ``/proc/cpuinfo`` (named as one; the CPU-flag boundary only): a file holding one processor's ``flags``
    line (x86) or ``Features`` line (ARM), put where :func:`tuner.machine.hardware.cpu_flags` reads, and the machine
    architecture ``platform.machine()`` reports. ``line=None``: no such file at all (a system without /proc)."""

    def __init__(self, folder: Path, line: str | None, machine: str = "x86_64") -> None:
        self.path = folder / "cpuinfo"
        self.machine = machine
        if line is not None:
            folder.mkdir(parents=True, exist_ok=True)
            key = "flags" if machine in ("x86_64", "amd64") else "Features"
            self.path.write_text(f"processor\t: 0\nvendor_id\t: FakeCpu\n{key}\t\t: {line}\n\n")

    def install(self, monkeypatch: Any) -> FakeCpuInfo:
        from tuner.machine import hardware

        monkeypatch.setattr(hardware, "CPUINFO", self.path)
        monkeypatch.setattr(platform, "machine", lambda: self.machine)
        return self
