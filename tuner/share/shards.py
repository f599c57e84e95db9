"""Consolidated shards: a pool's records gathered into Parquet files (read and written by pyarrow), so a look-up
reads what it needs of 100,000 records instead of 100,000 files.

Layout: ``shards/vram-<GiB>/<hash>.parquet``, one folder per VRAM class (a look-up reads only its card's class:
same card and siblings share it; ``vram-0`` holds CPU records). In a file, rows are sorted by model key (the
record's Hub repo, else its fingerprint's head) in row groups of :data:`ROW_GROUP_ROWS`. Each row's ``record`` is
the record's JSON, and it goes through the same gate as a file (:func:`tuner.share.gate.read_record`): the key
columns only choose what to read, never what is believed. ``account`` is the Hub account that brought the record
into the pool, as the keeper read it from the Hub when consolidating (:mod:`tuner.share.accounts` says when a
look-up believes it).

A shard is bytes a stranger may have written, so reading one is bounded in what it *decodes*, not only in what it
downloads (a 9.5 KB file of one dictionary-encoded 10 KB string in 200,000 rows decodes to 2 GB):

- the footer comes first, at most :data:`MAX_FOOTER_BYTES`; every row group holds at most :data:`ROW_GROUP_ROWS`
  rows, a file at most :data:`MAX_SHARD_ROWS`; the columns are strings;
- before pyarrow sees a column chunk, its bytes are fetched and its page headers walked (:mod:`tuner.share.pages`):
  no page decompresses to more than its bound, no encoding decodes to more than its bytes, no more values than
  rows. pyarrow reads only those checked bytes (:class:`_Checked`), nothing else of the file;
- string columns are read as dictionaries (``read_dictionary``): a value repeated in every row is held once;
- a look-up's ``max_decoded_bytes`` caps the record text it takes in, all shards together.

Records still come in one file per share (``records/``); whoever keeps the pool consolidates them
(:func:`build_shards`, ``scripts/consolidate_pool.py``) in one commit that adds the shards and deletes the files.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tuner.core.errors import ShardError
from tuner.share import pages
from tuner.share.gate import SharedRecord
from tuner.share.match import model_key, vram_class

FOLDER = "shards"
ROW_GROUP_ROWS = 512
MAX_SHARD_ROWS = 50_000
MAX_ROW_GROUPS = 2 * MAX_SHARD_ROWS // ROW_GROUP_ROWS  # a writer with smaller groups still fits
MAX_FOOTER_BYTES = 2**20  # a footer of 100 row groups of 8 columns with statistics is ~100 KB
TAIL_BYTES = 64 * 2**10  # what pyarrow reads first from a file's end
MAX_FOOTER_ITEMS = 20_000
MAX_KEY_CHUNK_BYTES = 2 * 2**20  # one row group's key column, decompressed (512 keys of a few hundred bytes)
MAX_RECORD_CHUNK_BYTES = 40 * 2**20  # one row group's record column: 512 records of at most 64 KiB, and slack
PATH = re.compile(r"shards/vram-(?P<gib>\d{1,4})/[A-Za-z0-9][A-Za-z0-9._-]{0,99}\.parquet")
KEYS = ("model_key", "head_sha256")
ROWS = ("record_id", "record")
ACCOUNT = "account"
SCHEMA = pa.schema([("model_key", pa.string()), ("head_sha256", pa.string()), ("record_id", pa.string()),
                    ("sharer", pa.string()), ("vram_class_gib", pa.int32()), ("engine_commit", pa.string()),
                    ("record", pa.string()), (ACCOUNT, pa.string())])


def row(record: SharedRecord, account: str | None = None) -> dict[str, Any]:
    model = record.model
    return {"model_key": model_key(model), "head_sha256": model.get("head_sha256"), "record_id": record.record_id,
            "sharer": record.data["sharer"], "vram_class_gib": vram_class(record.card["vram_total_bytes"]),
            "engine_commit": record.engine_commit,
            "record": json.dumps(record.data, sort_keys=True, separators=(",", ":")), ACCOUNT: account}


def build_shards(records: Iterable[SharedRecord], accounts: Mapping[str, str | None] | None = None) -> dict[str, bytes]:
    """Gated records as shard files: repo path → Parquet bytes (one record per id); ``accounts``: record id → the
    Hub account that brought it (None: unverified)."""
    by_class: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_class.setdefault(vram_class(r.card["vram_total_bytes"]), {}).setdefault(
            r.record_id, row(r, (accounts or {}).get(r.record_id)))
    out: dict[str, bytes] = {}
    for gib, rows in sorted(by_class.items()):
        ordered = sorted(rows.values(), key=lambda d: (d["model_key"], d["record_id"]))
        for start in range(0, len(ordered), MAX_SHARD_ROWS):
            sink = io.BytesIO()
            table = pa.Table.from_pylist(ordered[start:start + MAX_SHARD_ROWS], schema=SCHEMA)
            pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS, compression="zstd")
            data = sink.getvalue()
            out[f"{FOLDER}/vram-{gib}/{hashlib.sha256(data).hexdigest()[:16]}.parquet"] = data
    return out


@dataclass(frozen=True, slots=True)
class ShardRow:
    record_id: str
    raw: bytes  # the record's JSON, for the gate
    account: str | None  # the row's account column (what the keeper read from the Hub), None where it has none


@dataclass(frozen=True, slots=True)
class ShardRows:
    rows: int  # matching rows handed to ``take``
    row_groups: int
    row_groups_read: int  # whose record column was read
    left: int = 0  # matching rows not handed over (``take`` said stop, or the time was spent)
    decoded_bytes: int = 0  # record text taken in


class _Checked:
    """The parts of a shard that were fetched and checked, as the seekable file pyarrow reads: a read of anything
    else fails (pyarrow never decodes bytes that were not checked)."""

    def __init__(self, size: int) -> None:
        self.size, self._pos, self.closed = size, 0, False
        self._parts: dict[int, bytes] = {}

    def add(self, start: int, data: bytes) -> None:
        self._parts[start] = data

    def drop(self, start: int) -> None:
        self._parts.pop(start, None)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self.size}[whence] + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        for start, data in self._parts.items():
            if start <= self._pos and end <= start + len(data):
                out = data[self._pos - start:end - start]
                self._pos = end
                return out
        raise OSError(f"bytes {self._pos:,}..{end:,} of the shard were not checked")

    def close(self) -> None:
        self.closed = True


def _may_hold(stats: Any, keys: frozenset[str]) -> bool:
    if stats is None or not stats.has_min_max:
        return True
    return any(stats.min <= k <= stats.max for k in keys)


def read_rows(fetch: Callable[[int, int], bytes], size_bytes: int, keys: frozenset[str], sha_head: str | None,
              take: Callable[[ShardRow], bool], late: Callable[[], bool] = lambda: False) -> ShardRows:
    """Hand ``take`` the rows of one shard for a model (any of ``keys``, or a fingerprint head ``sha_head``;
    neither: every row), one row group at a time, until it answers False or ``late()``; ``fetch(start, end)`` gives
    the file's bytes. :class:`ShardError` when the file is not a shard this reader may decode."""
    try:
        return _read_rows(fetch, size_bytes, keys, sha_head, take, late)
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise ShardError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _footer(fetch: Callable[[int, int], bytes], size: int) -> _Checked:
    """The file's end, holding its whole footer (bounded before it is fetched)."""
    if size < 12:
        raise ValueError("not a Parquet file")
    tail = fetch(max(0, size - TAIL_BYTES), size)
    if len(tail) < 12 or tail[-4:] != b"PAR1":
        raise ValueError("not a Parquet file")
    footer = int.from_bytes(tail[-8:-4], "little")
    if footer > MAX_FOOTER_BYTES or footer + 12 > size:
        raise ValueError(f"a footer of {footer:,} bytes (at most {MAX_FOOTER_BYTES:,})")
    if footer + 8 > len(tail):
        tail = fetch(size - 8 - footer, size - len(tail)) + tail
    checked = _Checked(size)
    checked.add(size - len(tail), tail)
    return checked


def _chunk(fetch: Callable[[int, int], bytes], checked: _Checked, meta: Any, group: int, col: int,
           max_bytes: int) -> tuple[int, int]:
    """Fetch one column chunk of one row group and walk its page headers; (where it starts, what it decodes to)."""
    rg = meta.row_group(group)
    c = rg.column(col)
    start = c.data_page_offset
    # As pyarrow finds a chunk's start (ComputeColumnChunkRange): the dictionary page, where there is one, first.
    if c.has_dictionary_page and c.dictionary_page_offset and 0 < c.dictionary_page_offset < start:
        start = c.dictionary_page_offset
    length = c.total_compressed_size
    if start < 4 or length < 0 or start + length > checked.size or length > max_bytes:
        raise ValueError(f"row group {group}'s {meta.schema.column(col).name} is {length:,} bytes at {start:,} "
                         f"(at most {max_bytes:,}, inside the file)")
    data = fetch(start, start + length)
    if len(data) != length:
        raise ValueError(f"row group {group}'s {meta.schema.column(col).name} came short")
    cost = pages.chunk_cost(data, rows=rg.num_rows, max_page_bytes=max_bytes)
    if cost.uncompressed_bytes > max_bytes:
        raise ValueError(f"row group {group}'s {meta.schema.column(col).name} decodes to "
                         f"{cost.uncompressed_bytes:,} bytes (at most {max_bytes:,})")
    checked.add(start, data)
    return start, cost.uncompressed_bytes


def _strings(table: Any, name: str) -> list[str | None]:
    """A dictionary-read string column's values, row by row (each distinct value made a Python string once)."""
    values: list[str | None] = []
    for chunk in table.column(name).chunks:
        if not pa.types.is_dictionary(chunk.type):
            raise ValueError(f"column {name} was not read as a dictionary")
        words = chunk.dictionary.to_pylist()
        values += [None if i is None else words[i] for i in chunk.indices.to_pylist()]
    return values


def _read_rows(fetch: Callable[[int, int], bytes], size: int, keys: frozenset[str], sha_head: str | None,
               take: Callable[[ShardRow], bool], late: Callable[[], bool]) -> ShardRows:
    checked = _footer(fetch, size)
    wanted_columns = [*KEYS, *ROWS, ACCOUNT]
    # A footer is metadata a stranger wrote: its strings and lists are bounded before pyarrow allocates them.
    footer = pq.ParquetFile(checked, pre_buffer=False, thrift_string_size_limit=MAX_FOOTER_BYTES,
                            thrift_container_size_limit=MAX_FOOTER_ITEMS)
    present = [n for n in wanted_columns if n in footer.schema_arrow.names]
    # Every string column read as a dictionary: a value repeated in each row is decoded once, not once a row.
    pf = pq.ParquetFile(checked, pre_buffer=False, metadata=footer.metadata, read_dictionary=present)
    arrow = pf.schema_arrow
    missing = [c for c in (*KEYS, *ROWS) if c not in arrow.names]
    if missing:
        raise ShardError(f"no {', '.join(missing)} column")
    odd = [n for n in wanted_columns if n in arrow.names and not pa.types.is_dictionary(arrow.field(n).type)
           and not pa.types.is_string(arrow.field(n).type)]
    if odd:
        raise ShardError(f"column {odd[0]} is not text")
    meta = pf.metadata
    groups = list(range(meta.num_row_groups))
    rows_in = [meta.row_group(g).num_rows for g in groups]
    if len(groups) > MAX_ROW_GROUPS or any(n > ROW_GROUP_ROWS for n in rows_in) or sum(rows_in) > MAX_SHARD_ROWS:
        raise ShardError(f"{sum(rows_in):,} rows in {len(groups):,} row groups (at most {ROW_GROUP_ROWS} a row group, "
                         f"{MAX_SHARD_ROWS:,} a shard): not a shard this reader decodes")
    col = {name: meta.schema.names.index(name) for name in wanted_columns if name in meta.schema.names}
    every = not keys and sha_head is None  # every model (consolidating a pool)
    if sha_head is None and not every:  # rows are sorted by model key: its statistics rule row groups out
        groups = [g for g in groups if _may_hold(meta.row_group(g).column(col["model_key"]).statistics, keys)]
    wanted: dict[int, list[int]] = {}  # row group → rows in it
    for g in groups:
        if every:
            wanted[g] = list(range(rows_in[g]))
            continue
        starts = [_chunk(fetch, checked, meta, g, col[k], MAX_KEY_CHUNK_BYTES)[0] for k in KEYS]
        got = pf.read_row_group(g, columns=list(KEYS))
        for start in starts:
            checked.drop(start)
        model_keys, heads = _strings(got, "model_key"), _strings(got, "head_sha256")
        idx = [i for i, (k, h) in enumerate(zip(model_keys, heads, strict=True))
               if k in keys or (sha_head is not None and h == sha_head)]
        if idx:
            wanted[g] = idx
    handed = read = decoded = 0
    total = sum(len(idx) for idx in wanted.values())
    going = True
    for g, idx in wanted.items():
        if not going or late():
            break
        names = [*ROWS, *([ACCOUNT] if ACCOUNT in col else [])]
        starts = [_chunk(fetch, checked, meta, g, col[n], MAX_RECORD_CHUNK_BYTES)[0] for n in names]
        got = pf.read_row_group(g, columns=names)
        for start in starts:
            checked.drop(start)
        read += 1
        ids, texts = _strings(got, "record_id"), _strings(got, "record")
        accounts = _strings(got, ACCOUNT) if ACCOUNT in names else [None] * len(ids)
        del got
        for i in idx:
            text = texts[i] or ""
            decoded += len(text)
            handed += 1
            if not take(ShardRow(str(ids[i]), text.encode(), accounts[i])):
                going = False
                break
    return ShardRows(handed, meta.num_row_groups, read, total - handed, decoded)
