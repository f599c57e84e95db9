"""LaunchConfig → argv for llama-batched-bench, llama-server, llama-perplexity and llama-fit-params (llama-bench:
:mod:`~tuner.engine.flags.bench_argv`), in the dialect of the engine that runs them.

Because the measured argv and the emitted launch line come from the same function, they cannot differ. With
the engine's :class:`~tuner.engine.caps.Capabilities` each setting is spelled the way the detected binary accepts
it (or refused before launch).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import tuner.engine.flags.dialect as dialect
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UnsupportedFlagError, UsageError
from tuner.engine.caps import Capabilities
from tuner.engine.flags.env import env_prefix, validate_env
from tuner.engine.flags.spell import (  # noqa: F401 - render.SERVER and friends: callers know them here
    _BENCH_SPELL,
    _IGNORED_BARE,
    _IGNORED_WITH_VALUE,
    _SPEC_NUMBERS,
    _SPELL,
    BATCHED_BENCH,
    BENCH,
    FIT_PARAMS,
    PERPLEXITY,
    SERVER,
    _Argv,
)
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP, EngineKind

# common/arg.cpp reads every integer flag with std::stoi (a 32-bit int: a longer number is out_of_range and
# llama-server refuses to start) and ggml reads GGML_OP_OFFLOAD_MIN_BATCH with atoi (beyond an int: undefined).
INT_MAX = 2**31 - 1
_INT_SETTINGS = ("ctx", "parallel", "n_gpu_layers", "n_cpu_moe", "threads", "threads_batch", "batch", "ubatch",
                 "cache_reuse", "ctx_checkpoints", "checkpoint_min_step", "cache_ram_mib", "fit_target_mib",
                 "op_offload_min_batch", "spec_draft_n_max", "spec_draft_n_min")


def validate(cfg: LaunchConfig) -> None:
    """Refuse what the engine would reject at context creation, before anything is launched."""
    for name in _INT_SETTINGS:
        value = getattr(cfg, name)
        if value is not None and not -INT_MAX - 1 <= value <= INT_MAX:
            raise UsageError(f"{name} {value} is beyond the 32-bit whole numbers llama.cpp reads "
                             f"(at most {INT_MAX:,})")
    if cfg.cache_type_v.is_quantized and cfg.flash_attn is FlashAttn.OFF:
        raise UsageError(
            f"V cache type {cfg.cache_type_v.value} needs flash attention: use -fa on (or auto) or -ctv f16"
        )
    for name in ("n_cpu_moe", "n_gpu_layers", "threads", "threads_batch"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise UsageError(f"{name} must be >= 0, got {value}")
    for name in ("ctx", "parallel", "batch", "ubatch"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if cfg.batch is not None and cfg.ubatch is not None and cfg.ubatch > cfg.batch:
        # llama.cpp silently clamps ubatch to batch; the measured config would not be the one asked for.
        raise UsageError(f"ubatch {cfg.ubatch} is larger than batch {cfg.batch}: use -ub <= -b")
    _validate_spec(cfg)
    _validate_reuse(cfg)
    validate_env(cfg)


REUSE_FIELDS = ("cache_reuse", "ctx_checkpoints", "checkpoint_min_step", "cache_ram_mib")


def _validate_reuse(cfg: LaunchConfig) -> None:
    """What common/arg.cpp refuses (``-cms`` below 0) or what means nothing (negative counts)."""
    for name in ("cache_reuse", "ctx_checkpoints", "checkpoint_min_step"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise UsageError(f"{name} must be >= 0, got {value}")
    if cfg.fit_target_mib is not None and cfg.fit_target_mib < 0:
        raise UsageError(f"-fitt takes the MiB --fit leaves free, >= 0, got {cfg.fit_target_mib}")
    if cfg.cache_ram_mib is not None and cfg.cache_ram_mib < -1:
        raise UsageError(f"--cache-ram takes MiB, 0 (off) or -1 (no limit), got {cfg.cache_ram_mib}")


def server_accepts(caps: Capabilities | None, setting: str) -> bool:
    """Whether this engine's llama-server takes ``setting`` (unknown capabilities: assume it does)."""
    if caps is None or SERVER not in caps.flags:
        return True
    return any(caps.supports(SERVER, s) for s in _SPELL[setting])


def without_reuse(cfg: LaunchConfig) -> LaunchConfig:
    """``cfg`` with the prompt-reuse settings at the engine's defaults."""
    return replace(cfg, cache_reuse=None, ctx_checkpoints=None, checkpoint_min_step=None, cache_ram_mib=None)


def _reuse_flags(a: _Argv, cfg: LaunchConfig) -> None:
    """Prompt reuse between requests: llama-server only (server-context.cpp reads them per slot)."""
    for name in REUSE_FIELDS:
        if getattr(cfg, name) is not None:
            a.add(name, str(getattr(cfg, name)))


def spelled(setting: str, *values: object) -> str:
    """A setting as a user types it in a message (the long spelling): ``spelled("swa_full")`` → ``--swa-full``."""
    spellings = _SPELL[setting]
    flag = next((f for f in spellings if f.startswith("--")), spellings[0])
    return " ".join([flag, *(str(v) for v in values)])


def _validate_spec(cfg: LaunchConfig) -> None:
    """What llama-server would refuse, or silently not do, with these speculation flags."""
    needs_model = [t.value for t in cfg.spec_types if t.needs_draft_model]
    if needs_model and cfg.draft_model is None:
        raise UsageError(f"--spec-type {needs_model[0]} drafts with a second model: add -md DRAFT.gguf")
    if cfg.draft_model is not None and not needs_model:
        # The engine loads the draft but, with no draft type asked for, never drafts with it.
        raise UsageError("-md loads a draft model that nothing uses: add --spec-type draft-simple")
    if (cfg.spec_synth_len is not None or cfg.spec_synth_rates) and not cfg.spec_types:
        raise UsageError("synthetic acceptance needs a drafter: add --spec-type (e.g. ngram-mod or draft-mtp)")
    if cfg.spec_synth_len is not None and cfg.spec_synth_rates:
        raise UsageError("--spec-synth-len and --spec-synth-rates exclude each other: keep one")
    if cfg.spec_synth_len is not None and not (math.isfinite(cfg.spec_synth_len) and cfg.spec_synth_len >= 1.0):
        raise UsageError(f"--spec-synth-len counts the target token too, so it is >= 1, got {cfg.spec_synth_len}")
    rates = cfg.spec_synth_rates or ()
    if any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
        raise UsageError("--spec-synth-rates must lie in [0, 1] and never rise: e.g. 0.8,0.6,0.4")
    if cfg.spec_draft_p_min is not None and not 0.0 <= cfg.spec_draft_p_min <= 1.0:
        raise UsageError(f"--spec-draft-p-min is a probability in [0, 1], got {cfg.spec_draft_p_min}")
    n_min, n_max = cfg.spec_draft_n_min or 0, cfg.spec_draft_n_max
    if n_min < 0 or (n_max is not None and not 1 <= n_max >= n_min):
        raise UsageError("--spec-draft-n-max must be >= 1 and >= --spec-draft-n-min, which must be >= 0")


def _spec_flags(a: _Argv, cfg: LaunchConfig) -> None:
    """Speculative decoding: a llama-server feature (llama-bench at the pinned commit has no such option)."""
    if not cfg.spec_types:
        return
    a.add("spec_types", ",".join(t.value for t in cfg.spec_types))
    if cfg.draft_model is not None:
        a.add("draft_model", str(cfg.draft_model))
    for name in _SPEC_NUMBERS:
        if getattr(cfg, name) is not None:
            a.add(name, exact_number(getattr(cfg, name)))
    if cfg.spec_synth_rates:
        a.add("spec_synth_rates", ",".join(exact_number(r) for r in cfg.spec_synth_rates))


def exact_number(value: float) -> str:
    """A number as llama.cpp reads back the same value: a whole number in digits (std::stoi stops at "e", so
    ``1e+06`` would read as 1), a float in its shortest spelling that parses to it again."""
    if isinstance(value, int):
        return str(value)
    short = format(value, "g")
    return short if float(short) == value else repr(value)


def _common(a: _Argv, cfg: LaunchConfig) -> None:
    if cfg.device is not None:
        a.add("device", cfg.device)
    if cfg.n_gpu_layers is not None:
        a.add("n_gpu_layers", str(cfg.n_gpu_layers))
    if cfg.n_cpu_moe is not None:
        a.add("n_cpu_moe", str(cfg.n_cpu_moe))
    if cfg.cache_type_k is not CacheType.F16:
        a.add("cache_type_k", cfg.cache_type_k.value)
    if cfg.cache_type_v is not CacheType.F16:
        a.add("cache_type_v", cfg.cache_type_v.value)
    if cfg.threads is not None:
        a.add("threads", str(cfg.threads))
    if cfg.threads_batch is not None and a.tool != BENCH:
        a.add("threads_batch", str(cfg.threads_batch))
    if cfg.batch is not None:
        a.add("batch", str(cfg.batch))
    if cfg.ubatch is not None:
        a.add("ubatch", str(cfg.ubatch))


def _context_flags(a: _Argv, cfg: LaunchConfig) -> None:
    """Flags llama-server and llama-perplexity share (llama-bench has none of these)."""
    if cfg.flash_attn is not FlashAttn.AUTO:
        a.add("flash_attn", cfg.flash_attn.value)
    if cfg.kv_unified is True:
        a.add("kv_unified")
    elif cfg.kv_unified is False:
        a.add("no_kv_unified")
    if cfg.swa_full:
        a.add("swa_full")
    if not a.kind.maps_model(cfg) and not a.kind.unmaps(cfg):  # a lever that unmaps (ik's -rtr) says it already
        if not a.kind.reads_load_mode:
            a.add("no_mmap")
        else:
            a.add("load_mode", "none")  # read weights into anonymous memory instead of mapping the file
    if not cfg.repack:
        a.add("no_repack")
    if cfg.no_host:
        a.add("no_host")
    if not cfg.op_offload:
        a.add("no_op_offload")
    if a.kind is IK_LLAMA:
        a.add_words(dialect.server_lever_args(cfg))


def batched_bench_argv(binary: Path, cfg: LaunchConfig, *, n_prompt: int, n_gen: int,
                       n_parallel: Sequence[int], caps: Capabilities | None = None) -> list[str]:
    """llama-batched-bench: ``n_prompt`` prompt tokens then ``n_gen`` generated tokens in each of ``n`` parallel
    sequences, for each ``n`` of ``n_parallel`` (a count listed twice runs twice), in ``cfg``'s context, which
    is split over the sequences as llama-server splits it over an explicit ``-np`` (tools/batched-bench)."""
    validate(cfg)
    if not n_parallel or min(n_parallel) < 1 or n_prompt < 1 or n_gen < 1:
        raise UsageError("batched-bench needs prompt and generated tokens and parallel counts >= 1")
    a = _Argv(binary, BATCHED_BENCH, caps)
    a.add("model", str(cfg.model))
    if cfg.ctx is not None:
        a.add("ctx", str(cfg.ctx))
    _common(a, cfg)
    _fit_flags(a, cfg)
    _context_flags(a, cfg)
    a.argv += ["-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join(str(n) for n in n_parallel),
               "--output-format", "jsonl"]
    return a.argv


def fit_would_move(cfg: LaunchConfig) -> bool:
    """Would llama.cpp's ``--fit`` (on by default) move this config's layers? It gives up on any placement the
    user set — ``-ngl``, a tensor split or a tensor override (common/fit.cpp, ``common_params_fit_impl``: "already
    set by user, abort") — and ``--n-cpu-moe N`` is N overrides (common/arg.cpp), so ``--n-cpu-moe 0`` sets none:
    fit then moves experts to the host whenever the card is tight, and the server runs another placement than
    the line says (seen on an H100, results/benchmarks/gpu-lease-1/README.md)."""
    return cfg.n_cpu_moe == 0 and cfg.n_gpu_layers is None


def _fit_flags(a: _Argv, cfg: LaunchConfig) -> None:
    """``--fit off`` where fit would otherwise rewrite the placement this config states; ``-fitt`` where the config
    tells fit what to leave free (common/arg.cpp: one value is every device's margin; common/fit.cpp
    ``common_params_fit_impl`` fits until each device's projected free memory is at least that). ik_llama.cpp's
    ``--fit`` is off unless given (its common/common.cpp): its lines never need one."""
    if not a.kind.fits_by_default:
        return
    if fit_would_move(cfg):
        a.add("fit", "off")
    elif cfg.fit_target_mib is not None:
        a.add("fit_target_mib", str(cfg.fit_target_mib))


def server_argv(binary: Path, cfg: LaunchConfig, caps: Capabilities | None = None) -> list[str]:
    return _server_argv(binary, cfg, caps, fit=True)


def _server_argv(binary: Path, cfg: LaunchConfig, caps: Capabilities | None, *, fit: bool) -> list[str]:
    """llama-server's argv for ``cfg``; ``fit``: with the ``--fit off`` a placement of its own needs (llama-fit-params
    with -fitp prints the estimate of the config as given and never fits, tools/fit-params)."""
    validate(cfg)
    kind = dialect.kind_for(caps, cfg)
    dialect.check_levers(kind, cfg)
    a = _Argv(binary, SERVER, caps, kind)
    a.add("model", str(cfg.model))
    if cfg.ctx is not None:
        a.add("ctx", str(cfg.ctx))
    if cfg.parallel is not None:
        a.add("parallel", str(cfg.parallel))
    _common(a, cfg)
    if fit:
        _fit_flags(a, cfg)
    _context_flags(a, cfg)
    _reuse_flags(a, cfg)
    _spec_flags(a, cfg)
    return a.argv


# Settings llama-server takes as bare flags (no value): the rest take the next word as their value.
_BARE_SETTINGS = ("kv_unified", "no_kv_unified", "swa_full", "no_repack", "no_host", "no_op_offload", "log_jsonl")


def takes_value(flag: str) -> bool:
    """Does this llama-server flag, as :func:`server_argv` spells it, take the next word as its value?"""
    return not any(flag in _SPELL[s] for s in _BARE_SETTINGS)


def address_argv(host: str | None = None, port: int | str | None = None) -> list[str]:
    """Where llama-server listens; each part only when given (``port`` may be a template like ``${PORT}``)."""
    return [*(["--host", host] if host is not None else []), *(["--port", str(port)] if port is not None else [])]


def listen_argv(host: str, port: int, *, log_jsonl: bool = False) -> list[str]:
    """Where a measured llama-server listens, and (optionally) machine-readable logs for the runner."""
    return address_argv(host, port) + (["--log-jsonl"] if log_jsonl else [])


def file_log_argv(kind: EngineKind, folder: Path) -> list[str]:
    """Where an engine that writes a log file of its own by default writes it: ik_llama.cpp's common log would be
    ``llama.log`` in whatever folder it was started from (common/log.h ``log_handler1_impl``); ``--log-file NAME``
    makes it ``NAME.log``, here beside moe-tune's own logs. Nothing for llama.cpp, whose log is its stderr."""
    return ["--log-file", str(folder / "ik-common")] if kind.writes_file_log else []


def chunk_rows_argv() -> list[str]:
    """llama-perplexity writing a reference prints each chunk's running PPL on a line of its own (``[1]8.93,[2]…``
    otherwise, one line at the end: perplexity.cpp ``perplexity``), so a caller can read it as each chunk ends."""
    return ["--ppl-output-type", "1"]


def api_key_file_argv(path: Path) -> list[str]:
    """The server's key file by path (ik_llama.cpp reads no key from its environment): the key stays in the file."""
    return ["--api-key-file", str(path)]


def trace_argv(kind: EngineKind = LLAMA_CPP) -> list[str]:
    """llama-server at trace verbosity: it then logs each context checkpoint and the prompt cache's state. ik's server
    has no -lv (its --verbosity logs in another form, which nothing here reads): nothing for it."""
    return ["-lv", "4"] if kind is LLAMA_CPP else []


def server_logs_jsonl(caps: Capabilities | None) -> bool:
    """Whether this llama-server writes machine records (``--log-jsonl``); unknown capabilities: assume so."""
    return caps is None or caps.supports(SERVER, "--log-jsonl")


def perplexity_argv(
    binary: Path,
    cfg: LaunchConfig,
    *,
    text_file: Path,
    ctx: int,
    chunks: int | None = None,
    kld_base: Path | None = None,
    kld: bool = False,
    caps: Capabilities | None = None,
) -> list[str]:
    """llama-perplexity over ``text_file`` in chunks of ``ctx`` tokens.

    With ``kld_base`` and not ``kld``: write the reference logits to that file. With both: compare against it.
    """
    validate(cfg)
    kind = dialect.kind_for(caps, cfg)
    dialect.check_levers(kind, cfg)
    a = _Argv(binary, PERPLEXITY, caps, kind)
    a.add("model", str(cfg.model))
    a.argv += ["-f", str(text_file)]
    a.add("ctx", str(ctx))
    if chunks is not None:
        a.argv += ["--chunks", str(chunks)]
    if cfg.parallel is not None:
        a.add("parallel", str(cfg.parallel))
    _common(a, cfg)
    _context_flags(a, cfg)
    if kld_base is not None:
        a.argv += ["--kl-divergence-base", str(kld_base)]
        if kld:
            a.argv += ["--kl-divergence"]
    elif kld:
        raise UsageError("KL-divergence needs a reference logits file: pass kld_base")
    return a.argv


def fit_params_argv(binary: Path, cfg: LaunchConfig, caps: Capabilities | None = None) -> list[str]:
    """llama-fit-params projecting ``cfg``'s memory (header only, nothing allocated), with JSON records."""
    if not dialect.kind_for(caps, cfg).projects_memory:
        raise UnsupportedFlagError(f"{dialect.kind_for(caps, cfg).name} has no llama-fit-params: its memory comes "
                                   "from its own load log")
    if cfg.kv_unified is not None:
        # llama-fit-params has no --kv-unified / --no-kv-unified (its -np default is 1, where they agree).
        raise UnsupportedFlagError(
            "llama-fit-params cannot project --kv-unified / --no-kv-unified: leave kv_unified at the default "
            "or measure the breakdown with llama-server"
        )
    # Prompt reuse costs host RAM at run time only (checkpoints, prompt cache): nothing llama-fit-params projects,
    # and it does not accept those flags.
    argv = _server_argv(binary, without_reuse(cfg), caps, fit=False)
    a = _Argv(binary, FIT_PARAMS, caps)
    a.add("fit_print", "on")
    a.add("log_jsonl")
    return argv + a.argv[1:]


def with_fit_target(argv: list[str], margin_mib: int) -> list[str]:
    """``argv`` with --fit's margin: the MiB it leaves free on each device (llama.cpp's default is 1024)."""
    return [*argv, _SPELL["fit_target_mib"][0], str(max(0, int(margin_mib)))]


def launch_line(cfg: LaunchConfig, binary: str = "llama-server") -> str:
    """The command a user pastes into a shell: what the engine reads from its environment first (``VAR=value``)."""
    return shlex.join([*env_prefix(cfg), *server_argv(Path(binary), cfg)])


def with_overrides(cfg: LaunchConfig, **changes: object) -> LaunchConfig:
    """``cfg`` with the given fields replaced; unknown field names are a usage error."""
    known = {f.name for f in fields(LaunchConfig)}
    unknown = set(changes) - known
    if unknown:
        raise UsageError(f"unknown LaunchConfig fields {sorted(unknown)}: use one of {sorted(known)}")
    return replace(cfg, **changes)  # type: ignore[arg-type]
