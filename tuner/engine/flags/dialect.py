"""Each engine's dialect: how its tools spell the settings the two engines share, and ik_llama.cpp's own levers.

llama.cpp (common/arg.cpp at the pin) and ik_llama.cpp (its common/common.cpp and examples/llama-bench) read most
settings the same way; where they differ a line rendered for one is refused or misread by the other:

- loading: llama.cpp's ``--load-mode none``; ik's server ``--no-mmap``, its llama-bench ``-mmp 0``;
- ``--fit``: llama.cpp's takes on|off and is on by default (it moves layers unless the line places them); ik's is a
  switch, off unless given, so an ik line never needs ``--fit off``;
- llama-bench: llama.cpp's ``-fa`` takes on|off|auto, ik's 0|1 (on by default); ik's takes no ``-d``
  (depth: ``-gp DEPTH,N`` times N generated tokens after DEPTH prompt tokens) and writes ``-o json``, not jsonl;
- ``-ngl``: llama.cpp's default offloads what fits; ik's server default is 0 (``llama_model_default_params``:
  nothing on the GPU unless asked), while its llama-bench defaults to 999, so an ik bench always states the
  server's value;
- only ik reads ``-rtr``, ``-no-fmoe``, ``-muge``, ``-amb``, ``-no-gr``, ``-ser``, ``-no-ooae``; only llama.cpp
  reads ``--no-repack``, ``--no-host``, ``--no-op-offload``, ``-fitt``, ``-cms``, ``--cache-reuse`` and the
  speculation flags this project measures (ik reads ``-cram`` and ``--ctx-checkpoints`` as llama.cpp does).

The kind of a line comes from the engine it runs on (its capabilities) or, with none at hand, from the config's
``engine`` field: :func:`kind_for`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.core.errors import UnsupportedFlagError
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP, EngineKind, kind_by_name, kind_of_flags

if TYPE_CHECKING:
    from tuner.engine.caps import Capabilities

# ik_llama.cpp's spellings where they differ from llama.cpp's (tuner.engine.flags.render._SPELL), per tool.
IK_SERVER_SPELL: dict[str, tuple[str, ...]] = {
    "no_mmap": ("--no-mmap",),
    "ctx_checkpoints": ("--ctx-checkpoints",),  # llama.cpp's -ctxcp is not ik's
    "run_time_repack": ("--run-time-repack", "-rtr"),  # its --help lists the long form only
    "no_fused_moe": ("-no-fmoe", "--no-fused-moe"),
    "merge_up_gate": ("-muge", "--merge-up-gate-experts"),
    "attn_max_batch": ("-amb", "--attention-max-batch"),
    "no_graph_reuse": ("-no-gr", "--no-graph-reuse"),
    "smart_experts": ("-ser", "--smart-expert-reduction"),
    "no_only_active_experts": ("-no-ooae", "--no-offload-only-active-experts"),
}
IK_BENCH_SPELL: dict[str, tuple[str, ...]] = {
    "mmap": ("-mmp", "--mmap"),
    "run_time_repack": ("-rtr", "--run-time-repack"),
    "fused_moe": ("-fmoe", "--fused-moe"),
    "merge_up_gate": ("-muge", "--merge-up-gate-exps"),
    "attn_max_batch": ("-amb", "--attn-max-batch"),
    "graph_reuse": ("-gr", "--graph-reuse"),
    "smart_experts": ("-ser", "--smart-expert-reduction"),
    "no_only_active_experts": ("-no-ooae", "--no-offload-only-active-experts"),
    "gen_after_prompt": ("-gp",),
    "n_cpu_moe": ("--n-cpu-moe",),
}
# ik_llama.cpp's server default for -ngl (common.h ``n_gpu_layers = -1`` → ``llama_model_default_params``: 0).
IK_SERVER_GPU_LAYERS = 0
# What an ik bench takes for a flag llama-bench reads as a number (flash attention, loading): 1 or 0.
_IK_FA = {FlashAttn.ON: "1", FlashAttn.OFF: "0"}

# Settings of the shared LaunchConfig each kind cannot read, with the flag a user would know them by.
_LLAMA_ONLY = {"repack": "--no-repack", "no_host": "--no-host", "op_offload": "--no-op-offload",
               "fit_target_mib": "-fitt", "kv_unified": "--kv-unified", "swa_full": "--swa-full"}


def kind_for(caps: Capabilities | None, cfg: LaunchConfig) -> EngineKind:
    """The dialect to spell ``cfg`` in: the engine's own kind when its capabilities were read, else the config's.
    A config for one engine rendered for a build of the other is refused, with the engine to run it on."""
    wanted = kind_by_name(cfg.engine)
    if caps is None or not caps.flags:
        return wanted
    have = kind_of_flags(caps.flags)
    if have is not wanted:
        raise UnsupportedFlagError(
            f"this line is {wanted.name}'s and the engine here is {have.name}: run it with {wanted.name} "
            f"(`moe-tune engine install --engine {wanted.key}`, or point --llama-cpp-dir at a {wanted.name} build)")
    return have


def check_levers(kind: EngineKind, cfg: LaunchConfig) -> None:
    """Refuse a setting the kind does not read at all, naming the engine that does."""
    if kind is LLAMA_CPP:
        set_levers = [name for name in IK_LLAMA.levers if getattr(cfg, name) != getattr(_IK_DEFAULTS, name)]
        if set_levers:
            raise UnsupportedFlagError(f"llama.cpp does not read {lever_words(cfg, set_levers[0])}: it is "
                                       f"ik_llama.cpp's; set engine ik_llama.cpp or leave it at its default")
        return
    for name, flag in _LLAMA_ONLY.items():
        if getattr(cfg, name) != getattr(_IK_DEFAULTS, name):
            raise UnsupportedFlagError(f"{kind.name} does not read {flag}: it is llama.cpp's; leave it at its "
                                       "default for an ik_llama.cpp line")
    # -cram and --ctx-checkpoints read as llama.cpp's (ik's common.h: cache_ram_mib, ctx_checkpoints_n); its
    # checkpoint spacing, --cache-reuse and its speculation types are not llama.cpp's and are not measured.
    if cfg.checkpoint_min_step is not None or cfg.cache_reuse is not None or cfg.spec_types:
        raise UnsupportedFlagError(f"{kind.name}'s checkpoint spacing, --cache-reuse and speculation are not "
                                   "measured by moe-tune: leave them at their defaults for an ik_llama.cpp line")


_IK_DEFAULTS = LaunchConfig(model=Path("defaults"))  # every field at the engine's default


def lever_words(cfg: LaunchConfig, name: str) -> str:
    """A lever as the user writes it for ik's server (``-rtr``, ``-amb 512``)."""
    return " ".join(server_lever_args(cfg, only=name)) or name


def server_lever_args(cfg: LaunchConfig, only: str | None = None) -> list[str]:
    """ik_llama.cpp's levers as its llama-server spells them (nothing for a lever at its default)."""
    out: list[str] = []

    def want(name: str) -> bool:
        return only is None or only == name

    if want("run_time_repack") and cfg.run_time_repack:
        out.append(IK_SERVER_SPELL["run_time_repack"][0])
    if want("fused_moe") and not cfg.fused_moe:
        out.append(IK_SERVER_SPELL["no_fused_moe"][0])
    if want("merge_up_gate") and cfg.merge_up_gate:
        out.append(IK_SERVER_SPELL["merge_up_gate"][0])
    if want("attn_max_batch") and cfg.attn_max_batch is not None:
        out += [IK_SERVER_SPELL["attn_max_batch"][0], str(cfg.attn_max_batch)]
    if want("graph_reuse") and not cfg.graph_reuse:
        out.append(IK_SERVER_SPELL["no_graph_reuse"][0])
    if want("smart_experts") and cfg.smart_experts is not None:
        out += [IK_SERVER_SPELL["smart_experts"][0], ser_value(cfg.smart_experts)]
    if want("only_active_experts") and not cfg.only_active_experts:
        out.append(IK_SERVER_SPELL["no_only_active_experts"][0])
    return out


def bench_lever_args(cfg: LaunchConfig) -> list[str]:
    """ik_llama.cpp's levers as its llama-bench spells them: 0|1 values, every one stated where llama-bench's
    default differs from the server's (none do at this source: fused MoE and graph reuse on, repacking off)."""
    out: list[str] = []
    if cfg.run_time_repack:
        out += [IK_BENCH_SPELL["run_time_repack"][0], "1"]
    if not cfg.fused_moe:
        out += [IK_BENCH_SPELL["fused_moe"][0], "0"]
    if cfg.merge_up_gate:
        out += [IK_BENCH_SPELL["merge_up_gate"][0], "1"]
    if cfg.attn_max_batch is not None:
        out += [IK_BENCH_SPELL["attn_max_batch"][0], str(cfg.attn_max_batch)]
    if not cfg.graph_reuse:
        out += [IK_BENCH_SPELL["graph_reuse"][0], "0"]
    if cfg.smart_experts is not None:
        out += [IK_BENCH_SPELL["smart_experts"][0], ser_value(cfg.smart_experts)]
    if not cfg.only_active_experts:
        out += [IK_BENCH_SPELL["no_only_active_experts"][0], "1"]
    return out


def ser_value(ser: tuple[int, float]) -> str:
    """``-ser MIN,THRESH`` as ik reads it (``string_split_pairs<int,float>``)."""
    return f"{int(ser[0])},{float(ser[1])!r}"


def ik_bench_fa(fa: FlashAttn) -> str | None:
    """ik's llama-bench ``-fa`` value (None: its default, on, as the server's)."""
    return _IK_FA.get(fa)


def prompt_tests(n_prompt: int, depths: list[int]) -> list[int]:
    """The ``-p`` list an ik bench runs for a prompt of ``n_prompt`` tokens at each depth: it has no ``-d``, so a
    prompt at depth D is timed as the difference of two prompts from an empty cache, D and D + n_prompt tokens
    (:func:`tuner.measure.bench_rows.prompt_at_depth`)."""
    sizes: list[int] = []
    for d in depths:
        sizes += [n_prompt] if d == 0 else [d, d + n_prompt]
    return list(dict.fromkeys(sizes))
