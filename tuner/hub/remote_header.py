"""GGUF headers of Hub files without their tensor data: exact architecture facts before any download.

Each part's header is fetched with HTTP range requests that grow until the header is whole (a walk over
the header's length fields says how many bytes that is), then written into a *stand-in*: a sparse file of
the part's full size whose data region is a hole. Stand-ins keep the repo's file names side by side, so
``tuner.models.gguf_reader.inspect_model`` (the one GGUF header parser) reads a split quant from its first stand-in
exactly as from the downloaded files, and llama.cpp tools that only project memory can open them.
A quant already in the Hugging Face cache is read from there, with no network at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.file_download import hf_hub_url, repo_folder_name
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from tuner.core.errors import GGUFFormatError, HubError
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions, Quant, RemoteFile, hub_errors
from tuner.machine import paths
from tuner.machine.fileio import atomic_path
from tuner.models.gguf_reader import ModelInfo, header_end, inspect_model, local_header_bytes

HEADER_FIRST_BYTES = 256 * 1024
HEADER_MAX_BYTES = 256 * 2**20



@dataclass(frozen=True, slots=True)
class RemoteHeader:
    repo_id: str
    path: str  # inside the repo
    file_size_bytes: int
    header_bytes: int  # where tensor data starts
    bytes_read: int  # fetched over the network by this call (0 when served from a cache)
    local_path: Path  # the stand-in, or the downloaded file when the cache holds it


@dataclass(frozen=True, slots=True)
class QuantHeaders:
    repo_id: str
    quant: Quant
    parts: tuple[RemoteHeader, ...]

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.parts)

    @property
    def first_path(self) -> Path:
        return self.parts[0].local_path

    def model_info(self) -> ModelInfo:
        """Architecture and per-tensor bytes of the whole quant, every split part included."""
        return inspect_model(self.first_path)


def stand_ins_dir() -> Path:
    return paths.cache_root() / "hub-headers"


def read_quant_headers(
    repo_id: str, quant: Quant, *, commit: str, options: HubOptions = DEFAULT_OPTIONS,
    first_bytes: int = HEADER_FIRST_BYTES,
) -> QuantHeaders:
    """The header of every part of ``quant`` (the first part carries the metadata, each part its tensors)."""
    snapshot = options.storage_folder(repo_id) / "snapshots" / commit
    cached = [snapshot / f.path for f in quant.files]
    if all(p.is_file() and p.stat().st_size == f.size_bytes for p, f in zip(cached, quant.files, strict=True)):
        parts = tuple(RemoteHeader(repo_id, f.path, f.size_bytes, local_header_bytes(p), 0, p)
                      for p, f in zip(cached, quant.files, strict=True))
    else:
        parts = tuple(read_remote_header(repo_id, f, commit=commit, options=options, first_bytes=first_bytes)
                      for f in quant.files)
    return QuantHeaders(repo_id, quant, parts)


def read_remote_header(
    repo_id: str, file: RemoteFile, *, commit: str, options: HubOptions = DEFAULT_OPTIONS,
    first_bytes: int = HEADER_FIRST_BYTES,
) -> RemoteHeader:
    """Fetch one file's GGUF header into its stand-in (reused when already there) and return where it is."""
    stand_in = stand_ins_dir() / repo_folder_name(repo_id=repo_id, repo_type="model") / commit / file.path
    if stand_in.is_file() and stand_in.stat().st_size == file.size_bytes:
        known = local_header_bytes(stand_in)
        if known:
            return RemoteHeader(repo_id, file.path, file.size_bytes, known, 0, stand_in)
    if options.is_offline:
        raise HubError(f"the header of {repo_id}/{file.path} is not cached and offline mode is on: "
                       "run once without --offline")
    url = hf_hub_url(repo_id, file.path, revision=commit, endpoint=options.endpoint)
    headers = build_hf_headers(token=options.token)
    limit = min(file.size_bytes, HEADER_MAX_BYTES)
    buf = bytearray()
    want = min(first_bytes, limit)
    while True:
        with hub_errors(repo_id, options):
            buf += _fetch_range(url, headers, len(buf), want)
        end = header_end(bytes(buf))
        if end is not None and end <= len(buf):
            _write_stand_in(stand_in, bytes(buf[:end]), file.size_bytes)
            return RemoteHeader(repo_id, file.path, file.size_bytes, end, len(buf), stand_in)
        if end is None:
            raise GGUFFormatError(Path(f"{repo_id}/{file.path}"), "not a GGUF v2/v3 header")
        if end > limit or len(buf) >= limit:
            raise GGUFFormatError(Path(f"{repo_id}/{file.path}"), f"no complete header in {len(buf)} bytes")
        want = min(max(len(buf) * 2, end), limit)


def _fetch_range(url: str, headers: dict[str, str], start: int, end: int, timeout_s: float | None = None) -> bytes:
    """Bytes [start, end) of the file; stops reading at ``end`` even if the server ignores Range, and refuses a
    whole-file answer to a range that starts later (the bytes before ``start`` would be read for nothing: a
    multi-GiB file for a header). ``timeout_s``: how long any one step of the exchange may stall (None: the shared
    client's, :data:`tuner.hub.client.STALL_S`)."""
    want = end - start
    got = bytearray()
    wait: dict[str, Any] = {"timeout": timeout_s} if timeout_s else {}
    with get_session().stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end - 1}"},
                              follow_redirects=True, **wait) as response:
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        if response.status_code == 200 and start > 0:
            raise HubError(f"the server ignored Range: it answered {url} whole when asked for bytes {start:,} on")
        for chunk in response.iter_bytes():
            got += chunk
            if len(got) >= want:
                break
    return bytes(got[:want])


def _write_stand_in(path: Path, header: bytes, size_bytes: int) -> None:
    """The header, then a hole up to the full size (sparse: costs the header's bytes of disk)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(header)
        f.truncate(size_bytes)
