"""Consolidated shards (tuner/share/shards.py): Parquet written and read by pyarrow, read in part: the footer, the
key columns, then the record column of only the row groups that hold the model."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tests.share.test_gate import good, raw
from tuner.core.errors import ShardError
from tuner.share import shards
from tuner.share.gate import read_record


class Counting:
    """A shard's bytes, fetched by range as the pool fetches them, each range counted."""

    def __init__(self, data: bytes) -> None:
        self.data, self.bytes_read, self.ranges = data, 0, []

    def __call__(self, start: int, end: int) -> bytes:
        self.ranges.append((start, end))
        got = self.data[start:end]
        self.bytes_read += len(got)
        return got


def read(data: bytes, keys: frozenset[str], sha_head: str | None = None, max_rows: int = 10_000):
    """The rows ``read_rows`` hands over (at most ``max_rows``), the stats, and the fetcher."""
    rows: list[shards.ShardRow] = []

    def take(row: shards.ShardRow) -> bool:
        rows.append(row)
        return len(rows) < max_rows

    fetch = Counting(data)
    return rows, shards.read_rows(fetch, len(data), keys, sha_head, take), fetch


def many(n_models: int, per_model: int):
    """Records of many models, each with some text that does not compress (as real reasons and figures do not)."""
    base = read_record(raw(good("a" * 16)), "0" * 16)
    rng = random.Random(0)
    out = []
    for m in range(n_models):
        for i in range(per_model):
            data = json.loads(json.dumps(base.data))
            data["model"]["hub_repo"] = f"org/model{m:03d}-GGUF"
            data["printed"]["why"] = f"record {m}-{i} " + "".join(rng.choices("0123456789abcdef", k=300))
            out.append(replace(base, record_id=f"{m:08x}{i:08x}", data=data))
    return out


def test_a_look_up_reads_the_keys_then_only_the_row_groups_of_its_model():
    built = shards.build_shards(many(n_models=80, per_model=100))
    [(path, data)] = built.items()
    assert shards.PATH.fullmatch(path) and path.startswith("shards/vram-12/")
    rows, got, fetch = read(data, frozenset({"hub:org/model017-gguf"}))
    assert len(rows) == got.rows == 100 and {r.record_id[:8] for r in rows} == {f"{17:08x}"}
    assert got.row_groups == 16 and got.row_groups_read == 1  # 8,000 rows in groups of 512; model 17 in one
    assert fetch.bytes_read < len(data) / 4, (fetch.bytes_read, len(data))
    assert read_record(rows[0].raw, rows[0].record_id).model["hub_repo"] == "org/model017-GGUF"
    # A fingerprint query cannot use the sort: it reads the key columns of every group, the records of none.
    none, head, _ = read(data, frozenset(), "f" * 64)
    assert none == [] and head.row_groups_read == 0
    capped_rows, capped, _ = read(data, frozenset({"hub:org/model017-gguf"}), max_rows=30)
    assert len(capped_rows) == 30 and capped.left == 70


def test_a_file_that_is_not_a_shard_is_one_error():
    for data, why in ((b"not parquet", "Parquet"), (b"PAR1" + b"\0" * 64 + b"PAR1", "")):
        with pytest.raises(ShardError) as exc:
            read(data, frozenset({"hub:x/y"}))
        assert "\n" not in str(exc.value) and why in str(exc.value)


def _shard(records_text: list[str], **write: object) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"model_key": "hub:o/m-gguf", "head_sha256": None, "record_id": f"{i:016x}", "sharer": None,
             "vram_class_gib": 12, "engine_commit": "0c1e570", "record": t, "account": None}
            for i, t in enumerate(records_text)]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=shards.SCHEMA), sink, row_group_size=512, **write)
    return sink.getvalue()


def test_an_encoding_that_decodes_past_its_bytes_is_refused_before_pyarrow_decodes_it():
    """DELTA_BYTE_ARRAY keeps a prefix shared by consecutive strings once: 512 records sharing 60 KB are a few KB of
    pages that decode to 30 MB. Its page header names the encoding; the walk refuses it, nothing is decoded."""
    data = _shard(["x" * 60_000 + f"{i}" for i in range(512)], use_dictionary=False,
                  column_encoding={"record": "DELTA_BYTE_ARRAY"}, compression="zstd")
    assert len(data) < 200_000
    with pytest.raises(ShardError, match="a page in encoding 7, whose values may decode to more than its bytes"):
        read(data, frozenset({"hub:o/m-gguf"}))


def test_a_row_group_whose_pages_decode_past_the_bound_is_refused(monkeypatch):
    data = _shard(["y" * 2_000 + f"{i}" for i in range(100)], compression="zstd")
    assert read(data, frozenset({"hub:o/m-gguf"}))[1].rows == 100
    monkeypatch.setattr(shards, "MAX_RECORD_CHUNK_BYTES", 64 * 1024)  # 100 records of 2 KB decode to ~200 KB
    with pytest.raises(ShardError, match=r"(page that decompresses to|decodes to) [\d,]+ bytes \(at most 65,536\)"):
        read(data, frozenset({"hub:o/m-gguf"}))
