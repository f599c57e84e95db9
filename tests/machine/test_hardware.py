from __future__ import annotations

from tests.fakes import FakeNVML
from tuner.machine import hardware


def test_nvml_bandwidth_bus_pcie_power():
    gpu = hardware.probe_gpu_details(FakeNVML([("NVIDIA GeForce RTX 3090", 24 * 2**30, 2**30)]))[0]
    assert (gpu.memory_bus_width_bits, gpu.memory_clock_mhz, gpu.pcie_generation, gpu.pcie_width) == (384, 9751, 4, 16)
    assert gpu.power_limit_w == 350.0
    # 2 x 9751 MHz x 384 bit / 8 = 936 GB/s, the 3090's spec sheet figure.
    assert round(gpu.bandwidth_bytes_s / 1e9) == 936
    assert round(gpu.pcie_bandwidth_bytes_s / 1e9, 1) == 31.5


def test_missing_queries_read_as_zero():
    nvml = FakeNVML([("Some Laptop GPU", 8 * 2**30, 0)], extras={"bus_width": None, "pcie_gen": None})
    gpu = hardware.probe_gpu_details(nvml)[0]
    assert gpu.memory_bus_width_bits == 0 and gpu.bandwidth_bytes_s == 0.0
    assert gpu.pcie_generation == 0 and gpu.pcie_bandwidth_bytes_s == 0.0
    assert hardware.probe_gpus(nvml).gpus[0].total_bytes == 8 * 2**30
    assert hardware.probe_gpu_details(FakeNVML(init_error="no driver")) == ()


def test_probe_hardware_with_and_without_gpu():
    hw = hardware.probe_hardware(FakeNVML([("NVIDIA GeForce RTX 4090", 24 * 2**30, 2**30)]), host_bandwidth_s=0)
    assert hw.has_gpu and hw.vram_free_bytes == 23 * 2**30 and hw.source == "probed"
    assert round(hw.gpu_bandwidth_bytes_s / 1e9) == 936
    assert "RTX 4090" in hw.describe()
    none = hardware.probe_hardware(FakeNVML(init_error="Driver Not Loaded"), host_bandwidth_s=0)
    assert not none.has_gpu and none.describe().startswith("CPU only")
    assert none.ram_total_bytes > 0


def test_host_bandwidth_is_measured():
    bw = hardware.measure_host_bandwidth(seconds=0.2, block_bytes=64 * 2**20)
    assert 1e8 < bw < 1e12  # bytes/s: between 0.1 and 1000 GB/s on any machine


def test_pcie_table():
    assert hardware.pcie_bandwidth_bytes_s(4, 8) * 2 == hardware.pcie_bandwidth_bytes_s(4, 16)
    assert hardware.pcie_bandwidth_bytes_s(0, 16) == 0.0
