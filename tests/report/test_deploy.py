"""`launch-line --format`: every format carries the flags the line was measured with; the systemd unit passes
`systemd-analyze verify`, the compose service the compose specification's own schema (check-jsonschema's vendored
copy), and what a format cannot carry is written into it."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from tests.conftest import run_cli
from tests.demo_result import measured_flags, tune_demo, variant
from tuner.report import deploy, study_report

CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


@pytest.fixture(scope="module")
def tuned(engine_loc, tmp_path_factory) -> Path:
    return tune_demo(engine_loc, tmp_path_factory.mktemp("tuned"))


def yaml_doc(text: str):
    return YAML(typ="safe").load(io.StringIO(text))


def exec_start(unit: str) -> list[str]:
    """ExecStart's words as systemd reads them: specifiers and variables undoubled, C-style quotes."""
    [line] = [x for x in unit.splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$"))


def launch(result: Path, *args: str, env: dict[str, str] | None = None) -> str:
    res = run_cli("launch-line", str(result), *args, env={"CUDA_VISIBLE_DEVICES": "", **(env or {})})
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("rank", [1, 2])
def test_every_format_carries_the_measured_flags(tuned, engine_loc, rank):
    pick = study_report.picks(study_report.load_result(tuned))[rank - 1]
    flags = measured_flags(tuned, pick.label)
    model = Path(pick.config["model"])
    r = ["--rank", str(rank)]
    assert shlex.split(launch(tuned, *r)) == ["llama-server", *flags]
    assert json.loads(launch(tuned, *r, "--format", "json"))["argv"] == ["llama-server", *flags]
    swap = yaml_doc(launch(tuned, *r, "--format", "llama-swap"))
    assert shlex.split(swap["models"][model.stem]["cmd"]) == ["llama-server", *flags, "--port", "${PORT}"]
    unit = launch(tuned, *r, "--format", "systemd")
    assert exec_start(unit) == [str(engine_loc.tool("llama-server")), *flags]
    compose = yaml_doc(launch(tuned, *r, "--format", "compose"))
    [service] = compose["services"].values()
    inside = [f"/models/{model.name}" if a == str(model) else a for a in flags]
    assert service["command"] == [*inside, "--host", "0.0.0.0", "--port", "8080"]


def test_service_formats_serve_the_model_by_its_file_name_not_its_path(tuned):
    """llama-server names the model by its path unless given an alias (server-context.cpp): a service's clients
    see the file's name instead, set by environment (LLAMA_ARG_ALIAS) so the command stays the measured one."""
    stem = Path(json.loads(tuned.read_text())["model"]).stem
    unit = launch(tuned, "--format", "systemd")
    assert f"Environment=LLAMA_ARG_ALIAS={stem}" in unit.splitlines()
    [service] = yaml_doc(launch(tuned, "--format", "compose"))["services"].values()
    assert service["environment"]["LLAMA_ARG_ALIAS"] == stem
    swap = yaml_doc(launch(tuned, "--format", "llama-swap"))
    assert f"LLAMA_ARG_ALIAS={stem}" in swap["models"][stem]["env"]
    assert "LLAMA_ARG_ALIAS" not in launch(tuned)  # the shell line is the measured command, as it was measured


def test_systemd_unit_passes_systemd_analyze_verify(tuned, engine_loc, tmp_path):
    """A model path with a space, a `%` and a `$` (systemd's specifier and variable signs) still reaches the
    engine as one argument; the unit restarts on failure, starts with the user's session and names the card."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (systemd's own check of the unit)")
    odd = tmp_path / "my models 100% $HOME" / "demo.gguf"
    odd.parent.mkdir()
    odd.symlink_to(Path(json.loads(tuned.read_text())["model"]))
    result = variant(tuned, tmp_path / "results" / "odd", model=odd)
    unit = launch(result, "--format", "systemd", "--port", "8123", env={"CUDA_VISIBLE_DEVICES": "1"})
    words = exec_start(unit)
    assert words[0] == str(engine_loc.tool("llama-server")) and Path(words[0]).is_absolute()
    label = study_report.picks(study_report.load_result(result))[0].label
    assert words[1:] == [*measured_flags(result, label), "--port", "8123"]
    assert str(odd) in words
    lines = unit.splitlines()
    assert {"Restart=on-failure", "WantedBy=default.target", "Environment=CUDA_VISIBLE_DEVICES=1"} <= set(lines)
    file = tmp_path / "llama-server.service"
    file.write_text(unit)
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    check = subprocess.run(["systemd-analyze", "--user", "verify", str(file)], capture_output=True, text=True,
                           env=os.environ | {"XDG_RUNTIME_DIR": str(runtime)}, timeout=60)
    assert check.returncode == 0, check.stderr
    file.write_text(unit.replace("ExecStart=", "ExecStrat="))  # the check can fail
    broken = subprocess.run(["systemd-analyze", "--user", "verify", str(file)], capture_output=True, text=True,
                            env=os.environ | {"XDG_RUNTIME_DIR": str(runtime)}, timeout=60)
    assert broken.returncode != 0


def compose_valid(text: str, where: Path) -> subprocess.CompletedProcess[str]:
    where.write_text(text)
    return subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(where)],
                          capture_output=True, text=True, timeout=120)


def as_gpu_result(d: dict) -> None:
    d["engine"] = {**d["engine"], "backend": "cuda"}
    d["hardware"] = {**d["hardware"], "has_gpu": True, "gpu": "NVIDIA GeForce RTX 3060",
                     "vram_total_bytes": 12 * 2**30, "vram_budget_bytes": 11 * 2**30}


def test_compose_service_passes_the_compose_specification(tuned, tmp_path):
    gpu = variant(tuned, tmp_path / "results" / "gpu", as_gpu_result)
    text = launch(gpu, "--format", "compose", "--port", "9000", env={"CUDA_VISIBLE_DEVICES": "0"})
    check = compose_valid(text, tmp_path / "compose.yaml")
    assert check.returncode == 0, check.stdout + check.stderr
    [service] = yaml_doc(text)["services"].values()
    model = Path(json.loads(tuned.read_text())["model"])
    assert service["image"] == "ghcr.io/ggml-org/llama.cpp:server-cuda"
    assert service["volumes"] == [{"type": "bind", "source": str(model.parent), "target": "/models",
                                   "read_only": True}]
    assert service["ports"] == ["127.0.0.1:9000:8080"]
    assert service["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert "# not carried: the measured engine: the image runs its own llama.cpp build, not llama.cpp" in text
    # The validator is the compose specification's, not a rubber stamp: a misspelt key fails it.
    bad = compose_valid(text.replace("    ports:", "    portz:"), tmp_path / "bad.yaml")
    assert bad.returncode != 0 and "portz" in bad.stdout


def test_a_cpu_result_gets_the_cpu_image_and_says_no_card_is_reserved(tuned, tmp_path):
    text = launch(tuned, "--format", "compose", "--host", "0.0.0.0")
    assert compose_valid(text, tmp_path / "compose.yaml").returncode == 0
    [service] = yaml_doc(text)["services"].values()
    assert service["image"] == "ghcr.io/ggml-org/llama.cpp:server" and "deploy" not in service
    assert service["ports"] == ["0.0.0.0:8080:8080"]
    assert "# not carried: a GPU: the line was measured on a CPU build" in text


def test_services_get_the_card_the_shell_keeps_its_own(tuned):
    """A service does not inherit the shell's environment: llama-swap carries CUDA_VISIBLE_DEVICES in its env
    list; the shell line stays the printed line (the shell it is pasted into has its own environment)."""
    swap = yaml_doc(launch(tuned, "--format", "llama-swap", env={"CUDA_VISIBLE_DEVICES": "1"}))
    [entry] = swap["models"].values()
    stem = Path(json.loads(tuned.read_text())["model"]).stem
    assert entry["env"] == ["CUDA_VISIBLE_DEVICES=1", f"LLAMA_ARG_ALIAS={stem}"]
    assert launch(tuned, env={"CUDA_VISIBLE_DEVICES": "1"}).startswith("llama-server -m ")


def test_an_unknown_format_is_one_line_naming_the_formats(tuned):
    res = run_cli("launch-line", str(tuned), "--format", "ollama")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "shell, llama-swap, systemd, compose, preset, json" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", deploy.FORMATS)
def test_the_prompt_side_levers_travel_in_every_format(fmt):
    """Op offload off and --no-host are part of the measured line: every output format carries them (issue 43)."""
    from tuner.core.config import LaunchConfig

    cfg = LaunchConfig(model=Path("/models/m.gguf"), ctx=8192, n_cpu_moe=20, op_offload=False, no_host=True)
    text = deploy.render(deploy.Line(cfg, "tuned", "study"), fmt, port=8080, binary="/opt/llama/llama-server").text
    if fmt == "preset":  # an INI key per flag, dashes dropped (common/preset.cpp)
        assert "\nno-op-offload = true\n" in text and "\nno-host = true\n" in text
    else:
        assert "--no-op-offload" in text and "--no-host" in text, fmt


@pytest.mark.parametrize("fmt", deploy.FORMATS)
def test_the_load_mode_travels_in_every_format(fmt):
    """--load-mode none (pinned host experts, issue 53) is part of the measured line: every output format hands it
    to llama-server, in the spelling that format's reader takes; the default (mmap) adds nothing."""
    from tuner.core.config import LaunchConfig

    cfg = LaunchConfig(model=Path("/models/m.gguf"), ctx=8192, n_cpu_moe=20, mmap=False)
    text = deploy.render(deploy.Line(cfg, "tuned", "study"), fmt, port=8080, binary="/opt/llama/llama-server").text
    mapped = deploy.render(deploy.Line(LaunchConfig(model=cfg.model, ctx=8192, n_cpu_moe=20), "tuned", "study"), fmt,
                           port=8080, binary="/opt/llama/llama-server").text
    if fmt == "preset":  # an INI key per flag, any of its spellings without dashes (common/preset.cpp)
        assert "\nlm = none\n" in text and "lm =" not in mapped
    elif fmt in ("compose", "json"):  # argv as a list: the flag, then its value
        argv, plain = ([*yaml_doc(t)["services"].values()][0]["command"] if fmt == "compose" else json.loads(t)["argv"]
                       for t in (text, mapped))
        assert argv[argv.index("-lm") + 1] == "none" and "-lm" not in plain
    else:
        assert " -lm none " in text and "-lm" not in mapped, fmt


def _threshold_in(fmt: str, rendered: deploy.Rendered) -> str | None:
    """GGML_OP_OFFLOAD_MIN_BATCH as each format hands it to the engine (read the way that format's reader does)."""
    text = rendered.text
    if fmt == "shell":
        words = shlex.split(text)
        return dict(w.split("=", 1) for w in words[:words.index("/opt/llama/llama-server")]).get(
            "GGML_OP_OFFLOAD_MIN_BATCH")
    if fmt == "json":
        return json.loads(text)["env"].get("GGML_OP_OFFLOAD_MIN_BATCH")
    if fmt == "llama-swap":
        [entry] = yaml_doc(text)["models"].values()
        return dict(e.split("=", 1) for e in entry.get("env", [])).get("GGML_OP_OFFLOAD_MIN_BATCH")
    if fmt == "systemd":
        envs = [shlex.split(x.removeprefix("Environment="))[0] for x in text.splitlines()
                if x.startswith("Environment=")]
        return dict(e.split("=", 1) for e in envs).get("GGML_OP_OFFLOAD_MIN_BATCH")
    if fmt == "compose":
        [service] = yaml_doc(text)["services"].values()
        return service.get("environment", {}).get("GGML_OP_OFFLOAD_MIN_BATCH")
    assert fmt == "preset", fmt  # the router's environment is its children's: written in, and said not carried
    said = [n for n in rendered.not_carried if n.startswith("GGML_OP_OFFLOAD_MIN_BATCH=")]
    return said[0].split("=", 1)[1] if said and said[0] in text else None


@pytest.mark.parametrize("fmt", deploy.FORMATS)
def test_the_op_offload_threshold_travels_in_every_format(fmt):
    """GGML_OP_OFFLOAD_MIN_BATCH is part of the measured line though the engine reads it from its environment: each
    format hands it to the engine as that format sets an environment (or, for a preset, says it must be set)."""
    from tuner.core.config import LaunchConfig

    cfg = LaunchConfig(model=Path("/models/m.gguf"), ctx=8192, n_cpu_moe=20, ubatch=4096, batch=4096,
                       op_offload_min_batch=512)
    line = deploy.Line(cfg, "tuned", "study")
    rendered = deploy.render(line, fmt, port=8080, binary="/opt/llama/llama-server")
    assert _threshold_in(fmt, rendered) == "512"
    plain = deploy.render(deploy.Line(LaunchConfig(model=cfg.model), "tuned", "study"), fmt, port=8080,
                          binary="/opt/llama/llama-server")
    assert _threshold_in(fmt, plain) is None and "GGML_OP_OFFLOAD_MIN_BATCH" not in plain.text


def test_a_preset_is_loaded_by_the_pinned_llama_servers_router(engine_loc, demo_models, tmp_path):
    """launch-line --format preset writes a section llama-server's router reads (--models-preset, common/preset.cpp
    load_from_ini): the router lists the model and the arguments it would start it with are the measured line's."""
    import socket
    import time
    import urllib.request

    from tuner.core.config import FlashAttn, LaunchConfig
    from tuner.engine import flags

    model = demo_models[("qwen3moe", "Q4_K_M")]
    cfg = LaunchConfig(model=model, ctx=2048, parallel=1, n_cpu_moe=0, flash_attn=FlashAttn.ON, op_offload=False,
                       no_host=True, cache_ram_mib=0)
    ini = tmp_path / "presets.ini"
    ini.write_text(deploy.render(deploy.Line(cfg, "tuned", "study"), "preset").text)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    router = subprocess.Popen([str(engine_loc.tool("llama-server")), "--models-preset", str(ini), "--host",
                               "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        listed = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/models", timeout=2) as r:
                    listed = json.load(r)
                break
            except OSError:
                time.sleep(0.1)
        assert listed is not None, "the router did not answer"
        (entry,) = listed["data"]
        assert entry["id"] == model.stem and entry["source"] == "preset"
        args = entry["status"]["args"]
        words, i = [], 1
        while i < len(args):  # the router's own --host/--port/--alias: where it runs, not what
            if args[i] in ("--host", "--port", "--alias"):
                i += 2
                continue
            words.append(args[i])
            i += 1
        assert flags.parse_command(shlex.join(["llama-server", *words])).config == cfg
    finally:
        router.terminate()
        router.wait(timeout=10)
