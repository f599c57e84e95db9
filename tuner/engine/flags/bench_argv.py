"""LaunchConfig → llama-bench argv: one process for configs that share a model load, in the engine's dialect
(llama.cpp's ``-d`` and jsonl; ik_llama.cpp's ``-gp``, 0|1 values and json: :mod:`~tuner.engine.flags.dialect`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tuner.engine.flags.dialect as dialect
from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine.caps import Capabilities
from tuner.engine.flags.render import validate
from tuner.engine.flags.spell import BENCH, _Argv
from tuner.engine.kinds import IK_LLAMA


def bench_argv(binary: Path, cfg: LaunchConfig, **options: Any) -> list[str]:
    """llama-bench for one config (options as :func:`bench_group_argv`); it has no -c (context = prompt +
    generated + depth)."""
    return bench_group_argv(binary, [cfg], **options)


def bench_group_argv(
    binary: Path,
    cfgs: Sequence[LaunchConfig],
    *,
    n_prompt: int,
    n_gen: int,
    repetitions: int,
    depth: int | Sequence[int] = 0,
    caps: Capabilities | None = None,
    progress: bool = False,
) -> list[str]:
    """One llama-bench process for configs that form a full cross product of comma lists.

    llama-bench runs every combination of its lists and aborts the whole sweep at the first invalid one, so
    the caller (:func:`tuner.measure.bench.group_configs`) only hands in sets where every combination is a wanted,
    valid config. Each list is rendered in first-seen order. ``progress``: ``--progress`` where this llama-bench
    takes it (a line on stderr as each phase of a test starts: :mod:`tuner.measure.phases` reads them).
    """
    if not cfgs:
        raise UsageError("no configs to benchmark: pass at least one")
    for cfg in cfgs:
        validate(cfg)
    first = cfgs[0]
    kind = dialect.kind_for(caps, first)
    if len({(c.model, kind.maps_model(c), c.repack, c.no_host, c.op_offload, c.op_offload_min_batch, c.device)
            for c in cfgs}) != 1:
        raise UsageError("configs in one llama-bench run must share the model file, load mode, device and "
                         "op-offload threshold (the environment of the process)")
    depths = [depth] if isinstance(depth, int) else list(depth)
    for cfg in cfgs:
        dialect.check_levers(kind, cfg)
    if kind is IK_LLAMA:
        return _ik_bench_argv(binary, cfgs, n_prompt, n_gen, repetitions, depths, caps)
    a = _Argv(binary, BENCH, caps)
    a.add("model", str(first.model))
    a.argv += ["-p", str(n_prompt), "-n", str(n_gen), "-r", str(repetitions)]
    if depths != [0]:
        a.add("depth", ",".join(str(d) for d in depths))
    if first.device is not None:
        a.add("device", first.device)
    for name in ("n_gpu_layers", "n_cpu_moe", "cache_type_k", "cache_type_v", "threads", "batch", "ubatch",
                 "flash_attn"):
        values = _listed(cfgs, name)
        default = {"cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "auto"}.get(name, "")
        if values == [default]:
            continue
        if "" in values:
            raise UsageError(f"configs in one llama-bench run must all set {name} or none of them")
        a.add(name, ",".join(values))
    if not kind.maps_model(first):
        a.add("load_mode", "none")
    if not first.repack:
        a.add("repack", "0")
    if first.no_host:
        a.add("no_host", "1")
    if not first.op_offload:
        a.add("no_op_offload", "1")
    if progress and (caps is None or BENCH not in caps.flags or caps.supports(BENCH, "--progress")):
        a.argv.append("--progress")
    return a.argv + ["-o", "jsonl"]


def _listed(cfgs: Sequence[LaunchConfig], name: str) -> list[str]:
    """One setting's values over the configs, each once, in first-seen order ("" for the engine's default)."""
    seen: list[str] = []
    for c in cfgs:
        value = getattr(c, name)
        text = value.value if hasattr(value, "value") else ("" if value is None else str(value))
        if text not in seen:
            seen.append(text)
    return seen


def _ik_bench_argv(binary: Path, cfgs: Sequence[LaunchConfig], n_prompt: int, n_gen: int, repetitions: int,
                   depths: list[int], caps: Capabilities | None) -> list[str]:
    """ik_llama.cpp's llama-bench (examples/llama-bench): no ``-d``, so generation at depth D is ``-gp D,N`` and a
    prompt at depth D two prompts whose difference :mod:`tuner.measure.bench_rows` takes; ``-fa``, ``-mmp`` and the
    levers take 0|1; ``-ngl`` is always the server's value (its bench defaults to 999, its server to 0); ``-o json``
    (it writes no jsonl)."""
    first = cfgs[0]
    a = _Argv(binary, BENCH, caps, IK_LLAMA)
    a.add("model", str(first.model))
    prompts = dialect.prompt_tests(n_prompt, depths) if n_prompt > 0 else [0]
    gens = [n_gen] if n_gen > 0 and 0 in depths else [0]
    a.argv += ["-p", ",".join(str(p) for p in prompts), "-n", ",".join(str(g) for g in gens),
               "-r", str(repetitions)]
    for d in depths:
        if n_gen > 0 and d > 0:
            a.add("gen_after_prompt", f"{d},{n_gen}")
    if first.device is not None:
        a.add("device", first.device)
    layers = {str(dialect.IK_SERVER_GPU_LAYERS if c.n_gpu_layers is None else c.n_gpu_layers) for c in cfgs}
    a.add("n_gpu_layers", ",".join(sorted(layers, key=int)))
    if first.n_cpu_moe is not None:
        a.add("n_cpu_moe", str(first.n_cpu_moe))  # ik reads one value: configs of a run share their placement
    for name in ("cache_type_k", "cache_type_v", "threads", "batch", "ubatch"):
        values = _listed(cfgs, name)
        if values == [{"cache_type_k": "f16", "cache_type_v": "f16"}.get(name, "")]:
            continue
        if "" in values:
            raise UsageError(f"configs in one llama-bench run must all set {name} or none of them")
        a.add(name, ",".join(values))
    fa = list(dict.fromkeys(dialect.ik_bench_fa(c.flash_attn) or "1" for c in cfgs))
    if fa != ["1"]:
        a.add("flash_attn", ",".join(fa))
    if not IK_LLAMA.maps_model(first) and not IK_LLAMA.unmaps(first):  # a lever that unmaps (-rtr) says it already
        a.add("mmap", "0")
    a.add_words(dialect.bench_lever_args(first))
    # Without -v ik's llama-bench logs nothing of the load: a model it cannot load (an architecture it lacks)
    # would fail saying only "failed to load model". The log goes to stderr; the rows stay on stdout.
    return a.argv + ["-v", "-o", "json"]
