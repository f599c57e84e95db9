"""Hugging Face repos as the user names them: ``REPO:QUANT`` names, quant listings, remote GGUF headers.

A quant is one ``*.gguf`` file at the repo root, or the parts of a split (``*-00001-of-00003.gguf``),
often in a per-quant folder. Listings come from the Hub's tree API (sizes and LFS sha256), or from the
standard Hugging Face cache when offline. Remote GGUF headers (range requests, no tensor data) live in
``tuner.hub.remote_header``; downloading lives in ``tuner.hub.download``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, constants, errors
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import RepoFile

from tuner.core.errors import (
    GatedRepoError,
    HubError,
    HubUnreachableError,
    RepoNotFoundError,
    UnknownQuantError,
    UsageError,
)
from tuner.hub import client
from tuner.models.gguf_reader import split_name

DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when the name carries no quant

_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q[1-8](?:_[01])?(?:_K)?(?:_(?:XXS|XS|S|M|L|XL|NL))?|BF16|F16|F32"
    r"|MXFP4(?:_MOE)?|TQ[12]_0))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_REPO_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+))?$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


# -- names --------------------------------------------------------------------------------------------


def _example(available: tuple[str, ...]) -> str:
    """The quant an error message suggests: llama.cpp's default when the repo has it."""
    return DEFAULT_QUANT if DEFAULT_QUANT in available or not available else available[0]


@dataclass(frozen=True, slots=True)
class HubRef:
    """``owner/name[:QUANT]``, the way llama.cpp's ``-hf`` spells a model."""

    repo_id: str
    quant: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.quant}" if self.quant else self.repo_id


def parse_hub_ref(text: str) -> HubRef | None:
    """A Hub name, or None when ``text`` reads as a local path (exists, ends in .gguf, or starts with . / ~)."""
    text = text.strip()
    if not text or text.startswith((".", "/", "~")) or text.lower().endswith(".gguf") or os.path.exists(text):
        return None
    m = _REPO_RE.match(text)
    if m is None:
        return None
    return HubRef(m.group("repo"), m.group("quant"))


@dataclass(frozen=True, slots=True)
class HubOptions:
    """Where and how to talk to the Hub. ``None`` fields follow huggingface_hub's own settings."""

    endpoint: str | None = None  # HF_ENDPOINT otherwise
    token: str | bool | None = None  # HF_TOKEN / `hf auth login` otherwise
    cache_dir: Path | None = None  # HF_HUB_CACHE / HF_HOME otherwise
    offline: bool | None = None  # HF_HUB_OFFLINE otherwise

    @property
    def is_offline(self) -> bool:
        return constants.is_offline_mode() if self.offline is None else self.offline

    @property
    def hub_cache(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir is not None else Path(constants.HF_HUB_CACHE)

    @property
    def base_url(self) -> str:
        return (self.endpoint or constants.ENDPOINT).rstrip("/")

    def storage_folder(self, repo_id: str) -> Path:
        return self.hub_cache / repo_folder_name(repo_id=repo_id, repo_type="model")


DEFAULT_OPTIONS = HubOptions()


@contextlib.contextmanager
def hub_errors(repo_id: str, options: HubOptions) -> Iterator[None]:
    """Turn huggingface_hub and transport errors into the tool's one-line errors (every Hub call passes here, so
    the shared client is made stall-bounded first: :mod:`tuner.hub.client`)."""
    client.stall_bounded()
    try:
        yield
    except errors.GatedRepoError:
        raise GatedRepoError(repo_id) from None
    except errors.RepositoryNotFoundError:
        raise RepoNotFoundError(repo_id) from None
    except errors.RevisionNotFoundError:
        raise UsageError(f"revision not found in {repo_id}: check --revision (a branch, tag or commit)") from None
    except errors.RemoteEntryNotFoundError as exc:
        raise HubError(f"a file listed in {repo_id} is missing on the server ({exc.response.url}); "
                       "the repo changed while listing: run the command again") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise HubError(f"Hugging Face answered HTTP {status} for {repo_id}: try again later") from None
    except httpx2.TransportError as exc:
        why = client.overrun(exc)
        if why is not None:  # a bounded request (a look-up's) went over its time or bytes
            raise HubError(f"{repo_id}: {why}") from None
        raise HubUnreachableError(options.base_url, type(exc).__name__) from None
    except errors.LocalEntryNotFoundError as exc:
        raise HubUnreachableError(options.base_url, type(exc).__name__) from None


# -- quants -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoteFile:
    path: str  # inside the repo, e.g. "Q8_0/Model-Q8_0-00001-of-00002.gguf"
    size_bytes: int
    sha256: str | None  # the LFS hash; None for non-LFS files


@dataclass(frozen=True, slots=True)
class Quant:
    name: str  # e.g. "Q4_K_M", "UD-Q4_K_XL"
    files: tuple[RemoteFile, ...]  # split parts in order; one file when not split

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def first_file(self) -> RemoteFile:
        return self.files[0]

    @property
    def n_parts(self) -> int:
        return len(self.files)


@dataclass(frozen=True, slots=True)
class RepoQuants:
    repo_id: str
    revision: str
    commit: str | None
    quants: tuple[Quant, ...]
    from_cache: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(q.name for q in self.quants)

    def get(self, name: str | None) -> Quant:
        """The quant called ``name`` (case-insensitive); with None, Q4_K_M or the only one there is."""
        if name is None:
            if len(self.quants) == 1:
                return self.quants[0]
            name = DEFAULT_QUANT
        for q in self.quants:
            if q.name.upper() == name.upper():
                return q
        raise UnknownQuantError(self.repo_id, name, self.names, _example(self.names))


def quant_name(path: str) -> str:
    """The quant a GGUF file belongs to, from its file name, else its folder, else its stem."""
    name = path.rsplit("/", 1)[-1]
    split = split_name(name)
    stem = split[0] if split else name
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    for candidate in (stem, path.rsplit("/", 1)[0] if "/" in path else ""):
        found = _QUANT_RE.findall(candidate)
        if found:
            return str(found[-1]).upper()
    return stem


def group_quants(files: list[RemoteFile]) -> tuple[Quant, ...]:
    """Model GGUFs grouped into quants (split parts together), smallest first; projectors and imatrix left out."""
    groups: dict[str, list[tuple[int, int, RemoteFile]]] = {}
    for f in files:
        name = f.path.rsplit("/", 1)[-1].lower()
        if not name.endswith(".gguf") or "mmproj" in name or "imatrix" in name:
            continue
        split = split_name(f.path)
        key, part, count = split if split else (f.path, 1, 1)
        groups.setdefault(key, []).append((part, count, f))
    quants: list[Quant] = []
    seen: set[str] = set()
    for key, parts in groups.items():
        parts.sort(key=lambda p: p[0])
        if len(parts) != parts[0][1]:
            continue  # an incomplete split cannot be loaded
        name = quant_name(parts[0][2].path)
        if name.upper() in seen:
            name = key  # two files claim the same quant: keep them apart by path
        seen.add(name.upper())
        quants.append(Quant(name, tuple(p[2] for p in parts)))
    return tuple(sorted(quants, key=lambda q: (q.total_bytes, q.name)))


def list_quants(repo_id: str, *, revision: str = "main", options: HubOptions = DEFAULT_OPTIONS) -> RepoQuants:
    """Every quant in a repo with its files, sizes and LFS hashes (from the cache when offline)."""
    if options.is_offline:
        return cached_quants(repo_id, revision=revision, options=options)
    api = HfApi(endpoint=options.endpoint, token=options.token)
    with hub_errors(repo_id, options):
        info = api.model_info(repo_id, revision=revision)
        commit = info.sha or revision
        tree = api.list_repo_tree(repo_id, revision=commit, recursive=True)
        files = [
            RemoteFile(e.path, int(e.size), e.lfs.sha256 if e.lfs is not None else None)
            for e in tree
            if isinstance(e, RepoFile)
        ]
    return RepoQuants(repo_id, revision, info.sha, group_quants(files))


def cached_commit(repo_id: str, revision: str, options: HubOptions) -> str | None:
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    ref = options.storage_folder(repo_id) / "refs" / revision
    return ref.read_text().strip() if ref.is_file() else None


def cached_quants(repo_id: str, *, revision: str = "main", options: HubOptions = DEFAULT_OPTIONS) -> RepoQuants:
    """Quants whose files sit in the local Hugging Face cache for ``revision`` (complete splits only)."""
    commit = cached_commit(repo_id, revision, options)
    snapshot = options.storage_folder(repo_id) / "snapshots" / (commit or "")
    if commit is None or not snapshot.is_dir():
        raise HubError(
            f"{repo_id} is not in the Hugging Face cache ({options.hub_cache}): download it first "
            "(`moe-tune download REPO:QUANT` without --offline)"
        )
    files = []
    for path in sorted(snapshot.rglob("*.gguf")):
        if not path.exists():
            continue  # a dangling link: the blob was deleted
        blob = path.resolve().name
        files.append(RemoteFile(path.relative_to(snapshot).as_posix(), path.stat().st_size,
                                blob if _SHA256_RE.match(blob) else None))
    return RepoQuants(repo_id, revision, commit, group_quants(files), from_cache=True)
