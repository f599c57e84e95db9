"""Reading a pool: the gated records of a dataset repo that may speak of one model on one card, read within bounds
however the repo is stuffed. Fetching only; which records match, and what they agree on, is
:mod:`tuner.share.match` and :mod:`tuner.share.lookup`'s.

Two sources, both through the gate (:mod:`tuner.share.gate`):

- ``shards/``: consolidated Parquet files (:mod:`tuner.share.shards`), only the card's VRAM class folder, only
  the row groups that hold the model; at most :data:`MAX_SHARDS` files and :data:`MAX_SHARD_BYTES` read.
- ``records/``: one file per share, not yet consolidated. A file's name says nothing of its model, so the files
  are read in a random sample of at most :data:`MAX_FILES` (never in name order, which whoever names files
  would choose), a name that is not 16 hex digits or a file listed above the gate's size never fetched.

Everything within :data:`DEADLINE_S` seconds. What is not read is said in one line; every record, name, shard or
download that fails is one line, and the others are still read.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tuner.core.errors import RecordError, TunerError
from tuner.hub import client
from tuner.hub import records as hub
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions
from tuner.share.gate import MAX_RECORD_BYTES, SharedRecord, read_record, refusal, shown

FOLDER = "records"
RECORD_PATH = re.compile(r"records/(?P<id>[0-9a-f]{16})\.json")
MAX_LISTED = 20_000  # names listed from records/ (the Hub lists 1,000 a page)
MAX_FILES = 1_000  # record files read by one look-up
MAX_SHARDS = 64
MAX_SHARD_BYTES = 256 * 2**20  # read from shards by one look-up, all shards together
MAX_SHARD_ROWS = 20_000  # rows of one look-up's model taken from shards
DEADLINE_S = 60.0
WORKERS = 8


@dataclass(frozen=True, slots=True)
class PoolQuery:
    """What a look-up wants, so shards can be read in part (record files are read whole, and matched after)."""

    vram_class_gib: int | None = None  # None: every class
    keys: frozenset[str] = frozenset()  # model keys (tuner.share.match.model_key); empty: every model
    sha_head: str | None = None  # a local file's fingerprint head


@dataclass(frozen=True, slots=True)
class Fetched:
    repo_id: str
    commit: str
    records: tuple[SharedRecord, ...]
    skipped: tuple[str, ...]  # one line per record, name, shard or download that failed, and what was not read
    bytes_read: int = 0
    files_read: int = 0
    shard_rows_read: int = 0
    from_files: tuple[str, ...] = ()  # ids of the records read from records/ files (not yet in a shard)


@dataclass
class _Reading:
    repo_id: str
    commit: str
    options: HubOptions
    deadline: float
    bounds: Bounds
    records: dict[str, SharedRecord]
    skipped: list[str]
    bytes_read: int = 0
    files_read: int = 0
    shard_rows: int = 0
    from_files: list[str] = field(default_factory=list)

    def gate(self, raw: bytes, record_id: str) -> bool:
        if record_id in self.records:
            return False  # the same record (content-addressed) consolidated and still in records/: read once
        try:
            self.records[record_id] = read_record(raw, record_id)
        except RecordError as exc:
            self.skipped.append(str(exc))
            return False
        return True


@dataclass(frozen=True, slots=True)
class Bounds:
    """How much one read of a pool may take (a look-up's; consolidating a pool takes more)."""

    files: int = MAX_FILES
    listed: int = MAX_LISTED
    shard_rows: int = MAX_SHARD_ROWS
    shard_bytes: int = MAX_SHARD_BYTES
    seconds: float = DEADLINE_S


def fetch(repo_id: str, options: HubOptions = DEFAULT_OPTIONS, query: PoolQuery = PoolQuery(), *,
          rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
          bounds: Bounds | None = None) -> Fetched:
    """The gated records of ``repo_id`` that ``query`` may want; the rest named in ``skipped``."""
    hub.check_repo_id(repo_id)
    b = bounds or Bounds(MAX_FILES, MAX_LISTED, MAX_SHARD_ROWS, MAX_SHARD_BYTES, DEADLINE_S)  # read when called
    reading = _Reading(repo_id, hub.repo_commit(repo_id, options), options, clock() + b.seconds, b, {}, [])
    _from_shards(reading, query, clock)
    _from_files(reading, rng or random.Random(), clock)
    return Fetched(repo_id, reading.commit, tuple(sorted(reading.records.values(), key=lambda r: r.record_id)),
                   tuple(reading.skipped), reading.bytes_read, reading.files_read, reading.shard_rows,
                   tuple(sorted(reading.from_files)))


def _from_shards(reading: _Reading, query: PoolQuery, clock: Callable[[], float]) -> None:
    from tuner.share import shards

    b = reading.bounds
    listing = hub.list_files(reading.repo_id, reading.commit, shards.FOLDER, ".parquet", reading.options,
                             max_entries=b.listed, late=lambda: clock() > reading.deadline)
    if listing.stalled:
        reading.skipped.append(f"shards/ was listed in part ({len(listing.files):,} files): the server sent no "
                               f"further page for {client.STALL_S:.0f} s")
    wanted = []
    for f in listing.files:
        m = shards.PATH.fullmatch(f.path)
        if m is None:
            reading.skipped.append(f"shard {shown(f.path, 80)} skipped: a shard is shards/vram-<GiB>/<name>.parquet")
        elif query.vram_class_gib is None or int(m["gib"]) == query.vram_class_gib:
            wanted.append(f)
    if len(wanted) > MAX_SHARDS:
        reading.skipped.append(f"{len(wanted) - MAX_SHARDS} of {len(wanted)} shards for this card were not read "
                               f"(at most {MAX_SHARDS} a look-up)")
    spent = 0
    for f in wanted[:MAX_SHARDS]:
        if clock() > reading.deadline:
            reading.skipped.append(f"shard {shown(f.path, 80)} and those after it were not read: the look-up's "
                                   f"{b.seconds:.0f} s were spent")
            break
        source = hub.RangeFile(reading.repo_id, f.path, reading.commit, f.size_bytes, b.shard_bytes - spent,
                               reading.options)
        try:
            got = shards.read_rows(source, query.keys, query.sha_head, b.shard_rows - reading.shard_rows)
        except TunerError as exc:  # ShardError, and the Hub's errors
            reading.skipped.append(f"shard {shown(f.path, 80)} skipped: {shown(exc, 200)}")
            continue
        finally:
            spent += source.bytes_read
            reading.bytes_read += source.bytes_read
        reading.shard_rows += len(got.rows)
        if got.left:
            reading.skipped.append(f"{got.left:,} rows of {shown(f.path, 80)} were not read (at most "
                                   f"{b.shard_rows:,} rows a look-up)")
        for rid, raw in got.rows:
            reading.gate(raw, rid)


def _from_files(reading: _Reading, rng: random.Random, clock: Callable[[], float]) -> None:
    b = reading.bounds
    listing = hub.list_files(reading.repo_id, reading.commit, FOLDER, "", reading.options, max_entries=b.listed,
                             late=lambda: clock() > reading.deadline)
    if listing.stalled:
        reading.skipped.append(f"records/ was listed in part ({len(listing.files):,} files): the server sent no "
                               f"further page for {client.STALL_S:.0f} s")
    elif listing.cut:
        reading.skipped.append(f"records/ holds more than the {len(listing.files):,} files listed (at most "
                               f"{b.listed:,}, within {b.seconds:.0f} s): the pool needs consolidating")
    todo = []
    for f in listing.files:
        m = RECORD_PATH.fullmatch(f.path)
        name = f.path.removeprefix(f"{FOLDER}/")
        if m is None:
            reading.skipped.append(str(refusal(name, "a record file is records/<16 hex digits>.json")))
        elif f.size_bytes > MAX_RECORD_BYTES:  # never downloaded
            reading.skipped.append(str(refusal(m["id"], f"{f.size_bytes:,} bytes, more than the "
                                                        f"{MAX_RECORD_BYTES:,} a record may hold")))
        elif m["id"] not in reading.records:
            todo.append(m["id"])
    rng.shuffle(todo)
    if len(todo) > b.files:
        reading.skipped.append(f"{len(todo) - b.files:,} of {len(todo):,} record files were not read: a random "
                               f"{b.files:,} were (the pool needs consolidating)")
        todo = todo[:b.files]

    def download(rid: str) -> tuple[str, bytes | str]:
        try:
            return rid, hub.read_file(reading.repo_id, f"{FOLDER}/{rid}.json", reading.commit, MAX_RECORD_BYTES,
                                      reading.options)
        except TunerError as exc:
            return rid, f"download failed ({exc})"

    with ThreadPoolExecutor(WORKERS) as pool:
        for start in range(0, len(todo), WORKERS * 4):
            if clock() > reading.deadline:
                reading.skipped.append(f"{len(todo) - start:,} record files were not read: the look-up's "
                                       f"{b.seconds:.0f} s were spent")
                break
            for rid, got in pool.map(download, todo[start:start + WORKERS * 4]):
                if isinstance(got, str):
                    reading.skipped.append(str(refusal(rid, shown(got, 200))))
                    continue
                reading.files_read += 1
                reading.bytes_read += len(got)
                if reading.gate(got, rid):
                    reading.from_files.append(rid)
