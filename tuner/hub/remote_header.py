"""GGUF headers of Hub files without their tensor data: exact architecture facts before any download.

Each part's header is fetched with HTTP range requests that grow until the header is whole (a walk over
the header's length fields says how many bytes that is), then written into a *stand-in*: a sparse file of
the part's full size whose data region is a hole. Stand-ins keep the repo's file names side by side, so
``tuner.models.gguf_reader.inspect_model`` (the one GGUF header parser) reads a split quant from its first stand-in
exactly as from the downloaded files, and llama.cpp tools that only project memory can open them.
A quant already in the Hugging Face cache is read from there, with no network at all.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
from huggingface_hub.file_download import hf_hub_url, repo_folder_name
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from tuner.core.errors import GGUFFormatError
from tuner.hub.repos import DEFAULT_OPTIONS, HubError, HubOptions, Quant, RemoteFile, hub_errors
from tuner.machine import paths
from tuner.models.gguf_reader import ModelInfo, inspect_model

HEADER_FIRST_BYTES = 256 * 1024
HEADER_MAX_BYTES = 256 * 2**20

_SCALAR_BYTES = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}  # GGUF value type → bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


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
        parts = tuple(RemoteHeader(repo_id, f.path, f.size_bytes, _local_header_bytes(p), 0, p)
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
        known = _local_header_bytes(stand_in)
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


def header_end(buf: bytes) -> int | None:
    """Where tensor data starts, from the header's length fields.

    A value above ``len(buf)`` means more bytes are needed (exactly that many once the tensor list is
    reached); None means this is not a little-endian GGUF v2/v3 header.
    """
    need_more = len(buf) + 1
    try:
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
    except struct.error:
        return need_more
    if magic != gguf.GGUF_MAGIC or version not in (2, 3):
        return None
    off, alignment = 24, gguf.GGUF_DEFAULT_ALIGNMENT
    try:
        for _ in range(n_kv):
            (key_len,) = struct.unpack_from("<Q", buf, off)
            key = buf[off + 8:off + 8 + key_len]
            off += 8 + key_len
            (vtype,) = struct.unpack_from("<I", buf, off)
            if key == b"general.alignment" and vtype == _UINT32:
                (alignment,) = struct.unpack_from("<I", buf, off + 4)
            off = _skip_value(buf, off + 4, vtype)
        for _ in range(n_tensors):
            (name_len,) = struct.unpack_from("<Q", buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off + 8 + name_len)
            off += 8 + name_len + 4 + 8 * n_dims + 4 + 8
    except struct.error:
        return max(need_more, off)
    except ValueError:
        return None
    return off + (-off % max(alignment, 1))


def _skip_value(buf: bytes, off: int, vtype: int) -> int:
    if vtype in _SCALAR_BYTES:
        return off + _SCALAR_BYTES[vtype]
    if vtype == _STRING:
        (length,) = struct.unpack_from("<Q", buf, off)
        return off + 8 + length
    if vtype == _ARRAY:
        sub_type, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if sub_type in _SCALAR_BYTES:
            return off + count * _SCALAR_BYTES[sub_type]
        for _ in range(count):
            off = _skip_value(buf, off, sub_type)
        return off
    raise ValueError(f"unknown GGUF value type {vtype}")


def _local_header_bytes(path: Path) -> int:
    """Header size of a local GGUF (stand-in or full file), 0 when it is not a whole GGUF header."""
    size = path.stat().st_size
    want = min(HEADER_FIRST_BYTES, size)
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            buf = f.read(want)
            end = header_end(buf)
            if end is None:
                return 0
            if end <= len(buf):
                return end
            if want >= min(size, HEADER_MAX_BYTES):
                return 0
            want = min(max(want * 2, end), size, HEADER_MAX_BYTES)


def _fetch_range(url: str, headers: dict[str, str], start: int, end: int) -> bytes:
    """Bytes [start, end) of the file; stops reading even if the server ignores Range."""
    want = end - start
    got = bytearray()
    with get_session().stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end - 1}"},
                              follow_redirects=True) as response:
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        skip = start if response.status_code == 200 else 0
        for chunk in response.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            got += chunk
            if len(got) >= want:
                break
    return bytes(got[:want])


def _write_stand_in(path: Path, header: bytes, size_bytes: int) -> None:
    """The header, then a hole up to the full size (sparse: costs the header's bytes of disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.truncate(size_bytes)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
