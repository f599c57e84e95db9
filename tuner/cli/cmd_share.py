"""`moe-tune share` (a result as a record in a Hugging Face dataset repo) and `moe-tune lookup` (what others
measured for a model on a card). Neither measures anything; `auto-tune --seed-from` uses the same records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tuner.cli.app import JsonFlag, app, err, friendly, out

DEFAULT_REPO = "moe-tune/shared-results"
# What lookup prints at most (--json holds everything): engine commits, lines under each, and per line.
SHOWN_COMMITS, SHOWN_LINES, SHOWN_ACCOUNTS, SHOWN_WHY, SHOWN_VERDICTS = 3, 8, 8, 2, 3
RepoOpt = Annotated[str, typer.Option("--repo", help="Hugging Face dataset repo, OWNER/DATASET.")]


@app.command("share", short_help="Share a result as a record in a Hugging Face dataset repo.")
@friendly
def share_cmd(
    result: Annotated[Path, typer.Argument(help="results/<study>/result.json (or the folder).")],
    repo: RepoOpt,
    hub_repo: Annotated[str | None, typer.Option(
        "--hub-repo", metavar="OWNER/NAME", show_default=False,
        help="Name the model's Hub repo in the record (by default named only when it is public).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the record; send nothing.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Share an auto-tune result: one JSON record (card, host size, engine, model by Hub id or fingerprint,
    workload, every measured line with its verdicts, the printed line and why, this installation's random sharer
    id) sent to a dataset repo: committed to a repo you own, opened as a pull request on anyone else's (the
    pool's owner merges it). No paths, host name, user or serial numbers, and the model's Hub repo only when it
    is public: see docs/sharing.md. After a race across engines, either engine's folder shares the line the race
    printed, the engine that ran it and its verdict against llama.cpp's default; a line its quality price refused
    is never shared. Uses your Hugging Face token (`hf auth login` or HF_TOKEN).

    \b
    Examples:
      moe-tune share results/<study>/result.json --dry-run \\
        --repo you/moe-tune-results
      moe-tune share results/<study> --repo you/moe-tune-results
      moe-tune share results/<study> --repo moe-tune/shared-results
    """
    from tuner.share import store

    done = store.share(result, repo, dry_run=dry_run, hub_repo=hub_repo)
    for note in done.notes:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    if dry_run or as_json:
        payload = done.record if dry_run and not as_json else {
            "path": done.path, "url": done.url, "pull_request": done.pull_request, "record": done.record}
        out.print_json(json.dumps(payload))
        return
    how = "opened a pull request for" if done.pull_request else "committed"
    out.print(f"{how} {done.path} to {repo}: {done.url}", highlight=False, soft_wrap=True)


@app.command("lookup", short_help="What others measured for a model on a card (no GPU needed).")
@friendly
def lookup_cmd(
    model: Annotated[str, typer.Argument(help="A .gguf path (matched by fingerprint) or REPO[:QUANT].")],
    gpu: Annotated[str, typer.Option("--gpu", help="The card, e.g. \"RTX 3060 12GB\"; cpu for CPU-only results.")],
    repo: RepoOpt = DEFAULT_REPO,
    as_json: JsonFlag = False,
) -> None:
    """List the lines shared for MODEL (and its quants) on a card and its siblings (cards of the same VRAM class
    the card catalog knows), by engine commit, with how many Hugging Face accounts agree (the accounts that
    uploaded the records, as the Hub says; one account counts once), their verdicts and figures. Lines only one
    account reports come last, marked unconfirmed. Every record is checked before it is shown (docs/sharing.md);
    the first few refused are named, the rest counted. Measures nothing; ends within 60 s.

    \b
    Examples:
      moe-tune lookup unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M --gpu "RTX 3060 12GB"
      moe-tune lookup model.gguf --gpu "RTX 4060 Ti 16GB" --json \\
        --repo you/moe-tune-results
    """
    from rich import box
    from rich.text import Text

    from tuner.share import lookup, match

    model_q = match.ModelQuery.parse(model)
    card_q = match.CardQuery.parse(gpu)
    answer = lookup.lookup(repo, model_q, card_q)
    got = answer.fetched
    if as_json:
        out.print_json(json.dumps({
            "repo": repo, "commit": got.commit, "model": model, "card": card_q.name,
            "vram_class_gib": card_q.vram_class_gib, "records_read": answer.records_read,
            "records_kept": len(got.records), "bytes_read": got.bytes_read, "skipped": list(answer.skipped),
            # records read = kept + refused - refused_unread (a file refused before it was read is no record read)
            "refused": dict(answer.refusals.by_reason), "refused_unread": answer.refusals.unread,
            "by_engine_commit": {c: [g.to_dict() for g in lines] for c, lines in answer.groups.items()}}))
        return
    for line in answer.skipped:
        _wrapped(err, line, "warning: ")
    if not answer.groups:
        _wrapped(out, f"no shared record in {repo} for {model} on {card_q.name} or a card of its VRAM class "
                      f"({got.files_read + got.shard_rows_read:,} records read)")
        return
    # A pool can hold thousands of distinct lines that pass the gate: the text shows the best few (those more
    # accounts agree on first), and says how many more --json lists.
    commits = sorted(answer.groups.items(), key=lambda kv: (-max(g.n_accounts for g in kv[1]), kv[0]))
    hidden = sum(len(lines) for _, lines in commits[SHOWN_COMMITS:])
    for commit, every in commits[:SHOWN_COMMITS]:
        lines = every[:SHOWN_LINES]
        hidden += len(every) - len(lines)
        table = Table(title=f"engine {commit}", box=box.SIMPLE_HEAD)
        for col in ("accounts", "records", "printed", "gen tok/s", "pp tok/s", "cards", "workloads"):
            table.add_column(col, justify="right" if col in ("accounts", "records", "gen tok/s", "pp tok/s")
                             else "left")
        for g in lines:
            d = g.to_dict()
            # Text cells: a record's label or card name is never read as rich markup.
            table.add_row(*(Text(c) for c in (str(d["accounts"]), str(d["records"]), d["label"],
                                              _num(d["median_gen_tok_s"]), _num(d["median_prompt_tok_s"]),
                                              ", ".join(d["cards"]), ", ".join(d["workloads"]))))
        out.print(table)
        for g in lines:
            d = g.to_dict()
            # The line to run stands alone and whole; every word a stranger wrote is indented below it, wrapped here
            # (never by the terminal, which would put its tail at column 0).
            _wrapped(out, lookup.agreement(d["accounts"], d["unverified"]) + ":")
            out.print(d["line"], highlight=False, soft_wrap=True, markup=False)
            if d["account_names"]:
                _wrapped(out, ", ".join(d["account_names"][:SHOWN_ACCOUNTS]) + (
                    f" and {len(d['account_names']) - SHOWN_ACCOUNTS:,} more"
                    if len(d["account_names"]) > SHOWN_ACCOUNTS else ""), "  accounts: ")
            for why in d["why"][:SHOWN_WHY]:
                _wrapped(out, why, "  why: ")
            for v in d["verdicts"][:SHOWN_VERDICTS]:
                _wrapped(out, v, "  verdict: ")
    if hidden:
        _wrapped(out, f"{hidden:,} more line(s), fewer accounts behind each, not shown: --json lists every one")


def _wrapped(console: Console, text: str, first: str = "", rest: str = "    ") -> None:
    """``text`` in lines that fit the console, the first after ``first``, the others indented by ``rest``."""
    import textwrap

    width = max(40, console.width)
    for line in textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False) \
            or [first]:
        console.print(line, highlight=False, soft_wrap=True, markup=False)


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:,.1f}"
