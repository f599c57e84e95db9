"""`moe-tune quants` and `moe-tune download`: Hugging Face repos as the user names them."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from tuner.cli.app import JsonFlag, app, err, facts_table, friendly, mib, out
from tuner.core.errors import HubError, UnknownQuantError, UsageError

if TYPE_CHECKING:
    from tuner.catalog import families
    from tuner.models.gguf_reader import ModelInfo


if TYPE_CHECKING:
    from tuner.hub import download, remote_header, repos

# The Hub client (huggingface_hub) is imported inside the commands that talk to the Hub: importing it here
# would slow every moe-tune command's start-up.

Offline = Annotated[bool, typer.Option("--offline", help="Only the local Hugging Face cache (as HF_HUB_OFFLINE=1).")]
Revision = Annotated[str, typer.Option("--revision", help="Branch, tag or commit of the repo.")]

ARCH_FACTS = ("n_layer", "n_expert", "n_expert_used", "n_expert_shared", "n_embd", "n_head", "head_dim_k",
              "head_dim_v", "n_vocab", "ctx_train", "n_swa", "full_attention_interval", "mla_kv_lora_rank")


def _options(offline: bool) -> repos.HubOptions:
    from tuner.hub import repos

    return repos.HubOptions(offline=True if offline else None)


def _ref(name: str) -> repos.HubRef:
    from tuner.hub import repos

    ref = repos.parse_hub_ref(name)
    if ref is None:
        raise UsageError(f"{name} is not a Hugging Face repo name: use owner/name or owner/name:QUANT, "
                         "e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
    return ref


@app.command("quants", short_help="List a Hugging Face repo's quants: size, parts, fit.")
@friendly
def quants_cmd(
    repo: Annotated[str, typer.Argument(help="owner/name, optionally :QUANT to read that quant's header.")],
    ctx: Annotated[int, typer.Option("-c", "--ctx-size", help="Context (tokens) the fit verdict is for.")] = 8192,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Judge the fit for this card, e.g. \"RTX 3060 12GB\".")]
    = None,
    revision: Revision = "main",
    offline: Offline = False,
    as_json: JsonFlag = False,
) -> None:
    """List every quant in a Hugging Face repo with its size, parts and fit verdict.

    Architecture facts come from the GGUF header of the first part, read with HTTP range requests
    (no tensor data is downloaded).

    \b
    Example:
      moe-tune quants unsloth/Qwen3-30B-A3B-GGUF -c 32768
    """
    from tuner.catalog import cards, families
    from tuner.hub import remote_header, repos
    from tuner.plan import placement

    ref = _ref(repo)
    options = _options(offline)
    listing = repos.list_quants(ref.repo_id, revision=revision, options=options)
    if not listing.quants:
        raise HubError(f"{ref.repo_id} holds no GGUF files: pick a GGUF repo (names often end in -GGUF)")
    probe = listing.get(ref.quant) if ref.quant else _probe_quant(listing)
    headers = remote_header.read_quant_headers(ref.repo_id, probe, commit=listing.commit or revision, options=options)
    model = headers.model_info()
    hw = cards.machine(gpu)
    # Other quants are priced from the probe's header, scaled by file size (their headers are not fetched).
    size = probe.total_bytes or 1
    verdicts = {q.name: placement.fit_verdict(placement.scaled(model, (q.total_bytes or size) / size), ctx, hw)
                for q in listing.quants}
    known = families.find_model(ref.repo_id)
    published = {q.name: _published(known, q.name) for q in listing.quants}
    if as_json:
        out.print_json(json.dumps({
            "repo": listing.repo_id, "revision": listing.revision, "commit": listing.commit,
            "from_cache": listing.from_cache, "ctx": ctx,
            "quants": [
                {"name": q.name, "n_parts": q.n_parts, "total_bytes": q.total_bytes, "fit": verdicts[q.name],
                 "files": [asdict(f) for f in q.files],
                 "published": [{"gpu": f.gpu, "ctx": f.ctx, "settings": f.settings, "figures": dict(f.figures),
                                "source": known.sources[f.source]} for f in published[q.name]] if known else []}
                for q in listing.quants
            ],
            "header": _header_json(headers, model),
        }))
        return
    out.print(f"{listing.repo_id} @ {(listing.commit or revision)[:12]}"
              f"{'  (from the local cache)' if listing.from_cache else ''}", highlight=False, soft_wrap=True)
    facts = facts_table()
    facts.add_row("architecture", model.arch)
    for key in ARCH_FACTS:
        value = getattr(model, key)
        if value:
            facts.add_row(key, f"{value:,}")
    facts.add_row("n_head_kv", ", ".join(str(n) for n in sorted(set(model.n_head_kv))))
    facts.add_row("header of", f"{probe.name}: {probe.n_parts} part(s), {mib(headers.bytes_read)} fetched, "
                  f"tensors {mib(model.tensor_bytes)}")
    out.print(facts)
    table = Table()
    table.add_column("quant")
    table.add_column("parts", justify="right")
    table.add_column("size", justify="right")
    table.add_column(f"fits {hw.describe()} at -c {ctx}")
    if known:
        table.add_column("published (catalog, not measured here)")
    for q in listing.quants:
        row = [q.name, str(q.n_parts), _size(q.total_bytes), verdicts[q.name]]
        if known:
            row.append(_published_text(published[q.name]))
        table.add_row(*row)
    out.print(table)
    if known:
        cited = sorted({known.sources[f.source].split(":")[0] for fs in published.values() for f in fs})
        out.print(f"catalog: {known.name}" + (f"; published figures from {', '.join(cited)}" if cited else ""),
                  highlight=False, soft_wrap=True)


def _published(known: families.CatalogModel | None, quant: str) -> list[families.QualityFigure]:
    return known.figures_for(quant) if known else []


def _published_text(figures: list[families.QualityFigure]) -> str:
    if not figures:
        return ""
    f = figures[0]
    parts = [f"PPL {f.figures['ppl']}" if "ppl" in f.figures else "",
             f"{f.figures['gen_tok_s']:g} tok/s" if "gen_tok_s" in f.figures else ""]
    where = f"{f.gpu or '?'}" + (f", c {f.ctx}" if f.ctx else "")
    return f"{', '.join(p for p in parts if p)} ({where})"


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.2f} GiB" if n_bytes >= 2**30 else mib(n_bytes)


def _probe_quant(listing: repos.RepoQuants) -> repos.Quant:
    """The quant whose header stands for the repo: Q4_K_M when present, else the smallest."""
    from tuner.hub import repos

    try:
        return listing.get(repos.DEFAULT_QUANT)
    except UnknownQuantError:
        return listing.quants[0]


def _header_json(headers: remote_header.QuantHeaders, model: ModelInfo) -> dict[str, Any]:
    return {
        "quant": headers.quant.name, "bytes_read": headers.bytes_read,
        "parts": [{"path": p.path, "header_bytes": p.header_bytes, "file_size_bytes": p.file_size_bytes,
                   "local_path": str(p.local_path)} for p in headers.parts],
        "architecture": model.arch, "n_tensors": len(model.tensors), "tensor_bytes": model.tensor_bytes,
        **{key: getattr(model, key) for key in ARCH_FACTS},
        "n_head_kv": list(model.n_head_kv),
    }


@app.command("download", short_help="Download a quant into the Hugging Face cache.")
@friendly
def download_cmd(
    name: Annotated[str, typer.Argument(help="owner/name:QUANT (without :QUANT, Q4_K_M or the only quant).")],
    revision: Revision = "main",
    offline: Offline = False,
    as_json: JsonFlag = False,
) -> None:
    """Download every part of a quant into the Hugging Face cache and print the first part's path.

    Reuses what the cache holds, resumes an interrupted download, checks each file's sha256 against
    the Hub.

    \b
    Example:
      moe-tune download unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M
    """
    from rich import progress as rp

    from tuner.hub import download

    ref = _ref(name)
    options = _options(offline)
    columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn(), rp.TransferSpeedColumn(),
               rp.TimeRemainingColumn())
    with rp.Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        tasks: dict[str, rp.TaskID] = {}

        def on_progress(p: download.DownloadProgress) -> None:
            if p.path not in tasks:
                tasks[p.path] = progress.add_task(p.path.rsplit("/", 1)[-1], total=p.total_bytes)
            progress.update(tasks[p.path], completed=p.done_bytes)

        try:
            result = download.download_quant(ref.repo_id, ref.quant, revision=revision, options=options,
                                                 on_progress=on_progress)
        except KeyboardInterrupt:
            progress.stop()
            err.print("interrupted: the partial download is kept; run the same command again to resume",
                      highlight=False)
            raise typer.Exit(130) from None
    if as_json:
        out.print_json(json.dumps({
            "repo": result.repo_id, "quant": result.quant, "commit": result.commit,
            "first_path": str(result.first_path), "paths": [str(p) for p in result.paths],
            "downloaded_bytes": result.downloaded_bytes, "reused_bytes": result.reused_bytes,
            "resumed_from_bytes": result.resumed_from_bytes,
        }))
        return
    err.print(f"{result.repo_id}:{result.quant}: {len(result.paths)} file(s), {mib(result.downloaded_bytes)} "
              f"downloaded, {mib(result.reused_bytes)} reused from the cache", highlight=False)
    out.print(str(result.first_path), highlight=False, soft_wrap=True)
