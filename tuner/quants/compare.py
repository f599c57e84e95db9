"""`compare-quants`: every quant of one model side by side — size, fit, best config, speed, quality, Pareto.

The Pareto front over generation tok/s and KLD sits beside the orchestration (:func:`compare`), which takes the
quants one at a time — downloads a published one or makes one here from a full-precision source
(:mod:`tuner.models.quantize`) — auto-tunes each with a small trial budget, measures its quality against one
reference, and drops files a ``--disk-budget`` has no room for (:mod:`tuner.quants.disk`); the answer to
"which quant?" under a speed floor and a loss budget is :mod:`tuner.quants.pick`'s. Tables, files and the
plot are :mod:`tuner.report.compare_report`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tuner.catalog import families
from tuner.core.errors import CpuFallbackError, OverBudgetError, QualityError, QuantizeError, TunerError, UsageError
from tuner.engine import build
from tuner.hub import repos
from tuner.machine.hardware import Hardware
from tuner.measure import gpu_use, workload
from tuner.models import gguf_reader, quantize
from tuner.models.gguf_reader import ModelInfo
from tuner.quality import kld, kv_price, perplexity
from tuner.quants import disk as quant_disk
from tuner.quants import pick as quant_pick
from tuner.quants import sources as plan_sources
from tuner.search import autotune, study
from tuner.search.budget import QUANT_TRIALS

DEFAULT_TRIALS = QUANT_TRIALS
REFERENCE_LOGITS, IMATRIX, KV_LOGITS = "the reference logits", "the importance matrix", "KV-pricing logits"

FitFn = Callable[[repos.Quant, ModelInfo], str]
MADE, PUBLISHED, LOCAL = plan_sources.MADE, plan_sources.PUBLISHED, plan_sources.LOCAL
StepFn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class QuantRow:
    """One quant's line in the comparison. Speed fields are None when tuning failed (``error`` says why)."""

    quant: str
    path: str
    size_bytes: int
    n_parts: int
    fit: str
    is_reference: bool = False
    launch_line: str | None = None
    gen_tok_s: float | None = None
    prompt_tok_s: float | None = None
    ppl: float | None = None
    ppl_error: float | None = None
    kld_mean: float | None = None
    kld_p99: float | None = None
    same_top_pct: float | None = None
    pareto: bool = False
    study: str | None = None
    published: str | None = None  # catalog figures, labelled as published, never measured here
    error: str | None = None
    origin: str = PUBLISHED  # made here | published | local file
    command: str | None = None  # for a quant made here: the exact llama-quantize command
    kld_mean_error: float | None = None  # half-width of the 90 % interval
    gen_tok_s_error: float | None = None  # half-width of the 90 % interval of the mean, over quiet rounds
    depth_tokens: int | None = None  # context depth the speed was measured at
    verdict: str = ""
    kept: bool = True  # the file is still on disk (a --disk-budget drops the others)
    config_name: str | None = None  # the best config in a few letters: KV types, --n-cpu-moe, slots


@dataclass(frozen=True, slots=True)
class CompareRequest:
    sources: tuple[str, ...]  # one Hub repo (owner/name[:QUANT]) or GGUF files
    quants: tuple[str, ...] = ()  # empty: every quant in the repo
    trials: int = DEFAULT_TRIALS
    min_ctx: int | None = None
    workload: workload.Workload = workload.preset(workload.WorkloadKind.CHAT)
    kld_ctx: int = perplexity.DEFAULT_CTX
    kld_chunks: int = perplexity.DEFAULT_CHUNKS
    reference: Path | None = None
    out_dir: Path | None = None
    options: repos.HubOptions = repos.DEFAULT_OPTIONS
    make: tuple[str, ...] = ()  # recipes to make here: Q4_K_M, IQ4_XS, Q3_K_M/Q8_0 (experts/rest)
    make_from: str | None = None  # F16/BF16/Q8_0 .gguf or a repo (its full-precision quant); None: see _source
    imatrix: bool = False
    disk_budget_bytes: int | None = None
    min_tok_s: float | None = None
    max_kld: float | None = None
    device: str | None = None  # -dev of every tuned config: "none" measures the CPU on purpose


@dataclass(frozen=True, slots=True)
class Comparison:
    title: str
    reference: str | None
    rows: tuple[QuantRow, ...]
    out_dir: Path
    catalog_model: str | None = None
    pick: str | None = None
    binding: str = ""
    disk_used_bytes: int | None = None
    undecided: tuple[str, ...] = ()  # rows whose interval straddles a limit, with why

    @property
    def measured(self) -> int:
        return sum(r.gen_tok_s is not None or r.kld_mean is not None for r in self.rows)


# ----------------------------------------------------------------------------------------- pure logic


def pareto_flags(rows: Sequence[QuantRow]) -> list[bool]:
    """On the front: no other row is at least as fast (gen tok/s) and as close (mean KLD), and better in one."""
    return study.non_dominated([(r.gen_tok_s, -r.kld_mean) if r.gen_tok_s is not None and r.kld_mean is not None
                                else None for r in rows])


def with_pareto(rows: Sequence[QuantRow]) -> tuple[QuantRow, ...]:
    return tuple(replace(r, pareto=f) for r, f in zip(rows, pareto_flags(rows), strict=True))


def config_name(config: dict[str, Any], slots: int = 1) -> str:
    """The best config as a short name for an 80-column table: ``f16``, ``q8 cm12``, ``q8/q4 cm40 np2`` (the K/V
    cache types without ``_0``, ``cm``: --n-cpu-moe, ``np``: slots); the full launch line goes below the table."""
    k, v = (str(config.get(key) or "f16").removesuffix("_0") for key in ("cache_type_k", "cache_type_v"))
    name = k if k == v else f"{k}/{v}"
    if config.get("n_cpu_moe"):
        name += f" cm{config['n_cpu_moe']}"
    return name + (f" np{slots}" if slots > 1 else "")


def default_out_dir(sources: Sequence[str]) -> Path:
    ref = repos.parse_hub_ref(sources[0]) if len(sources) == 1 else None
    name = ref.repo_id.split("/")[-1] if ref else Path(sources[0]).stem
    return Path("results") / f"compare-{name}"


# -------------------------------------------------------------------------------------- orchestration


def _published(known: families.CatalogModel | None, quant: str) -> str | None:
    figs = known.figures_for(quant) if known else []
    if not figs:
        return None
    f = figs[0]
    parts = [f"{k} {v:g}" for k, v in f.figures.items()]
    where = (f.gpu or "?") + (f", c {f.ctx}" if f.ctx else "")
    return f"{', '.join(parts)} ({where}; {known.sources.get(f.source, f.source) if known else f.source})"


def _measure_one(row: QuantRow, path: Path, req: CompareRequest, reference: Path | None,
                 loc: build.EngineLocation, tune_hw: Hardware, out_dir: Path, on_step: StepFn) -> QuantRow:
    row = replace(row, is_reference=reference is not None and path.resolve() == reference.resolve())
    on_step(f"{row.quant}: quality against {reference.name if reference else 'no reference (PPL only)'}")
    try:
        q = perplexity.measure(loc, path, reference=reference, auto_reference=False, ctx=req.kld_ctx,
                               chunks=req.kld_chunks, on_step=on_step)
    except QualityError as exc:  # this quant's row says why; the comparison goes on with the next
        return replace(row, error=str(exc))
    row = replace(row, ppl=q.ppl, ppl_error=q.ppl_error, kld_mean=q.kld_mean, kld_p99=q.kld_p99,
                  same_top_pct=q.same_top_pct,
                  kld_mean_error=quant_pick.kld_error(q.kld_mean_error) if q.kld_mean is not None else None)
    on_step(f"{row.quant}: auto-tune, {req.trials} trial(s)")
    load = req.workload
    tune = autotune.TuneRequest(model=path, workload=load, min_ctx=req.min_ctx,
                                budget=study.Budget(trials=req.trials),
                                measure=study.Measure.for_workload(load),
                                results_dir=out_dir / "tune", device=req.device)
    try:
        res = autotune.auto_tune(tune, loc, tune_hw, on_step=on_step,
                                 on_progress=lambda pr: on_step(f"{row.quant}: {pr.describe()}"))
    except CpuFallbackError:
        raise  # the engine is not on the GPU: every row would be a CPU figure, so the comparison stops
    except TunerError as exc:
        return replace(row, error=str(exc))
    if res.search.interrupted:  # Ctrl-C or SIGTERM stops the comparison (rows kept resume), not this quant only
        raise KeyboardInterrupt(f"{row.quant}: auto-tune interrupted")
    w = res.result.to_dict().get("winner") or {}
    if w.get("gen_tok_s") is None:
        return replace(row, study=res.study_name, error="no config measured with llama-server")
    # The speed the pick judges: the printed line's quiet rounds (its confirmation rounds when the finish selected
    # among candidates: not the rounds that chose it), as their mean with the interval around that mean.
    # Every round busy (--allow-busy): the median of them all, with no interval, so it decides no limit.
    quiet = w.get("quiet_gen_samples_tok_s") or []
    return replace(row, launch_line=w.get("launch_line"), gen_tok_s=quant_pick.speed_mean(quiet) or w["gen_tok_s"],
                   config_name=config_name(w.get("config") or {}, int(w.get("slots") or 1)),
                   prompt_tok_s=w.get("prompt_tok_s"), study=res.study_name, depth_tokens=load.gen_depth,
                   gen_tok_s_error=quant_pick.speed_error(quiet))


def choose(rows: Sequence[QuantRow], min_tok_s: float | None, max_kld: float | None) -> quant_pick.Pick:
    return quant_pick.pick([quant_pick.Candidate(r.quant, r.size_bytes, r.gen_tok_s, r.gen_tok_s_error,
                                                 r.kld_mean, r.kld_mean_error)
                            for r in rows if r.error is None], min_tok_s, max_kld)


def _fingerprint(req: CompareRequest) -> str:
    # Not the quant lists: a comparison run again with more (or fewer) quants keeps the rows it measured.
    return quant_disk.fingerprint(sources=req.sources, make_from=req.make_from, imatrix=req.imatrix,
                                  trials=req.trials, min_ctx=req.min_ctx, workload=req.workload.describe(),
                                  kld=(req.kld_ctx, req.kld_chunks),
                                  reference=str(req.reference))


def normalized(req: CompareRequest) -> tuple[CompareRequest, str | None]:
    """The request as compare runs it (a local F16 with --quants: those quants made from it), and a note."""
    sources, quants, make, make_from, note = plan_sources.normalize(req.sources, req.quants, req.make, req.make_from)
    return replace(req, sources=sources, quants=quants, make=make, make_from=make_from), note


def compare(req: CompareRequest, loc: build.EngineLocation, tune_hw: Hardware, fit_of: FitFn, *,
            on_step: StepFn | None = None) -> Comparison:
    """Fetch or make, tune and measure each quant in turn, within the disk budget; resumable. The report files
    (report.md, compare.csv, compare.json, the plot) are the caller's to write."""
    if req.trials < 1 or req.kld_chunks < 1:
        raise UsageError("--trials and --chunks must be >= 1")
    if req.disk_budget_bytes is not None and req.disk_budget_bytes <= 0:
        raise UsageError("--disk-budget must be > 0 GiB")
    say = on_step or (lambda _msg: None)
    # Before anything is fetched or made: a GPU rig whose engine runs on the CPU stops here.
    tune_hw = gpu_use.preflight(loc, tune_hw, req.device)
    req, note = normalized(req)
    if note:
        say(note)
    out_dir = req.out_dir or default_out_dir(req.sources or (req.make_from or "made",))
    out_dir.mkdir(parents=True, exist_ok=True)
    owned = quant_disk.load_owned(out_dir)  # what earlier runs of this comparison fetched or made
    plan = plan_sources.plan(req.sources, req.quants, req.make, req.make_from, req.reference, req.imatrix,
                             req.options, loc, out_dir, lambda q: q in owned, say)
    known = families.find_model(plan.catalog) if plan.catalog else None
    key = _fingerprint(req)
    names = {t.name for t in plan.targets}
    rows = [QuantRow(**d) for d in quant_disk.load_rows(out_dir, key) if d.get("quant") in names]
    done = {r.quant for r in rows}
    if done:
        say(f"resuming: {len(done)} quant(s) already measured ({', '.join(sorted(done))})")
    for stale in (out_dir / "quants").glob("*.part"):  # a quant an interrupted run was making: made again
        stale.unlink(missing_ok=True)
    ledger = quant_disk.DiskLedger(out_dir, req.disk_budget_bytes)
    for q, paths in owned.items():  # what an earlier run fetched or made and kept stays counted and droppable
        if q in names and all(p.is_file() for p in paths):
            ledger.keep(q, paths, _dropper(out_dir, q, paths))
    todo = [t for t in plan.targets if t.name not in done]
    kv_logits = _fixed_part(plan, req, loc, ledger, todo)
    rows = _measure_all(todo, rows, plan, req, loc, tune_hw, fit_of, ledger, kv_logits, known, out_dir, key, say)
    final = choose(rows, req.min_tok_s, req.max_kld)
    rows = [replace(r, verdict=final.verdicts.get(r.quant, r.verdict or quant_pick.UNMEASURED),
                    kept=r.kept and Path(r.path).is_file()) for r in rows]
    rows.sort(key=lambda r: r.size_bytes)
    ref = plan.reference
    reference = None if ref is None else str(ref.path) if ref.fetched else ref.name
    return Comparison(title=plan.title, reference=reference, rows=with_pareto(rows),
                      out_dir=out_dir, catalog_model=known.name if known else None, pick=final.quant,
                      binding=final.binding, disk_used_bytes=ledger.used_bytes(), undecided=final.undecided)


def _fixed_part(plan: plan_sources.Plan, req: CompareRequest, loc: build.EngineLocation,
                ledger: quant_disk.DiskLedger, todo: list[plan_sources.Target]) -> int:
    """Reserve, check and fetch what the comparison keeps throughout: the reference and the source (every shard),
    the reference logits, the importance matrix. Refuses in one line, before fetching anything, when that alone
    or with the smallest quant does not fit the budget. Returns the bytes of one quant's KV-pricing logits."""
    header = (plan.reference or plan.source)
    info = header.info() if header is not None else None
    for f in dict.fromkeys(x for x in (plan.reference, plan.source) if x is not None and x.counted_bytes):
        ledger.reserve(f.label, f.counted_bytes)
    if plan.reference is not None and info is not None:
        ledger.reserve(REFERENCE_LOGITS, kld.logits_bytes(info.n_vocab, req.kld_ctx, req.kld_chunks))
    if req.imatrix and plan.source is not None:
        ledger.reserve(IMATRIX, quant_disk.imatrix_bytes_bound(plan.source.info()))
    if info is None and todo:  # no reference: the vocabulary of the first quant on disk (local files)
        info = gguf_reader.inspect_model(todo[0].fetch().path)
    kv_logits = kld.logits_bytes(info.n_vocab, kv_price.PRICE_CTX, kv_price.PRICE_CHUNKS) if info else 0
    if not todo:
        return kv_logits
    _check_fixed(ledger, [], kv_logits)
    # Made quants are sized from the source's header (no byte of the source fetched yet): a budget that cannot hold
    # the source and the smallest of them is refused now, not after the download and the importance matrix.
    early = [t.estimate_bytes() if t.sized_now else t.header_estimate() for t in todo]
    _check_fixed(ledger, [b for b in early if b is not None], kv_logits)
    for f in dict.fromkeys(x for x in (plan.reference, plan.source) if x is not None):
        paths = f.fetch()
        if f.counted_bytes:
            ledger.keep(f.label, paths)
    if plan.reference is not None and (logits := _logits_of(plan.reference.path, req, loc)) is not None:
        ledger.keep(REFERENCE_LOGITS, (logits,))
    if (matrix := plan.imatrix()) is not None:
        ledger.keep(IMATRIX, (matrix,))
    _check_fixed(ledger, [t.estimate_bytes() for t in todo], kv_logits)
    return kv_logits


def _check_fixed(ledger: quant_disk.DiskLedger, quant_bytes: list[int], kv_logits: int) -> None:
    """Refuse in one line when the fixed part, or the fixed part and the smallest quant, exceeds the budget."""
    if ledger.budget_bytes is None:
        return
    floor = ledger.used_bytes() - sum(ledger.label_bytes(q) for q in ledger.droppable)
    smallest = min(quant_bytes, default=0)
    need = floor + smallest + (kv_logits if quant_bytes else 0) + quant_disk.WORK_RESERVE_BYTES
    if need <= ledger.budget_bytes:
        return
    fixed = quant_disk.parts_line(ledger.kept_parts())
    what = (f"the comparison's fixed part ({fixed})" if not quant_bytes else
            f"the fixed part ({fixed}) with the smallest quant ({quant_disk.gib(smallest)}, and "
            f"{quant_disk.gib(kv_logits)} of KV-pricing logits while it is tuned)")
    raise OverBudgetError(f"{what} needs {quant_disk.gib(need)} with the work reserve, over --disk-budget "
                          f"{quant_disk.gib(ledger.budget_bytes)}: raise it to at least {need / 2**30:.3f}, or "
                          "lower --chunks or -c (smaller reference logits)")


def _measure_all(todo: list[plan_sources.Target], rows: list[QuantRow], plan: plan_sources.Plan,
                 req: CompareRequest, loc: build.EngineLocation, tune_hw: Hardware, fit_of: FitFn,
                 ledger: quant_disk.DiskLedger, kv_logits: int, known: families.CatalogModel | None, out_dir: Path,
                 key: str, say: StepFn) -> list[QuantRow]:
    reference = plan.reference.path if plan.reference is not None and todo else None
    for t in todo:
        winner = choose(rows, req.min_tok_s, req.max_kld).quant
        try:
            need = quant_disk.Need(((f"the quant {t.name}", t.estimate_bytes()), ("its KV-pricing logits", kv_logits)))
            for q in ledger.make_room(need, {winner} if winner else set(), t.name):
                say(f"disk budget: dropped {q}")
                rows = [replace(r, kept=False) if r.quant == q else r for r in rows]
            got = t.fetch()
        except (OverBudgetError, QuantizeError) as exc:
            say(f"{t.name}: {exc}")
            rows.append(QuantRow(quant=t.name, path="", size_bytes=0, n_parts=t.n_parts, fit="", origin=t.origin,
                                 error=str(exc), kept=False))
            quant_disk.save_rows(out_dir, key, [asdict(r) for r in rows])
            continue
        if got.owned:
            ledger.keep(t.name, got.paths, _dropper(out_dir, t.name, got.paths))
            quant_disk.save_owned(out_dir, t.name, got.paths)
        quant = repos.Quant(t.name, tuple(repos.RemoteFile(p.name, p.stat().st_size, None) for p in got.paths))
        row = QuantRow(quant=t.name, path=str(got.path), size_bytes=quant.total_bytes, n_parts=quant.n_parts,
                       fit=fit_of(quant, gguf_reader.inspect_model(got.path)), origin=t.origin, command=got.command)
        ledger.reserve(KV_LOGITS, kv_logits)
        kv_file = _kv_logits_of(got.path, loc)
        try:
            row = _measure_one(row, got.path, req, reference, loc, tune_hw, out_dir, say)
        finally:
            _drop_kv_logits(got.path, loc, kv_file, reference, req)
            ledger.forget(KV_LOGITS)
        rows.append(replace(row, published=_published(known, t.name)))
        if reference is not None and (logit := _logits_of(reference, req, loc)) is not None:
            ledger.keep(REFERENCE_LOGITS, (logit,))
        quant_disk.save_rows(out_dir, key, [asdict(r) for r in rows])
    return rows


def _dropper(out_dir: Path, quant: str, paths: tuple[Path, ...]) -> Callable[[], None]:
    def drop() -> None:
        quant_disk.drop_files(paths)  # a downloaded file's blob behind its cache link too
        for p in paths:
            quantize.drop(p)  # a made file's sidecar
        quant_disk.save_owned(out_dir, quant, None)
    return drop


def _logits_of(reference: Path, req: CompareRequest, loc: build.EngineLocation) -> Path | None:
    """The cached reference logits file the quality measure wrote (the budget counts it)."""
    return perplexity.cached_logits_path(loc, reference, ctx=req.kld_ctx, chunks=req.kld_chunks)


def _kv_logits_of(model: Path, loc: build.EngineLocation) -> Path | None:
    """The KV-pricing logits of ``model`` when they are cached before its auto-tune (then they are not ours)."""
    return perplexity.cached_logits_path(loc, model, ctx=kv_price.PRICE_CTX, chunks=kv_price.PRICE_CHUNKS)


def _drop_kv_logits(model: Path, loc: build.EngineLocation, before: Path | None, reference: Path | None,
                    req: CompareRequest) -> None:
    """Delete the f16-KV logits a quant's auto-tune wrote to price its KV types (tuner.quality.kv_price): its
    prices are cached as results, and on a 152K-vocabulary model each file is ~0.6 GB. Never the reference
    logits, nor a file that was there before."""
    path = _kv_logits_of(model, loc)
    if path is None or before is not None:
        return
    if reference is not None and path == _logits_of(reference, req, loc):
        return
    path.unlink(missing_ok=True)
    path.with_suffix(".json").unlink(missing_ok=True)
