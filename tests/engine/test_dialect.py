"""Each engine's dialect: one LaunchConfig rendered for llama.cpp or ik_llama.cpp, ik's lines read back, and a line
refused where its engine does not read a setting. The spellings are ik_llama.cpp's own (its common/common.cpp
parser and examples/llama-bench's usage text, in the ik-llama-cpp-python 0.1.5 sdist); tests/engine/test_ik.py holds
them against the built binaries' --help."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UnsupportedFlagError
from tuner.engine import build, flags
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP, kind_named, kind_of_flags, kinds_named

MODEL = Path("/models/Qwen3-30B-A3B-Q4_K_M.gguf")
IK = IK_LLAMA.name


def ik(**changes: object) -> LaunchConfig:
    return LaunchConfig(model=MODEL, engine=IK, **changes)  # type: ignore[arg-type]


def test_engines_are_named_as_users_write_them():
    assert kind_named("ik") is IK_LLAMA and kind_named("ik_llama.cpp") is IK_LLAMA
    assert kind_named("llama.cpp") is LLAMA_CPP
    assert kinds_named("llama.cpp,ik,llama.cpp") == (LLAMA_CPP, IK_LLAMA)
    with pytest.raises(Exception, match="unknown engine 'vllm': use llama.cpp or ik"):
        kind_named("vllm")


def test_a_build_is_known_by_the_flags_it_lists_not_its_folder():
    # ik's server lists -ser and -amb (its common.cpp); llama.cpp's lists neither.
    assert kind_of_flags({"llama-server": ("-m", "-ser", "-amb")}) is IK_LLAMA
    assert kind_of_flags({"llama-server": ("-m", "--n-cpu-moe", "--fit")}) is LLAMA_CPP


def test_ik_server_line_carries_its_levers_and_no_fit_off():
    cfg = ik(ctx=8192, parallel=1, n_cpu_moe=0, threads=2, run_time_repack=True, mmap=False, fused_moe=False,
             merge_up_gate=True, attn_max_batch=512, graph_reuse=False, only_active_experts=False)
    argv = flags.server_argv(Path("llama-server"), cfg)
    # --n-cpu-moe 0 would make llama.cpp's --fit move experts (--fit off is added there); ik's fit is off unless given
    assert "--fit" not in argv
    assert argv[argv.index("--n-cpu-moe") + 1] == "0"
    for flag in ("--run-time-repack", "-no-fmoe", "-muge", "-no-gr", "-no-ooae"):
        assert flag in argv
    assert argv[argv.index("-amb") + 1] == "512"
    assert "--no-mmap" not in argv  # -rtr loads without mmap by itself (ik's common.cpp sets use_mmap false)
    llama = flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL, n_cpu_moe=0))
    assert llama[-2:] == ["--fit", "off"]


def test_loading_without_mmap_is_spelled_per_engine():
    assert flags.server_argv(Path("s"), ik(mmap=False))[-1] == "--no-mmap"
    assert flags.server_argv(Path("s"), LaunchConfig(model=MODEL, mmap=False))[-2:] == ["-lm", "none"]


def test_a_lever_that_loads_without_mmap_makes_the_line_unmapped_wherever_it_is_read():
    """-rtr loads ik's weights into its own buffers (its common.cpp sets ``use_mmap = false`` with it): the kind says
    so (EngineKind.maps_model), and the server line, the bench run and a pasted line all follow it, whatever the
    config's own mmap field says."""
    rtr = ik(run_time_repack=True)  # mmap left at True: -rtr overrides it
    assert not IK_LLAMA.maps_model(rtr) and IK_LLAMA.maps_model(ik()) and not IK_LLAMA.maps_model(ik(mmap=False))
    assert LLAMA_CPP.maps_model(LaunchConfig(model=MODEL)) and not LLAMA_CPP.maps_model(LaunchConfig(model=MODEL,
                                                                                                    mmap=False))
    for cfg in (rtr, ik(run_time_repack=True, mmap=False)):
        argv = flags.server_argv(Path("s"), cfg)
        assert "--run-time-repack" in argv and "--no-mmap" not in argv, argv
    # One bench run: both load the same way (unmapped), whatever their mmap fields say.
    both = [rtr, ik(run_time_repack=True, mmap=False, cache_type_k=CacheType.Q8_0)]
    argv = flags.bench_group_argv(Path("llama-bench"), both, n_prompt=8, n_gen=8, repetitions=1)
    assert argv[argv.index("-rtr") + 1] == "1" and "-mmp" not in argv
    # Read back: a pasted -rtr line is a line without mmap, and renders as pasted.
    back = flags.parse_command(f"llama-server -m {MODEL} -rtr").config
    assert back == ik(run_time_repack=True, mmap=False) and not IK_LLAMA.maps_model(back)
    assert flags.launch_line(back) == f"llama-server -m {MODEL} --run-time-repack"


def test_ik_bench_states_the_server_default_and_times_depth_its_own_way():
    cfgs = [ik(threads=2, cache_type_k=k, flash_attn=FlashAttn.ON, run_time_repack=True, mmap=False)
            for k in (CacheType.F16, CacheType.Q8_0)]
    argv = flags.bench_group_argv(Path("llama-bench"), cfgs, n_prompt=64, n_gen=16, repetitions=2, depth=[0, 256])
    # no -d: a prompt at depth 256 is 256 and 320 tokens from an empty cache; generation at 256 is -gp 256,16
    assert argv[argv.index("-p") + 1] == "64,256,320"
    assert argv[argv.index("-n") + 1] == "16"
    assert argv[argv.index("-gp") + 1] == "256,16"
    assert argv[argv.index("-ngl") + 1] == "0"  # ik's server offloads nothing by default; its bench 999
    assert argv[argv.index("-rtr") + 1] == "1"
    assert "-fa" not in argv  # on in both its bench and its server
    assert argv[argv.index("-ctk") + 1] == "f16,q8_0"
    assert argv[-3:] == ["-v", "-o", "json"] and "-d" not in argv and "-mmp" not in argv


def test_ik_bench_takes_numbers_where_llama_bench_takes_words():
    off = flags.bench_argv(Path("b"), ik(flash_attn=FlashAttn.OFF, mmap=False, fused_moe=False),
                           n_prompt=8, n_gen=8, repetitions=1)
    assert off[off.index("-fa") + 1] == "0" and off[off.index("-mmp") + 1] == "0"
    assert off[off.index("-fmoe") + 1] == "0"
    llama = flags.bench_argv(Path("b"), LaunchConfig(model=MODEL, flash_attn=FlashAttn.OFF), n_prompt=8, n_gen=8,
                             repetitions=1)
    assert llama[llama.index("-fa") + 1] == "off"


@pytest.mark.parametrize("changes,named", [
    ({"repack": False}, "--no-repack"), ({"op_offload": False}, "--no-op-offload"), ({"no_host": True}, "--no-host"),
    ({"fit_target_mib": 2048}, "-fitt"), ({"cache_reuse": 256}, "--cache-reuse")])
def test_llama_cpp_settings_are_refused_in_an_ik_line(changes, named):
    with pytest.raises(UnsupportedFlagError, match="ik_llama.cpp"):
        flags.server_argv(Path("llama-server"), ik(**changes))
    assert named in flags.launch_line(LaunchConfig(model=MODEL, **changes))  # llama.cpp reads it


def test_ik_levers_are_refused_in_a_llama_cpp_line():
    with pytest.raises(UnsupportedFlagError, match="llama.cpp does not read --run-time-repack: it is ik_llama.cpp's"):
        flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL, run_time_repack=True))


def test_a_line_for_one_engine_is_refused_on_the_other():
    ik_caps = build.Capabilities("0", "0", "x", "cpu", (), {"llama-server": ("-m", "-ser", "-amb")})
    with pytest.raises(UnsupportedFlagError, match="this line is llama.cpp's and the engine here is ik_llama.cpp"):
        flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL), ik_caps)


def test_an_ik_line_reads_back_as_rendered():
    cfg = ik(ctx=4096, parallel=1, threads=2, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
             flash_attn=FlashAttn.ON, run_time_repack=True, mmap=False, merge_up_gate=True, attn_max_batch=256,
             smart_experts=(6, 0.5), graph_reuse=False)
    line = flags.launch_line(cfg, "/opt/ik/bin/llama-server")
    back = flags.parse_command(line).config  # known as ik's by its levers
    assert back == cfg
    assert flags.launch_line(back, "/opt/ik/bin/llama-server") == line
    plain = ik(ctx=4096)  # no lever of its own: the engine is named by the caller
    assert flags.parse_command(flags.launch_line(plain), IK_LLAMA).config == plain
    assert flags.parse_command(flags.launch_line(plain)).config.engine == LLAMA_CPP.name


def test_an_ik_line_with_fit_is_refused_with_the_fix():
    with pytest.raises(Exception, match="--fit in an ik_llama.cpp line is not measured"):
        flags.parse_command(f"llama-server -m {MODEL} -rtr --fit")


def test_smart_expert_reduction_renders_as_ik_reads_it():
    argv = flags.server_argv(Path("s"), ik(smart_experts=(6, 0.5)))
    assert argv[-2:] == ["-ser", "6,0.5"]
    assert shlex.join(argv).endswith("-ser 6,0.5")
