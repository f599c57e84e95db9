"""The one renderer: LaunchConfig → argv for llama-bench and llama-server, and the launch line."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tuner import flags
from tuner.config import CacheType, FlashAttn, LaunchConfig
from tuner.errors import UsageError

MODEL = Path("/models/Qwen3-30B-A3B-Q4_K_M.gguf")


def test_defaults_render_no_flags():
    assert flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL)) == ["llama-server", "-m", str(MODEL)]


def test_server_and_bench_spell_the_same_config():
    cfg = LaunchConfig(model=MODEL, n_cpu_moe=20, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
                       flash_attn=FlashAttn.ON, ctx=32768, parallel=2, threads=8, ubatch=1024)
    server = flags.server_argv(Path("llama-server"), cfg)
    assert server == ["llama-server", "-m", str(MODEL), "-c", "32768", "-np", "2", "--n-cpu-moe", "20",
                      "-ctk", "q8_0", "-ctv", "q8_0", "-t", "8", "-ub", "1024", "-fa", "on"]
    bench = flags.bench_argv(Path("llama-bench"), cfg, n_prompt=512, n_gen=128, repetitions=3, depth=4096)
    assert bench[-2:] == ["-o", "jsonl"]
    assert "-c" not in bench  # llama-bench has no context flag; depth stands in
    assert bench[bench.index("-d") + 1] == "4096"
    assert bench[bench.index("-ncmoe") + 1] == "20"
    assert bench[bench.index("-fa") + 1] == "on"


def test_launch_line_round_trips_through_a_shell():
    cfg = LaunchConfig(model=Path("/my models/x.gguf"), ctx=8192)
    line = flags.launch_line(cfg)
    assert shlex.split(line) == ["llama-server", "-m", "/my models/x.gguf", "-c", "8192"]


def test_quantized_v_without_flash_attention_is_refused():
    cfg = LaunchConfig(model=MODEL, cache_type_v=CacheType.Q4_0, flash_attn=FlashAttn.OFF)
    with pytest.raises(UsageError, match="needs flash attention"):
        flags.server_argv(Path("llama-server"), cfg)
    with pytest.raises(UsageError):
        flags.bench_argv(Path("llama-bench"), cfg, n_prompt=1, n_gen=1, repetitions=1)


@pytest.mark.parametrize("field,value", [("n_cpu_moe", -1), ("ctx", 0), ("parallel", 0)])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(UsageError, match=field):
        flags.validate(LaunchConfig(model=MODEL, **{field: value}))
