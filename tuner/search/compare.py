"""`compare-quants`: every quant of one model side by side — size, fit, best config, speed, quality, Pareto.

The Pareto front over generation tok/s and KLD sits beside the orchestration (:func:`compare`), which downloads
the quants, auto-tunes each with a small trial budget, measures its quality against one reference and reads
published figures from the catalog. Tables, files and the plot are :mod:`tuner.report.compare_report`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tuner.catalog import families
from tuner.core.errors import TunerError, UsageError
from tuner.engine import build
from tuner.hub import download, repos
from tuner.machine.hardware import Hardware
from tuner.measure import workload
from tuner.models import gguf_reader
from tuner.models.gguf_reader import ModelInfo
from tuner.quality import perplexity
from tuner.search import autotune, study

DEFAULT_TRIALS = 4
# Reference quants, best first, when the repo holds one; otherwise the largest quant is the reference.
REFERENCE_QUANTS = ("F32", "BF16", "F16", "Q8_0")

FitFn = Callable[[repos.Quant, ModelInfo], str]
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


@dataclass(frozen=True, slots=True)
class Comparison:
    title: str
    reference: str | None
    rows: tuple[QuantRow, ...]
    out_dir: Path
    catalog_model: str | None = None


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
    quant: repos.Quant
    path: Path


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


def _targets(req: CompareRequest, on_step: StepFn) -> tuple[str, list[_Target], Path | None, str | None]:
    """(title, targets, reference path, catalog key) — Hub quants downloaded into the HF cache first."""
    refs = [repos.parse_hub_ref(s) for s in req.sources]
    if all(r is None for r in refs):
        paths = [Path(s).expanduser() for s in req.sources]
        for p in paths:
            if not p.is_file():
                raise UsageError(f"model {p} not found: give .gguf paths or one Hugging Face repo (owner/name)")
        targets = [_Target(_local_quant(p), p) for p in paths]
        ref = req.reference or perplexity.find_reference(paths[0])
        return ", ".join(p.name for p in paths), targets, ref, None
    if len(refs) != 1 or refs[0] is None:
        raise UsageError("compare-quants takes one Hugging Face repo or several .gguf files, not a mix")
    repo = refs[0]
    listing = repos.list_quants(repo.repo_id, options=req.options)
    if not listing.quants:
        raise repos.HubError(f"{repo.repo_id} holds no GGUF files: pick a GGUF repo (names often end in -GGUF)")
    wanted = req.quants or ((repo.quant,) if repo.quant else listing.names)
    chosen = [listing.get(name) for name in wanted]
    targets = []
    for q in chosen:
        on_step(f"fetching {repo.repo_id}:{q.name} ({q.total_bytes / 2**20:,.1f} MiB)")
        got = download.download_quant(repo.repo_id, q.name, options=req.options)
        targets.append(_Target(q, got.first_path))
    ref = req.reference
    if ref is None:
        rq = _reference_quant(listing)
        hit = next((t for t in targets if t.quant.name == rq.name), None)
        if hit is None:
            on_step(f"fetching the reference {repo.repo_id}:{rq.name}")
        ref = hit.path if hit else download.download_quant(repo.repo_id, rq.name, options=req.options).first_path
    return repo.repo_id, targets, ref, repo.repo_id


def _published(known: families.CatalogModel | None, quant: str) -> str | None:
    figs = known.figures_for(quant) if known else []
    if not figs:
        return None
    f = figs[0]
    parts = [f"{k} {v:g}" for k, v in f.figures.items()]
    where = (f.gpu or "?") + (f", c {f.ctx}" if f.ctx else "")
    return f"{', '.join(parts)} ({where}; {known.sources.get(f.source, f.source) if known else f.source})"


def _measure_one(t: _Target, req: CompareRequest, reference: Path | None, loc: build.EngineLocation,
                 tune_hw: Hardware, fit_of: FitFn, out_dir: Path, on_step: StepFn) -> QuantRow:
    info = gguf_reader.inspect_model(t.path)
    row = QuantRow(quant=t.quant.name, path=str(t.path), size_bytes=t.quant.total_bytes, n_parts=t.quant.n_parts,
                   fit=fit_of(t.quant, info),
                   is_reference=reference is not None and t.path.resolve() == reference.resolve())
    on_step(f"{t.quant.name}: quality against {reference.name if reference else 'no reference (PPL only)'}")
    q = perplexity.measure(loc, t.path, reference=reference, auto_reference=False, ctx=req.kld_ctx,
                        chunks=req.kld_chunks, on_step=on_step)
    row = replace(row, ppl=q.ppl, ppl_error=q.ppl_error, kld_mean=q.kld_mean, kld_p99=q.kld_p99,
                  same_top_pct=q.same_top_pct)
    on_step(f"{t.quant.name}: auto-tune, {req.trials} trial(s)")
    load = req.workload
    tune = autotune.TuneRequest(model=t.path, workload=load, min_ctx=req.min_ctx,
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
                   prompt_tok_s=w.get("prompt_tok_s"), study=res.study_name)


def compare(req: CompareRequest, loc: build.EngineLocation, tune_hw: Hardware, fit_of: FitFn, *,
            on_step: StepFn | None = None) -> Comparison:
    """Fetch, tune and measure every quant; write report.md, compare.csv, compare.json and the plot."""
    if req.trials < 1 or req.kld_chunks < 1:
        raise UsageError("--trials and --chunks must be >= 1")
    say = on_step or (lambda _msg: None)
    title, targets, reference, catalog_key = _targets(req, say)
    out_dir = req.out_dir or default_out_dir(req.sources)
    known = families.find_model(catalog_key) if catalog_key else None
    rows = []
    for t in targets:
        row = _measure_one(t, req, reference, loc, tune_hw, fit_of, out_dir, say)
        rows.append(replace(row, published=_published(known, t.quant.name)))
    rows.sort(key=lambda r: r.size_bytes)
    cmp = Comparison(title=title, reference=str(reference) if reference else None, rows=with_pareto(rows),
                     out_dir=out_dir, catalog_model=known.name if known else None)
    return cmp
