"""scripts/gpu_check on a machine without a GPU: the pack (from a small synthetic sdist, no network), the
dry-run listing, and the CPU fallback (the memory model's plan per budget, the ballast saying no GPU), resumable.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check"
sys.path.insert(0, str(REPO / "scripts"))
import gpu_pack  # noqa: E402

TOP = "llama_cpp_python-0.3.36"
TREE = {  # path in the llama.cpp tree -> kept by the trim?
    "CMakeLists.txt": True, "LICENSE": True, "src/llama.cpp": True, "common/arg.cpp": True,
    "ggml/src/ggml.c": True, "ggml/src/ggml-cpu/ggml-cpu.c": True, "ggml/src/ggml-cuda/ggml-cuda.cu": True,
    "ggml/src/ggml-backend-impl.h": True, "ggml/src/ggml-vulkan/ggml-vulkan.cpp": False,
    "ggml/src/ggml-metal/ggml-metal.m": False, "tools/server/server.cpp": True,
    "tools/server/tests/test_basic.py": False, "tools/ui/CMakeLists.txt": True, "tools/ui/ui.cpp.in": True,
    "tools/ui/src/app.ts": False, "tools/ui/package-lock.json": False, "scripts/ui-assets.cmake": True,
    "scripts/compare-llama-bench.py": False, "models/ggml-vocab-llama-bpe.gguf": False, "docs/build.md": False,
    "examples/simple/simple.cpp": False, "tests/test-backend-ops.cpp": False, "media/logo.png": False,
    "convert_hf_to_gguf.py": False, "vendor/nlohmann/json.hpp": True, ".github/workflows/build.yml": False,
}


def _synthetic_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        names = [f"{TOP}/pyproject.toml", f"{TOP}/.git/modules/vendor/llama.cpp/HEAD",
                 *(f"{TOP}/vendor/llama.cpp/{rel}" for rel in TREE)]
        for name in names:
            data = f"// {name}\n".encode() * 50
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _run(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MOE_TUNE_CACHE=str(cache))
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)


def test_trim_keeps_what_a_cuda_build_needs():
    for rel, kept in TREE.items():
        assert gpu_pack.keep_member(rel) is kept, rel


def test_pack_from_a_local_sdist_without_network(tmp_path):
    sdist = _synthetic_sdist(tmp_path / f"{TOP}.tar.gz")
    wheels = tmp_path / "wheels-here"
    wheels.mkdir()
    (wheels / "gguf-0.0.0-py3-none-any.whl").write_bytes(b"PK stand-in, only copied")
    res = _run("--pack", str(tmp_path / "pack"), "--sdist", str(sdist), "--wheels-from", str(wheels),
               cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr
    assert "MiB of 60 MiB" in res.stdout and "wheels/gguf-0.0.0-py3-none-any.whl" in res.stdout
    with tarfile.open(tmp_path / "pack" / gpu_pack.TREE_NAME) as tar:
        files = {m.name for m in tar.getmembers() if m.isfile()}
    assert files == {rel for rel, kept in TREE.items() if kept}
    manifest = json.loads((tmp_path / "pack" / gpu_pack.MANIFEST).read_text())
    assert manifest["pin"]["commit"] == "0c1e57098" and manifest["missing_wheels"] == []
    assert manifest["tree"]["dropped_bytes"] > 0
    # The GPU side unpacks it where cmake can find the tree's CMakeLists.txt.
    dest = gpu_pack.extract_tree(tmp_path / "pack" / gpu_pack.TREE_NAME, tmp_path / "src")
    assert (dest / "CMakeLists.txt").is_file() and not (dest / "models").exists()


def test_pack_refuses_what_is_not_the_sdist(tmp_path):
    bogus = tmp_path / "bogus.tar.gz"
    with tarfile.open(bogus, "w:gz") as tar:
        info = tarfile.TarInfo("something/README")
        tar.addfile(info, io.BytesIO(b""))
    res = _run("--pack", str(tmp_path / "pack"), "--sdist", str(bogus), "--no-wheels", cache=tmp_path / "cache")
    assert res.returncode == 1 and "no vendor/llama.cpp tree" in res.stderr and "Traceback" not in res.stderr


def test_dry_run_lists_the_gpu_steps_and_the_cpu_ones(tmp_path):
    res = _run("--dry-run", "--budgets", "8,24", "--zero-weights", cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr
    for step in ("gpu-info", "engine", "budget-8g", "budget-24g", "long-16g", "spill-oom", "spill-unified",
                 "plan-budgets", "ballast"):
        assert f"  {step} " in res.stdout, step
    assert "without a GPU (this machine: no NVIDIA GPU found" in res.stdout
    assert "budget-12g" not in res.stdout


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU is here: the GPU path runs instead")
@pytest.mark.slow  # writes a real-scale shape and runs the CLI per step
def test_cpu_fallback_plans_each_budget_and_resumes(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    stopped = _run("--out", str(out), "--budgets", "16", "--long-ctx", "0", "--time-limit", "1", cache=cache)
    assert stopped.returncode == 75 and "run the same command again" in stopped.stderr
    res = _run("--out", str(out), "--budgets", "16", "--long-ctx", "0", "--copy-to", str(tmp_path / "back"),
               cache=cache)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["state.json", "table.json", "table.md"]
    doc = json.loads((out / "table.json").read_text())
    (row,) = doc["plan"]
    assert row["budget_mib"] == 16384 and 0 < row["n_cpu_moe"] < 48  # 17 GiB of weights, 16 GiB free
    assert row["vram_bytes"] + 1024 * 2**20 <= 16384 * 2**20
    assert "needs an NVIDIA GPU" in doc["steps"]["ballast"]["note"]
    assert "zero-filled" in doc["model"]["weights_label"]
    assert "planned, not measured" in (out / "table.md").read_text()
    state = json.loads((out / "state.json").read_text())
    again = _run("--out", str(out), "--budgets", "16", "--long-ctx", "0", cache=cache)
    assert again.returncode == 0 and "plan-budgets:" not in again.stderr  # every step was done: nothing re-runs
    assert json.loads((out / "state.json").read_text())["steps"] == state["steps"]


def test_a_state_from_another_machine_redoes_engine_and_model_only(tmp_path):
    import gpu_check

    out = tmp_path / "out"
    out.mkdir()
    done = {"status": "done", "took_s": 1.0}
    state = {"machine": {}, "steps": {
        "gpu-info": {**done, "result": {"gpu_name": "NVIDIA H100 80GB HBM3"}},
        "engine": {**done, "result": {"bin": str(tmp_path / "gone" / "bin")}},
        "model": {**done, "result": {"path": str(tmp_path / "gone.gguf")}},
        "budget-8g": {**done, "result": {"tune": {}}},
    }}
    (out / "state.json").write_text(json.dumps(state))
    c = gpu_check.Check(gpu_check.parse_args(["--out", str(out)]))
    assert sorted(c.state["steps"]) == ["budget-8g", "gpu-info"]


def test_leftovers_of_a_killed_run_are_ended_and_live_ones_are_not(tmp_path):
    import gpu_procs
    import psutil

    out = tmp_path / "out"
    marker = str(out / "engine-build" / "ninja")
    sleeper = f"import time; time.sleep(60)  # {marker}"
    # An orphan: its parent started it in a new session and exited (a device command killed mid-build).
    spawn = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
             "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(c.pid)")
    orphan = int(subprocess.run([sys.executable, "-c", spawn, sleeper], capture_output=True, text=True,
                                timeout=30).stdout)
    owned = subprocess.Popen([sys.executable, "-c", sleeper])  # its parent (this test) is alive
    try:
        assert [p.pid for p in gpu_procs.leftovers(out, None)] == [orphan]
        ended = gpu_procs.end_leftovers(out, None)
        assert len(ended) == 1 and ended[0].startswith(str(orphan))
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        assert owned.poll() is None
    finally:
        owned.kill()
        owned.wait()


def test_card_and_architecture_from_nvidia_smi():
    import gpu_check

    info = gpu_check.parse_smi("NVIDIA H100 80GB HBM3, 9.0, 81559, 81004, 580.159.04\n"
                               "NVIDIA H100 80GB HBM3, 9.0, 81559, 81559, 580.159.04\n")
    assert info == {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0", "cuda_arch": "90",
                    "total_mib": 81559, "free_mib": 81004, "driver": "580.159.04"}
    assert gpu_check.parse_smi("NVIDIA GeForce RTX 4060 Ti, 8.9, 16380, 15000, 570.86.10")["cuda_arch"] == "89"
