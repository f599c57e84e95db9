"""Hostile shards for the pool's tests and benchmarks (tests/share/test_attacks.py, scripts/bench_lookup_rss.py)."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def bomb(rows: int, row_group_rows: int, value_bytes: int, key: str, head: str) -> bytes:
    """A shard of ``rows`` rows whose record is one ``value_bytes`` string, dictionary-encoded: a few KiB of file
    that decodes to rows x value_bytes when read the plain way."""
    def same(text: str) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)), pa.array([text]))

    table = pa.table({"model_key": same(key), "head_sha256": same(head), "record_id": same("0" * 16),
                      "sharer": same("a" * 16), "vram_class_gib": pa.array(np.zeros(rows, dtype=np.int32)),
                      "engine_commit": same("0c1e570"), "record": same("x" * value_bytes)})
    sink = io.BytesIO()
    # store_schema=False: nothing in the file asks a reader for dictionaries; the plain read expands every row.
    pq.write_table(table, sink, row_group_size=row_group_rows, compression="zstd", store_schema=False)
    return sink.getvalue()
