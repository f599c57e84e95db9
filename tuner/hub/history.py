"""Who put a file into a dataset repo, as the Hub says it (the Hub authenticates every commit and pull request):
the commit that last changed each path (``get_paths_info`` expanded: its ``lastCommit``), the accounts a commit
names (the commits API, huggingface_hub's paginated ``/commits/<rev>`` route, read page by page and only as far as
needed), and the account that opened the pull request a merge commit brought in (the discussions API:
``get_repo_discussions`` and ``get_discussion_details``'s ``merge_commit_oid``).

Names and commit ids only, each checked against the Hub's own forms; what they mean for agreement is
:mod:`tuner.share.accounts`'. Every listing stops at its caller's bound or when ``late()`` says the time is spent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import quote

from tuner.hub.records import DATASET, _api
from tuner.hub.repos import HubOptions, hub_errors

ACCOUNT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")  # a Hub user or organization name
COMMIT = re.compile(r"[0-9a-f]{40}")
PATHS_PER_REQUEST = 50  # the Hub expands (lastCommit) at most 50 paths a page
LISTED_PER_DETAIL = 20  # discussions listed (open ones, known ones) for each pull request asked in detail


@dataclass(frozen=True, slots=True)
class PullRequest:
    num: int
    author: str | None  # None: the Hub names no account we can read (a deleted user, an odd name)
    merge_commit: str | None  # None: not merged


def account(name: object) -> str | None:
    return name if isinstance(name, str) and ACCOUNT.fullmatch(name) and name != "deleted" else None


def last_commits(repo_id: str, revision: str, paths: Iterable[str], options: HubOptions, *,
                 late: Callable[[], bool]) -> dict[str, str]:
    """Path → the commit that last changed it at ``revision`` (paths the Hub does not answer for are left out)."""
    from huggingface_hub.hf_api import RepoFile

    todo = sorted(set(paths))
    out: dict[str, str] = {}
    with hub_errors(repo_id, options):
        api = _api(options)
        for start in range(0, len(todo), PATHS_PER_REQUEST):
            if late():
                break
            batch = todo[start:start + PATHS_PER_REQUEST]
            for info in api.get_paths_info(repo_id, batch, expand=True, revision=revision, repo_type=DATASET):
                last = getattr(info, "last_commit", None)
                if isinstance(info, RepoFile) and info.path in batch and last is not None \
                        and COMMIT.fullmatch(str(last.oid)):
                    out[info.path] = str(last.oid)
    return out


def commit_accounts(repo_id: str, revision: str, wanted: set[str], options: HubOptions, *, max_commits: int,
                    late: Callable[[], bool]) -> dict[str, tuple[str, ...]]:
    """Commit id → the accounts the Hub names as its authors, for the commits of ``wanted`` (and those passed on
    the way), walking ``revision``'s history newest first until every wanted one is seen, ``max_commits`` are read,
    or ``late()``."""
    # list_repo_commits reads the whole history before it returns; its own paginator stops where we stop.
    from huggingface_hub.utils import build_hf_headers
    from huggingface_hub.utils._pagination import paginate

    out: dict[str, tuple[str, ...]] = {}
    url = f"{_api(options).endpoint}/api/{DATASET}s/{repo_id}/commits/{quote(revision, safe='')}"
    with hub_errors(repo_id, options):
        for n, item in enumerate(paginate(url, params={}, headers=build_hf_headers(token=options.token))):
            if n >= max_commits or late() or not wanted - out.keys():
                break
            if not isinstance(item, dict) or not COMMIT.fullmatch(str(item.get("id"))):
                continue
            names = [account(a.get("user")) for a in item.get("authors") or () if isinstance(a, dict)]
            out[str(item["id"])] = tuple(n for n in names if n)
    return out


def merged_pulls(repo_id: str, options: HubOptions, *, known: set[int], wanted: set[str], max_details: int,
                 late: Callable[[], bool]) -> list[PullRequest]:
    """The merged pull requests of ``repo_id`` not in ``known``, newest first as the Hub lists them, each with its
    opener and merge commit, until every ``wanted`` merge commit is found, ``max_details`` were asked, or
    ``late()``."""
    out: list[PullRequest] = []
    found: set[str] = set()
    with hub_errors(repo_id, options):
        api = _api(options)
        listed = api.get_repo_discussions(repo_id, repo_type=DATASET, discussion_type="pull_request")
        for n, d in enumerate(listed):
            if len(out) >= max_details or n >= LISTED_PER_DETAIL * max_details or late() or not wanted - found:
                break
            if d.status != "merged" or d.num in known:
                continue
            details = api.get_discussion_details(repo_id, d.num, repo_type=DATASET)
            merge = str(details.merge_commit_oid) if COMMIT.fullmatch(str(details.merge_commit_oid)) else None
            out.append(PullRequest(d.num, account(details.author), merge))
            if merge:
                found.add(merge)
    return out
