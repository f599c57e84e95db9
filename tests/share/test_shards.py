"""Consolidated shards (tuner/share/shards.py): Parquet written and read by pyarrow, read in part: the footer, the
key columns, then the record column of only the row groups that hold the model."""

from __future__ import annotations

import io
import json
import random
from dataclasses import replace

import pytest

from tests.share.test_gate import good, raw
from tuner.core.errors import ShardError
from tuner.share import shards
from tuner.share.gate import read_record


class CountingFile(io.BytesIO):
    """A file that counts the bytes a reader takes from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.bytes_read = 0

    def read(self, n: int | None = -1) -> bytes:
        got = super().read(n)
        self.bytes_read += len(got)
        return got


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
    f = CountingFile(data)
    got = shards.read_rows(f, frozenset({"hub:org/model017-gguf"}), None, max_rows=10_000)
    assert len(got.rows) == 100 and {rid[:8] for rid, _ in got.rows} == {f"{17:08x}"}
    assert got.row_groups == 16 and got.row_groups_read == 1  # 8,000 rows in groups of 512; model 17 in one
    assert f.bytes_read < len(data) / 4, (f.bytes_read, len(data))
    assert read_record(got.rows[0][1], got.rows[0][0]).model["hub_repo"] == "org/model017-GGUF"
    # A fingerprint query cannot use the sort: it reads the key columns of every group, the records of one.
    head = shards.read_rows(CountingFile(data), frozenset(), "f" * 64, max_rows=10)
    assert head.rows == () and head.row_groups_read == 0
    capped = shards.read_rows(CountingFile(data), frozenset({"hub:org/model017-gguf"}), None, max_rows=30)
    assert len(capped.rows) == 30 and capped.left == 70


def test_a_file_that_is_not_a_shard_is_one_error():
    for data, why in ((b"not parquet", "Parquet"), (b"PAR1" + b"\0" * 64 + b"PAR1", "")):
        with pytest.raises(ShardError) as exc:
            shards.read_rows(io.BytesIO(data), frozenset({"hub:x/y"}), None, 10)
        assert "\n" not in str(exc.value) and why in str(exc.value)
