"""Consolidated shards: a pool's records gathered into Parquet files (read and written by pyarrow), so a look-up
reads what it needs of 100,000 records instead of 100,000 files.

Layout: ``shards/vram-<GiB>/<hash>.parquet``, one folder per VRAM class (a look-up reads only its card's class:
same card and siblings share it; ``vram-0`` holds CPU records). In a file, rows are sorted by model key (the
record's Hub repo, else its fingerprint's head) in row groups of :data:`ROW_GROUP_ROWS`. A look-up reads the
footer, then the two small key columns of the row groups whose statistics may hold its model, then the record
column of only the row groups that do. Each row's ``record`` is the record's JSON, and it goes through the same
gate as a file (:func:`tuner.share.gate.read_record`): the key columns only choose what to read, never what is
believed.

Records still come in one file per share (``records/``); whoever keeps the pool consolidates them
(:func:`build_shards`, ``scripts/consolidate_pool.py``) in one commit that adds the shards and deletes the files.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tuner.core.errors import ShardError
from tuner.share.gate import SharedRecord
from tuner.share.match import model_key, vram_class

FOLDER = "shards"
ROW_GROUP_ROWS = 512
MAX_SHARD_ROWS = 50_000
MAX_FOOTER_BYTES = 16 * 2**20
MAX_FOOTER_ITEMS = 200_000
PATH = re.compile(r"shards/vram-(?P<gib>\d{1,4})/[A-Za-z0-9][A-Za-z0-9._-]{0,99}\.parquet")
KEYS = ("model_key", "head_sha256")
ROWS = ("record_id", "record")
SCHEMA = pa.schema([("model_key", pa.string()), ("head_sha256", pa.string()), ("record_id", pa.string()),
                    ("sharer", pa.string()), ("vram_class_gib", pa.int32()), ("engine_commit", pa.string()),
                    ("record", pa.string())])


def row(record: SharedRecord) -> dict[str, Any]:
    model = record.model
    return {"model_key": model_key(model), "head_sha256": model.get("head_sha256"), "record_id": record.record_id,
            "sharer": record.data["sharer"], "vram_class_gib": vram_class(record.card["vram_total_bytes"]),
            "engine_commit": record.engine_commit,
            "record": json.dumps(record.data, sort_keys=True, separators=(",", ":"))}


def build_shards(records: Iterable[SharedRecord]) -> dict[str, bytes]:
    """Gated records as shard files: repo path → Parquet bytes (one record per id)."""
    by_class: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_class.setdefault(vram_class(r.card["vram_total_bytes"]), {}).setdefault(r.record_id, row(r))
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
class ShardRows:
    rows: tuple[tuple[str, bytes], ...]  # (record id, record bytes) of the rows whose keys match
    row_groups: int
    row_groups_read: int  # whose record column was read
    left: int = 0  # matching rows beyond ``max_rows``, not read


def _may_hold(stats: Any, keys: frozenset[str]) -> bool:
    if stats is None or not stats.has_min_max:
        return True
    return any(stats.min <= k <= stats.max for k in keys)


def read_rows(source: Any, keys: frozenset[str], sha_head: str | None, max_rows: int) -> ShardRows:
    """The rows of one shard for a model (any of ``keys``, or a fingerprint head ``sha_head``; neither: every row), at
    most ``max_rows``; :class:`ShardError` when the file is not a shard this reader can read."""
    try:
        return _read_rows(source, keys, sha_head, max_rows)
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
        raise ShardError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _read_rows(source: Any, keys: frozenset[str], sha_head: str | None, max_rows: int) -> ShardRows:
    # A footer is metadata a stranger wrote: its strings and lists are bounded before pyarrow allocates them.
    pf = pq.ParquetFile(source, pre_buffer=True, thrift_string_size_limit=MAX_FOOTER_BYTES,
                        thrift_container_size_limit=MAX_FOOTER_ITEMS)
    names = pf.schema_arrow.names
    missing = [c for c in (*KEYS, *ROWS) if c not in names]
    if missing:
        raise ShardError(f"no {', '.join(missing)} column")
    meta = pf.metadata
    groups = list(range(meta.num_row_groups))
    every = not keys and sha_head is None  # every model (consolidating a pool)
    if sha_head is None and not every:  # rows are sorted by model key: its statistics rule row groups out
        col = names.index("model_key")
        groups = [g for g in groups if _may_hold(meta.row_group(g).column(col).statistics, keys)]
    if not groups:
        return ShardRows((), meta.num_row_groups, 0)
    table = pf.read_row_groups(groups, columns=list(KEYS))
    model_keys, heads = table.column("model_key").to_pylist(), table.column("head_sha256").to_pylist()
    wanted: dict[int, list[int]] = {}  # row group → rows in it
    offset = 0
    for g in groups:
        n = meta.row_group(g).num_rows
        for i in range(offset, offset + n):
            if every or model_keys[i] in keys or (sha_head is not None and heads[i] == sha_head):
                wanted.setdefault(g, []).append(i - offset)
        offset += n
    rows: list[tuple[str, bytes]] = []
    read = 0
    total = sum(len(idx) for idx in wanted.values())
    for g, idx in wanted.items():
        if len(rows) >= max_rows:
            break
        got = pf.read_row_group(g, columns=list(ROWS))
        ids, texts = got.column("record_id").to_pylist(), got.column("record").to_pylist()
        read += 1
        for i in idx[:max_rows - len(rows)]:
            rows.append((str(ids[i]), texts[i].encode() if isinstance(texts[i], str) else b""))
    return ShardRows(tuple(rows), meta.num_row_groups, read, total - len(rows))
