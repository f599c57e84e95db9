"""Small files in a Hugging Face dataset repo, through huggingface_hub's own API and the Hub's file routes: who the
token belongs to, whether a repo is public, one commit (or one pull request) of one file, a bounded listing of a
folder, a bounded read of one file, and byte ranges of a large one (a columnar shard).

Bytes only: what the files mean (a shared auto-tune record) and whether they are to be trusted is
:mod:`tuner.share`'s to say. Every read here is bounded: a listing in entries and seconds, a file in bytes (a
file listed larger than the caller's bound is never asked for), every request in seconds of stall.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx2

from tuner.core.errors import HubError, UsageError
from tuner.hub import client
from tuner.hub.remote_header import _fetch_range
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions, hub_errors

DATASET = "dataset"


@dataclass(frozen=True, slots=True)
class RemoteRecord:
    path: str  # inside the repo, e.g. "records/3f…json"
    size_bytes: int


@dataclass(frozen=True, slots=True)
class Listing:
    commit: str
    files: tuple[RemoteRecord, ...]
    cut: bool  # the folder holds more than was listed (bounded in entries or seconds, or a page never came)
    stalled: bool = False  # a later page never came (silent for client.STALL_S, or past a bounded read's end)


@dataclass(frozen=True, slots=True)
class Pushed:
    path: str
    url: str  # the commit's page, or the pull request's
    commit: str
    pull_request: bool  # opened as a pull request (the repo's owner merges it), not committed to main


def check_repo_id(repo_id: str) -> str:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise UsageError(f"--repo {repo_id!r} is not OWNER/DATASET: name a dataset repo like you/moe-tune-results")
    return repo_id


def _api(options: HubOptions, token: str | bool | None = None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=options.endpoint, token=options.token if token is None else token)


def _online(repo_id: str, options: HubOptions) -> None:
    if options.is_offline:
        raise HubError(f"{repo_id} is on the Hub and offline mode is on: unset HF_HUB_OFFLINE to share or look up")


def _need_token(options: HubOptions) -> None:
    from huggingface_hub import get_token

    if options.token is False or (options.token is None and get_token() is None):
        raise UsageError("sharing writes to the Hub and needs a token with write access: run `hf auth login` "
                         "or set HF_TOKEN (--dry-run prints the record without one)")


def namespaces(options: HubOptions = DEFAULT_OPTIONS) -> frozenset[str]:
    """The user the token belongs to and the organizations it is a member of (whoami)."""
    _online("whoami", options)
    _need_token(options)
    with hub_errors("whoami", options):
        me = _api(options).whoami(cache=True)
    orgs = [o.get("name") for o in me.get("orgs") or () if isinstance(o, dict)]
    return frozenset(n for n in (me.get("name"), *orgs) if isinstance(n, str) and n)


def is_public(repo_id: str, repo_type: str = "model", options: HubOptions = DEFAULT_OPTIONS) -> bool:
    """Whether anyone may see ``repo_id`` (asked without the user's token): not private, not gated, and there.
    Any failure to learn it answers False."""
    from huggingface_hub.errors import HfHubHTTPError

    if options.is_offline:
        return False
    try:
        with hub_errors(repo_id, options):
            info = _api(options, token=False).repo_info(repo_id, repo_type=repo_type, timeout=client.STALL_S)
    except (HubError, UsageError, HfHubHTTPError, ValueError):
        return False
    return info.private is False and not info.gated and not getattr(info, "disabled", False)


def push(repo_id: str, path_in_repo: str, data: bytes, message: str, options: HubOptions = DEFAULT_OPTIONS, *,
         create_pr: bool = False) -> Pushed:
    """``data`` at ``path_in_repo`` as one commit to main (creating the repo if it is missing), or, with
    ``create_pr``, as a pull request to an existing repo (nothing reaches main until its owner merges)."""
    _online(repo_id, options)
    _need_token(options)
    api = _api(options)
    with hub_errors(repo_id, options):
        if not create_pr:
            api.create_repo(repo_id, repo_type=DATASET, exist_ok=True)
        info = api.upload_file(path_or_fileobj=data, path_in_repo=path_in_repo, repo_id=repo_id, repo_type=DATASET,
                               commit_message=message, create_pr=create_pr)
    url = info.pr_url if create_pr and info.pr_url else info.commit_url
    return Pushed(path_in_repo, str(url), str(info.oid), create_pr)


def commit_files(repo_id: str, adds: dict[str, bytes], deletes: list[str], message: str,
                 options: HubOptions = DEFAULT_OPTIONS) -> str:
    """One commit to main of the user's own dataset repo: ``adds`` written, ``deletes`` removed; its URL."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    _online(repo_id, options)
    _need_token(options)
    ops: list[CommitOperationAdd | CommitOperationDelete] = [
        CommitOperationAdd(path_in_repo=path, path_or_fileobj=data) for path, data in adds.items()]
    ops += [CommitOperationDelete(path_in_repo=path) for path in deletes]
    with hub_errors(repo_id, options):
        info = _api(options).create_commit(repo_id, ops, commit_message=message, repo_type=DATASET)
    return str(info.commit_url)


def repo_commit(repo_id: str, options: HubOptions = DEFAULT_OPTIONS) -> str:
    """The dataset repo's current commit on main (every later read names it, so they agree)."""
    _online(repo_id, options)
    with hub_errors(repo_id, options):
        info = _api(options).dataset_info(repo_id, timeout=client.STALL_S, expand=["sha"])
    return info.sha or "main"


def list_files(repo_id: str, commit: str, folder: str, suffix: str, options: HubOptions = DEFAULT_OPTIONS, *,
               max_entries: int, late: Callable[[], bool]) -> Listing:
    """Up to ``max_entries`` files under ``folder`` ending in ``suffix`` at ``commit``, in the server's order, listed
    until ``late()`` says the caller's time is spent; an empty listing when the folder is missing."""
    from huggingface_hub.errors import RemoteEntryNotFoundError
    from huggingface_hub.hf_api import RepoFile

    files: list[RemoteRecord] = []
    cut = stalled = False
    with hub_errors(repo_id, options):
        try:
            for e in _api(options).list_repo_tree(repo_id, path_in_repo=folder, repo_type=DATASET, revision=commit,
                                                  recursive=True):
                if len(files) >= max_entries or late():
                    cut = True
                    break
                if isinstance(e, RepoFile) and e.path.endswith(suffix):
                    files.append(RemoteRecord(e.path, int(e.size)))
        except RemoteEntryNotFoundError:
            pass
        except httpx2.TransportError as exc:
            if not files or not (isinstance(exc, httpx2.TimeoutException) or client.overrun(exc)):
                raise  # nothing listed, or the server broke off: hub_errors says so in one line
            cut = stalled = True  # a later page never came (or came too late): keep the pages that did
    return Listing(commit, tuple(files), cut, stalled)


def read_file(repo_id: str, path_in_repo: str, commit: str, max_bytes: int,
              options: HubOptions = DEFAULT_OPTIONS) -> bytes:
    """At most ``max_bytes + 1`` bytes of one file at ``commit`` (one more than the bound: the caller tells an
    oversized file from a full one)."""
    return read_range(repo_id, path_in_repo, commit, 0, max_bytes + 1, options)


def read_range(repo_id: str, path_in_repo: str, commit: str, start: int, end: int,
               options: HubOptions = DEFAULT_OPTIONS) -> bytes:
    """Bytes [start, end) of one file at ``commit`` (fewer where the file ends first)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    _online(repo_id, options)
    url = hf_hub_url(repo_id, path_in_repo, repo_type=DATASET, revision=commit, endpoint=options.endpoint)
    with hub_errors(repo_id, options):
        return _fetch_range(url, build_hf_headers(token=options.token), start, end, timeout_s=client.STALL_S)


class RangeReader:
    """Byte ranges of one file at ``commit``, each one range request, counted against ``budget_bytes`` (a range
    that would go over is not asked for: :class:`HubError`)."""

    def __init__(self, repo_id: str, path_in_repo: str, commit: str, size_bytes: int, budget_bytes: int,
                 options: HubOptions = DEFAULT_OPTIONS) -> None:
        self.repo_id, self.path, self.commit, self.size = repo_id, path_in_repo, commit, size_bytes
        self.budget_bytes = budget_bytes
        self.options = options
        self.bytes_read = 0
        self.requests = 0

    def __call__(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file (``end`` clipped to its size)."""
        end = min(end, self.size)
        if end <= start:
            return b""
        if self.bytes_read + (end - start) > self.budget_bytes:
            raise HubError(f"{self.path} would need more than {self.budget_bytes:,} bytes read")
        data = read_range(self.repo_id, self.path, self.commit, start, end, self.options)
        self.bytes_read += len(data)
        self.requests += 1
        return data
