"""scripts/gpu_check on a machine without a GPU: the pack (from a small synthetic sdist, no network), the
dry-run listing, and the CPU fallback (the memory model's plan per budget, the ballast saying no GPU), resumable.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check"
sys.path.insert(0, str(REPO / "scripts"))
from gpucheck import pack as gpu_pack  # noqa: E402

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


def _dry_run_commands(stdout: str) -> list[dict[str, object]]:
    """The dry run's first lease: per command its --time-limit, its steps (part, name, estimate), its total."""
    commands: list[dict[str, object]] = []
    for line in stdout.splitlines():
        if m := re.match(r"command (\d): .* --time-limit (\d+) ", line):
            commands.append({"limit": int(m.group(2)), "steps": [], "total": None})
        elif commands and (m := re.match(r"  (\(([a-e])\) |    )(\S+) +~ *(\d+) s +(\d+) s  ", line)):
            commands[-1]["steps"].append((m.group(2) or "", m.group(3), int(m.group(4))))  # type: ignore[union-attr]
        elif commands and (m := re.match(r"  = ~(\d+) s of its (\d+) s", line)):
            commands[-1]["total"] = int(m.group(1))
        elif line.startswith("later leases"):
            break
    return commands


def test_dry_run_with_no_options_plans_the_next_lease_that_decides_agents(tmp_path):
    """Issue 53: with no options the dry run plans the next lease from the state the last one brought back: the
    engine restored (built here before the lease: 0 s of building there), valid weights, then the tuner's line
    against llama.cpp's default on agent sessions at 12, 8 and 16 GiB, every step estimated from lease 2's measured
    steps. Issue 67: then ik_llama.cpp on the card, raced against llama.cpp's default with experts in RAM at 8 and
    16 GiB, its engine restored from the second command's own carry; the whole lease, ik in it, inside 900 s."""
    res = _run("--dry-run", cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr
    state = "results/benchmarks/gpu-nvidia-h100-80gb-hbm3.json"
    assert res.stdout.startswith(f"the next lease, from the state {state} came back with")
    packed = (REPO / ".gpu-pack" / "engine" / "engine.json").is_file()  # the engine built here and packed
    assert ("prerequisite, here, before the first device call" in res.stdout) is not packed
    assert "MOE_TUNE_CPU_ISA=avx2 MOE_TUNE_CUDA_ARCHS=90 moe-tune engine install --engine ik --backend cuda" \
        in res.stdout or (REPO / ".gpu-pack-ik" / "engine-ik" / "engine.json").is_file()
    commands = _dry_run_commands(res.stdout)
    assert len(commands) == 2  # two back-to-back commands
    names = [[name for _, name, _ in c["steps"]] for c in commands]  # type: ignore[union-attr]
    assert names[0][:4] == ["gpu-info", "wheels", "engine", "model-valid"]  # what the answers need, first
    steps = {n: est for c in commands for _, n, est in c["steps"]}  # type: ignore[union-attr]
    assert steps["engine"] == 5 and steps["ik-engine"] == 5  # both restored, neither built there
    assert "valid weights drawn directly" in res.stdout.split("command 1:")[1].split(" model-valid ")[1].splitlines()[0]
    order = [n for c in names for n in c]
    runs = ["12g-agent", "8g-agent", "16g-agent"]
    for run in runs:
        assert order.index(f"search-{run}") + 1 == order.index(f"versus-{run}"), run  # its line, then the verdict
    assert [order.index(f"versus-{r}") for r in runs] == sorted(order.index(f"versus-{r}") for r in runs)
    # (e) after what matters most: ik's engine opens the second command (its own carry), then the two races.
    assert names[1][:3] == ["ik-engine", "race-8g-agent", "race-16g-agent"]
    assert max(order.index(f"versus-{r}") for r in runs) < order.index("ik-engine")
    assert "carry .gpu-pack-ik" in res.stdout.split("command 2:")[1].splitlines()[0]
    assert "carry .gpu-pack)" in res.stdout.split("command 1:")[1].splitlines()[0]
    # Lease 2's speed steps ran on zero weights: op offload is planned again (now after ik); memory and spill are not.
    later = res.stdout.split("later leases")[1]
    assert "opoff-12g-agent" in later and "memory-12g" not in res.stdout and "spill-oom " not in res.stdout
    lease = 0.0
    for c in commands:
        total = sum(est for _, _, est in c["steps"])  # type: ignore[union-attr]
        assert total == c["total"] and total <= c["limit"] <= 540  # each command fits its own limit, <= 9 min
        lease += total + 10  # its transfers
    assert lease + 120 <= 900  # the machine's start (1-2 min), both commands, ik's race among them: 15 minutes
    m = re.search(r"first lease on the estimates: ~(\d+) s of 900 s; reaches .*\(e\) ik_llama.cpp vs", res.stdout)
    assert m and abs(int(m.group(1)) - (lease + 120)) <= 2  # the sum it says is the sum of its commands
    m = re.search(r"6 interleaved rounds decide a 1.14x gain at 4 % round-to-round noise with P = (\d\.\d+)",
                  res.stdout)
    assert m and float(m.group(1)) >= 0.9
    assert "without a GPU (this machine: no NVIDIA GPU found" in res.stdout
    for step in ("model", "plan-budgets", "ballast"):
        assert f"  {step} " in res.stdout.split("without a GPU")[1], step


def test_a_step_with_a_carry_of_its_own_opens_a_command():
    from gpucheck import lease as gpu_lease

    steps = [gpu_lease.Planned("a", 100, "x", "b"), gpu_lease.Planned("ik", 5, "x", "e", carry=".gpu-pack-ik"),
             gpu_lease.Planned("race", 100, "x", "e")]
    plan = gpu_lease.plan(steps)
    assert [[s.name for s in c.steps] for c in plan.commands] == [["a"], ["ik", "race"]]  # room left in the first
    assert [c.carry for c in plan.commands] == [".gpu-pack", ".gpu-pack-ik"]


def test_a_measured_build_time_from_the_state_that_came_back_is_what_a_run_without_a_carried_engine_expects(
        tmp_path):
    """A later lease starts from the JSON the last one brought back: its done steps are not planned again. The dry
    run plans the engine as carried (built here first); a run whose pack holds none expects the build time the
    state measured."""
    from gpucheck import check as gpu_check
    from gpucheck import steps as gpu_steps
    from gpucheck import table as gpu_table

    done = {"status": "done", "took_s": 1.0}
    state = {"machine": {"gpu_name": "NVIDIA H100 80GB HBM3", "build": {"finished": True, "build_s": 610.0}},
             "steps": {"gpu-info": {**done, "result": {"gpu_name": "NVIDIA H100 80GB HBM3", "cuda_arch": "90"}},
                       "memory-12g": {**done, "result": {"rows": []}}}}
    (back,) = [p for p in gpu_table.write_back(state, tmp_path / "back") if p.suffix == ".json"]
    assert back.name == "gpu-nvidia-h100-80gb-hbm3.json"
    res = _run("--dry-run", "--state", str(back), "--out", str(tmp_path / "fresh"), cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr
    planned = {n: est for c in _dry_run_commands(res.stdout) for _, n, est in c["steps"]}  # type: ignore[union-attr]
    assert "memory-12g" not in planned and "gpu-info" in planned  # gpu-info: the next machine is asked again
    assert planned["engine"] == 5
    c = gpu_check.Check(gpu_check.parse_args(["--state", str(back), "--out", str(tmp_path / "run")]))
    assert gpu_steps.engine_est_s(c) == (610.0, "CUDA build, measured 610 s on such a machine")


def test_lease_plan_keeps_the_order_and_stops_at_the_first_step_that_does_not_fit():
    from gpucheck import lease as gpu_lease

    steps = [gpu_lease.Planned("build", 500, "b"), gpu_lease.Planned("a", 30, "x", "a"),
             gpu_lease.Planned("big", 220, "x", "b"), gpu_lease.Planned("c", 20, "x", "c")]
    plan = gpu_lease.plan(steps)
    assert [[s.name for s in c.steps] for c in plan.commands] == [["build", "a"], ["big"]]
    assert [s.name for s in plan.later] == ["c"]  # 10 s short of the 230 s left
    assert plan.commands[1].limit_s == 900 - 120 - 2 * 10 - 530 and plan.parts_first == ("a", "b")
    text = gpu_lease.render(plan, "cmd")
    assert "reaches (a) memory model vs llama.cpp's CUDA breakdown, (b) tuned vs llama.cpp's default (valid " \
        "weights); NOT (c)" in text


def test_the_lease_packs_identity_is_the_same_under_an_avx2_cpu_and_this_zen4(tmp_path, monkeypatch):
    """Issue 67: the packed CUDA engines (llama.cpp's and ik_llama.cpp's) are keyed and built portable for the CPU:
    the identity a lease's machine computes under its own CPU's flags is the one computed here, whatever CPU either
    has, and names no host ISA. Another CPU is simulated at the boundary cpu_isa reads: a FAKE /proc/cpuinfo."""
    from gpucheck import engine as gpu_engine

    from tests.fakes import AVX2_CPU_FLAGS, ZEN4_CPU_FLAGS, FakeCpuInfo
    from tuner.engine import build, cpu_isa
    from tuner.engine.kinds import IK_LLAMA

    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "90")
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)  # this machine's default: builds for its own CPU
    seen = {}
    for name, flags in (("avx2", AVX2_CPU_FLAGS), ("zen4", ZEN4_CPU_FLAGS)):
        FakeCpuInfo(tmp_path / name, flags).install(monkeypatch)
        seen[name] = {"lease": (gpu_engine.identity("90"), gpu_engine.identity("90", IK_LLAMA)),
                      "here": (build.build_identity(build.Backend.CUDA), build.build_identity(build.Backend.CUDA,
                                                                                              IK_LLAMA))}
    assert seen["avx2"]["lease"] == seen["zen4"]["lease"]
    assert seen["avx2"]["here"] != seen["zen4"]["here"]  # the fake CPU reached cpu_isa: a native build differs
    for ident in seen["zen4"]["lease"]:
        assert not [f for f in ident["cmake_flags"] if "AVX512" in f or "ARCH_FLAGS" in f or "cpu_isa=" in f]
        assert "-DGGML_NATIVE=OFF" in ident["cmake_flags"] and "-DCMAKE_CUDA_ARCHITECTURES=90" in ident["cmake_flags"]
    assert seen["zen4"]["lease"][1]["engine"] == "ik_llama.cpp" and "engine" not in seen["zen4"]["lease"][0]


def test_an_engine_comes_back_in_parts_and_is_restored_only_for_the_same_build(tmp_path, monkeypatch):
    from gpucheck import engine as gpu_engine

    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "90")
    built = tmp_path / "build" / "bin"
    built.mkdir(parents=True)
    for name in gpu_engine.CHECK_TOOLS:
        (built / name).write_bytes(os.urandom(3000))
    (built / "libllama.so.0.5.0").write_bytes(os.urandom(5000))
    (built / "libllama.so.0").symlink_to("libllama.so.0.5.0")  # the loader's link: kept
    (built / "libcublas.so.13").symlink_to(tmp_path / "toolkit-cublas")  # the toolkit's runtime: never packed
    (built / "build.ninja.tmp").write_text("not an engine file")
    meta = gpu_engine.identity("90")
    assert meta["arch"] == "90" and "-DCMAKE_CUDA_ARCHITECTURES=90" in meta["cmake_flags"]
    back = tmp_path / "OUT"
    res = gpu_engine.pack(built, back, meta, part_bytes=4096)
    assert res["packed"] and len(res["parts"]) >= 3  # ~14 KB of random bytes in 4 KiB parts
    assert sorted(p.name for p in back.iterdir()) == sorted([*res["parts"], "engine.json"])
    again = tmp_path / "next-lease" / "bin"
    assert gpu_engine.restore(back, again, gpu_engine.identity("89")) is None  # another card's build
    assert gpu_engine.restore(back, again, gpu_engine.identity("90")) is not None
    assert sorted(p.name for p in again.iterdir()) == sorted([*gpu_engine.CHECK_TOOLS, "libllama.so.0",
                                                              "libllama.so.0.5.0"])
    assert (again / "llama-server").read_bytes() == (built / "llama-server").read_bytes()
    assert os.readlink(again / "libllama.so.0") == "libllama.so.0.5.0"
    too_big = gpu_engine.pack(built, tmp_path / "OUT2", meta, limit_bytes=1024)
    assert not too_big["packed"] and "the next lease builds it again" in too_big["note"]
    assert not (tmp_path / "OUT2").exists()
    # The next lease's dry run restores it in seconds instead of building.
    pack = tmp_path / "pack"
    shutil.copytree(back, pack / "engine")
    res2 = _run("--dry-run", "--from", str(pack), cache=tmp_path / "cache")
    assert "restore the engine carried in the pack" in res2.stdout
    assert "prerequisite, here, before the first device call" not in res2.stdout  # ik's is another carry's
    assert next(est for c in _dry_run_commands(res2.stdout) for _, n, est in c["steps"]  # type: ignore[union-attr]
                if n == "engine") == 5


def test_memory_model_against_a_cuda_breakdown_component_by_component(demo_models):
    """(a)'s rows from a breakdown as llama.cpp prints it for a CUDA build (a CUDA0 device row and the host)."""
    from gpucheck import memory as gpu_memory
    from gpucheck import table as gpu_table

    from tuner.catalog.cards import find_card
    from tuner.core.config import FlashAttn, LaunchConfig
    from tuner.engine.breakdown import BufferRow, MemoryBreakdown
    from tuner.models.gguf_reader import inspect_model
    from tuner.plan import memory

    info = inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * 2**30, 60 * 2**30, 50e9)
    est = memory.estimate(info, LaunchConfig(model=info.paths[0], ctx=8192, parallel=1, flash_attn=FlashAttn.ON,
                                             n_cpu_moe=4), hw)
    mib = 2**20
    truth = MemoryBreakdown((
        BufferRow("device", "CUDA0", est.gpu.weights_bytes // mib, est.gpu.context_bytes // mib,
                  est.gpu.compute_bytes // mib + 9, 16380, 15000),
        BufferRow("host", "Host", est.engine_host_weights_bytes // mib, 0, est.host.compute_bytes // mib)))
    rows = gpu_memory.compare(est, truth, info.tensor_bytes, "llama-server at exit")
    assert [(r["device"], r["component"]) for r in rows] == [
        ("GPU", "model"), ("GPU", "context"), ("GPU", "compute"), ("host", "model"), ("host", "context"),
        ("host", "compute")]
    by = {(r["device"], r["component"]): r for r in rows}
    assert by[("GPU", "compute")]["agrees"] is False and by[("GPU", "compute")]["tolerance_mib"] == 4
    assert all(r["agrees"] for k, r in by.items() if k != ("GPU", "compute"))
    state = {"machine": {"gpu_name": "NVIDIA H100 80GB HBM3"},
             "steps": {"memory-12g": {"status": "done", "result": {"rows": rows}}}}
    md, doc = gpu_table.render(state)
    assert "## (a) memory model vs llama.cpp's own CUDA breakdown, component by component" in md
    assert "| memory-12g | llama-server at exit | GPU | compute |" in md and "no (tolerance 4 MiB)" in md
    assert len(doc["memory"]) == 6


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU is here: the GPU path runs instead")
@pytest.mark.slow  # writes a real-scale shape and runs the CLI per step
def test_cpu_fallback_plans_each_budget_and_resumes(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    stopped = _run("--out", str(out), "--budgets", "16", "--long-ctx", "0", "--time-limit", "1", cache=cache)
    assert stopped.returncode == 75 and "run the same command again" in stopped.stderr
    res = _run("--out", str(out), "--budgets", "16", "--long-ctx", "0", "--copy-to", str(tmp_path / "back"),
               cache=cache)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["gpu-cpu.json", "gpu-cpu.md"]
    doc = json.loads((out / "table.json").read_text())
    assert json.loads((tmp_path / "back" / "gpu-cpu.json").read_text())["state"]["steps"].keys() == \
        json.loads((out / "state.json").read_text())["steps"].keys()
    (row,) = [r for r in doc["plan"] if r["budget_mib"] == 16384 and r["workload"] == "chat"]
    assert {(r["budget_mib"], r["workload"]) for r in doc["plan"]} == {(12288, "chat"), (12288, "agent"),
                                                                       (8192, "agent"), (16384, "agent"),
                                                                       (16384, "chat")}
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
    from gpucheck import check as gpu_check

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
    import psutil
    from gpucheck import procs as gpu_procs

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
    from gpucheck import check as gpu_check

    info = gpu_check.parse_smi("NVIDIA H100 80GB HBM3, 9.0, 81559, 81004, 580.159.04\n"
                               "NVIDIA H100 80GB HBM3, 9.0, 81559, 81559, 580.159.04\n")
    assert info == {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0", "cuda_arch": "90",
                    "total_mib": 81559, "free_mib": 81004, "driver": "580.159.04"}
    assert gpu_check.parse_smi("NVIDIA GeForce RTX 4060 Ti, 8.9, 16380, 15000, 570.86.10")["cuda_arch"] == "89"


def test_the_op_offload_step_takes_the_agent_lines_and_its_table_says_off_vs_on():
    """(d): the tuned line and llama.cpp's --fit choice of the agent tune, each with op offload on and off; the
    table shows each line's off/on ratio for the agent turn and the long prompt, a failed load as failed."""
    from gpucheck import opoff as gpu_opoff
    from gpucheck import table as gpu_table

    tuned = {"model": "/m.gguf", "n_cpu_moe": 24, "ubatch": 4096, "batch": 4096}
    result = {"tune": {"winner": {"config": tuned, "launch_line": "a"},
                       "finish": {"baselines": [{"label": "default", "config": {"model": "/m.gguf"}},
                                                {"label": "fit", "config": {"model": "/m.gguf", "n_cpu_moe": 26},
                                                 "launch_line": "b"}]}}}
    assert [label for label, _ in gpu_opoff.arms_of(result)] == ["tuned", "fit"]
    same = {"tune": {**result["tune"], "finish": {"baselines": [{"label": "fit", "config": tuned,
                                                                 "launch_line": "a"}]}}}
    assert [label for label, _ in gpu_opoff.arms_of(same)] == ["tuned"]  # one line is measured once
    with pytest.raises(ValueError, match="no line to compare"):
        gpu_opoff.arms_of({"tune": {}})
    search = {"best": tuned, "default": {"model": "/m.gguf", "ctx": 32768}}  # the next lease's search step
    assert [(label, cfg) for label, cfg in gpu_opoff.arms_of(search)] == [("tuned", tuned),
                                                                          ("default", search["default"])]
    rows = [{"line": "tuned", "op_offload": "on (min batch 32)", "n_cpu_moe": 24, "ubatch": 4096,
             "turn_prompt_tok_s": 400.0, "long_prompt_tok_s": 2400.0, "gen_tok_s": 30.0, "spill": "none"},
            {"line": "tuned", "op_offload": "off", "n_cpu_moe": 24, "ubatch": 4096, "turn_prompt_tok_s": 600.0,
             "long_prompt_tok_s": 800.0, "gen_tok_s": 30.0, "spill": "none", "turn_prompt_tok_s_off_vs_on": 1.5,
             "long_prompt_tok_s_off_vs_on": 1 / 3},
            {"line": "fit", "op_offload": "on (min batch 32)", "n_cpu_moe": 26, "ubatch": None,
             "failed": "out_of_memory: cudaMalloc failed"}]
    md, doc = gpu_table.render({"steps": {"opoff-12g-agent": {"status": "done", "result": {"rows": rows}}}})
    assert "## (d) op offload on vs off (--no-op-offload)" in md and "| 1.50x | 0.33x |" in md
    assert "failed: out_of_memory: cudaMalloc failed" in md and len(doc["opoff"]) == 3


def test_the_roofline_column_gives_generation_and_prompt_and_no_prompt_share_on_zero_weights():
    """(b)'s roofline column: the tuned line's generation and prompt speed as shares of their ceilings; a zero-filled
    model's prompt share is not meaningful (its tied router copies k of E experts a ubatch), so it is not printed;
    a share above an even router's bound says that fewer experts were copied (issue 53)."""
    from gpucheck import table as gpu_table

    def render(weights: str, prompt_pct: float) -> str:
        win = {"label": "candidate-1", "launch_line": "a", "gen_tok_s": 40.0, "prompt_tok_s": 900.0,
               "roofline_pct": 41.6, "prompt_roofline_pct": prompt_pct}
        state = {"steps": {"model": {"status": "done", "result": {"weights": weights}},
                           "tune-12g-chat": {"status": "done", "result": {"free_mib": 12288, "workload": "chat",
                                                                          "ctx": 8192, "tune": {"winner": win}}}}}
        return gpu_table.render(state)[0]

    assert "roofline % gen / prompt" in render("random", 63.2)
    assert "| 42 / 63 |" in render("random", 63.2)
    assert "| 42 / n/m (zero weights) |" in render("zero", 163.2)
    assert "| 42 / 109 (fewer experts copied than an even router uses) |" in render("random", 109.0)


def test_the_pack_keeps_paths_longer_than_100_characters_inside_the_tree(tmp_path):
    """The sdist is a PAX archive: a member's long name travels in its PAX "path" header, which tarfile wrote back
    over the trimmed name, so every CUDA template instance kept the sdist's prefix and the first lease's
    configure failed ("FlashAttention template instance … does not exist")."""
    from gpucheck import pack as gpu_pack

    rel = "ggml/src/ggml-cuda/template-instances/fattn-vec-instance-f16-f16.cu"
    prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    assert len(prefix + rel) > 100
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name in (prefix + "CMakeLists.txt", prefix + rel):
            data = b"// instance\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    gpu_pack.trim_sdist(sdist, tmp_path / "tree.tar.gz")
    with tarfile.open(tmp_path / "tree.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["CMakeLists.txt", rel]


def test_a_new_lease_measures_again_the_steps_it_names_from_a_carried_state(tmp_path):
    """The second H100 lease's state (results/benchmarks/gpu-nvidia-h100-80gb-hbm3.json): every step done, the speed
    steps on zero weights. Those are measured again on valid weights (their results kept under ``earlier``);
    ``--again`` plans named steps anew, and the first command of the plan names both --state and --again."""
    from gpucheck import check as gpu_check

    state = REPO / "results" / "benchmarks" / "gpu-nvidia-h100-80gb-hbm3.json"
    again = "memory-12g,spill-oom"
    plain = _run("--dry-run", "--state", str(state), "--out", str(tmp_path / "a"), cache=tmp_path / "cache")
    assert plain.returncode == 0, plain.stderr
    assert not {"memory-12g", "spill-oom"} & {n for c in _dry_run_commands(plain.stdout) for _, n, _ in c["steps"]}  # type: ignore[union-attr]
    res = _run("--dry-run", "--state", str(state), "--again", again, "--out", str(tmp_path / "b"),
               cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr
    planned = [n for c in _dry_run_commands(res.stdout) for _, n, _ in c["steps"]]  # type: ignore[union-attr]
    later = [ln.split()[1] if ln.startswith("  (") else ln.split()[0] for ln in
             res.stdout.split("later leases")[1].split("each versus step")[0].splitlines()[1:] if ln.strip()]
    assert "memory-12g" in planned and {"memory-12g", "spill-oom"} <= set(planned + later)  # as the lease leaves room
    assert f"--state {state} --again {again}" in res.stdout.split("command 1: ")[1].splitlines()[0]
    c = gpu_check.Check(gpu_check.parse_args(["--state", str(state), "--out", str(tmp_path / "c")]))
    assert {"tune-12g-agent", "opoff-12g-agent", "budget-8g"} <= set(c.state["earlier"])
    assert "opoff-12g-agent" not in c.state["steps"] and c.state["steps"]["memory-12g"]["status"] == "done"


def test_the_pack_carries_the_cuda_engine_built_here_without_the_toolkits_libraries(tmp_path, monkeypatch):
    """`--pack DIR --engine 90`: the managed CUDA build whose identity (pin, flags, architecture, toolkit) is the
    one the lease asks for goes into DIR/engine; the copies of cudart and cuBLAS beside its binaries stay behind
    (the GPU machine links its own), and a build for another architecture is not taken."""
    from gpucheck import engine as gpu_engine
    from gpucheck import pack as gpu_pack

    from tuner.engine import build

    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOE_TUNE_CUDA_FROM", "installed")
    root = tmp_path / "cache" / "engine"

    def managed(name: str, arch: str) -> Path:
        bin_dir = root / name / "bin"
        bin_dir.mkdir(parents=True)
        for tool in gpu_engine.CHECK_TOOLS:
            (bin_dir / tool).write_bytes(os.urandom(2000))
        (bin_dir / "libggml-cuda.so").write_bytes(os.urandom(4000))
        (bin_dir / "libcublas.so.13").write_bytes(os.urandom(8000))  # copied in by `engine install`
        (bin_dir / "libcudart.so.13").write_bytes(os.urandom(1000))
        (bin_dir / "libcudart.so").symlink_to("libcudart.so.13")
        (root / name / build.STAMP_NAME).write_text(json.dumps(
            {"identity": gpu_engine.identity(arch)["cmake_flags"], "build_s": 1642.0}))
        return bin_dir

    managed("cuda-89", "89")
    with pytest.raises(gpu_pack.UsageError, match="no CUDA engine for arch 90"):
        gpu_pack.pack_engine(tmp_path / "pack", "90")
    managed("cuda-90", "90")
    res = gpu_pack.pack_engine(tmp_path / "pack", "90")
    assert res["packed"]
    meta = json.loads((tmp_path / "pack" / "engine" / gpu_engine.META).read_text())
    assert meta["arch"] == "90" and meta["build"]["build_s"] == 1642.0
    assert any(f.startswith("toolkit=installed-") for f in meta["cmake_flags"])
    restored = tmp_path / "lease" / "bin"
    assert gpu_engine.restore(tmp_path / "pack" / "engine", restored, gpu_engine.identity("90")) is not None
    assert sorted(p.name for p in restored.iterdir()) == sorted([*gpu_engine.CHECK_TOOLS, "libggml-cuda.so"])


def test_speed_steps_measure_on_valid_weights_and_memory_on_zero_weights(tmp_path):
    """Zero weights tie the router (every token takes the same experts): the memory check alone uses them; the
    valid-weight model is written before the first speed step, and the table says per step which model it used."""
    from gpucheck import table as gpu_table

    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps({"machine": {}, "steps": {}}))
    res = _run("--dry-run", "--state", str(fresh), cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr
    lease = res.stdout.split("without a GPU")[0]
    planned = [line for line in lease.splitlines() if re.match(r"  (\(\w\) |    )\S", line)]
    names = [line.split()[1] if line.startswith("  (") else line.split()[0] for line in planned]
    assert names.index("model-valid") < names.index("search-12g-agent")
    assert names.index("model") < names.index("memory-12g")
    for line, name in zip(planned, names, strict=True):
        if name == "memory-12g":
            assert line.endswith("[zero weights]")
        elif line.startswith(("  (b)", "  (c)", "  (d)")):
            assert line.endswith("[valid weights]"), line
    done = {"status": "done", "took_s": 3.0}
    state = {"machine": {}, "steps": {
        "model": {**done, "result": {"target": "q:Q4_K_M", "path": "/z.gguf", "weights_label": "zero weights (x)"}},
        "model-valid": {**done, "result": {"target": "q:Q4_K_M", "path": "/v.gguf", "weights_label": "valid (y)"}},
        "memory-12g": {**done, "result": {"rows": [], "model_weights": "zero"}},
        "versus-12g-agent": {**done, "result": {"model_weights": "direct"}}}}
    md, doc = gpu_table.render(state)
    assert "| memory-12g | done | 3 | zero weights |" in md and "| versus-12g-agent | done | 3 | valid weights |" in md
    assert "- model for speed: q:Q4_K_M (valid (y)), /v.gguf" in md and doc["model_valid"]["path"] == "/v.gguf"


def test_a_rehearsal_says_what_it_will_spend_and_stops_at_the_first_cuda_call(tmp_path, monkeypatch, capsys):
    """Issue 67: `--rehearse` runs a command as the lease would and ends at its first CUDA call, which a machine
    without a GPU cannot make, recording where; on start the command says which steps it plans and their seconds.
    A step with a carry of its own is left for the next command (its device call carries that folder)."""
    from gpucheck import check as gpu_check
    from gpucheck.steps import Step

    ran: list[str] = []

    def plain(name: str):
        def run(c):
            ran.append(name)
            return {}
        return run

    def first_cuda(c):
        ran.append("search")
        c.cuda_call("the VRAM ballast (cudaMalloc)")
        ran.append("after the CUDA call")
        return {}

    steps = [Step("gpu-info", True, 1, plain("gpu-info"), "card"), Step("wheels", True, 2, plain("wheels"), "wheels"),
             Step("search-12g-agent", True, 51, first_cuda, "search", "b"), Step("versus", True, 105, plain("v"), "v")]
    monkeypatch.setattr(gpu_check, "steps_for", lambda c: steps)
    c = gpu_check.Check(gpu_check.parse_args(["--rehearse", "--out", str(tmp_path / "out"), "--time-limit", "540"]))
    c.has_gpu = True
    assert gpu_check.run_steps(c) == 0
    assert ran == ["gpu-info", "wheels", "search"]
    err = capsys.readouterr().err
    assert "this command plans gpu-info, wheels, search-12g-agent, versus: ~159 s of its 540 s --time-limit" in err
    assert "rehearsal stops in search-12g-agent after" in err and "the VRAM ballast (cudaMalloc)" in err
    (stop,) = c.state["rehearsal"]
    assert stop["step"] == "search-12g-agent" and stop["first_cuda_call"] == "the VRAM ballast (cudaMalloc)"
    assert [n for n, s in c.state["steps"].items() if s["status"] == "done"] == ["gpu-info", "wheels"]

    ran.clear()
    steps[:] = [Step("race", True, 5, plain("race"), "r", "e"),
                Step("ik-engine", True, 5, plain("ik-engine"), "ik", "e", carry=".gpu-pack-ik")]
    c2 = gpu_check.Check(gpu_check.parse_args(["--rehearse", "--out", str(tmp_path / "out2"), "--time-limit", "540"]))
    c2.has_gpu = True
    assert gpu_check.run_steps(c2) == gpu_check.EXIT_CONTINUE and ran == ["race"]
    assert "stopping before ik-engine: its command carries .gpu-pack-ik" in capsys.readouterr().err
    assert not list((REPO / "results" / "benchmarks").glob("gpu-cpu.*"))  # a rehearsal keeps no card's figures


def test_the_race_sizes_ik_by_the_plan_with_a_margin_and_says_when_nothing_fits(tmp_path):
    """(e): ik_llama.cpp's line at a budget is every layer on the card and the experts of the fewest first layers the
    plan fits in RAM, plus IK_MARGIN_LAYERS; where nothing fits, no line and why."""
    from types import SimpleNamespace

    from gpucheck import race as gpu_race

    from tuner.engine.kinds import IK_LLAMA

    rows = [{"n_cpu_moe": n, "verdict": "fits" if n >= 30 else "needs spill"} for n in range(49)]
    asked: list[tuple[str, ...]] = []
    c = SimpleNamespace(cli=lambda *argv: asked.append(argv) or {"rows": rows})
    line, sized = gpu_race.ik_line(c, tmp_path / "m.gguf", 8)  # type: ignore[arg-type]
    assert asked == [("plan", str(tmp_path / "m.gguf"), "-c", "32768", "-np", "1", "-fa", "on", "--vram-budget",
                      "8192")]
    assert line is not None and line.engine == IK_LLAMA.name and line.n_gpu_layers == 999
    assert line.n_cpu_moe == 30 + gpu_race.IK_MARGIN_LAYERS and sized == {"planned_n_cpu_moe": 30, "n_cpu_moe": 32}
    c = SimpleNamespace(cli=lambda *argv: {"rows": [{"n_cpu_moe": 0, "verdict": "needs spill"}]})
    line, sized = gpu_race.ik_line(c, tmp_path / "m.gguf", 8)  # type: ignore[arg-type]
    assert line is None and "nothing fits 8 GiB" in sized["note"]
    state = {"steps": {"race-8g-agent": {"status": "done", "result": {
        "budget_mib": 8192, "verdict": {"rounds": 6, "ratio": 1.2, "low": 1.1, "high": 1.3, "outcome": "better"},
        "scores": {"tuned": [0.2] * 6, "default": [0.1] * 6},
        "arms": {"tuned": {"launch_line": "ik-server -ngl 999"}, "default": {"launch_line": "llama-server"}}}}}}
    md = "\n".join(gpu_race.markdown(state))
    assert "| race-8g-agent | 6 | 5.00 | 10.00 | 1.20x | 1.10-1.30x | better |" in md
