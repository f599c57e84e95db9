"""The one renderer: LaunchConfig → argv for llama-bench and llama-server, and the launch line."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UnsupportedFlagError, UsageError
from tuner.engine import build, flags

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


# ------------------------------------------------------------------------------ capabilities and reverse

FULL = LaunchConfig(model=MODEL, n_cpu_moe=20, n_gpu_layers=99, cache_type_k=CacheType.Q8_0,
                    cache_type_v=CacheType.Q4_0, flash_attn=FlashAttn.ON, ctx=32768, parallel=2, threads=8,
                    threads_batch=16, batch=2048, ubatch=512, kv_unified=True, swa_full=True, mmap=False,
                    repack=False, cache_reuse=256, ctx_checkpoints=8, checkpoint_min_step=1024, cache_ram_mib=2048,
                    op_offload=False)


def _caps(server_flags: tuple[str, ...]) -> build.Capabilities:
    return build.Capabilities("test", "1", "abc", "cpu", (), {"llama-server": server_flags})


def test_the_spelling_the_binary_accepts_is_used():
    caps = _caps(("-m", "--model", "-ncmoe", "-c"))
    cfg = LaunchConfig(model=MODEL, n_cpu_moe=4, ctx=4096)
    assert flags.server_argv(Path("llama-server"), cfg, caps) == [
        "llama-server", "-m", str(MODEL), "-c", "4096", "-ncmoe", "4"]


def test_a_flag_the_binary_lacks_is_refused_before_launch():
    caps = _caps(("-m", "-c"))
    with pytest.raises(UnsupportedFlagError, match="does not accept --n-cpu-moe 4: update it"):
        flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL, n_cpu_moe=4), caps)


def test_every_setting_renders_with_flags_the_real_engine_accepts(engine_loc):
    caps = build.capabilities(engine_loc)
    assert flags.server_argv(Path("llama-server"), FULL, caps) == flags.server_argv(Path("llama-server"), FULL)
    bench = flags.bench_argv(Path("llama-bench"), FULL, n_prompt=8, n_gen=8, repetitions=1, depth=[0, 512],
                             caps=caps)
    assert bench[bench.index("-d") + 1] == "0,512" and bench[bench.index("--repack") + 1] == "0"
    assert bench[bench.index("-nopo") + 1] == "1"  # llama-bench's spelling of --no-op-offload
    ppl = flags.perplexity_argv(Path("llama-perplexity"), FULL, text_file=Path("t.txt"), ctx=512, caps=caps)
    assert "--kv-unified" in ppl and "-lm" in ppl and "--no-op-offload" in ppl


def test_pasted_command_round_trips_to_the_same_argv():
    line = flags.launch_line(FULL)
    parsed = flags.parse_command(line)
    assert parsed.config == FULL and parsed.ignored == ()
    assert flags.launch_line(parsed.config) == line


def test_pasted_command_with_aliases_line_breaks_and_noise():
    pasted = ("CUDA_VISIBLE_DEVICES=0 ./build/bin/llama-server \\\n  --model '/my models/x.gguf' -ncmoe 20 "
              "--ctx-size=32768 --parallel 2 --flash-attn on -ctk q8_0 -ctv q8_0 \\\n  --jinja --host 0.0.0.0 "
              "--port 8080 -ngl all --no-kv-unified --no-mmap")
    parsed = flags.parse_command(pasted)
    assert parsed.ignored == ("--jinja", "--host 0.0.0.0", "--port 8080")
    argv = flags.server_argv(Path("llama-server"), parsed.config)
    assert argv == ["llama-server", "-m", "/my models/x.gguf", "-c", "32768", "-np", "2", "-ngl", "999",
                    "--n-cpu-moe", "20", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "--no-kv-unified",
                    "-lm", "none"]
    assert flags.parse_command(shlex.join(argv)).config == parsed.config  # a fixed point


@pytest.mark.parametrize("pasted,needle", [
    ("llama-cli -m x.gguf", "must start with llama-server"),
    ("llama-server -c 4096", "no -m MODEL"),
    ("llama-server -m x.gguf -ot exps=CPU", "-ot in the pasted command is not something moe-tune measures"),
    ("llama-server -m x.gguf -fa maybe", "-fa takes on, off or auto"),
    ("llama-server -m x.gguf -c lots", "ctx must be a whole number"),
    ("llama-server -m x.gguf -ctv q8_0 -fa off", "needs flash attention"),
    ("llama-server -m 'x.gguf", "check its quotes"),
])
def test_bad_pasted_commands_are_one_line_usage_errors(pasted, needle):
    with pytest.raises(UsageError, match=needle) as info:
        flags.parse_command(pasted)
    assert "\n" not in str(info.value)


def test_bare_fa_from_older_builds_means_on():
    assert flags.parse_command("llama-server -m x.gguf -fa -c 512").config.flash_attn is FlashAttn.ON


def test_group_argv_uses_comma_lists_and_refuses_mixed_models():
    a = LaunchConfig(model=MODEL, flash_attn=FlashAttn.ON, threads=2)
    b = LaunchConfig(model=MODEL, flash_attn=FlashAttn.OFF, threads=2)
    argv = flags.bench_group_argv(Path("llama-bench"), [a, b], n_prompt=8, n_gen=8, repetitions=2, depth=[0, 64])
    assert argv[argv.index("-fa") + 1] == "on,off" and argv[argv.index("-t") + 1] == "2"
    with pytest.raises(UsageError, match="share the model file"):
        flags.bench_group_argv(Path("llama-bench"), [a, LaunchConfig(model=Path("/other.gguf"))], n_prompt=8,
                               n_gen=8, repetitions=1)


def test_ubatch_larger_than_batch_is_refused():
    with pytest.raises(UsageError, match="use -ub <= -b"):
        flags.validate(LaunchConfig(model=MODEL, batch=256, ubatch=512))


def test_fit_params_projects_the_server_config():
    cfg = LaunchConfig(model=MODEL, ctx=8192, cache_type_k=CacheType.Q8_0, flash_attn=FlashAttn.ON)
    argv = flags.fit_params_argv(Path("llama-fit-params"), cfg)
    assert argv[1:-3] == flags.server_argv(Path("llama-server"), cfg)[1:]
    assert argv[-3:] == ["-fitp", "on", "--log-jsonl"]
    with pytest.raises(UsageError, match="kv-unified"):
        flags.fit_params_argv(Path("llama-fit-params"), LaunchConfig(model=MODEL, kv_unified=True))


def test_prompt_reuse_settings_are_server_only_and_spelled_as_the_engine_takes_them():
    cfg = LaunchConfig(model=MODEL, cache_reuse=256, ctx_checkpoints=0, checkpoint_min_step=512, cache_ram_mib=-1)
    argv = flags.server_argv(Path("llama-server"), cfg)
    assert argv[3:] == ["--cache-reuse", "256", "-ctxcp", "0", "-cms", "512", "-cram", "-1"]
    # llama-fit-params takes none of them (common/arg.cpp: server examples only) and projects none of their cost.
    fit = flags.fit_params_argv(Path("llama-fit-params"), cfg)
    assert fit == ["llama-fit-params", "-m", str(MODEL), "-fitp", "on", "--log-jsonl"]
    ppl = flags.perplexity_argv(Path("llama-perplexity"), cfg, text_file=Path("t.txt"), ctx=512)
    assert "--cache-reuse" not in ppl and "-ctxcp" not in ppl
    long_only = _caps(("-m", "--ctx-checkpoints"))
    assert flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL, ctx_checkpoints=4), long_only)[3:] == [
        "--ctx-checkpoints", "4"]
    assert flags.server_accepts(long_only, "ctx_checkpoints") and not flags.server_accepts(long_only, "cache_reuse")
    with pytest.raises(UnsupportedFlagError, match="--cache-reuse 256"):
        flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL, cache_reuse=256), long_only)
    assert flags.spelled("ctx_checkpoints", 32) == "--ctx-checkpoints 32"
    pasted = flags.parse_command("llama-server -m x.gguf --swa-checkpoints 3 --checkpoint-min-step=64 --cache-ram 0")
    assert (pasted.config.ctx_checkpoints, pasted.config.checkpoint_min_step, pasted.config.cache_ram_mib) == (3, 64, 0)


@pytest.mark.parametrize(("field", "value"), [("cache_reuse", -1), ("ctx_checkpoints", -2),
                                              ("checkpoint_min_step", -1), ("cache_ram_mib", -2)])
def test_out_of_range_reuse_settings_are_refused(field, value):
    with pytest.raises(UsageError, match="must be >= 0|--cache-ram takes"):
        flags.validate(LaunchConfig(model=MODEL, **{field: value}))


def test_a_line_that_puts_every_expert_on_the_card_turns_fit_off():
    """llama.cpp's --fit (on by default) gives up on a placement the user set (-ngl, a tensor split, tensor
    overrides: common/fit.cpp, common_params_fit_impl) but --n-cpu-moe 0 sets no override (common/arg.cpp), so
    on a tight card fit moved experts to the host and the server ran another placement than the line (an H100
    lease, results/benchmarks/gpu-lease-1/README.md). Such a line carries --fit off; others stay as they were."""
    all_on_card = LaunchConfig(model=MODEL, ctx=8192, n_cpu_moe=0, flash_attn=FlashAttn.ON)
    argv = flags.server_argv(Path("llama-server"), all_on_card)
    assert argv[argv.index("--fit") + 1] == "off"
    batched = flags.batched_bench_argv(Path("llama-batched-bench"), all_on_card, n_prompt=8, n_gen=8, n_parallel=[1])
    assert batched[batched.index("--fit") + 1] == "off"
    for placed in (LaunchConfig(model=MODEL, n_cpu_moe=4), LaunchConfig(model=MODEL, n_gpu_layers=20),
                   LaunchConfig(model=MODEL, n_cpu_moe=0, n_gpu_layers=999), LaunchConfig(model=MODEL)):
        assert "--fit" not in flags.server_argv(Path("llama-server"), placed), placed
    # llama-fit-params with -fitp prints the config as given and never fits: no --fit there.
    assert "--fit" not in flags.fit_params_argv(Path("llama-fit-params"), all_on_card)
    # Read back: the line is a fixed point; a pasted --fit on is the default; --fit off alone means every layer.
    assert flags.parse_command(flags.launch_line(all_on_card)).config == all_on_card
    assert flags.parse_command("llama-server -m x.gguf --fit on -ncmoe 3").config.n_cpu_moe == 3
    assert flags.parse_command("llama-server -m x.gguf -fit off").config.n_gpu_layers == 999
    with pytest.raises(UsageError, match="--fit takes on or off"):
        flags.parse_command("llama-server -m x.gguf --fit maybe")


def test_the_real_server_accepts_fit_off(engine_loc):
    caps = build.capabilities(engine_loc)
    argv = flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL, n_cpu_moe=0), caps)
    assert "--fit" in argv or "-fit" in argv


def _fit_line(first_partial: int, n_layers: int) -> str:
    """A single-GPU llama-fit-params answer as common/fit.cpp builds it (``set_ngl_tensor_split_tbo``: the first
    layers whole on the GPU, then a partial layer whose overflow is ``get_overflow_pattern``'s LAYER_FRACTION_UP,
    then LAYER_FRACTION_MOE up to index ``n_layers``, the output layer counted in ``-ngl``) and fit-params.cpp
    prints it (``-c … -ngl … -ot "pattern=BUFT,…"``)."""
    parts = [rf"blk\.{first_partial}\.ffn_(gate|gate_up|down).*=CPU"]
    parts += [rf"blk\.{il}\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU" for il in range(first_partial + 1, n_layers + 1)]
    return f'-c 8192 -ngl {n_layers + 1} -ot "{",".join(parts)}"'


def test_the_fit_choice_counts_the_layers_it_puts_on_the_host_not_its_last_index():
    # On an H100 with 12 GiB free (results/benchmarks/gpu-lease-2: llama-server's own --fit, Qwen3-30B-A3B Q4_K_M,
    # 48 layers, -c 8192) the engine put 9,694 MiB of weights on CUDA0: 17,524 with every expert there, 784 with
    # none, so 348.75 MiB a layer and (17,524 - 9,694) / 348.75 = 22.5 layers' experts on the host: 22 whole
    # (26..47) and layer 25 in part. Read as the highest index + 1 this once became --n-cpu-moe 49 (every expert
    # on the host: 0.71x of llama.cpp's own speed there); the count, rounded towards the host, is 23.
    base = LaunchConfig(model=MODEL, ctx=8192, parallel=1)
    fit = flags.parse_fit_line(_fit_line(25, 48), base, 48)
    assert (fit.n_cpu_moe, fit.n_gpu_layers, fit.ctx) == (23, 49, 8192)
    assert 784 + (48 - 23) * 348.75 <= 9694  # rounded towards the host: it fits wherever the fit's placement does
    every = flags.parse_fit_line(r'-c 8192 -ngl 49 -ot "blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"', base, 48)
    assert every.n_cpu_moe == 48  # common/fit.cpp's pattern_moe_all: every layer's experts on the host
    assert flags.parse_fit_line("-c 8192 -ngl 49", base, 48).n_cpu_moe is None  # everything fits on the card
    split = (r'-c 8192 -ngl 49 -ts 30,19 '
        r'-ot "blk\.29\.ffn_down.*=CUDA1,blk\.47\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"')
    assert flags.parse_fit_line(split, base, 48).n_cpu_moe == 1  # an overflow to the next GPU stays on a device


def test_the_op_offload_threshold_is_environment_in_the_line_and_read_back():
    """llama.cpp reads GGML_OP_OFFLOAD_MIN_BATCH from its environment (ggml-cuda.cu, ggml_backend_cuda_reg), not
    argv: the config's threshold is the process's environment, the printed line's ``VAR=value`` prefix, and a pasted
    line's prefix is read back into the config."""
    cfg = LaunchConfig(model=MODEL, n_cpu_moe=20, ubatch=4096, batch=4096, op_offload_min_batch=512)
    assert flags.server_env(cfg) == {"GGML_OP_OFFLOAD_MIN_BATCH": "512"}
    assert flags.server_env(LaunchConfig(model=MODEL)) == {}  # the engine's 32: not rendered
    line = flags.launch_line(cfg)
    assert line.startswith("GGML_OP_OFFLOAD_MIN_BATCH=512 llama-server -m ")
    assert "GGML_OP_OFFLOAD_MIN_BATCH" not in flags.server_argv(Path("llama-server"), cfg)  # not a flag
    assert flags.parse_command(line).config == cfg
    assert flags.launch_line(flags.parse_command(line).config) == line  # a fixed point
    pasted = "CUDA_VISIBLE_DEVICES=0 GGML_OP_OFFLOAD_MIN_BATCH=4096 llama-server -m /m.gguf --n-cpu-moe 4"
    assert flags.parse_command(pasted).config.op_offload_min_batch == 4096
    with pytest.raises(UsageError, match="only matters with op offload on"):
        flags.parse_command(pasted + " --no-op-offload")
    with pytest.raises(UsageError, match="whole number"):
        flags.parse_command("GGML_OP_OFFLOAD_MIN_BATCH=lots llama-server -m /m.gguf")
    with pytest.raises(UsageError, match=">= 1"):
        flags.server_argv(Path("llama-server"), LaunchConfig(model=MODEL, op_offload_min_batch=0))


def test_one_llama_bench_process_has_one_op_offload_threshold():
    """A llama-bench process has one environment: configs that differ in the threshold cannot share it."""
    a = LaunchConfig(model=MODEL, n_cpu_moe=4, threads=2)
    b = LaunchConfig(model=MODEL, n_cpu_moe=4, threads=2, op_offload_min_batch=512)
    with pytest.raises(UsageError, match="op-offload threshold"):
        flags.bench_group_argv(Path("llama-bench"), [a, b], n_prompt=8, n_gen=8, repetitions=1)


@pytest.mark.parametrize("pasted", [
    "llama-server -m x.gguf --spec-type ngram-mod --spec-draft-n-max 1000000",
    "llama-server -m x.gguf --spec-type ngram-mod --spec-draft-n-max 1234567",
    "llama-server -m x.gguf --spec-type ngram-mod --spec-draft-p-min 0.123456789",
    "llama-server -m x.gguf --spec-type ngram-mod --spec-synth-len 1234567.5",
    "llama-server -m x.gguf --spec-type ngram-mod --spec-synth-rates 0.987654321,0.5",
])
def test_spec_numbers_render_as_the_engine_reads_them_back(pasted):
    """std::stoi stops at the first letter: ``1e+06`` (format "g") read as 1 and ``1.23457e+06`` as 1, so the line
    shown was not the line measured; every number now renders to the same value when read again."""
    cfg = flags.parse_command(pasted).config
    line = flags.launch_line(cfg)
    assert flags.parse_command(line).config == cfg
    assert "e+" not in line and line.split()[-1] == pasted.split()[-1]


@pytest.mark.parametrize("pasted", [
    "llama-server -m x.gguf -c 99999999999999999999",
    "llama-server -m x.gguf -ngl 100000000000000000",
    "llama-server -m x.gguf -c 2147483648",
    "GGML_OP_OFFLOAD_MIN_BATCH=4294967296 llama-server -m x.gguf",
    "llama-server -m x.gguf --spec-type ngram-mod --spec-synth-len nan",
    "llama-server -m x.gguf --spec-type ngram-mod --spec-synth-len inf",
])
def test_numbers_llama_cpp_cannot_read_are_refused(pasted):
    """common/arg.cpp reads integers with std::stoi (32 bits: more is out_of_range, the server does not start)."""
    with pytest.raises(UsageError):
        flags.parse_command(pasted)
    assert flags.parse_command("llama-server -m x.gguf -c 2147483647").config.ctx == 2**31 - 1
