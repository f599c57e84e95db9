"""Measuring one config (or a group sharing a model load): llama-bench speed with spread, and a server trial.

Noise control: a figure is repeated until its relative standard error is at most ``RSE_TARGET_PCT`` or a
repetition cap is hit, and every figure carries its median and CV. Failures come back classified
(:class:`tuner.core.errors.TrialFailedError`), never as a 0.0.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.core.errors import EngineNotFoundError, ProcessFailedError, TrialFailedError, TunerError, UsageError
from tuner.engine import breakdown, build, flags, runner
from tuner.engine.breakdown import MemoryBreakdown
from tuner.engine.build import Capabilities, EngineLocation
from tuner.engine.flags import dialect
from tuner.engine.kinds import KINDS
from tuner.machine import activity, pressure
from tuner.machine.sampler import (
    NOT_MEASURED,
    MemoryReport,
    PagingVerdict,
    Sampler,
    SpillVerdict,
    paging_verdict,
    spill_verdict,
)
from tuner.measure import failures, gpu_use, phases, workload
from tuner.measure.bench_rows import (  # noqa: F401 - bench.BenchRow, bench.spread, bench.parse_jsonl: as before
    BenchRow,
    Spread,
    parse_jsonl,
    parse_rows,
    prompt_at_depth,
    spread,
)
from tuner.measure.phases import paging_fix
from tuner.measure.workload import LevelResult, Workload

RSE_TARGET_PCT = 3.0
MIN_REPETITIONS = 3
MAX_REPETITIONS = 12


@dataclass(frozen=True, slots=True)
class BenchResult:
    argv: tuple[str, ...]
    rows: tuple[BenchRow, ...]
    elapsed_s: float
    config: LaunchConfig | None = None
    runs: int = 1  # llama-bench processes merged into these rows
    memory: MemoryReport | None = None
    group: int = 1  # configs measured in the same llama-bench processes (they shared the model's load)

    def row(self, kind: str, depth: int | None = None) -> BenchRow:
        for row in self.rows:
            if row.kind == kind and (depth is None or row.n_depth == depth):
                return row
        raise KeyError(kind)

    @property
    def prompt_tok_s(self) -> float:
        return self.row("pp").avg_tok_s

    @property
    def gen_tok_s(self) -> float:
        return self.row("tg").avg_tok_s

    @property
    def host_paging(self) -> PagingVerdict:
        """Did the engine read its model back from disk during the timed generation runs (the load's reads are
        left out); with what to change when it did."""
        return phases.bench_verdict([(r.n_gen, r.host, r.host_runs) for r in self.rows if r.kind == "tg"],
                                    self.config)


# llama-bench reports flash attention as llama.cpp's enum value.
_FA_CODE = {FlashAttn.ON: "1", FlashAttn.OFF: "0", FlashAttn.AUTO: "-1"}


def _wanted(cfg: LaunchConfig) -> dict[str, str]:
    """The row params a config must show; settings left at the engine default match anything."""
    want = {"type_k": cfg.cache_type_k.value, "type_v": cfg.cache_type_v.value}
    if cfg.flash_attn is not FlashAttn.AUTO:
        want["flash_attn"] = _FA_CODE[cfg.flash_attn]
    for key, name in (("n_threads", "threads"), ("n_batch", "batch"), ("n_ubatch", "ubatch"),
                      ("n_gpu_layers", "n_gpu_layers"), ("n_cpu_moe", "n_cpu_moe")):
        if getattr(cfg, name) is not None:
            want[key] = str(getattr(cfg, name))
    return want


def rows_for(cfg: LaunchConfig, rows: Sequence[BenchRow]) -> tuple[BenchRow, ...]:
    want = _wanted(cfg)
    return tuple(r for r in rows if all(dict(r.params).get(k, v) == v for k, v in want.items()))


# op_offload_min_batch is the engine's environment, read once per process: configs that differ in it never share one.
# An engine's own levers are one value per llama-bench process too (ik_llama.cpp's examples/llama-bench: params.repack,
# fmoe, …): every kind's, as the kind lists them.
_LOAD_FIELDS = ("model", "mmap", "repack", "no_host", "op_offload", "op_offload_min_batch", "device", "n_gpu_layers",
                "n_cpu_moe", "engine", *dict.fromkeys(lever for kind in KINDS for lever in kind.levers))
_SWEPT_FIELDS = ("cache_type_k", "cache_type_v", "flash_attn", "threads", "batch", "ubatch")


def _is_product(group: Sequence[LaunchConfig]) -> bool:
    axes = [list(dict.fromkeys(getattr(c, f) for c in group)) for f in _SWEPT_FIELDS]
    if math.prod(len(a) for a in axes) != len(set(group)):
        return False
    base = group[0]
    return all(replace(base, **dict(zip(_SWEPT_FIELDS, combo, strict=True))) in set(group)
               for combo in itertools.product(*axes))


def group_configs(cfgs: Sequence[LaunchConfig]) -> list[list[LaunchConfig]]:
    """Split configs into llama-bench runs: one per model load, each an exact cross product of its lists.

    llama-bench runs every combination of its comma lists and aborts the whole sweep at the first invalid
    one, so a group is only formed where every combination is a requested (hence validated) config.
    """
    by_load: dict[tuple[Any, ...], list[LaunchConfig]] = {}
    for cfg in dict.fromkeys(cfgs):
        flags.validate(cfg)
        key = tuple(getattr(cfg, f) for f in _LOAD_FIELDS) + tuple(
            getattr(cfg, f) is None for f in ("threads", "batch", "ubatch"))
        by_load.setdefault(key, []).append(cfg)
    groups: list[list[LaunchConfig]] = []
    for group in by_load.values():
        if _is_product(group):
            groups.append(group)
            continue
        # Otherwise vary one setting per run, choosing the setting that needs the fewest runs.
        best: list[list[LaunchConfig]] | None = None
        for free in _SWEPT_FIELDS:
            parts: dict[tuple[Any, ...], list[LaunchConfig]] = {}
            for cfg in group:
                parts.setdefault(tuple(getattr(cfg, f) for f in _SWEPT_FIELDS if f != free), []).append(cfg)
            if best is None or len(parts) < len(best):
                best = list(parts.values())
        groups.extend(best or [])
    return groups


def _tool(engine: EngineLocation, name: str) -> Path:
    try:
        return engine.tool(name)
    except EngineNotFoundError as exc:
        raise TrialFailedError(name, failures.from_error(exc)) from None


_Test = tuple[int, int, tuple[int, ...]]  # (n_prompt, n_gen, depths) of one llama-bench process


def _tests(n_prompt: int, n_gen: int, depths: Sequence[int], gen_depth: int | None) -> list[_Test]:
    """The llama-bench processes one measurement needs. With ``gen_depth`` the prompt test runs at ``depths``
    and the generation test at ``gen_depth`` in a second process of the same load: one process with both
    depths would also time the prompt at the generation depth (the dearest test there is) and throw it away."""
    if gen_depth is None or n_prompt == 0 or n_gen == 0 or [gen_depth] == list(depths):
        return [(n_prompt, n_gen, tuple(depths if gen_depth is None else [gen_depth]))]
    return [(n_prompt, 0, tuple(depths)), (0, n_gen, (gen_depth,))]


_NO_FA_KERNEL = "no FlashAttention vector kernel compiled"


def check_fa_kernels(engine: EngineLocation, cfgs: Sequence[LaunchConfig], log_text: str = "") -> None:
    """Refuse configs whose K/V pair this engine has no flash-attention vector kernel for: a CUDA build converts
    their whole cache to f16 at every token (``ggml_cuda_flash_attn_ext_vec`` warns "no FlashAttention vector
    kernel compiled for K/V types …"), so a figure would measure the conversion, not the pair. What the engine
    said in ``log_text`` is kept with its capabilities (:func:`tuner.engine.build.note_engine_log`), so a pair seen
    falling back once is refused before it runs for the rest of the run, with the flag that adds it."""
    if not any(c.flash_attn is not FlashAttn.OFF for c in cfgs):
        return
    if log_text and _NO_FA_KERNEL not in log_text:
        return  # a run's log that says nothing new: the check before it stands
    try:
        caps = build.note_engine_log(engine, log_text) if _NO_FA_KERNEL in log_text else build.capabilities(engine)
    except EngineNotFoundError:
        return  # the run itself says which tool is missing, as a trial failure
    fa = caps.fa_kernels
    for c in cfgs:
        if c.flash_attn is not FlashAttn.OFF and not fa.has(c.cache_type_k.value, c.cache_type_v.value):
            raise TrialFailedError("llama.cpp", failures.Failure(failures.FailureKind.REJECTED_CONFIG, fa.why_missing(
                c.cache_type_k.value, c.cache_type_v.value)))


RowFn = Callable[[BenchRow, Sequence[LaunchConfig]], None]  # a test's row, the configs of the process that wrote it


class _Streamed:
    """llama-bench's stdout as it comes: each test's row handed on once its object is whole (llama.cpp writes a jsonl
    line per test as it ends, ik_llama.cpp a json object per test as it ends), its stderr progress kept as the run's
    activity (:mod:`tuner.machine.activity`)."""

    def __init__(self, on_row: RowFn | None, cfgs: Sequence[LaunchConfig]) -> None:
        self._on_row = on_row
        self._cfgs = cfgs
        self._text: list[str] = []
        self._told = 0

    def stdout(self, line: str) -> None:
        self._text.append(line)
        if self._on_row is None or "}" not in line:
            return
        rows = parse_rows("\n".join(self._text))
        for row in rows[self._told:]:
            self._on_row(row, self._cfgs)
        self._told = len(rows)


def _activity(line: str) -> None:
    """llama-bench's progress ("llama-bench: benchmark 1/2: warmup prompt run") as the run's activity."""
    text = line.strip()
    if text.startswith("llama-bench: benchmark "):
        activity.doing(text.removeprefix("llama-bench: "))


def _bench_once(engine: EngineLocation, cfgs: Sequence[LaunchConfig], *, tests: Sequence[_Test],
                repetitions: int, timeout_s: float, caps: Capabilities | None,
                sampler: Sampler | None, on_row: RowFn | None = None
                ) -> tuple[tuple[str, ...], tuple[BenchRow, ...], float]:
    check_fa_kernels(engine, cfgs)
    argvs: list[str] = []
    rows: tuple[BenchRow, ...] = ()
    elapsed = 0.0
    for n_prompt, n_gen, depths in tests:
        argv = flags.bench_group_argv(_tool(engine, "llama-bench"), cfgs, n_prompt=n_prompt, n_gen=n_gen,
                                      repetitions=repetitions, depth=list(depths), caps=caps, progress=True)
        windows = phases.Windows()

        def started(pid: int, windows: phases.Windows = windows) -> None:
            windows.attach(pid)
            if sampler is not None:
                sampler.attach(pid)

        def progress(line: str, windows: phases.Windows = windows) -> bool:
            _activity(line)
            return phases.bench_line(windows, line)

        streamed = _Streamed(on_row, cfgs)
        activity.doing("llama-bench: loading the model")
        try:
            result = runner.run_process(
                argv, timeout_s=timeout_s, what="llama-bench", fix="check the model file and flags",
                on_start=started, on_stderr=progress, on_exit=windows.exited, env=flags.server_env(cfgs[0]),
                on_stdout=streamed.stdout,
            )
        except TunerError as exc:
            raise TrialFailedError("llama-bench", failures.from_error(exc)) from None
        # Test i is the i-th row (llama-bench prints each test's row when it is done, in order).
        got = tuple(replace(r, host=windows.of(i), host_runs=windows.count(i))
                    for i, r in enumerate(parse_rows(result.stdout)))
        if not dialect.kind_for(caps, cfgs[0]).bench_has_depth and n_prompt > 0:
            got = prompt_at_depth(got, n_prompt, depths)  # ik: a prompt at depth from two prompts' times
        gpu_use.check_bench(got[0].gpu_info if got else None, result.stderr_tail, cfgs[0])
        check_fa_kernels(engine, cfgs, result.stderr_tail)
        expected = ((n_prompt > 0) + (n_gen > 0)) * len(depths) * len(cfgs)
        if len(got) < expected:
            # llama-bench can stop part-way through a sweep and still exit 0.
            err = ProcessFailedError("llama-bench", argv, result.returncode, result.stderr_tail,
                                     f"it reported {len(got)} of {expected} tests")
            raise TrialFailedError("llama-bench", failures.from_error(err))
        argvs = argv if not argvs else [*argvs, "&&", *argv]
        rows += got
        elapsed += result.elapsed_s
    return tuple(argvs), rows, elapsed


def _merge(old: tuple[BenchRow, ...], new: tuple[BenchRow, ...]) -> tuple[BenchRow, ...]:
    merged = []
    for row in old:
        extra = next((n for n in new if (n.kind, n.n_depth, n.params) == (row.kind, row.n_depth, row.params)), None)
        if extra is None:
            merged.append(row)
            continue
        samples = row.samples_tok_s + extra.samples_tok_s
        merged.append(replace(row, samples_tok_s=samples, avg_tok_s=statistics.fmean(samples),
                              stddev_tok_s=statistics.stdev(samples) if len(samples) > 1 else 0.0,
                              host=pressure.combined((row.host, extra.host)),
                              host_runs=row.host_runs + extra.host_runs))
    return tuple(merged)


def run_bench_group(
    engine: EngineLocation,
    cfgs: Sequence[LaunchConfig],
    *,
    n_prompt: int = 512,
    n_gen: int = 128,
    depth: int | Sequence[int] = 0,
    gen_depth: int | None = None,
    repetitions: int | None = None,
    rse_target_pct: float = RSE_TARGET_PCT,
    max_repetitions: int = MAX_REPETITIONS,
    timeout_s: float = 1800.0,
    caps: Capabilities | None = None,
    sampler: Sampler | None = None,
    on_row: RowFn | None = None,
) -> list[BenchResult]:
    """llama-bench for configs sharing a model load, one result per config.

    ``depth``: the context filled before each test; ``gen_depth``, when given, replaces it for the generation
    test only (a workload's prompt starts at its history, its reply at history + prompt).
    With ``repetitions`` the count is exact; without it, runs repeat until every figure's relative standard
    error is <= ``rse_target_pct`` or ``max_repetitions`` samples are in.
    """
    depths = [depth] if isinstance(depth, int) else list(depth)
    tests = _tests(n_prompt, n_gen, depths, gen_depth)
    reps = repetitions or MIN_REPETITIONS
    argv, rows, elapsed = _bench_once(engine, cfgs, tests=tests, repetitions=reps, timeout_s=timeout_s,
                                      caps=caps, sampler=sampler, on_row=on_row)
    runs, done = 1, reps
    while repetitions is None and done < max_repetitions and any(
            r.spread.rse_pct > rse_target_pct for r in rows):
        more = min(MIN_REPETITIONS, max_repetitions - done)
        _, extra, took = _bench_once(engine, cfgs, tests=tests, repetitions=more, timeout_s=timeout_s, caps=caps,
                                     sampler=sampler, on_row=on_row)
        rows, runs, done, elapsed = _merge(rows, extra), runs + 1, done + more, elapsed + took
    memory = sampler.report() if sampler else None
    return [BenchResult(argv, rows_for(cfg, rows) if len(cfgs) > 1 else rows, elapsed, cfg, runs, memory, len(cfgs))
            for cfg in cfgs]


def run_bench(
    engine: EngineLocation,
    cfg: LaunchConfig,
    *,
    n_prompt: int = 512,
    n_gen: int = 128,
    repetitions: int | None = 3,
    depth: int | Sequence[int] = 0,
    gen_depth: int | None = None,
    timeout_s: float = 1800.0,
    caps: Capabilities | None = None,
    sampler: Sampler | None = None,
    max_repetitions: int = MAX_REPETITIONS,
) -> BenchResult:
    """One config with llama-bench; ``repetitions=None`` repeats until the spread is small (noise control)."""
    return run_bench_group(engine, [cfg], n_prompt=n_prompt, n_gen=n_gen, depth=depth, gen_depth=gen_depth,
                           repetitions=repetitions, timeout_s=timeout_s, caps=caps, sampler=sampler,
                           max_repetitions=max_repetitions)[0]


def run_bench_many(engine: EngineLocation, cfgs: Sequence[LaunchConfig], *,
                   on_done: Callable[[LaunchConfig, BenchResult | failures.Failure], None] | None = None,
                   **kwargs: Any) -> list[BenchResult | failures.Failure]:
    """Every config, grouped by model load; a failed group is retried one config at a time to find the culprit.
    ``on_done``: told each config's result as its group ends (a search tells its trials as they end, not together)."""
    out: dict[LaunchConfig, BenchResult | failures.Failure] = {}

    def done(cfg: LaunchConfig, got: BenchResult | failures.Failure) -> None:
        out[cfg] = got
        if on_done is not None:
            on_done(cfg, got)

    for group in group_configs(cfgs):
        try:
            results = run_bench_group(engine, group, **kwargs)
        except TrialFailedError as exc:
            if len(group) == 1:
                done(group[0], exc.failure)
                continue
            for cfg in group:
                try:
                    done(cfg, run_bench_group(engine, [cfg], **kwargs)[0])
                except TrialFailedError as one:
                    done(cfg, one.failure)
            continue
        for res in results:
            assert res.config is not None
            done(res.config, res)
    return [out[c] for c in cfgs]


# ------------------------------------------------------------------------------------------ server trial


@dataclass(frozen=True, slots=True)
class ServerTrial:
    argv: tuple[str, ...]
    config: LaunchConfig
    workload: Workload
    levels: tuple[LevelResult, ...]
    memory: MemoryReport
    spill: SpillVerdict
    log_path: Path
    # Machine records from --log-jsonl (fit_memory_breakdown at start and exit), raw for tuner.engine.breakdown.
    log_records: tuple[dict[str, Any], ...] = ()
    # llama.cpp's own memory breakdown (the at-exit record; the projected one when the exit record was lost).
    memory_breakdown: MemoryBreakdown | None = None
    # The generation ceiling from tuner.plan.roofline for this config and machine, when known.
    roofline_tok_s: float | None = None
    host_paging: PagingVerdict = NOT_MEASURED  # host RAM: was the model read back from disk while it generated

    @property
    def eligible(self) -> bool:
        """A config that pages host RAM is never the printed line (whatever its speed on this run)."""
        return not self.host_paging.paging

    @property
    def tokens_per_joule(self) -> float | None:
        return self.memory.tokens_per_joule(sum(lvl.gen_tokens for lvl in self.levels))


def slot_context(cfg: LaunchConfig) -> int | None:
    """Tokens one request may use: -c split over -np slots unless the KV cache is unified."""
    if cfg.ctx is None:
        return None
    slots = cfg.parallel or 1
    return cfg.ctx if cfg.kv_unified else cfg.ctx // slots


def run_server_trial(
    engine: EngineLocation,
    cfg: LaunchConfig,
    load: Workload,
    *,
    log_dir: Path,
    caps: Capabilities | None = None,
    nvml: Any = None,
    load_timeout_s: float = 300.0,
    request_timeout_s: float = 300.0,
    roofline_tok_s: float | None = None,
    on_ready: Callable[[runner.ServerProcess], None] | None = None,
    vram_budget_bytes: int | None = None,
) -> ServerTrial:
    """llama-server with exactly ``cfg``: warm up, then the workload at concurrency 1..parallel, sampled."""
    per_slot = slot_context(cfg)
    if per_slot is not None and load.prompt_tokens + load.gen_tokens > per_slot:
        raise UsageError(
            f"{load.prompt_tokens}+{load.gen_tokens} tokens do not fit the {per_slot}-token slot context: "
            "raise -c, use --kv-unified, or lower -p/-n"
        )
    check_fa_kernels(engine, [cfg])
    argv = flags.server_argv(_tool(engine, "llama-server"), cfg, caps) + \
        flags.file_log_argv(dialect.kind_for(caps, cfg), log_dir)
    log_jsonl = flags.server_logs_jsonl(caps)
    sampler = Sampler(nvml)
    sampler.start()
    levels: tuple[LevelResult, ...] = ()
    failure: failures.Failure | None = None
    try:
        with runner.serve(argv, log_dir=log_dir, load_timeout_s=load_timeout_s, log_jsonl=log_jsonl,
                          env=flags.server_env(cfg)) as server:
            sampler.attach(server.proc.pid)
            if on_ready is not None:
                on_ready(server)
            levels = workload.run_workload(server, load, cfg.parallel or 1, timeout_s=request_timeout_s,
                                           on_timed=sampler.begin_timed)
            sampler.end_timed()
            sampler.sample_now()
    except TunerError as exc:
        failure = failures.from_error(exc)
    finally:
        memory = sampler.stop()
    if failure is not None:
        raise TrialFailedError("llama-server", failure)
    gen = levels[0].per_request_gen_tok_s if levels else None
    verdict = spill_verdict(memory, gen_tok_s=gen, roofline_tok_s=roofline_tok_s,
                            vram_budget_bytes=vram_budget_bytes)
    paging = paging_verdict(sampler.host, sum(lvl.gen_tokens for lvl in levels))
    if paging.paging:
        paging = replace(paging, fix=paging_fix(cfg))
    records = tuple(server.log_records())
    log_text = server.log.read_text(errors="replace")
    gpu_use.check_server(log_text, cfg)
    check_fa_kernels(engine, [cfg], log_text)
    found = breakdown.parse_log_jsonl(log_text) if log_jsonl else \
        [b for b in [breakdown.parse_load_log(log_text)] if b is not None]  # an engine without --log-jsonl
    return ServerTrial(tuple(server.argv), cfg, load, levels, memory, verdict, server.log, records,
                       memory_breakdown=found[-1] if found else None, roofline_tok_s=roofline_tok_s,
                       host_paging=paging)

