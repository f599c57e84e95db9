"""Downloading a quant into the standard Hugging Face cache, and turning any model name into a local path.

What the installed huggingface_hub does on its own (2.x): it retries a cut connection a few times with a
``Range`` request inside one call, but it writes to a process-unique temporary file that it deletes on any
failure, so Ctrl-C or a dead link loses everything fetched so far; and it checks sizes, not sha256.
So the bytes are fetched here into ``blobs/<etag>.incomplete`` (kept across runs and resumed with
``Range``), hashed while they arrive, checked against the Hub's LFS sha256, moved to ``blobs/<etag>``,
and only then handed to ``hf_hub_download``, which finds the blob and makes the snapshot link itself.
The cache layout stays exactly the one every Hugging Face tool reads.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx2
from huggingface_hub import hf_hub_download
from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from tuner.core.errors import (
    DownloadInterruptedError,
    HashMismatchError,
    HubDiskSpaceError,
    HubError,
    NotCachedError,
    UnknownQuantError,
    UsageError,
)
from tuner.hub.repos import (
    DEFAULT_OPTIONS,
    DEFAULT_QUANT,
    HubOptions,
    Quant,
    RemoteFile,
    hub_errors,
    list_quants,
    parse_hub_ref,
)

CHUNK_BYTES = 1 << 20
DEFAULT_RETRIES = 5
RETRY_PAUSE_S = 0.2


@dataclass(frozen=True, slots=True)
class DownloadProgress:
    path: str  # inside the repo
    done_bytes: int
    total_bytes: int


ProgressFn = Callable[[DownloadProgress], None]


@dataclass(frozen=True, slots=True)
class DownloadedQuant:
    repo_id: str
    quant: str
    commit: str
    paths: tuple[Path, ...]  # snapshot paths, split parts in order
    downloaded_bytes: int  # fetched over the network by this call
    reused_bytes: int  # already complete in the cache
    resumed_from_bytes: int  # partial bytes kept from an earlier, interrupted run

    @property
    def first_path(self) -> Path:
        return self.paths[0]


def check_disk_space(need_bytes: int, folder: Path) -> None:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need_bytes > free:
        raise HubDiskSpaceError(folder, need_bytes, free)


def download_quant(
    repo_id: str,
    quant: str | None = None,
    *,
    revision: str = "main",
    options: HubOptions = DEFAULT_OPTIONS,
    on_progress: ProgressFn | None = None,
    retries: int = DEFAULT_RETRIES,
) -> DownloadedQuant:
    """Every part of ``quant`` in the cache, downloaded, resumed or reused; offline: from the cache only."""
    listing = list_quants(repo_id, revision=revision, options=options)
    try:
        chosen = listing.get(quant)
    except UnknownQuantError:
        if listing.from_cache:
            raise NotCachedError(repo_id, [quant or DEFAULT_QUANT]) from None
        raise
    commit = listing.commit or revision
    storage = options.storage_folder(repo_id)
    snapshot = storage / "snapshots" / commit
    if listing.from_cache:
        return DownloadedQuant(repo_id, chosen.name, commit, tuple(snapshot / f.path for f in chosen.files), 0,
                               chosen.total_bytes, 0)
    todo = [f for f in chosen.files if not _complete(snapshot / f.path, f)]
    reused = sum(f.size_bytes for f in chosen.files if f not in todo)
    need = sum(f.size_bytes - _partial_bytes(storage, f) for f in todo)
    check_disk_space(need, storage)
    downloaded = resumed = 0
    for f in todo:
        got, kept = _download_file(repo_id, f, commit, options, on_progress, retries)
        downloaded += got
        resumed += kept
        with hub_errors(repo_id, options):  # the blob is there: this only links it into the snapshot
            hf_hub_download(repo_id, f.path, revision=commit, cache_dir=options.hub_cache,
                            endpoint=options.endpoint, token=options.token)
    if revision != commit:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / revision).write_text(commit)
    return DownloadedQuant(repo_id, chosen.name, commit, tuple(snapshot / f.path for f in chosen.files),
                           downloaded, reused, resumed)


def _complete(path: Path, f: RemoteFile) -> bool:
    return path.is_file() and path.stat().st_size == f.size_bytes


def _partial_bytes(storage: Path, f: RemoteFile) -> int:
    if f.sha256 is None:
        return 0
    part = storage / "blobs" / f"{f.sha256}.incomplete"
    return part.stat().st_size if part.is_file() else 0


def _download_file(
    repo_id: str, f: RemoteFile, commit: str, options: HubOptions, on_progress: ProgressFn | None, retries: int
) -> tuple[int, int]:
    """Fetch one file's blob (resuming a partial one); returns (bytes fetched now, bytes kept from before)."""
    url = hf_hub_url(repo_id, f.path, revision=commit, endpoint=options.endpoint)
    headers = build_hf_headers(token=options.token)
    with hub_errors(repo_id, options):
        meta = get_hf_file_metadata(url, token=options.token, endpoint=options.endpoint)
    if meta.etag is None or meta.location is None:
        raise HubError(f"{options.base_url} sent no ETag for {f.path}: check that HF_ENDPOINT points to a Hub")
    blob = options.storage_folder(repo_id) / "blobs" / meta.etag
    if blob.is_file() and blob.stat().st_size == f.size_bytes:
        return 0, 0
    want_sha = f.sha256 or (meta.etag if len(meta.etag) == 64 else None)
    location = meta.location
    if urlparse(location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # signed CDN links must not see the token
    part = blob.with_name(blob.name + ".incomplete")
    part.parent.mkdir(parents=True, exist_ok=True)
    kept = part.stat().st_size if part.is_file() else 0
    if kept > f.size_bytes:
        part.unlink()
        kept = 0
    hasher = [hashlib.sha256()]
    if kept:
        with open(part, "rb") as old:
            while chunk := old.read(CHUNK_BYTES):
                hasher[0].update(chunk)
    have = _stream_into(repo_id, f, location, headers, part, hasher, kept, options, on_progress, retries)
    digest = hasher[0].hexdigest()
    if want_sha is not None and digest != want_sha:
        part.unlink(missing_ok=True)
        raise HashMismatchError(repo_id, f.path, digest, want_sha)
    part.replace(blob)
    return have - kept, kept


def _stream_into(
    repo_id: str, f: RemoteFile, url: str, headers: dict[str, str], part: Path, hasher: list[Any], have: int,
    options: HubOptions, on_progress: ProgressFn | None, retries: int,
) -> int:
    """Append the rest of the file to ``part`` with Range requests; a cut connection resumes, bounded.

    ``hasher`` is a one-item box so a restart (server ignoring Range) can replace the running hash.
    """
    failures = 0
    session = get_session()  # stall-bounded since the metadata request (hub_errors): a silent server is resumed below
    with open(part, "ab") as out:
        while have < f.size_bytes:
            before = have
            try:
                request_headers = {**headers, "Range": f"bytes={have}-"} if have else headers
                with session.stream("GET", url, headers=request_headers, follow_redirects=True) as response:
                    if response.status_code >= 400:
                        response.read()
                        with hub_errors(repo_id, options):
                            hf_raise_for_status(response)
                    if have and response.status_code == 200:  # the server ignored Range: start over
                        out.truncate(0)
                        hasher[0] = hashlib.sha256()
                        have = 0
                    for chunk in response.iter_bytes(CHUNK_BYTES):
                        out.write(chunk)
                        hasher[0].update(chunk)
                        have += len(chunk)
                        if on_progress is not None:
                            on_progress(DownloadProgress(f.path, have, f.size_bytes))
                if have < f.size_bytes:
                    raise httpx2.ReadError("body ended early")
            except httpx2.TransportError as exc:
                out.flush()
                failures = 0 if have > before else failures + 1
                if failures > retries or retries == 0:
                    raise DownloadInterruptedError(repo_id, f.path, have, f.size_bytes, type(exc).__name__) from None
                time.sleep(RETRY_PAUSE_S * failures)
    if have != f.size_bytes:
        part.unlink(missing_ok=True)
        raise HubError(f"{f.path} is {have} bytes, the Hub lists {f.size_bytes}: run the command again")
    return have


def quant_for(name: str, *, revision: str = "main", options: HubOptions = DEFAULT_OPTIONS) -> tuple[str, Quant]:
    """The repo and quant a ``REPO[:QUANT]`` name points at, without downloading."""
    ref = parse_hub_ref(name)
    if ref is None:
        raise UsageError(f"{name} is not a Hugging Face name: use owner/name or owner/name:QUANT")
    return ref.repo_id, list_quants(ref.repo_id, revision=revision, options=options).get(ref.quant)


def drop_quant(got: DownloadedQuant) -> int:
    """Delete a quant this process downloaded from the cache (snapshot links and their blobs); the bytes freed.

    compare-quants under a disk budget drops the quants it fetched once they are measured and not kept."""
    return drop_links(got.paths)


def drop_links(paths: Iterable[Path]) -> int:
    """Delete files and, for Hugging Face cache links, the blobs they point at; the bytes freed."""
    freed = 0
    for link in paths:
        target = link.resolve()
        if target.is_file():
            freed += target.stat().st_size
            target.unlink()
        link.unlink(missing_ok=True)
    return freed
