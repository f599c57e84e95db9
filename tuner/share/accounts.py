"""Agreement counts Hub accounts: who brought a record into the pool, as the Hub says, never what the record says.

A record's ``sharer`` id is whatever its writer typed, so five made-up ids were five "sharers". Who uploaded a file
is known to the Hub, which authenticates every commit and pull request (:mod:`tuner.hub.history`):

- a record file (``records/<id>.json``) counts as the account that opened the pull request whose merge last changed
  it, or, where no pull request merged it (the pool's owner committed it), the account that made that commit;
- a shard row counts as its ``account`` column (what the keeper read from the Hub when consolidating) when the
  shard itself was committed to main directly, which only the pool's owners can do; a shard that came in a pull
  request counts as that request's opener, one account for all its rows;
- a record whose uploader the Hub does not say (the request failed or ran out of time, an old shard without the
  column, a deleted account) is *unverified*: every such record of a look-up together counts as one voice, and the
  look-up says so.

Facts the Hub gave about a commit or a merged pull request never change, so they are cached per commit (and per
pull request) under the cache folder, one file per Hub endpoint and repo: a second look-up asks only about new
commits. Pull requests are looked for among the newest :data:`MAX_LISTED` discussions; a merge older than that is
taken as the commit it is (its author, the merger: one account, never more).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.core.errors import TunerError
from tuner.hub import history
from tuner.hub.repos import HubOptions
from tuner.machine import paths
from tuner.machine.fileio import atomic_write
from tuner.share.gate import shown

MAX_COMMITS = 5_000  # history read by one look-up
MAX_DETAILS = 200  # pull requests asked about in detail by one look-up
MAX_LISTED = MAX_DETAILS * history.LISTED_PER_DETAIL
FOLDER = "hub-accounts"


@dataclass(frozen=True, slots=True)
class Source:
    """Where a record came from in the pool."""

    path: str  # records/<id>.json, or the shard's path
    row_account: str | None = None  # a shard row's account column
    shard: bool = False


@dataclass
class _Known:
    commits: dict[str, list[str]] = field(default_factory=dict)  # commit → its authors
    pulls: dict[str, list[str | None]] = field(default_factory=dict)  # merged PR number → [opener, merge commit]

    def merges(self) -> dict[str, str | None]:
        return {m: author for author, m in self.pulls.values() if m}


@dataclass(frozen=True, slots=True)
class Resolved:
    accounts: dict[str, str | None]  # record id → the account that brought it (None: unverified)
    notes: tuple[str, ...] = ()


def cache_file(repo_id: str, options: HubOptions) -> Path:
    endpoint = hashlib.sha256(options.base_url.encode()).hexdigest()[:12]
    return paths.cache_root() / FOLDER / endpoint / (repo_id.replace("/", "--") + ".json")


def _load(path: Path) -> _Known:
    try:
        raw = json.loads(path.read_text())
        commits = {c: [a for a in v if history.account(a)] for c, v in raw["commits"].items()
                   if history.COMMIT.fullmatch(c) and isinstance(v, list)}
        pulls = {n: [history.account(v[0]), v[1] if history.COMMIT.fullmatch(str(v[1])) else None]
                 for n, v in raw["pulls"].items() if n.isdigit() and isinstance(v, list) and len(v) == 2}
        return _Known(commits, pulls)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return _Known()


def resolve(repo_id: str, revision: str, sources: Mapping[str, Source], options: HubOptions, *,
            late: Callable[[], bool]) -> Resolved:
    """Record id → the Hub account that brought it into ``repo_id`` at ``revision`` (None: the Hub did not say)."""
    if not sources:
        return Resolved({})
    cache = cache_file(repo_id, options)
    known = _load(cache)
    notes: list[str] = []
    last: dict[str, str] = {}
    try:
        last = history.last_commits(repo_id, revision, {s.path for s in sources.values()}, options, late=late)
        needed = set(last.values())
        if needed - known.merges().keys():
            for pr in history.merged_pulls(repo_id, options, known={int(n) for n in known.pulls},
                                           wanted=needed - known.merges().keys(), max_details=MAX_DETAILS, late=late):
                known.pulls[str(pr.num)] = [pr.author, pr.merge_commit]
        direct = needed - known.merges().keys() - known.commits.keys()
        if direct:
            for commit, authors in history.commit_accounts(repo_id, revision, direct, options,
                                                           max_commits=MAX_COMMITS, late=late).items():
                known.commits[commit] = list(authors)
    except TunerError as exc:
        notes.append(f"who uploaded the records could not all be read from the Hub ({shown(exc, 160)})")
    _save(cache, known)
    merges = known.merges()
    out: dict[str, str | None] = {}
    for rid, src in sources.items():
        c = last.get(src.path)
        if c is None:  # the Hub did not say which commit brought it
            out[rid] = None
        elif c in merges:
            out[rid] = merges[c]
        elif c in known.commits:
            out[rid] = history.account(src.row_account) if src.shard else next(iter(known.commits[c]), None)
        else:
            out[rid] = None
    unverified = sum(a is None for a in out.values())
    if unverified:
        notes.append(f"{unverified:,} of {len(out):,} records came with no uploader the Hub would name: they count "
                     "together as one unverified account")
    return Resolved(out, tuple(notes))


def _save(path: Path, known: _Known) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"commits": known.commits, "pulls": known.pulls}, sort_keys=True))
    except OSError:
        pass  # a cache that cannot be written costs the next look-up its questions, nothing else


def label(account: Any) -> str:
    return account if isinstance(account, str) else "unverified"
