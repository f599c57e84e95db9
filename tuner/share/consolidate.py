"""Consolidating a pool, its keeper's job: every record of ``records/`` and of the old shards, through the gate,
written again as shards (:mod:`tuner.share.shards`) in one commit that also deletes the record files it took in
and the shards it replaces. A refused record file stays where it is (a record from a newer schema is readable by a
newer moe-tune); the keeper may delete those by hand. ``scripts/consolidate_pool.py`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.hub import records as hub
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions
from tuner.share import pool, shards

# The keeper reads the whole pool, not a look-up's share of it.
KEEPER = pool.Bounds(files=10**6, listed=10**6, shard_rows=10**7, shard_bytes=16 * 2**30, seconds=6 * 3600.0,
                     kept_bytes=16 * 2**30, request_s=600.0, response_bytes=2**30)


@dataclass(frozen=True, slots=True)
class Consolidated:
    shards: dict[str, int]  # new shard path → bytes
    records: int  # in the new shards
    files_taken: tuple[str, ...]  # record files the commit deletes (now in a shard)
    skipped: tuple[str, ...]
    commit_url: str | None  # None: dry run


def consolidate(repo_id: str, options: HubOptions = DEFAULT_OPTIONS, *, dry_run: bool = False) -> Consolidated:
    got = pool.fetch(repo_id, options, bounds=KEEPER)
    built = shards.build_shards(got.records, got.accounts)  # who brought each record, as the Hub said
    old = hub.list_files(repo_id, got.commit, shards.FOLDER, ".parquet", options, max_entries=KEEPER.listed,
                         late=lambda: False)
    taken = tuple(f"{pool.FOLDER}/{rid}.json" for rid in got.from_files)
    url = None
    if not dry_run:
        deletes = [f.path for f in old.files if f.path not in built] + list(taken)
        url = hub.commit_files(repo_id, built, deletes, f"moe-tune: {len(got.records):,} records consolidated into "
                                                        f"{len(built)} shard(s)", options)
    return Consolidated({p: len(b) for p, b in built.items()}, len(got.records), taken, got.skipped, url)
