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

from tuner.catalog import families
from tuner.core.errors import OverBudgetError, QuantizeError, TunerError, UsageError
from tuner.engine import build
from tuner.hub import download, repos
from tuner.machine.hardware import Hardware
from tuner.measure import workload
from tuner.models import gguf_reader, quantize
from tuner.models.gguf_reader import ModelInfo
from tuner.quality import imatrix, kld, perplexity
from tuner.quants import disk as quant_disk
from tuner.quants import pick as quant_pick
from tuner.search import autotune, study

DEFAULT_TRIALS = 4
# Reference quants, best first, when the repo holds one; otherwise the largest quant is the reference.
REFERENCE_QUANTS = ("F32", "BF16", "F16", "Q8_0")

FitFn = Callable[[repos.Quant, ModelInfo], str]
MADE, PUBLISHED, LOCAL = "made here", "published", "local file"
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
    gen_tok_s_error: float | None = None  # half-width of the 90 % interval over the finish's rounds
    depth_tokens: int | None = None  # context depth the speed was measured at
    verdict: str = ""
    kept: bool = True  # the file is still on disk (a --disk-budget drops the others)


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


# ----------------------------------------------------------------------------------------- pure logic


def pareto_flags(rows: Sequence[QuantRow]) -> list[bool]:
    """On the front: no other row is at least as fast (gen tok/s) and as close (mean KLD), and better in one."""
    return study.non_dominated([(r.gen_tok_s, -r.kld_mean) if r.gen_tok_s is not None and r.kld_mean is not None
                                else None for r in rows])


def with_pareto(rows: Sequence[QuantRow]) -> tuple[QuantRow, ...]:
    return tuple(replace(r, pareto=f) for r, f in zip(rows, pareto_flags(rows), strict=True))


def default_out_dir(sources: Sequence[str]) -> Path:
    ref = repos.parse_hub_ref(sources[0]) if len(sources) == 1 else None
    name = ref.repo_id.split("/")[-1] if ref else Path(sources[0]).stem
    return Path("results") / f"compare-{name}"


# -------------------------------------------------------------------------------------- orchestration


@dataclass(frozen=True, slots=True)
class _Target:
    """One quant to measure; ``fetch`` puts its file on disk (download or make) only when its turn comes."""

    name: str
    origin: str
    estimate_bytes: Callable[[], int]
    fetch: Callable[[], tuple[Path, str | None, Callable[[], None] | None]]  # path, command, drop (None: keep)
    size_bytes: int = 0
    n_parts: int = 1


def _local_quant(path: Path) -> repos.Quant:
    parts = gguf_reader.split_parts(path)
    return repos.Quant(repos.quant_name(path.name),
                     tuple(repos.RemoteFile(p.name, p.stat().st_size, None) for p in parts))


def _reference_quant(listing: repos.RepoQuants) -> repos.Quant:
    for name in REFERENCE_QUANTS:
        for q in listing.quants:
            if q.name.upper() == name:
                return q
    return max(listing.quants, key=lambda q: q.total_bytes)


def _published_target(repo_id: str, q: repos.Quant, options: repos.HubOptions, on_step: StepFn) -> _Target:
    def fetch() -> tuple[Path, str | None, Callable[[], None] | None]:
        on_step(f"fetching {repo_id}:{q.name} ({q.total_bytes / 2**20:,.1f} MiB)")
        got = download.download_quant(repo_id, q.name, options=options)
        fetched = got.downloaded_bytes + got.resumed_from_bytes > 0  # ours to drop; a cached one is the user's

        def drop() -> None:
            download.drop_quant(got)
        return got.first_path, None, drop if fetched else None
    return _Target(q.name, PUBLISHED, lambda: q.total_bytes, fetch, q.total_bytes, q.n_parts)


def _local_target(p: Path) -> _Target:
    q = _local_quant(p)
    return _Target(q.name, MADE if quantize.made_command(p) else LOCAL, lambda: 0,
                   lambda: (p, quantize.made_command(p), None), q.total_bytes, q.n_parts)


def _made_target(loc: build.EngineLocation, source: Callable[[], Path], recipe: quantize.Recipe, out_dir: Path,
                 imat: Callable[[], Path | None], on_step: StepFn) -> _Target:
    def fetch() -> tuple[Path, str | None, Callable[[], None] | None]:
        made = quantize.make(loc, source(), out_dir, recipe, imatrix=imat(), on_step=on_step)
        return made.path, made.command, _dropper(made.path)
    return _Target(recipe.name, MADE, lambda: quantize.estimate_bytes(loc, source(), recipe, imat()), fetch)


def _make_source(req: CompareRequest, on_step: StepFn) -> tuple[Callable[[], Path], repos.HubRef | None]:
    """Where --make quantizes from: --from (a file or a repo), else the repo's or the files' full-precision
    copy. The repo's copy is fetched lazily, when the first quant is made."""
    spec = req.make_from
    if spec is None:
        if len(req.sources) == 1 and repos.parse_hub_ref(req.sources[0]):
            spec = req.sources[0]
        elif req.sources:
            found = perplexity.find_reference(Path(req.sources[0]).expanduser())
            if found is None:
                raise UsageError("--make needs a full-precision source: add --from MODEL-F16.gguf (or BF16/Q8_0)")
            spec = str(found)
        else:
            raise UsageError("--make needs a source: add --from MODEL-F16.gguf or --from owner/repo")
    ref = repos.parse_hub_ref(spec) if not Path(spec).expanduser().is_file() else None
    if ref is None:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UsageError(f"--from {path} not found: give an F16/BF16/Q8_0 .gguf or a Hugging Face repo")
        return (lambda: path), None
    cache: dict[str, Path] = {}

    def fetch() -> Path:
        if "p" not in cache:
            listing = repos.list_quants(ref.repo_id, options=req.options)
            q = listing.get(ref.quant) if ref.quant else _reference_quant(listing)
            on_step(f"fetching the source {ref.repo_id}:{q.name} ({q.total_bytes / 2**20:,.1f} MiB)")
            cache["p"] = download.download_quant(ref.repo_id, q.name, options=req.options).first_path
        return cache["p"]
    return fetch, ref


def _targets(req: CompareRequest, loc: build.EngineLocation, out_dir: Path, on_step: StepFn
             ) -> tuple[str, list[_Target], Callable[[], Path | None], str | None]:
    """(title, targets, reference, catalog key): published or local quants, then the quants to make."""
    refs = [repos.parse_hub_ref(s) for s in req.sources]
    targets: list[_Target] = []
    title, catalog = "", None
    reference: Callable[[], Path | None] = lambda: req.reference  # noqa: E731
    if req.sources and all(r is None for r in refs):
        paths = [Path(s).expanduser() for s in req.sources]
        for p in paths:
            if not p.is_file():
                raise UsageError(f"model {p} not found: give .gguf paths or one Hugging Face repo (owner/name)")
        targets = [_local_target(p) for p in paths]
        title = ", ".join(p.name for p in paths)
        if req.reference is None:
            found = perplexity.find_reference(paths[0])
            reference = lambda: found  # noqa: E731
    elif req.sources:
        if len(refs) != 1 or refs[0] is None:
            raise UsageError("compare-quants takes one Hugging Face repo or several .gguf files, not a mix")
        repo = refs[0]
        listing = repos.list_quants(repo.repo_id, options=req.options)
        if not listing.quants:
            raise repos.HubError(f"{repo.repo_id} holds no GGUF files: pick a GGUF repo (names often end in -GGUF)")
        wanted = req.quants or ((repo.quant,) if repo.quant else () if req.make else listing.names)
        targets = [_published_target(repo.repo_id, listing.get(n), req.options, on_step) for n in wanted]
        title, catalog = repo.repo_id, repo.repo_id
        if req.reference is None and not req.make:
            rq = _reference_quant(listing)
            reference = lambda: download.download_quant(repo.repo_id, rq.name,  # noqa: E731
                                                        options=req.options).first_path
    if req.make:
        source, _ = _make_source(req, on_step)
        recipes = quantize.parse_recipes(",".join(req.make), quantize.available_types(loc))
        imat_cache: dict[str, Path | None] = {}

        def imat() -> Path | None:
            if "m" not in imat_cache:
                imat_cache["m"] = imatrix.importance_matrix(loc, source(), on_step=on_step) if req.imatrix else None
            return imat_cache["m"]
        targets += [_made_target(loc, source, r, out_dir / "quants", imat, on_step) for r in recipes]
        title = title or (req.make_from or "made quants")
        if req.reference is None:
            reference = source
    if not targets:
        raise UsageError("nothing to compare: give a repo or .gguf files, or --make TYPES --from SOURCE")
    return title, targets, reference, catalog


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
    q = perplexity.measure(loc, path, reference=reference, auto_reference=False, ctx=req.kld_ctx,
                           chunks=req.kld_chunks, on_step=on_step)
    row = replace(row, ppl=q.ppl, ppl_error=q.ppl_error, kld_mean=q.kld_mean, kld_p99=q.kld_p99,
                  same_top_pct=q.same_top_pct,
                  kld_mean_error=quant_pick.kld_error(q.kld_mean_error) if q.kld_mean is not None else None)
    on_step(f"{row.quant}: auto-tune, {req.trials} trial(s)")
    load = req.workload
    tune = autotune.TuneRequest(model=path, workload=load, min_ctx=req.min_ctx,
                                budget=study.Budget(trials=req.trials),
                                measure=study.Measure.for_workload(load),
                                results_dir=out_dir / "tune")
    try:
        res = autotune.auto_tune(tune, loc, tune_hw, on_step=on_step)
    except TunerError as exc:
        return replace(row, error=str(exc))
    w = res.result.to_dict().get("winner") or {}
    if w.get("gen_tok_s") is None:
        return replace(row, study=res.study_name, error="no config measured with llama-server")
    return replace(row, launch_line=w.get("launch_line"), gen_tok_s=w.get("gen_tok_s"),
                   prompt_tok_s=w.get("prompt_tok_s"), study=res.study_name, depth_tokens=load.gen_depth,
                   gen_tok_s_error=quant_pick.speed_error(w.get("gen_samples_tok_s") or []))


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


def compare(req: CompareRequest, loc: build.EngineLocation, tune_hw: Hardware, fit_of: FitFn, *,
            on_step: StepFn | None = None) -> Comparison:
    """Fetch or make, tune and measure each quant in turn, within the disk budget; resumable. The report files
    (report.md, compare.csv, compare.json, the plot) are the caller's to write."""
    if req.trials < 1 or req.kld_chunks < 1:
        raise UsageError("--trials and --chunks must be >= 1")
    if req.disk_budget_bytes is not None and req.disk_budget_bytes <= 0:
        raise UsageError("--disk-budget must be > 0 GiB")
    say = on_step or (lambda _msg: None)
    out_dir = req.out_dir or default_out_dir(req.sources or (req.make_from or "made",))
    out_dir.mkdir(parents=True, exist_ok=True)
    title, targets, reference_of, catalog_key = _targets(req, loc, out_dir, say)
    known = families.find_model(catalog_key) if catalog_key else None
    key = _fingerprint(req)
    names = {t.name for t in targets}
    rows = [QuantRow(**d) for d in quant_disk.load_rows(out_dir, key) if d.get("quant") in names]
    done = {r.quant for r in rows}
    if done:
        say(f"resuming: {len(done)} quant(s) already measured ({', '.join(sorted(done))})")
    ledger = quant_disk.DiskLedger(out_dir, req.disk_budget_bytes)
    for stale in (out_dir / "quants").glob("*.part"):  # a quant an interrupted run was making: made again
        stale.unlink(missing_ok=True)
    for r in rows:  # what an earlier run kept stays counted and droppable
        if r.kept and Path(r.path).is_file() and _inside_dir(Path(r.path), out_dir):
            ledger.keep(r.quant, Path(r.path), _dropper(Path(r.path)))
    reference: Path | None = None
    for t in targets:
        if t.name in done:
            continue
        winner = choose(rows, req.min_tok_s, req.max_kld).quant
        try:
            if reference is None:
                reference = reference_of()
            need = t.estimate_bytes()
            if reference is not None and "reference logits" not in ledger.external:
                need += kld.logits_bytes(gguf_reader.inspect_model(reference).n_vocab, req.kld_ctx, req.kld_chunks)
                if _inside_dir(reference, req.options.hub_cache):  # fetched for this comparison: it counts
                    ledger.keep_file("reference", reference)
            for q in ledger.make_room(need, {winner} if winner else set(), f"{t.name}"):
                say(f"disk budget: dropped {q}")
                rows = [replace(r, kept=False) if r.quant == q else r for r in rows]
            path, command, drop = t.fetch()
        except (OverBudgetError, QuantizeError) as exc:
            rows.append(QuantRow(quant=t.name, path="", size_bytes=0, n_parts=t.n_parts, fit="", origin=t.origin,
                                 error=str(exc), kept=False))
            quant_disk.save_rows(out_dir, key, [asdict(r) for r in rows])
            continue
        if drop is not None:
            ledger.keep(t.name, path, drop)
        quant = repos.Quant(t.name, tuple(repos.RemoteFile(p.name, p.stat().st_size, None)
                                          for p in gguf_reader.split_parts(path)))
        row = QuantRow(quant=t.name, path=str(path), size_bytes=quant.total_bytes, n_parts=quant.n_parts,
                       fit=fit_of(quant, gguf_reader.inspect_model(path)), origin=t.origin, command=command)
        row = _measure_one(row, path, req, reference, loc, tune_hw, out_dir, say)
        rows.append(replace(row, published=_published(known, t.name)))
        if reference is not None and (logit := _logits_of(reference, req, loc)) is not None:
            ledger.keep_file("reference logits", logit)
        quant_disk.save_rows(out_dir, key, [asdict(r) for r in rows])
    final = choose(rows, req.min_tok_s, req.max_kld)
    rows = [replace(r, verdict=final.verdicts.get(r.quant, r.verdict or quant_pick.UNMEASURED),
                    kept=r.kept and Path(r.path).is_file()) for r in rows]
    rows.sort(key=lambda r: r.size_bytes)
    return Comparison(title=title, reference=str(reference) if reference else None, rows=with_pareto(rows),
                      out_dir=out_dir, catalog_model=known.name if known else None, pick=final.quant,
                      binding=final.binding, disk_used_bytes=ledger.used_bytes())


def _dropper(path: Path) -> Callable[[], None]:
    def drop() -> None:
        quantize.drop(path)
    return drop


def _inside_dir(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _logits_of(reference: Path, req: CompareRequest, loc: build.EngineLocation) -> Path | None:
    """The cached reference logits file the quality measure wrote (the budget counts it)."""
    return perplexity.cached_logits_path(loc, reference, ctx=req.kld_ctx, chunks=req.kld_chunks)
